//! TLS session tickets every hub replica can read, so an agent coming back
//! (after a restart of its hub, or to another replica) resumes its session
//! instead of making a full handshake.
//!
//! Keys roll: each epoch has a key of its own, kept in the hub's store by
//! the hub, and tickets are sealed with the current epoch's key and opened
//! with it or the previous one's. A key older than that is erased, so a
//! stolen key opens at most two epochs of tickets (rustls asks for key
//! rolling and erasure rather than a lifetime inside the ticket).
//!
//! A resumed session carries the client certificate of the handshake it
//! resumes and skips its verification: the hub checks that certificate
//! again when it admits a tunnel ([`crate::live::LiveTls::verify_client`]).

use std::sync::{
    Arc, RwLock,
    atomic::{AtomicU64, Ordering},
};

use ring::{
    aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey},
    rand::{SecureRandom, SystemRandom},
};
use rustls::server::ProducesTickets;

/// Format of our tickets: the byte, then the epoch (big-endian u32), the
/// nonce, and the sealed session with its tag.
const VERSION: u8 = 1;
const HEADER_LEN: usize = 1 + 4;

struct EpochKey {
    epoch: u32,
    key: LessSafeKey,
}

#[derive(Default)]
struct Ring {
    current: Option<EpochKey>,
    previous: Option<EpochKey>,
}

/// A listener's ticketer: the shared keys, and its own count of tickets
/// accepted (resumptions offered that it could open).
pub struct TicketKeys {
    ring: Arc<RwLock<Ring>>,
    lifetime_secs: u32,
    accepted: AtomicU64,
    rng: SystemRandom,
}

impl std::fmt::Debug for TicketKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TicketKeys")
            .field("lifetime_secs", &self.lifetime_secs)
            .field("accepted", &self.accepted())
            .finish_non_exhaustive()
    }
}

fn key_of(epoch: u32, secret: &[u8; 32]) -> EpochKey {
    let unbound = UnboundKey::new(&CHACHA20_POLY1305, secret)
        .expect("a 32-byte key is what ChaCha20-Poly1305 takes");
    EpochKey {
        epoch,
        key: LessSafeKey::new(unbound),
    }
}

impl TicketKeys {
    /// No keys yet (tickets off until [`TicketKeys::install`]); tickets
    /// say they live `lifetime_secs` (an epoch).
    pub fn new(lifetime_secs: u32) -> Arc<Self> {
        Arc::new(Self {
            ring: Default::default(),
            lifetime_secs,
            accepted: AtomicU64::new(0),
            rng: SystemRandom::new(),
        })
    }

    /// Another ticketer on the same keys, with a count of its own (one per
    /// listener).
    pub fn sharing(&self) -> Arc<Self> {
        Arc::new(Self {
            ring: self.ring.clone(),
            lifetime_secs: self.lifetime_secs,
            accepted: AtomicU64::new(0),
            rng: SystemRandom::new(),
        })
    }

    /// Seals from now on with `epoch`'s key and opens that epoch's and the
    /// one before's; every other key is dropped.
    pub fn install(&self, epoch: u32, current: &[u8; 32], previous: Option<&[u8; 32]>) {
        let mut ring = self.ring.write().unwrap_or_else(|e| e.into_inner());
        ring.current = Some(key_of(epoch, current));
        ring.previous = previous.map(|p| key_of(epoch.wrapping_sub(1), p));
    }

    /// The epoch sealing now, once keys are installed.
    pub fn epoch(&self) -> Option<u32> {
        let ring = self.ring.read().unwrap_or_else(|e| e.into_inner());
        ring.current.as_ref().map(|k| k.epoch)
    }

    /// Tickets this listener opened since it started.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl ProducesTickets for TicketKeys {
    fn enabled(&self) -> bool {
        self.epoch().is_some()
    }

