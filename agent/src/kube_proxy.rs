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
use tokio::io::AsyncWriteExt;

/// Largest request body forwarded (a manifest, a patch).
pub const MAX_REQUEST_BODY: usize = 16 * 1024 * 1024;

/// Characters kept as they are in `Impersonate-Extra-<key>` names.
const EXTRA_KEY: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.');

/// The proxy: one kube client, shared by all requests.
#[derive(Clone)]
pub struct KubeProxy {
    client: kube::Client,
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
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }

    /// From in-cluster config, `KUBECONFIG` or `~/.kube/config`.
    /// The tower service the tunnel serves requests with.
    pub fn service(&self) -> ProxyService {
        ProxyService {
            client: self.client.clone(),
        }
    }
}

/// Tower service of the proxy.
#[derive(Clone)]
pub struct ProxyService {
    client: kube::Client,
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
        let client = self.client.clone();
        Box::pin(async move { Ok(proxy(client, req).await) })
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

/// Sets the impersonation headers for `caller`, after removing whatever
/// identity headers the request carried.
pub fn impersonate(headers: &mut http::HeaderMap, caller: &Caller) -> Result<(), String> {
    let drop: Vec<http::HeaderName> = headers
        .keys()
        .filter(|n| {
            let n = n.as_str();
            n == "authorization"
                || n.starts_with("impersonate-")
                || matches!(
                    n,
                    "host"
                        | "connection"
                        | "keep-alive"
                        | "transfer-encoding"
                        | "te"
                        | "proxy-connection"
                )
        })
        .cloned()
        .collect();
    for n in drop {
        headers.remove(n);
    }
    let value = |v: &str| {
        http::HeaderValue::from_str(v)
            .map_err(|_| format!("identity value {v:?} is not a valid header"))
    };
    headers.insert("impersonate-user", value(&caller.user)?);
    for g in &caller.groups {
        headers.append("impersonate-group", value(g)?);
    }
    if !caller.uid.is_empty() {
        headers.insert("impersonate-uid", value(&caller.uid)?);
    }
    for extra in &caller.extra {
        let key = percent_encoding::utf8_percent_encode(&extra.key.to_ascii_lowercase(), EXTRA_KEY)
            .to_string();
        let name = http::HeaderName::from_bytes(format!("impersonate-extra-{key}").as_bytes())
            .map_err(|_| format!("extra key {:?} is not usable", extra.key))?;
        for v in &extra.values {
            headers.append(name.clone(), value(v)?);
        }
    }
    Ok(())
}

async fn proxy(client: kube::Client, req: http::Request<RequestBody>) -> http::Response<ProxyBody> {
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
    if let Err(e) = impersonate(&mut parts.headers, &caller) {
        return status(400, "BadRequest", &e);
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
    use otter_tunnel::frame::Extra;

    #[test]
    fn client_identity_headers_are_replaced_by_the_verified_caller() {
        let mut h = http::HeaderMap::new();
        h.insert("authorization", "Bearer stolen".parse().unwrap());
        h.insert("impersonate-user", "system:admin".parse().unwrap());
        h.append("impersonate-group", "system:masters".parse().unwrap());
        h.insert("accept", "application/json".parse().unwrap());
        let caller = Caller {
            user: "alice".into(),
            groups: vec!["system:authenticated".into(), "devs".into()],
            uid: "u-1".into(),
            extra: vec![Extra {
                key: "Scopes/Team".into(),
                values: vec!["a".into(), "b".into()],
            }],
        };
        impersonate(&mut h, &caller).unwrap();
        assert!(h.get("authorization").is_none());
        assert_eq!(h["impersonate-user"], "alice");
        let groups: Vec<_> = h
            .get_all("impersonate-group")
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(groups, ["system:authenticated", "devs"]);
        assert_eq!(h["impersonate-uid"], "u-1");
        let extra: Vec<_> = h
            .get_all("impersonate-extra-scopes%2fteam")
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(extra, ["a", "b"]);
        assert_eq!(h["accept"], "application/json");
        let bad = Caller {
            user: "a\nb".into(),
            ..Default::default()
        };
        assert!(impersonate(&mut http::HeaderMap::new(), &bad).is_err());
    }
}
