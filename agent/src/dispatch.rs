//! The agent's one service on a tunnel. Every stream the hub opens is
//! served by [`AgentService`], which sends it by its target (see
//! [`otter_tunnel::http::Target`]) to the gRPC API, the Kubernetes API
//! proxy, or what the agent answers for itself: its report on how it
//! connected, the hub's request to renew now, and the hub's goodbye.
//!
//! The tunnel crate knows none of these: it carries a request to the
//! agent's service and its response back ([`otter_tunnel::http::serve`]).

use std::{
    convert::Infallible,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body_util::{BodyExt, Empty, Full, combinators::UnsyncBoxBody};
use otter_tunnel::{
    BoxError,
    frame::{REASON_HEADER, TARGET_BYE, TARGET_DIAG, TARGET_KUBE, TARGET_RENEW},
    http::{RequestBody, Target, clean_reason},
};
use tower::ServiceExt;

use crate::kube_proxy::ProxyService;

/// The agent's report for [`TARGET_DIAG`] (JSON), made when asked: from
/// the request's headers (the hub's clock) and the agent's state then.
pub type DiagFn = Arc<dyn Fn(&http::HeaderMap) -> Bytes + Send + Sync>;

/// Where the hub's goodbye for a tunnel lands: the reason it gave before
/// closing it, or `None` when it gave none.
pub type Goodbye = Arc<Mutex<Option<String>>>;

/// Every response body of the agent, whichever service made it.
pub type AgentBody = UnsyncBoxBody<Bytes, BoxError>;

/// What the agent answers for itself on one tunnel.
#[derive(Clone)]
pub struct Own {
    /// Makes its report on how it connected.
    pub diag: DiagFn,
    /// Woken by [`TARGET_RENEW`]: the hub asks for a renewal now.
    pub renew: Arc<tokio::sync::Notify>,
    /// Set by [`TARGET_BYE`]: the hub is closing this tunnel.
    pub goodbye: Goodbye,
}

impl std::fmt::Debug for Own {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Own")
            .field("goodbye", &self.goodbye)
            .finish_non_exhaustive()
    }
}

/// The service every stream of one tunnel is served with.
#[derive(Clone)]
pub struct AgentService {
    routes: tonic::service::Routes,
    kube: Option<ProxyService>,
    own: Own,
}

impl std::fmt::Debug for AgentService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentService")
            .field("kube", &self.kube.is_some())
            .field("own", &self.own)
            .finish_non_exhaustive()
    }
}

impl AgentService {
    pub fn new(routes: tonic::service::Routes, kube: Option<ProxyService>, own: Own) -> Self {
        AgentService { routes, kube, own }
    }

    /// The hub's goodbye on this tunnel, taken (once).
    pub fn take_goodbye(&self) -> Option<String> {
        lock(&self.own.goodbye).take()
    }
}

impl tower::Service<http::Request<RequestBody>> for AgentService {
    type Response = http::Response<AgentBody>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Each call drives its own clone of the inner service to readiness.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<RequestBody>) -> Self::Future {
        let target = req
            .extensions()
            .get::<Target>()
            .cloned()
            .unwrap_or_default();
        match target.0.as_str() {
            "" => {
                let routes = self.routes.clone();
                Box::pin(async move {
                    let resp = routes.oneshot(req).await?;
                    Ok(oversize_is_resource_exhausted(resp)
                        .map(|b| b.map_err(Into::into).boxed_unsync()))
                })
            }
            TARGET_KUBE => match self.kube.clone() {
                Some(kube) => Box::pin(async move {
                    let resp = kube
                        .oneshot(req)
                        .await
                        .unwrap_or_else(|e: Infallible| match e {});
                    Ok(resp)
                }),
                None => ready(empty(http::StatusCode::NOT_FOUND)),
            },
            TARGET_DIAG => {
                let report = (self.own.diag)(req.headers());
                let mut resp =
                    http::Response::new(Full::new(report).map_err(Into::into).boxed_unsync());
                resp.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/json"),
                );
                ready(resp)
            }
            TARGET_RENEW => {
                self.own.renew.notify_one();
                ready(empty(http::StatusCode::ACCEPTED))
            }
            TARGET_BYE => {
                let reason = req
                    .headers()
                    .get(REASON_HEADER)
                    .map(|v| clean_reason(v.as_bytes()))
                    .unwrap_or_default();
                *lock(&self.own.goodbye) = Some(reason);
                ready(empty(http::StatusCode::NO_CONTENT))
            }
            _ => ready(empty(http::StatusCode::NOT_FOUND)),
        }
    }
}

fn ready(
    resp: http::Response<AgentBody>,
) -> BoxFuture<'static, Result<http::Response<AgentBody>, BoxError>> {
    Box::pin(std::future::ready(Ok(resp)))
}

fn empty(status: http::StatusCode) -> http::Response<AgentBody> {
    let mut resp = http::Response::new(
        Empty::new()
            .map_err(|e: Infallible| match e {})
            .boxed_unsync(),
    );
    *resp.status_mut() = status;
    resp
}

/// A poisoned goodbye slot still holds a reason worth reading.
fn lock(slot: &Goodbye) -> std::sync::MutexGuard<'_, Option<String>> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// gRPC says a message over the receiver's limit is RESOURCE_EXHAUSTED;
/// tonic answers OutOfRange. Callers get the code the protocol (and the
/// hub, for the limits it checks itself) promises.
fn oversize_is_resource_exhausted<B>(mut resp: http::Response<B>) -> http::Response<B> {
    if let Some(status) = tonic::Status::from_header_map(resp.headers())
        && status.code() == tonic::Code::OutOfRange
        && status.message().contains("message length too large")
    {
        let _ = tonic::Status::resource_exhausted(status.message().to_owned())
            .add_header(resp.headers_mut());
    }
    resp
}
