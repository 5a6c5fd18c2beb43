//! A Watch through the hub outlives its tunnel. When the cluster's tunnel
//! drops (the agent restarts, the network is cut, the agent moves to
//! another transport or replica), the caller's stream stays open: the hub
//! opens the Watch again on the cluster's next tunnel from the last
//! resourceVersion it passed on, so the caller sees every change once. If
//! that version has expired, the agent's ERROR event (410) tells the caller
//! to list again, as a direct Watch would. The wait is bounded by
//! `watch_resume_grace`; after it the call ends `Unavailable` as before.
//!
//! Only whole messages are passed on, so a message cut by the drop is
//! never half-delivered; it comes again from the resumed Watch.

use std::{
    collections::VecDeque,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use otter_proto::{
    resource::v1::WatchRequest,
    runtime::v1::{PodLogRequest, PodLogResponse},
};
use prost::Message;
use prost_types::Timestamp;
use tonic::{Code, Status};

use crate::{
    auth::Principal,
    forward::{HttpBody, Sent},
    server::HubState,
};

/// The method whose calls are resumed.
pub const WATCH: &str = "/otterscale.resource.v1.ResourceService/Watch";

/// Trailer of a call that ended because its tunnel was lost (value: the
/// cluster): how a replica that passed a Watch to the one holding the
/// tunnel tells that loss from the cluster's own answer.
pub const TUNNEL_LOST: &str = "otter-tunnel-lost";

/// Largest watch event held while the rest of it arrives (an object in
/// etcd is at most 1.5 MiB; its JSON in a Struct is larger).
const MAX_EVENT: usize = 16 * 1024 * 1024;

/// First and longest pause between tries to open the Watch again.
const FIRST_RETRY: Duration = Duration::from_millis(100);
const MAX_RETRY: Duration = Duration::from_secs(2);

/// The one field of a watch event the hub reads.
#[derive(Clone, PartialEq, prost::Message)]
struct EventVersion {
    #[prost(string, optional, tag = "3")]
    resource_version: Option<String>,
}

/// What a resumed call keeps of what it passed on, and the request that
/// goes on from there.
trait Progress: Send + Unpin + 'static {
    /// One whole response message from the cluster (without its gRPC
    /// prefix), read where it lies in the frames it came in; what to pass
    /// on in its place.
    fn take(&mut self, message: Parts<'_>) -> Result<Passed, Status>;
    /// The request message that goes on from what was passed on.
    fn next_request(&mut self) -> Vec<u8>;
}

/// What a resumed call passes on for one message from the cluster.
enum Passed {
    /// The message as it came.
    AsIs,
    /// Another message.
    Instead(Vec<u8>),
    /// Nothing (all of it was passed on before).
    Nothing,
}

/// The method whose followed logs are resumed.
pub const POD_LOG: &str = "/otterscale.runtime.v1.RuntimeService/PodLog";

/// Longest log line held while the rest of it arrives; a longer one is
/// passed on as it is.
const MAX_LINE: usize = 1024 * 1024;

/// A followed log goes on from the time of the last line passed on. The
/// cluster is asked for timestamps; after a resume the lines before that
/// time are skipped, and as many lines of that very time as were passed on
/// (the apiserver's `sinceTime` includes the moment it names).
#[derive(Debug)]
pub struct LogProgress {
    /// The request as sent to the cluster (timestamps on).
    request: PodLogRequest,
    /// Whether the caller asked for timestamps.
    stamped: bool,
    /// The start of a line not yet whole.
    partial: Vec<u8>,
    /// The time of the last line passed on, and how many of that time.
    last: Option<(Timestamp, usize)>,
    /// After a resume: what to skip.
    skip: Option<(Timestamp, usize)>,
}

fn order(a: &Timestamp, b: &Timestamp) -> std::cmp::Ordering {
    (a.seconds, a.nanos).cmp(&(b.seconds, b.nanos))
}

/// The time a log line starts with, and where its text starts.
fn line_time(line: &[u8]) -> Option<(Timestamp, usize)> {
    let space = line.iter().position(|b| *b == b' ')?;
    let at = std::str::from_utf8(&line[..space]).ok()?.parse().ok()?;
    Some((at, space + 1))
}

impl Progress for LogProgress {
    fn take(&mut self, message: Parts<'_>) -> Result<Passed, Status> {
        let data = PodLogResponse::decode(message)
            .map_err(|e| Status::internal(format!("log message from the cluster: {e}")))?
            .data
            .unwrap_or_default();
        self.partial.extend_from_slice(&data);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(end) = self.partial[start..].iter().position(|b| *b == b'\n') {
            let line = &self.partial[start..start + end + 1];
            start += end + 1;
            let Some((at, text)) = line_time(line) else {
                out.extend_from_slice(line);
                continue;
            };
            if let Some((since, n)) = &mut self.skip {
                match order(&at, since) {
                    std::cmp::Ordering::Less => continue,
                    std::cmp::Ordering::Equal if *n > 0 => {
                        *n -= 1;
                        continue;
                    }
                    _ => self.skip = None,
                }
            }
            match &mut self.last {
                Some((t, n)) if order(t, &at).is_eq() => *n += 1,
                _ => self.last = Some((at, 1)),
            }
            out.extend_from_slice(if self.stamped { line } else { &line[text..] });
        }
        self.partial.drain(..start);
        if self.partial.len() > MAX_LINE {
            out.append(&mut self.partial);
        }
        Ok(if out.is_empty() {
            Passed::Nothing
        } else {
            Passed::Instead(PodLogResponse { data: Some(out) }.encode_to_vec())
        })
    }

    fn next_request(&mut self) -> Vec<u8> {
        self.partial.clear();
        let mut request = self.request.clone();
        if let Some((at, n)) = self.last {
            // Whole seconds: that is what reaches the kubelet (kube-rs
            // rounds `sinceTime` to the nearest second, which may be
            // later than `at`); the skip takes out the rest.
            request.since_time = Some(Timestamp {
                seconds: at.seconds,
                nanos: 0,
            });
            request.since_seconds = None;
            request.tail_lines = None;
            self.skip = Some((at, n));
        }
        request.encode_to_vec()
    }
}

/// A Watch goes on from the resourceVersion of the last event passed on.
#[derive(Debug)]
pub struct WatchProgress {
    request: WatchRequest,
    version: Option<String>,
}

impl Progress for WatchProgress {
    fn take(&mut self, message: Parts<'_>) -> Result<Passed, Status> {
        if let Ok(EventVersion {
            resource_version: Some(v),
        }) = EventVersion::decode(message)
        {
            self.version = Some(v);
        }
        Ok(Passed::AsIs)
    }

    fn next_request(&mut self) -> Vec<u8> {
        let mut request = self.request.clone();
        if self.version.is_some() {
            request.resource_version = self.version.clone();
        }
        request.encode_to_vec()
    }
}

/// What opening the call again takes.
struct Reopen {
    state: Arc<HubState>,
    caller: Principal,
    cluster: String,
    parts: http::request::Parts,
}

/// The first gRPC message of `first` (a request's first bytes).
fn first_message(first: &Bytes) -> Option<&[u8]> {
    let len = u32::from_be_bytes(first.get(1..5)?.try_into().ok()?) as usize;
    first.get(5..5 + len)
}

/// A call the hub resumes when its tunnel drops, and what it keeps to do
/// so.
#[derive(Debug)]
pub enum Resumable {
    Watch(WatchProgress),
    Log(LogProgress),
}

impl Resumable {
    /// Whether a call of `path` whose request starts with `first` is one:
    /// a Watch, or a PodLog that follows. With it, the first bytes to send
    /// in place of `first` (a followed log is asked for with timestamps,
    /// which the hub takes off again when the caller did not want them).
    pub fn of(path: &str, first: &Bytes) -> Option<(Resumable, Bytes)> {
        let message = first_message(first)?;
        let rest = first.slice(5 + message.len()..);
        match path {
            WATCH => {
                let request = WatchRequest::decode(message).ok()?;
                let progress = WatchProgress {
                    request,
                    version: None,
                };
                Some((Resumable::Watch(progress), first.clone()))
            }
            POD_LOG => {
                let mut request = PodLogRequest::decode(message).ok()?;
                if request.follow != Some(true) || request.previous == Some(true) {
                    return None;
                }
                let stamped = request.timestamps == Some(true);
                request.timestamps = Some(true);
                let mut sent = BytesMut::from(&framed(&request.encode_to_vec())[..]);
                sent.extend_from_slice(&rest);
                let progress = LogProgress {
                    request,
                    stamped,
                    partial: Vec::new(),
                    last: None,
                    skip: None,
                };
                Some((Resumable::Log(progress), sent.freeze()))
            }
            _ => None,
        }
    }

    /// The answer to the call whose first attempt answered `resp`, resumed
    /// on the cluster's next tunnel whenever this one drops.
    pub fn answer(
        self,
        state: &Arc<HubState>,
        caller: Principal,
        cluster: String,
        parts: http::request::Parts,
        resp: http::Response<HttpBody>,
    ) -> http::Response<HttpBody> {
        match self {
            Resumable::Watch(p) => resuming(state, caller, cluster, parts, p, resp),
            Resumable::Log(p) => resuming(state, caller, cluster, parts, p, resp),
        }
    }
}

fn resuming<P: Progress>(
    state: &Arc<HubState>,
    caller: Principal,
    cluster: String,
    parts: http::request::Parts,
    progress: P,
    resp: http::Response<HttpBody>,
) -> http::Response<HttpBody> {
    // A refusal before anything was passed on (trailers only) is the
    // call's answer.
    if resp.headers().contains_key("grpc-status") {
        return resp;
    }
    let reopen = Arc::new(Reopen {
        state: state.clone(),
        caller,
        cluster,
        parts,
    });
    resp.map(|inner| {
        Resuming {
            inner,
            reopen,
            passing: Passing::new(progress),
            reopening: None,
            done: false,
        }
        .boxed_unsync()
    })
}

impl Reopen {
    /// Opens the call again with `request`, trying until the grace window
    /// closes.
    async fn open(self: Arc<Self>, request: Vec<u8>) -> Result<HttpBody, Status> {
        let grace = self.state.config.watch_resume_grace;
        let deadline = tokio::time::Instant::now() + grace;
        let mut pause = FIRST_RETRY;
        loop {
            let failed = match self.once(&request).await {
                Ok(body) => {
                    self.state.metrics.streams_resumed.inc();
                    tracing::info!(cluster = %self.cluster, method = %self.parts.uri.path(), "call resumed on the cluster's new tunnel");
                    return Ok(body);
                }
                Err(s) if matches!(s.code(), Code::Unavailable | Code::ResourceExhausted) => s,
                Err(s) => return Err(s),
            };
            if tokio::time::Instant::now() + pause >= deadline {
                return Err(Status::unavailable(format!(
                    "tunnel to cluster {} lost and not back within {} s: {}",
                    self.cluster,
                    grace.as_secs(),
                    failed.message()
                )));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_RETRY);
        }
    }

    /// One try: the answer's body, or why there is none.
    async fn once(&self, request: &[u8]) -> Result<HttpBody, Status> {
        let empty = http_body_util::Empty::new()
            .map_err(|never| match never {})
            .boxed_unsync();
        let sent = crate::forward::send(
            &self.state,
            &self.caller,
            &self.cluster,
            self.parts.clone(),
            framed(request),
            empty,
        )
        .await?;
        let resp = match sent {
            Sent::Tunnel { resp, .. } => resp.map(|b| b.map_err(Into::into).boxed_unsync()),
            Sent::Peer(resp) => resp,
        };
        match Status::from_header_map(resp.headers()) {
            Some(status) => Err(status),
            None => Ok(resp.into_body()),
        }
    }
}

/// `message` with its gRPC prefix (uncompressed).
pub(crate) fn framed(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.extend_from_slice(&[0]);
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out.freeze()
}

type Opening = Pin<Box<dyn Future<Output = Result<HttpBody, Status>> + Send>>;

/// Bytes from the cluster not yet passed on, in the frames they came in:
/// a message is held until it is whole, and passed on without a copy. The
/// frames are slices of the tunnel reader's buffers, so what is held keeps
/// those alive: at most [`MAX_EVENT`] and the one buffer being filled.
///
/// Frames under [`SMALL_FRAME`] are copied into a tail instead: an agent
/// sending one-byte frames must not make the hub hold a handle (and a
/// reader buffer) per byte. Each byte is copied once, so holding stays
/// linear in what came, and at most two frames per [`SMALL_FRAME`] are
/// held apart.
#[derive(Debug, Default)]
struct Held {
    frames: VecDeque<Bytes>,
    /// Small frames' bytes after `frames`.
    tail: BytesMut,
    len: usize,
}

impl Held {
    fn push(&mut self, frame: Bytes) {
        if frame.is_empty() {
            return;
        }
        self.len += frame.len();
        if frame.len() < SMALL_FRAME {
            self.tail.extend_from_slice(&frame);
            if self.tail.len() >= TAIL {
                self.frames.push_back(self.tail.split().freeze());
            }
            return;
        }
        if !self.tail.is_empty() {
            self.frames.push_back(self.tail.split().freeze());
        }
        self.frames.push_back(frame);
    }

    /// The held bytes' pieces, in order.
    fn pieces(&self) -> impl Iterator<Item = &[u8]> {
        self.frames
            .iter()
            .map(|f| &f[..])
            .chain(std::iter::once(&self.tail[..]))
    }

    /// The gRPC prefix of the first message (compression flag, length),
    /// once its five bytes are here, wherever the frames cut them.
    fn prefix(&self) -> Option<(u8, usize)> {
        if self.len < 5 {
            return None;
        }
        let mut head = [0u8; 5];
        let mut n = 0;
        for piece in self.pieces() {
            let k = (5 - n).min(piece.len());
            head[n..n + k].copy_from_slice(&piece[..k]);
            n += k;
            if n == 5 {
                break;
            }
        }
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        Some((head[0], len))
    }

    /// The first `n` bytes (no more than are held), as slices of the frames.
    fn split(&mut self, n: usize) -> Vec<Bytes> {
        let mut out = Vec::new();
        let mut left = n.min(self.len);
        self.len -= left;
        while left > 0 {
            let Some(front) = self.frames.front_mut() else {
                out.push(self.tail.split_to(left).freeze());
                break;
            };
            if front.len() <= left {
                left -= front.len();
                out.extend(self.frames.pop_front());
            } else {
                out.push(front.split_to(left));
                left = 0;
            }
        }
        out
    }

    fn clear(&mut self) {
        self.frames.clear();
        self.tail.clear();
        self.len = 0;
    }
}

/// One message's bytes across the frames they came in, read as a [`Buf`]
/// (prost decodes from it; a field it skips is never copied).
pub(crate) struct Parts<'a> {
    parts: &'a [Bytes],
    at: usize,
    offset: usize,
    left: usize,
}

