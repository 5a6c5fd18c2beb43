//! Command line of `otter-agent`; every flag has an `OTTER_*` variable so
//! the manifest's Deployment can set them as env.

use std::path::PathBuf;

use clap::Parser;
use otter_tunnel::TransportKind;
use url::Url;

use crate::{Agent, AgentConfig, config::Secret};

/// OtterScale Link agent: joins this cluster to a hub.
#[derive(Debug, Parser)]
#[command(name = "otter-agent", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// How log lines are written: `text`, or `json` (one object a line,
    /// for log collectors).
    #[arg(long, env = "OTTER_LOG_FORMAT", default_value = "text")]
    pub log_format: otter_tunnel::logging::LogFormat,
    /// The hub's API URL; repeat (or separate with commas) for hub
    /// replicas without a load balancer in front: Register and renewals
    /// go to the first that answers.
    #[arg(
        long = "hub-url",
        env = "OTTER_HUB_URL",
        value_delimiter = ',',
        required = true
    )]
    pub hub_urls: Vec<Url>,
    /// This cluster's name at the hub (a DNS label).
    #[arg(long, env = "OTTER_CLUSTER")]
    pub cluster: String,
    /// This agent's id; defaults to the pod name, then the host name.
    #[arg(long, env = "OTTER_AGENT_ID")]
    pub agent_id: Option<String>,
    /// File holding the join token from the agent manifest.
    #[arg(long, env = "OTTER_JOIN_TOKEN_FILE")]
    pub join_token_file: Option<PathBuf>,
    /// File holding the hub CA certificate (PEM).
    #[arg(long, env = "OTTER_HUB_CA_FILE")]
    pub hub_ca_file: PathBuf,
    /// The CA (PEM) that issued the hub API's certificate, when the hub
    /// shows one users' tools trust (its manifest says so); trusted for the
    /// API only, the tunnel stays pinned to the hub CA.
    #[arg(long, env = "OTTER_HUB_API_CA_FILE")]
    pub hub_api_ca_file: Option<PathBuf>,
    /// Trust the public roots for the hub's API (a hub whose API
    /// certificate is from a public CA; its manifest says so).
    #[arg(long, env = "OTTER_HUB_API_PUBLIC_ROOTS")]
    pub hub_api_public_roots: bool,
    /// Where to keep the agent's key and certificate across restarts.
    #[arg(long, env = "OTTER_STATE_DIR", conflicts_with = "state_secret")]
    pub state_dir: Option<PathBuf>,
    /// Keep them in this Secret instead (the manifest's way: it outlives
    /// the pod), which also holds the join token until the agent enrolled.
    #[arg(long, env = "OTTER_STATE_SECRET")]
    pub state_secret: Option<String>,
    /// Namespace of that Secret: the agent's own.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub state_namespace: String,
    /// User name prefixes the agent impersonates (the ceiling: never a
    /// `system:` name, whatever the hub sends).
    #[arg(
        long = "allow-user-prefix",
        env = "OTTER_ALLOW_USER_PREFIXES",
        value_delimiter = ',',
        default_values_t = ["otter:".to_owned(), "oidc:".to_owned()]
    )]
    pub allow_user_prefixes: Vec<String>,
    /// Group name prefixes the agent impersonates; the manifest sets its
    /// tenant's, `otter:<tenant>:`.
    #[arg(
        long = "allow-group-prefix",
        env = "OTTER_ALLOW_GROUP_PREFIXES",
        value_delimiter = ',',
        default_values_t = ["otter:".to_owned()]
    )]
    pub allow_group_prefixes: Vec<String>,
    /// Transports to try, in order.
    #[arg(
        long,
        env = "OTTER_TRANSPORTS",
        value_delimiter = ',',
        default_value = "quic,h2,ws"
    )]
    pub transports: Vec<TransportKind>,
    /// HTTP CONNECT proxy (`http[s]://[user:pass@]host:port`); without it,
    /// `HTTPS_PROXY` / `HTTP_PROXY` and `NO_PROXY` are honoured.
    #[arg(long, env = "OTTER_PROXY")]
    pub proxy: Option<Url>,
    /// CA (PEM file) an `https://` proxy's certificate chains to, when it
    /// is not a public one.
    #[arg(long, env = "OTTER_PROXY_CA_FILE")]
    pub proxy_ca_file: Option<PathBuf>,
    /// While on a fallback transport, seconds between tries of the better
    /// ones (switching without dropping calls); 0 never tries.
    #[arg(long, env = "OTTER_TRANSPORT_RETRY_SECS", default_value_t = 120)]
    pub transport_retry_secs: u64,
    /// A QUIC tunnel losing more than this percentage of its packets over
    /// 10 s moves to the next transport (make before break) and QUIC is
    /// not tried again for 10 minutes; 0 never moves. BBR keeps QUIC ahead
    /// of TCP up to a few percent of loss on every path measured; a path
    /// that loses far more UDP than that is one that polices UDP.
    #[arg(long, env = "OTTER_MAX_LOSS_PERCENT", default_value_t = 20.0)]
    pub max_loss_percent: f64,
    /// Tunnel keepalive interval in seconds.
    #[arg(long, env = "OTTER_KEEPALIVE_SECS", default_value_t = 5)]
    pub keepalive_secs: u64,
    /// How far into its certificate's life (by the hub's clock) the agent
    /// renews it, from 0.1 to 0.95; earlier leaves more time for renewals
    /// that fail (a proxy or the hub down) before the certificate expires.
    #[arg(long, env = "OTTER_RENEW_AT", default_value_t = 2.0 / 3.0)]
    pub renew_at: f64,
    /// SHA-256 of the hub CA certificate (hex); the CA file must match it.
    #[arg(long, env = "OTTER_HUB_CA_FINGERPRINT")]
    pub hub_ca_fingerprint: Option<String>,
    /// Rancher project to file this cluster under ("<cluster-id>:<project>").
    #[arg(long, env = "OTTER_RANCHER_PROJECT_ID", default_value = "")]
    pub rancher_project_id: String,
    /// Address for the /healthz and /readyz probes (off when unset).
    #[arg(long, env = "OTTER_HEALTH_LISTEN")]
    pub health_listen: Option<std::net::SocketAddr>,
    /// Kubeconfig for the agent's own access to the cluster; without it,
    /// `KUBECONFIG` or `~/.kube/config`, then the in-cluster ServiceAccount.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Most exec sessions open at once.
    #[arg(long, env = "OTTER_MAX_EXEC_SESSIONS", default_value_t = 100)]
    pub max_exec_sessions: usize,
    /// Most port-forward sessions open at once.
    #[arg(long, env = "OTTER_MAX_PORT_FORWARD_SESSIONS", default_value_t = 100)]
    pub max_port_forward_sessions: usize,
    /// Seconds without input or output after which a session is ended.
    #[arg(long, env = "OTTER_SESSION_IDLE_SECS", default_value_t = 1800)]
    pub session_idle_secs: u64,
}

