//! TLS session tickets of the tunnel port (TLS + HTTP/2, WebSocket and
//! QUIC): agents coming back after a restart of the hub, or to another
//! replica, resume their sessions instead of making full handshakes. The
//! keys live in the store, one per epoch, so every replica and every
//! restart reads the same ones; keys older than the previous epoch are
//! erased from it.

use std::sync::Arc;

use otter_pki::tickets::TicketKeys;

use crate::{
    Result,
    server::HubState,
    store::{Store, tree},
    unix_now,
};

/// How long one key seals tickets; tickets open for up to two epochs.
pub const EPOCH_SECS: u64 = 6 * 3600;
/// Name of an epoch's key under `meta/`, before the epoch's number.
const KEY_PREFIX: &str = "tls-ticket-key-";
/// Tickets sent after each full or resumed handshake (rustls keeps up to
/// 8 per server on the client).
pub const TICKETS_PER_HANDSHAKE: usize = 4;
/// How often the epoch is checked.
const CHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// The ticketers of the tunnel port's listeners, on one set of keys.
#[derive(Debug)]
pub struct Tickets {
    /// TLS + HTTP/2 and WebSocket.
    pub tcp: Arc<TicketKeys>,
    pub quic: Arc<TicketKeys>,
}

impl Default for Tickets {
    fn default() -> Self {
        let tcp = TicketKeys::new(EPOCH_SECS as u32);
        let quic = tcp.sharing();
        Self { tcp, quic }
    }
}

fn epoch_now() -> u32 {
    u32::try_from(u64::try_from(unix_now()).unwrap_or(0) / EPOCH_SECS).unwrap_or(u32::MAX)
}

fn key(store: &dyn Store, epoch: u32) -> Result<[u8; 32]> {
    let secret = crate::store::secret(store, &format!("{KEY_PREFIX}{epoch}"))?;
    secret
        .try_into()
        .map_err(|_| crate::HubError::Config(format!("{KEY_PREFIX}{epoch}: not a 32-byte key")))
}

impl Tickets {
    /// Takes the keys of the epoch now (made on first use by whichever
    /// replica comes first) and erases those older than the previous one.
    pub fn roll(&self, store: &dyn Store) -> Result<()> {
        let epoch = epoch_now();
        if self.tcp.epoch() == Some(epoch) {
            return Ok(());
        }
        let current = key(store, epoch)?;
        let previous = key(store, epoch.saturating_sub(1))?;
        self.tcp.install(epoch, &current, Some(&previous));
        for (name, _) in store.scan_raw(tree::META)? {
            let old = name
                .strip_prefix(KEY_PREFIX)
                .and_then(|e| e.parse::<u32>().ok())
                .is_some_and(|e| e.saturating_add(1) < epoch);
            if old {
                store.delete(tree::META, &name)?;
            }
        }
        tracing::debug!(epoch, "TLS ticket keys rolled");
        Ok(())
    }
}

/// Rolls the keys when the epoch turns. A store that cannot be read keeps
/// the keys there are (tickets of an epoch past are then not made again:
/// agents fall back to full handshakes).
pub async fn roll_periodically(
    state: Arc<HubState>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(CHECK_EVERY) => {}
        }
        let s = state.clone();
        let rolled = tokio::task::spawn_blocking(move || s.tickets.roll(&*s.store)).await;
        if let Ok(Err(e)) = rolled {
            tracing::warn!(error = %e, "TLS ticket keys not rolled");
        }
    }
}
