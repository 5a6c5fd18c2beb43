//! One HTTP exchange per tunnel stream.
//!
//! The hub side ([`forward`]) writes the request head, pumps the request
//! body, and returns the response with a body that reads straight off the
//! stream. The agent side ([`serve_stream`]) rebuilds the request, calls a
//! tower service (the agent's tonic router), and writes the response back,
//! trailers included. gRPC passes through unchanged.
//!
//! Cancellation: the hub keeps its half of the stream open until the
//! response is done. When the caller goes away the hub drops the stream; the
//! agent sees its read side end and drops the service future, which cancels
//! the work (an upstream watch, a log follow, an exec session).

use std::{
    any::Any,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use http_body::{Body, Frame};
use prost::Message;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::{mpsc, oneshot},
};
use tokio_util::{
    codec::{FramedRead, FramedWrite},
    sync::CancellationToken,
};

use crate::{
    Result, TunnelError,
    frame::{
        Caller, ChunkCodec, ChunkKind, HeaderList, Limits, RequestHead, ResponseHead, from_wire,
        to_wire,
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

/// Sends `req` over `stream` on behalf of `caller` and returns the agent's
/// response. `guard` lives as long as the response body (a concurrency
/// permit, a metrics gauge).
pub async fn forward<B>(
    stream: TunnelStream,
    caller: Option<Caller>,
    req: http::Request<B>,
    limits: Limits,
    guard: Option<Box<dyn Any + Send + Sync>>,
) -> Result<http::Response<ResponseBody>>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send,
{
    forward_to("", stream, caller, req, limits, guard).await
}

/// Like [`forward`], for one of the agent's other services (`target`, see
/// [`crate::frame::RequestHead::target`]).
pub async fn forward_to<B>(
    target: &str,
    stream: TunnelStream,
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
    let mut writer: Writer = FramedWrite::new(stream.send, codec);
    // Queued, not flushed: it leaves with the request's first bytes.
    writer
        .feed((ChunkKind::Open, head.encode_to_vec().into()))
        .await?;

    let (done_tx, done_rx) = oneshot::channel();
    tokio::spawn(pump_request(writer, body, done_rx, limits));

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
    let (status, headers) = parse_response_head(payload)?;
    let mut response = http::Response::new(ResponseBody {
        reader,
        done: Some(done_tx),
        finished: false,
        _guard: guard,
    });
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    Ok(response)
}

/// Decodes the payload of a HEAD chunk (what the agent sent) into a status
/// and headers, refusing statuses and headers HTTP does not allow. Public so
/// the fuzz targets feed it exactly what the hub parses.
pub fn parse_response_head(payload: Bytes) -> Result<(http::StatusCode, http::HeaderMap)> {
    let head = ResponseHead::decode(payload)
        .map_err(|e| TunnelError::protocol(format!("response head: {e}")))?;
    // Checked before the cast: a u32 status must not wrap into a valid u16.
    let status = Some(head.status)
        .filter(|s| *s <= 999)
        .and_then(|s| http::StatusCode::from_u16(s as u16).ok())
        .ok_or_else(|| TunnelError::protocol(format!("bad status {}", head.status)))?;
    Ok((status, from_wire(head.headers)?))
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
        while let Some(frame) = next_frame(&mut writer, &mut body).await? {
            let frame = frame.map_err(|e| TunnelError::Io(std::io::Error::other(e.into())))?;
            if let Ok(data) = frame.into_data() {
                feed_data(&mut writer, data, limits.max_data).await?;
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
    done: Option<oneshot::Sender<()>>,
    finished: bool,
    _guard: Option<Box<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody")
            .field("finished", &self.finished)
            .finish()
    }
}

impl ResponseBody {
    fn finish(&mut self) {
        self.finished = true;
        if let Some(done) = self.done.take() {
            let _ = done.send(());
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
        if self.finished {
            return Poll::Ready(None);
        }
        // Counts against the task's budget, as tokio's own sockets do, so
        // whoever drains a bulk response yields now and then (see
        // `next_frame`).
        let coop = ready!(tokio::task::coop::poll_proceed(cx));
        let next = ready!(self.reader.poll_next_unpin(cx));
        coop.made_progress();
        match next {
            None => {
                self.finish();
                Poll::Ready(None)
            }
            Some(Ok((ChunkKind::Data, data))) => Poll::Ready(Some(Ok(Frame::data(data)))),
            Some(Ok((ChunkKind::Trailers, payload))) => {
                self.finish();
                Poll::Ready(Some(parse_trailers(payload).map(Frame::trailers)))
            }
            Some(Ok((kind, _))) => {
                self.finished = true;
                Poll::Ready(Some(Err(TunnelError::protocol(format!(
                    "unexpected {kind:?} in response"
                )))))
            }
            Some(Err(e)) => {
                self.finished = true;
                Poll::Ready(Some(Err(e)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished
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

/// Serves one stream: reads the request, calls `service`, writes the
/// response. Returns when the exchange is over or the hub abandoned it.
pub async fn serve_stream<S, B>(stream: TunnelStream, service: S, limits: Limits) -> Result<()>
where
    S: tower_service::Service<http::Request<RequestBody>, Response = http::Response<B>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    serve_stream_with(stream, service, None::<NoService>, limits).await
}

/// A service that is never called: for [`serve_stream_with`] without a
/// Kubernetes API proxy.
#[derive(Debug, Clone, Copy)]
pub struct NoService;

impl tower_service::Service<http::Request<RequestBody>> for NoService {
    type Response = http::Response<http_body_util::Empty<Bytes>>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<std::result::Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> Poll<std::result::Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<RequestBody>) -> Self::Future {
        let mut resp = http::Response::new(http_body_util::Empty::new());
        *resp.status_mut() = http::StatusCode::NOT_FOUND;
        std::future::ready(Ok(resp))
    }
}

/// Serves one stream with the agent's gRPC `service`, or with `kube` when
/// the request names the Kubernetes API proxy as its target (404 when there
/// is none).
pub async fn serve_stream_with<S, B, K, KB>(
    stream: TunnelStream,
    service: S,
    kube: Option<K>,
    limits: Limits,
) -> Result<()>
where
    S: tower_service::Service<http::Request<RequestBody>, Response = http::Response<B>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    K: tower_service::Service<http::Request<RequestBody>, Response = http::Response<KB>>,
    K::Error: Into<BoxError>,
    KB: Body<Data = Bytes>,
    KB::Error: Into<BoxError>,
{
    serve_stream_full(stream, service, kube, AgentSelf::default(), limits).await
}

/// The agent's report for [`crate::frame::TARGET_DIAG`] (JSON), made when
/// asked: from the request's headers (the hub's clock) and the agent's
/// state at that moment.
pub type DiagFn = std::sync::Arc<dyn Fn(&http::HeaderMap) -> Bytes + Send + Sync>;

/// Where an agent keeps the hub's goodbye for a tunnel: the reason the hub
/// gave before closing it, or `None` when it gave none.
pub type Goodbye = std::sync::Arc<std::sync::Mutex<Option<String>>>;

/// The longest goodbye reason kept; longer ones are cut.
pub const MAX_REASON: usize = 256;

/// What the agent answers for itself rather than for a caller.
#[derive(Clone, Default)]
pub struct AgentSelf {
    /// Makes its report on how it connected.
    pub diag: Option<DiagFn>,
    /// Woken by [`crate::frame::TARGET_RENEW`]: the hub asks for a
    /// certificate renewal now.
    pub renew: Option<std::sync::Arc<tokio::sync::Notify>>,
    /// Set by [`crate::frame::TARGET_BYE`]: the hub is closing this tunnel.
    pub goodbye: Option<Goodbye>,
}

impl std::fmt::Debug for AgentSelf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentSelf")
            .field("diag", &self.diag.is_some())
            .field("renew", &self.renew.is_some())
            .field("goodbye", &self.goodbye)
            .finish()
    }
}

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

/// Like [`serve_stream_with`], also answering the hub's own requests to the
/// agent ([`AgentSelf`]).
pub async fn serve_stream_full<S, B, K, KB>(
    stream: TunnelStream,
    service: S,
    kube: Option<K>,
    own: AgentSelf,
    limits: Limits,
) -> Result<()>
where
    S: tower_service::Service<http::Request<RequestBody>, Response = http::Response<B>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    K: tower_service::Service<http::Request<RequestBody>, Response = http::Response<KB>>,
    K::Error: Into<BoxError>,
    KB: Body<Data = Bytes>,
    KB::Error: Into<BoxError>,
{
    let codec = ChunkCodec { limits };
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
    let target = head.target;

    let (tx, rx) = mpsc::channel(2);
    let mut request = http::Request::new(RequestBody { rx });
    *request.method_mut() = head.method;
    *request.uri_mut() = head.uri;
    *request.headers_mut() = head.headers;
    if let Some(caller) = head.caller {
        request.extensions_mut().insert(caller);
    }

    // The reader feeds the body, then watches for the hub closing its side,
    // which means the caller is gone.
    let abandoned = CancellationToken::new();
    let finished = CancellationToken::new();
    let reader_task = {
        let (abandoned, finished) = (abandoned.clone(), finished.clone());
        async move {
            let mut tx = Some(tx);
            loop {
                let next = tokio::select! {
                    n = reader.next() => n,
                    _ = finished.cancelled() => return,
                };
                match (next, &tx) {
                    (Some(Ok((ChunkKind::Data, data))), Some(sender)) => {
                        // A service that stopped reading the body just gets no more of it.
                        if sender.send(Ok(data)).await.is_err() {
                            tx = None;
                        }
                    }
                    (Some(Ok((ChunkKind::End, _))), Some(_)) => tx = None,
                    (next, _) => {
                        if let (Some(sender), Some(Err(e))) = (&tx, next) {
                            let _ = sender.send(Err(e)).await;
                        }
                        abandoned.cancel();
                        return;
                    }
                }
            }
        }
    };
    let reader_handle = tokio::spawn(reader_task);

    let mut writer: Writer = FramedWrite::new(stream.send, codec);
    let exchange = async {
        if target == crate::frame::TARGET_RENEW {
            let renew = own.renew.clone();
            let answer = tower::service_fn(move |_: http::Request<RequestBody>| {
                let renew = renew.clone();
                async move {
                    let mut resp = http::Response::new(http_body_util::Empty::<Bytes>::new());
                    match renew {
                        Some(n) => {
                            n.notify_one();
                            *resp.status_mut() = http::StatusCode::ACCEPTED;
                        }
                        None => *resp.status_mut() = http::StatusCode::NOT_FOUND,
                    }
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            respond(answer, request, &mut writer, limits).await
        } else if target == crate::frame::TARGET_BYE {
            let goodbye = own.goodbye.clone();
            let answer = tower::service_fn(move |req: http::Request<RequestBody>| {
                let goodbye = goodbye.clone();
                async move {
                    let mut resp = http::Response::new(http_body_util::Empty::<Bytes>::new());
                    match goodbye {
                        Some(slot) => {
                            let reason = req
                                .headers()
                                .get(crate::frame::REASON_HEADER)
                                .map(|v| clean_reason(v.as_bytes()))
                                .unwrap_or_default();
                            *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
                            *resp.status_mut() = http::StatusCode::NO_CONTENT;
                        }
                        None => *resp.status_mut() = http::StatusCode::NOT_FOUND,
                    }
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            respond(answer, request, &mut writer, limits).await
        } else if target == crate::frame::TARGET_DIAG {
            let make = own.diag.clone();
            let diag = tower::service_fn(move |req: http::Request<RequestBody>| {
                let body = make
                    .as_ref()
                    .map_or_else(|| Bytes::from_static(b"{}"), |f| f(req.headers()));
                async move {
                    let mut resp = http::Response::new(http_body_util::Full::new(body));
                    resp.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/json"),
                    );
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            respond(diag, request, &mut writer, limits).await
        } else if target == crate::frame::TARGET_KUBE {
            match kube {
                Some(kube) => respond(kube, request, &mut writer, limits).await,
                None => respond(NoService, request, &mut writer, limits).await,
            }
        } else if target.is_empty() {
            respond(service, request, &mut writer, limits).await
        } else {
            respond(NoService, request, &mut writer, limits).await
        }
    };
    let result = tokio::select! {
        r = exchange => r,
        _ = abandoned.cancelled() => Err(TunnelError::Closed("the hub abandoned the call".into())),
    };
    finished.cancel();
    let _ = reader_handle.await;
    result
}

/// Calls `service` and writes its response: head, data, trailers, end.
async fn respond<S, B>(
    mut service: S,
    request: http::Request<RequestBody>,
    writer: &mut Writer,
    limits: Limits,
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
    };
    writer
        .feed((ChunkKind::Head, head.encode_to_vec().into()))
        .await?;
    let mut body = std::pin::pin!(body);
    while let Some(frame) = next_frame(writer, &mut body).await? {
        let frame = frame.map_err(|e| TunnelError::Io(std::io::Error::other(e.into())))?;
        match frame.into_data() {
            Ok(data) => feed_data(writer, data, limits.max_data).await?,
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
    // Flushes what is queued, then ends the stream.
    writer.close().await
}
