//! SPDY/3.1 for the streaming subresources, as the kubelet speaks it behind the apiserver:
//! an HTTP/1.1 `Upgrade: SPDY/3.1` (or, for port-forward, SPDY carried in the binary
//! messages of a WebSocket whose subprotocol is `SPDY/3.1+portforward.k8s.io`), the stream
//! protocol chosen from the client's `X-Stream-Protocol-Version` headers, then one SPDY
//! stream per channel.
//!
//! - `frame.rs`: frame layout, limits, encode/decode.
//! - `header.rs`: name/value blocks and their zlib contexts; `dictionary.rs`: the preset
//!   dictionary.
//! - `conn.rs`: a server connection (reader, writer, stream table) driving a session.
//! - `tunnel.rs`: the byte stream carried in WebSocket binary messages.
//!
//! The sessions themselves live in `spdy_exec.rs` (exec, attach) and
//! `spdy_portforward.rs`.

pub mod conn;
mod dictionary;
pub mod frame;
pub mod header;
pub mod tunnel;

use std::future::Future;
use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

pub use conn::{Event, Events, Handle};

use crate::State;
use crate::error::ApiError;
use crate::http::{Body, error_response, full};

/// The `Upgrade` token.
pub const UPGRADE: &str = "SPDY/3.1";
/// Request: the stream protocols the client speaks, most wanted first. Response: the one
/// chosen.
pub const PROTOCOL_HEADER: &str = "X-Stream-Protocol-Version";
/// Sent with a 403 when no protocol matches: what the server would have accepted.
pub const ACCEPTED_HEADER: &str = "X-Accepted-Stream-Protocol-Versions";

/// Whether the request asks to upgrade to SPDY/3.1.
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get_all(http::header::UPGRADE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(UPGRADE))
}

/// The stream protocols the client offered, in its order.
pub fn offered(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(PROTOCOL_HEADER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .take(32)
        .collect()
}

/// Picks the client's most wanted protocol that the server supports, like the kubelet's
/// handshake: 400 when the client named none, 403 (with the accepted versions listed in a
/// header) when none matches.
pub fn negotiate(
    headers: &HeaderMap,
    supported: &[&'static str],
) -> Result<&'static str, Box<Response<Body>>> {
    let client = offered(headers);
    if client.is_empty() {
        return Err(Box::new(error_response(&ApiError::bad_request(format!(
            "unable to upgrade: {PROTOCOL_HEADER} is required"
        )))));
    }
    if let Some(p) = client
        .iter()
        .find_map(|c| supported.iter().copied().find(|s| s == c))
    {
        return Ok(p);
    }
    let msg = format!(
        "unable to upgrade: unable to negotiate protocol: client supports [{}], server accepts [{}]",
        client.join(" "),
        supported.join(" ")
    );
    let mut r = error_response(&ApiError::new(403, "Forbidden", msg));
    for s in supported {
        r.headers_mut()
            .append(ACCEPTED_HEADER, HeaderValue::from_static(s));
    }
    Err(Box::new(r))
}

/// Answers 101 and runs `session` over the upgraded connection in a server-owned task,
/// which the server's shutdown ends.
pub fn accept<F, Fut>(
    state: &Arc<State>,
    req: Request<Incoming>,
    protocol: &'static str,
    session: F,
) -> Response<Body>
where
    F: FnOnce(Handle, Events) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let cancel = state.cancel.clone();
    state.spawn(async move {
        let upgraded = tokio::select! {
            _ = cancel.cancelled() => return,
            u = hyper::upgrade::on(req) => match u {
                Ok(u) => u,
                Err(e) => {
                    tracing::debug!(error = %e, "spdy upgrade failed");
                    return;
                }
            },
        };
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = conn::serve(TokioIo::new(upgraded), session) => {}
        }
    });
    let mut r = Response::new(full(""));
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(
        http::header::CONNECTION,
        HeaderValue::from_static("Upgrade"),
    );
    h.insert(http::header::UPGRADE, HeaderValue::from_static(UPGRADE));
    h.insert(PROTOCOL_HEADER, HeaderValue::from_static(protocol));
    r
}

#[cfg(test)]
mod tests;