/// What to do instead of running the agent.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Check, a line each, what this agent needs to reach its hub (the
    /// hub's names, the proxy, the API and tunnel ports over TCP and TLS,
    /// QUIC over UDP, the clock, something to join with), with the fix
    /// for what fails; exits 1 when a check fails. Takes the agent's own
    /// flags and variables: `kubectl exec deploy/otter-agent -- otter-agent
    /// doctor` in the cluster.
    Doctor,
}

/// Runs the agent until Ctrl-C or SIGTERM (or the doctor); returns the
/// exit code.
pub async fn run(cli: Cli) -> i32 {
    if matches!(cli.command, Some(Command::Doctor)) {
        return doctor(cli).await;
    }
    let health = match cli.health_listen {
        Some(addr) => match crate::health::bind(addr).await {
            Ok(l) => {
                // With port 0 the kernel picks; say which, so a probe (or
                // a test) can find it.
                match l.local_addr() {
                    Ok(bound) => tracing::info!(addr = %bound, "health probes listening"),
                    Err(e) => tracing::warn!(error = %e, "health listener has no address"),
                }
                Some(l)
            }
            Err(e) => {
                eprintln!("otter-agent: cannot listen on {addr} for health probes: {e}");
                return 64;
            }
        },
        None => None,
    };
    match start(cli).await {
        Ok(agent) => {
            if let Some(listener) = health {
                agent.serve_health(listener);
            }
            wait_for_signal().await;
            agent.shutdown().await;
            0
        }
        Err(e) => {
            eprintln!("otter-agent: {e}");
            64
        }
    }
}

