//! The `otter` command line. `main.rs` only parses and calls [`run`].

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand};
use url::Url;

use crate::{Hub, HubConfig};

/// OtterScale Link: reach many Kubernetes clusters from one hub.
#[derive(Debug, Parser)]
#[command(name = "otter", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the hub: LinkService, agent tunnels, and call forwarding.
    ///
    /// Example: otter hub --data-dir /var/lib/otter --external-url https://hub.example.com:8443
    Hub(HubArgs),
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
    /// Concurrent calls one tunnel carries; more get ResourceExhausted.
    #[arg(long, default_value_t = 512)]
    pub max_calls_per_tunnel: u32,
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
    /// Extra CA (PEM file) to trust for the issuer.
    #[arg(long)]
    pub oidc_ca_file: Option<PathBuf>,
    /// Kubeconfig of the Rancher management cluster (its current context);
    /// ListRancherProjects lists the `management.cattle.io/v3` projects there.
    #[arg(long, env = "OTTER_RANCHER_KUBECONFIG")]
    pub rancher_kubeconfig: Option<PathBuf>,
}

impl HubArgs {
    pub fn into_config(self) -> Result<HubConfig, String> {
        let mut c = HubConfig::new(self.data_dir);
        c.api_listen = self.listen;
        c.tunnel_listen = self.tunnel_listen;
        c.external_url = self.external_url;
        c.tunnel_urls = self.tunnel_urls;
        c.agent_cert_lifetime = Duration::from_secs(self.agent_cert_lifetime_secs);
        c.join_token_ttl = Duration::from_secs(self.join_token_ttl_secs);
        c.keepalive =
            otter_tunnel::Keepalive::every(Duration::from_secs(self.keepalive_secs.max(1)));
        c.max_calls_per_tunnel = self.max_calls_per_tunnel;
        c.cors_origins = self.cors_origins;
        c.disabled_features = self.disabled_features;
        c.api_plaintext = self.api_plaintext;
        c.admin_group = self.admin_group;
        c.rancher_kubeconfig = self.rancher_kubeconfig;
        if let (Some(issuer), Some(audience)) = (self.oidc_issuer, self.oidc_audience) {
            let mut oidc = crate::oidc::OidcConfig::new(issuer, &audience);
            oidc.user_claim = self.oidc_user_claim;
            oidc.groups_claim = self.oidc_groups_claim;
            if let Some(path) = self.oidc_ca_file {
                oidc.ca_pem = Some(
                    std::fs::read_to_string(&path)
                        .map_err(|e| format!("cannot read {}: {e}", path.display()))?,
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
    match cli.command {
        Command::Hub(args) => {
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
    }
}
