//! quinn's BBR, held steady through its round-trip probe.
//!
//! BBR (v1, as quinn has it) drops its window to three quarters of its
//! estimate of the path's bandwidth-delay product for 200 ms whenever it
//! sends at full rate and has not probed for 10 s: at the first bulk
//! transfer of a tunnel, at the first after a quiet spell, and every 10 s
//! of a long one. After a quiet spell that estimate is a keepalive's, so
//! the window falls to four datagrams: a port-forward through the hub over
//! QUIC ran its first 32 MiB at about 125 MB/s and the next at 600-750.
//! In BBR the probe lets the sender measure the path's minimum round trip
//! afresh; quinn's takes that from the connection's lifetime minimum
//! whatever the probe sees, so here the probe only slows the sender.
//! [`SteadyBbr`] keeps the window BBR had before a probe until the probe is
//! over, or until a loss says the path has less room.

use std::{
    any::Any,
    sync::Arc,
    time::{Duration, Instant},
};

use quinn::congestion::{BbrConfig, Controller, ControllerFactory, ControllerMetrics};
use quinn_proto::RttEstimator;

/// How long after its last probe quinn's BBR probes again, at the first
/// acknowledgement of a full-rate send.
const PROBE_AFTER: Duration = Duration::from_secs(10);

/// How long a window is held from the start of a probe: the probe's
/// 200 ms and the round trip that ends it, with room for long paths.
const HOLD_FOR: Duration = Duration::from_secs(1);

/// Builds [`SteadyBbr`] controllers.
#[derive(Debug, Default)]
pub struct SteadyBbrConfig(Arc<BbrConfig>);

impl ControllerFactory for SteadyBbrConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(SteadyBbr::new(self.0.clone().build(now, current_mtu)))
    }
}

/// A congestion controller that is `inner` (quinn's BBR) except during
/// its round-trip probes (see the module's notes).
pub struct SteadyBbr {
    inner: Box<dyn Controller>,
    /// When `inner` last started a probe, as its own rule has it.
    last_probe: Option<Instant>,
    /// The window held, and until when.
    hold: Option<(u64, Instant)>,
    /// The time of the latest event seen (`window` is asked without one).
    now: Option<Instant>,
    /// When a loss was last reported.
    last_loss: Option<Instant>,
}

impl std::fmt::Debug for SteadyBbr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SteadyBbr")
            .field("window", &self.window())
            .field("last_probe", &self.last_probe)
            .field("hold", &self.hold)
            .finish_non_exhaustive()
    }
}

impl SteadyBbr {
    pub fn new(inner: Box<dyn Controller>) -> Self {
        Self {
            inner,
            last_probe: None,
            hold: None,
            now: None,
            last_loss: None,
        }
    }

    fn held(&self) -> Option<u64> {
        let (window, until) = self.hold?;
        (self.now? < until).then_some(window)
    }
}

