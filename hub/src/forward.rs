//! The front door for ResourceService and RuntimeService: authenticate the
//! caller, find the cluster's tunnel, and pass the gRPC call through on a
//! stream of its own. Only the first request message is looked at (for the
//! routing key); responses pass through without being decoded.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, combinators::UnsyncBoxBody};
use otter_tunnel::{frame::Limits, http::ResponseBody};
use prost::Message;
use tonic::Status;

use crate::{auth, metrics::Metrics, server::HubState};

/// Response body type of every handler of the API port.
pub type HttpBody = UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

const FORWARDED_SERVICES: [&str; 2] = [
    "/otterscale.resource.v1.ResourceService/",
    "/otterscale.runtime.v1.RuntimeService/",
];

/// Methods whose first field is a session id (`<cluster>:<random>`), not a
/// cluster: the agent that made the session owns it.
const SESSION_METHODS: [&str; 3] = [
    "/otterscale.runtime.v1.RuntimeService/WriteTTY",
    "/otterscale.runtime.v1.RuntimeService/ResizeTTY",
    WRITE_PORT_FORWARD,
];

/// Answered by the hub once its bytes are queued ([`crate::uploads`]).
const WRITE_PORT_FORWARD: &str = "/otterscale.runtime.v1.RuntimeService/WritePortForward";

/// Methods that open a session: audited when they start and when they end.
const SESSION_OPENERS: [&str; 2] = [
    "/otterscale.runtime.v1.RuntimeService/ExecuteTTY",
    PORT_FORWARD,
];

/// Its session's upload paths end with it ([`crate::uploads::SessionEnd`]).
const PORT_FORWARD: &str = "/otterscale.runtime.v1.RuntimeService/PortForward";

/// Field 1 of every forwarded request: the cluster, or the session id.
#[derive(Clone, PartialEq, prost::Message)]
struct RouteKey {
    #[prost(string, optional, tag = "1")]
    key: Option<String>,
}

/// Whether `path` is handled here.
pub fn is_forwarded(path: &str) -> bool {
    FORWARDED_SERVICES.iter().any(|p| path.starts_with(p))
}

/// A call's end with `status`, as the trailers of a streamed response.
pub fn status_trailers(status: &Status) -> Frame<Bytes> {
    let mut trailers = http::HeaderMap::new();
    let _ = status.add_header(&mut trailers);
    Frame::trailers(trailers)
}

/// A unary call's answer of an empty message, OK.
fn empty_answer() -> http::Response<HttpBody> {
    let frames = [
        Ok(Frame::data(Bytes::from_static(&[0, 0, 0, 0, 0]))),
        Ok(status_trailers(&Status::new(tonic::Code::Ok, ""))),
    ];
    let body = http_body_util::StreamBody::new(futures::stream::iter(frames));
    http::Response::builder()
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .body(body.boxed_unsync())
        .expect("static response")
}

/// A gRPC error as a trailers-only response.
pub fn status_response(status: Status) -> http::Response<HttpBody> {
    status.into_http()
}

/// Forwards one call; every failure becomes a gRPC status. Each call is
/// one audit line, written when it ends.
pub async fn handle(
    state: Arc<HubState>,
    req: http::Request<HttpBody>,
) -> http::Response<HttpBody> {
    let timer = crate::audit::Timer::start();
    // Without an audit log, no line is built (the hot path stays lean).
    let mut event = match state.audit.enabled() {
        true => crate::audit::Event {
            kind: "call",
            action: req.uri().path().to_owned(),
            remote: crate::server::ConnInfo::remote_of(req.extensions()),
            ..Default::default()
        },
        false => Default::default(),
    };
    match route(state.clone(), req, &mut event).await {
        Ok(resp) => resp,
        Err(status) if state.audit.enabled() => {
            event.code = format!("{:?}", status.code());
            event.duration_ms = timer.millis();
            state.audit.record(event);
            status_response(status)
        }
        Err(status) => status_response(status),
    }
}

