//! What every transport provides: the hub opens streams, the agent accepts
//! them.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::io::{AsyncRead, AsyncWrite};

use crate::Result;

/// Boxed future, so the traits stay object-safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Which transport a tunnel runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    Quic,
    H2,
    Ws,
    Mem,
}

impl TransportKind {
    /// The name used in URLs, flags, metrics and ListLinks.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Quic => "quic",
            Self::H2 => "h2",
            Self::Ws => "ws",
            Self::Mem => "mem",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for TransportKind {
    type Err = crate::TunnelError;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "quic" => Ok(Self::Quic),
            "h2" | "tls" => Ok(Self::H2),
            "ws" | "wss" => Ok(Self::Ws),
            other => Err(crate::TunnelError::UnknownTransport(other.to_owned())),
        }
    }
}

/// One bidirectional stream of a tunnel. Dropping it ends the stream; the
/// peer sees end-of-stream or a reset.
pub struct TunnelStream {
    pub send: Box<dyn AsyncWrite + Send + Unpin>,
    pub recv: Box<dyn AsyncRead + Send + Unpin>,
    /// Where a transport that schedules its streams' bytes reads what
    /// [`TunnelStream::continues`] said.
    pub(crate) sent_before: Option<Arc<AtomicU64>>,
    /// The hub's side: set once the tunnel's agent has said, in a response
    /// head, that it takes a FIN right after a request's END as the
    /// request's end and a stop of its answer as the caller gone. From then
    /// on a request that is whole goes with its FIN, instead of the FIN
    /// following once the answer is read: a datagram less each way per
    /// unary call over QUIC. `None` where the agent's side cannot see a
    /// stop (HTTP/2, whose END_STREAM shares the TCP segment the hub sends
    /// anyway, and the in-memory pipes).
    pub(crate) fin_with_request: Option<Arc<AtomicBool>>,
    /// The agent's side: resolves once the hub stops reading the answer (a
    /// QUIC STOP_SENDING, sent when the hub drops an unfinished answer) or
    /// the connection goes. With the request's FIN already in, it is the
    /// only sign left that the caller went away.
    pub(crate) stopped: Option<BoxFuture<'static, ()>>,
}

impl TunnelStream {
    pub fn new(
        send: impl AsyncWrite + Send + Unpin + 'static,
        recv: impl AsyncRead + Send + Unpin + 'static,
    ) -> Self {
        TunnelStream {
            send: Box::new(send),
            recv: Box::new(recv),
            sent_before: None,
            fin_with_request: None,
            stopped: None,
        }
    }

    /// This stream's bytes carry on an upload that has already sent
    /// `bytes` on streams before it (a port-forward's upload path sends
    /// its batches a few at once, each on a stream of its own). Said
    /// before the first write. Over QUIC a stream's bytes yield to those
    /// of streams that have sent less, so the batches of one upload go in
    /// their order; elsewhere it changes nothing.
    pub fn continues(&self, bytes: u64) {
        if let Some(before) = &self.sent_before {
            before.store(bytes, Ordering::Relaxed);
        }
    }
}

impl std::fmt::Debug for TunnelStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TunnelStream")
    }
}

/// The hub's handle on one tunnel connection.
pub trait Opener: Send + Sync + 'static {
    /// Opens a new stream. Never waits for the peer's stream credit: the hub
    /// bounds concurrency itself and refuses beyond it.
    fn open(&self) -> BoxFuture<'_, Result<TunnelStream>>;
    /// Resolves, with the reason, once the connection is gone.
    fn closed(&self) -> BoxFuture<'static, String>;
    /// Closes the connection; streams in flight are ended.
    fn close(&self, reason: &str);
    /// Latest round-trip estimate, if the transport measures one.
    fn rtt(&self) -> Option<Duration>;
    /// A count that grows whenever the peer is heard from (a keepalive
    /// answered, a datagram received): sampled now and then, it tells a
    /// peer that went silent before the keepalive timeout ends the tunnel.
    /// `None` when the transport cannot tell.
    fn heard(&self) -> Option<u64>;
    fn kind(&self) -> TransportKind;
    /// The hub's side of the path's counts (see [`Acceptor::packets`]).
    fn packets(&self) -> Option<PathCounts> {
        None
    }
}

