//! The network side: TLS accept loop, HTTP/1.1 and HTTP/2 on one port (ALPN), size limits,
//! authentication and impersonation, path routing and response helpers.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::rbac::{self, Identity};
use crate::resources::ResourceType;
use crate::util::Query;
use crate::{State, api, discovery, openapi};

/// Response body: a whole buffer or a stream (watch, follow logs).
pub type Body = BoxBody<Bytes, Infallible>;

/// Largest request body accepted (the apiserver's limit is 3 MiB too).
pub const MAX_BODY: usize = 3 * 1024 * 1024;
/// Largest header block accepted.
const MAX_HEADERS: usize = 64 * 1024;
/// Time a client gets to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Concurrent connections served; more wait in the accept queue.
const MAX_CONNECTIONS: usize = 256;

/// Accepts connections until the server is cancelled.
pub(crate) async fn serve(
    state: Arc<State>,
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let permit = tokio::select! {
            _ = state.cancel.cancelled() => return,
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
        };
        let (tcp, _) = tokio::select! {
            _ = state.cancel.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let st = state.clone();
        let acceptor = acceptor.clone();
        // Each handshake runs in its own task so a slow client never blocks accept.
        state.spawn(async move {
            let _permit = permit;
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                _ => return,
            };
            let svc_state = st.clone();
            let svc = hyper::service::service_fn(move |req| {
                let s = svc_state.clone();
                async move { Ok::<_, Infallible>(handle(s, req).await) }
            });
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .max_buf_size(MAX_HEADERS.max(8192))
                .timer(hyper_util::rt::TokioTimer::new());
            builder
                .http2()
                .max_header_list_size(MAX_HEADERS as u32)
                .max_concurrent_streams(250)
                .timer(hyper_util::rt::TokioTimer::new());
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), svc);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = st.cancel.cancelled() => {}
            }
        });
    }
}

/// Everything a handler needs about the request except its body.
#[derive(Debug)]
pub struct Ctx {
    pub method: Method,
    pub path: String,
    pub query: Query,
    pub headers: HeaderMap,
    pub who: Identity,
}

impl Ctx {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    }

    /// The field manager: the query parameter, else the user agent's first word.
    pub fn field_manager(&self) -> String {
        if let Some(m) = self.query.get("fieldManager").filter(|m| !m.is_empty()) {
            return m.to_string();
        }
        let ua = self.header("user-agent");
        let first = ua.split('/').next().unwrap_or_default();
        if first.is_empty() {
            "unknown".into()
        } else {
            first.chars().take(128).collect()
        }
    }

    pub fn dry_run(&self) -> bool {
        self.query.all("dryRun").iter().any(|v| v == "All")
    }
}

/// A parsed resource path.
#[derive(Debug, Clone)]
pub struct ResReq {
    pub rt: ResourceType,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub sub: Option<String>,
}

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed()
}

/// A body fed by a channel; the stream ends when the sender is dropped.
pub fn channel_body(rx: mpsc::Receiver<Bytes>) -> Body {
    let stream =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (b, rx)) })
            .map(|b| Ok::<_, Infallible>(Frame::data(b)));
    BodyExt::boxed(StreamBody::new(stream))
}

pub fn json_response(code: u16, v: &Value) -> Response<Body> {
    let body = serde_json::to_vec(v).unwrap_or_default();
    let mut r = Response::new(full(body));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::OK);
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

pub fn json_response_warn(code: u16, v: &Value, warnings: &[String]) -> Response<Body> {
    let mut r = json_response(code, v);
    for w in warnings {
        let text = format!("299 - \"{}\"", w.replace('"', "\\\""));
        if let Ok(h) = HeaderValue::from_str(&text) {
            r.headers_mut().append("warning", h);
        }
    }
    r
}

pub fn error_response(e: &ApiError) -> Response<Body> {
    json_response(e.code, &e.to_status())
}

/// Reads the request body, refusing more than [`MAX_BODY`].
pub async fn read_body(body: Incoming) -> Result<Bytes, ApiError> {
    match Limited::new(body, MAX_BODY).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::new(
            413,
            "RequestEntityTooLarge",
            format!("the request body is larger than the limit of {MAX_BODY} bytes"),
        )),
        Err(e) => Err(ApiError::bad_request(format!(
            "reading the request body failed: {e}"
        ))),
    }
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let resp = match route(state, req).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    };
    tracing::debug!(%method, %path, status = resp.status().as_u16(), "request");
    resp
}

fn segments(path: &str) -> Vec<String> {
    path.split('/')
        .filter(|s| !s.is_empty())
        .map(|s| s.to_string())
        .collect()
}

