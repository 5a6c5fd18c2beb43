//! WebSocket over TLS: for networks where only HTTPS gets out (corporate
//! proxies, load balancers that speak HTTP/1.1). The WebSocket carries a
//! byte stream, and HTTP/2 runs on it exactly as on the TLS transport, so
//! calls keep their own streams and flow-control windows.
//!
//! It shares the TLS tunnel port: the agent offers ALPN `http/1.1` and asks
//! for an upgrade on [`PATH`]; the hub tells it apart from the HTTP/2
//! transport by ALPN.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::Bytes;
use futures::{Sink, Stream};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::{
    WebSocketStream,
    tungstenite::{Message, protocol::WebSocketConfig},
};
use tokio_util::io::{SinkWriter, StreamReader};

use crate::{Result, TunnelError, h2::Io};

/// ALPN the agent offers for this transport.
pub const ALPN: &[u8] = b"http/1.1";
/// Request path of the tunnel upgrade.
pub const PATH: &str = "/otter/tunnel";
/// Largest WebSocket message either side accepts; HTTP/2 frames are smaller.
pub const MAX_MESSAGE: usize = 1024 * 1024;

/// WebSocket limits of both ends.
pub fn config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(MAX_MESSAGE))
        .max_frame_size(Some(MAX_MESSAGE))
        // The read buffer is allocated whole for every connection: the
        // default 128 KiB would be most of an idle tunnel's memory on the
        // hub. 16 KiB takes one TLS record per read.
        .read_buffer_size(16 * 1024)
}

/// A WebSocket as the byte stream HTTP/2 runs on: tokio-util's reader and
/// writer over [`Messages`].
pub type WsIo<S> = SinkWriter<StreamReader<Messages<S>, Bytes>>;

fn ws_io<S: AsyncRead + AsyncWrite + Unpin>(ws: WebSocketStream<S>) -> WsIo<S> {
    SinkWriter::new(StreamReader::new(Messages(ws)))
}

/// A WebSocket's binary messages as chunks of the byte stream: each write
/// is sent as one binary message, each binary message read is the next
/// chunk. Pings are answered by the WebSocket layer; a close ends the
/// stream.
pub struct Messages<S>(WebSocketStream<S>);

impl<S> std::fmt::Debug for Messages<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Messages")
    }
}

fn ws_err(e: tokio_tungstenite::tungstenite::Error) -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, e)
}

impl<S: AsyncRead + AsyncWrite + Unpin> Stream for Messages<S> {
    type Item = io::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            return Poll::Ready(match ready!(Pin::new(&mut self.0).poll_next(cx)) {
                None | Some(Ok(Message::Close(_))) => None,
                Some(Ok(Message::Binary(b))) => Some(Ok(b)),
                Some(Ok(_)) => continue,
                Some(Err(e)) => Some(Err(ws_err(e))),
            });
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Sink<&[u8]> for Messages<S> {
    type Error = io::Error;

    fn poll_ready(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_ready(cx).map_err(ws_err)
    }

    fn start_send(mut self: Pin<&mut Self>, data: &[u8]) -> io::Result<()> {
        // HTTP/2 writes a frame or less at a time (64 KiB frames); a write
        // the peer would refuse as a message is refused here instead.
        if data.len() > MAX_MESSAGE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "write larger than a WebSocket message may be",
            ));
        }
        Pin::new(&mut self.0)
            .start_send(Message::Binary(Bytes::copy_from_slice(data)))
            .map_err(ws_err)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx).map_err(ws_err)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_close(cx).map_err(ws_err)
    }
}

/// Hub side: completes the upgrade on an accepted TLS connection, refusing
/// any other path.
// The callback's error type is tungstenite's own (an HTTP response).
#[allow(clippy::result_large_err)]
pub async fn accept(io: Box<dyn Io>) -> Result<WsIo<Box<dyn Io>>> {
    use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
    let check = |req: &Request, resp: Response| -> std::result::Result<Response, ErrorResponse> {
        if req.uri().path() == PATH {
            Ok(resp)
        } else {
            let mut e = ErrorResponse::new(Some("not a tunnel endpoint".into()));
            *e.status_mut() = http::StatusCode::NOT_FOUND;
            Err(e)
        }
    };
    let ws = tokio_tungstenite::accept_hdr_async_with_config(io, check, Some(config()))
        .await
        .map_err(|e| TunnelError::protocol(format!("WebSocket upgrade: {e}")))?;
    Ok(ws_io(ws))
}

