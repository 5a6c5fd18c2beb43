//! The agent's Kubernetes API proxy: requests the hub forwards from kubectl
//! (`/clusters/<name>/…` on the hub) go to this cluster's apiserver with the
//! agent's own credentials plus impersonation of the caller the hub
//! verified, so Kubernetes RBAC decides what the caller may do.
//!
//! Identity comes only from the tunnel's request head: whatever
//! `Authorization` or `Impersonate-*` headers arrive are dropped first.

use std::{
    convert::Infallible,
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use futures::StreamExt;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use otter_tunnel::{BoxError, Caller, http::RequestBody};

use crate::impersonation::{self, Ceiling};
use tokio::io::AsyncWriteExt;

/// Largest request body forwarded (a manifest, a patch).
pub const MAX_REQUEST_BODY: usize = 16 * 1024 * 1024;

/// The proxy: one kube client, shared by all requests.
#[derive(Clone)]
pub struct KubeProxy {
    client: kube::Client,
    ceiling: Ceiling,
}

impl std::fmt::Debug for KubeProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KubeProxy")
    }
}

/// Response body of the proxy: the apiserver's body, streamed.
pub type ProxyBody =
    http_body_util::combinators::UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

impl KubeProxy {
    /// Sends with the agent's own `client`, acting as callers within the
    /// default ceiling.
    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            ceiling: Ceiling::default(),
        }
    }

    /// Sends with the agent's own client and the ceiling of `access`: the
    /// same rules as the gRPC services.
    pub fn for_access(access: &crate::kube::KubeAccess) -> Self {
        Self {
            client: access.agent().clone(),
            ceiling: access.ceiling().clone(),
        }
    }

    /// The tower service the tunnel serves requests with.
    pub fn service(&self) -> ProxyService {
        ProxyService {
            client: self.client.clone(),
            ceiling: self.ceiling.clone(),
        }
    }
}

/// Tower service of the proxy.
#[derive(Clone)]
pub struct ProxyService {
    client: kube::Client,
    ceiling: Ceiling,
}

impl std::fmt::Debug for ProxyService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProxyService")
    }
}

impl tower::Service<http::Request<RequestBody>> for ProxyService {
    type Response = http::Response<ProxyBody>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<RequestBody>) -> Self::Future {
        let (client, ceiling) = (self.client.clone(), self.ceiling.clone());
        Box::pin(async move { Ok(proxy(client, ceiling, req).await) })
    }
}

/// A Kubernetes `Status` error response, as kubectl expects to read it.
pub fn status(code: u16, reason: &str, message: &str) -> http::Response<ProxyBody> {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    });
    let mut resp = http::Response::new(
        http_body_util::Full::new(Bytes::from(body.to_string()))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *resp.status_mut() =
        http::StatusCode::from_u16(code).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

/// Drops the hop-by-hop headers a request carried and replaces its
/// identity headers with the caller's (see [`crate::impersonation`]).
fn prepare(
    headers: &mut http::HeaderMap,
    ceiling: &Ceiling,
    caller: &Caller,
) -> Result<(), impersonation::Refusal> {
    for hop in [
        "host",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "proxy-connection",
    ] {
        headers.remove(hop);
    }
    impersonation::impersonate(headers, ceiling, caller)
}

async fn proxy(
    client: kube::Client,
    ceiling: Ceiling,
    req: http::Request<RequestBody>,
) -> http::Response<ProxyBody> {
    let Some(caller) = req.extensions().get::<Caller>().cloned() else {
        return status(
            401,
            "Unauthorized",
            "no verified caller came with this request",
        );
    };
    if caller.user.is_empty() {
        return status(
            401,
            "Unauthorized",
            "no verified caller came with this request",
        );
    }
    let upgrade = req.headers().get(http::header::UPGRADE).cloned();
    let (mut parts, body) = req.into_parts();
    if let Err(refusal) = prepare(&mut parts.headers, &ceiling, &caller) {
        let (code, reason) = refusal.http();
        return status(code, reason, &refusal.to_string());
    }
    if let Some(protocol) = upgrade {
        // exec, attach, port-forward: WebSocket or SPDY, relayed byte for byte.
        parts.headers.insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("Upgrade"),
        );
        parts.headers.insert(http::header::UPGRADE, protocol);
        return upgrade_connection(client, parts, body).await;
    }
    let body = match http_body_util::Limited::new(body, MAX_REQUEST_BODY)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => return status(413, "RequestEntityTooLarge", &format!("request body: {e}")),
    };
    let mut upstream = http::Request::new(kube::client::Body::from(body.to_vec()));
    *upstream.method_mut() = parts.method;
    *upstream.uri_mut() = parts.uri;
    *upstream.headers_mut() = parts.headers;
    match client.send(upstream).await {
        Ok(resp) => resp.map(|b| Passthrough(b).boxed_unsync()),
        Err(e) => status(
            502,
            "ServiceUnavailable",
            &format!("the cluster's API server did not answer: {e}"),
        ),
    }
}

