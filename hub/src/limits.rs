//! What an anonymous client can hold on the API port, and for how long.
//!
//! Anyone can connect to the API port: users, dashboards and agents
//! registering, and also anyone else. Before a caller is authenticated it
//! gets little:
//!
//! - **connections**: a global cap and a cap per source address (an IPv6
//!   /64); beyond either a new connection is closed at once, so a flood
//!   spends the attacker's sockets, not the hub's descriptors;
//! - **time**: the TLS handshake and the first request head must arrive
//!   within [`FIRST_REQUEST_TIMEOUT`], every later HTTP/1.1 head within
//!   [`HEADER_READ_TIMEOUT`], and a request body that stops sending for
//!   [`BODY_IDLE_TIMEOUT`] is abandoned;
//! - **bytes**: every protocol authenticates from the headers before it
//!   reads a body byte (see `server::route`), and the endpoints that need
//!   no token (Register, health, reflection) take messages of at most
//!   [`MAX_PUBLIC_MESSAGE`];
//! - **store lookups**: a token the replica's copy of etcd lacks is asked
//!   of etcd in one transaction at a time for every lookup waiting, with a
//!   bounded queue behind it (see `etcd::look_up`), so made-up tokens cost
//!   etcd one request per round trip, however many arrive.
//!
//! The process's open-file limit is raised to its hard limit at start, and
//! the API port may use at most half of it, so the tunnel port still
//! accepts agents while the API port is flooded.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

/// From accepting a connection to its first complete request head (TLS
/// handshake included).
pub const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A later HTTP/1.1 request head (idle keep-alive included) must be read
/// within this.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// A request body the hub is reading may pause this long between frames.
pub const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest request message of the endpoints that need no token: a
/// Register carries a CSR of at most 16 KiB and a few names.
pub const MAX_PUBLIC_MESSAGE: usize = 64 * 1024;

/// Bounds of the API port's connections.
#[derive(Debug, Clone, Copy)]
pub struct ApiConnectionLimits {
    /// All sources together (further bounded by half the open-file limit).
    pub max_total: usize,
    /// One source address (an IPv6 /64).
    pub per_source: usize,
}

impl Default for ApiConnectionLimits {
    fn default() -> Self {
        Self {
            max_total: 8192,
            per_source: 512,
        }
    }
}

/// The API port's open connections, counted per source.
#[derive(Debug)]
pub struct ApiConnections {
    limits: ApiConnectionLimits,
    state: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
    refused: u64,
}

/// One open connection; its place frees when this is dropped.
#[derive(Debug)]
pub struct ApiConnection {
    gate: Arc<ApiConnections>,
    source: IpAddr,
}

impl Drop for ApiConnection {
    fn drop(&mut self) {
        let mut s = self.gate.lock();
        s.total -= 1;
        if let Some(n) = s.by_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                s.by_source.remove(&self.source);
            }
        }
    }
}

impl ApiConnections {
    pub fn new(limits: ApiConnectionLimits) -> Arc<ApiConnections> {
        Arc::new(ApiConnections {
            limits: ApiConnectionLimits {
                max_total: limits.max_total.max(1),
                per_source: limits.per_source.max(1),
            },
            state: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for a connection from `source`, or `None`: close it.
    pub fn try_enter(self: &Arc<Self>, source: IpAddr) -> Option<ApiConnection> {
        let source = otter_tunnel::handshakes::source_key(source);
        let mut s = self.lock();
        let held = s.by_source.get(&source).copied().unwrap_or(0);
        if s.total >= self.limits.max_total || held >= self.limits.per_source {
            s.refused += 1;
            return None;
        }
        s.total += 1;
        *s.by_source.entry(source).or_default() += 1;
        Some(ApiConnection {
            gate: self.clone(),
            source,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.lock().total
    }

    /// Connections closed at once for being over a cap.
    pub fn refused(&self) -> u64 {
        self.lock().refused
    }

    pub fn limits(&self) -> ApiConnectionLimits {
        self.limits
    }
}

/// Raises the soft open-file limit to the hard one (and, where the process
/// may, the hard one too), so the hub's connections are bounded by its own
/// caps rather than by a default of 1,024. Returns the soft limit in force.
pub fn raise_open_file_limit() -> Option<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    // What a root process may raise the hard limit to on a default kernel
    // (fs.nr_open); refused without the privilege, which is fine.
    const WANT: u64 = 1 << 20;
    let now = getrlimit(Resource::Nofile);
    let hard = now.maximum;
    if hard.is_some_and(|h| h < WANT) {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: now.current,
                maximum: Some(WANT),
            },
        );
    }
    let now = getrlimit(Resource::Nofile);
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: now.maximum,
            maximum: now.maximum,
        },
    );
    // `None` is unlimited.
    Some(getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX))
}

