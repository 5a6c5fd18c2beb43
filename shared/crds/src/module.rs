//! `module.otterscale.io/v1alpha1`: platform modules.
//!
//! A [`ModuleTemplate`] is a catalogue entry holding a FluxCD HelmRelease or
//! Kustomization spec; a [`Module`] installs one template, optionally into another
//! namespace or with other Helm values.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use crate::common::ResourceReference;

/// Desired state of a Module: which template to install, and overrides.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "module.otterscale.io",
    version = "v1alpha1",
    kind = "Module",
    status = "ModuleStatus",
    category = "otterscale",
    derive = "PartialEq",
    doc = "A platform module installed from a ModuleTemplate; the controller creates the FluxCD HelmRelease or Kustomization and reports its state back.",
    printcolumn(name = "Template", type_ = "string", json_path = ".spec.templateRef"),
    printcolumn(name = "Namespace", type_ = "string", json_path = ".status.namespace"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Outdated",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"UpgradeAvailable\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ModuleSpec {
    /// Name of the ModuleTemplate to install; cannot change.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("templateRef is immutable"))]
    pub template_ref: String,

    /// Target namespace, overriding the template's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)$")
    )]
    pub namespace: Option<String>,

    /// Helm values overriding the template's; ignored for Kustomization templates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::preserve_unknown_object")]
    pub values: Option<serde_json::Value>,

    /// Template generation approved for rollout: while the template's generation is
    /// higher, its changes wait. Left out, every template change rolls out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_template_generation: Option<i64>,
}

/// Observed state of a Module, with the FluxCD objects it manages.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModuleStatus {
    /// The metadata.generation the controller last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Template generation last applied to the FluxCD objects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_template_generation: Option<i64>,

    /// Current generation of the template; above appliedTemplateGeneration an
    /// upgrade is available.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available_template_generation: Option<i64>,

    /// Namespace the FluxCD objects were created in (override or template default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,

    /// The FluxCD HelmRelease of the module.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub helm_release_ref: Option<ResourceReference>,

    /// The FluxCD Kustomization of the module.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kustomization_ref: Option<ResourceReference>,

    /// Status conditions, one per type (for example Ready, TemplateNotFound).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::conditions")]
    pub conditions: Option<Vec<Condition>>,
}

/// Desired state of a ModuleTemplate: a default namespace and exactly one of a
/// FluxCD HelmRelease or Kustomization spec.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "module.otterscale.io",
    version = "v1alpha1",
    kind = "ModuleTemplate",
    category = "otterscale",
    derive = "PartialEq",
    doc = "A reusable platform module blueprint holding a Helm chart (FluxCD HelmRelease) or a Kustomization; Modules install it.",
    printcolumn(name = "Namespace", type_ = "string", json_path = ".spec.namespace"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("(has(self.helmRelease) && !has(self.kustomization)) || (!has(self.helmRelease) && has(self.kustomization))").message("exactly one of helmRelease or kustomization must be set"))]
#[serde(rename_all = "camelCase")]
pub struct ModuleTemplateSpec {
    /// What the module is, for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub description: Option<String>,

    /// Namespace the FluxCD objects go to unless a Module overrides it.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)$")
    )]
    pub namespace: String,

    /// FluxCD HelmRelease spec; its schema is FluxCD's, resolved at run time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::preserve_unknown_object")]
    pub helm_release: Option<serde_json::Value>,

    /// FluxCD Kustomization spec; its schema is FluxCD's, resolved at run time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::preserve_unknown_object")]
    pub kustomization: Option<serde_json::Value>,
}
