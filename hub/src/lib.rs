//! The OtterScale Link hub: agents in member clusters register here and dial
//! in; users, dashboards and the `otter` CLI call here, and the hub forwards
//! each Resource/Runtime call to the right cluster over that cluster's tunnel.
//!
//! # Layout
//! - [`config`] — typed settings of `otter hub`.
//! - [`audit`] — one JSON line per call, request and admin action.
//! - [`store`] — what survives a restart (sled by default, behind a trait).
//! - [`authority`] — the CA kept in the store; the hub's server certificate.
//! - [`tenancy`] — tenants, the cluster names they hold, roles.
//! - [`tokens`] — join tokens (agents) and API tokens (users), stored hashed.
//! - [`registry`] — live tunnels by cluster: the routing table.
//! - [`quota`] — places counted per tenant, user or cluster.
//! - [`tunnels`] — accepts tunnel connections, checks certificates, keeps the
//!   registry and the stored links in step.
//! - [`link_service`] — `otterscale.link.v1.LinkService`.
//! - [`forward`] — the front door for Resource/Runtime calls: authenticate,
//!   route by cluster, one tunnel stream per call.
//! - [`kube_proxy`] — kubectl through the hub: `/clusters/<name>/…`.
//! - [`chart`] — ShowChart: a Helm chart's values and README, fetched by
//!   the hub under an address policy.
//! - [`server`] — listeners and the request dispatch; [`Hub::start`].
//! - [`ops`] — probes, Prometheus text and gRPC health for kubelets and
//!   scrapers.
//! - [`cli`] — the `otter` command line (`main.rs` only calls it).

pub mod admin;
pub mod audit;
pub mod auth;
pub mod authority;
pub mod background;
pub mod chart;
pub mod cli;
pub mod config;
pub mod cors;
pub mod credentials;
pub mod deadline;
pub mod etcd;
pub mod fleet;
pub mod forward;
pub mod kube_proxy;
pub mod limits;
pub mod link_service;
pub mod links;
pub mod manifest;
pub mod methods;
pub mod metrics;
pub mod oidc;
pub mod ops;
pub mod peers;
pub mod protocol;
pub mod quota;
pub mod rancher;
pub mod registry;
pub mod resume;
pub mod sealed;
pub mod server;
pub mod store;
pub mod tenancy;
pub mod tickets;
pub mod tokens;
pub mod tunnels;
pub mod uploads;

pub use config::HubConfig;
pub use server::Hub;

/// Version of this build, reported to agents and in ListLinks.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Errors of the hub library. Handlers map them to gRPC codes in one place
/// ([`HubError::into_status`]).
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// The store failed or holds something unreadable.
    #[error("store: {0}")]
    Store(#[from] store::StoreError),
    /// The shared store cannot take a write now (no etcd quorum, no
    /// member reachable): worth retrying, unlike [`HubError::Store`].
    #[error("store unavailable: {0}")]
    StoreUnavailable(String),
    /// Too many callers wait on the store for the same kind of answer (a
    /// flood of unknown tokens): refused at once, without a log line each.
    #[error("busy: {0}")]
    Busy(String),
    /// Another store user (a hub still running, or one of this process
    /// still letting go) holds the data directory's lock.
    #[error("store: the data directory {0} is in use by another hub (its lock is held)")]
    Locked(std::path::PathBuf),
    /// Certificates and keys.
    #[error(transparent)]
    Pki(#[from] otter_pki::PkiError),
    /// Tunnel transport failure.
    #[error(transparent)]
    Tunnel(#[from] otter_tunnel::TunnelError),
    /// A value the caller gave is not acceptable (a name, a duration, a
    /// flag): said as it is, and to a gRPC caller as `InvalidArgument`.
    #[error("{0}")]
    Invalid(String),
    /// A file a setting names cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    ReadFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A setting is wrong; said before anything is bound.
    #[error("configuration: {0}")]
    Config(String),
    /// Binding or serving a listener failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl HubError {
    /// The gRPC status a caller sees. Internal details stay in the log.
    pub fn into_status(self) -> tonic::Status {
        match self {
            HubError::Pki(e) => tonic::Status::invalid_argument(e.to_string()),
            HubError::Invalid(e) => tonic::Status::invalid_argument(e),
            // A file of the hub's own setup (the API CA a manifest names)
            // went missing after start: the caller can do nothing but
            // tell the operator, and the file's name says what to fix.
            HubError::ReadFile { path, source } => {
                tracing::error!(path = %path.display(), error = %source, "a file the hub needs cannot be read");
                tonic::Status::failed_precondition(format!(
                    "the hub cannot read {}: ask its operator",
                    path.display()
                ))
            }
            HubError::StoreUnavailable(e) => {
                tracing::warn!(error = %e, "store unavailable");
                tonic::Status::unavailable(
                    "the hub's store cannot take writes right now (its etcd has no quorum or \
                     cannot be reached); calls to connected clusters still work: retry this later",
                )
            }
            HubError::Busy(e) => tonic::Status::unavailable(e),
            other => {
                tracing::error!(error = %other, "internal error");
                tonic::Status::internal("internal error in the hub; see its log")
            }
        }
    }
}

/// Result alias for the hub.
pub type Result<T, E = HubError> = std::result::Result<T, E>;

/// A span of seconds the way kubectl shows ages: "45s", "3m", "5h", "4d"
/// (the unit changes at twice its size, so "90s" rather than "1m").
pub fn short_duration(secs: i64) -> String {
    let secs = secs.max(0);
    match secs {
        0..=119 => format!("{secs}s"),
        120..=7199 => format!("{}m", secs / 60),
        7200..=172_799 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86400),
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}
