//! `pods/portforward` over SPDY/3.1 (`portforward.k8s.io`), directly or tunnelled in a
//! WebSocket. Every forwarded connection is a pair of client-opened streams sharing a
//! `requestID` header: `streamType: error` (the server writes a failure there, then closes
//! it) and `streamType: data` (the bytes), both naming the pod's `port`. Each complete pair
//! connects to the local listener registered for that port.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::State;
use crate::portforward::connect_error;
use crate::spdy::frame::rst;
use crate::spdy::{Event, Events, Handle};

pub(crate) const PROTOCOL: &str = "portforward.k8s.io";
/// The WebSocket subprotocol of SPDY tunnelled in WebSocket.
pub(crate) const TUNNEL_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";

/// Forwarded connections (stream pairs) at once per client connection.
const MAX_PAIRS: usize = 64;
/// How long the second stream of a pair may take (the kubelet's default).
const PAIR_WAIT: Duration = Duration::from_secs(30);
/// Longest `requestID` accepted.
const MAX_REQUEST_ID: usize = 64;
/// Time to connect to the local target.
const CONNECT_WAIT: Duration = Duration::from_secs(10);
/// Client DATA frames queued for one target (each at most `frame::MAX_DATA`): with
/// `MAX_PAIRS` that bounds what a connection can make this side hold.
const INBOUND_QUEUE: usize = 2;

/// The pod this connection forwards to.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub namespace: String,
    pub pod: String,
    pub uid: String,
}

#[derive(Debug)]
enum Inbound {
    Data(Bytes),
    Fin,
}

#[derive(Debug)]
struct Pair {
    error: Option<u32>,
    data: Option<u32>,
    port: u16,
    since: Instant,
    to_target: Option<mpsc::Sender<Inbound>>,
}

/// The session: pairs streams up and runs one forwarding task per pair; every task ends
/// with the session.
pub(crate) async fn session(state: Arc<State>, h: Handle, mut ev: Events, target: Target) {
    let mut pairs: HashMap<String, Pair> = HashMap::new();
    let mut by_stream: HashMap<u32, String> = HashMap::new();
    let mut tasks: JoinSet<String> = JoinSet::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            e = ev.next() => match e {
                None => return,
                Some(Event::Open { id, headers, .. }) => {
                    let port = headers
                        .get("port")
                        .and_then(|p| p.parse::<u16>().ok())
                        .filter(|p| *p > 0);
                    let kind = headers.get("streamtype").unwrap_or_default().to_string();
                    // Clients too old to send requestID open error and data streams with
                    // consecutive ids: id / 4 pairs them (as the kubelet does).
                    let request = headers
                        .get("requestid")
                        .map(str::to_string)
                        .unwrap_or_else(|| (id / 4).to_string());
                    let (Some(port), true, true) = (
                        port,
                        kind == "error" || kind == "data",
                        request.len() <= MAX_REQUEST_ID,
                    ) else {
                        h.refuse(id, rst::REFUSED_STREAM).await;
                        continue;
                    };
                    if !pairs.contains_key(&request) && pairs.len() >= MAX_PAIRS {
                        h.refuse(id, rst::REFUSED_STREAM).await;
                        continue;
                    }
                    if !h.accept(id).await {
                        continue;
                    }
                    let pair = pairs.entry(request.clone()).or_insert_with(|| Pair {
                        error: None,
                        data: None,
                        port,
                        since: Instant::now(),
                        to_target: None,
                    });
                    let slot = if kind == "error" { &mut pair.error } else { &mut pair.data };
                    if slot.is_some() {
                        let msg = format!(
                            "error processing stream for request {request}: {kind} stream already assigned"
                        );
                        if let Some(e) = pair.error {
                            h.send(e, msg.as_bytes()).await;
                        }
                        h.refuse(id, rst::PROTOCOL_ERROR).await;
                        continue;
                    }
                    *slot = Some(id);
                    if kind == "data" {
                        pair.port = port;
                    }
                    by_stream.insert(id, request.clone());
                    if let (Some(error), Some(data)) = (pair.error, pair.data) {
                        let (tx, rx) = mpsc::channel(INBOUND_QUEUE);
                        pair.to_target = Some(tx);
                        let addr = state
                            .ports
                            .lock()
                            .ok()
                            .and_then(|m| m.get(&(target.namespace.clone(), target.pod.clone(), pair.port)).copied());
                        let fw = Forward { h: h.clone(), error, data, port: pair.port, target: target.clone() };
                        tasks.spawn(async move {
                            fw.run(addr, rx).await;
                            request
                        });
                    }
                }
                Some(Event::Data { id, data }) => {
                    if let Some(tx) = to_target(&pairs, &by_stream, id) {
                        let _ = tx.send(Inbound::Data(data)).await;
                    }
                }
                Some(Event::Fin { id }) => {
                    if let Some(tx) = to_target(&pairs, &by_stream, id) {
                        let _ = tx.send(Inbound::Fin).await;
                    }
                }
                Some(Event::Reset { id }) => {
                    // A reset data stream ends its connection; a reset error stream only
                    // means the client no longer listens there.
                    if let Some(req) = by_stream.get(&id)
                        && pairs.get(req).is_some_and(|p| p.data == Some(id))
                    {
                        let req = req.clone();
                        remove(&mut pairs, &mut by_stream, &req);
                    }
                }
                Some(Event::GoAway) => {}
            },
            done = tasks.join_next(), if !tasks.is_empty() => {
                if let Some(Ok(req)) = done {
                    remove(&mut pairs, &mut by_stream, &req);
                }
            }
            _ = tick.tick() => {
                let stale: Vec<String> = pairs
                    .iter()
                    .filter(|(_, p)| p.to_target.is_none() && p.since.elapsed() > PAIR_WAIT)
                    .map(|(k, _)| k.clone())
                    .collect();
                for req in stale {
                    if let Some(p) = pairs.get(&req) {
                        if let Some(e) = p.error {
                            h.send(e, b"timed out waiting for streams").await;
                            h.finish(e).await;
                        }
                        if let Some(d) = p.data {
                            h.refuse(d, rst::CANCEL).await;
                        }
                    }
                    remove(&mut pairs, &mut by_stream, &req);
                }
            }
        }
    }
}