/// The agent's side of a tunnel connection.
pub trait Acceptor: Send + 'static {
    /// The next stream the hub opened; `None` once the connection closed
    /// cleanly.
    fn accept(&mut self) -> BoxFuture<'_, Result<Option<TunnelStream>>>;
    /// Latest round-trip estimate.
    fn rtt(&self) -> Option<Duration>;
    fn kind(&self) -> TransportKind;
    /// Packets sent on the path so far and how many of them were lost,
    /// where the transport sees them (QUIC; TCP keeps its own to itself).
    fn packets(&self) -> Option<PathCounts> {
        None
    }
}

/// A path's packet counts since the tunnel was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathCounts {
    pub sent: u64,
    pub lost: u64,
    /// Datagrams received: both ends keep alive, so on a live path this
    /// grows at least once per keepalive interval however idle the tunnel.
    pub received: u64,
    /// The largest datagram this side sends now, as the path MTU search
    /// has found it.
    pub mtu: u16,
    /// Datagrams this side sent to search the path MTU (each a size not
    /// yet known to get through).
    pub mtu_probes: u64,
    /// Streams this side cut short: the RESET_STREAM and STOP_SENDING
    /// frames it sent. A call that runs to its end closes its stream with
    /// a FIN each way and adds none.
    pub resets_sent: u64,
    /// The same frames, received from the peer.
    pub resets_received: u64,
    /// Datagrams to the peer's address that its host refused (ICMP port
    /// unreachable: nothing listens there any more), where the kernel
    /// reports them; counted per address, so a tunnel dialled again to the
    /// same address sees the earlier ones too.
    pub refused: u64,
}

/// Liveness settings, the same on both ends and on every transport: a
/// keepalive goes out every `interval`, and a tunnel whose keepalive goes
/// unanswered for `timeout` (three intervals, so one or two lost pings are
/// not fatal) is dead. HTTP/2 and WebSocket tunnels apply it to each ping;
/// QUIC as its idle timeout, which restarts with the first keepalive sent
/// after the peer was last heard: the same moment.
#[derive(Debug, Clone, Copy)]
pub struct Keepalive {
    /// A ping goes out this often (both ways).
    pub interval: Duration,
    /// A keepalive unanswered this long means the tunnel is dead.
    pub timeout: Duration,
}

impl Keepalive {
    pub fn every(interval: Duration) -> Self {
        Self {
            interval,
            timeout: interval * 3,
        }
    }
}

impl Default for Keepalive {
    fn default() -> Self {
        Self::every(Duration::from_secs(5))
    }
}

/// A tunnel connection the hub accepted, before it is routed: the caller
/// checks the certificate and decides which cluster it serves.
pub struct Accepted {
    pub opener: std::sync::Arc<dyn Opener>,
    /// The client certificate, already verified against the hub CA by TLS.
    pub peer_cert: Option<rustls::pki_types::CertificateDer<'static>>,
    pub remote: std::net::SocketAddr,
    pub transport: TransportKind,
    /// The tunnel's slot among those being set up; drop it once set up.
    pub admission: Option<crate::pace::Admission>,
    /// When the connection reached the hub (its TCP accept, its first QUIC
    /// packet taken): of two tunnels of one agent, the one that reached
    /// the hub later is the one the agent dialled later.
    pub began: std::time::Instant,
}

/// A connection on the tunnel port that asked for the hub's link API
/// ([`crate::h2::LINK_ALPN`]) rather than for a tunnel: an agent renewing
/// its certificate where the tunnel port is its only way out.
pub struct LinkConn {
    pub io: Box<dyn crate::h2::Io>,
    /// The client certificate, already verified against the hub CA by TLS.
    pub peer_cert: Option<rustls::pki_types::CertificateDer<'static>>,
    pub remote: std::net::SocketAddr,
}

impl std::fmt::Debug for LinkConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkConn")
            .field("remote", &self.remote)
            .finish()
    }
}

impl std::fmt::Debug for Accepted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accepted")
            .field("remote", &self.remote)
            .field("transport", &self.transport)
            .finish()
    }
}
