//! SPDY inside WebSocket (`SPDY/3.1+portforward.k8s.io`): the binary messages, in order,
//! are the SPDY byte stream; their boundaries mean nothing. A text message is not part of
//! the protocol and ends the tunnel.

use std::future::Future;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use super::conn::{self, Events, Handle};
use crate::ws::Ws;

/// Bytes buffered between the WebSocket and the SPDY connection in each direction.
const PIPE: usize = 64 * 1024;
/// Largest WebSocket message sent.
const CHUNK: usize = 32 * 1024;

/// Runs a SPDY server connection, with `session`, over the byte stream a WebSocket carries.
pub async fn serve<F, Fut>(ws: Ws, session: F)
where
    F: FnOnce(Handle, Events) -> Fut,
    Fut: Future<Output = ()>,
{
    let (near, far) = tokio::io::duplex(PIPE);
    let (mut far_r, mut far_w) = tokio::io::split(far);
    let (mut sink, mut stream) = ws.split();
    let inbound = async move {
        while let Some(m) = stream.next().await {
            match m {
                Ok(Message::Binary(b)) => {
                    if far_w.write_all(&b).await.is_err() {
                        break;
                    }
                }
                Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_)) => {}
                Ok(Message::Text(_) | Message::Close(_)) | Err(_) => break,
            }
        }
        // The SPDY side reads the end of the stream.
        let _ = far_w.shutdown().await;
    };
    let outbound = async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match far_r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let m = Message::Binary(Bytes::copy_from_slice(&buf[..n]));
                    if sink.send(m).await.is_err() {
                        return;
                    }
                }
            }
        }
        let _ = sink
            .send(Message::Close(Some(CloseFrame {
                code: CloseCode::Normal,
                reason: "".into(),
            })))
            .await;
    };
    let spdy = conn::serve(near, session);
    tokio::pin!(inbound, outbound, spdy);
    let mut inbound_done = false;
    loop {
        tokio::select! {
            _ = &mut spdy => break,
            _ = &mut inbound, if !inbound_done => inbound_done = true,
            // The WebSocket cannot be written any more: nothing else matters.
            _ = &mut outbound => return,
        }
    }
    // The SPDY side has closed: send what is left and the close frame, then give the client
    // a moment to answer it.
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), async {
        (&mut outbound).await;
        if !inbound_done {
            (&mut inbound).await;
        }
    })
    .await;
}
