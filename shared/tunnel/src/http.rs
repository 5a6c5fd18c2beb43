//! One HTTP exchange per tunnel stream.
//!
//! The hub side ([`forward`]) writes the request head, pumps the request
//! body, and returns the response with a body that reads straight off the
//! stream. The agent side ([`serve`]) rebuilds the request, calls one
//! tower service (the agent's, which dispatches on the request's
//! [`Target`]), and writes the response back,
//! trailers included. gRPC passes through unchanged.
//!
//! Cancellation: the hub keeps its half of the stream open until the
//! response is done. When the caller goes away the hub drops the stream; the
//! agent sees its read side end and drops the service future, which cancels
//! the work (an upstream watch, a log follow, an exec session).

use std::{
    any::Any,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll, ready},
    time::Duration,
};

use bytes::{Buf, Bytes, BytesMut};
use futures::{FutureExt, SinkExt, StreamExt};
use http_body::{Body, Frame};
use prost::Message;
use tokio::{
    io::{AsyncRead, AsyncWrite, AsyncWriteExt},
    sync::{mpsc, oneshot},
};
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::{
    Result, TunnelError,
    frame::{
        Caller, ChunkCodec, ChunkKind, HEADER_LEN, HeaderList, Limits, RequestHead, ResponseHead,
        from_wire, to_wire,
    },
    transport::TunnelStream,
};

/// Boxed error of bodies and services.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long the agent waits for the request head of a new stream.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

type Reader = FramedRead<Box<dyn AsyncRead + Send + Unpin>, ChunkCodec>;
type Writer = FramedWrite<Box<dyn AsyncWrite + Send + Unpin>, ChunkCodec>;

/// Queues `data` as DATA chunks no larger than the limit (the writer
/// flushes by itself past its buffer's bound).
async fn feed_data(writer: &mut Writer, mut data: Bytes, max: usize) -> Result<()> {
    while data.len() > max {
        writer.feed((ChunkKind::Data, data.split_to(max))).await?;
    }
    if !data.is_empty() {
        writer.feed((ChunkKind::Data, data)).await?;
    }
    Ok(())
}

/// Bytes a pump moves in one turn of its worker thread. Neither quinn's
/// streams nor a body whose frames are always ready make a pump wait, and
/// tokio's cooperative budget counts frames, not bytes: with a stream
/// window of megabytes a pump whose peer kept up moved megabytes per turn,
/// and the tasks queued behind it on that worker waited. Beside a bulk
/// Watch over QUIC, small calls through the hub had a p99 of 8 ms, and 2.5
/// ms with turns of a quarter MiB (50-150 µs of copying and encryption);
/// the bulk stream alone kept its rate.
const TURN: usize = 256 * 1024;

/// DATA chunks shorter than this that arrive together reach the hub's
/// caller gathered, up to [`GATHERED`] bytes in one frame.
const SMALL_CHUNK: usize = 4 * 1024;
const GATHERED: usize = 16 * 1024;

/// Counts the bytes a pump moves, to end its turn every [`TURN`].
#[derive(Debug, Default)]
struct Turn {
    moved: usize,
}

impl Turn {
    /// Counts `n` bytes moved; whether the turn is over (counting starts
    /// again).
    fn over(&mut self, n: usize) -> bool {
        self.moved += n;
        let over = self.moved >= TURN;
        if over {
            self.moved = 0;
        }
        over
    }

    /// Counts `n` bytes moved, and yields the worker when the turn is over.
    async fn moved(&mut self, n: usize) {
        if self.over(n) {
            tokio::task::yield_now().await;
        }
    }
}

/// The body's next frame. What is queued is flushed only when the body has
/// nothing ready: a unary exchange (head, message, end or trailers) leaves
/// in one write instead of three, a stream's events still go out at once.
async fn next_frame<B>(
    writer: &mut Writer,
    body: &mut std::pin::Pin<&mut B>,
) -> Result<Option<std::result::Result<Frame<Bytes>, B::Error>>>
where
    B: Body<Data = Bytes>,
{
    // A body that always has a frame ready (a bulk stream from a fast
    // source) into a stream that always has room never returns Pending, and
    // quinn's streams take no part in tokio's cooperative budget: without
    // this, such a pump keeps its worker thread, and the tasks queued behind
    // it (another tunnel's keepalive, say) wait for as long as it lasts.
    tokio::task::coop::consume_budget().await;
    let ready = std::future::poll_fn(|cx| Poll::Ready(body.as_mut().poll_frame(cx))).await;
    match ready {
        Poll::Ready(frame) => Ok(frame),
        Poll::Pending => {
            writer.flush().await?;
            Ok(std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await)
        }
    }
}

// ---------------------------------------------------------------- hub side

/// Sends `req` over `stream` to the agent's service `target` (see
/// [`crate::frame::RequestHead::target`]; empty for its gRPC API) on behalf
/// of `caller`, and returns the agent's response. `guard` (a concurrency permit, a metrics
/// gauge) is held until the response ends or its body is dropped.
pub async fn forward<B>(
    stream: TunnelStream,
    target: &str,
    caller: Option<Caller>,
    req: http::Request<B>,
    limits: Limits,
    guard: Option<Box<dyn Any + Send + Sync>>,
) -> Result<http::Response<ResponseBody>>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send,
{
    let codec = ChunkCodec { limits };
    let (parts, body) = req.into_parts();
    let head = RequestHead {
        method: parts.method.as_str().to_owned(),
        path: parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned(),
        headers: to_wire(&parts.headers),
        caller,
        target: target.to_owned(),
    };
    // Whether a request that is whole may go with its FIN (see
    // `TunnelStream::fin_with_request`): the agent has said so before.
    let learnt = stream.fin_with_request;
    let fin_with_request = learnt.as_ref().is_some_and(|f| f.load(Ordering::Relaxed));
    let mut writer: Writer = FramedWrite::new(stream.send, codec);
    // Queued, not flushed: it leaves with the request's first bytes.
    writer
        .feed((ChunkKind::Open, head.encode_to_vec().into()))
        .await?;

    // What the body has ready goes with the head. A body that is already
    // whole (a unary call: one message, then its end) leaves in one write
    // and needs no task to pump it; the response keeps the writer so the
    // stream stays open until the response is done, unless the agent takes
    // the FIN with the request.
    let mut body = Box::pin(body);
    let (ready, whole) = ready_data(body.as_mut())?;
    // A write that fails here is the pump's failure: the request is cut
    // short and whatever the agent answered (a refusal of the request,
    // say) is still read.
    let written = async {
        for data in ready {
            feed_data(&mut writer, data, limits.max_data).await?;
        }
        if whole {
            writer.feed((ChunkKind::End, Bytes::new())).await?;
            match fin_with_request {
                true => writer.close().await?,
                false => writer.flush().await?,
            }
        }
        Ok::<_, TunnelError>(())
    }
    .await;
    let (sent, done) = match (written, whole) {
        (Ok(()), true) if fin_with_request => (None, None),
        (Ok(()), true) => (Some(writer), None),
        (Ok(()), false) => {
            let (done_tx, done_rx) = oneshot::channel();
            tokio::spawn(pump_request(writer, body, done_rx, limits));
            (None, Some(done_tx))
        }
        (Err(_), _) => (None, None),
    };

    let mut reader: Reader = FramedRead::new(stream.recv, codec);
    let (kind, payload) = reader
        .next()
        .await
        .ok_or_else(|| TunnelError::Closed("stream ended before the response head".into()))??;
    if kind != ChunkKind::Head {
        return Err(TunnelError::protocol(format!(
            "expected response head, got {kind:?}"
        )));
    }
    let head = parse_response_head(payload)?;
    if head.fin_with_request
        && let Some(learnt) = learnt
    {
        learnt.store(true, Ordering::Relaxed);
    }
    let mut response = http::Response::new(ResponseBody {
        reader,
        done,
        sent,
        finished: false,
        turn: Turn::default(),
        turn_over: false,
        small: Small::default(),
        guard,
        end_due: false,
    });
    *response.status_mut() = head.status;
    *response.headers_mut() = head.headers;
    Ok(response)
}