/// Sends an HTTP/1.1 Upgrade request to the apiserver. When it switches
/// protocols, the response body becomes the apiserver's bytes and the
/// request body (the tunnel's DATA chunks after the head) is written to it,
/// until either side ends. Anything else is answered as a plain response.
async fn upgrade_connection(
    client: kube::Client,
    parts: http::request::Parts,
    body: RequestBody,
) -> http::Response<ProxyBody> {
    let mut upstream = http::Request::new(kube::client::Body::empty());
    *upstream.method_mut() = parts.method;
    *upstream.uri_mut() = parts.uri;
    *upstream.headers_mut() = parts.headers;
    let mut resp = match client.send(upstream).await {
        Ok(resp) => resp,
        Err(e) => {
            return status(
                502,
                "ServiceUnavailable",
                &format!("the cluster's API server did not answer: {e}"),
            );
        }
    };
    if resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
        return resp.map(|b| Passthrough(b).boxed_unsync());
    }
    let upgraded = match hyper::upgrade::on(&mut resp).await {
        Ok(u) => u,
        Err(e) => {
            return status(
                502,
                "ServiceUnavailable",
                &format!("the cluster's API server did not switch protocols: {e}"),
            );
        }
    };
    let (read, mut write) = tokio::io::split(hyper_util::rt::TokioIo::new(upgraded));
    // Caller → apiserver. Ends with the request body: the hub's END (the
    // caller closed its side) or the stream going away.
    tokio::spawn(async move {
        let mut body = std::pin::pin!(body);
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data()
                && write.write_all(&data).await.is_err()
            {
                return;
            }
        }
        let _ = write.shutdown().await;
    });
    // Apiserver → caller, as the response body.
    let (parts, _) = resp.into_parts();
    let stream = tokio_util::io::ReaderStream::with_capacity(read, 64 * 1024)
        .map(|r| r.map(Frame::data).map_err(|e| -> BoxError { Box::new(e) }));
    http::Response::from_parts(
        parts,
        http_body_util::StreamBody::new(stream).boxed_unsync(),
    )
}

/// The apiserver's body, with its error boxed.
struct Passthrough(kube::client::Body);

impl Body for Passthrough {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.0)
            .poll_frame(cx)
            .map(|f| f.map(|r| r.map_err(|e| -> Self::Error { Box::new(e) })))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_and_identity_headers_are_replaced_and_the_ceiling_holds() {
        let mut h = http::HeaderMap::new();
        h.insert("authorization", "Bearer stolen".parse().unwrap());
        h.insert("impersonate-user", "system:admin".parse().unwrap());
        h.insert("connection", "close".parse().unwrap());
        h.insert("accept", "application/json".parse().unwrap());
        let caller = Caller {
            user: "otter:alice".into(),
            groups: vec!["otter:acme:devs".into()],
            ..Default::default()
        };
        prepare(&mut h, &Ceiling::default(), &caller).unwrap();
        assert!(h.get("authorization").is_none() && h.get("connection").is_none());
        assert_eq!(h["impersonate-user"], "otter:alice");
        assert_eq!(h["accept"], "application/json");
        let masters = Caller {
            groups: vec!["system:masters".into()],
            ..caller
        };
        let refused = prepare(&mut h, &Ceiling::default(), &masters).unwrap_err();
        assert_eq!(refused.http(), (403, "Forbidden"));
    }
}
