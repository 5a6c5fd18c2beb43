//! The OtterScale Link agent. It runs in a member cluster, registers with
//! the hub (join token → CSR → certificate), dials out over QUIC or TLS +
//! HTTP/2, and serves every stream the hub opens with its gRPC services.
//!
//! # Layout
//! - [`config`] — typed settings of `otter-agent`.
//! - [`enroll`] — Register: first contact with a join token, renewal with
//!   the current certificate.
//! - [`tunnel`] — the dial loop: transport order, fallback, backoff with
//!   full jitter, serving streams, renewal before expiry.
//! - [`dispatch`] — the one service a tunnel's streams are served with:
//!   by target, the gRPC API, the Kubernetes API proxy, or the agent's own
//!   answers (diagnosis, renew now, the hub's goodbye).
//! - [`backoff`] — the reconnect schedule, sans IO.
//! - [`ended`] — who ended a tunnel (the hub, a proxy, the network) and
//!   why, sans IO.
//! - [`impersonation`] — who the agent acts as: the caller's
//!   `Impersonate-*` headers, within the ceiling the manifest set.
//! - [`kube_proxy`] — kubectl's requests, forwarded by the hub, sent to the
//!   local apiserver as the caller (impersonation).
//! - [`health`] — `/healthz` and `/readyz` for the kubelet, `/metrics`.
//! - [`gauges`] — live counts of tunnel streams and sessions.
//! - [`services`] — the gRPC services the agent serves, wired together:
//!   - [`kube`] — the agent's Kubernetes client and the impersonating
//!     clients per caller;
//!   - [`resource`] — ResourceService; [`discovery`] — cached discovery
//!     and OpenAPI schemas;
//!   - [`runtime`] — RuntimeService; [`sessions`] — the exec and
//!     port-forward session table, sans IO;
//!   - [`status`] — Kubernetes errors as gRPC statuses, in one place;
//!   - [`convert`] — JSON and `Struct`, manifests.

pub mod backoff;
pub mod cli;
pub mod config;
pub mod convert;
pub mod discovery;
pub mod dispatch;
pub mod doctor;
pub mod ended;
pub mod enroll;
pub mod gauges;
pub mod health;
pub mod identity;
pub mod impersonation;
pub mod kube;
pub mod kube_proxy;
pub mod ordered;
pub mod resource;
pub mod runtime;
pub mod sessions;
pub mod status;
pub mod tunnel;

/// Settings of the Kubernetes services.
#[derive(Debug, Clone, Default)]
pub struct ServicesConfig {
    pub resource: resource::ResourceConfig,
    pub runtime: runtime::RuntimeConfig,
}

/// ResourceService and RuntimeService for the agent of `cluster`, acting
/// through `kube`. Call inside a tokio runtime (the session reaper starts).
pub fn services(
    kube: kube::KubeAccess,
    cluster: &str,
    config: ServicesConfig,
) -> tonic::service::Routes {
    use otter_proto::{
        resource::v1::resource_service_server::ResourceServiceServer,
        runtime::v1::runtime_service_server::RuntimeServiceServer,
    };
    let resources = resource::Resources::new(kube.clone(), config.resource);
    let runtime = runtime::Runtime::new(kube, resources.catalog(), cluster, config.runtime);
    // Requests: manifests up to 3 MiB, input chunks up to 4 MiB, plus room
    // for the other fields.
    let max = convert::MAX_MANIFEST.max(runtime::MAX_INPUT) + 64 * 1024;
    tonic::service::Routes::new(
        ResourceServiceServer::new(resources).max_decoding_message_size(max),
    )
    .add_service(RuntimeServiceServer::new(runtime).max_decoding_message_size(max))
}

pub use config::AgentConfig;
pub use tunnel::{Agent, AgentStatus};

/// Version of this build, sent with Register.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Errors of the agent library.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A setting is wrong.
    #[error("configuration: {0}")]
    Config(String),
    /// The hub refused or failed Register.
    #[error("register: {0}")]
    Register(#[from] tonic::Status),
    /// Could not reach the hub's API.
    #[error("cannot reach the hub: {0}")]
    Connect(String),
    #[error(transparent)]
    Pki(#[from] otter_pki::PkiError),
    #[error(transparent)]
    Tunnel(#[from] otter_tunnel::TunnelError),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The kubeconfig file could not be read or used.
    #[error("kubeconfig {}: {source}", path.display())]
    Kubeconfig {
        path: std::path::PathBuf,
        #[source]
        source: ::kube::config::KubeconfigError,
    },
    /// Neither a kubeconfig nor the in-cluster ServiceAccount was found.
    #[error("no Kubernetes configuration found: {0}")]
    NoKubeConfig(#[from] ::kube::config::InferConfigError),
    /// The Kubernetes client could not be built from the configuration.
    #[error("cannot build the Kubernetes client: {0}")]
    KubeClient(#[source] ::kube::Error),
    /// The kept identity (a Secret) could not be read or written.
    #[error("identity store: {0}")]
    Identity(String),
}

impl AgentError {
    /// The hub's retry-after hint, when the hub turned this attempt away
    /// because it is busy (paced tunnel admission or registration).
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            Self::Tunnel(t) => t.retry_after(),
            Self::Register(s) => s
                .metadata()
                .get(otter_tunnel::pace::GRPC_RETRY_AFTER_MS)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .map(std::time::Duration::from_millis),
            _ => None,
        }
    }

    /// Whether the hub answered and refused (an identity it does not take),
    /// as opposed to not being reached, failing, or being busy.
    pub fn refused_by_hub(&self) -> bool {
        matches!(self, Self::Register(s)
            if matches!(s.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied))
    }
}

/// Result alias for the agent.
pub type Result<T, E = AgentError> = std::result::Result<T, E>;
