//! Reconnect pacing: exponential backoff with full jitter (each delay drawn
//! uniformly from zero to the current ceiling), so thousands of agents that
//! lost the hub at the same moment come back spread out, not as a stampede.

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration) -> Self {
        Self {
            base,
            cap,
            attempt: 0,
        }
    }

    /// The ceiling for the next delay.
    pub fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(20)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The next delay, drawn with `rand01` in [0, 1).
    pub fn next_with(&mut self, rand01: f64) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        ceiling.mul_f64(rand01.clamp(0.0, 1.0))
    }

    /// The next delay, with the thread's random generator.
    pub fn next_delay(&mut self) -> Duration {
        self.next_with(rand::random::<f64>())
    }

    /// After a connection that worked: start from the bottom again.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_up_to_the_cap_and_jitter_stays_below_it() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let ceilings: Vec<_> = (0..8)
            .map(|_| {
                let c = b.ceiling();
                let d = b.next_with(0.999);
                assert!(d <= c);
                c.as_millis()
            })
            .collect();
        assert_eq!(ceilings, vec![100, 200, 400, 800, 1600, 2000, 2000, 2000]);
        b.reset();
        assert_eq!(b.ceiling(), Duration::from_millis(100));
        assert_eq!(b.next_with(0.0), Duration::ZERO);
    }
}