async fn route(
    state: Arc<HubState>,
    req: http::Request<HttpBody>,
    event: &mut crate::audit::Event,
) -> Result<http::Response<HttpBody>, Status> {
    let timer = crate::audit::Timer::start();
    let caller = auth::verified(req.extensions())?;
    let auditing = state.audit.enabled();
    if auditing {
        event.user = caller.cluster_user.clone();
        event.groups = caller.groups.clone();
    }
    let (parts, body) = req.into_parts();
    let (prefix, rest) = read_first_message(body, state.config.max_request_message).await?;
    if prefix[0] != 0 {
        return Err(Status::invalid_argument(
            "compressed request messages are not accepted; send them uncompressed",
        ));
    }
    let key = RouteKey::decode(&prefix[5..])
        .map_err(|e| Status::invalid_argument(format!("request message does not decode: {e}")))?
        .key
        .unwrap_or_default();
    let path = parts.uri.path().to_owned();
    let cluster = if SESSION_METHODS.contains(&path.as_str()) {
        match key.split_once(':') {
            Some((cluster, _)) => cluster.to_owned(),
            None => {
                return Err(Status::not_found(
                    "session not found (malformed session id)",
                ));
            }
        }
    } else {
        key.clone()
    };
    if cluster.is_empty() {
        return Err(Status::invalid_argument("cluster is required"));
    }
    if auditing {
        event.cluster = cluster.clone();
    }
    if path == WRITE_PORT_FORWARD {
        crate::uploads::Uploads::write(&state, &caller, &cluster, &key, parts, prefix).await?;
        if auditing {
            event.code = "Ok".to_owned();
            event.duration_ms = timer.millis();
            state.audit.record(std::mem::take(event));
        }
        return Ok(empty_answer());
    }

    // A Watch or a followed log outlives its tunnel where the caller came
    // in (a call a peer sent is resumed by the replica that sent it).
    let (resume, prefix) = match (parts.extensions.get::<crate::peers::FromPeer>().is_none()
        && !state.config.watch_resume_grace.is_zero())
    .then(|| crate::resume::Resumable::of(&path, &prefix))
    .flatten()
    {
        Some((resumable, sent)) => (Some((resumable, parts.clone())), sent),
        None => (None, prefix),
    };
    let (resp, tenant) = match send(&state, &caller, &cluster, parts, prefix, rest).await? {
        Sent::Tunnel { resp, tenant } => {
            (resp.map(|b| b.map_err(Into::into).boxed_unsync()), tenant)
        }
        // The replica holding the tunnel audits the call.
        Sent::Peer(resp) => {
            let resp = match resume {
                Some((resumable, parts)) => {
                    resumable.answer(&state, caller, cluster.clone(), parts, resp)
                }
                None => resp,
            };
            return Ok(ending_uploads(&state, &path, &cluster, resp));
        }
    };
    let hold = crate::credentials::hold_for(&state.live, &caller);
    let opens_session = SESSION_OPENERS.contains(&path.as_str());
    let resp = match resume {
        Some((resumable, parts)) => resumable.answer(&state, caller, cluster.clone(), parts, resp),
        None => resp,
    };
    if auditing {
        event.tenant = tenant;
    }
    let metrics = state.metrics.clone();
    // The call's line is written when its body ends (or is dropped): a
    // Watch is audited with its whole duration and final code.
    let code = resp
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .map(code_name);
    if auditing && opens_session {
        event.kind = "session";
        let mut open = event.clone();
        open.phase = "open";
        open.code = code.clone().unwrap_or_else(|| "OK".to_owned());
        open.duration_ms = timer.millis();
        state.audit.record(open);
        event.phase = "close";
    }
    let audit = auditing.then(|| CallAudit {
        audit: state.audit.clone(),
        event: std::mem::take(event),
        timer,
        code,
    });
    let ends = cluster.clone();
    let resp = resp.map(|body| {
        GrpcTunnelBody {
            inner: body,
            cluster,
            failed: false,
            metrics,
            audit,
            hold,
        }
        .boxed_unsync()
    });
    Ok(ending_uploads(&state, &path, &ends, resp))
}

/// A PortForward's answer closes its session's upload paths as it ends.
fn ending_uploads(
    state: &Arc<HubState>,
    path: &str,
    cluster: &str,
    resp: http::Response<HttpBody>,
) -> http::Response<HttpBody> {
    if path != PORT_FORWARD {
        return resp;
    }
    resp.map(|body| {
        crate::uploads::SessionEnd::new(body, state.clone(), cluster.to_owned()).boxed_unsync()
    })
}

/// Where a call went.
// Returned once per call and taken apart at once: boxing the tunnel's
// response body would cost an allocation per call to save a move.
#[expect(clippy::large_enum_variant)]
pub(crate) enum Sent {
    /// Over a tunnel of this replica, with that tunnel's tenant.
    Tunnel {
        resp: http::Response<ResponseBody>,
        tenant: String,
    },
    /// To the replica holding the cluster's tunnel.
    Peer(http::Response<HttpBody>),
}