/// The agent's settings from its flags (all but what needs the cluster).
fn agent_config(cli: &Cli) -> anyhow::Result<AgentConfig> {
    let ca = std::fs::read_to_string(&cli.hub_ca_file)
        .map_err(|e| anyhow::anyhow!("cannot read hub CA {}: {e}", cli.hub_ca_file.display()))?;
    // Pin the hub: the CA handed over with the manifest must be the one the
    // manifest's fingerprint names.
    if let Some(expected) = cli.hub_ca_fingerprint.as_deref().filter(|f| !f.is_empty()) {
        let actual = otter_pki::ca::fingerprint_pem(&ca)?;
        if !actual.eq_ignore_ascii_case(expected.trim()) {
            anyhow::bail!(
                "hub CA {} has fingerprint {actual}, not the pinned {expected}",
                cli.hub_ca_file.display()
            );
        }
    }
    let agent_id = cli
        .agent_id
        .clone()
        .or_else(|| std::env::var("POD_NAME").ok())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "agent".into());
    let mut hub_urls = cli.hub_urls.iter().cloned();
    let first = hub_urls
        .next()
        .ok_or_else(|| anyhow::anyhow!("--hub-url is required"))?;
    let mut config = AgentConfig::new(first, &cli.cluster, &agent_id, &ca);
    config.more_hub_urls = hub_urls.collect();
    if let Some(path) = &cli.join_token_file {
        let token = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read join token {}: {e}", path.display()))?;
        config.join_token = Secret(token.trim().to_owned());
    }
    config.api_trust = crate::config::ApiTrust {
        ca_pem: match &cli.hub_api_ca_file {
            Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
                anyhow::anyhow!("cannot read the hub API's CA {}: {e}", path.display())
            })?),
            None => None,
        },
        public_roots: cli.hub_api_public_roots,
    };
    config.state = cli
        .state_dir
        .clone()
        .map(crate::identity::IdentityStore::Dir);
    config.rancher_project_id = cli.rancher_project_id.clone();
    config.transports = cli.transports.clone();
    config.proxy = match cli.proxy.clone() {
        Some(url) => {
            let no_proxy = std::env::var("NO_PROXY")
                .or_else(|_| std::env::var("no_proxy"))
                .unwrap_or_default();
            Some(otter_tunnel::proxy::Proxy::new(url, &no_proxy)?)
        }
        None => otter_tunnel::proxy::Proxy::from_env().transpose()?,
    };
    if let Some(proxy) = config.proxy.take() {
        config.proxy = Some(match proxy.is_https() {
            true => {
                let ca = match &cli.proxy_ca_file {
                    Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
                        anyhow::anyhow!("cannot read proxy CA {}: {e}", path.display())
                    })?),
                    None => None,
                };
                let tls = otter_pki::tls::public_client_config(ca.as_deref(), &[])?;
                proxy.with_tls(std::sync::Arc::new(tls))
            }
            false => proxy,
        });
    }
    config.keepalive =
        otter_tunnel::Keepalive::every(std::time::Duration::from_secs(cli.keepalive_secs.max(1)));
    config.transport_retry = std::time::Duration::from_secs(cli.transport_retry_secs);
    config.max_loss = cli.max_loss_percent / 100.0;
    config.renew_at = cli.renew_at;
    config.validate()?;
    Ok(config)
}

