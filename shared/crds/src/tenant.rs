//! `tenant.otterscale.io/v1alpha1`: workspaces.
//!
//! A [`Workspace`] is a namespace with its members (RBAC), quotas, default limits
//! and network isolation.

use k8s_openapi::api::core::v1::{LimitRangeSpec, ResourceQuotaSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use crate::common::ResourceReference;

/// Access level of a workspace member, mapped to RBAC in the namespace.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum MemberRole {
    /// Full control of the workspace.
    Admin,
    /// Manage application objects, but not role bindings.
    Edit,
    /// Read only.
    View,
}

/// One member of a workspace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceMember {
    /// Access level.
    pub role: MemberRole,

    /// Identity of the member (an OIDC subject or user name), used as the RBAC subject.
    #[schemars(length(min = 1, max = 253))]
    pub subject: String,

    /// Harbor user name, used for the registry project instead of subject when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub username: Option<String>,

    /// Display name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,

    /// True for a service account rather than a person.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<bool>,
}

/// Ingress isolation of the workspace (NetworkPolicy and Istio AuthorizationPolicy).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[x_kube(validation = Rule::new("!has(self.allowedNamespaces) || size(self.allowedNamespaces) == 0 || self.enabled").message("allowedNamespaces can only be set when network isolation is enabled"))]
#[serde(rename_all = "camelCase")]
pub struct NetworkIsolationSpec {
    /// Deny ingress from everywhere but the allowed namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,

    /// Namespaces still allowed in while isolation is on; add system namespaces
    /// (a mesh or monitoring) that need access.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = 64),
        inner(
            length(min = 1, max = 63),
            regex(pattern = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)$")
        )
    )]
    #[x_kube(merge_strategy = ListMerge::Set)]
    pub allowed_namespaces: Option<Vec<String>>,
}

/// Desired state of a Workspace: namespace, members, quotas and isolation.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "tenant.otterscale.io",
    version = "v1alpha1",
    kind = "Workspace",
    status = "WorkspaceStatus",
    category = "otterscale",
    derive = "PartialEq",
    doc = "A namespace isolated for a team: member access through RBAC, resource quotas, default limits and network policies.",
    printcolumn(
        name = "Namespace",
        type_ = "string",
        json_path = ".status.namespaceRef.name"
    ),
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
pub struct WorkspaceSpec {
    /// Namespace created for the workspace, unique among workspaces; cannot change.
    /// Left out, an admission webhook picks a six-character name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = 63),
        regex(pattern = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    #[x_kube(
        validation = Rule::new("self == oldSelf").message("namespace is immutable"),
        validation = Rule::new("!(self in ['default','kube-system','kube-public','kube-node-lease','otterscale-system'])").message("namespace is reserved and cannot be used for a workspace")
    )]
    pub namespace: Option<String>,

    /// Rancher project of the workspace as `<cluster-id>:<project-id>`; cannot change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "rancherProjectID")]
    #[schemars(
        length(max = 507),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?:[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    #[x_kube(validation = Rule::new("self == oldSelf").message("rancherProjectID is immutable"))]
    pub rancher_project_id: Option<String>,

    /// Who may use the workspace; at least one admin.
    #[schemars(length(min = 1))]
    #[x_kube(
        merge_strategy = ListMerge::Atomic,
        validation = Rule::new("self.exists(u, u.role == 'admin')").message("at least one workspace member must have role 'admin'")
    )]
    pub members: Vec<WorkspaceMember>,

    /// Resource quota of the namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_quota: Option<ResourceQuotaSpec>,

    /// Default requests and limits for pods in the namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_range: Option<LimitRangeSpec>,

    /// Ingress isolation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_isolation: Option<NetworkIsolationSpec>,

    /// Label the namespace for license injection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub license_injection: Option<bool>,
}

/// Observed state of a Workspace, with the objects the controller made for it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceStatus {
    /// The metadata.generation the controller last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// The workspace's Namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_ref: Option<ResourceReference>,

    /// Its ResourceQuota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_quota_ref: Option<ResourceReference>,

    /// Its LimitRange.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_range_ref: Option<ResourceReference>,

    /// Its ConfigMap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_ref: Option<ResourceReference>,

    /// The RoleBindings of its members, one per name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub role_binding_refs: Option<Vec<ResourceReference>>,

    /// Its Istio PeerAuthentication (mTLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_authentication_ref: Option<ResourceReference>,

    /// Its Istio AuthorizationPolicy (isolation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authorization_policy_ref: Option<ResourceReference>,

    /// Its NetworkPolicy (isolation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy_ref: Option<ResourceReference>,

    /// Its image pull Secret with Harbor robot credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secret_ref: Option<ResourceReference>,

    /// Its FluxCD HelmRepository for the workspace's Harbor OCI registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub helm_repository_ref: Option<ResourceReference>,

    /// Status conditions, one per type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::conditions")]
    pub conditions: Option<Vec<Condition>>,
}