/// The next frame of a request body the hub is reading, or an error when
/// the client sent nothing for [`BODY_IDLE_TIMEOUT`].
pub async fn next_frame<B>(
    body: &mut B,
) -> Result<Option<Result<http_body::Frame<B::Data>, B::Error>>, tonic::Status>
where
    B: http_body::Body + Unpin,
{
    use http_body_util::BodyExt;
    tokio::time::timeout(BODY_IDLE_TIMEOUT, body.frame())
        .await
        .map_err(|_| {
            tonic::Status::deadline_exceeded(format!(
                "request body stalled: nothing received for {} s",
                BODY_IDLE_TIMEOUT.as_secs()
            ))
        })
}

/// How long the hub keeps reading a body it answered without needing (see
/// [`drain`]).
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads and drops a request body the hub answered before reading it (a
/// refusal from the headers), at most [`MAX_PUBLIC_MESSAGE`] bytes within
/// [`DRAIN_TIMEOUT`]: then the HTTP/1.1 connection carries the client's
/// next request instead of closing under a client still writing. Beyond
/// either bound the body is dropped, and with it the connection.
pub async fn drain<B>(mut body: B)
where
    B: http_body::Body + Unpin,
    B::Data: bytes::Buf,
{
    use bytes::Buf;
    use http_body_util::BodyExt;
    let mut left = MAX_PUBLIC_MESSAGE;
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data() {
                match left.checked_sub(data.remaining()) {
                    Some(l) => left = l,
                    None => return,
                }
            }
        }
    })
    .await;
}

/// A request body on the API port. Over HTTP/1.1, one dropped before its
/// end (a call answered from its first message, say an unknown cluster,
/// while the client's terminating chunk is still on its way) is handed to
/// [`drain`]: hyper would otherwise close the connection after an answer
/// that did not say so, and a client reusing it saw `EPIPE`. HTTP/2
/// streams are independent: a dropped one is just reset.
#[derive(Debug)]
pub struct RequestBody {
    inner: Option<hyper::body::Incoming>,
    drain_on_drop: bool,
}

impl RequestBody {
    pub fn new(body: hyper::body::Incoming, version: http::Version) -> Self {
        Self {
            inner: Some(body),
            drain_on_drop: version <= http::Version::HTTP_11,
        }
    }
}

impl http_body::Body for RequestBody {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, hyper::Error>>> {
        match self.inner.as_mut() {
            Some(body) => std::pin::Pin::new(body).poll_frame(cx),
            None => std::task::Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| http_body::SizeHint::with_exact(0), |b| b.size_hint())
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        let Some(body) = self.inner.take() else {
            return;
        };
        if self.drain_on_drop
            && !http_body::Body::is_end_stream(&body)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(drain(body));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_per_source_and_in_total() {
        let gate = ApiConnections::new(ApiConnectionLimits {
            max_total: 4,
            per_source: 2,
        });
        let a: Vec<_> = (0..2)
            .map(|_| gate.try_enter("10.0.0.1".parse().unwrap()).unwrap())
            .collect();
        assert!(gate.try_enter("10.0.0.1".parse().unwrap()).is_none());
        // One IPv6 /64 is one source.
        let _b = gate.try_enter("2001:db8::1".parse().unwrap()).unwrap();
        let _c = gate.try_enter("2001:db8::ffff".parse().unwrap()).unwrap();
        assert!(gate.try_enter("2001:db8::2".parse().unwrap()).is_none());
        assert!(gate.try_enter("10.0.0.9".parse().unwrap()).is_none());
        assert_eq!((gate.open(), gate.refused()), (4, 3));
        drop(a);
        assert_eq!(gate.open(), 2);
        assert!(gate.try_enter("10.0.0.1".parse().unwrap()).is_some());
    }

    #[test]
    fn the_open_file_limit_is_at_least_what_it_was() {
        let before = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
        let after = raise_open_file_limit().unwrap();
        assert!(after >= before.unwrap_or(u64::MAX));
    }
}
