//! The crate's error type (start-up and plumbing failures) and the Kubernetes `Status`
//! errors that the API handlers return to clients.

use serde_json::{Value, json};

/// Errors from starting or running the server (not API errors: those are [`ApiError`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Binding or accepting on the listen address failed.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// Creating the CA or the serving certificate failed.
    #[error("certificate generation failed: {0}")]
    Cert(#[from] rcgen::Error),
    /// Building the TLS configuration failed.
    #[error("tls configuration failed: {0}")]
    Tls(#[from] rustls::Error),
    /// The configuration handed to [`crate::KubeSim::start`] is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// A Kubernetes API error, rendered as a `Status` object with the matching HTTP code.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status code, also `Status.code`.
    pub code: u16,
    /// `Status.reason`, e.g. `NotFound`.
    pub reason: &'static str,
    /// Human readable message, worded like the real apiserver's.
    pub message: String,
    /// `Status.details`, when the apiserver sets one.
    pub details: Option<Value>,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    pub fn with_details(mut self, details: Value) -> Self {
        self.details = Some(details);
        self
    }

    /// The `details` object the apiserver attaches for a named object of a resource.
    fn named(name: &str, group: &str, kind: &str) -> Value {
        let mut d = json!({ "name": name, "kind": kind });
        if !group.is_empty() {
            d["group"] = json!(group);
        }
        d
    }

    pub fn not_found(group: &str, plural: &str, name: &str) -> Self {
        let qualified = qualified(group, plural);
        Self::new(404, "NotFound", format!("{qualified} \"{name}\" not found"))
            .with_details(Self::named(name, group, plural))
    }

    pub fn already_exists(group: &str, plural: &str, name: &str) -> Self {
        let qualified = qualified(group, plural);
        Self::new(
            409,
            "AlreadyExists",
            format!("{qualified} \"{name}\" already exists"),
        )
        .with_details(Self::named(name, group, plural))
    }

    pub fn conflict(group: &str, plural: &str, name: &str) -> Self {
        let qualified = qualified(group, plural);
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {qualified} \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
            ),
        )
        .with_details(Self::named(name, group, plural))
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// 422 Invalid with one cause per field error, in the apiserver's wording.
    pub fn invalid(group: &str, kind: &str, name: &str, causes: Vec<FieldCause>) -> Self {
        let list: Vec<String> = causes
            .iter()
            .map(|c| format!("{}: {}", c.field, c.message))
            .collect();
        let summary = if list.len() == 1 {
            list[0].clone()
        } else {
            format!("[{}]", list.join(", "))
        };
        let kind_q = if group.is_empty() {
            kind.to_string()
        } else {
            format!("{kind}.{group}")
        };
        let causes_json: Vec<Value> = causes
            .iter()
            .map(|c| json!({ "reason": c.reason, "message": c.message, "field": c.field }))
            .collect();
        let mut details = json!({ "name": name, "kind": kind, "causes": causes_json });
        if !group.is_empty() {
            details["group"] = json!(group);
        }
        Self::new(
            422,
            "Invalid",
            format!("{kind_q} \"{name}\" is invalid: {summary}"),
        )
        .with_details(details)
    }

    pub fn unauthorized() -> Self {
        Self::new(401, "Unauthorized", "Unauthorized")
    }

    pub fn forbidden(message: impl Into<String>, details: Value) -> Self {
        Self::new(403, "Forbidden", message).with_details(details)
    }

    pub fn gone(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    pub fn method_not_supported(what: &str) -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            format!("the server does not allow this method on the requested resource ({what})"),
        )
    }

    pub fn unsupported_media_type(message: impl Into<String>) -> Self {
        Self::new(415, "UnsupportedMediaType", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalError", message)
    }

    pub fn path_not_found() -> Self {
        Self::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
        .with_details(json!({}))
    }

    /// The `Status` object itself.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

/// One field error of a 422 Invalid.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldCause {
    /// Cause type as the apiserver names it: `FieldValueRequired`, `FieldValueInvalid`, ...
    pub reason: &'static str,
    /// The message without the field, e.g. `Unsupported value: "x": supported values: "a"`.
    pub message: String,
    /// The field path, e.g. `spec.size`.
    pub field: String,
}

/// `pods` or `deployments.apps`: how the apiserver names a resource in messages.
pub fn qualified(group: &str, plural: &str) -> String {
    if group.is_empty() {
        plural.to_string()
    } else {
        format!("{plural}.{group}")
    }
}