/// A response head as the hub uses it: checked status and headers.
#[derive(Debug)]
pub struct ParsedResponseHead {
    pub status: http::StatusCode,
    pub headers: http::HeaderMap,
    /// See [`ResponseHead::fin_with_request`].
    pub fin_with_request: bool,
}

/// Decodes the payload of a HEAD chunk (what the agent sent) into a status
/// and headers, refusing statuses and headers HTTP does not allow. Public so
/// the fuzz targets feed it exactly what the hub parses.
pub fn parse_response_head(payload: Bytes) -> Result<ParsedResponseHead> {
    let head = ResponseHead::decode(payload)
        .map_err(|e| TunnelError::protocol(format!("response head: {e}")))?;
    // Checked before the cast: a u32 status must not wrap into a valid u16.
    let status = Some(head.status)
        .filter(|s| *s <= 999)
        .and_then(|s| http::StatusCode::from_u16(s as u16).ok())
        .ok_or_else(|| TunnelError::protocol(format!("bad status {}", head.status)))?;
    Ok(ParsedResponseHead {
        status,
        headers: from_wire(head.headers)?,
        fin_with_request: head.fin_with_request,
    })
}

/// Decodes the payload of a TRAILERS chunk.
pub fn parse_trailers(payload: Bytes) -> Result<http::HeaderMap> {
    let list =
        HeaderList::decode(payload).map_err(|e| TunnelError::protocol(format!("trailers: {e}")))?;
    from_wire(list.headers)
}

/// A request head as the agent uses it: checked method, path and headers,
/// and the caller the hub verified.
#[derive(Debug)]
pub struct ParsedRequestHead {
    /// Which of the agent's services (see [`RequestHead::target`]).
    pub target: String,
    pub method: http::Method,
    pub uri: http::Uri,
    pub headers: http::HeaderMap,
    pub caller: Option<Caller>,
}

/// Decodes the payload of an OPEN chunk (what the hub sent). Public so the
/// fuzz targets feed it exactly what the agent parses.
pub fn parse_request_head(payload: Bytes) -> Result<ParsedRequestHead> {
    let head = RequestHead::decode(payload)
        .map_err(|e| TunnelError::protocol(format!("request head: {e}")))?;
    let method = http::Method::from_bytes(head.method.as_bytes())
        .map_err(|_| TunnelError::protocol(format!("bad method {:?}", head.method)))?;
    let uri: http::Uri = head
        .path
        .parse()
        .map_err(|_| TunnelError::protocol(format!("bad path {:?}", head.path)))?;
    Ok(ParsedRequestHead {
        target: head.target,
        method,
        uri,
        headers: from_wire(head.headers)?,
        caller: head.caller,
    })
}

/// The most of a request body [`forward`] takes along with the head; the
/// rest is pumped.
const READY_MAX: usize = 64 * 1024;

/// The data `body` has ready now, without waiting (up to about
/// [`READY_MAX`]), and whether it ended.
fn ready_data<B>(mut body: Pin<&mut B>) -> Result<(Vec<Bytes>, bool)>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let (mut ready, mut len) = (Vec::new(), 0);
    while len < READY_MAX {
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    len += data.len();
                    ready.push(data);
                }
            }
            Poll::Ready(Some(Err(e))) => {
                return Err(TunnelError::Io(std::io::Error::other(e.into())));
            }
            Poll::Ready(None) => return Ok((ready, true)),
            Poll::Pending => break,
        }
    }
    Ok((ready, false))
}

/// Streams the request body to the agent, then holds the stream open until
/// the response is finished (`done` fires) or abandoned (`done` dropped).
async fn pump_request<B>(
    mut writer: Writer,
    body: B,
    mut done: oneshot::Receiver<()>,
    limits: Limits,
) where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send,
{
    let pump = async {
        let mut body = std::pin::pin!(body);
        let mut turn = Turn::default();
        while let Some(frame) = next_frame(&mut writer, &mut body).await? {
            let frame = frame.map_err(|e| TunnelError::Io(std::io::Error::other(e.into())))?;
            if let Ok(data) = frame.into_data() {
                let n = data.len();
                feed_data(&mut writer, data, limits.max_data).await?;
                turn.moved(n).await;
            }
        }
        writer.send((ChunkKind::End, Bytes::new())).await
    };
    tokio::select! {
        r = pump => if r.is_err() {
            // Dropping the writer without END tells the agent the request was cut short.
            return;
        },
        _ = &mut done => return,
    }
    if done.await.is_ok() {
        let _ = writer.close().await;
    }
}

