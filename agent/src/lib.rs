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
//! - [`backoff`] — the reconnect schedule, sans IO.
//! - [`kube_proxy`] — kubectl's requests, forwarded by the hub, sent to the
//!   local apiserver as the caller (impersonation).
//! - [`health`] — `/healthz` and `/readyz` for the kubelet.

pub mod backoff;
pub mod cli;
pub mod config;
pub mod enroll;
pub mod health;
pub mod kube_proxy;
pub mod tunnel;

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
}

/// Result alias for the agent.
pub type Result<T, E = AgentError> = std::result::Result<T, E>;
