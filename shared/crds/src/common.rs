//! Types used by more than one API group.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Points at an object that a controller created for the owning resource.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct ResourceReference {
    /// Name of the object.
    pub name: String,

    /// Namespace of the object; left out for cluster-scoped objects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}