impl<'a> Parts<'a> {
    /// The bytes of `parts` after the first `skip`.
    fn new(parts: &'a [Bytes], skip: usize) -> Self {
        let mut this = Parts {
            parts,
            at: 0,
            offset: 0,
            left: parts.iter().map(Bytes::len).sum(),
        };
        this.advance(skip.min(this.left));
        this
    }
}

impl Buf for Parts<'_> {
    fn remaining(&self) -> usize {
        self.left
    }

    fn chunk(&self) -> &[u8] {
        self.parts.get(self.at).map_or(&[], |p| &p[self.offset..])
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.left, "advanced past the message's end");
        self.left -= cnt;
        while cnt > 0 {
            let here = self.parts[self.at].len() - self.offset;
            if cnt < here {
                self.offset += cnt;
                return;
            }
            cnt -= here;
            self.at += 1;
            self.offset = 0;
        }
    }
}

/// Frames shorter than this are copied into the held tail.
const SMALL_FRAME: usize = 4 * 1024;
/// The tail is held as a frame of its own once this long.
const TAIL: usize = 64 * 1024;

/// Pieces shorter than this are passed on together, copied into one
/// frame, so a run of small events does not become a frame each.
const SMALL_PIECE: usize = 4 * 1024;
/// At most this much is gathered so.
const GATHERED: usize = 16 * 1024;

