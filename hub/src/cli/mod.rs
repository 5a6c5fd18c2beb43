//! The `otter` command line. `main.rs` only parses and calls [`run`].
//!
//! # Layout
//! - this file — the commands and flags, and the hub server (`otter hub`).
//! - [`client`] — reaching a hub: URL, token, CA; `otter login`'s config file.
//! - [`commands`] — one function per client command.
//! - [`resources`] — resource names as typed, resolved with Discovery.
//! - [`output`] — tables, ages, YAML.
//! - [`resume`] — a Watch that is opened again from the last
//!   resourceVersion when the tunnel or the hub goes away (`get -w`).

pub mod client;
pub mod commands;
pub mod describe;
pub mod fleet;
pub mod output;
pub mod resources;
pub mod resume;

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand};
use url::Url;

use crate::{Hub, HubConfig, HubError};

/// OtterScale Link: reach many Kubernetes clusters from one hub.
#[derive(Debug, Parser)]
#[command(name = "otter", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// How log lines are written: `text`, or `json` (one object a line,
    /// for log collectors).
    #[arg(long, global = true, env = "OTTER_LOG_FORMAT", default_value = "text")]
    pub log_format: otter_tunnel::logging::LogFormat,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the hub: LinkService, agent tunnels, and call forwarding.
    ///
    /// Example: otter hub --data-dir /var/lib/otter --external-url https://hub.example.com:8443
    Hub(Box<HubArgs>),
    /// Save the hub URL, a token and the hub CA for later commands.
    ///
    /// Example: otter login --hub https://hub.example.com:8443 --token-file ./otter-data/admin-token --ca-file ./otter-data/ca.crt
    Login {
        /// The hub's API URL, as its operator gave it (https://…).
        #[arg(long)]
        hub: Url,
        /// An API token (prefer --token-file: a flag's value is visible to
        /// other users of the machine).
        #[arg(
            long,
            conflicts_with = "token_file",
            required_unless_present = "token_file"
        )]
        token: Option<String>,
        /// Read the token from a file.
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// PEM of the hub CA, when its certificate is not publicly trusted.
        #[arg(long)]
        ca_file: Option<PathBuf>,
    },
    /// Hub API tokens.
    #[command(subcommand)]
    Token(TokenCommand),
    /// The audit log: calls, kubectl requests, registrations, tunnels and
    /// admin actions (a tenant's admins see their tenant's; operators any).
    ///
    /// Example: otter audit --tenant acme --since 2h
    Audit {
        /// The tenant; an admin's only tenant by default, all for operators.
        #[arg(long)]
        tenant: Option<String>,
        /// How far back, like 30m, 2h or 7d.
        #[arg(long, value_parser = parse_ttl, default_value = "1h")]
        since: Duration,
        /// `json` for the lines as they are.
        #[arg(short, long)]
        output: Option<String>,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Tenants: the customers of this hub.
    ///
    /// Example: otter tenant create acme && otter token create alice --tenant acme --role admin
    #[command(subcommand)]
    Tenant(TenantCommand),
    /// Rotate the hub CA without stranding agents (admins only): stage a new
    /// CA, activate it once every agent trusts it, finish once every agent
    /// holds a certificate from it.
    ///
    /// Example: otter ca stage && otter ca status && otter ca activate && otter ca finish
    Ca {
        #[command(subcommand)]
        step: CaStep,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Let an enrolled cluster take a new agent (admins only): a join token
    /// enrolls a cluster once, so replacing its agent (a lost identity, a
    /// reinstalled cluster) needs this, then a new manifest applied.
    ///
    /// Example: otter re-enroll edge-1 && kubectl apply -f $(otter agent-manifest --cluster edge-1)
    ReEnroll {
        /// The member cluster to open for a new agent.
        cluster: String,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Print a URL serving the agent manifest for a cluster (or the YAML with -o yaml).
    ///
    /// Example (in the member cluster): kubectl apply -f $(otter agent-manifest --cluster edge-1)
    AgentManifest {
        /// The member cluster's name on the hub (new, or re-enrolled).
        #[arg(long)]
        cluster: String,
        /// The tenant the cluster joins; the caller's only administered
        /// tenant by default.
        #[arg(long)]
        tenant: Option<String>,
        /// Also make this user cluster-admin of the member cluster (repeatable).
        #[arg(long = "extra-user")]
        extra_users: Vec<String>,
        /// The Rancher project the cluster's namespaces belong to (labels
        /// the agent's namespace for Rancher).
        #[arg(long)]
        rancher_project_id: Option<String>,
        /// A label for the link, key=value (repeatable); selects the
        /// cluster in fan-out calls such as `otter get --clusters env=prod`.
        #[arg(long = "label")]
        labels: Vec<String>,
        /// `yaml` prints the manifest instead of its URL.
        #[arg(short, long)]
        output: Option<String>,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// List the member clusters and their tunnels.
    ///
    /// Example: otter links -o wide
    Links {
        #[command(subcommand)]
        action: Option<LinksCommand>,
        /// `json` or `wide`.
        #[arg(short, long)]
        output: Option<String>,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Show resources of a cluster, like kubectl get.
    ///
    /// Example: otter get pods --cluster edge-1 -A
    Get {
        /// Resource type, as kubectl takes it: pods, deploy, nodes, crontabs.stable.example.com.
        resource: String,
        /// One object's name; all of them without.
        name: Option<String>,
        #[command(flatten)]
        scope: Scope,
        /// In every namespace.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
        /// Label selector, like app=web,tier!=db.
        #[arg(short = 'l', long)]
        selector: Option<String>,
        /// `yaml`, `json` or `wide`.
        #[arg(short, long)]
        output: Option<String>,
        /// Keep printing changes.
        #[arg(short, long)]
        watch: bool,
        /// Every cluster whose link labels match this selector
        /// (`env=prod,region in (eu,us)`; "" for all), in one table with a
        /// CLUSTER column.
        #[arg(long, conflicts_with_all = ["watch", "cluster"])]
        clusters: Option<String>,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Server-side apply a YAML or JSON file (`-` for stdin).
    ///
    /// Example: otter apply -f app.yaml --cluster edge-1
    Apply {
        /// The YAML or JSON file to apply (`-` for stdin).
        #[arg(short, long)]
        filename: String,
        #[command(flatten)]
        scope: Scope,
        /// Take over fields other managers own.
        #[arg(long)]
        force_conflicts: bool,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Delete a resource.
    ///
    /// Example: otter delete pod web-0 --cluster edge-1 --grace-period 0
    Delete {
        /// Resource type, as kubectl takes it.
        resource: String,
        /// The object's name.
        name: String,
        #[command(flatten)]
        scope: Scope,
        /// Seconds the object gets to stop (0: at once).
        #[arg(long)]
        grace_period: Option<i64>,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Show a resource and its events.
    ///
    /// Example: otter describe deploy web --cluster edge-1
    Describe {
        /// Resource type, as kubectl takes it.
        resource: String,
        /// The object's name.
        name: String,
        #[command(flatten)]
        scope: Scope,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Print (or follow) a pod's logs.
    ///
    /// Example: otter logs web-0 --cluster edge-1 -f --tail 20
    Logs {
        /// The pod.
        pod: String,
        #[command(flatten)]
        scope: Scope,
        /// Keep printing new lines.
        #[arg(short, long)]
        follow: bool,
        /// Only the last N lines.
        #[arg(long)]
        tail: Option<i64>,
        /// Only newer than this, e.g. 30s, 5m, 2h.
        #[arg(long, value_parser = parse_duration)]
        since: Option<std::time::Duration>,
        /// The container, when the pod has several.
        #[arg(short = 'c', long)]
        container: Option<String>,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Run a command in a pod.
    ///
    /// Example: otter exec -it web-0 --cluster edge-1 -- sh
    Exec {
        /// The pod.
        pod: String,
        #[command(flatten)]
        scope: Scope,
        /// Pass stdin to the command.
        #[arg(short = 'i', long)]
        stdin: bool,
        /// Allocate a terminal.
        #[arg(short = 't', long)]
        tty: bool,
        /// The container, when the pod has several.
        #[arg(short = 'c', long)]
        container: Option<String>,
        #[command(flatten)]
        hub: client::HubFlags,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Forward a local port to a pod's port.
    ///
    /// Example: otter port-forward web-0 8080:80 --cluster edge-1
    PortForward {
        /// The pod.
        pod: String,
        /// LOCAL:REMOTE (or PORT for both).
        ports: String,
        #[command(flatten)]
        scope: Scope,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Set the replicas of a Deployment, StatefulSet or ReplicaSet.
    ///
    /// Example: otter scale deploy web --replicas 3 --cluster edge-1
    Scale {
        /// deploy, statefulset or replicaset.
        resource: String,
        /// The workload's name.
        name: String,
        /// How many pods it should run.
        #[arg(long)]
        replicas: i32,
        #[command(flatten)]
        scope: Scope,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// The CLI's own settings.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Print this binary's version and the agent image its hub puts in
    /// manifests by default.
    Version {
        /// Only the version, as `v0.1.0`.
        #[arg(long)]
        short: bool,
    },
    /// Write kubectl contexts that reach clusters through the hub.
    ///
    /// Example: otter kubeconfig --cluster edge-1 && kubectl --context otter-edge-1 get pods
    Kubeconfig {
        /// A cluster to add (repeatable).
        #[arg(long = "cluster")]
        clusters: Vec<String>,
        /// Every cluster the hub knows.
        #[arg(long)]
        all: bool,
        /// The kubeconfig to merge into (default: $KUBECONFIG, else ~/.kube/config).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// The hub's Kubernetes proxy prefix.
        #[arg(long, default_value = "/clusters")]
        prefix: String,
        /// Let kubectl ask `otter token get` for the token instead of storing it.
        #[arg(long)]
        exec_plugin: bool,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Rolling restart of a workload, like kubectl rollout restart.
    ///
    /// Example: otter restart deploy web --cluster edge-1
    Restart {
        /// deploy, statefulset or daemonset.
        resource: String,
        /// The workload's name.
        name: String,
        #[command(flatten)]
        scope: Scope,
        #[command(flatten)]
        hub: client::HubFlags,
    },
}

/// `otter config …`, like kubectl's contexts.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Act on this cluster when a command has no --cluster.
    ///
    /// Example: otter config use-cluster edge-1 && otter get pods
    UseCluster {
        /// The cluster; "" clears the default.
        cluster: String,
    },
    /// Print the default cluster.
    CurrentCluster,
}

/// `otter links …`.
#[derive(Debug, Subcommand)]
pub enum LinksCommand {
    /// Forget a cluster's link (its tenant's admins): the tunnel is closed,
    /// the agent's certificate refused from then on, the name freed.
    ///
    /// Example: otter links delete edge-1
    Delete {
        /// The member cluster.
        cluster: String,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Let the cluster take a new agent (as `otter re-enroll`).
    ReEnroll {
        /// The member cluster.
        cluster: String,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Everything the hub knows of one link: tunnel, certificate, the
    /// agent's diagnosis, and what its connectivity doctor found when its
    /// dials last kept failing.
    ///
    /// Example: otter links describe edge-1
    Describe {
        /// The member cluster.
        cluster: String,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Set (key=value) or remove (key-) labels of a link (its tenant's
    /// admins), as kubectl label does.
    ///
    /// Example: otter links label edge-1 env=prod region=eu legacy-
    Label {
        /// The member cluster.
        cluster: String,
        /// key=value to set, key- to remove.
        #[arg(required = true)]
        labels: Vec<String>,
        #[command(flatten)]
        hub: client::HubFlags,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Print the login's token as a kubectl ExecCredential (for kubeconfigs
    /// written with `otter kubeconfig --exec-plugin`).
    Get {
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Create an API token (a tenant's admins for their tenant, operators
    /// for any); prints the token.
    ///
    /// Example: otter token create alice --tenant acme --role member --group devs --ttl 30d
    Create {
        /// Who the token is for (the user name calls are made as).
        name: String,
        /// Groups the user is in, within the tenant (repeatable).
        #[arg(long = "group")]
        groups: Vec<String>,
        /// The tenant; the caller's only administered tenant by default.
        #[arg(long, conflicts_with = "operator")]
        tenant: Option<String>,
        /// `member` (reaches the tenant's clusters) or `admin` (also mints
        /// manifests and tokens, deletes and re-enrolls links).
        #[arg(long, conflicts_with = "operator")]
        role: Option<String>,
        /// A hub operator (operators only): manages tenants, reaches no
        /// cluster unless a tenant makes it a member.
        #[arg(long)]
        operator: bool,
        /// Lifetime, like 12h or 30d; none: until revoked.
        #[arg(long, value_parser = parse_ttl)]
        ttl: Option<Duration>,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// List the tokens the caller manages (no secrets).
    List {
        /// `json` for the raw list.
        #[arg(short, long)]
        output: Option<String>,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Revoke a token by id: it fails from its next call on.
    ///
    /// Example: otter token revoke 3f2a9c0d11e4b7a8
    Revoke {
        /// The token's id, as `otter token list` shows it.
        id: String,
        #[command(flatten)]
        hub: client::HubFlags,
    },
}

/// `otter tenant …` (creating and deleting: hub operators).
#[derive(Debug, Subcommand)]
pub enum TenantCommand {
    /// Create a tenant; then name its first admin with
    /// `otter token create USER --tenant NAME --role admin`.
    Create {
        /// The new tenant's name (lower-case letters, digits and dashes).
        name: String,
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// The tenants the caller sees (operators: all).
    List {
        #[command(flatten)]
        hub: client::HubFlags,
    },
    /// Delete a tenant that holds no cluster.
    Delete {
        /// The tenant.
        name: String,
        #[command(flatten)]
        hub: client::HubFlags,
    },
}

impl TenantCommand {
    fn hub(&self) -> &client::HubFlags {
        match self {
            TenantCommand::Create { hub, .. }
            | TenantCommand::List { hub }
            | TenantCommand::Delete { hub, .. } => hub,
        }
    }
}

/// `12h`, `30d`, `90m`, `45s`, or plain seconds.
fn parse_ttl(s: &str) -> Result<Duration, HubError> {
    let invalid = |why: &str| HubError::Invalid(format!("{s:?}: {why}"));
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits
        .parse()
        .map_err(|_| invalid("expected a number and a unit, like 12h or 30d"))?;
    let secs = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(invalid("the unit is one of s, m, h, d")),
    };
    n.checked_mul(secs)
        .filter(|&t| t > 0)
        .map(Duration::from_secs)
        .ok_or_else(|| invalid("must be more than 0 and not absurdly long"))
}

#[derive(Debug, Clone, Copy, Subcommand)]
pub enum CaStep {
    /// Phase, fingerprints, and the clusters not ready for the next step.
    Status,
    /// Make a new CA and trust it next to the active one; connected agents
    /// are asked to renew, which gives them both.
    Stage,
    /// Sign with the staged CA (refused while a cluster has not renewed
    /// since staging, unless --force).
    Activate {
        /// Go ahead even if the clusters listed would be stranded.
        #[arg(long)]
        force: bool,
    },
    /// Stop trusting the previous CA (refused while a cluster still holds a
    /// certificate it signed, unless --force).
    Finish {
        /// Go ahead even if the clusters listed would be stranded.
        #[arg(long)]
        force: bool,
    },
}

/// Cluster and namespace of a command.
#[derive(Debug, Clone, clap::Args)]
pub struct Scope {
    /// The member cluster (default: `otter config use-cluster`'s). No
    /// short form: `-c` is the container, as in kubectl.
    #[arg(long, env = "OTTER_CLUSTER")]
    pub cluster: Option<String>,
    /// The namespace (`default` when not given).
    #[arg(short = 'n', long)]
    pub namespace: Option<String>,
}

impl Scope {
    /// The cluster named on the command line, else the saved default.
    pub fn cluster(&self) -> anyhow::Result<String> {
        if let Some(c) = &self.cluster {
            return Ok(c.clone());
        }
        client::load_file()?.cluster.ok_or_else(|| {
            anyhow::anyhow!(
                "no cluster: pass --cluster X, or set a default with `otter config use-cluster X`"
            )
        })
    }
}

fn parse_duration(s: &str) -> Result<std::time::Duration, HubError> {
    let invalid = || HubError::Invalid(format!("{s:?} is not a duration like 30s, 5m or 2h"));
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num.parse().map_err(|_| invalid())?;
    let secs = match unit {
        "" | "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => return Err(invalid()),
    };
    Ok(std::time::Duration::from_secs(secs))
}

/// One clear line for a failed RPC.
pub fn status_error(s: tonic::Status) -> anyhow::Error {
    let what = match s.code() {
        tonic::Code::Unauthenticated => "not logged in or token rejected",
        tonic::Code::PermissionDenied => "forbidden",
        tonic::Code::NotFound => "not found",
        tonic::Code::Unavailable => "unavailable",
        tonic::Code::InvalidArgument => "invalid",
        tonic::Code::DeadlineExceeded => "timed out",
        _ => "error",
    };
    if s.message().is_empty() {
        return anyhow::anyhow!("{what} ({:?})", s.code());
    }
    anyhow::anyhow!("{what}: {}", s.message())
}

#[derive(Debug, Args)]
pub struct HubArgs {
    /// Where the hub keeps its CA, links and tokens (sled).
    #[arg(long, env = "OTTER_DATA_DIR", default_value = "./otter-data")]
    pub data_dir: PathBuf,
    /// API listener (gRPC over TLS).
    #[arg(long, env = "OTTER_LISTEN", default_value = "127.0.0.1:8443")]
    pub listen: SocketAddr,
    /// Tunnel listener: TLS + HTTP/2 on TCP and QUIC on UDP, same port.
    #[arg(long, env = "OTTER_TUNNEL_LISTEN", default_value = "127.0.0.1:8444")]
    pub tunnel_listen: SocketAddr,
    /// URL users and agents use to reach the API listener.
    #[arg(long, env = "OTTER_EXTERNAL_URL")]
    pub external_url: Option<Url>,
    /// URL agents dial for tunnels (repeat, in order of preference), e.g.
    /// quic://hub.example.com:8444 and h2://hub.example.com:8444.
    #[arg(long = "tunnel-url", env = "OTTER_TUNNEL_URLS", value_delimiter = ',')]
    pub tunnel_urls: Vec<Url>,
    /// Lifetime of agent certificates, in seconds.
    #[arg(long, default_value_t = 24 * 3600)]
    pub agent_cert_lifetime_secs: u64,
    /// Lifetime of join tokens, in seconds.
    #[arg(long, default_value_t = 3600)]
    pub join_token_ttl_secs: u64,
    /// Tunnel keepalive interval in seconds; a silent tunnel is dropped after three.
    #[arg(long, default_value_t = 5)]
    pub keepalive_secs: u64,
    /// Seconds an API caller's connection may be silent before the hub
    /// checks on it (an HTTP/2 ping; TCP keepalive probes for HTTP/1.1); it
    /// is closed, and its calls ended, when no answer comes within as long
    /// again.
    #[arg(long, default_value_t = crate::config::DEFAULT_API_KEEPALIVE_SECS)]
    pub api_keepalive_secs: u64,
    /// Concurrent calls one tunnel carries; more get ResourceExhausted.
    #[arg(long, default_value_t = 512)]
    pub max_calls_per_tunnel: u32,
    /// Concurrent calls one tenant's callers may have across its clusters
    /// (counted per replica); more get ResourceExhausted (kubectl: 429).
    #[arg(long, default_value_t = crate::config::DEFAULT_MAX_CALLS_PER_TENANT)]
    pub max_calls_per_tenant: u32,
    /// Seconds a Watch or followed log whose cluster's tunnel dropped waits
    /// for the next one, to go on from the last change or line it passed; 0
    /// ends it with the tunnel (Unavailable).
    #[arg(long, default_value_t = 60)]
    pub watch_resume_grace_secs: u64,
    /// Tunnels set up at once; agents beyond it are told to retry later.
    #[arg(long, default_value_t = crate::config::DEFAULT_MAX_ADMISSIONS)]
    pub max_concurrent_admissions: usize,
    /// File with a 32-byte key (raw, hex or base64) that seals the CA keys and
    /// signing secrets in the store (`head -c 32 /dev/urandom > store.key`).
    #[arg(long, env = "OTTER_STORE_KEY_FILE")]
    pub store_key_file: Option<PathBuf>,
    /// A store shared by several hub replicas, `etcd://HOST:PORT[,HOST:PORT…]`
    /// (needs --store-key-file); without it, sled in --data-dir.
    #[arg(long, env = "OTTER_STORE")]
    pub store: Option<String>,
    /// Every key the hub keeps in etcd starts with it.
    #[arg(long, env = "OTTER_STORE_PREFIX", default_value = crate::etcd::DEFAULT_PREFIX)]
    pub store_prefix: String,
    /// CA of etcd's serving certificate: TLS to etcd.
    #[arg(long, env = "OTTER_ETCD_CA_FILE")]
    pub etcd_ca_file: Option<PathBuf>,
    /// Client certificate for etcd (with --etcd-key-file).
    #[arg(long, env = "OTTER_ETCD_CERT_FILE")]
    pub etcd_cert_file: Option<PathBuf>,
    /// The key of --etcd-cert-file.
    #[arg(long, env = "OTTER_ETCD_KEY_FILE")]
    pub etcd_key_file: Option<PathBuf>,
    /// etcd user; its password comes from OTTER_ETCD_PASSWORD (never argv).
    #[arg(long, env = "OTTER_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// This replica's name among those sharing the store (default: the host's name).
    #[arg(long, env = "OTTER_REPLICA_NAME")]
    pub replica_name: Option<String>,
    /// Where the other replicas reach this one (mutual TLS with replica certificates).
    #[arg(long, env = "OTTER_PEER_LISTEN")]
    pub peer_listen: Option<SocketAddr>,
    /// The URL other replicas dial for --peer-listen (default: from its address).
    #[arg(long, env = "OTTER_PEER_URL")]
    pub peer_url: Option<Url>,
    /// TLS and QUIC handshakes on the tunnel port before a client certificate is verified;
    /// as many API connections before their first request head (a set of their own).
    #[arg(long, default_value_t = 1024)]
    pub max_pending_handshakes: usize,
    /// Of each set, what one source address (IPv6: /64) may hold once half are taken.
    #[arg(long, default_value_t = 32)]
    pub pending_handshakes_per_source: usize,
    /// Connections to the API port, all sources together (also at most half the open-file limit).
    #[arg(long, default_value_t = 8192)]
    pub max_api_connections: usize,
    /// Connections to the API port from one source address (IPv6: /64).
    #[arg(long, default_value_t = 512)]
    pub max_api_connections_per_source: usize,
    /// The retry-after hint refused agents get, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub admission_retry_after_ms: u64,
    /// Register calls served at once; more are told to retry later.
    #[arg(long, default_value_t = crate::config::DEFAULT_MAX_REGISTRATIONS)]
    pub max_concurrent_registrations: usize,
    /// kubectl exec / attach / port-forward connections one user may hold at once (429 beyond).
    #[arg(long, default_value_t = 64)]
    pub kube_upgrades_per_user: usize,
    /// kubectl exec / attach / port-forward connections one cluster may carry at once (429 beyond).
    #[arg(long, default_value_t = 256)]
    pub kube_upgrades_per_cluster: usize,
    /// Seconds an exec / attach / port-forward connection may stay silent before it is closed.
    #[arg(long, default_value_t = 1800)]
    pub kube_upgrade_idle_secs: u64,
    /// Browser origin allowed to call the API (repeat; `*` for any).
    #[arg(
        long = "cors-origin",
        env = "OTTER_CORS_ORIGINS",
        value_delimiter = ','
    )]
    pub cors_origins: Vec<String>,
    /// Switch off a feature (`link-enabled`, `resource-enabled`, `runtime-enabled`); repeatable.
    #[arg(
        long = "disable-feature",
        env = "OTTER_DISABLED_FEATURES",
        value_delimiter = ','
    )]
    pub disabled_features: Vec<String>,
    /// Serve the API without TLS (HTTP/1.1 and h2c), for local development only.
    #[arg(long)]
    pub api_plaintext: bool,
    /// Let ShowChart fetch from any address, private ones included
    /// (loopback, RFC 1918, link-local): for a hub inside a trusted network.
    #[arg(long)]
    pub chart_allow_private: bool,
    /// Let ShowChart fetch from this range although it is not public (an
    /// internal chart mirror); repeatable.
    #[arg(long = "chart-allow-cidr", value_delimiter = ',')]
    pub chart_allow_cidrs: Vec<ipnet::IpNet>,
    /// Extra CA (PEM file) ShowChart trusts, besides the public roots.
    #[arg(long)]
    pub chart_ca_file: Option<PathBuf>,
    /// Serve Prometheus text at /metrics on this address, plaintext and
    /// without a token (keep it inside the cluster's network).
    #[arg(long, env = "OTTER_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Serve /healthz, /livez, /readyz and gRPC health (h2c, for kubelet
    /// `grpc:` probes) on this address, plaintext; may equal --metrics-listen.
    #[arg(long, env = "OTTER_HEALTH_LISTEN")]
    pub health_listen: Option<SocketAddr>,
    /// Callers in this group administer the hub.
    #[arg(long, env = "OTTER_ADMIN_GROUP", default_value = crate::tokens::ADMIN_GROUP)]
    pub admin_group: String,
    /// OpenID Connect issuer URL for user tokens.
    #[arg(long, env = "OTTER_OIDC_ISSUER", requires = "oidc_audience")]
    pub oidc_issuer: Option<Url>,
    /// Audience (client id) tokens must carry.
    #[arg(long, env = "OTTER_OIDC_AUDIENCE")]
    pub oidc_audience: Option<String>,
    /// Claim naming the user.
    #[arg(long, default_value = "sub")]
    pub oidc_user_claim: String,
    /// Claim holding the user's groups.
    #[arg(long, default_value = "groups")]
    pub oidc_groups_claim: String,
    /// A groups-claim value `<prefix><tenant>:<role>` (role `member` or
    /// `admin`) makes the user that in the tenant.
    #[arg(long, default_value = "otterscale:tenant:")]
    pub oidc_tenant_group_prefix: String,
    /// Put before the identity provider's user name in the name clusters
    /// see (like kube-apiserver's `--oidc-username-prefix`).
    #[arg(long, default_value = "oidc:")]
    pub oidc_username_prefix: String,
    /// Extra CA (PEM file) to trust for the issuer.
    #[arg(long)]
    pub oidc_ca_file: Option<PathBuf>,
    /// Kubeconfig of the Rancher management cluster (its current context);
    /// ListRancherProjects lists the `management.cattle.io/v3` projects there.
    #[arg(long, env = "OTTER_RANCHER_KUBECONFIG")]
    pub rancher_kubeconfig: Option<PathBuf>,
    /// Audit log: a file (rotated by size, 3 old ones kept, owner-only) or
    /// `-` for stdout. One JSON line per call, kubectl request,
    /// registration, tunnel and admin action.
    #[arg(long, env = "OTTER_AUDIT_LOG")]
    pub audit_log: Option<PathBuf>,
    /// Size at which the audit file is rotated, in MiB.
    #[arg(long, default_value_t = 100)]
    pub audit_log_max_mb: u64,
    /// Agent image the manifests run.
    #[arg(long, env = "OTTER_AGENT_IMAGE")]
    pub agent_image: Option<String>,
    /// Namespace the agent manifests install into.
    #[arg(long, env = "OTTER_AGENT_NAMESPACE", default_value = crate::manifest::DEFAULT_NAMESPACE)]
    pub agent_namespace: String,
    /// How long a manifest URL works, in seconds.
    #[arg(long, default_value_t = 3600)]
    pub manifest_ttl_secs: u64,
    /// A certificate chain (PEM, leaf first) for the API port, one users'
    /// tools trust (a public CA's, cert-manager's); read again when the file
    /// changes. Without it the API port shows one from the hub CA.
    #[arg(long, env = "OTTER_TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// The key of --tls-cert-file.
    #[arg(long, env = "OTTER_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// The CA that issued --tls-cert-file, handed to agents in their
    /// manifests to verify the API with; without it agents trust the public
    /// roots for the API (the tunnel stays pinned to the hub CA).
    #[arg(long, env = "OTTER_TLS_CA_FILE", requires = "tls_cert_file")]
    pub tls_ca_file: Option<PathBuf>,
}

impl HubArgs {
    pub fn into_config(self) -> Result<HubConfig, HubError> {
        let mut c = HubConfig::new(self.data_dir);
        c.store_key_file = self.store_key_file;
        if let Some(url) = &self.store {
            let mut etcd = crate::etcd::EtcdOptions::from_url(url)?;
            etcd.prefix = self.store_prefix;
            etcd.ca_file = self.etcd_ca_file;
            etcd.cert_file = self.etcd_cert_file;
            etcd.key_file = self.etcd_key_file;
            if let Some(user) = self.etcd_user {
                etcd.password = Some(std::env::var("OTTER_ETCD_PASSWORD").map_err(|_| {
                    HubError::Invalid(
                        "--etcd-user needs the password in OTTER_ETCD_PASSWORD".to_owned(),
                    )
                })?);
                etcd.user = Some(user);
            }
            c.store = Some(etcd);
        }
        if let Some(name) = self.replica_name {
            c.replica = name;
        }
        c.peer_listen = self.peer_listen;
        c.peer_url = self.peer_url;
        c.api_listen = self.listen;
        c.api_tls = match (self.tls_cert_file, self.tls_key_file) {
            (Some(cert_file), Some(key_file)) => Some(crate::config::ApiTls {
                cert_file,
                key_file,
                ca_file: self.tls_ca_file,
                reload_every: crate::config::API_CERT_RELOAD,
            }),
            _ => None,
        };
        c.tunnel_listen = self.tunnel_listen;
        c.external_url = self.external_url;
        c.tunnel_urls = self.tunnel_urls;
        c.agent_cert_lifetime = Duration::from_secs(self.agent_cert_lifetime_secs);
        c.join_token_ttl = Duration::from_secs(self.join_token_ttl_secs);
        c.keepalive =
            otter_tunnel::Keepalive::every(Duration::from_secs(self.keepalive_secs.max(1)));
        let api_keepalive = Duration::from_secs(self.api_keepalive_secs.max(1));
        c.api_keepalive = otter_tunnel::Keepalive {
            interval: api_keepalive,
            timeout: api_keepalive,
        };
        c.max_calls_per_tunnel = self.max_calls_per_tunnel;
        c.max_calls_per_tenant = self.max_calls_per_tenant;
        c.watch_resume_grace = Duration::from_secs(self.watch_resume_grace_secs);
        c.max_concurrent_admissions = self.max_concurrent_admissions;
        c.admission_retry_after = Duration::from_millis(self.admission_retry_after_ms);
        c.tunnel_handshakes = otter_tunnel::handshakes::HandshakeLimits {
            max_pending: self.max_pending_handshakes,
            per_source: self.pending_handshakes_per_source,
            ..Default::default()
        };
        c.api_handshakes = otter_tunnel::handshakes::HandshakeLimits {
            max_pending: self.max_pending_handshakes,
            per_source: self.pending_handshakes_per_source,
            ..c.api_handshakes
        };
        c.api_connections = crate::limits::ApiConnectionLimits {
            max_total: self.max_api_connections,
            per_source: self.max_api_connections_per_source,
        };
        c.max_concurrent_registrations = self.max_concurrent_registrations;
        c.kube_upgrades = crate::config::KubeUpgradeLimits {
            per_user: self.kube_upgrades_per_user,
            per_cluster: self.kube_upgrades_per_cluster,
            idle_timeout: Duration::from_secs(self.kube_upgrade_idle_secs.max(1)),
        };
        c.cors_origins = self.cors_origins;
        c.disabled_features = self.disabled_features;
        c.api_plaintext = self.api_plaintext;
        c.charts =
            crate::chart::ChartPolicy {
                allow_private: self.chart_allow_private,
                allow: self.chart_allow_cidrs,
                ca_pem: match &self.chart_ca_file {
                    Some(path) => Some(std::fs::read_to_string(path).map_err(|source| {
                        HubError::ReadFile {
                            path: path.clone(),
                            source,
                        }
                    })?),
                    None => None,
                },
            };
        c.metrics_listen = self.metrics_listen;
        c.health_listen = self.health_listen;
        c.admin_group = self.admin_group;
        c.rancher_kubeconfig = self.rancher_kubeconfig;
        c.audit_log = self.audit_log.map(|path| {
            if path.as_os_str() == "-" {
                crate::audit::Target::Stdout
            } else {
                crate::audit::Target::File {
                    path,
                    max_bytes: self.audit_log_max_mb.max(1) * 1024 * 1024,
                }
            }
        });
        if let Some(image) = self.agent_image {
            c.agent_image = image;
        }
        c.agent_namespace = self.agent_namespace;
        c.manifest_ttl = Duration::from_secs(self.manifest_ttl_secs);
        if let (Some(issuer), Some(audience)) = (self.oidc_issuer, self.oidc_audience) {
            let mut oidc = crate::oidc::OidcConfig::new(issuer, &audience);
            oidc.user_claim = self.oidc_user_claim;
            oidc.groups_claim = self.oidc_groups_claim;
            oidc.tenant_group_prefix = self.oidc_tenant_group_prefix;
            oidc.username_prefix = self.oidc_username_prefix;
            // The groups-claim value that makes an operator is the admin
            // group's name.
            oidc.operator_group = c.admin_group.clone();
            if let Some(path) = self.oidc_ca_file {
                oidc.ca_pem =
                    Some(
                        std::fs::read_to_string(&path).map_err(|source| HubError::ReadFile {
                            path: path.clone(),
                            source,
                        })?,
                    );
            }
            c.oidc = Some(oidc);
        }
        Ok(c)
    }
}

/// Exit code for a configuration error (EX_USAGE), before anything is bound.
pub const EXIT_CONFIG: i32 = 64;

/// Runs the parsed command; returns the process exit code.
pub async fn run(cli: Cli) -> i32 {
    match client_command(cli.command).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("otter: {}", output::printable(&format!("{e:#}")));
            1
        }
    }
}

async fn client_command(command: Command) -> anyhow::Result<i32> {
    match command {
        Command::Hub(args) => return Ok(serve(*args).await),
        Command::Login {
            hub,
            token,
            token_file,
            ca_file,
        } => {
            let token = match (token, token_file) {
                (Some(t), _) => t,
                (None, Some(f)) => std::fs::read_to_string(&f)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?
                    .trim()
                    .to_owned(),
                (None, None) => anyhow::bail!("give --token or --token-file"),
            };
            commands::login(hub, token, ca_file).await?;
        }
        Command::Token(TokenCommand::Get { hub }) => commands::token_get(&hub)?,
        Command::Token(TokenCommand::Create {
            name,
            groups,
            tenant,
            role,
            operator,
            ttl,
            hub,
        }) => {
            let new = commands::NewToken {
                name,
                groups,
                tenant,
                role,
                operator,
                ttl,
            };
            commands::token_create(&hub.connect().await?, &new).await?
        }
        Command::Token(TokenCommand::List { output, hub }) => {
            commands::token_list(&hub.connect().await?, output.as_deref()).await?
        }
        Command::Token(TokenCommand::Revoke { id, hub }) => {
            commands::token_revoke(&hub.connect().await?, &id).await?
        }
        Command::Audit {
            tenant,
            since,
            output,
            hub,
        } => {
            commands::audit(
                &hub.connect().await?,
                tenant.as_deref(),
                since,
                output.as_deref(),
            )
            .await?
        }
        Command::Tenant(action) => {
            commands::tenant(&action.hub().connect().await?, &action).await?
        }
        Command::Ca { step, hub } => commands::ca(&hub.connect().await?, step).await?,
        Command::ReEnroll { cluster, hub } => {
            commands::re_enroll(&hub.connect().await?, &cluster).await?
        }
        Command::AgentManifest {
            cluster,
            tenant,
            extra_users,
            rancher_project_id,
            labels,
            output,
            hub,
        } => {
            let yaml = match output.as_deref() {
                None | Some("url") => false,
                Some("yaml") => true,
                Some(o) => anyhow::bail!("-o {o}: use yaml (or leave it out for the URL)"),
            };
            commands::agent_manifest(
                &hub.connect().await?,
                &cluster,
                tenant.as_deref(),
                extra_users,
                rancher_project_id,
                &labels,
                yaml,
            )
            .await?
        }
        Command::Links {
            action: Some(LinksCommand::Delete { cluster, hub }),
            ..
        } => commands::link_delete(&hub.connect().await?, &cluster).await?,
        Command::Links {
            action: Some(LinksCommand::ReEnroll { cluster, hub }),
            ..
        } => commands::re_enroll(&hub.connect().await?, &cluster).await?,
        Command::Links {
            action: Some(LinksCommand::Describe { cluster, hub }),
            ..
        } => fleet::describe_link(&hub.connect().await?, &cluster).await?,
        Command::Links {
            action:
                Some(LinksCommand::Label {
                    cluster,
                    labels,
                    hub,
                }),
            ..
        } => commands::link_label(&hub.connect().await?, &cluster, &labels).await?,
        Command::Links {
            action: None,
            output,
            hub,
        } => commands::links(&hub.connect().await?, output.as_deref()).await?,
        Command::Get {
            resource,
            name,
            scope,
            all_namespaces,
            selector,
            output,
            watch,
            clusters,
            hub,
        } => {
            let cluster = match &clusters {
                Some(_) => String::new(),
                None => scope.cluster()?,
            };
            let args = commands::GetArgs {
                cluster,
                resource,
                name,
                namespace: scope.namespace,
                all_namespaces,
                selector,
                output,
                watch,
            };
            match clusters {
                Some(selector) => fleet::get(&hub.connect().await?, args, &selector).await?,
                None => commands::get(&hub.connect().await?, args).await?,
            }
        }
        Command::Apply {
            filename,
            scope,
            force_conflicts,
            hub,
        } => {
            commands::apply(
                &hub.connect().await?,
                &scope.cluster()?,
                &filename,
                scope.namespace,
                force_conflicts,
            )
            .await?
        }
        Command::Delete {
            resource,
            name,
            scope,
            grace_period,
            hub,
        } => {
            commands::delete(
                &hub.connect().await?,
                &scope.cluster()?,
                &resource,
                &name,
                scope.namespace,
                grace_period,
            )
            .await?
        }
        Command::Describe {
            resource,
            name,
            scope,
            hub,
        } => {
            commands::describe(
                &hub.connect().await?,
                &scope.cluster()?,
                &resource,
                &name,
                scope.namespace,
            )
            .await?
        }
        Command::Logs {
            pod,
            scope,
            follow,
            tail,
            since,
            container,
            hub,
        } => {
            commands::logs(
                &hub.connect().await?,
                &scope,
                &pod,
                follow,
                tail,
                since,
                container,
            )
            .await?
        }
        Command::Exec {
            pod,
            scope,
            stdin,
            tty,
            container,
            hub,
            command,
        } => {
            return commands::exec(
                &hub.connect().await?,
                &scope,
                &pod,
                container,
                stdin,
                tty,
                command,
            )
            .await;
        }
        Command::PortForward {
            pod,
            ports,
            scope,
            hub,
        } => {
            let (local, remote) = commands::forwarded_ports(&ports)?;
            commands::port_forward(
                &hub.connect().await?,
                &scope.cluster()?,
                &pod,
                scope.namespace,
                local,
                remote,
            )
            .await?
        }
        Command::Scale {
            resource,
            name,
            replicas,
            scope,
            hub,
        } => {
            if replicas < 0 {
                anyhow::bail!("--replicas must be 0 or more");
            }
            commands::scale(
                &hub.connect().await?,
                &scope.cluster()?,
                &resource,
                &name,
                scope.namespace,
                replicas,
            )
            .await?
        }
        Command::Config(ConfigCommand::UseCluster { cluster }) => commands::use_cluster(&cluster)?,
        Command::Config(ConfigCommand::CurrentCluster) => match client::load_file()?.cluster {
            Some(c) => println!("{c}"),
            None => anyhow::bail!("no default cluster; set one with `otter config use-cluster X`"),
        },
        Command::Version { short } => {
            let version = format!("v{}", crate::VERSION);
            if short {
                println!("{version}");
            } else {
                println!("otter {version}");
                println!("agent image {}", crate::HubConfig::new(".").agent_image);
            }
        }
        Command::Kubeconfig {
            clusters,
            all,
            kubeconfig,
            prefix,
            exec_plugin,
            hub,
        } => {
            let path = kubeconfig
                .or_else(|| {
                    std::env::var_os("KUBECONFIG").and_then(|k| std::env::split_paths(&k).next())
                })
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".kube/config")))
                .ok_or_else(|| anyhow::anyhow!("no kubeconfig path: pass --kubeconfig"))?;
            let opts = commands::KubeconfigOptions {
                all,
                prefix,
                exec_plugin,
            };
            commands::kubeconfig(&hub.connect().await?, clusters, path, &opts).await?
        }
        Command::Restart {
            resource,
            name,
            scope,
            hub,
        } => {
            commands::restart(
                &hub.connect().await?,
                &scope.cluster()?,
                &resource,
                &name,
                scope.namespace,
            )
            .await?
        }
    }
    Ok(0)
}

async fn serve(args: HubArgs) -> i32 {
    let config = match args.into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("otter hub: {e}");
            return EXIT_CONFIG;
        }
    };
    if let Err(e) = config.validate() {
        eprintln!("otter hub: {e}");
        return EXIT_CONFIG;
    }
    let data_dir = config.data_dir.clone();
    let hub = match Hub::start(config).await {
        Ok(h) => h,
        Err(e) => {
            eprintln!("otter hub: {e}");
            return 1;
        }
    };
    if hub.admin_token.is_some() {
        println!(
            "admin token written to {}",
            data_dir.join("admin-token").display()
        );
    }
    println!(
        "hub API on https://{} , tunnels on {}",
        hub.api_addr, hub.tunnel_addr
    );
    let _ = tokio::signal::ctrl_c().await;
    hub.shutdown().await;
    0
}
