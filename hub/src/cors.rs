//! CORS for the browser dashboard: preflight answers and the headers that
//! let Connect and gRPC-Web clients read statuses and trailers.

use http::{HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt, Empty};

use crate::forward::HttpBody;

const ALLOW_METHODS: &str = "GET, POST, OPTIONS";
const ALLOW_HEADERS: &str = "authorization, content-type, content-encoding, accept-encoding, \
    connect-protocol-version, connect-timeout-ms, connect-content-encoding, connect-accept-encoding, \
    grpc-timeout, x-grpc-web, x-user-agent";
const EXPOSE_HEADERS: &str = "grpc-status, grpc-message, grpc-status-details-bin, \
    connect-content-encoding, content-encoding, date";
/// How long a browser may cache a preflight answer.
const MAX_AGE: &str = "7200";

fn allowed(origins: &[String], origin: &HeaderValue) -> bool {
    let Ok(origin) = origin.to_str() else {
        return false;
    };
    origins.iter().any(|o| o == "*" || o == origin)
}

/// Answers a preflight request from an allowed origin; `None` for anything
/// else (including preflights from origins not allowed, which then fail in
/// the browser as they should).
pub fn preflight<B>(
    origins: &[String],
    req: &http::Request<B>,
) -> Option<http::Response<HttpBody>> {
    if req.method() != Method::OPTIONS {
        return None;
    }
    let origin = req.headers().get(header::ORIGIN)?;
    req.headers().get(header::ACCESS_CONTROL_REQUEST_METHOD)?;
    let mut resp = http::Response::new(Empty::new().map_err(|e| match e {}).boxed_unsync());
    *resp.status_mut() = StatusCode::NO_CONTENT;
    if allowed(origins, origin) {
        let h = resp.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static(ALLOW_METHODS),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static(ALLOW_HEADERS),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static(MAX_AGE),
        );
        h.insert(header::VARY, HeaderValue::from_static("origin"));
    }
    Some(resp)
}

/// Adds CORS headers to an actual response for an allowed origin.
pub fn decorate(
    mut resp: http::Response<HttpBody>,
    origin: Option<HeaderValue>,
    origins: &[String],
) -> http::Response<HttpBody> {
    if let Some(origin) = origin.filter(|o| allowed(origins, o)) {
        let h = resp.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        h.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static(EXPOSE_HEADERS),
        );
        h.append(header::VARY, HeaderValue::from_static("origin"));
    }
    resp
}