/// What a resumed call has received and not yet passed on.
struct Passing<P> {
    /// Bytes of messages not yet whole.
    held: Held,
    /// Whole messages' bytes to pass on, in order.
    ready: VecDeque<Bytes>,
    progress: P,
}

impl<P: Progress> Passing<P> {
    fn new(progress: P) -> Self {
        Passing {
            held: Held::default(),
            ready: VecDeque::new(),
            progress,
        }
    }

    /// Takes a frame from the cluster, and the whole messages it completes
    /// through the progress.
    fn push(&mut self, frame: Bytes) -> Result<(), Status> {
        self.held.push(frame);
        while let Some((compressed, len)) = self.held.prefix() {
            if len > MAX_EVENT {
                return Err(Status::resource_exhausted(format!(
                    "streamed message of {len} bytes is over the limit of {MAX_EVENT}"
                )));
            }
            if self.held.len < 5 + len {
                break;
            }
            let message = self.held.split(5 + len);
            if compressed != 0 {
                // Compressed: passed on as it came, not read.
                self.ready.extend(message);
                continue;
            }
            match self.progress.take(Parts::new(&message, 5))? {
                Passed::AsIs => self.ready.extend(message),
                Passed::Instead(other) => self.ready.push_back(framed(&other)),
                Passed::Nothing => {}
            }
        }
        Ok(())
    }

