//! Settings of `otter hub`.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use otter_tunnel::{Keepalive, TransportKind};
use url::Url;

use crate::{HubError, Result};

/// Everything the hub needs to start. Built from flags by [`crate::cli`], or
/// directly by tests.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// Where the store lives.
    pub data_dir: PathBuf,
    /// Key (32 bytes in a file) that seals the store's secrets at rest.
    pub store_key_file: Option<PathBuf>,
    /// The store several replicas share; none: sled in `data_dir`.
    pub store: Option<crate::etcd::EtcdOptions>,
    /// This replica's name among those sharing the store.
    pub replica: String,
    /// Where other replicas reach this one (mutual TLS, replica
    /// certificates only); none: a hub of one replica.
    pub peer_listen: Option<SocketAddr>,
    /// The URL other replicas dial for `peer_listen` (default: from it).
    pub peer_url: Option<Url>,
    /// API listener (gRPC, Connect, gRPC-Web, manifest URLs), TLS.
    pub api_listen: SocketAddr,
    /// The API listener's certificate from files (one users' tools trust:
    /// a public CA's, cert-manager's), read again when they change; none:
    /// one from the hub CA. The tunnel and peer ports keep the hub CA's.
    pub api_tls: Option<ApiTls>,
    /// Tunnel listener: TCP (TLS + HTTP/2) and UDP (QUIC) on the same port.
    pub tunnel_listen: SocketAddr,
    /// How users and agents reach the API listener (names go into the server
    /// certificate). Defaults to `https://localhost:<api port>`.
    pub external_url: Option<Url>,
    /// How agents reach the tunnel listener, in the order they should try.
    /// Defaults to QUIC then HTTP/2 on `localhost:<tunnel port>`.
    pub tunnel_urls: Vec<Url>,
    /// Lifetime of agent certificates.
    pub agent_cert_lifetime: Duration,
    /// Lifetime of join tokens.
    pub join_token_ttl: Duration,
    /// Tunnel keepalive (both ways).
    pub keepalive: Keepalive,
    /// Callers on the API port: a connection that has sent nothing for
    /// `interval` is probed (an HTTP/2 ping; TCP keepalive for HTTP/1.1)
    /// and closed when no answer comes within `timeout`, so a caller whose
    /// path died does not hold its calls, their tunnel slots and the
    /// agents' watches for ever.
    pub api_keepalive: Keepalive,
    /// Concurrent calls per tunnel; more are refused with ResourceExhausted.
    pub max_calls_per_tunnel: u32,
    /// Concurrent calls per tenant across its clusters (on this replica);
    /// more are refused with ResourceExhausted. What a tenant's callers can
    /// make the hub hold is this many answers' send buffers.
    pub max_calls_per_tenant: u32,
    /// How long a tunnel of a replaced agent may finish its calls before it
    /// is closed.
    pub drain_timeout: Duration,
    /// The same, for an agent's older tunnel when it connects again (say,
    /// over a better transport): long enough for watches and exec sessions
    /// in flight to end on their own; a dead one ends sooner by keepalive.
    pub reconnect_drain_timeout: Duration,
    /// How long a Watch or followed log whose tunnel dropped waits for the
    /// cluster's next tunnel (it is then opened again from the last event
    /// or line passed on); zero: it ends `Unavailable` with its tunnel.
    pub watch_resume_grace: Duration,
    /// An agent's report on its tunnel (ListLinks' diagnosis: clock skew,
    /// renewals) older than this is fetched again when a link listing
    /// reads it; the listing shows the one kept meanwhile.
    pub diagnosis_max_age: Duration,
    /// Tunnels set up at once (handshakes through admission); agents beyond
    /// it are told to come back after `admission_retry_after`.
    pub max_concurrent_admissions: usize,
    /// Handshakes on the tunnel port before a client certificate is
    /// verified: how many at once, each source's share, when the oldest
    /// may be dropped for a newcomer.
    pub tunnel_handshakes: otter_tunnel::handshakes::HandshakeLimits,
    /// Connections of the API port before their first request head: how
    /// many at once and each source's share. When all places are taken,
    /// one waiting for its peer makes room for a newcomer once it is a
    /// second old, or at once if its source holds more than half its
    /// share: a user's TLS handshake and request head take milliseconds,
    /// so under a flood of stalled connections from a few sources it still
    /// gets through, where waiting for a place would leave it in the
    /// kernel's backlog behind the flood. (Dropping the oldest at any age,
    /// as before, made 10,000 agents enrolling at once drop each other's
    /// handshakes 17,000 times.)
    pub api_handshakes: otter_tunnel::handshakes::HandshakeLimits,
    /// Connections of the API port, in total and per source address.
    pub api_connections: crate::limits::ApiConnectionLimits,
    /// The hint refused agents get: they wait at least this long, plus jitter.
    pub admission_retry_after: Duration,
    /// Register calls served at once (each signs a certificate); more are
    /// answered Unavailable with the same hint.
    pub max_concurrent_registrations: usize,
    /// Largest gRPC request message accepted at the front door.
    pub max_request_message: usize,
    /// Browser origins allowed by CORS (exact match; `*` allows any).
    pub cors_origins: Vec<String>,
    /// Features (`otterscale.api.feature` names) switched off.
    pub disabled_features: Vec<String>,
    /// Serve the API without TLS (HTTP/1.1 and h2c), for local development.
    pub api_plaintext: bool,
    /// Where ShowChart may fetch charts from, and the CA it trusts.
    pub charts: crate::chart::ChartPolicy,
    /// Plaintext port for Prometheus scrapes (`/metrics`, no token).
    pub metrics_listen: Option<SocketAddr>,
    /// Plaintext port for probes (`/healthz`, `/livez`, `/readyz`, gRPC
    /// health over h2c).
    pub health_listen: Option<SocketAddr>,
    /// Callers in this group may administer the hub (mint manifests, tokens).
    pub admin_group: String,
    /// OpenID Connect issuer for user tokens, if any.
    pub oidc: Option<crate::oidc::OidcConfig>,
    /// Where audit lines go; none: no audit log.
    pub audit_log: Option<crate::audit::Target>,
    /// How long a manifest URL serves its YAML.
    pub manifest_ttl: Duration,
    /// How often the tokens of live streams are checked against the store
    /// (a revocation made on another replica ends them within this).
    pub recheck_tokens_every: Duration,
    /// Namespace the agent manifest installs into.
    pub agent_namespace: String,
    /// Agent image the manifest runs.
    pub agent_image: String,
    /// Path prefix of the Kubernetes API proxy (`<prefix>/<cluster>/…`).
    pub kube_proxy_prefix: String,
    /// Bounds of the proxy's upgraded connections (exec, attach,
    /// port-forward).
    pub kube_upgrades: KubeUpgradeLimits,
    /// Kubeconfig of the Rancher management cluster whose projects
    /// ListRancherProjects lists, if any.
    pub rancher_kubeconfig: Option<PathBuf>,
}

