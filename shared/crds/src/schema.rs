//! Hand-written schema fragments shared by several API groups.
//!
//! The derive covers almost everything; these functions cover the few places where
//! the upstream schema is not what a plain Rust type would produce: free-form
//! objects kept by the apiserver as sent, and condition lists with the validation
//! the Kubernetes API conventions put on `metav1.Condition`.

use schemars::{Schema, SchemaGenerator, json_schema};

/// Format of a resource quantity (`1.5Gi`, `500m`, `2`), as the apiserver parses it.
pub const QUANTITY_PATTERN: &str = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$";

/// A resource quantity: an integer or a string in [`QUANTITY_PATTERN`].
pub fn quantity(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "anyOf": [{ "type": "integer" }, { "type": "string" }],
        "pattern": QUANTITY_PATTERN,
        "x-kubernetes-int-or-string": true,
    })
}

/// A free-form JSON object that the apiserver stores without pruning.
pub fn preserve_unknown_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// A list of status conditions, keyed by `type` (a list-map for server-side apply),
/// each item validated the way the Kubernetes API conventions require.
pub fn conditions(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "description": "One aspect of the current state of the object.",
            "type": "object",
            "required": ["lastTransitionTime", "message", "reason", "status", "type"],
            "properties": {
                "lastTransitionTime": {
                    "description": "When the condition last changed from one status to another.",
                    "type": "string",
                    "format": "date-time",
                },
                "message": {
                    "description": "Human-readable details about the last transition; may be empty.",
                    "type": "string",
                    "maxLength": 32768,
                },
                "observedGeneration": {
                    "description": "The metadata.generation the condition was computed from.",
                    "type": "integer",
                    "format": "int64",
                    "minimum": 0,
                },
                "reason": {
                    "description": "Machine-readable CamelCase reason for the last transition; never empty.",
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 1024,
                    "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                },
                "status": {
                    "description": "Status of the condition: True, False or Unknown.",
                    "type": "string",
                    "enum": ["True", "False", "Unknown"],
                },
                "type": {
                    "description": "Condition type, in CamelCase or as foo.example.com/CamelCase.",
                    "type": "string",
                    "maxLength": 316,
                    "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
                },
            },
        },
    })
}
