//! Liveness and readiness over plain HTTP for the kubelet's probes:
//! `/healthz` answers while the process runs, `/readyz` only while a tunnel
//! to the hub can carry calls (up, on a certificate the hub still honours);
//! `/metrics` has the live counts ([`crate::gauges`]) in Prometheus' text
//! format.

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
                    let metrics = (req.uri().path() == "/metrics").then(|| gauges.render(&now));
                    async move {
                        let (code, text): (u16, Bytes) = match (req.uri().path(), metrics) {
                            (_, Some(m)) => (200, m.into()),
                            ("/healthz", _) => (200, "ok".into()),
                            ("/readyz", _) => {
                                let (code, text) = readiness(&now, unix_now());
                                (code, text.into())
                            }
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

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// What `/readyz` answers: 200 while a tunnel is up on a certificate that
/// has not expired by the hub's clock (`now` corrected by the skew last
/// measured); the hub closes a tunnel whose certificate expired, so a
/// tunnel that just came up on one cannot carry calls for long either.
pub fn readiness(status: &AgentStatus, now: i64) -> (u16, String) {
    let hub_now = now + status.clock_skew_ms.unwrap_or(0) / 1000;
    let left = status.cert_not_after - hub_now;
    let renewal = match status.last_renewal_error.as_str() {
        "" => String::new(),
        e => format!("; the last renewal failed: {e}"),
    };
    match status.connected {
        _ if status.cert_not_after > 0 && left <= 0 => (
            503,
            format!("the agent's certificate expired {}s ago{renewal}", -left),
        ),
        Some(kind) if status.cert_not_after > 0 => (
            200,
            format!("tunnel up over {kind}; certificate valid for {left}s{renewal}"),
        ),
        Some(kind) => (200, format!("tunnel up over {kind}")),
        None => match status.last_error.as_str() {
            "" => (503, "no tunnel to the hub".to_owned()),
            e => (503, format!("no tunnel to the hub: {e}")),
        },
    }
}

/// Binds the probe listener.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_with_a_tunnel_on_a_live_certificate() {
        let up = AgentStatus {
            connected: Some(otter_tunnel::TransportKind::H2),
            cert_not_after: 1_000,
            ..Default::default()
        };
        let (code, text) = readiness(&up, 940);
        assert_eq!(code, 200, "{text}");
        assert!(text.contains("valid for 60s"), "{text}");
        // Expired by the hub's clock, though this one reads earlier.
        let behind = AgentStatus {
            clock_skew_ms: Some(90_000),
            last_renewal_error: "tunnel port: refused".into(),
            ..up.clone()
        };
        let (code, text) = readiness(&behind, 940);
        assert_eq!(code, 503, "{text}");
        assert!(text.contains("expired 30s ago"), "{text}");
        assert!(text.contains("tunnel port: refused"), "{text}");
        let down = AgentStatus {
            connected: None,
            last_error: "no transport worked".into(),
            ..up
        };
        let (code, text) = readiness(&down, 940);
        assert_eq!(code, 503);
        assert!(text.contains("no transport worked"), "{text}");
    }
}