    fn lifetime(&self) -> u32 {
        self.lifetime_secs
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        let ring = self.ring.read().unwrap_or_else(|e| e.into_inner());
        let current = ring.current.as_ref()?;
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).ok()?;
        let mut header = [0u8; HEADER_LEN];
        header[0] = VERSION;
        header[1..].copy_from_slice(&current.epoch.to_be_bytes());
        let mut sealed = plain.to_vec();
        current
            .key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(header),
                &mut sealed,
            )
            .ok()?;
        let mut ticket = Vec::with_capacity(HEADER_LEN + NONCE_LEN + sealed.len());
        ticket.extend_from_slice(&header);
        ticket.extend_from_slice(&nonce);
        ticket.extend_from_slice(&sealed);
        Some(ticket)
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        // Whatever a peer sends: every length and field is checked.
        if cipher.len() < HEADER_LEN + NONCE_LEN || cipher[0] != VERSION {
            return None;
        }
        let (header, rest) = cipher.split_at(HEADER_LEN);
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let epoch = u32::from_be_bytes(header[1..].try_into().ok()?);
        let ring = self.ring.read().unwrap_or_else(|e| e.into_inner());
        let key = [ring.current.as_ref(), ring.previous.as_ref()]
            .into_iter()
            .flatten()
            .find(|k| k.epoch == epoch)?;
        let mut buf = sealed.to_vec();
        let header: [u8; HEADER_LEN] = header.try_into().ok()?;
        let plain = key
            .key
            .open_in_place(
                Nonce::try_assume_unique_for_key(nonce).ok()?,
                Aad::from(header),
                &mut buf,
            )
            .ok()?;
        let plain = plain.to_vec();
        self.accepted.fetch_add(1, Ordering::Relaxed);
        Some(plain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_open_for_two_epochs_and_not_when_touched() {
        let keys = TicketKeys::new(3600);
        assert!(!keys.enabled(), "no keys, no tickets");
        assert!(keys.encrypt(b"session").is_none());
        let (k1, k2, k3) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        keys.install(10, &k1, None);
        let t1 = keys.encrypt(b"session one").unwrap();
        assert_eq!(keys.decrypt(&t1).unwrap(), b"session one");
        // Another listener on the same keys opens it too, and counts it.
        let other = keys.sharing();
        assert_eq!(other.decrypt(&t1).unwrap(), b"session one");
        assert_eq!((keys.accepted(), other.accepted()), (1, 1));
        // A ticket made by another replica with the same keys opens.
        let replica = TicketKeys::new(3600);
        replica.install(10, &k1, None);
        assert_eq!(replica.decrypt(&t1).unwrap(), b"session one");

        // Next epoch: the old ticket still opens, a new one too.
        keys.install(11, &k2, Some(&k1));
        assert_eq!(keys.decrypt(&t1).unwrap(), b"session one");
        let t2 = keys.encrypt(b"session two").unwrap();
        // Two epochs on: the first key is gone, and its tickets with it.
        keys.install(12, &k3, Some(&k2));
        assert!(keys.decrypt(&t1).is_none());
        assert_eq!(keys.decrypt(&t2).unwrap(), b"session two");

        // Any change to a ticket is refused: header, nonce, body, tag.
        for at in [
            0,
            2,
            HEADER_LEN + 1,
            HEADER_LEN + NONCE_LEN + 1,
            t2.len() - 1,
        ] {
            let mut bad = t2.clone();
            bad[at] ^= 0x40;
            assert!(keys.decrypt(&bad).is_none(), "flipped byte {at}");
        }
        for cut in [0, 1, HEADER_LEN, HEADER_LEN + NONCE_LEN, t2.len() - 1] {
            assert!(keys.decrypt(&t2[..cut]).is_none(), "cut at {cut}");
        }
        // Another key of the same epoch opens nothing.
        let stranger = TicketKeys::new(3600);
        stranger.install(12, &[9u8; 32], None);
        assert!(stranger.decrypt(&t2).is_none());
    }
}