/// Sends a call on, its first message already read (`prefix`): over the
/// cluster's tunnel on this replica, or to the replica that holds it.
/// Every forwarded call, and every Watch opened again, goes through here.
pub(crate) async fn send(
    state: &Arc<HubState>,
    caller: &auth::Principal,
    cluster: &str,
    mut parts: http::request::Parts,
    prefix: Bytes,
    rest: HttpBody,
) -> Result<Sent, Status> {
    let opened = state
        .registry
        .open_call(caller, cluster, &*state.store, &state.config.replica)
        .await;
    // A write of an upload path, sent on by the replica that runs the
    // path: the only place-in-order header an agent sees.
    if parts.extensions.get::<crate::peers::FromPeer>().is_some()
        && let Some(place) = parts
            .headers
            .get(otter_tunnel::frame::UPLOAD_ORDER_HEADER)
            .and_then(|v| v.to_str().ok())
    {
        parts.extensions.insert(crate::uploads::Ordered {
            place: place.to_owned(),
            sent_before: None,
        });
    }
    strip_client_headers(&mut parts.headers);
    let ordered = parts.extensions.get::<crate::uploads::Ordered>();
    let sent_before = ordered.and_then(|o| o.sent_before);
    if let Some(crate::uploads::Ordered { place, .. }) = ordered
        && let Ok(v) = http::HeaderValue::from_str(place)
    {
        parts
            .headers
            .insert(otter_tunnel::frame::UPLOAD_ORDER_HEADER, v);
    }
    let metrics = state.metrics.clone();
    let body = PrefixedBody {
        prefix: Some(prefix),
        rest,
        metrics: metrics.clone(),
    };
    let call = match opened {
        Ok(call) => call,
        // Another replica holds the tunnel: the call goes there, once (a
        // call a peer sent is never sent on), and is audited there.
        Err(crate::registry::RouteError::Elsewhere(owner, place))
            if parts.extensions.get::<crate::peers::FromPeer>().is_none()
                && let Some(peers) = &state.peers =>
        {
            let remote = crate::server::ConnInfo::remote_of(&parts.extensions);
            let req = http::Request::from_parts(parts, body.map_err(Into::into).boxed_unsync());
            return match peers.send(&owner, caller, &remote, req).await {
                Ok(resp) => Ok(Sent::Peer(crate::peers::relayed(resp, place))),
                Err(e) => Err(Status::unavailable(format!("cluster {cluster}: {e}"))),
            };
        }
        Err(e) => return Err(e.status()),
    };
    if let Some(bytes) = sent_before {
        call.stream.continues(bytes);
    }
    metrics.calls_in_flight.inc();
    let tenant = call.tunnel.tenant.clone();
    let guard = CallGuard {
        _permit: call.permit,
        metrics,
    };
    let resp = otter_tunnel::http::forward(
        call.stream,
        "",
        Some(call.identity),
        http::Request::from_parts(parts, body),
        Limits::default(),
        Some(Box::new(guard)),
    )
    .await
    .map_err(|e| Status::unavailable(format!("cluster {cluster}: {e}")))?;
    Ok(Sent::Tunnel { resp, tenant })
}

/// A gRPC status code's name, from its number.
fn code_name(number: &str) -> String {
    let code = number.trim().parse::<i32>().map(tonic::Code::from_i32);
    match code {
        Ok(code) => format!("{code:?}"),
        Err(_) => number.to_owned(),
    }
}

/// A forwarded call's audit line, written once when the call ends: with
/// the code of its trailers, or `Cancelled` when the caller left first.
struct CallAudit {
    audit: crate::audit::Audit,
    event: crate::audit::Event,
    timer: crate::audit::Timer,
    code: Option<String>,
}

impl Drop for CallAudit {
    fn drop(&mut self) {
        let mut event = std::mem::take(&mut self.event);
        event.code = self.code.take().unwrap_or_else(|| "Cancelled".to_owned());
        event.duration_ms = self.timer.millis();
        self.audit.record(event);
    }
}

/// Drops what a client must not pass to an agent: its credentials, anything
/// that looks like identity, and connection-level headers.
pub fn strip_client_headers(headers: &mut http::HeaderMap) {
    let drop: Vec<http::HeaderName> = headers
        .keys()
        .filter(|name| {
            let n = name.as_str();
            n == "authorization"
                || n == "cookie"
                || n.starts_with("impersonate-")
                || n.starts_with("x-otter-")
                || n.starts_with("otter-peer-")
                || matches!(
                    n,
                    "connection"
                        | "keep-alive"
                        | "proxy-connection"
                        | "transfer-encoding"
                        | "upgrade"
                        | "host"
                )
        })
        .cloned()
        .collect();
    for name in drop {
        headers.remove(name);
    }
}

/// Checks the first gRPC message of `req` against `max` (from its length
/// prefix, before buffering it) and gives the request back with the body
/// unchanged.
pub async fn limit_first_message(
    req: http::Request<HttpBody>,
    max: usize,
) -> Result<http::Request<HttpBody>, Status> {
    use futures::StreamExt;
    let (parts, body) = req.into_parts();
    let (prefix, rest) = read_first_message(body, max).await?;
    let first = futures::stream::once(async move {
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Frame::data(prefix))
    });
    let body = first.chain(http_body_util::BodyStream::new(rest));
    Ok(http::Request::from_parts(
        parts,
        http_body_util::StreamBody::new(body).boxed_unsync(),
    ))
}

