//! Kubernetes errors as gRPC statuses, in one place.
//!
//! The Kubernetes `Status` reason picks the code and its message is kept, so
//! the caller reads what the apiserver said:
//!
//! | reason | code |
//! |---|---|
//! | Unauthorized | Unauthenticated |
//! | Forbidden | PermissionDenied |
//! | NotFound, Gone, Expired | NotFound |
//! | AlreadyExists | AlreadyExists |
//! | Conflict (stale resourceVersion) | Aborted: read again and retry |
//! | Conflict (server-side apply field managers) | FailedPrecondition: apply with force, or drop the fields |
//! | Invalid, BadRequest, MethodNotAllowed, UnsupportedMediaType, NotAcceptable, RequestEntityTooLarge | InvalidArgument |
//! | Timeout, ServerTimeout | DeadlineExceeded |
//! | TooManyRequests | ResourceExhausted |
//! | ServiceUnavailable | Unavailable |
//! | InternalError and anything else | Internal |
//!
//! A reason the table does not know falls back on the HTTP code. Errors
//! that never reached the apiserver (connection, TLS) are Unavailable.

use tonic::{Code, Status};

/// The gRPC status for a Kubernetes `Status`.
pub fn from_kube_status(s: &kube::core::Status) -> Status {
    let code = code_for(&s.reason, s.code, is_field_conflict(s));
    let message = if s.message.is_empty() {
        format!("Kubernetes API answered {} {}", s.code, s.reason)
    } else {
        s.message.clone()
    };
    Status::new(code, message)
}

/// The gRPC status for any error of the Kubernetes client.
pub fn from_kube(e: kube::Error) -> Status {
    match e {
        kube::Error::Api(s) => from_kube_status(&s),
        kube::Error::HyperError(e) => {
            Status::unavailable(format!("cannot reach the Kubernetes API: {e}"))
        }
        kube::Error::Service(e) => {
            Status::unavailable(format!("cannot reach the Kubernetes API: {e}"))
        }
        kube::Error::SerdeError(e) => Status::internal(format!(
            "the Kubernetes API answered something unexpected: {e}"
        )),
        kube::Error::BuildRequest(e) => Status::invalid_argument(format!("bad request: {e}")),
        kube::Error::UpgradeConnection(e) => from_upgrade(e),
        other => Status::internal(format!("Kubernetes client: {other}")),
    }
}

fn from_upgrade(e: kube::client::UpgradeConnectionError) -> Status {
    Status::unavailable(format!(
        "WebSocket upgrade with the Kubernetes API failed: {e}"
    ))
}

/// Whether a 409 is a server-side apply conflict between field managers.
fn is_field_conflict(s: &kube::core::Status) -> bool {
    s.details
        .as_ref()
        .is_some_and(|d| d.causes.iter().any(|c| c.reason == "FieldManagerConflict"))
        || s.message.contains("conflict with \"")
        || s.message.contains("Apply failed with")
}

fn code_for(reason: &str, http: u16, field_conflict: bool) -> Code {
    match reason {
        "Unauthorized" => Code::Unauthenticated,
        "Forbidden" => Code::PermissionDenied,
        "NotFound" | "Gone" | "Expired" => Code::NotFound,
        "AlreadyExists" => Code::AlreadyExists,
        "Conflict" if field_conflict => Code::FailedPrecondition,
        "Conflict" => Code::Aborted,
        "Invalid"
        | "BadRequest"
        | "MethodNotAllowed"
        | "UnsupportedMediaType"
        | "NotAcceptable"
        | "RequestEntityTooLarge" => Code::InvalidArgument,
        "Timeout" | "ServerTimeout" => Code::DeadlineExceeded,
        "TooManyRequests" => Code::ResourceExhausted,
        "ServiceUnavailable" => Code::Unavailable,
        "InternalError" => Code::Internal,
        _ => match http {
            400 | 405 | 406 | 413 | 415 | 422 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 | 410 => Code::NotFound,
            409 if field_conflict => Code::FailedPrecondition,
            409 => Code::Aborted,
            429 => Code::ResourceExhausted,
            503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            _ => Code::Internal,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(reason: &str, code: u16, message: &str) -> kube::core::Status {
        serde_json::from_value(serde_json::json!({
            "status": "Failure", "reason": reason, "code": code, "message": message
        }))
        .unwrap()
    }

    #[test]
    fn reasons_map_to_codes_and_keep_the_message() {
        let cases = [
            ("Unauthorized", 401, Code::Unauthenticated),
            ("Forbidden", 403, Code::PermissionDenied),
            ("NotFound", 404, Code::NotFound),
            ("Gone", 410, Code::NotFound),
            ("Expired", 410, Code::NotFound),
            ("AlreadyExists", 409, Code::AlreadyExists),
            ("Conflict", 409, Code::Aborted),
            ("Invalid", 422, Code::InvalidArgument),
            ("BadRequest", 400, Code::InvalidArgument),
            ("Timeout", 504, Code::DeadlineExceeded),
            ("TooManyRequests", 429, Code::ResourceExhausted),
            ("ServiceUnavailable", 503, Code::Unavailable),
            ("InternalError", 500, Code::Internal),
            ("", 403, Code::PermissionDenied),
            ("", 422, Code::InvalidArgument),
        ];
        for (reason, http, want) in cases {
            let s = from_kube_status(&status(reason, http, "the message"));
            assert_eq!(s.code(), want, "{reason} {http}");
            assert_eq!(s.message(), "the message");
        }
    }

    #[test]
    fn apply_conflicts_are_failed_precondition() {
        let mut s = status(
            "Conflict",
            409,
            "Apply failed with 1 conflict: conflict with \"other\": .data.k",
        );
        assert_eq!(from_kube_status(&s).code(), Code::FailedPrecondition);
        s.message = "the object has been modified".into();
        assert_eq!(from_kube_status(&s).code(), Code::Aborted);
    }
}
