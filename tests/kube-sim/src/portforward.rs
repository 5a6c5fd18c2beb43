//! `pods/portforward` over WebSocket (`v4.channel.k8s.io`, as the kubelet speaks it): for
//! port index i, channel 2i carries data and 2i+1 errors; the first message on every
//! channel is the channel byte plus the port (u16, little-endian). Each port connects to
//! the local TCP target the test registered for that pod and port. SPDY (plain, or tunnelled
//! in WebSocket as `SPDY/3.1+portforward.k8s.io`) is handed to `spdy_portforward.rs`.

use std::net::SocketAddr;
use std::sync::Arc;

use futures::{SinkExt, StreamExt};
use http::{Request, Response};
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::State;
use crate::api::load_pod;
use crate::error::ApiError;
use crate::http::{Body, Ctx, ResReq};
use crate::util::str_at;
use crate::ws::{self, frame};
use crate::{spdy, spdy_portforward};

/// Ports one connection may forward (each takes two channels out of 255).
const MAX_PORTS: usize = 64;

pub(crate) fn handle(
    state: Arc<State>,
    ctx: Ctx,
    rr: ResReq,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let pod = load_pod(&state, &rr)?;
    let ns = rr.namespace.clone().unwrap_or_default();
    let name = rr.name.clone().unwrap_or_default();
    let uid = str_at(&pod, "metadata.uid").unwrap_or_default().to_string();
    let target = spdy_portforward::Target {
        namespace: ns.clone(),
        pod: name.clone(),
        uid: uid.clone(),
    };
    // Over SPDY the port travels in each stream's headers; the query is not needed.
    if !ws::is_upgrade(req.headers()) {
        if !spdy::is_upgrade(req.headers()) {
            return Err(ws::upgrade_required());
        }
        let protocol = match spdy::negotiate(req.headers(), &[spdy_portforward::PROTOCOL]) {
            Ok(p) => p,
            Err(r) => return Ok(*r),
        };
        state.record_session("portforward", "spdy", protocol);
        let st = state.clone();
        return Ok(spdy::accept(&state, req, protocol, move |h, ev| {
            spdy_portforward::session(st, h, ev, target)
        }));
    }
    if ws::choose(req.headers(), &[spdy_portforward::TUNNEL_PROTOCOL]).is_some() {
        state.record_session(
            "portforward",
            "spdy-over-websocket",
            spdy_portforward::PROTOCOL,
        );
        let st = state.clone();
        return ws::accept(
            &state,
            req,
            spdy_portforward::TUNNEL_PROTOCOL,
            move |ws| async move {
                spdy::tunnel::serve(ws, move |h, ev| {
                    spdy_portforward::session(st, h, ev, target)
                })
                .await
            },
        );
    }
    let mut ports: Vec<u16> = Vec::new();
    for p in ctx.query.all("ports").iter().flat_map(|v| {
        v.split(',')
            .map(str::trim)
            .map(String::from)
            .collect::<Vec<_>>()
    }) {
        let n: u16 = p
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| ApiError::bad_request(format!("invalid port {p:?}")))?;
        ports.push(n);
    }
    if ports.is_empty() {
        return Err(ApiError::bad_request(
            "query parameter \"port\" is required",
        ));
    }
    if ports.len() > MAX_PORTS {
        return Err(ApiError::bad_request(format!(
            "at most {MAX_PORTS} ports per request"
        )));
    }
    let protocol = ws::choose(req.headers(), &[ws::V4]).ok_or_else(|| {
        ApiError::bad_request(format!(
            "none of the offered subprotocols {:?} is supported (want v4.channel.k8s.io or SPDY/3.1+portforward.k8s.io)",
            ws::offered(req.headers())
        ))
    })?;
    state.record_session("portforward", "websocket", protocol);
    let targets: Vec<Option<SocketAddr>> = {
        let map = state.ports.lock().map(|m| m.clone()).unwrap_or_default();
        ports
            .iter()
            .map(|p| map.get(&(ns.clone(), name.clone(), *p)).copied())
            .collect()
    };
    ws::accept(&state, req, protocol, move |ws| {
        run(ws, ports, targets, uid, ns)
    })
}

/// What the runtime reports when the pod's port cannot be reached.
pub(crate) fn connect_error(port: u16, uid: &str, ns: &str, why: &str) -> String {
    format!(
        "error forwarding port {port} to pod {uid}, uid : failed to connect to localhost:{port} inside namespace \"{ns}\", IPv4: {why}"
    )
}

async fn run(ws: Ws2, ports: Vec<u16>, targets: Vec<Option<SocketAddr>>, uid: String, ns: String) {
    let (mut sink, mut stream) = ws.split();
    for (i, p) in ports.iter().enumerate() {
        let header = p.to_le_bytes();
        for ch in [2 * i as u8, 2 * i as u8 + 1] {
            if sink.send(frame(ch, &header)).await.is_err() {
                return;
            }
        }
    }
    // Everything going to the client funnels through one channel into the sink.
    let (out_tx, mut out_rx) = mpsc::channel::<Message>(64);
    let mut writers: Vec<Option<tokio::net::tcp::OwnedWriteHalf>> = Vec::new();
    let mut readers = tokio::task::JoinSet::new();
    for (i, (port, target)) in ports.iter().zip(targets).enumerate() {
        let data_ch = 2 * i as u8;
        let err_ch = data_ch + 1;
        let conn = match target {
            // Forwarding stays on this machine's loopback, whatever a test registered.
            Some(addr) if addr.ip().is_loopback() => {
                TcpStream::connect(addr).await.map_err(|e| e.to_string())
            }
            Some(_) => Err("target is not a loopback address".to_string()),
            None => Err("connection refused".to_string()),
        };
        match conn {
            Ok(tcp) => {
                let (mut r, w) = tcp.into_split();
                writers.push(Some(w));
                let tx = out_tx.clone();
                readers.spawn(async move {
                    let mut buf = vec![0u8; 32 * 1024];
                    loop {
                        match r.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if tx.send(frame(data_ch, &buf[..n])).await.is_err() {
                                    break;
                                }
                            }
                        }
                    }
                });
            }
            Err(e) => {
                writers.push(None);
                let msg = connect_error(*port, &uid, &ns, &e);
                let _ = out_tx.send(frame(err_ch, msg.as_bytes())).await;
            }
        }
    }
    drop(out_tx);
    let mut all_done = readers.is_empty();
    loop {
        tokio::select! {
            m = out_rx.recv() => match m {
                Some(m) => {
                    if sink.send(m).await.is_err() {
                        return;
                    }
                }
                None => {
                    // Every target closed: end the session.
                    let _ = sink.send(Message::Close(Some(CloseFrame { code: CloseCode::Normal, reason: "".into() }))).await;
                    return;
                }
            },
            _ = readers.join_next(), if !all_done => {
                if readers.is_empty() {
                    all_done = true;
                }
            }
            msg = stream.next() => match msg {
                Some(Ok(m)) if ws::payload(&m).is_some() => {
                    let data = ws::payload(&m).unwrap_or_default();
                    let ch = data[0];
                    let idx = (ch / 2) as usize;
                    if ch.is_multiple_of(2)
                        && let Some(Some(w)) = writers.get_mut(idx)
                            && w.write_all(&data[1..]).await.is_err() {
                                writers[idx] = None;
                            }
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                Some(Ok(_)) => {}
            },
        }
    }
}

type Ws2 = ws::Ws;