/// How many upgraded connections (kubectl exec, attach, port-forward) the
/// Kubernetes API proxy relays at once, and how long one may stay silent.
#[derive(Debug, Clone, Copy)]
pub struct KubeUpgradeLimits {
    /// Per caller (user name), across clusters.
    pub per_user: usize,
    /// Per cluster, across callers.
    pub per_cluster: usize,
    /// A connection with no bytes either way for this long is closed.
    pub idle_timeout: Duration,
}

impl Default for KubeUpgradeLimits {
    fn default() -> Self {
        Self {
            per_user: 64,
            per_cluster: 256,
            idle_timeout: Duration::from_secs(30 * 60),
        }
    }
}

/// The host's name when it is a DNS label (a pod's name is), else `hub`.
fn default_replica_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .map(|h| h.to_lowercase())
        .filter(|h| otter_pki::identity::validate_replica_name(h).is_ok())
        .unwrap_or_else(|| "hub".to_owned())
}

/// Tunnels set up at once by default. Each set-up is mostly waiting (a
/// store write, the agent's answer), so on two cores 1,024 at once brought
/// 10,000 agents back after a graceful restart in 14.6 s where 128 took
/// 23.4 s, with half the hub's CPU (6.4 s against 13.7: fewer refused
/// handshakes to redo). Handshakes before admission are bounded apart
/// (`HandshakeLimits`), so this adds no unauthenticated work.
pub const DEFAULT_MAX_ADMISSIONS: usize = 1024;

/// Register calls served at once by default: signing is quick, the store
/// write is the wait. 10,000 new agents connected in 27.7–32.6 s with 256
/// where 32 took 35.8–37.9 s.
pub const DEFAULT_MAX_REGISTRATIONS: usize = 256;

