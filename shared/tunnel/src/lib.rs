//! The reverse tunnel: an agent dials out, and the hub then opens one
//! multiplexed stream per forwarded call over that connection.
//!
//! # Layout
//! - [`transport`] — the two halves of a tunnel as traits: the hub's
//!   [`Opener`] and the agent's [`Acceptor`], and the [`TunnelStream`] they
//!   hand out; [`TransportKind`] and the keepalive settings.
//! - [`quic`], [`h2`], [`ws`], [`mem`] — one file per transport: QUIC
//!   streams (quinn), HTTP/2 streams over TLS/TCP (h2), the same HTTP/2 over
//!   a WebSocket (for HTTPS-only networks), and in-memory pipes for tests.
//! - [`pace`] — paced admission: how many tunnels the hub sets up at once,
//!   and the retry-after hint each transport carries to the others;
//!   [`handshakes`] — the bounds on handshakes before a client certificate
//!   is verified (deadline, fair share per source, eviction of the oldest).
//! - [`frame`] — sans-IO framing of a stream: typed, length-prefixed chunks
//!   with hard size limits.
//! - [`http`] — HTTP exchanges over one stream: the hub side
//!   ([`http::forward`]) and the agent side ([`http::serve`]): the
//!   tunnel's two verbs. gRPC
//!   calls ride this unchanged: headers, body frames and trailers pass
//!   through without the hub decoding a message.
//!
//! Roles are reversed on purpose: the agent is the TCP/QUIC client (it dials
//! out through NAT and firewalls), but the hub opens the streams and the agent
//! serves them.

pub mod congestion;
pub mod frame;
pub mod h2;
pub mod handshakes;
pub mod heap;
pub mod http;
pub mod logging;
pub mod mem;
pub mod pace;
pub mod proxy;
pub mod quic;
pub mod reach;
pub mod transport;
mod udp;
pub mod ws;

pub use frame::Caller;

/// Most bytes one write to an exec or port-forward session carries
/// (`WriteTTY`, `WritePortForward`): the agent refuses larger ones, and
/// the hub batches queued port-forward writes up to it.
pub const MAX_SESSION_INPUT: usize = 1024 * 1024;
pub use http::BoxError;
pub use transport::{Acceptor, Keepalive, Opener, PathCounts, TransportKind, TunnelStream};

/// Everything that can go wrong on a tunnel or one of its streams.
#[derive(Debug, thiserror::Error)]
pub enum TunnelError {
    /// Reading or writing the underlying socket or stream failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer broke the stream framing; the stream is closed.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A peer-declared size was over its limit.
    #[error("{what} of {len} bytes is over the limit of {max}")]
    TooLarge {
        what: &'static str,
        len: usize,
        max: usize,
    },
    /// HTTP/2 layer error.
    #[error("HTTP/2: {0}")]
    H2(#[from] ::h2::Error),
    /// QUIC connection error.
    #[error("QUIC: {0}")]
    Quic(#[from] quinn::ConnectionError),
    /// Could not start a QUIC connection.
    #[error("QUIC connect: {0}")]
    QuicConnect(#[from] quinn::ConnectError),
    /// TLS configuration could not be used.
    #[error("TLS: {0}")]
    Tls(String),
    /// The tunnel is closed (or closing) and opens no more streams.
    #[error("tunnel closed: {0}")]
    Closed(String),
    /// Something took longer than its bound.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// The hub is setting up as many tunnels as it will at once; dial again
    /// after `retry_after` (see [`pace`]).
    /// The HTTP proxy did not open the way to the hub (its answer to
    /// CONNECT, credentials named when it asked for them).
    #[error("{0}")]
    Proxy(String),
    /// A log format that is not one of ours.
    #[error("{0:?}: the log format is text or json")]
    UnknownLogFormat(String),
    /// A transport name that is not one of ours.
    #[error("unknown transport {0:?} (quic, h2 or ws)")]
    UnknownTransport(String),
    #[error("the hub is busy admitting other tunnels: retry after {} ms", retry_after.as_millis())]
    Refused { retry_after: std::time::Duration },
}

impl TunnelError {
    /// The hub's retry-after hint, when this is a paced refusal.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            Self::Refused { retry_after } => Some(*retry_after),
            Self::Quic(quinn::ConnectionError::ApplicationClosed(c))
                if c.error_code == quinn::VarInt::from_u32(pace::QUIC_REFUSED) =>
            {
                pace::parse_reason(&String::from_utf8_lossy(&c.reason))
            }
            _ => None,
        }
    }
}

impl TunnelError {
    pub(crate) fn protocol(msg: impl Into<String>) -> Self {
        Self::Protocol(msg.into())
    }

    /// How the tunnel connection ended, as far as the transport can tell
    /// from this error.
    pub fn connection_end(&self) -> ConnectionEnd {
        use quinn::ConnectionError as C;
        match self {
            Self::Quic(C::ApplicationClosed(c)) => {
                ConnectionEnd::PeerClosed(http::clean_reason(&c.reason))
            }
            Self::Quic(C::ConnectionClosed(c)) => {
                ConnectionEnd::PeerClosed(format!("QUIC close: {c}"))
            }
            Self::Quic(C::Reset) => ConnectionEnd::PeerClosed(
                "the hub no longer knows this connection (it restarted)".into(),
            ),
            Self::Quic(C::TimedOut) => ConnectionEnd::Silent("keepalives unanswered".into()),
            // HTTP/2 and WebSocket tunnels end this way when their
            // keepalive goes unanswered.
            Self::Closed(why) => ConnectionEnd::Silent(why.clone()),
            other => ConnectionEnd::Broken(other.to_string()),
        }
    }
}

/// How a tunnel connection ended (see [`TunnelError::connection_end`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionEnd {
    /// The peer closed it in the transport's own authenticated way (QUIC's
    /// close frame), with this reason: over TLS+TCP no such close exists.
    PeerClosed(String),
    /// Keepalives went unanswered: the path went silent.
    Silent(String),
    /// The connection failed or was cut (a reset, a broken pipe).
    Broken(String),
}

/// Result alias for this crate.
pub type Result<T, E = TunnelError> = std::result::Result<T, E>;

/// An error with its causes, which name what failed (a refused connection,
/// a proxy's answer, a certificate) where the outermost text often says
/// only "transport error" or "client error".
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quic_close_is_the_peers_with_its_reason_cleaned() {
        let close = quinn::ConnectionError::ApplicationClosed(quinn::ApplicationClose {
            error_code: quinn::VarInt::from_u32(0),
            reason: bytes::Bytes::from_static(b"hub shutting down\n\x1b[31m"),
        });
        assert_eq!(
            TunnelError::Quic(close).connection_end(),
            ConnectionEnd::PeerClosed("hub shutting down[31m".into())
        );
        assert!(matches!(
            TunnelError::Quic(quinn::ConnectionError::TimedOut).connection_end(),
            ConnectionEnd::Silent(_)
        ));
        assert!(matches!(
            TunnelError::Io(std::io::ErrorKind::ConnectionReset.into()).connection_end(),
            ConnectionEnd::Broken(_)
        ));
    }
}
