//! How the CLI reaches a hub: URL, token and CA from flags, `OTTER_*`
//! variables or `~/.config/otter/config.toml` (written by `otter login`,
//! mode 0600), in that order.

use std::{path::PathBuf, sync::Arc, time::Duration};

use serde::{Deserialize, Serialize};
use url::Url;

/// The stored CLI configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub hub: Option<String>,
    pub token: Option<String>,
    /// PEM of the hub CA, when the hub's certificate is not publicly trusted.
    pub ca_pem: Option<String>,
    /// The cluster commands act on without `--cluster` (`otter config
    /// use-cluster`), as kubectl's current context.
    pub cluster: Option<String>,
}

/// Where the config file lives: `$OTTER_CONFIG`, else
/// `$XDG_CONFIG_HOME/otter/config.toml`, else `~/.config/otter/config.toml`.
pub fn config_path() -> PathBuf {
    if let Some(p) = std::env::var_os("OTTER_CONFIG") {
        return PathBuf::from(p);
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("otter").join("config.toml")
}

pub fn load_file() -> anyhow::Result<FileConfig> {
    let path = config_path();
    match std::fs::read_to_string(&path) {
        Ok(text) => toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(FileConfig::default()),
        Err(e) => Err(anyhow::anyhow!("{}: {e}", path.display())),
    }
}

pub fn save_file(cfg: &FileConfig) -> anyhow::Result<PathBuf> {
    let path = config_path();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    crate::tokens::write_private(&path, &toml::to_string(cfg)?)?;
    Ok(path)
}

/// Connection flags shared by every client command.
#[derive(Debug, Clone, clap::Args)]
pub struct HubFlags {
    /// Hub API URL (default: from `otter login`).
    #[arg(long, global = true, env = "OTTER_HUB")]
    pub hub: Option<Url>,
    /// Bearer token (default: from `otter login`).
    #[arg(long, global = true, env = "OTTER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// PEM file of the hub CA (default: from `otter login`, else public roots).
    #[arg(long, global = true, env = "OTTER_CA_FILE")]
    pub ca_file: Option<PathBuf>,
}

/// A resolved connection.
#[derive(Clone)]
pub struct Hub {
    pub url: Url,
    pub token: String,
    pub ca_pem: Option<String>,
    pub channel: tonic::transport::Channel,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("url", &self.url.as_str())
            .finish()
    }
}

impl HubFlags {
    pub async fn connect(&self) -> anyhow::Result<Hub> {
        let file = load_file()?;
        let url = match (&self.hub, &file.hub) {
            (Some(u), _) => u.clone(),
            (None, Some(u)) => Url::parse(u)?,
            (None, None) => {
                anyhow::bail!("no hub: run `otter login --hub URL --token TOKEN` or set OTTER_HUB")
            }
        };
        let token = self
            .token
            .clone()
            .or(file.token)
            .ok_or_else(|| anyhow::anyhow!("no token: run `otter login` or set OTTER_TOKEN"))?;
        let ca_pem = match &self.ca_file {
            Some(p) => Some(
                std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?,
            ),
            None => file.ca_pem,
        };
        let channel = channel(&url, ca_pem.as_deref()).await?;
        Ok(Hub {
            url,
            token,
            ca_pem,
            channel,
        })
    }
}

/// A gRPC channel over TLS trusting `ca_pem` (or the public roots).
pub async fn channel(url: &Url, ca_pem: Option<&str>) -> anyhow::Result<tonic::transport::Channel> {
    otter_pki::tls::install_default_provider();
    let host = url
        .host_str()
        .ok_or_else(|| anyhow::anyhow!("hub URL {url} has no host"))?
        .to_owned();
    let port = url.port_or_known_default().unwrap_or(443);
    let bare = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let tls = match ca_pem {
        Some(ca) => otter_pki::tls::client_config(ca, None, &[b"h2"])?,
        None => otter_pki::tls::public_client_config(None, &[b"h2"])?,
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
    let server_name = rustls::pki_types::ServerName::try_from(bare.clone())?;
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{host}:{port}"))?
        .connect_timeout(Duration::from_secs(10));
    let channel = endpoint
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let (connector, name, addr) =
                (connector.clone(), server_name.clone(), (bare.clone(), port));
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let _ = tcp.set_nodelay(true);
                let tls = connector.connect(name, tcp).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await
        .map_err(|e| {
            // The cause with its fix when it is a known one, else the chain.
            let why = otter_tunnel::reach::why_unreachable(
                &e,
                &host,
                port,
                otter_tunnel::reach::CaHint(
                    "--ca-file, or `otter login --ca-file`: the hub's ca.crt",
                ),
            )
            .unwrap_or_else(|| otter_tunnel::error_chain(&e));
            anyhow::anyhow!("cannot reach the hub at {url}: {why}")
        })?;
    Ok(channel)
}

impl Hub {
    /// A request carrying the token.
    pub fn req<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Ok(v) = format!("Bearer {}", self.token).parse() {
            r.metadata_mut().insert("authorization", v);
        }
        r
    }
}