/// Reads the body up to the end of the first gRPC message. Returns the bytes
/// read (the first message and anything after it) and the rest of the body.
async fn read_first_message(mut body: HttpBody, max: usize) -> Result<(Bytes, HttpBody), Status> {
    let mut buf = BytesMut::new();
    loop {
        if buf.len() >= 5 {
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            if len > max {
                return Err(Status::resource_exhausted(format!(
                    "request message of {len} bytes is over the limit of {max}"
                )));
            }
            if buf.len() >= 5 + len {
                return Ok((buf.freeze(), body));
            }
        }
        match crate::limits::next_frame(&mut body).await? {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                }
            }
            Some(Err(e)) => {
                // The protocol layer says which status a body it rewrote
                // failed with (an oversized or undecodable message).
                if let Some(status) = e.downcast_ref::<Status>() {
                    return Err(status.clone());
                }
                return Err(Status::cancelled(format!("reading request: {e}")));
            }
            None => {
                return Err(Status::invalid_argument(
                    "request ended before its first message",
                ));
            }
        }
    }
}

/// The request body as the agent gets it: what was read for routing, then
/// the rest.
struct PrefixedBody<B> {
    prefix: Option<Bytes>,
    rest: B,
    metrics: Arc<Metrics>,
}

/// Held for as long as a forwarded call lives: its slot on the tunnel and
/// its place in the in-flight gauge.
struct CallGuard {
    _permit: crate::registry::CallPermit,
    metrics: Arc<Metrics>,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.metrics.calls_in_flight.dec();
    }
}

impl Body for PrefixedBody<HttpBody> {
    type Data = Bytes;
    // A concrete error type: a boxed `dyn Error` here trips the compiler's
    // higher-ranked lifetime checks once the call is boxed as a Send future.
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            self.metrics.bytes_to_agent.inc_by(prefix.len() as u64);
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        let frame = ready!(Pin::new(&mut self.rest).poll_frame(cx));
        if let Some(Ok(f)) = &frame
            && let Some(d) = f.data_ref()
        {
            self.metrics.bytes_to_agent.inc_by(d.len() as u64);
        }
        Poll::Ready(frame.map(|r| r.map_err(|e| std::io::Error::other(e.to_string()))))
    }

    // Saying when the caller's body has ended lets HTTP/2 send the first
    // message with END_STREAM at once: a unary call goes out as one
    // HEADERS and one DATA frame, without a task to pipe an empty rest.
    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }
}

/// Response body of a forwarded call. A tunnel that breaks mid-call ends the
/// call with gRPC status Unavailable instead of a bare stream reset, so the
/// caller learns what happened.
struct GrpcTunnelBody {
    inner: HttpBody,
    cluster: String,
    failed: bool,
    metrics: Arc<Metrics>,
    audit: Option<CallAudit>,
    /// Ends the call when the caller's hub token is revoked or expires.
    hold: Option<crate::credentials::Hold>,
}

impl GrpcTunnelBody {
    /// Ends the call with `status` in its trailers.
    fn fail(&mut self, status: Status, reason: &str) -> Frame<Bytes> {
        self.failed = true;
        if let Some(audit) = &mut self.audit {
            audit.code = Some(format!("{:?}", status.code()));
            audit.event.reason = reason.to_owned();
        }
        status_trailers(&status)
    }
}

impl Body for GrpcTunnelBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        if let Some(hold) = &mut self.hold
            && let Poll::Ready(ended) = hold.poll_ended(cx)
        {
            let frame = self.fail(Status::unauthenticated(ended.message()), ended.reason());
            return Poll::Ready(Some(Ok(frame)));
        }
        match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
            Some(Err(e)) => {
                let status =
                    Status::unavailable(format!("tunnel to cluster {} lost: {e}", self.cluster));
                let mut frame = self.fail(status, "cluster");
                if let Some(t) = frame.trailers_mut()
                    && let Ok(v) = http::HeaderValue::from_str(&self.cluster)
                {
                    t.insert(crate::resume::TUNNEL_LOST, v);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            other => {
                if let Some(Ok(f)) = &other {
                    if let Some(d) = f.data_ref() {
                        self.metrics.bytes_from_agent.inc_by(d.len() as u64);
                    } else if let Some(code) = f
                        .trailers_ref()
                        .and_then(|t| t.get("grpc-status"))
                        .and_then(|v| v.to_str().ok())
                        && let Some(audit) = &mut self.audit
                    {
                        audit.code = Some(code_name(code));
                    }
                }
                Poll::Ready(other)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }
}
