//! Liveness and readiness over plain HTTP for the kubelet's probes:
//! `/healthz` answers while the process runs, `/readyz` only while a tunnel
//! to the hub is up; `/metrics` has the live counts ([`crate::gauges`]) in
//! Prometheus' text format.

use std::{convert::Infallible, net::SocketAddr};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::{net::TcpListener, sync::watch};
use tokio_util::sync::CancellationToken;

use crate::{AgentStatus, gauges::Gauges};

/// Serves the probes on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    status: watch::Receiver<AgentStatus>,
    gauges: std::sync::Arc<Gauges>,
    shutdown: CancellationToken,
) {
    loop {
        let (tcp, _) = tokio::select! {
            r = listener.accept() => match r { Ok(c) => c, Err(_) => continue },
            _ = shutdown.cancelled() => return,
        };
        let (status, gauges) = (status.clone(), gauges.clone());
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let now = status.borrow().clone();
                    let ready = now.connected.is_some();
                    let metrics = (req.uri().path() == "/metrics").then(|| gauges.render(&now));
                    async move {
                        let (code, text): (u16, Bytes) = match (req.uri().path(), metrics) {
                            (_, Some(m)) => (200, m.into()),
                            ("/healthz", _) => (200, "ok".into()),
                            ("/readyz", _) if ready => (200, "tunnel up".into()),
                            ("/readyz", _) => (503, "no tunnel to the hub".into()),
                            _ => (404, "not found".into()),
                        };
                        let mut resp = http::Response::new(Full::new(text));
                        *resp.status_mut() =
                            http::StatusCode::from_u16(code).unwrap_or(http::StatusCode::OK);
                        Ok::<_, Infallible>(resp)
                    }
                });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), service);
            let _ = tokio::time::timeout(std::time::Duration::from_secs(30), conn).await;
        });
    }
}

/// Binds the probe listener.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}
