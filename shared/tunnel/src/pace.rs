//! Paced admission of tunnels: when many agents come back at once (a hub
//! restart, a network that healed), the hub sets up at most a configured
//! number of tunnels at a time and tells the others when to come back,
//! instead of letting them all handshake, time out and retry together.
//!
//! The hint travels the way each transport can carry it:
//!
//! | transport | refusal |
//! |---|---|
//! | QUIC | the connection closed with application code [`QUIC_REFUSED`] and reason `retry-after-ms=<n>` |
//! | TLS + HTTP/2 | instead of the HTTP/2 preface, the line `otter-tunnel-refused retry-after-ms=<n>` |
//! | WebSocket | the upgrade answered `503 Service Unavailable` with `Retry-After` (seconds) and `otter-retry-after-ms` |
//!
//! Registrations (the Register call, which signs a certificate) are paced
//! the same way with a gate of their own: `Unavailable` with the hint in the
//! metadata [`GRPC_RETRY_AFTER_MS`].
//!
//! The agent waits at least that long, plus jitter, before it dials again,
//! and tries no other transport meanwhile. Refusing still costs a TLS
//! handshake (the hint must be authenticated), but nothing more.
//!
//! A slot is taken only once the handshake has verified the agent's client
//! certificate, so anonymous connections cannot hold them; the handshakes
//! before that are bounded by [`crate::handshakes`].

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::handshakes::{HandshakeLimits, Handshakes};

/// QUIC application error code of a paced refusal.
pub const QUIC_REFUSED: u32 = 0x0f7e_0503;
/// What the hub sends instead of the HTTP/2 preface when it refuses.
pub const H2_REFUSED: &[u8] = b"otter-tunnel-refused ";
/// Header with the hint in milliseconds on a refused WebSocket upgrade.
pub const WS_RETRY_AFTER_MS: &str = "otter-retry-after-ms";
/// gRPC metadata with the hint in milliseconds on a Register the hub
/// turned away (status Unavailable).
pub const GRPC_RETRY_AFTER_MS: &str = "retry-after-ms";

/// The reason text carrying `after`.
pub fn reason(after: Duration) -> String {
    format!("retry-after-ms={}", after.as_millis())
}

/// The hint in a reason text made by [`reason`].
pub fn parse_reason(text: &str) -> Option<Duration> {
    let ms = text.trim().strip_prefix("retry-after-ms=")?;
    ms.trim().parse().ok().map(Duration::from_millis)
}

/// The hub's admission gate, shared by every transport's listener.
#[derive(Debug)]
pub struct Pacer {
    permits: Arc<Semaphore>,
    max: usize,
    retry_after: Duration,
    peak: AtomicUsize,
    refused: AtomicU64,
    handshakes: Arc<Handshakes>,
}

/// A tunnel being set up; its slot frees when this is dropped.
#[derive(Debug)]
pub struct Admission {
    _permit: OwnedSemaphorePermit,
}

impl Pacer {
    /// At most `max` tunnels set up at once; others are told to come back
    /// after `retry_after`.
    pub fn new(max: usize, retry_after: Duration) -> Arc<Pacer> {
        Self::with_handshakes(max, retry_after, HandshakeLimits::default())
    }

    /// Like [`Pacer::new`], with the bounds of the handshakes before
    /// admission.
    pub fn with_handshakes(
        max: usize,
        retry_after: Duration,
        handshakes: HandshakeLimits,
    ) -> Arc<Pacer> {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        Arc::new(Pacer {
            permits: Arc::new(Semaphore::new(max)),
            max,
            retry_after,
            peak: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
            handshakes: Handshakes::new(handshakes),
        })
    }

    /// No limit (tests and benchmarks of the transports alone).
    pub fn unlimited() -> Arc<Pacer> {
        Self::new(Semaphore::MAX_PERMITS, Duration::from_secs(1))
    }

    /// A slot for a new tunnel, or the delay to tell it.
    pub fn try_enter(&self) -> Result<Admission, Duration> {
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => {
                self.peak.fetch_max(self.in_progress(), Ordering::SeqCst);
                Ok(Admission { _permit: permit })
            }
            Err(_) => {
                self.refused.fetch_add(1, Ordering::SeqCst);
                Err(self.retry_after)
            }
        }
    }

    /// Tunnels being set up right now.
    pub fn in_progress(&self) -> usize {
        self.max - self.permits.available_permits()
    }

    /// The most tunnels ever set up at once.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    /// Tunnels refused with a hint so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// The handshakes in progress before admission.
    pub fn handshakes(&self) -> &Arc<Handshakes> {
        &self.handshakes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_max_at_once_and_refusals_carry_the_hint() {
        let p = Pacer::new(2, Duration::from_millis(300));
        let a = p.try_enter().unwrap();
        let b = p.try_enter().unwrap();
        assert_eq!(p.try_enter().unwrap_err(), Duration::from_millis(300));
        assert_eq!((p.in_progress(), p.peak(), p.refused()), (2, 2, 1));
        drop(a);
        let c = p.try_enter().unwrap();
        drop((b, c));
        assert_eq!((p.in_progress(), p.peak()), (0, 2));
        let r = reason(Duration::from_millis(1500));
        assert_eq!(parse_reason(&r), Some(Duration::from_millis(1500)));
        assert_eq!(parse_reason("agent replaced"), None);
    }
}
