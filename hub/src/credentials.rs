//! Calls that outlive the request that authenticated them (a Watch, a log
//! follow, an exec or port-forward session, an upgraded kubectl
//! connection) stay tied to the hub token they were opened with: revoking
//! the token, or its expiry, ends them, not only the token's next call.
//!
//! A revocation through this replica ends its streams at once; every
//! replica also re-checks the tokens of its live streams against the store
//! on a short period, which catches revocations made anywhere else.

use std::{
    collections::HashMap,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use futures::{Future, FutureExt};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::store::Store;

/// The hub token a caller authenticated with (identity-provider tokens
/// carry none: like kube-apiserver, a stream opened with one is not cut
/// when the token's own expiry passes).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Credential {
    pub id: String,
    /// Unix seconds.
    pub expires: Option<i64>,
}

/// The live streams of each hub token.
#[derive(Debug, Default)]
pub struct LiveCredentials {
    tokens: Mutex<HashMap<String, Live>>,
}

#[derive(Debug)]
struct Live {
    cancel: CancellationToken,
    streams: usize,
}

impl LiveCredentials {
    /// Ties one stream to `credential`; the stream ends when the returned
    /// hold says so.
    pub fn hold(self: &Arc<Self>, credential: &Credential) -> Hold {
        let cancel = {
            let mut tokens = self
                .tokens
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let live = tokens.entry(credential.id.clone()).or_insert_with(|| Live {
                cancel: CancellationToken::new(),
                streams: 0,
            });
            live.streams += 1;
            live.cancel.clone()
        };
        let expiry = credential.expires.map(|at| {
            let left = at.saturating_sub(crate::unix_now()).max(0) as u64;
            Box::pin(tokio::time::sleep(Duration::from_secs(left)))
        });
        Hold {
            owner: self.clone(),
            id: credential.id.clone(),
            revoked: Box::pin(cancel.cancelled_owned()),
            expiry,
        }
    }

    /// Ends every stream of token `id` on this replica.
    pub fn revoke(&self, id: &str) {
        let live = self
            .tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(id);
        if let Some(live) = live {
            tracing::info!(token = %id, streams = live.streams, "ending the streams of a revoked token");
            live.cancel.cancel();
        }
    }

    /// Tokens with live streams here.
    pub fn ids(&self) -> Vec<String> {
        self.tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .keys()
            .cloned()
            .collect()
    }

    /// Ends the streams of every token the store no longer holds (revoked
    /// on another replica, or by a tenant's deletion); returns how many
    /// tokens that was. A store that fails ends nothing: a hiccup must not
    /// cut every session.
    pub fn sweep(&self, store: &dyn Store) -> usize {
        let mut ended = 0;
        for id in self.ids() {
            match store.get_raw(crate::store::tree::API_TOKENS, &id) {
                Ok(None) => {
                    self.revoke(&id);
                    ended += 1;
                }
                Ok(Some(_)) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "could not re-check live tokens");
                    return ended;
                }
            }
        }
        ended
    }

    fn release(&self, id: &str) {
        let mut tokens = self
            .tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(live) = tokens.get_mut(id) {
            live.streams -= 1;
            if live.streams == 0 {
                tokens.remove(id);
            }
        }
    }
}

/// Why a held stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Revoked,
    Expired,
}

impl Ended {
    /// The word audit lines give as the reason.
    pub fn reason(self) -> &'static str {
        match self {
            Ended::Revoked => "revoked",
            Ended::Expired => "expired",
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            Ended::Revoked => "the token this stream was opened with was revoked",
            Ended::Expired => "the token this stream was opened with expired",
        }
    }
}

/// One stream's tie to its token; dropping it lets go.
pub struct Hold {
    owner: Arc<LiveCredentials>,
    id: String,
    revoked: Pin<Box<WaitForCancellationFutureOwned>>,
    expiry: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hold").field("id", &self.id).finish()
    }
}

impl Hold {
    /// Ready once the stream must end.
    pub fn poll_ended(&mut self, cx: &mut Context<'_>) -> Poll<Ended> {
        if self.revoked.poll_unpin(cx).is_ready() {
            return Poll::Ready(Ended::Revoked);
        }
        match self.expiry.as_mut().map(|sleep| sleep.as_mut().poll(cx)) {
            Some(Poll::Ready(())) => Poll::Ready(Ended::Expired),
            _ => Poll::Pending,
        }
    }

    /// Waits until the stream must end.
    pub async fn ended(&mut self) -> Ended {
        futures::future::poll_fn(|cx| self.poll_ended(cx)).await
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.owner.release(&self.id);
    }
}

/// A hold for `caller`'s stream, if it authenticated with a hub token.
pub fn hold_for(live: &Arc<LiveCredentials>, caller: &crate::auth::Principal) -> Option<Hold> {
    caller.credential.as_ref().map(|c| live.hold(c))
}

/// Re-checks the live streams' tokens every `period` until `stop`.
pub async fn sweep_every(
    live: Arc<LiveCredentials>,
    store: Arc<dyn Store>,
    period: Duration,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if live.ids().is_empty() {
            continue;
        }
        let (live, store) = (live.clone(), store.clone());
        let _ = tokio::task::spawn_blocking(move || live.sweep(&*store)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cred(id: &str, expires: Option<i64>) -> Credential {
        Credential {
            id: id.into(),
            expires,
        }
    }

    #[tokio::test]
    async fn revoking_ends_every_stream_of_that_token_only() {
        let live = Arc::new(LiveCredentials::default());
        let (mut a1, mut a2, mut b) = (
            live.hold(&cred("a", None)),
            live.hold(&cred("a", None)),
            live.hold(&cred("b", None)),
        );
        live.revoke("a");
        assert_eq!(a1.ended().await, Ended::Revoked);
        assert_eq!(a2.ended().await, Ended::Revoked);
        let waker = futures::task::noop_waker();
        assert!(b.poll_ended(&mut Context::from_waker(&waker)).is_pending());
        drop((a1, a2));
        assert_eq!(live.ids(), vec!["b".to_owned()]);
        drop(b);
        assert!(live.ids().is_empty(), "nothing kept once streams end");
    }

    #[tokio::test]
    async fn a_sweep_ends_the_streams_of_tokens_revoked_elsewhere() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::SledStore::open(dir.path()).unwrap();
        let spec = crate::tokens::TokenSpec::member("mel", &[], "default");
        let (_, kept) = crate::tokens::mint_api_token(&store, &spec).unwrap();
        let (_, gone) = crate::tokens::mint_api_token(&store, &spec).unwrap();
        let live = Arc::new(LiveCredentials::default());
        let (mut k, mut g) = (live.hold(&cred(&kept, None)), live.hold(&cred(&gone, None)));
        assert_eq!(live.sweep(&store), 0);
        // Revoked through the store alone, as another replica does.
        crate::tokens::revoke_api_token(&store, &gone).unwrap();
        assert_eq!(live.sweep(&store), 1);
        assert_eq!(g.ended().await, Ended::Revoked);
        let waker = futures::task::noop_waker();
        assert!(k.poll_ended(&mut Context::from_waker(&waker)).is_pending());
    }

    #[tokio::test]
    async fn a_token_past_its_expiry_ends_its_stream() {
        let live = Arc::new(LiveCredentials::default());
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut later = live.hold(&cred("a", Some(crate::unix_now() + 60)));
        assert!(later.poll_ended(&mut cx).is_pending());
        let mut past = live.hold(&cred("b", Some(crate::unix_now() - 1)));
        assert_eq!(past.ended().await, Ended::Expired);
    }
}