async fn start(cli: Cli) -> anyhow::Result<Agent> {
    let mut config = agent_config(&cli)?;
    if cli.state_secret.is_none() {
        nothing_to_join_with(&config).await?;
    }
    otter_pki::tls::install_default_provider();
    let access = kube_access(&cli).await?;
    if let Some(name) = &cli.state_secret {
        config.state = Some(crate::identity::IdentityStore::secret(
            access.agent().clone(),
            &cli.state_namespace,
            name,
        ));
        nothing_to_join_with(&config).await?;
    }
    let mut services = crate::ServicesConfig::default();
    services.runtime.sessions = crate::sessions::Limits {
        max_exec: cli.max_exec_sessions,
        max_port_forward: cli.max_port_forward_sessions,
        idle: std::time::Duration::from_secs(cli.session_idle_secs.max(1)),
    };
    services.runtime.gauges = config.gauges.clone();
    // kubectl's requests through the hub use the agent's own client; the
    // proxy adds the caller's impersonation headers itself.
    let proxy = crate::kube_proxy::KubeProxy::for_access(&access);
    let routes = crate::services(access, &config.cluster, services);
    Ok(Agent::start_with_proxy(config, routes, Some(proxy))?)
}

/// The agent's access to its cluster: the kubeconfig's or the pod's
/// ServiceAccount, impersonating within the ceiling.
async fn kube_access(cli: &Cli) -> anyhow::Result<crate::kube::KubeAccess> {
    // A KUBECONFIG that names several files is left to kube's own loader.
    let single_file = cli
        .kubeconfig
        .clone()
        .filter(|p| !p.as_os_str().is_empty() && !p.to_string_lossy().contains(':'));
    let kube_config = crate::kube::load_config(single_file.as_deref()).await?;
    let ceiling = crate::impersonation::Ceiling::new(
        cli.allow_user_prefixes.clone(),
        cli.allow_group_prefixes.clone(),
    )?;
    Ok(crate::kube::KubeAccess::new(kube_config)?.with_ceiling(ceiling))
}

async fn doctor(cli: Cli) -> i32 {
    otter_pki::tls::install_default_provider();
    let mut config = match agent_config(&cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("otter-agent doctor: {e}");
            return 64;
        }
    };
    // The identity kept in a Secret needs the cluster: read it when the
    // cluster answers, else the doctor goes on without it.
    if let Some(name) = &cli.state_secret {
        match kube_access(&cli).await {
            Ok(access) => {
                config.state = Some(crate::identity::IdentityStore::secret(
                    access.agent().clone(),
                    &cli.state_namespace,
                    name,
                ));
            }
            Err(e) => eprintln!("otter-agent doctor: the kept identity cannot be read: {e}"),
        }
    }
    let checks = crate::doctor::run(&config).await;
    print!("{}", crate::doctor::render(&checks));
    match checks
        .iter()
        .any(|c| c.verdict == crate::doctor::Verdict::Fail)
    {
        true => 1,
        false => 0,
    }
}

/// Fails the start when waiting would change nothing: no join token and no
/// identity kept from an earlier join (a pod then shows CrashLoopBackOff
/// with this message, where a loop would look healthy). A store that
/// cannot be read now is not that: the agent starts and retries.
async fn nothing_to_join_with(config: &AgentConfig) -> anyhow::Result<()> {
    if !config.join_token.0.is_empty() {
        return Ok(());
    }
    let (kept, place) = match &config.state {
        None => (Some(false), "no --state-dir or --state-secret".to_owned()),
        Some(store) => {
            let identity = store.load(config.clock.now()).await;
            let token = store.join_token().await;
            let kept = match (identity, token) {
                (Ok(identity), Ok(token)) => Some(identity.is_some() || token.is_some()),
                _ => None,
            };
            (kept, format!("nothing usable in the {store:?}"))
        }
    };
    if kept == Some(false) {
        anyhow::bail!(
            "no join token and no identity from an earlier join ({place}): apply a fresh \
             manifest (`otter agent-manifest --cluster {}`), or give a token with \
             --join-token-file",
            config.cluster
        );
    }
    Ok(())
}

async fn wait_for_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}