/// Where a data stream's bytes go (error streams carry nothing from the client).
fn to_target(
    pairs: &HashMap<String, Pair>,
    by_stream: &HashMap<u32, String>,
    id: u32,
) -> Option<mpsc::Sender<Inbound>> {
    let p = pairs.get(by_stream.get(&id)?)?;
    if p.data != Some(id) {
        return None;
    }
    p.to_target.clone()
}

/// Forgets a pair; dropping its sender ends its task's inbound side.
fn remove(pairs: &mut HashMap<String, Pair>, by_stream: &mut HashMap<u32, String>, req: &str) {
    if let Some(p) = pairs.remove(req) {
        for id in [p.error, p.data].into_iter().flatten() {
            by_stream.remove(&id);
        }
    }
}

/// One forwarded connection.
struct Forward {
    h: Handle,
    error: u32,
    data: u32,
    port: u16,
    target: Target,
}

impl Forward {
    async fn fail(&self, why: &str) {
        let msg = connect_error(self.port, &self.target.uid, &self.target.namespace, why);
        self.h.send(self.error, msg.as_bytes()).await;
        self.h.finish(self.error).await;
        self.h.finish(self.data).await;
    }

    async fn run(self, addr: Option<SocketAddr>, mut rx: mpsc::Receiver<Inbound>) {
        let tcp = match addr {
            // Forwarding stays on this machine's loopback, whatever a test registered.
            Some(a) if a.ip().is_loopback() => {
                match tokio::time::timeout(CONNECT_WAIT, TcpStream::connect(a)).await {
                    Ok(Ok(t)) => t,
                    Ok(Err(e)) => return self.fail(&e.to_string()).await,
                    Err(_) => return self.fail("connection timed out").await,
                }
            }
            Some(_) => return self.fail("target is not a loopback address").await,
            None => return self.fail("connection refused").await,
        };
        let (mut r, mut w) = tcp.into_split();
        let mut buf = vec![0u8; 32 * 1024];
        let (mut client_open, mut target_open) = (true, true);
        // Ends when both directions have ended, or the client resets or leaves.
        while client_open || target_open {
            tokio::select! {
                m = rx.recv(), if client_open => match m {
                    Some(Inbound::Data(d)) => {
                        // A target that stopped reading just loses what follows.
                        let _ = w.write_all(&d).await;
                    }
                    Some(Inbound::Fin) => {
                        let _ = w.shutdown().await;
                        client_open = false;
                    }
                    None => return,
                },
                n = r.read(&mut buf), if target_open => match n {
                    Ok(n) if n > 0 => {
                        if !self.h.send(self.data, &buf[..n]).await {
                            return;
                        }
                    }
                    _ => {
                        // The target is done: so are both streams from this side.
                        target_open = false;
                        self.h.finish(self.data).await;
                        self.h.finish(self.error).await;
                    }
                },
            }
        }
    }
}
