//! The hub as a Kubernetes API endpoint per cluster: `/clusters/<name>/…`
//! (prefix configurable). kubectl's bearer token is checked here, its
//! `Authorization` and any `Impersonate-*` headers are dropped, and the
//! request travels on its own tunnel stream to the cluster's agent, which
//! sends it to its apiserver as the verified caller.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use otter_tunnel::frame::{Limits, TARGET_KUBE};

use crate::{
    auth,
    forward::HttpBody,
    link_service::LinkRecord,
    server::HubState,
    store::{StoreExt, tree},
};

/// Splits `/clusters/<name>/<rest>` into the cluster and the apiserver path
/// (with the query). `None` when the path is not under the prefix.
pub fn split<'a>(prefix: &str, path_and_query: &'a str) -> Option<(&'a str, String)> {
    let rest = path_and_query.strip_prefix(prefix)?.strip_prefix('/')?;
    let (cluster, tail) = match rest.find(['/', '?']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if cluster.is_empty() {
        return None;
    }
    let tail = if tail.is_empty() || tail.starts_with('?') {
        format!("/{tail}")
    } else {
        tail.to_owned()
    };
    Some((cluster, tail))
}

/// A Kubernetes `Status` error, which kubectl prints as its usual message.
pub fn status(code: u16, reason: &str, message: &str) -> http::Response<HttpBody> {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    });
    let mut resp = http::Response::new(
        Full::new(Bytes::from(body.to_string()))
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

/// Serves one request of the proxy.
pub async fn handle(
    state: Arc<HubState>,
    cluster: String,
    tail: String,
    req: http::Request<Incoming>,
) -> http::Response<HttpBody> {
    let caller = match auth::authenticate(&state, req.headers()).await {
        Ok(c) => c,
        Err(e) => return status(401, "Unauthorized", e.message()),
    };
    if req.headers().get(http::header::UPGRADE).is_some() {
        return status(
            501,
            "NotImplemented",
            "exec, attach and port-forward through the hub's Kubernetes proxy are not available in this build; use `otter exec` and `otter port-forward`",
        );
    }
    let Some(tunnel) = state.registry.get(&cluster) else {
        return match state.store.get::<LinkRecord>(tree::LINKS, &cluster) {
            Ok(Some(_)) => status(
                503,
                "ServiceUnavailable",
                &format!("cluster {cluster} is offline"),
            ),
            Ok(None) => status(
                404,
                "NotFound",
                &format!("cluster {cluster} is not registered"),
            ),
            Err(e) => status(500, "InternalError", &e.to_string()),
        };
    };
    let Ok(permit) = tunnel.calls.clone().try_acquire_owned() else {
        return status(
            429,
            "TooManyRequests",
            &format!("cluster {cluster} has too many calls in flight; retry later"),
        );
    };
    let stream = match tunnel.opener.open().await {
        Ok(s) => s,
        Err(e) => {
            return status(
                503,
                "ServiceUnavailable",
                &format!("cluster {cluster}: tunnel failed: {e}"),
            );
        }
    };
    let (mut parts, body) = req.into_parts();
    crate::forward::strip_client_headers(&mut parts.headers);
    parts.uri = match tail.parse() {
        Ok(u) => u,
        Err(_) => return status(400, "BadRequest", "bad request path"),
    };
    let body = body.map_err(|e| std::io::Error::other(e.to_string()));
    let req = http::Request::from_parts(parts, body);
    match otter_tunnel::http::forward_to(
        TARGET_KUBE,
        stream,
        Some(caller),
        req,
        Limits::default(),
        Some(Box::new(permit)),
    )
    .await
    {
        Ok(resp) => resp.map(|b| {
            b.map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
                .boxed_unsync()
        }),
        Err(e) => status(
            503,
            "ServiceUnavailable",
            &format!("cluster {cluster}: {e}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cluster_and_path() {
        assert_eq!(
            split("/clusters", "/clusters/edge-1/api/v1/pods?limit=500"),
            Some(("edge-1", "/api/v1/pods?limit=500".into()))
        );
        assert_eq!(
            split("/clusters", "/clusters/edge-1"),
            Some(("edge-1", "/".into()))
        );
        assert_eq!(
            split("/clusters", "/clusters/edge-1?x=1"),
            Some(("edge-1", "/?x=1".into()))
        );
        assert_eq!(split("/clusters", "/clusters/"), None);
        assert_eq!(split("/clusters", "/clustersx/a"), None);
        assert_eq!(split("/k", "/k/c/version"), Some(("c", "/version".into())));
    }
}
