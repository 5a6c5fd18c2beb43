//! Liveness and readiness over plain HTTP for the kubelet's probes:
//! `/healthz` answers while the process runs, `/readyz` only while a tunnel
//! to the hub is up.

use std::{convert::Infallible, net::SocketAddr};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::{net::TcpListener, sync::watch};
use tokio_util::sync::CancellationToken;

use crate::AgentStatus;

/// Serves the probes on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    status: watch::Receiver<AgentStatus>,
    shutdown: CancellationToken,
) {
    loop {
        let (tcp, _) = tokio::select! {
            r = listener.accept() => match r { Ok(c) => c, Err(_) => continue },
            _ = shutdown.cancelled() => return,
        };
        let status = status.clone();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let ready = status.borrow().connected.is_some();
                    async move {
                        let (code, text) = match req.uri().path() {
                            "/healthz" => (200, "ok"),
                            "/readyz" if ready => (200, "tunnel up"),
                            "/readyz" => (503, "no tunnel to the hub"),
                            _ => (404, "not found"),
                        };
                        let mut resp =
                            http::Response::new(Full::new(Bytes::from_static(text.as_bytes())));
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
