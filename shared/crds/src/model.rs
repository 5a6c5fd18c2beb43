//! `model.otterscale.io/v1alpha1`: machine-learning models as OCI artifacts.
//!
//! A [`ModelArtifact`] imports a model (from Hugging Face), packages it as an OCI
//! artifact and pushes it to a registry; a [`ModelService`] serves such an artifact
//! with vLLM, optionally split into llm-d prefill and decode pods behind the Gateway
//! API Inference Extension.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{EnvVar, LocalObjectReference, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use crate::common::ResourceReference;

/// OCI packaging format of a model artifact.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum PackFormat {
    /// A CNCF ModelPack artifact.
    ModelPack,
    /// A KitOps ModelKit artifact.
    ModelKit,
}

/// Desired state of a ModelArtifact: model source, target registry, packaging
/// format and scratch storage for the pipeline.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "model.otterscale.io",
    version = "v1alpha1",
    kind = "ModelArtifact",
    namespaced,
    status = "ModelArtifactStatus",
    category = "otterscale",
    derive = "PartialEq",
    doc = "Imports a model from a source such as Hugging Face, packages it as an OCI artifact (ModelPack or ModelKit) and pushes it to a registry; a Job runs the pipeline and the resulting digest is reported in the status.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Registry",
        type_ = "string",
        json_path = ".spec.target.registry"
    ),
    printcolumn(
        name = "Repository",
        type_ = "string",
        json_path = ".spec.target.repository"
    ),
    printcolumn(
        name = "Digest",
        type_ = "string",
        json_path = ".status.digest",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ModelArtifactSpec {
    /// Where the model is fetched from.
    pub source: ModelSource,

    /// Registry and repository the packaged artifact is pushed to.
    pub target: OciTarget,

    /// OCI packaging format.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "ModelPack"))]
    pub format: Option<PackFormat>,

    /// Scratch volume for the pipeline, deleted when the Job completes.
    pub storage: StorageSpec,
}

/// Origin of a model; exactly one source is set.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[x_kube(validation = Rule::new("[has(self.huggingFace)].filter(x, x).size() == 1").message("exactly one source must be specified"))]
#[serde(rename_all = "camelCase")]
pub struct ModelSource {
    /// A repository on the Hugging Face Hub.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<HuggingFaceSource>,
}

/// A model on the Hugging Face Hub. The values reach shell scripts, hence the
/// narrow character sets.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HuggingFaceSource {
    /// Model identifier such as `facebook/opt-125m`.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-zA-Z0-9][a-zA-Z0-9._/-]*$")
    )]
    pub model: String,

    /// Branch, tag or commit to fetch; the default branch when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[a-zA-Z0-9._/-]*$"))]
    pub revision: Option<String>,

    /// Secret key holding an access token, for private or gated repositories.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<SecretKeySelector>,
}

/// Registry destination of a packaged model. The values reach shell scripts,
/// hence the narrow character sets.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OciTarget {
    /// Registry host, optionally with a port; no path.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-zA-Z0-9][a-zA-Z0-9._:-]*$")
    )]
    pub registry: String,

    /// Repository path inside the registry, without the host.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-zA-Z0-9][a-zA-Z0-9._/-]*$")
    )]
    pub repository: String,

    /// Tag to push; `latest` when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 128),
        regex(pattern = r"^[a-zA-Z0-9][a-zA-Z0-9._-]*$")
    )]
    pub tag: Option<String>,

    /// A `kubernetes.io/dockerconfigjson` Secret with registry credentials, mounted
    /// into the pipeline's Pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<SecretReference>,

    /// Talk to the registry without TLS (development and air-gapped setups only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub insecure: Option<bool>,
}

/// Scratch volume of the pipeline.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StorageSpec {
    /// Requested capacity; about twice the model size holds download and artifact.
    #[schemars(schema_with = "crate::schema::quantity")]
    pub size: Quantity,

    /// StorageClass of the volume; the cluster default when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
}

/// A Secret in the same namespace, by name.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct SecretReference {
    /// Name of the Secret.
    #[schemars(length(min = 1))]
    pub name: String,
}