async fn route(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let path = req.uri().path().to_string();
    let segs = segments(&path);
    let seg: Vec<&str> = segs.iter().map(String::as_str).collect();

    // Health and version are public, like the apiserver's system:public-info-viewer.
    match seg.as_slice() {
        ["healthz"] | ["livez"] | ["readyz"] => {
            let mut r = Response::new(full("ok"));
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            return Ok(r);
        }
        ["version"] => return Ok(json_response(200, &discovery::version())),
        _ => {}
    }

    let real = rbac::authenticate(&state.cfg, req.headers())?;
    let who = rbac::impersonate(&state.cfg, real, req.headers())?;
    let ctx = Ctx {
        method: req.method().clone(),
        path: path.clone(),
        query: Query::parse(req.uri().query()),
        headers: req.headers().clone(),
        who,
    };
    let accept = ctx.header("accept").to_string();
    let get = ctx.method == Method::GET;

    match seg.as_slice() {
        ["api"] if get => {
            return Ok(match discovery::aggregated_version(&accept) {
                Some(v) => aggregated_response(discovery::aggregated(&state.registry, true, v), v),
                None => json_response(200, &discovery::api_versions(&state.addr.to_string())),
            });
        }
        ["apis"] if get => {
            return Ok(match discovery::aggregated_version(&accept) {
                Some(v) => aggregated_response(discovery::aggregated(&state.registry, false, v), v),
                None => json_response(200, &discovery::api_group_list(&state.registry)),
            });
        }
        ["api", "v1"] if get => {
            return discovery::resource_list(&state.registry, "", "v1")
                .map(|d| json_response(200, &d))
                .ok_or_else(ApiError::path_not_found);
        }
        ["apis", g] if get => {
            return discovery::api_group(&state.registry, g)
                .map(|d| json_response(200, &d))
                .ok_or_else(ApiError::path_not_found);
        }
        ["apis", g, v] if get => {
            return discovery::resource_list(&state.registry, g, v)
                .map(|d| json_response(200, &d))
                .ok_or_else(ApiError::path_not_found);
        }
        ["openapi", "v3"] if get => {
            return Ok(json_response(200, &openapi::v3_root(&state.registry)));
        }
        ["openapi", "v3", rest @ ..] if get => {
            let gv = rest.join("/");
            return openapi::v3_document(&state.registry, &gv)
                .map(|d| json_response(200, &d))
                .ok_or_else(ApiError::path_not_found);
        }
        ["openapi", "v2"] | ["swagger.json"] | ["swagger-2.0.0.pb-v1"] if get => {
            if accept.contains("protobuf") || seg[0] == "swagger-2.0.0.pb-v1" {
                // Only JSON is served. kubectl <= 1.26 validates with the protobuf form and
                // prints this message, which says what to do.
                return Err(ApiError::new(
                    404,
                    "NotFound",
                    "the server could not find the requested resource (kube-sim serves OpenAPI v2 as JSON only: run kubectl 1.26 or older with --validate=false)",
                ));
            }
            return Ok(json_response(200, &openapi::v2(&state.registry)));
        }
        _ => {}
    }

    let (group, version, rest) = match seg.as_slice() {
        ["api", "v1", rest @ ..] => ("", "v1", rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(ApiError::path_not_found()),
    };
    let rr = parse_resource(&state, group, version, rest)?;
    api::dispatch(state, ctx, rr, req).await
}

fn aggregated_response(doc: Value, v: &str) -> Response<Body> {
    let mut r = json_response(200, &doc);
    let ct = format!("application/json;g=apidiscovery.k8s.io;v={v};as=APIGroupDiscoveryList");
    if let Ok(h) = HeaderValue::from_str(&ct) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, h);
    }
    r.headers_mut()
        .insert(http::header::VARY, HeaderValue::from_static("Accept"));
    r
}

fn parse_resource(
    state: &State,
    group: &str,
    version: &str,
    rest: &[&str],
) -> Result<ResReq, ApiError> {
    let (namespace, parts): (Option<String>, Vec<&str>) = match rest {
        ["namespaces", ns, plural, more @ ..]
            if !(more.is_empty() && matches!(*plural, "status" | "finalize")) =>
        {
            let mut p = vec![*plural];
            p.extend_from_slice(more);
            (Some(ns.to_string()), p)
        }
        other => (None, other.to_vec()),
    };
    let (plural, name, sub) = match parts.as_slice() {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some(name.to_string()), None),
        [plural, name, sub] => (*plural, Some(name.to_string()), Some(sub.to_string())),
        _ => return Err(ApiError::path_not_found()),
    };
    let rt = state
        .registry
        .find(group, version, plural)
        .ok_or_else(ApiError::path_not_found)?;
    if namespace.is_some() && !rt.namespaced {
        return Err(ApiError::path_not_found());
    }
    if let Some(s) = &sub
        && !rt.has_sub(s)
    {
        return Err(ApiError::path_not_found());
    }
    Ok(ResReq {
        rt,
        namespace,
        name,
        sub,
    })
}
