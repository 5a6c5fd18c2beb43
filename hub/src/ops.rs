//! What probes and scrapers read: the HTTP probes, Prometheus text and gRPC
//! health, the way a kubelet and a stock Prometheus ask for them.
//!
//! The API port answers `/healthz`, `/livez` and `/readyz` without a token
//! (they say nothing about anyone's clusters). Its `/metrics` wants a token,
//! as before. An operator who wants a plain scrape or a kubelet `grpc:`
//! probe gives the hub ports of their own, plaintext and without tokens:
//! `--metrics-listen` serves `/metrics`, `--health-listen` the probes and
//! the gRPC health service over h2c. Given one address, one listener
//! serves both. These ports serve nothing else, so they can be left
//! inside the cluster's network while the API port faces the world.

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::{
    HubError, Result,
    forward::HttpBody,
    server::{HubState, plain},
};

/// Connections an ops port serves at once, and from one source: probes and
/// scrapes are a few per minute, so this only bounds a misbehaving client,
/// and the per-source share keeps one such client from crowding out the
/// kubelet's probes.
const MAX_CONNECTIONS: usize = 64;
const MAX_CONNECTIONS_PER_SOURCE: usize = 8;

/// How long one ops connection may stay open: probes are one request, a
/// scraper opens a new connection after this.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// A connection must send its first bytes, and an HTTP/1.1 request its
/// whole head, within this.
const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(5);

/// HTTP/2 streams one connection may hold open: a `grpc:` probe needs one.
const MAX_STREAMS: u32 = 8;

/// Largest gRPC health request: a service name.
const MAX_HEALTH_MESSAGE: usize = 1024;

/// What one ops listener serves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Roles {
    /// `/metrics`, Prometheus text.
    pub metrics: bool,
    /// `/healthz`, `/livez`, `/readyz` and gRPC health.
    pub health: bool,
}

/// Binds the listeners the configuration asks for: one per distinct
/// address, with the roles given to it (port 0 asks for a port each).
pub async fn bind(
    metrics: Option<SocketAddr>,
    health: Option<SocketAddr>,
) -> Result<Vec<(TcpListener, Roles)>> {
    let mut wanted: Vec<(SocketAddr, Roles)> = Vec::new();
    for (addr, role) in [
        (
            metrics,
            Roles {
                metrics: true,
                health: false,
            },
        ),
        (
            health,
            Roles {
                metrics: false,
                health: true,
            },
        ),
    ] {
        let Some(addr) = addr else { continue };
        match wanted
            .iter_mut()
            .find(|(a, _)| *a == addr && addr.port() != 0)
        {
            Some((_, roles)) => {
                roles.metrics |= role.metrics;
                roles.health |= role.health;
            }
            None => wanted.push((addr, role)),
        }
    }
    let mut out = Vec::with_capacity(wanted.len());
    for (addr, roles) in wanted {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| HubError::Config(format!("cannot listen on {addr}: {e}")))?;
        out.push((listener, roles));
    }
    Ok(out)
}

/// The answer to a probe path, or `None` for any other path.
pub fn probe(state: &HubState, path: &str) -> Option<http::Response<HttpBody>> {
    Some(match path {
        "/healthz" | "/livez" => plain(http::StatusCode::OK, "ok"),
        "/readyz" => match not_ready(state) {
            None => plain(http::StatusCode::OK, "ok"),
            Some(why) => plain(http::StatusCode::SERVICE_UNAVAILABLE, why),
        },
        _ => return None,
    })
}

/// Why the hub should get no new traffic, if it should not.
fn not_ready(state: &HubState) -> Option<&'static str> {
    if !state.serving.load(Ordering::Acquire) {
        Some("not serving: starting or shutting down")
    } else if !state.store_writable.load(Ordering::Acquire) {
        Some("the store does not take writes")
    } else {
        None
    }
}

/// The Prometheus text of the hub's metrics.
pub fn metrics(state: &HubState) -> http::Response<HttpBody> {
    state.metrics.pacers(&state.pacer, &state.register_pacer);
    state
        .metrics
        .api_port(&state.api_pending, &state.api_connections);
    state.metrics.tickets(&state.tickets);
    state.metrics.quic_socket();
    let mut resp = plain(http::StatusCode::OK, state.metrics.render().trim_end());
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}

/// Serves one ops listener until `shutdown`. `health` answers gRPC health
/// checks (h2c).
pub async fn serve(
    state: Arc<HubState>,
    listener: TcpListener,
    roles: Roles,
    health: tonic::service::Routes,
    shutdown: CancellationToken,
) {
    let slots = crate::limits::ApiConnections::new(crate::limits::ApiConnectionLimits {
        max_total: MAX_CONNECTIONS,
        per_source: MAX_CONNECTIONS_PER_SOURCE,
    });
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors, say: wait rather than spin.
                    tracing::warn!(error = %e, "ops port: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => return,
        };
        // Over a bound the newest connection is closed at once.
        let Some(slot) = slots.try_enter(peer.ip()) else {
            continue;
        };
        let (state, health, shutdown) = (state.clone(), health.clone(), shutdown.clone());
        state.tasks.clone().spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                let (state, health) = (state.clone(), health.clone());
                async move { Ok::<_, Infallible>(answer(&state, roles, health, req).await) }
            });
            // A connection that says nothing gives its place back soon.
            let mut first = [0u8; 1];
            match tokio::time::timeout(FIRST_BYTES_TIMEOUT, tcp.peek(&mut first)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return,
            }
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(FIRST_BYTES_TIMEOUT);
            builder
                .http2()
                .timer(TokioTimer::new())
                .max_concurrent_streams(MAX_STREAMS);
            let conn = builder.serve_connection(TokioIo::new(tcp), service);
            tokio::select! {
                _ = tokio::time::timeout(CONNECTION_LIFETIME, conn) => {}
                _ = shutdown.cancelled() => {}
            }
        });
    }
}

async fn answer(
    state: &HubState,
    roles: Roles,
    health: tonic::service::Routes,
    req: http::Request<Incoming>,
) -> http::Response<HttpBody> {
    let path = req.uri().path();
    if roles.health && path.starts_with("/grpc.health.v1.Health/") {
        let req = req.map(|b| {
            b.map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
                .boxed_unsync()
        });
        // Measured from its length prefix before anything is buffered.
        let req = match crate::forward::limit_first_message(req, MAX_HEALTH_MESSAGE).await {
            Ok(req) => req,
            Err(status) => return status.into_http(),
        };
        let mut health = health;
        let resp = match tower::Service::call(&mut health, req).await {
            Ok(resp) => resp,
            Err(never) => match never {},
        };
        return resp.map(|b| {
            b.map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
                .boxed_unsync()
        });
    }
    if req.method() != http::Method::GET && req.method() != http::Method::HEAD {
        return plain(http::StatusCode::METHOD_NOT_ALLOWED, "use GET");
    }
    if roles.metrics && path == "/metrics" {
        return metrics(state);
    }
    if roles.health
        && let Some(resp) = probe(state, path)
    {
        return resp;
    }
    plain(http::StatusCode::NOT_FOUND, "no such endpoint")
}