/// Hub side: answers the upgrade with 503 and the pacer's hint (standard
/// `Retry-After` in whole seconds, rounded up, and the exact milliseconds
/// in [`crate::pace::WS_RETRY_AFTER_MS`]), then closes.
// The callback's error type is tungstenite's own (an HTTP response).
#[allow(clippy::result_large_err)]
pub async fn refuse(io: Box<dyn Io>, after: std::time::Duration) {
    use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
    let refuse = |_: &Request, _: Response| -> std::result::Result<Response, ErrorResponse> {
        let mut e = ErrorResponse::new(Some(crate::pace::reason(after)));
        *e.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
        let secs = after.as_millis().div_ceil(1000).max(1);
        let headers = e.headers_mut();
        if let Ok(v) = http::HeaderValue::from_str(&secs.to_string()) {
            headers.insert(http::header::RETRY_AFTER, v);
        }
        if let Ok(v) = http::HeaderValue::from_str(&after.as_millis().to_string()) {
            headers.insert(crate::pace::WS_RETRY_AFTER_MS, v);
        }
        Err(e)
    };
    let _ = tokio_tungstenite::accept_hdr_async_with_config(io, refuse, Some(config())).await;
}

/// The hint of a refused upgrade: milliseconds when given, else the
/// standard `Retry-After` seconds.
fn refusal_hint(resp: &http::Response<Option<Vec<u8>>>) -> Option<std::time::Duration> {
    if resp.status() != http::StatusCode::SERVICE_UNAVAILABLE {
        return None;
    }
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    header(crate::pace::WS_RETRY_AFTER_MS)
        .map(std::time::Duration::from_millis)
        .or_else(|| header("retry-after").map(std::time::Duration::from_secs))
}

/// Agent side: upgrades a TLS connection to the hub's tunnel WebSocket.
pub async fn connect(io: Box<dyn Io>, host: &str, port: u16) -> Result<WsIo<Box<dyn Io>>> {
    let url = format!("wss://{host}:{port}{PATH}");
    let (ws, _) = tokio_tungstenite::client_async_with_config(url, io, Some(config()))
        .await
        .map_err(|e| match &e {
            tokio_tungstenite::tungstenite::Error::Http(resp) if refusal_hint(resp).is_some() => {
                TunnelError::Refused {
                    retry_after: refusal_hint(resp).unwrap_or_default(),
                }
            }
            _ => TunnelError::protocol(format!("WebSocket upgrade: {e}")),
        })?;
    Ok(ws_io(ws))
}

/// Dials the hub's tunnel port, verifies it with `tls` (which must offer
/// [`ALPN`]), upgrades to the tunnel WebSocket and serves HTTP/2 on it.
pub async fn dial(
    addr: std::net::SocketAddr,
    server_name: rustls::pki_types::ServerName<'static>,
    tls: std::sync::Arc<rustls::ClientConfig>,
    settings: crate::h2::H2Settings,
) -> Result<crate::h2::H2Acceptor> {
    let tcp = tokio::time::timeout(
        settings.connect_timeout,
        tokio::net::TcpStream::connect(addr),
    )
    .await
    .map_err(|_| TunnelError::Timeout("WebSocket tunnel connect"))??;
    let _ = tcp.set_nodelay(true);
    dial_tcp(Box::new(tcp), addr.port(), server_name, tls, settings).await
}

/// Like [`dial`], over a connection already open (through a proxy) to the
/// hub's `port`.
pub async fn dial_tcp(
    tcp: Box<dyn Io>,
    port: u16,
    server_name: rustls::pki_types::ServerName<'static>,
    tls: std::sync::Arc<rustls::ClientConfig>,
    settings: crate::h2::H2Settings,
) -> Result<crate::h2::H2Acceptor> {
    let host = match &server_name {
        rustls::pki_types::ServerName::DnsName(d) => d.as_ref().to_owned(),
        rustls::pki_types::ServerName::IpAddress(ip) => std::net::IpAddr::from(*ip).to_string(),
        _ => "localhost".to_owned(),
    };
    let connect = async {
        let tls = tokio_rustls::TlsConnector::from(tls)
            .connect(server_name, tcp)
            .await?;
        let ws = connect(Box::new(tls), &host, port).await?;
        crate::h2::agent_handshake_as(Box::new(ws), settings, crate::TransportKind::Ws).await
    };
    tokio::time::timeout(settings.connect_timeout, connect)
        .await
        .map_err(|_| TunnelError::Timeout("WebSocket tunnel handshake"))?
}
