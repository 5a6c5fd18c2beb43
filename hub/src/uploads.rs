//! `WritePortForward` answered from the hub: a port-forward's upload path.
//!
//! The upstream API carries a port-forward's upload as one unary call per
//! chunk, with no sequence number, so a client sends them one after
//! another and pays a round trip to the cluster for each. Far from the
//! cluster, that round trip is the whole rate (256 KiB per 100 ms is
//! 2.6 MB/s). Here the first write of a session goes through to the agent
//! as before: its answer proves the session exists and is the caller's.
//! Every later write of that caller to that session is answered as soon as
//! its bytes are queued, in order, on the session's single upload path,
//! which sends them on in batches (one agent call carries as much as is
//! queued, up to the agent's limit per write), a few batches at once: each
//! names its place on the path, and the agent hands each to the pod only
//! after the one before ([`otter_tunnel::frame::UPLOAD_ORDER_HEADER`]).
//! One batch per round trip was half of kubectl's rate at 100 ms.
//!
//! Bounded: a session queues at most [`SESSION_QUEUE`] bytes and all of
//! them together [`TOTAL_QUEUE`]; a write waits for room (back-pressure),
//! at most [`ROOM_WAIT`]. An upload path that fails (the session ended,
//! the tunnel went) keeps its error for [`FAILED_KEPT`], so the writes
//! after it get that error rather than a stream with a hole in it. A path
//! ends with its session: when the PortForward stream that opened the
//! session ends here ([`SessionEnd`]), or after [`IDLE`] without a write
//! (the stream went through another replica).

use std::{
    collections::HashMap,
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll, ready},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use otter_proto::runtime::v1::{PortForwardResponse, WritePortForwardRequest};
use prost::Message;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::{
    auth::Principal,
    forward::{HttpBody, Sent},
    server::HubState,
};

/// Bytes one session may have queued.
pub const SESSION_QUEUE: usize = 4 * 1024 * 1024;
/// Bytes all sessions together may have queued.
pub const TOTAL_QUEUE: usize = 128 * 1024 * 1024;
/// Upload paths open at once; beyond, writes go through one by one.
pub const MAX_UPLOADS: usize = 4096;
/// Longest a write waits for room in the queue.
pub const ROOM_WAIT: Duration = Duration::from_secs(30);
/// An upload path nobody wrote to for this long is closed.
const IDLE: Duration = Duration::from_secs(60);
/// How long a failed upload path answers with its error.
const FAILED_KEPT: Duration = Duration::from_secs(60);
/// Bound of one call to the agent.
const CALL_DEADLINE: Duration = Duration::from_secs(30);
/// The answer to a WritePortForward is an empty message; anything much
/// larger is not one.
const MAX_ANSWER: usize = 64 * 1024;

/// A session's upload, keyed by session id and the caller's name in the
/// cluster (writes of another caller are that caller's own, and the agent
/// answers them as it sees fit).
type Key = (String, String);

/// Every session's upload path on this replica.
#[derive(Debug)]
pub struct Uploads {
    paths: Mutex<HashMap<Key, Arc<Path>>>,
    total: Arc<Semaphore>,
    stop: CancellationToken,
}

impl Default for Uploads {
    fn default() -> Self {
        Uploads {
            paths: Mutex::default(),
            total: Arc::new(Semaphore::new(TOTAL_QUEUE)),
            stop: CancellationToken::new(),
        }
    }
}

/// One session's queue and what became of it.
#[derive(Debug)]
struct Path {
    queue: mpsc::UnboundedSender<Chunk>,
    room: Arc<Semaphore>,
    failed: Mutex<Option<Status>>,
    /// Cancelled when the session ends or the hub stops.
    ended: CancellationToken,
}

/// Queued bytes and their place in both bounds.
#[derive(Debug)]
struct Chunk {
    data: Bytes,
    _room: OwnedSemaphorePermit,
    _total: OwnedSemaphorePermit,
}

/// Where a write went.
enum Queued {
    Yes,
    /// The path closed under it (it was idle): go through directly.
    Closed,
}

impl Uploads {
    /// Closes every upload path (the hub is stopping).
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Upload paths open now.
    pub fn open(&self) -> usize {
        self.lock().len()
    }