/// How long an API connection may be silent before the hub asks whether
/// its caller is still there, and how long it then waits for the answer.
/// A laptop closed on a dashboard's Watch is noticed within a minute; a
/// ping every half minute of silence costs a connection 17 bytes each way.
pub const DEFAULT_API_KEEPALIVE_SECS: u64 = 30;

/// Calls one tenant may have in flight across its clusters: eight tunnels'
/// worth, and at most 256 MiB of answers' send buffers held for callers
/// that stop reading.
pub const DEFAULT_MAX_CALLS_PER_TENANT: u32 = 4096;

impl HubConfig {
    /// Defaults for a hub with its data in `data_dir`, listening on loopback.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            store_key_file: None,
            store: None,
            replica: default_replica_name(),
            peer_listen: None,
            peer_url: None,
            api_listen: "127.0.0.1:8443".parse().expect("static address"),
            api_tls: None,
            tunnel_listen: "127.0.0.1:8444".parse().expect("static address"),
            external_url: None,
            tunnel_urls: Vec::new(),
            agent_cert_lifetime: Duration::from_secs(24 * 3600),
            join_token_ttl: Duration::from_secs(3600),
            keepalive: Keepalive::default(),
            api_keepalive: Keepalive {
                interval: Duration::from_secs(DEFAULT_API_KEEPALIVE_SECS),
                timeout: Duration::from_secs(DEFAULT_API_KEEPALIVE_SECS),
            },
            max_calls_per_tunnel: 512,
            max_calls_per_tenant: DEFAULT_MAX_CALLS_PER_TENANT,
            drain_timeout: Duration::from_secs(30),
            max_concurrent_admissions: DEFAULT_MAX_ADMISSIONS,
            admission_retry_after: Duration::from_secs(1),
            tunnel_handshakes: Default::default(),
            // A connection still without its first request is dropped
            // for a newcomer once 3 s old (when every place is taken and
            // it waits on its peer). At 1 s, 10,000 agents enrolling at
            // once on two busy cores dropped each other 27,504 times, every
            // drop a handshake thrown away and a Register tried again
            // (first connect 57.3 s); at 3 s, 568 times (36.8 s). A flood
            // from few sources is dropped at once by its share whatever
            // the age.
            api_handshakes: otter_tunnel::handshakes::HandshakeLimits {
                evict_after: Duration::from_secs(3),
                ..Default::default()
            },
            api_connections: Default::default(),
            max_concurrent_registrations: DEFAULT_MAX_REGISTRATIONS,
            reconnect_drain_timeout: Duration::from_secs(15 * 60),
            watch_resume_grace: Duration::from_secs(60),
            diagnosis_max_age: Duration::from_secs(30),
            max_request_message: 16 * 1024 * 1024,
            cors_origins: Vec::new(),
            disabled_features: Vec::new(),
            api_plaintext: false,
            charts: Default::default(),
            metrics_listen: None,
            health_listen: None,
            admin_group: crate::tokens::ADMIN_GROUP.to_owned(),
            oidc: None,
            audit_log: None,
            manifest_ttl: Duration::from_secs(3600),
            recheck_tokens_every: Duration::from_secs(5),
            agent_namespace: crate::manifest::DEFAULT_NAMESPACE.to_owned(),
            agent_image: format!("{}:v{}", crate::manifest::DEFAULT_IMAGE, crate::VERSION),
            kube_proxy_prefix: "/clusters".to_owned(),
            kube_upgrades: KubeUpgradeLimits::default(),
            rancher_kubeconfig: None,
        }
    }

    /// Checks the settings before anything is bound.
    pub fn validate(&self) -> Result<()> {
        // In a shared store the CA keys are read by whoever reads etcd:
        // sealed, always.
        otter_pki::identity::validate_replica_name(&self.replica)
            .map_err(|e| HubError::Config(format!("--replica-name: {e}")))?;
        if self.peer_listen.is_some() && self.store.is_none() {
            return Err(HubError::Config(
                "--peer-listen is for replicas sharing a store: give --store etcd://… too".into(),
            ));
        }
        if self.store.is_some() && self.store_key_file.is_none() {
            return Err(HubError::Config(
                "a store on etcd needs --store-key-file: the CA keys and signing secrets are sealed in it"
                    .into(),
            ));
        }
        if self.agent_cert_lifetime < Duration::from_secs(60) {
            return Err(HubError::Config(
                "agent certificate lifetime must be at least 1 minute".into(),
            ));
        }
        if self.max_concurrent_admissions == 0 || self.max_concurrent_registrations == 0 {
            return Err(HubError::Config(
                "max concurrent admissions and registrations must be at least 1".into(),
            ));
        }
        if self.kube_upgrades.per_user == 0 || self.kube_upgrades.per_cluster == 0 {
            return Err(HubError::Config(
                "upgraded connection limits must be at least 1".into(),
            ));
        }
        if self.api_keepalive.interval.is_zero() || self.api_keepalive.timeout.is_zero() {
            return Err(HubError::Config(
                "the API keepalive interval and timeout must be positive".into(),
            ));
        }
        if self.max_calls_per_tunnel == 0 || self.max_calls_per_tenant == 0 {
            return Err(HubError::Config(
                "max calls per tunnel and per tenant must be at least 1".into(),
            ));
        }
        for url in &self.tunnel_urls {
            tunnel_transport(url)?;
        }
        // The CA that manifests tell agents to trust for the API: read at
        // each manifest (the operator may replace it), checked here so a
        // wrong path is said at start, not at the first manifest.
        if let Some(path) = self.api_tls.as_ref().and_then(|t| t.ca_file.as_ref()) {
            let pem = std::fs::read_to_string(path).map_err(|source| HubError::ReadFile {
                path: path.clone(),
                source,
            })?;
            if !pem.contains("-----BEGIN CERTIFICATE-----") {
                return Err(HubError::Config(format!(
                    "--tls-ca-file {}: no PEM certificate in it",
                    path.display()
                )));
            }
        }
        if !self.kube_proxy_prefix.starts_with('/')
            || self.kube_proxy_prefix.len() < 2
            || self.kube_proxy_prefix.ends_with('/')
        {
            return Err(HubError::Config(format!(
                "kube proxy prefix {:?} must start with '/' and not end with one",
                self.kube_proxy_prefix
            )));
        }
        if let Some(oidc) = &self.oidc {
            let p = &oidc.username_prefix;
            // Identity provider users must stay apart from hub users and
            // from Kubernetes' own.
            // Either prefix of the other would let a subject land on a
            // hub name ("otter" + ":alice"), or on a built-in one.
            let overlaps =
                |reserved: &str| reserved.starts_with(p.as_str()) || p.starts_with(reserved);
            if p.is_empty() || overlaps(crate::auth::HUB_USER_PREFIX) || overlaps("system:") {
                return Err(HubError::Config(format!(
                    "OIDC username prefix {p:?} must be non-empty and not start with \"otter:\" or \"system:\""
                )));
            }
        }
        otter_pki::validate_cluster_name(&self.agent_namespace).map_err(|_| {
            HubError::Config(format!(
                "agent namespace {:?} is not a valid name",
                self.agent_namespace
            ))
        })?;
        Ok(())
    }

    /// The external URL, defaulting to localhost and the bound API port.
    pub fn external_url(&self, api_port: u16) -> Url {
        self.external_url.clone().unwrap_or_else(|| {
            Url::parse(&format!("https://localhost:{api_port}")).expect("valid URL")
        })
    }

    /// Tunnel URLs, defaulting to QUIC, then HTTP/2, then WebSocket on localhost.
    pub fn tunnel_urls(&self, tunnel_port: u16) -> Vec<Url> {
        if !self.tunnel_urls.is_empty() {
            return self.tunnel_urls.clone();
        }
        ["quic", "h2", "wss"]
            .iter()
            .map(|s| Url::parse(&format!("{s}://localhost:{tunnel_port}")).expect("valid URL"))
            .collect()
    }
}

/// The transport a tunnel URL names by its scheme.
pub fn tunnel_transport(url: &Url) -> Result<TransportKind> {
    url.scheme()
        .parse()
        .map_err(|e: otter_tunnel::TunnelError| HubError::Config(format!("tunnel URL {url}: {e}")))
}

/// How often the API certificate's files are looked at: cert-manager
/// renews days before expiry, so seconds are plenty.
pub const API_CERT_RELOAD: Duration = Duration::from_secs(10);

/// The API listener's certificate from files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiTls {
    /// PEM chain, leaf first.
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// The CA that issued it, which manifests hand to agents so they can
    /// verify the API; none: agents trust the public roots for the API.
    pub ca_file: Option<PathBuf>,
    /// How often the files are looked at for a rewrite.
    pub reload_every: Duration,
}