impl Controller for SteadyBbr {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        self.now = Some(now);
        self.inner.on_sent(now, bytes, last_packet_number);
    }

    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &RttEstimator,
    ) {
        self.now = Some(now);
        self.inner.on_ack(now, sent, bytes, app_limited, rtt);
    }

    fn on_end_acks(
        &mut self,
        now: Instant,
        in_flight: u64,
        app_limited: bool,
        largest_packet_num_acked: Option<u64>,
    ) {
        self.now = Some(now);
        // BBR's rule for starting a probe, read before it acts on it.
        let probes = !app_limited
            && self
                .last_probe
                .is_none_or(|last| now.saturating_duration_since(last) > PROBE_AFTER);
        // Not right after a loss: then BBR's recovery rules the window.
        let held = probes
            && self
                .last_loss
                .is_none_or(|lost| now.saturating_duration_since(lost) > HOLD_FOR);
        let before = self.window();
        // BBR ends a probe 200 ms after its bytes in flight have fallen to
        // the probe's window; with the window held they never would, and
        // the probe would only come later. Told none are in flight as it
        // starts, it sets its 200 ms going at once.
        let in_flight = if held { 0 } else { in_flight };
        self.inner
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked);
        if probes {
            self.last_probe = Some(now);
        }
        if held {
            // Never below what a new connection starts with.
            let window = before.max(self.inner.initial_window());
            self.hold = Some((window, now + HOLD_FOR));
        }
    }

    fn on_congestion_event(
        &mut self,
        now: Instant,
        sent: Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.now = Some(now);
        // A loss is the path's word: BBR's own window rules from here.
        self.hold = None;
        self.last_loss = Some(now);
        self.inner
            .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes);
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.inner.on_mtu_update(new_mtu);
    }

    fn window(&self) -> u64 {
        let window = self.inner.window();
        self.held().map_or(window, |held| held.max(window))
    }

    fn metrics(&self) -> ControllerMetrics {
        let mut metrics = self.inner.metrics();
        metrics.congestion_window = self.window();
        metrics
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(Self {
            inner: self.inner.clone_box(),
            last_probe: self.last_probe,
            hold: self.hold,
            now: self.now,
            last_loss: self.last_loss,
        })
    }

    fn initial_window(&self) -> u64 {
        self.inner.initial_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BBR's window as far as probes go: from a full-rate acknowledgement
    /// 10 s after the last probe, `PROBE` until 200 ms after the bytes in
    /// flight fell below it; `NORMAL` otherwise, or `AFTER_LOSS` once a
    /// loss was reported.
    #[derive(Clone, Default)]
    struct Fake {
        probe_started: Option<Instant>,
        probing: bool,
        ends_at: Option<Instant>,
        now: Option<Instant>,
        lost: bool,
    }

    const NORMAL: u64 = 2_000_000;
    const PROBE: u64 = 36_000;
    const AFTER_LOSS: u64 = 100_000;
    const INITIAL: u64 = 240_000;

    impl Controller for Fake {
        fn on_sent(&mut self, now: Instant, _: u64, _: u64) {
            self.now = Some(now);
        }
        fn on_end_acks(&mut self, now: Instant, in_flight: u64, app_limited: bool, _: Option<u64>) {
            self.now = Some(now);
            if !self.probing
                && !app_limited
                && self
                    .probe_started
                    .is_none_or(|t| now.saturating_duration_since(t) > PROBE_AFTER)
            {
                self.probe_started = Some(now);
                self.probing = true;
                self.ends_at = None;
            }
            if self.probing {
                match self.ends_at {
                    None if in_flight < PROBE => self.ends_at = Some(now + ms(200)),
                    Some(end) if now >= end => self.probing = false,
                    _ => {}
                }
            }
        }
        fn on_congestion_event(&mut self, now: Instant, _: Instant, _: bool, _: u64) {
            self.now = Some(now);
            self.lost = true;
        }
        fn on_mtu_update(&mut self, _: u16) {}
        fn window(&self) -> u64 {
            if self.lost {
                AFTER_LOSS
            } else if self.probing {
                PROBE
            } else {
                NORMAL
            }
        }
        fn clone_box(&self) -> Box<dyn Controller> {
            Box::new(self.clone())
        }
        fn initial_window(&self) -> u64 {
            INITIAL
        }
        fn into_any(self: Box<Self>) -> Box<dyn Any> {
            self
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A megabyte in flight throughout: a bulk transfer.
    const BULK: u64 = 1_000_000;

    #[test]
    fn a_probe_keeps_the_window_and_still_ends() {
        let t0 = Instant::now();
        let mut cc = SteadyBbr::new(Box::new(Fake::default()));
        // Acknowledgements of a quiet tunnel's keepalives start no probe.
        cc.on_end_acks(t0, 0, true, Some(1));
        assert_eq!(cc.window(), NORMAL);
        // The first full-rate send does; the window stays.
        cc.on_end_acks(t0 + ms(5), BULK, false, Some(2));
        assert_eq!(cc.inner.window(), PROBE, "BBR probes");
        assert_eq!(cc.window(), NORMAL);
        cc.on_sent(t0 + ms(150), 1200, 3);
        assert_eq!(cc.window(), NORMAL);
        // BBR's probe ends 200 ms on although the bytes in flight never
        // fell (it was told none were, as it began).
        cc.on_end_acks(t0 + ms(300), BULK, false, Some(3));
        assert_eq!(cc.inner.window(), NORMAL, "BBR's probe is over");
        assert_eq!(cc.window(), NORMAL);
        // 5 s on, no probe; 11 s on, the next, held again.
        cc.on_end_acks(t0 + ms(5_000), BULK, false, Some(4));
        assert_eq!(cc.inner.window(), NORMAL);
        cc.on_end_acks(t0 + ms(11_000), BULK, false, Some(5));
        assert_eq!(cc.inner.window(), PROBE);
        assert_eq!(cc.window(), NORMAL);
    }

    #[test]
    fn a_probe_from_a_small_window_is_held_at_the_initial_one() {
        // A window below the initial one before the probe (a stale
        // estimate after a quiet spell) is held at the initial window.
        let small = Fake {
            lost: true,
            ..Fake::default()
        };
        let mut cc = SteadyBbr::new(Box::new(small));
        cc.on_end_acks(Instant::now(), BULK, false, Some(1));
        assert_eq!(cc.window(), INITIAL);
    }

    #[test]
    fn a_loss_ends_the_hold_and_a_probe_right_after_one_is_bbrs() {
        let t0 = Instant::now();
        let mut cc = SteadyBbr::new(Box::new(Fake::default()));
        cc.on_end_acks(t0, BULK, false, Some(1));
        assert_eq!(cc.window(), NORMAL);
        cc.on_congestion_event(t0 + ms(50), t0 + ms(40), false, 1200);
        assert_eq!(cc.window(), AFTER_LOSS);

        let mut cc = SteadyBbr::new(Box::new(Fake::default()));
        cc.on_congestion_event(t0, t0, false, 1200);
        cc.inner = Box::new(Fake::default());
        cc.on_end_acks(t0 + ms(10), BULK, false, Some(1));
        assert_eq!(cc.window(), PROBE);
    }

    #[test]
    fn the_hold_ends_on_its_own() {
        let t0 = Instant::now();
        let mut cc = SteadyBbr::new(Box::new(Fake::default()));
        cc.on_end_acks(t0, BULK, false, Some(1));
        assert_eq!(cc.window(), NORMAL);
        // Were BBR still probing 1 s on, its window would be the one.
        cc.inner = Box::new(Fake {
            probing: true,
            ..Fake::default()
        });
        cc.on_sent(t0 + HOLD_FOR + ms(1), 1200, 2);
        assert_eq!(cc.window(), PROBE);
    }
}