/// Response body read straight off the tunnel stream.
pub struct ResponseBody {
    reader: Reader,
    /// Tells the request's pump the response is done.
    done: Option<oneshot::Sender<()>>,
    /// The request side of a request that went out whole, ended with the
    /// response (dropped unended when the response is abandoned).
    sent: Option<Writer>,
    finished: bool,
    /// Whoever drains the body lets its worker go once a turn's bytes
    /// came through (see [`TURN`]).
    turn: Turn,
    turn_over: bool,
    /// Small frames not yet taken downstream, and what waits behind them.
    small: Small,
    /// Let go when the response ends, before its last frame goes on: a
    /// caller who saw the end and calls again finds the place free.
    guard: Option<Box<dyn Any + Send + Sync>>,
    /// The trailers came and the agent's FIN is still to be read (see
    /// [`ResponseBody::read_end`]).
    end_due: bool,
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        if !self.end_due {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let empty: Box<dyn AsyncRead + Send + Unpin> = Box::new(tokio::io::empty());
        let codec = *self.reader.decoder();
        let mut reader = std::mem::replace(&mut self.reader, FramedRead::new(empty, codec));
        runtime.spawn(async move {
            let _ = tokio::time::timeout(LINGER, reader.next()).await;
        });
    }
}

/// Small frames (under [`SMALL_CHUNK`]) of one response that are still
/// held downstream: the caller's connection counts the bytes it holds for
/// a stream, not the frames, and each frame costs about a hundred bytes of
/// bookkeeping there. An agent sending its answer a byte at a time to a
/// caller that reads nothing made the hub hold 1.2 MiB per stream for its
/// 64 KiB of bytes. With [`SMALL_IN_FLIGHT`] small frames held, what comes
/// next is gathered (copied) until a frame is let go, the gathered bytes
/// reach [`SMALL_CHUNK`], or the response ends.
const SMALL_IN_FLIGHT: usize = 16;

#[derive(Debug, Default)]
struct Small {
    /// Created with the first small frame.
    in_flight: Option<Arc<InFlight>>,
    /// Bytes waiting for a small frame to be let go.
    held: BytesMut,
    /// The end of the response (or a large frame), behind `held`; boxed,
    /// as it is seldom there and a frame is large.
    queued: Option<Box<Option<Result<Frame<Bytes>>>>>,
}

#[derive(Debug, Default)]
struct InFlight {
    count: AtomicUsize,
    waker: futures::task::AtomicWaker,
}

/// A small frame's bytes, counted until the last holder lets them go.
struct Counted {
    bytes: Bytes,
    in_flight: Arc<InFlight>,
}

impl AsRef<[u8]> for Counted {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.in_flight.count.fetch_sub(1, Ordering::AcqRel);
        self.in_flight.waker.wake();
    }
}

impl Small {
    /// Whether another small frame may go now; if not, `cx` is woken when
    /// one is let go.
    fn room(&mut self, cx: &mut Context<'_>) -> bool {
        let f = self.in_flight.get_or_insert_with(Default::default);
        if f.count.load(Ordering::Acquire) < SMALL_IN_FLIGHT {
            return true;
        }
        f.waker.register(cx.waker());
        f.count.load(Ordering::Acquire) < SMALL_IN_FLIGHT
    }

    /// `data` as it goes downstream: counted while held if small.
    fn send(&mut self, data: Bytes) -> Frame<Bytes> {
        if data.len() >= SMALL_CHUNK {
            return Frame::data(data);
        }
        let in_flight = self.in_flight.get_or_insert_with(Default::default).clone();
        in_flight.count.fetch_add(1, Ordering::AcqRel);
        Frame::data(Bytes::from_owner(Counted {
            bytes: data,
            in_flight,
        }))
    }

    /// The held bytes as a frame, when they may go.
    fn release(&mut self, cx: &mut Context<'_>) -> Option<Frame<Bytes>> {
        if self.held.is_empty() || (self.held.len() < SMALL_CHUNK && !self.room(cx)) {
            return None;
        }
        let held = self.held.split().freeze();
        Some(self.send(held))
    }

    /// Puts `next` behind the held bytes, and returns them (or `next` when
    /// nothing is held).
    fn before(&mut self, next: Option<Result<Frame<Bytes>>>) -> Option<Result<Frame<Bytes>>> {
        if self.held.is_empty() {
            return next;
        }
        self.queued = Some(Box::new(next));
        let held = self.held.split().freeze();
        Some(Ok(self.send(held)))
    }
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody")
            .field("finished", &self.finished)
            .finish()
    }
}

impl ResponseBody {
    /// `first` and the small DATA chunks after it already read off the
    /// stream, as one frame. The agent's body decides how its bytes are cut:
    /// one cut into single bytes would otherwise reach the caller's
    /// connection (and anything holding frames) as a frame per byte, each
    /// with its own bookkeeping. Larger chunks pass as they came.
    fn gather(&mut self, first: Bytes) -> Bytes {
        if first.len() >= SMALL_CHUNK {
            return first;
        }
        let max = self.reader.decoder().limits.max_data.min(SMALL_CHUNK - 1);
        let mut out: Option<BytesMut> = None;
        loop {
            let buf = self.reader.read_buffer();
            let Some((kind, len)) = crate::frame::header(buf) else {
                break;
            };
            if kind != ChunkKind::Data as u8 {
                break;
            }
            let so_far = out.as_ref().map_or(first.len(), BytesMut::len);
            if len > max || buf.len() < HEADER_LEN + len || so_far + len > GATHERED {
                break;
            }
            out.get_or_insert_with(|| BytesMut::from(&first[..]))
                .extend_from_slice(&buf[HEADER_LEN..HEADER_LEN + len]);
            self.reader.read_buffer_mut().advance(HEADER_LEN + len);
        }
        out.map_or(first, BytesMut::freeze)
    }

    /// No more frames: the call's places go now, not when the body is
    /// dropped, so a caller who saw the end and calls again finds room.
    fn end(&mut self) {
        self.finished = true;
        self.guard = None;
    }

    /// After the trailers only the agent's FIN may come. Read now if it is
    /// in (it mostly comes in the trailers' datagram), else read when the
    /// body is dropped: a QUIC stream let go before its end is read sends
    /// the agent a STOP_SENDING, which means a caller that left. The FIN
    /// trails the trailers when the agent's connection sends its bytes in
    /// the moment between their write and its end (one call in twenty on
    /// a busy machine).
    fn read_end(&mut self) {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        self.end_due = self.reader.poll_next_unpin(&mut cx).is_pending();
    }