/// One key of a Secret in the same namespace.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct SecretKeySelector {
    /// Name of the Secret.
    #[schemars(length(min = 1))]
    pub name: String,

    /// Key inside the Secret; `token` when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

/// Observed state of a ModelArtifact.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelArtifactStatus {
    /// The metadata.generation the controller last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Summary of where the pipeline is: `Pending`, `Running`, `Succeeded` or
    /// `Failed`. Not an enum in the schema (upstream leaves it open), so a newer
    /// controller's phase still reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,

    /// Manifest digest of the pushed artifact, once the phase is Succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,

    /// Full OCI reference of the pushed artifact, tag included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,

    /// The Job most recently created for the artifact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_ref: Option<ResourceReference>,

    /// When that Job was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,

    /// When that Job finished, successfully or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,

    /// Status conditions, one per type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::conditions")]
    pub conditions: Option<Vec<Condition>>,
}

/// Accelerator hardware of the serving pods.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum AcceleratorType {
    Nvidia,
    Amd,
    IntelGaudi,
    Google,
    Cpu,
}

/// What the gateway does while the endpoint picker is unavailable.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum EppFailureMode {
    FailOpen,
    FailClose,
}

/// Desired state of a ModelService: the model, the vLLM engine, the accelerator,
/// the decode (and optional prefill) pods and the Gateway API wiring.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "model.otterscale.io",
    version = "v1alpha1",
    kind = "ModelService",
    namespaced,
    status = "ModelServiceStatus",
    category = "otterscale",
    derive = "PartialEq",
    doc = "Serves an OCI-packaged model with vLLM, optionally with llm-d prefill/decode disaggregation and Gateway API integration; the model is mounted as a Kubernetes image volume.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Model", type_ = "string", json_path = ".spec.model.name"),
    printcolumn(
        name = "Decode",
        type_ = "string",
        json_path = ".status.decodeReady",
        priority = 1
    ),
    printcolumn(
        name = "Prefill",
        type_ = "string",
        json_path = ".status.prefillReady",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ModelServiceSpec {
    /// The model artifact and the name it is served under.
    pub model: ModelSpec,

    /// The inference engine.
    pub engine: EngineSpec,

    /// Accelerator hardware of the serving pods.
    pub accelerator: AcceleratorSpec,

    /// Decode pods; without prefill pods these serve everything.
    pub decode: RoleSpec,

    /// Separate prefill pods for disaggregated serving.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<RoleSpec>,

    /// The llm-d routing sidecar; needed when prefill pods are set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_proxy: Option<RoutingProxySpec>,

    /// A Gateway API Inference Extension InferencePool selecting the serving pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool: Option<InferencePoolSpec>,

    /// An HTTPRoute to the InferencePool; needs inferencePool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "httpRoute")]
    pub http_route: Option<HttpRouteSpec>,

    /// Observability.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monitoring: Option<MonitoringSpec>,
}

/// The model artifact to serve, mounted read-only as an image volume.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// Name clients use in OpenAI-compatible requests (vLLM's --served-model-name).
    #[schemars(length(min = 1, max = 253))]
    pub name: String,

    /// OCI reference of the model artifact, used as an image volume source.
    #[schemars(length(min = 1))]
    pub image: String,

    /// Where the model is mounted in the serving containers (vLLM's --model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "/models"))]
    pub mount_path: Option<String>,

    /// Pull secrets for a model artifact in a private registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
}

/// The vLLM engine container.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineSpec {
    /// vLLM container image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,

    /// Pull policy of the engine image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,

    /// Extra vLLM arguments, appended after the ones derived from the spec
    /// (model, port, served name, parallelism).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Vec<String>>,

    /// Extra environment variables of the engine container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<EnvVar>>,

    /// Port the engine serves on; with a routing proxy this is the proxy's port and
    /// vLLM moves to routingProxy.targetPort.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535), extend("default" = 8000))]
    pub port: Option<i32>,
}

/// Accelerator hardware of the serving pods.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct AcceleratorSpec {
    /// Accelerator kind; it decides the device resource name and vendor settings.
    #[serde(rename = "type")]
    pub type_: AcceleratorType,
}

