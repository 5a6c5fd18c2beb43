//! In-memory transport: a tunnel made of tokio duplex pipes, for tests that
//! need the stream semantics without sockets.

use std::{sync::Arc, time::Duration};

use tokio::sync::{Mutex, mpsc};
use tokio_util::sync::CancellationToken;

use crate::{
    Result, TunnelError,
    transport::{Acceptor, BoxFuture, Opener, TransportKind, TunnelStream},
};

/// Bytes buffered in each direction of one stream.
const PIPE_BUFFER: usize = 64 * 1024;

/// Makes a connected pair: the hub's opener and the agent's acceptor.
pub fn pair() -> (MemOpener, MemAcceptor) {
    let (tx, rx) = mpsc::channel(64);
    let closed = CancellationToken::new();
    (
        MemOpener {
            tx,
            closed: closed.clone(),
            reason: Arc::new(Mutex::new(String::new())),
        },
        MemAcceptor { rx, closed },
    )
}

#[derive(Debug)]
pub struct MemOpener {
    tx: mpsc::Sender<TunnelStream>,
    closed: CancellationToken,
    reason: Arc<Mutex<String>>,
}

impl Opener for MemOpener {
    fn open(&self) -> BoxFuture<'_, Result<TunnelStream>> {
        Box::pin(async move {
            if self.closed.is_cancelled() {
                return Err(TunnelError::Closed("in-memory tunnel closed".into()));
            }
            let (hub, agent) = tokio::io::duplex(PIPE_BUFFER);
            let (hub_recv, hub_send) = tokio::io::split(hub);
            let (agent_recv, agent_send) = tokio::io::split(agent);
            self.tx
                .send(TunnelStream::new(agent_send, agent_recv))
                .await
                .map_err(|_| {
                    TunnelError::Closed("agent side of in-memory tunnel is gone".into())
                })?;
            Ok(TunnelStream::new(hub_send, hub_recv))
        })
    }

    fn closed(&self) -> BoxFuture<'static, String> {
        let token = self.closed.clone();
        let tx = self.tx.clone();
        let reason = self.reason.clone();
        Box::pin(async move {
            tokio::select! {
                _ = token.cancelled() => {}
                _ = tx.closed() => {}
            }
            let r = reason.lock().await.clone();
            if r.is_empty() {
                "in-memory tunnel closed".into()
            } else {
                r
            }
        })
    }

    fn close(&self, reason: &str) {
        if let Ok(mut r) = self.reason.try_lock() {
            *r = reason.to_owned();
        }
        self.closed.cancel();
    }

    fn rtt(&self) -> Option<Duration> {
        None
    }

    fn heard(&self) -> Option<u64> {
        None
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Mem
    }
}

#[derive(Debug)]
pub struct MemAcceptor {
    rx: mpsc::Receiver<TunnelStream>,
    closed: CancellationToken,
}

impl Acceptor for MemAcceptor {
    fn accept(&mut self) -> BoxFuture<'_, Result<Option<TunnelStream>>> {
        Box::pin(async move {
            tokio::select! {
                s = self.rx.recv() => Ok(s),
                _ = self.closed.cancelled() => Ok(None),
            }
        })
    }

    fn rtt(&self) -> Option<Duration> {
        None
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Mem
    }
}
