//! `fleet.otterscale.io/v1alpha1`: Talos Linux clusters on bare metal.
//!
//! A [`Cluster`] describes one Talos Kubernetes cluster; each [`Machine`] is one
//! bare-metal node of it, backed by a Metal3 `BareMetalHost`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use crate::common::ResourceReference;

/// Where a cluster is in its life.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ClusterPhase {
    Pending,
    Provisioning,
    Provisioned,
    Ready,
    Failed,
    Deleting,
}

/// Address of the Kubernetes API server.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct Endpoint {
    /// DNS name or IP address of the API server.
    #[schemars(length(min = 1))]
    pub host: String,

    /// TCP port of the API server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535), extend("default" = 6443))]
    pub port: Option<i32>,
}

/// Hash algorithm of an image checksum.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChecksumType {
    Sha256,
    Sha512,
    Md5,
    Auto,
}

/// Disk format of an OS image.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ImageFormat {
    Raw,
    Qcow2,
    LiveIso,
}

/// The OS image written to every bare-metal host of the cluster.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageSpec {
    /// Where the image is downloaded from, for example a Talos raw image on an HTTP server.
    #[schemars(length(min = 1))]
    pub url: String,

    /// Checksum of the image, or a URL of a file that holds it.
    #[schemars(length(min = 1))]
    pub checksum: String,

    /// Algorithm of `checksum`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "sha256"))]
    pub checksum_type: Option<ChecksumType>,

    /// Disk format of the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "raw"))]
    pub format: Option<ImageFormat>,
}

/// Pod, service and DNS networking of the cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkSpec {
    /// Cluster DNS domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "cluster.local"))]
    pub dns_domain: Option<String>,

    /// CIDR ranges that pod IPs are allocated from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4), inner(length(max = 43)))]
    #[x_kube(validation = Rule::new("self.all(cidr, isCIDR(cidr))").message("each entry must be a valid CIDR notation"))]
    pub pod_subnets: Option<Vec<String>>,

    /// CIDR ranges that service ClusterIPs are allocated from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4), inner(length(max = 43)))]
    #[x_kube(validation = Rule::new("self.all(cidr, isCIDR(cidr))").message("each entry must be a valid CIDR notation"))]
    pub service_subnets: Option<Vec<String>>,
}

/// How the Talos machine configuration is produced.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum GenerateType {
    Controlplane,
    Worker,
    None,
}

/// Where a node's Talos machine configuration comes from.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TalosConfigSpec {
    /// `controlplane` and `worker` generate a configuration from the cluster's
    /// parameters; `none` takes the complete configuration from `data`. Left out,
    /// the controller picks by the machine's role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generate_type: Option<GenerateType>,

    /// A complete Talos machine configuration (YAML); used only with generateType `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,

    /// RFC 6902 JSON patches applied to a generated configuration; not used with generateType `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_patches: Option<Vec<ConfigPatch>>,
}

/// A JSON patch operation (RFC 6902).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PatchOp {
    Add,
    Remove,
    Replace,
    Move,
    Copy,
    Test,
}

/// One RFC 6902 JSON patch operation.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct ConfigPatch {
    /// The operation.
    pub op: PatchOp,

    /// JSON pointer to the location the operation acts on.
    #[schemars(length(min = 1))]
    pub path: String,

    /// Value for `add`, `replace` and `test`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::preserve_unknown_object")]
    pub value: Option<serde_json::Value>,
}