/// vLLM tensor and data parallelism.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ParallelismSpec {
    /// Tensor-parallel size: accelerators one model copy is sharded over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1), extend("default" = 1))]
    pub tensor: Option<i32>,

    /// Data-parallel size: model copies inside one pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1), extend("default" = 1))]
    pub data: Option<i32>,

    /// Local data-parallel size for disaggregated serving.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1), extend("default" = 1))]
    pub data_local: Option<i32>,
}

/// A group of serving pods (decode or prefill).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoleSpec {
    /// Number of pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0), extend("default" = 1))]
    pub replicas: Option<i32>,

    /// Parallelism of vLLM in these pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallelism: Option<ParallelismSpec>,

    /// CPU and memory of the vLLM container; accelerator resources are derived from
    /// the accelerator type and parallelism and are not set here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// Node labels the pods must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,

    /// Tolerations of the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
}

/// The llm-d routing sidecar, run as a restartable init container that routes
/// requests between prefill and decode pods.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoutingProxySpec {
    /// Sidecar container image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,

    /// KV-cache transfer protocol.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "nixlv2"))]
    pub connector: Option<String>,

    /// Port vLLM listens on behind the proxy (the proxy takes engine.port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535), extend("default" = 8200))]
    pub target_port: Option<i32>,

    /// Log encoding of the sidecar, such as `json` or `console`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zap_encoder: Option<String>,

    /// Log level of the sidecar, such as `debug`, `info` or `error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zap_log_level: Option<String>,

    /// Serve TLS on the proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_proxy: Option<bool>,

    /// Use TLS towards prefill pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "prefillerUseTLS")]
    pub prefiller_use_tls: Option<bool>,

    /// Directory of the proxy's TLS certificates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_path: Option<String>,
}

/// The InferencePool and the endpoint picker (EPP) the operator runs for it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// The endpoint picker deployment.
    pub endpoint_picker: EndpointPickerSpec,
}

/// The endpoint picker (EPP) deployment; its Service is named after the ModelService.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerSpec {
    /// EPP container image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,

    /// Number of EPP pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0), extend("default" = 1))]
    pub replicas: Option<i32>,

    /// CPU and memory of the EPP container (no CPU limit by default, to allow bursts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// gRPC (ext-proc) port of the EPP Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535), extend("default" = 9002))]
    pub port: Option<i32>,

    /// What the gateway does while the EPP is unavailable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "FailOpen"))]
    pub failure_mode: Option<EppFailureMode>,
}

/// An HTTPRoute from a Gateway to the InferencePool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteSpec {
    /// The Gateway the route attaches to.
    pub gateway_ref: GatewayRef,

    /// Host names the route matches; all when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostnames: Option<Vec<String>>,
}

/// A Gateway API Gateway.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct GatewayRef {
    /// Name of the Gateway.
    #[schemars(length(min = 1))]
    pub name: String,

    /// Namespace of the Gateway; the ModelService's namespace when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// Observability of a model service.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MonitoringSpec {
    /// A Prometheus PodMonitor for the serving pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_monitor: Option<PodMonitorSpec>,
}

/// A Prometheus PodMonitor.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodMonitorSpec {
    /// Create the PodMonitor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = false))]
    pub enabled: Option<bool>,

    /// Named port of the vLLM container that serves metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "http"))]
    pub port_name: Option<String>,

    /// HTTP path of the metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "/metrics"))]
    pub path: Option<String>,

    /// Time between scrapes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "30s"))]
    pub interval: Option<String>,
}

/// Observed state of a ModelService.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelServiceStatus {
    /// The metadata.generation the controller last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Summary of where the service is: `Pending`, `Running`, `Ready` or `Failed`.
    /// Not an enum in the schema (upstream leaves it open), so a newer
    /// controller's phase still reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,

    /// Ready decode pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_ready: Option<i32>,

    /// Desired decode pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_replicas: Option<i32>,

    /// Ready prefill pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_ready: Option<i32>,

    /// Desired prefill pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_replicas: Option<i32>,

    /// Status conditions, one per type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::conditions")]
    pub conditions: Option<Vec<Condition>>,
}