    /// The next bytes to pass on: a piece as it came, or small pieces
    /// gathered into one.
    fn next_ready(&mut self) -> Option<Bytes> {
        let first = self.ready.pop_front()?;
        if first.len() >= SMALL_PIECE || self.ready.front().is_none_or(|b| b.len() >= SMALL_PIECE) {
            return Some(first);
        }
        let mut out = BytesMut::from(&first[..]);
        while let Some(next) = self.ready.front()
            && next.len() < SMALL_PIECE
            && out.len() + next.len() <= GATHERED
        {
            out.extend_from_slice(next);
            self.ready.pop_front();
        }
        Some(out.freeze())
    }
}

struct Resuming<P> {
    inner: HttpBody,
    reopen: Arc<Reopen>,
    passing: Passing<P>,
    reopening: Option<Opening>,
    /// The call's status was passed on.
    done: bool,
}

impl<P: Progress> Resuming<P> {
    /// The tunnel is gone: what was half-received is dropped, and the call
    /// is opened again from what was passed on.
    fn lost(&mut self, why: &dyn std::fmt::Display) {
        tracing::info!(cluster = %self.reopen.cluster, reason = %why, "a resumable call lost its tunnel; resuming");
        self.passing.held.clear();
        // The dead attempt's body holds its call slot and place in the
        // in-flight gauge: let them go while the cluster is away.
        self.inner = http_body_util::Empty::new()
            .map_err(|never| match never {})
            .boxed_unsync();
        let request = self.passing.progress.next_request();
        self.reopening = Some(Box::pin(self.reopen.clone().open(request)));
    }
}

