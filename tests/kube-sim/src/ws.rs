//! WebSocket plumbing for the streaming subresources: protocol negotiation
//! (`v5.channel.k8s.io`, `v4.channel.k8s.io`), the 101 upgrade, and size limits.
//! Messages are binary; the first byte is the channel number.

use std::future::Future;
use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};

use crate::State;
use crate::error::ApiError;
use crate::http::{Body, full};

pub const V5: &str = "v5.channel.k8s.io";
pub const V4: &str = "v4.channel.k8s.io";

/// Channel numbers of remote command streams.
pub const STDIN: u8 = 0;
pub const STDOUT: u8 = 1;
pub const STDERR: u8 = 2;
pub const ERROR: u8 = 3;
pub const RESIZE: u8 = 4;
/// v5: `[255, channel]` closes that channel.
pub const CLOSE: u8 = 255;

pub type Ws = WebSocketStream<TokioIo<Upgraded>>;

/// Largest WebSocket message and frame accepted from a client.
const MAX_MESSAGE: usize = 4 * 1024 * 1024;
const MAX_FRAME: usize = 1024 * 1024;

pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

/// The sub-protocols the client offered, in order.
pub fn offered(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(http::header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Picks the first of `supported` (in our order of preference) the client offered.
pub fn choose(headers: &HeaderMap, supported: &[&'static str]) -> Option<&'static str> {
    let offered = offered(headers);
    supported
        .iter()
        .copied()
        .find(|s| offered.iter().any(|o| o == s))
}

/// Why a request to a streaming endpoint that upgrades to neither WebSocket nor SPDY is
/// refused.
pub fn upgrade_required() -> ApiError {
    ApiError::bad_request(
        "Upgrade request required: streaming subresources need an Upgrade to websocket (v5.channel.k8s.io, v4.channel.k8s.io) or SPDY/3.1",
    )
}

/// Answers 101 and runs `session` on the upgraded connection in a server-owned task.
pub fn accept<F, Fut>(
    state: &Arc<State>,
    req: Request<Incoming>,
    protocol: &'static str,
    session: F,
) -> Result<Response<Body>, ApiError>
where
    F: FnOnce(Ws) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let key = req
        .headers()
        .get(http::header::SEC_WEBSOCKET_KEY)
        .ok_or_else(|| ApiError::bad_request("missing Sec-WebSocket-Key"))?
        .as_bytes()
        .to_vec();
    let accept_key = tokio_tungstenite::tungstenite::handshake::derive_accept_key(&key);
    let cancel = state.cancel.clone();
    state.spawn(async move {
        let upgraded = tokio::select! {
            _ = cancel.cancelled() => return,
            u = hyper::upgrade::on(req) => match u {
                Ok(u) => u,
                Err(e) => {
                    tracing::debug!(error = %e, "websocket upgrade failed");
                    return;
                }
            },
        };
        let config = WebSocketConfig::default()
            .max_message_size(Some(MAX_MESSAGE))
            .max_frame_size(Some(MAX_FRAME));
        let ws =
            WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, Some(config))
                .await;
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = session(ws) => {}
        }
    });
    let mut r = Response::new(full(""));
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(http::header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(
        http::header::CONNECTION,
        HeaderValue::from_static("Upgrade"),
    );
    h.insert(
        http::header::SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_static(protocol),
    );
    if let Ok(v) = HeaderValue::from_str(&accept_key) {
        h.insert(http::header::SEC_WEBSOCKET_ACCEPT, v);
    }
    Ok(r)
}

/// A binary message on a channel.
pub fn frame(channel: u8, data: &[u8]) -> tokio_tungstenite::tungstenite::Message {
    let mut v = Vec::with_capacity(data.len() + 1);
    v.push(channel);
    v.extend_from_slice(data);
    tokio_tungstenite::tungstenite::Message::Binary(v.into())
}

/// The payload of a data message. Text frames count too: the Python client sends stdin as
/// text with the channel as the first character, and the kubelet reads both alike.
pub fn payload(m: &tokio_tungstenite::tungstenite::Message) -> Option<&[u8]> {
    match m {
        tokio_tungstenite::tungstenite::Message::Binary(b) if !b.is_empty() => Some(b.as_ref()),
        tokio_tungstenite::tungstenite::Message::Text(t) if !t.is_empty() => Some(t.as_bytes()),
        _ => None,
    }
}