    /// Ended well: the agent's side of the stream is closed too.
    fn finish(&mut self) {
        self.end();
        if let Some(done) = self.done.take() {
            let _ = done.send(());
        }
        if let Some(mut writer) = self.sent.take() {
            // Every transport ends a stream without waiting (a FIN, an empty
            // END_STREAM frame); one that would wait finishes in a task.
            if writer.close().now_or_never().is_none() {
                tokio::spawn(async move {
                    let _ = writer.close().await;
                });
            }
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = TunnelError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>>>> {
        if let Some(queued) = self.small.queued.take() {
            return Poll::Ready(*queued);
        }
        if self.finished {
            return Poll::Ready(None);
        }
        if std::mem::take(&mut self.turn_over) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        loop {
            if let Some(held) = self.small.release(cx) {
                return Poll::Ready(Some(Ok(held)));
            }
            // Counts against the task's budget, as tokio's own sockets do,
            // so whoever drains a bulk response yields now and then (see
            // `next_frame`).
            let coop = ready!(tokio::task::coop::poll_proceed(cx));
            let next = ready!(self.reader.poll_next_unpin(cx));
            coop.made_progress();
            let end = match next {
                None => {
                    self.finish();
                    None
                }
                Some(Ok((ChunkKind::Data, data))) => {
                    let data = self.gather(data);
                    self.turn_over = self.turn.over(data.len());
                    if data.len() >= SMALL_CHUNK {
                        return Poll::Ready(self.small.before(Some(Ok(Frame::data(data)))));
                    }
                    if self.small.held.is_empty() && self.small.room(cx) {
                        return Poll::Ready(Some(Ok(self.small.send(data))));
                    }
                    self.small.held.extend_from_slice(&data);
                    continue;
                }
                Some(Ok((ChunkKind::Trailers, payload))) => {
                    self.finish();
                    self.read_end();
                    Some(parse_trailers(payload).map(Frame::trailers))
                }
                Some(Ok((kind, _))) => {
                    self.end();
                    Some(Err(TunnelError::protocol(format!(
                        "unexpected {kind:?} in response"
                    ))))
                }
                Some(Err(e)) => {
                    self.end();
                    Some(Err(e))
                }
            };
            return Poll::Ready(self.small.before(end));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished && self.small.queued.is_none() && self.small.held.is_empty()
    }
}

// -------------------------------------------------------------- agent side

/// Request body on the agent: DATA chunks handed over by the stream reader.
/// The channel holds at most two chunks, so a service that reads slowly
/// slows the hub down instead of growing memory.
#[derive(Debug)]
pub struct RequestBody {
    rx: mpsc::Receiver<Result<Bytes>>,
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = TunnelError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data)))
    }
}

/// The agent's service a request is for, as the hub named it
/// ([`crate::frame::RequestHead::target`]): in the request's extensions,
/// beside the [`Caller`], so one service dispatches every stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Target(pub String);

impl Target {
    /// The agent's gRPC API (the empty target).
    pub fn is_api(&self) -> bool {
        self.0.is_empty()
    }
}

/// The longest goodbye reason kept; longer ones are cut.
pub const MAX_REASON: usize = 256;

/// A peer's reason as kept and logged: printable characters only (no line
/// breaks or escapes reach a log), at most [`MAX_REASON`] bytes.
pub fn clean_reason(raw: &[u8]) -> String {
    let text = String::from_utf8_lossy(raw);
    let mut out = String::new();
    for c in text.chars().filter(|c| !c.is_control()) {
        if out.len() + c.len_utf8() > MAX_REASON {
            break;
        }
        out.push(c);
    }
    out
}

/// Serves one stream: reads the request head, calls `service` with the
/// request (its [`Caller`] and [`Target`] in the extensions), and writes the
/// response back, trailers included. Returns when the exchange is over or
/// the hub abandoned it.
pub async fn serve<S, B>(stream: TunnelStream, service: S, limits: Limits) -> Result<()>
where
    S: tower_service::Service<http::Request<RequestBody>, Response = http::Response<B>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let codec = ChunkCodec { limits };
    let stopped = stream.stopped;
    let mut reader: Reader = FramedRead::new(stream.recv, codec);
    let (kind, payload) = tokio::time::timeout(HEAD_TIMEOUT, reader.next())
        .await
        .map_err(|_| TunnelError::Timeout("request head"))?
        .ok_or_else(|| TunnelError::Closed("stream ended before the request head".into()))??;
    if kind != ChunkKind::Open {
        return Err(TunnelError::protocol(format!(
            "expected request head, got {kind:?}"
        )));
    }
    let head = parse_request_head(payload)?;

    let (tx, rx) = mpsc::channel(2);
    let mut request = http::Request::new(RequestBody { rx });
    *request.method_mut() = head.method;
    *request.uri_mut() = head.uri;
    *request.headers_mut() = head.headers;
    if let Some(caller) = head.caller {
        request.extensions_mut().insert(caller);
    }
    request.extensions_mut().insert(Target(head.target));

    // The reader feeds the body, then watches for the hub closing its side,
    // which means the caller is gone. It runs in this task beside the
    // exchange, not in one of its own: a unary call's body is in the
    // reader's buffer already, and a second task cost a hand-off per call.
    // Set once the whole request is read: then the stream is worth
    // keeping open for the hub's end (see below).
    let whole = std::sync::atomic::AtomicBool::new(false);
    // Where a stop can be seen, the reader stops at the request's end: a
    // hub that sends its FIN with the request is not taken for a caller
    // leaving (the FIN is read after the answer), and a stop is.
    let watches_stop = stopped.is_some();
    let mut writer: Writer = FramedWrite::new(stream.send, codec);
    let exchange = respond(service, request, &mut writer, limits, watches_stop);
    let mut exchange = std::pin::pin!(exchange);
    let abandoned = || Err(TunnelError::Closed("the hub abandoned the call".into()));
    let read = {
        let reading = async {
            let mut tx = Some(tx);
            loop {
                match (reader.next().await, &tx) {
                    (Some(Ok((ChunkKind::Data, data))), sender) => {
                        // A service that stopped reading the body (or never
                        // read it) just gets no more of it; its call goes on.
                        if let Some(sender) = sender
                            && sender.send(Ok(data)).await.is_err()
                        {
                            tx = None;
                        }
                    }
                    (Some(Ok((ChunkKind::End, _))), _) => {
                        whole.store(true, std::sync::atomic::Ordering::Relaxed);
                        tx = None;
                        if watches_stop {
                            return Read::Whole;
                        }
                    }
                    (next, _) => {
                        if let (Some(sender), Some(Err(e))) = (&tx, next) {
                            let _ = sender.send(Err(e)).await;
                        }
                        return Read::Left;
                    }
                }
            }
        };
        let mut reading = std::pin::pin!(reading);
        tokio::select! {
            biased;
            r = &mut exchange => {
                r?;
                None
            }
            read = &mut reading => Some(read),
        }
    };
    match read {
        Some(Read::Left) => return abandoned(),
        Some(Read::Whole) => {
            let stopped = stopped.unwrap_or_else(|| Box::pin(std::future::pending()));
            tokio::select! {
                biased;
                r = exchange => r?,
                () = stopped => return abandoned(),
            }
        }
        None => {}
    }
    // The hub ends its side once it has read the answer, or has ended it
    // already where it sends its FIN with the request. Waiting for that
    // (briefly) closes the stream with no frame more: dropped now, with
    // the hub's side still open, the stream would be reset (one more
    // frame, in a write of its own over HTTP/2). A request still coming
    // is not waited for: the reset stops it.
    if whole.load(std::sync::atomic::Ordering::Relaxed) {
        let _ = tokio::time::timeout(LINGER, async {
            while let Some(Ok(_)) = reader.next().await {}
        })
        .await;
    }
    Ok(())
}