impl<P: Progress> Body for Resuming<P> {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            if let Some(opening) = &mut self.reopening {
                let opened = ready!(opening.as_mut().poll(cx));
                self.reopening = None;
                match opened {
                    Ok(body) => self.inner = body,
                    Err(status) => {
                        self.done = true;
                        return Poll::Ready(Some(Ok(crate::forward::status_trailers(&status))));
                    }
                }
            }
            // Whole messages go out before anything more is read, so a
            // drop noticed on the next read never cuts one.
            if let Some(data) = self.passing.next_ready() {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        if let Err(status) = self.passing.push(data) {
                            return Poll::Ready(Some(Err(Box::new(status))));
                        }
                    }
                    Err(frame) => {
                        // The replica holding the tunnel lost it.
                        if frame
                            .trailers_ref()
                            .is_some_and(|t| t.contains_key(TUNNEL_LOST))
                        {
                            self.lost(&"the replica holding the tunnel lost it");
                            continue;
                        }
                        self.done = true;
                        return Poll::Ready(Some(Ok(frame)));
                    }
                },
                Some(Err(e)) => self.lost(&e),
                None => self.lost(&"the stream ended without a status"),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.passing.ready.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(p: &mut LogProgress, text: &str) -> String {
        let message = PodLogResponse {
            data: Some(text.as_bytes().to_vec()),
        }
        .encode_to_vec();
        match p.take(Parts::new(&[Bytes::from(message)], 0)).unwrap() {
            Passed::Instead(m) => {
                String::from_utf8(PodLogResponse::decode(&m[..]).unwrap().data.unwrap()).unwrap()
            }
            Passed::Nothing => String::new(),
            Passed::AsIs => panic!("log lines are always rewritten"),
        }
    }

    /// A watch event as the hub reads it: a large object, then its
    /// resourceVersion (tag 3).
    #[derive(Clone, PartialEq, prost::Message)]
    struct Event {
        #[prost(bytes = "vec", optional, tag = "2")]
        object: Option<Vec<u8>>,
        #[prost(string, optional, tag = "3")]
        resource_version: Option<String>,
    }

    fn watch_progress() -> WatchProgress {
        WatchProgress {
            request: WatchRequest::default(),
            version: None,
        }
    }

    /// The framed events, and where each ends in the stream.
    fn events(sizes: &[usize]) -> (Vec<u8>, Vec<usize>) {
        let mut stream = Vec::new();
        let mut ends = Vec::new();
        for (i, size) in sizes.iter().enumerate() {
            let event = Event {
                object: Some((0..*size).map(|b| (b * 7 + i) as u8).collect()),
                resource_version: Some(format!("{}", 100 + i)),
            };
            stream.extend_from_slice(&framed(&event.encode_to_vec()));
            ends.push(stream.len());
        }
        (stream, ends)
    }

    #[test]
    fn watch_events_cut_anywhere_pass_on_whole_with_their_version_kept() {
        let (stream, ends) = events(&[0, 3, 40_000, 200, 100_000, 1]);
        // Cuts into two frames around every message's start (its prefix
        // cut too), and frames of a few sizes.
        let mut cuts: Vec<Vec<usize>> = std::iter::once(0)
            .chain(ends.iter().copied())
            .flat_map(|end| end.saturating_sub(3)..end + 7)
            .filter(|c| (1..stream.len()).contains(c))
            .map(|c| vec![c])
            .collect();
        for size in [1, 5, 6, 4096, 16_384, 65_536] {
            cuts.push((size..stream.len()).step_by(size).collect());
        }
        for cut in cuts {
            let mut passing = Passing::new(watch_progress());
            let mut out = Vec::new();
            let mut start = 0;
            for end in cut.into_iter().chain([stream.len()]) {
                passing
                    .push(Bytes::copy_from_slice(&stream[start..end]))
                    .unwrap();
                while let Some(b) = passing.next_ready() {
                    out.extend_from_slice(&b);
                }
                // Only whole messages are passed on.
                assert!(out.is_empty() || ends.contains(&out.len()));
                start = end;
            }
            assert_eq!(out, stream);
            assert_eq!(passing.held.len, 0);
            assert_eq!(passing.progress.version.as_deref(), Some("105"));
        }
    }

    #[test]
    fn an_event_in_one_byte_frames_is_held_in_few_frames_each_byte_copied_once() {
        let (stream, _) = events(&[300_000]);
        let mut passing = Passing::new(watch_progress());
        let mut first_held = None;
        for b in &stream[..stream.len() - 1] {
            passing.push(Bytes::copy_from_slice(&[*b])).unwrap();
            let held = &passing.held;
            assert!(held.frames.len() <= 2 * held.len / SMALL_FRAME + 1);
            // What was held stays where it is: bytes are copied once, not
            // again with every few frames (quadratic in a large event).
            match (first_held, held.frames.front()) {
                (None, Some(f)) => first_held = Some((f.as_ptr(), f.len())),
                (Some(was), f) => assert_eq!(Some(was), f.map(|f| (f.as_ptr(), f.len()))),
                (None, None) => {}
            }
        }
        assert!(first_held.is_some());
        passing
            .push(Bytes::copy_from_slice(&stream[stream.len() - 1..]))
            .unwrap();
        let mut out = Vec::new();
        while let Some(b) = passing.next_ready() {
            out.extend_from_slice(&b);
        }
        assert_eq!(out, stream);
        assert_eq!(passing.held.len, 0);
        assert!(passing.held.tail.is_empty());
    }

    #[test]
    fn a_large_event_passes_on_in_the_frames_it_came_in() {
        let stream = Bytes::from(events(&[300_000]).0);
        let mut passing = Passing::new(watch_progress());
        let frames: Vec<Bytes> = (0..stream.len())
            .step_by(65_536)
            .map(|at| stream.slice(at..(at + 65_536).min(stream.len())))
            .collect();
        for frame in &frames[..frames.len() - 1] {
            passing.push(frame.clone()).unwrap();
            assert!(passing.next_ready().is_none(), "held until whole");
        }
        passing.push(frames[frames.len() - 1].clone()).unwrap();
        // The same memory the frames came in: no copy on the way.
        for frame in &frames {
            let out = passing.next_ready().unwrap();
            assert_eq!(out.as_ptr(), frame.as_ptr());
            assert_eq!(out.len(), frame.len());
        }
        assert!(passing.next_ready().is_none());
        assert_eq!(passing.progress.version.as_deref(), Some("100"));
    }

    #[test]
    fn small_events_pass_on_gathered_and_an_oversized_one_is_refused() {
        let (stream, _) = events(&[10; 300]);
        let mut passing = Passing::new(watch_progress());
        passing.push(Bytes::from(stream.clone())).unwrap();
        let mut pieces = 0;
        let mut out = Vec::new();
        while let Some(b) = passing.next_ready() {
            assert!(b.len() <= GATHERED);
            out.extend_from_slice(&b);
            pieces += 1;
        }
        assert_eq!(out, stream);
        assert!(pieces < 10, "{pieces} pieces for 300 small events");

        let mut passing = Passing::new(watch_progress());
        let mut head = vec![0u8];
        head.extend_from_slice(&((MAX_EVENT + 1) as u32).to_be_bytes());
        let status = passing.push(Bytes::from(head)).unwrap_err();
        assert_eq!(status.code(), Code::ResourceExhausted);
    }

    #[test]
    fn a_resumed_log_passes_each_line_once_and_keeps_lines_whole() {
        let mut p = LogProgress {
            request: PodLogRequest::default(),
            stamped: false,
            partial: Vec::new(),
            last: None,
            skip: None,
        };
        // A line cut between two messages comes out whole, without its time.
        assert_eq!(
            chunk(
                &mut p,
                "2026-01-01T00:00:01.5Z a\n2026-01-01T00:00:01.5Z b\n2026-01-01T00:00:0"
            ),
            "a\nb\n"
        );
        assert_eq!(chunk(&mut p, "2.25Z c\n2026-01-01T00:00:02.25Z c2"), "c\n");
        // The tunnel drops mid-line: the request goes on from the second
        // of the last line passed on, and the half line is forgotten.
        let next = PodLogRequest::decode(&p.next_request()[..]).unwrap();
        let since = next.since_time.unwrap();
        assert_eq!((since.nanos, since.seconds % 60), (0, 2));
        // The cluster sends from that second on: what was passed is skipped.
        assert_eq!(
            chunk(
                &mut p,
                "2026-01-01T00:00:01.5Z b\n2026-01-01T00:00:02.25Z c\n2026-01-01T00:00:02.25Z c2\n2026-01-01T00:00:03Z d\n"
            ),
            "c2\nd\n"
        );
    }
}