/// Desired state of a Cluster.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "fleet.otterscale.io",
    version = "v1alpha1",
    kind = "Cluster",
    status = "ClusterStatus",
    category = "otterscale",
    derive = "PartialEq",
    doc = "A Talos Linux Kubernetes cluster provisioned on bare metal through Metal3 BareMetalHosts.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "CP Ready",
        type_ = "boolean",
        json_path = ".status.controlPlaneReady"
    ),
    printcolumn(
        name = "Workers",
        type_ = "string",
        json_path = ".status.readyWorkers",
        priority = 1
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
pub struct ClusterSpec {
    /// API server address of the cluster, usually a virtual IP or a load balancer.
    pub control_plane_endpoint: Endpoint,

    /// Talos version the configuration is generated for, such as `v1.9`.
    #[schemars(regex(pattern = r"^v\d+\.\d+(\.\d+)?$"))]
    pub talos_version: String,

    /// Kubernetes version to run, such as `v1.32.0`.
    #[schemars(regex(pattern = r"^v\d+\.\d+\.\d+$"))]
    pub kubernetes_version: String,

    /// Talos image written to each bare-metal host.
    pub talos_image: ImageSpec,

    /// Pod, service and DNS networking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_network: Option<ClusterNetworkSpec>,

    /// Configuration source for control-plane nodes; a Machine may override it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_config: Option<TalosConfigSpec>,

    /// Configuration source for worker nodes (a generated join configuration when
    /// left out); a Machine may override it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_config: Option<TalosConfigSpec>,
}

/// Observed state of a Cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    /// The metadata.generation the controller last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Summary of where the cluster is in its life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ClusterPhase>,

    /// True when every control-plane machine is bootstrapped and running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_ready: Option<bool>,

    /// True once the first control-plane node is bootstrapped and etcd initialised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialized: Option<bool>,

    /// Secret holding the Talos secrets bundle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_ref: Option<ResourceReference>,

    /// Secret holding the talosconfig client configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub talosconfig_ref: Option<ResourceReference>,

    /// Number of ready worker machines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_workers: Option<i32>,

    /// Number of worker machines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_workers: Option<i32>,

    /// Status conditions, one per type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::conditions")]
    pub conditions: Option<Vec<Condition>>,
}

/// The role of a machine in its cluster.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum MachineRole {
    Controlplane,
    Worker,
}

/// Where a machine is in its life.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum MachinePhase {
    Pending,
    Provisioning,
    Provisioned,
    Bootstrapping,
    Running,
    Failed,
    Deleting,
}

/// Names a Metal3 `BareMetalHost`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct BareMetalHostReference {
    /// Name of the BareMetalHost.
    #[schemars(length(min = 1))]
    pub name: String,

    /// Namespace of the BareMetalHost.
    #[schemars(length(min = 1))]
    pub namespace: String,
}

/// One address of a machine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct MachineAddress {
    /// Kind of address: InternalIP, ExternalIP or Hostname.
    #[serde(rename = "type")]
    pub type_: String,

    /// The address itself.
    pub address: String,
}

/// Desired state of a Machine.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "fleet.otterscale.io",
    version = "v1alpha1",
    kind = "Machine",
    status = "MachineStatus",
    category = "otterscale",
    derive = "PartialEq",
    doc = "One bare-metal node of a Talos cluster, backed by a Metal3 BareMetalHost.",
    printcolumn(name = "Cluster", type_ = "string", json_path = ".spec.clusterRef"),
    printcolumn(name = "Role", type_ = "string", json_path = ".spec.role"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("!(self.role == 'worker' && self.bootstrap)").message("worker nodes cannot be bootstrap nodes"))]
#[serde(rename_all = "camelCase")]
pub struct MachineSpec {
    /// Name of the Cluster the machine belongs to; cannot change.
    #[schemars(length(min = 1))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("clusterRef is immutable"))]
    pub cluster_ref: String,

    /// Control-plane or worker node; cannot change.
    #[x_kube(validation = Rule::new("self == oldSelf").message("role is immutable"))]
    pub role: MachineRole,

    /// The BareMetalHost behind the machine; cannot change.
    #[x_kube(validation = Rule::new("self == oldSelf").message("bareMetalHostRef is immutable"))]
    pub bare_metal_host_ref: BareMetalHostReference,

    /// Overrides the cluster's configuration source for this machine. Left out,
    /// control-plane machines use the cluster's controlPlaneConfig and workers its workerConfig.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub talos_config: Option<TalosConfigSpec>,

    /// Marks the one control-plane machine per cluster that initialises etcd;
    /// never set on workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap: Option<bool>,
}

/// Observed state of a Machine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineStatus {
    /// The metadata.generation the controller last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Summary of where the machine is in its life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<MachinePhase>,

    /// True when the machine is bootstrapped and its node is healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<bool>,

    /// True when the BareMetalHost has finished provisioning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infrastructure_ready: Option<bool>,

    /// True when the Talos bootstrap has completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_ready: Option<bool>,

    /// Secret holding the machine's Talos configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_data_secret_ref: Option<ResourceReference>,

    /// Addresses found by the BareMetalHost's hardware inspection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addresses: Option<Vec<MachineAddress>>,

    /// Status conditions, one per type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::conditions")]
    pub conditions: Option<Vec<Condition>>,
}