/// How the reading of a request ended, on the agent's side.
enum Read {
    /// The hub closed its side before the request was whole: the caller
    /// left.
    Left,
    /// The request is whole, and the agent watches for a stop (see
    /// [`ResponseHead::fin_with_request`]) rather than for the hub's FIN.
    Whole,
}

/// How long an answered stream waits for the hub to end its side.
const LINGER: Duration = Duration::from_secs(2);

/// Calls `service` and writes its response: head, data, trailers, end.
async fn respond<S, B>(
    mut service: S,
    request: http::Request<RequestBody>,
    writer: &mut Writer,
    limits: Limits,
    fin_with_request: bool,
) -> Result<()>
where
    S: tower_service::Service<http::Request<RequestBody>, Response = http::Response<B>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    std::future::poll_fn(|cx| service.poll_ready(cx))
        .await
        .map_err(|e| TunnelError::Io(std::io::Error::other(e.into())))?;
    let response = service
        .call(request)
        .await
        .map_err(|e| TunnelError::Io(std::io::Error::other(e.into())))?;
    let (parts, body) = response.into_parts();
    let head = ResponseHead {
        status: u32::from(parts.status.as_u16()),
        headers: to_wire(&parts.headers),
        fin_with_request,
    };
    writer
        .feed((ChunkKind::Head, head.encode_to_vec().into()))
        .await?;
    let mut body = std::pin::pin!(body);
    let mut turn = Turn::default();
    while let Some(frame) = next_frame(writer, &mut body).await? {
        let frame = frame.map_err(|e| TunnelError::Io(std::io::Error::other(e.into())))?;
        match frame.into_data() {
            Ok(data) => {
                let n = data.len();
                feed_data(writer, data, limits.max_data).await?;
                turn.moved(n).await;
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    let list = HeaderList {
                        headers: to_wire(&trailers),
                    };
                    writer
                        .feed((ChunkKind::Trailers, list.encode_to_vec().into()))
                        .await?;
                }
            }
        }
    }
    // What is queued goes out and ends the stream in one write, not a
    // flush and then an end (over HTTP/2, one DATA frame with END_STREAM).
    let last = writer.write_buffer_mut().split();
    let io = writer.get_mut();
    io.write_all(&last).await?;
    io.shutdown().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::{
        convert::Infallible,
        sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        },
    };

    use super::*;

    /// Takes every write at once, as a QUIC stream with window to spare
    /// does: a pump writing into it never waits.
    struct Sink;

    impl AsyncWrite for Sink {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// Answers every request with a body of `frames` frames of 64 KiB,
    /// each ready at once.
    struct Bulk {
        frames: usize,
    }

    type BulkBody = http_body_util::StreamBody<
        futures::stream::Iter<std::vec::IntoIter<std::result::Result<Frame<Bytes>, Infallible>>>,
    >;

    impl tower_service::Service<http::Request<RequestBody>> for Bulk {
        type Response = http::Response<BulkBody>;
        type Error = Infallible;
        type Future = std::future::Ready<std::result::Result<Self::Response, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::result::Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<RequestBody>) -> Self::Future {
            let frames: Vec<_> = (0..self.frames)
                .map(|_| Ok(Frame::data(Bytes::from(vec![7u8; 64 * 1024]))))
                .collect();
            let body = http_body_util::StreamBody::new(futures::stream::iter(frames));
            std::future::ready(Ok(http::Response::new(body)))
        }
    }

    /// A pump whose body always has a frame ready and whose stream always
    /// has room lets other tasks run every quarter MiB; without the turn
    /// it would hold a current-thread runtime for all 4 MiB.
    #[tokio::test(flavor = "current_thread")]
    async fn a_pump_that_never_waits_gives_way_every_turn() {
        let turns = Arc::new(AtomicUsize::new(0));
        let counted = turns.clone();
        let counter = tokio::spawn(async move {
            loop {
                counted.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        });
        tokio::task::yield_now().await;
        let (_tx, rx) = mpsc::channel(1);
        let request = http::Request::new(RequestBody { rx });
        let mut writer: Writer = FramedWrite::new(
            Box::new(Sink) as Box<dyn AsyncWrite + Send + Unpin>,
            ChunkCodec {
                limits: Limits::default(),
            },
        );
        let before = turns.load(Ordering::Relaxed);
        respond(
            Bulk { frames: 64 },
            request,
            &mut writer,
            Limits::default(),
            false,
        )
        .await
        .unwrap();
        let given = turns.load(Ordering::Relaxed) - before;
        counter.abort();
        assert!(
            given > 0 && given + 1 >= 4 * 1024 * 1024 / TURN,
            "{given} turns given"
        );
    }

    /// A service that drops the request unread keeps its call: the rest of
    /// the request and its end are read and dropped, and only the hub
    /// closing its side abandons the call.
    #[tokio::test]
    async fn a_call_whose_request_goes_unread_is_answered() {
        use http_body_util::BodyExt;
        let (hub_send, agent_recv) = tokio::io::duplex(64 * 1024);
        let (agent_send, hub_recv) = tokio::io::duplex(64 * 1024);
        let (unread, go) = told();
        let agent = tokio::spawn(async move {
            let stream = TunnelStream::new(agent_send, agent_recv);
            serve(stream, &unread, Limits::default()).await
        });
        let stream = TunnelStream::new(hub_send, hub_recv);
        let request = http::Request::post("/svc/Call")
            .body(http_body_util::Full::new(Bytes::from_static(b"unread")))
            .unwrap();
        let sending = forward(stream, "", None, request, Limits::default(), None);
        let answering = async {
            // The request and its end reach the agent first.
            tokio::time::sleep(Duration::from_millis(100)).await;
            go.send(()).unwrap();
        };
        let (response, ()) = tokio::join!(sending, answering);
        let body = response.unwrap().into_body().collect().await.unwrap();
        assert_eq!(body.to_bytes(), "answer");
        agent.await.unwrap().unwrap();
    }

    /// One end of a stream as raw chunks: what the other side's `forward`
    /// or `serve` wrote, and what this side writes back.
    struct RawEnd {
        reader: Reader,
        writer: Writer,
    }

    /// A stream between the code under test (its [`TunnelStream`]) and a
    /// raw end played by the test.
    fn raw_pair() -> (TunnelStream, RawEnd) {
        let (tested_send, raw_recv) = tokio::io::duplex(64 * 1024);
        let (raw_send, tested_recv) = tokio::io::duplex(64 * 1024);
        let raw = RawEnd {
            reader: FramedRead::new(Box::new(raw_recv), ChunkCodec::default()),
            writer: FramedWrite::new(Box::new(raw_send), ChunkCodec::default()),
        };
        (TunnelStream::new(tested_send, tested_recv), raw)
    }

    /// [`raw_pair`] whose tested end watches for a stop, and what stops it.
    fn watching_pair() -> (TunnelStream, RawEnd, oneshot::Sender<()>) {
        let (mut stream, raw) = raw_pair();
        let (stop, stopped) = oneshot::channel::<()>();
        stream.stopped = Some(Box::pin(async move {
            let _ = stopped.await;
        }));
        (stream, raw, stop)
    }

    impl RawEnd {
        async fn next(&mut self) -> Option<(ChunkKind, Bytes)> {
            self.reader
                .next()
                .await
                .map(|r| r.expect("a well-formed chunk"))
        }

        /// The agent's head of a 200 answer, queued.
        async fn answer_head(&mut self, fin_with_request: bool) {
            let head = ResponseHead {
                status: 200,
                fin_with_request,
                ..Default::default()
            };
            self.writer
                .feed((ChunkKind::Head, head.encode_to_vec().into()))
                .await
                .unwrap();
        }

        /// The hub's part of a unary call: head, one message, end, and
        /// with `fin` its FIN at once.
        async fn request(&mut self, fin: bool) {
            let head = RequestHead {
                method: "POST".into(),
                path: "/svc/Call".into(),
                ..Default::default()
            };
            self.writer
                .feed((ChunkKind::Open, head.encode_to_vec().into()))
                .await
                .unwrap();
            self.writer
                .feed((ChunkKind::Data, Bytes::from_static(b"question")))
                .await
                .unwrap();
            self.writer
                .send((ChunkKind::End, Bytes::new()))
                .await
                .unwrap();
            if fin {
                self.writer.close().await.unwrap();
            }
        }
    }

    /// The hub's side of a unary call over `stream`: the whole answer, once
    /// it has ended.
    fn hub_asking(
        stream: TunnelStream,
    ) -> tokio::task::JoinHandle<http_body_util::Collected<Bytes>> {
        use http_body_util::BodyExt;
        let request = http::Request::post("/svc/Call")
            .body(http_body_util::Full::new(Bytes::from_static(b"question")))
            .unwrap();
        tokio::spawn(async move {
            let response = forward(stream, "", None, request, Limits::default(), None)
                .await
                .unwrap();
            response.into_body().collect().await.unwrap()
        })
    }

    /// What `forward` sends for a unary call once the agent has said it
    /// takes the FIN with the request: head, message, end and then the
    /// stream's end, all before any answer. The first call learns it from
    /// the agent's answer and still keeps its side open.
    #[tokio::test]
    async fn a_request_sent_whole_goes_with_its_fin_once_the_agent_said_it_may() {
        let learnt = Arc::new(std::sync::atomic::AtomicBool::new(false));
        for call in 0..2 {
            let (mut stream, mut agent) = raw_pair();
            stream.fin_with_request = Some(learnt.clone());
            let hub = hub_asking(stream);
            let kinds: Vec<_> = [agent.next().await, agent.next().await, agent.next().await]
                .into_iter()
                .map(|c| c.expect("a chunk").0)
                .collect();
            assert_eq!(kinds, [ChunkKind::Open, ChunkKind::Data, ChunkKind::End]);
            if call == 1 {
                // The FIN is in before the agent has said a word.
                let fin = tokio::time::timeout(Duration::from_secs(10), agent.next()).await;
                assert!(matches!(fin, Ok(None)), "the request's FIN");
            }
            agent.answer_head(true).await;
            agent
                .writer
                .feed((ChunkKind::Data, Bytes::from_static(b"answer")))
                .await
                .unwrap();
            agent.writer.close().await.unwrap();
            assert_eq!(hub.await.unwrap().to_bytes(), "answer");
            if call == 0 {
                // Read the answer, the hub ends its side.
                assert!(
                    agent.next().await.is_none(),
                    "the hub's FIN after the answer"
                );
                assert!(learnt.load(Ordering::Relaxed), "learnt from the answer");
            }
        }
    }

    /// An agent that sends its trailers and never its FIN holds the hub's
    /// side of the stream for [`LINGER`], no longer: the hub waits that
    /// long for the FIN behind the trailers, then lets the stream go.
    #[tokio::test]
    async fn an_agents_end_that_never_comes_is_waited_for_two_seconds_at_most() {
        let (stream, mut agent) = raw_pair();
        let hub = hub_asking(stream);
        for _ in 0..3 {
            agent.next().await.expect("the request's chunks");
        }
        let trailers = HeaderList {
            headers: to_wire(&http::HeaderMap::from_iter([(
                http::header::HeaderName::from_static("grpc-status"),
                http::HeaderValue::from_static("0"),
            )])),
        };
        agent.answer_head(false).await;
        agent
            .writer
            .send((ChunkKind::Trailers, trailers.encode_to_vec().into()))
            .await
            .unwrap();
        let answer = hub.await.unwrap();
        let trailers = answer.trailers().expect("the trailers");
        assert_eq!(trailers["grpc-status"], "0");
        // The answer is done and its body dropped; the stream is still
        // read (a byte of a chunk header goes in)...
        let raw = agent.writer.get_mut();
        raw.write_all(&[ChunkKind::Data as u8]).await.unwrap();
        raw.flush().await.unwrap();
        // ... until the wait is over.
        tokio::time::sleep(LINGER + Duration::from_millis(100)).await;
        let late = raw.write_all(&[0]).await;
        assert!(late.is_err(), "the hub still holds the stream: {late:?}");
    }

    /// Answers `answer` once told to, without reading the request; records
    /// when its call is dropped (answered or not).
    struct Told {
        go: std::sync::Mutex<Option<oneshot::Receiver<()>>>,
        dropped: Arc<std::sync::atomic::AtomicBool>,
    }

    struct DropFlag(Arc<std::sync::atomic::AtomicBool>);

    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    impl tower_service::Service<http::Request<RequestBody>> for &Told {
        type Response = http::Response<http_body_util::Full<Bytes>>;
        type Error = Infallible;
        type Future =
            futures::future::BoxFuture<'static, std::result::Result<Self::Response, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::result::Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<RequestBody>) -> Self::Future {
            let go = self.go.lock().unwrap().take().unwrap();
            let flag = DropFlag(self.dropped.clone());
            Box::pin(async move {
                let _flag = flag;
                let _ = go.await;
                let answer = http_body_util::Full::new(Bytes::from_static(b"answer"));
                Ok(http::Response::new(answer))
            })
        }
    }

    fn told() -> (Told, oneshot::Sender<()>) {
        let (go, went) = oneshot::channel();
        let told = Told {
            go: std::sync::Mutex::new(Some(went)),
            dropped: Arc::default(),
        };
        (told, go)
    }

    /// An agent that watches for a stop says so in its answer's head,
    /// answers a request that came with its FIN, and gives the call up
    /// only when its answer is stopped.
    #[tokio::test]
    async fn an_agent_watching_for_a_stop_answers_a_request_that_came_with_its_fin() {
        // Answered.
        let (stream, mut hub, stop) = watching_pair();
        let (service, go) = told();
        let serving = async {
            hub.request(true).await;
            // The request and its FIN are in before the answer is let go.
            tokio::time::sleep(Duration::from_millis(50)).await;
            go.send(()).unwrap();
            let (kind, head) = hub.next().await.unwrap();
            assert_eq!(kind, ChunkKind::Head);
            assert!(ResponseHead::decode(head).unwrap().fin_with_request);
            assert_eq!(hub.next().await.unwrap().1, "answer");
            assert!(hub.next().await.is_none(), "the agent's FIN");
        };
        let (served, ()) = tokio::join!(serve(stream, &service, Limits::default()), serving);
        served.unwrap();
        drop(stop);

        // Stopped mid-call: the call is given up and its work dropped.
        let (stream, mut hub, stop) = watching_pair();
        let (service, _go) = told();
        let stopping = async {
            hub.request(true).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(!service.dropped.load(Ordering::SeqCst), "still at work");
            stop.send(()).unwrap();
        };
        let (served, ()) = tokio::join!(serve(stream, &service, Limits::default()), stopping);
        assert!(matches!(served, Err(TunnelError::Closed(_))), "{served:?}");
        assert!(
            service.dropped.load(Ordering::SeqCst),
            "the call's work is dropped"
        );
    }

    /// An agent that cannot see a stop says nothing in its heads and takes
    /// a FIN right after the request as its caller gone, as agents always
    /// did: a hub must not send it the FIN early.
    #[tokio::test]
    async fn an_agent_not_watching_for_a_stop_takes_an_early_fin_as_the_caller_gone() {
        let (stream, mut hub) = raw_pair();
        let (service, _go) = told();
        let (served, ()) = tokio::join!(
            serve(stream, &service, Limits::default()),
            hub.request(true)
        );
        assert!(matches!(served, Err(TunnelError::Closed(_))), "{served:?}");
        assert!(service.dropped.load(Ordering::SeqCst));

        let (stream, mut hub) = raw_pair();
        let (service, go) = told();
        go.send(()).unwrap();
        let asking = async {
            hub.request(false).await;
            let (_, head) = hub.next().await.unwrap();
            assert!(!ResponseHead::decode(head).unwrap().fin_with_request);
            hub.writer.close().await.unwrap();
        };
        let (served, ()) = tokio::join!(serve(stream, &service, Limits::default()), asking);
        served.unwrap();
    }

    /// A response body reading `wire` (chunks as the agent writes them).
    fn body_reading(wire: Vec<u8>) -> ResponseBody {
        let source: Box<dyn AsyncRead + Send + Unpin> = Box::new(std::io::Cursor::new(wire));
        ResponseBody {
            reader: FramedRead::new(source, ChunkCodec::default()),
            done: None,
            sent: None,
            finished: false,
            turn: Turn::default(),
            turn_over: false,
            small: Small::default(),
            guard: None,
            end_due: false,
        }
    }

    #[tokio::test]
    async fn small_chunks_read_together_reach_the_caller_as_one_frame() {
        use http_body_util::BodyExt;

        let mut wire = bytes::BytesMut::new();
        let mut put = |kind, payload: &[u8]| {
            tokio_util::codec::Encoder::encode(
                &mut ChunkCodec::default(),
                (kind, Bytes::copy_from_slice(payload)),
                &mut wire,
            )
            .unwrap();
        };
        let sent: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
        // One-byte chunks, a large one, a few more small ones.
        for b in &sent[..30_000] {
            put(ChunkKind::Data, &[*b]);
        }
        put(ChunkKind::Data, &sent[30_000..39_990]);
        for b in &sent[39_990..] {
            put(ChunkKind::Data, &[*b]);
        }
        let trailers = HeaderList {
            headers: to_wire(&http::HeaderMap::from_iter([(
                http::header::HeaderName::from_static("grpc-status"),
                http::HeaderValue::from_static("0"),
            )])),
        };
        put(ChunkKind::Trailers, &trailers.encode_to_vec());
        let mut body = body_reading(wire.to_vec());
        let (mut got, mut frames, mut status) = (Vec::new(), Vec::new(), None);
        while let Some(frame) = body.frame().await {
            match frame.unwrap().into_data() {
                Ok(data) => {
                    frames.push(data.len());
                    got.extend_from_slice(&data);
                }
                Err(frame) => status = frame.into_trailers().ok(),
            }
        }
        assert_eq!(got, sent, "every byte, in order");
        assert!(frames.iter().all(|n| *n <= GATHERED), "{frames:?}");
        // 30,010 one-byte chunks in as many frames as reads of the stream
        // (8 KiB each, so about 1,400 chunks a frame); the large chunk as
        // it came.
        assert!(frames.len() < 100, "{} frames", frames.len());
        assert!(frames.contains(&9_990), "{frames:?}");
        assert_eq!(status.unwrap()["grpc-status"], "0");
    }

    /// The call's place is free once its last frame is handed on, with the
    /// body still held: a caller who saw the end and calls again gets in.
    #[tokio::test]
    async fn the_guard_is_let_go_with_the_last_frame() {
        use http_body_util::BodyExt;

        let mut wire = bytes::BytesMut::new();
        for (kind, payload) in [
            (ChunkKind::Data, &b"answer"[..]),
            (
                ChunkKind::Trailers,
                &HeaderList::default().encode_to_vec()[..],
            ),
        ] {
            tokio_util::codec::Encoder::encode(
                &mut ChunkCodec::default(),
                (kind, Bytes::copy_from_slice(payload)),
                &mut wire,
            )
            .unwrap();
        }
        let place = Arc::new(());
        let mut body = body_reading(wire.to_vec());
        body.guard = Some(Box::new(place.clone()));
        let data = body.frame().await.unwrap().unwrap();
        assert_eq!(data.into_data().unwrap(), "answer");
        assert_eq!(Arc::strong_count(&place), 2, "held while the answer runs");
        let last = body.frame().await.unwrap().unwrap();
        assert!(last.is_trailers());
        assert_eq!(Arc::strong_count(&place), 1, "let go with the trailers");
        assert!(body.frame().await.is_none());
    }

    /// A stream that hands over one chunk per read, with nothing ready in
    /// between: an agent sending its bytes one at a time.
    struct OneAtATime {
        chunks: std::collections::VecDeque<Vec<u8>>,
        ready: bool,
    }

    impl AsyncRead for OneAtATime {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            if !std::mem::replace(&mut self.ready, false) {
                self.ready = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if let Some(mut chunk) = self.chunks.pop_front() {
                let n = chunk.len().min(buf.remaining());
                buf.put_slice(&chunk[..n]);
                if n < chunk.len() {
                    self.chunks.push_front(chunk.split_off(n));
                }
            }
            Poll::Ready(Ok(()))
        }
    }

    /// The response's bytes and how many data frames carried them, for
    /// `sent` trickled a byte per chunk; `keep` holds every frame as a
    /// caller's connection that takes nothing would.
    async fn trickled(sent: &[u8], keep: bool) -> (Vec<u8>, usize) {
        use http_body_util::BodyExt;
        let encode = |kind, payload: &[u8]| {
            let mut wire = bytes::BytesMut::new();
            tokio_util::codec::Encoder::encode(
                &mut ChunkCodec::default(),
                (kind, Bytes::copy_from_slice(payload)),
                &mut wire,
            )
            .unwrap();
            wire.to_vec()
        };
        let mut chunks: std::collections::VecDeque<_> = sent
            .iter()
            .map(|b| encode(ChunkKind::Data, &[*b]))
            .collect();
        let trailers = HeaderList {
            headers: to_wire(&http::HeaderMap::from_iter([(
                http::header::HeaderName::from_static("grpc-status"),
                http::HeaderValue::from_static("0"),
            )])),
        };
        chunks.push_back(encode(ChunkKind::Trailers, &trailers.encode_to_vec()));
        let mut body = body_reading(Vec::new());
        body.reader = FramedRead::new(
            Box::new(OneAtATime {
                chunks,
                ready: false,
            }),
            ChunkCodec::default(),
        );
        let (mut got, mut frames, mut kept) = (Vec::new(), 0, Vec::new());
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame.unwrap().into_data() else {
                break;
            };
            frames += 1;
            got.extend_from_slice(&data);
            if keep {
                kept.push(data);
            }
        }
        (got, frames)
    }

    #[tokio::test]
    async fn small_frames_held_downstream_are_bounded_and_the_rest_gathered() {
        let sent: Vec<u8> = (0..3_000u32).map(|i| (i % 251) as u8).collect();
        // Taken as they come: each byte in a frame of its own, at once.
        let (got, frames) = trickled(&sent, false).await;
        assert_eq!(got, sent, "every byte, in order");
        assert_eq!(frames, sent.len());
        // Held downstream: sixteen frames, then the rest gathered, here
        // (under 4 KiB) let go with the response's end.
        let (got, frames) = trickled(&sent, true).await;
        assert_eq!(got, sent, "every byte, in order");
        assert_eq!(frames, SMALL_IN_FLIGHT + 1);
        // Over 4 KiB held: a frame of their own each time they reach it.
        let sent: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        let (got, frames) = trickled(&sent, true).await;
        assert_eq!(got, sent, "every byte, in order");
        assert_eq!(
            frames,
            SMALL_IN_FLIGHT + (20_000 - SMALL_IN_FLIGHT).div_ceil(SMALL_CHUNK)
        );
    }

    /// The hub's side: a response read off a stream that always has the
    /// next chunk lets whoever drains it go every quarter MiB, and wakes
    /// it at once to go on.
    #[test]
    fn a_response_read_off_a_stream_that_never_waits_gives_way_every_turn() {
        let codec = ChunkCodec {
            limits: Limits::default(),
        };
        let mut wire = bytes::BytesMut::new();
        let chunks = 64;
        for _ in 0..chunks {
            tokio_util::codec::Encoder::encode(
                &mut codec.clone(),
                (ChunkKind::Data, Bytes::from(vec![7u8; 64 * 1024])),
                &mut wire,
            )
            .unwrap();
        }
        let mut body = body_reading(wire.freeze().to_vec());
        let woken = Arc::new(AtomicUsize::new(0));
        struct Count(Arc<AtomicUsize>);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let waker = std::task::Waker::from(Arc::new(Count(woken.clone())));
        let mut cx = Context::from_waker(&waker);
        let (mut data, mut pending) = (0, 0);
        loop {
            match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(frame))) => data += frame.into_data().unwrap().len(),
                Poll::Ready(None) => break,
                Poll::Ready(Some(Err(e))) => panic!("{e}"),
                Poll::Pending => {
                    pending += 1;
                    // Every give-way wakes its drainer again at once.
                    assert_eq!(woken.load(Ordering::Relaxed), pending);
                }
            }
        }
        assert_eq!(data, chunks * 64 * 1024);
        assert!(pending > 0);
        assert_eq!(pending, chunks * 64 * 1024 / TURN);
    }
}
