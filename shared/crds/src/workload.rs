//! `workload.otterscale.io/v1alpha1`: applications.
//!
//! An [`Application`] bundles a Deployment with an optional Service and an optional
//! PersistentVolumeClaim; the specs are the Kubernetes core types themselves.

use k8s_openapi::api::apps::v1::DeploymentSpec;
use k8s_openapi::api::core::v1::{PersistentVolumeClaimSpec, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use crate::common::ResourceReference;

/// Desired state of an Application: a Deployment, and optionally a Service and a
/// PersistentVolumeClaim.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "workload.otterscale.io",
    version = "v1alpha1",
    kind = "Application",
    namespaced,
    status = "ApplicationStatus",
    category = "otterscale",
    derive = "PartialEq",
    doc = "One workload as a single object: a Deployment with an optional Service and an optional PersistentVolumeClaim.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ApplicationSpec {
    /// Pod template, replicas and update strategy of the workload.
    pub deployment: DeploymentSpec,

    /// Service exposing the workload; none is created when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceSpec>,

    /// Claim for persistent storage; none is created when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<PersistentVolumeClaimSpec>,
}

/// Observed state of an Application, with the objects it manages.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApplicationStatus {
    /// The metadata.generation the controller last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Its Deployment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment_ref: Option<ResourceReference>,

    /// Its Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_ref: Option<ResourceReference>,

    /// Its PersistentVolumeClaim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim_ref: Option<ResourceReference>,

    /// Status conditions, one per type (for example Ready, Progressing, Degraded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::conditions")]
    pub conditions: Option<Vec<Condition>>,
}