    /// Closes the upload paths of `session` (its stream ended).
    fn end_session(&self, session: &str) {
        self.lock().retain(|(id, _), path| {
            let keep = id != session;
            if !keep {
                path.ended.cancel();
            }
            keep
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Arc<Path>>> {
        self.paths.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Answers one `WritePortForward` of `caller` to `session` on `cluster`
    /// (`prefix`: the whole request message, with its gRPC prefix).
    pub async fn write(
        state: &Arc<HubState>,
        caller: &Principal,
        cluster: &str,
        session: &str,
        parts: http::request::Parts,
        prefix: Bytes,
    ) -> Result<(), Status> {
        let this = &state.uploads;
        let data = WritePortForwardRequest::decode(&prefix[5..])
            .map_err(|e| Status::invalid_argument(format!("request does not decode: {e}")))?
            .data
            .unwrap_or_default();
        if data.len() > otter_tunnel::MAX_SESSION_INPUT {
            return Err(Status::invalid_argument(format!(
                "data chunk of {} bytes is over the limit of {}",
                data.len(),
                otter_tunnel::MAX_SESSION_INPUT
            )));
        }
        let key = (session.to_owned(), caller.cluster_user.clone());
        // A peer's write is a batch of the path on that replica: it goes
        // straight on, in the place that replica gave it.
        let from_peer = parts.extensions.get::<crate::peers::FromPeer>().is_some();
        let path = (!from_peer)
            .then(|| this.lock().get(&key).cloned())
            .flatten();
        if let Some(path) = path {
            if let Some(status) = path.failed() {
                return Err(status);
            }
            if let Queued::Yes = path.enqueue(Bytes::from(data), &this.total).await? {
                return Ok(());
            }
        }
        // Through to the agent, and only then a path of its own: the
        // agent's answer proves the session exists and is this caller's.
        call_agent(state, caller, cluster, parts.clone(), prefix).await?;
        if !from_peer {
            this.open_path(state, caller, cluster, key, parts);
        }
        Ok(())
    }

    fn open_path(
        &self,
        state: &Arc<HubState>,
        caller: &Principal,
        cluster: &str,
        key: Key,
        mut parts: http::request::Parts,
    ) {
        let mut paths = self.lock();
        if paths.len() >= MAX_UPLOADS || paths.contains_key(&key) {
            return;
        }
        // The client's deadline was for its first call; each batch gets
        // its own.
        parts.headers.remove("grpc-timeout");
        let (queue, rx) = mpsc::unbounded_channel();
        let path = Arc::new(Path {
            queue,
            room: Arc::new(Semaphore::new(SESSION_QUEUE)),
            failed: Mutex::new(None),
            ended: self.stop.child_token(),
        });
        paths.insert(key.clone(), path.clone());
        let pump = Pump {
            state: state.clone(),
            caller: caller.clone(),
            cluster: cluster.to_owned(),
            key,
            parts,
            path,
        };
        state.tasks.spawn(pump.run(rx));
    }
}

impl Path {
    fn failed(&self) -> Option<Status> {
        self.failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Queues `data` once there is room for it.
    async fn enqueue(&self, data: Bytes, total: &Arc<Semaphore>) -> Result<Queued, Status> {
        let n = u32::try_from(data.len()).unwrap_or(u32::MAX);
        let room = async {
            let mine = self.room.clone().acquire_many_owned(n).await;
            let all = total.clone().acquire_many_owned(n).await;
            mine.ok().zip(all.ok())
        };
        let Some((room, all)) = tokio::time::timeout(ROOM_WAIT, room).await.map_err(|_| {
            Status::resource_exhausted("the port-forward is not taking input fast enough; retry")
        })?
        else {
            return Ok(Queued::Closed);
        };
        let chunk = Chunk {
            data,
            _room: room,
            _total: all,
        };
        Ok(match self.queue.send(chunk) {
            Ok(()) => Queued::Yes,
            Err(_) => Queued::Closed,
        })
    }
}

/// A write's place on its upload path, `<upload>/<seq>` as the agent
/// reads it ([`otter_tunnel::frame::UPLOAD_ORDER_HEADER`]): set by the
/// path's pump, carried to a peer as that header, never taken from a
/// client. With the bytes the path sent before it, where the pump knows
/// them: the tunnel sends the batch behind requests that sent less
/// ([`otter_tunnel::TunnelStream::continues`]), so a path's batches go in
/// their order. (A peer's copy does not carry them: there the batches go
/// in turn, as other requests.)
#[derive(Debug, Clone)]
pub struct Ordered {
    pub place: String,
    pub sent_before: Option<u64>,
}

/// Writes of one path on their way to the agent at once. Each waits there
/// for the one before, so far from the cluster a path moves this many
/// batches per round trip instead of one. The bytes on their way are
/// bounded by [`SESSION_QUEUE`] anyway; this bounds the calls. It is what
/// the queue holds in a client's usual writes (256 KiB): a batch goes as
/// soon as a call may start, with what is queued at that moment, so with
/// only 4 calls a slot freed by an answer often went to one write and the
/// path kept about half its queue on the way. At 100 ms from the agent,
/// over a 100 Mbit/s link, 4 moved 6.2-7.5 MB/s and 16 moved 8.5-10.5.
const IN_FLIGHT: usize = SESSION_QUEUE / (256 * 1024);

/// Sends one session's queued bytes to its agent, in order.
struct Pump {
    state: Arc<HubState>,
    caller: Principal,
    cluster: String,
    key: Key,
    parts: http::request::Parts,
    path: Arc<Path>,
}

impl Pump {
    async fn run(self, mut rx: mpsc::UnboundedReceiver<Chunk>) {
        let stop = self.path.ended.clone();
        let upload: u64 = rand::random();
        let mut seq = 0u64;
        let mut sent = 0u64;
        let mut carried: Option<Chunk> = None;
        let mut calls = futures::stream::FuturesOrdered::new();
        let idle = tokio::time::sleep(IDLE);
        tokio::pin!(idle);
        // Whether the queue's sender is gone (the path was removed).
        let mut closed = false;
        let failed = loop {
            if calls.len() < IN_FLIGHT
                && let Some(first) = carried.take().or_else(|| rx.try_recv().ok())
            {
                let (data, held) = batch(first, &mut rx, &mut carried);
                let len = data.len() as u64;
                let msg = WritePortForwardRequest {
                    session_id: Some(self.key.0.clone()),
                    data: Some(data.into()),
                };
                let mut parts = self.parts.clone();
                parts.extensions.insert(Ordered {
                    place: format!("{upload:x}/{seq:x}"),
                    sent_before: Some(sent),
                });
                seq += 1;
                sent += len;
                let call = call_agent(
                    &self.state,
                    &self.caller,
                    &self.cluster,
                    parts,
                    crate::resume::framed(&msg.encode_to_vec()),
                );
                // The batch keeps its room in the queue until answered.
                calls.push_back(async move {
                    let r = call.await;
                    drop(held);
                    r
                });
                idle.as_mut().reset(tokio::time::Instant::now() + IDLE);
                continue;
            }
            if closed && calls.is_empty() {
                break None;
            }
            tokio::select! {
                _ = stop.cancelled() => break None,
                Some(sent) = futures::StreamExt::next(&mut calls), if !calls.is_empty() => {
                    if let Err(status) = sent {
                        break Some(status);
                    }
                }
                next = rx.recv(), if !closed && calls.len() < IN_FLIGHT => match next {
                    Some(c) => carried = Some(c),
                    None => closed = true,
                },
                () = &mut idle, if calls.is_empty() => break None,
            }
        };
        if let Some(status) = failed {
            tracing::debug!(cluster = %self.cluster, code = ?status.code(), "port-forward upload failed");
            *self
                .path
                .failed
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(status);
            // What is queued or on its way behind the failure goes nowhere
            // (the agent fails the writes after a failed one).
            drop(calls);
            rx.close();
            drop(carried.take());
            while rx.try_recv().is_ok() {}
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(FAILED_KEPT) => {}
            }
        }
        let mut paths = self.state.uploads.lock();
        if paths
            .get(&self.key)
            .is_some_and(|p| Arc::ptr_eq(p, &self.path))
        {
            paths.remove(&self.key);
        }
        // Closed under the lock: a write that found this path before it
        // was removed sees it closed and goes through directly.
        rx.close();
    }
}

/// `first` and as much as is queued behind it, up to the agent's limit per
/// write (what does not fit is `carried` to the next batch); the chunks'
/// room in the queue is held until the batch is answered.
fn batch(
    first: Chunk,
    rx: &mut mpsc::UnboundedReceiver<Chunk>,
    carried: &mut Option<Chunk>,
) -> (BytesMut, Vec<Chunk>) {
    let limit = otter_tunnel::MAX_SESSION_INPUT;
    let mut data = BytesMut::from(first.data.as_ref());
    let mut held = vec![first];
    while let Ok(next) = rx.try_recv() {
        if data.len() + next.data.len() > limit {
            *carried = Some(next);
            break;
        }
        data.extend_from_slice(&next.data);
        held.push(next);
    }
    (data, held)
}

/// One WritePortForward through to the cluster; its status.
async fn call_agent(
    state: &Arc<HubState>,
    caller: &Principal,
    cluster: &str,
    parts: http::request::Parts,
    message: Bytes,
) -> Result<(), Status> {
    let call = async {
        let empty: HttpBody = http_body_util::Empty::new()
            .map_err(|never| match never {})
            .boxed_unsync();
        let resp = match crate::forward::send(state, caller, cluster, parts, message, empty).await?
        {
            Sent::Tunnel { resp, .. } => {
                resp.map(|b| b.map_err(otter_tunnel::BoxError::from).boxed_unsync())
            }
            Sent::Peer(resp) => resp,
        };
        status_of(resp).await
    };
    tokio::time::timeout(CALL_DEADLINE, call)
        .await
        .map_err(|_| {
            Status::deadline_exceeded(format!("cluster {cluster} did not answer the write"))
        })?
}

/// The gRPC status of a unary answer (trailers-only, or after its body).
async fn status_of(resp: http::Response<HttpBody>) -> Result<(), Status> {
    let ok = |s: Status| match s.code() {
        tonic::Code::Ok => Ok(()),
        _ => Err(s),
    };
    if let Some(status) = Status::from_header_map(resp.headers()) {
        return ok(status);
    }
    let mut body = resp.into_body();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| Status::unavailable(format!("reading the cluster's answer: {e}")))?;
        match frame.into_data() {
            Ok(data) => {
                seen += data.len();
                if seen > MAX_ANSWER {
                    return Err(Status::internal(
                        "the cluster's answer to a write is too large",
                    ));
                }
            }
            Err(frame) => {
                if let Some(status) = frame.trailers_ref().and_then(Status::from_header_map) {
                    return ok(status);
                }
            }
        }
    }
    Err(Status::internal("the cluster's answer carried no status"))
}

/// Watches a PortForward answer for its session id (the first message
/// carries it) and, when the stream ends, closes that session's upload
/// paths on this replica, so none outlives its session.
pub(crate) struct SessionEnd {
    inner: HttpBody,
    state: Arc<HubState>,
    /// The cluster the PortForward went to: only its sessions are ended.
    cluster: String,
    /// The first message's bytes, until it is whole.
    first: Option<BytesMut>,
    session: Option<String>,
}

impl SessionEnd {
    /// The first message of a PortForward answer is a session id and no
    /// data; anything longer is not looked into.
    const MAX_FIRST: usize = 4096;

    pub(crate) fn new(inner: HttpBody, state: Arc<HubState>, cluster: String) -> Self {
        SessionEnd {
            inner,
            state,
            cluster,
            first: Some(BytesMut::new()),
            session: None,
        }
    }

    fn see(&mut self, data: &Bytes) {
        let Some(buf) = &mut self.first else { return };
        let room = (Self::MAX_FIRST + 5).saturating_sub(buf.len());
        buf.extend_from_slice(&data[..data.len().min(room)]);
        if buf.len() < 5 {
            return;
        }
        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        if len > Self::MAX_FIRST || buf[0] != 0 {
            self.first = None;
        } else if buf.len() >= 5 + len {
            self.session = session_of(&self.cluster, &buf[5..5 + len]);
            self.first = None;
        }
    }
}

/// The session id a PortForward's first answer names, if it is one of
/// `cluster`'s (`<cluster>:<random>`). The agent writes that answer: one
/// that names another cluster's session must not end that session's
/// upload (and drop bytes its caller was told were queued).
fn session_of(cluster: &str, first: &[u8]) -> Option<String> {
    let id = PortForwardResponse::decode(first).ok()?.session_id?;
    (id.split_once(':').map(|(c, _)| c) == Some(cluster)).then_some(id)
}

impl Drop for SessionEnd {
    fn drop(&mut self) {
        if let Some(id) = &self.session {
            self.state.uploads.end_session(id);
        }
    }
}

impl Body for SessionEnd {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(f)) = &frame
            && let Some(d) = f.data_ref()
        {
            self.see(d);
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(id: &str) -> Vec<u8> {
        PortForwardResponse {
            session_id: Some(id.to_owned()),
            ..Default::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn only_a_session_of_the_cluster_answering_is_ended() {
        assert_eq!(
            session_of("edge-1", &answer("edge-1:abc")).as_deref(),
            Some("edge-1:abc")
        );
        // A compromised agent of edge-1 naming a session of edge-2.
        assert_eq!(session_of("edge-1", &answer("edge-2:abc")), None);
        assert_eq!(session_of("edge-1", &answer("edge-1")), None);
        assert_eq!(session_of("edge-1", b"\xff\xff not protobuf"), None);
    }
}
