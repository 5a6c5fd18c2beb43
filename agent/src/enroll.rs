//! Register with the hub: a fresh key and CSR each time, authenticated by the
//! join token on first contact and by the current certificate on renewal.

use std::{sync::Arc, time::Duration};

use otter_pki::tls;
use otter_proto::link::v1::{RegisterRequest, link_service_client::LinkServiceClient};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use url::Url;

use crate::{AgentConfig, AgentError, Result};

/// What Register gives the agent.
#[derive(Clone)]
pub struct Credentials {
    pub key_pem: String,
    pub cert_pem: String,
    /// The CAs the hub answered with (two during a CA rotation); the hub is
    /// verified with these from then on, see [`hub_trust`].
    pub ca_pem: String,
    pub serial: String,
    /// The agent id the certificate names: an agent that finds kept
    /// credentials goes on as that agent, whatever its pod is called now.
    pub agent_id: String,
    /// Unix seconds.
    pub issued_at: i64,
    pub not_after: i64,
    pub tunnel_urls: Vec<Url>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("serial", &self.serial)
            .field("not_after", &self.not_after)
            .finish()
    }
}

impl Credentials {
    /// When to renew: `fraction` of the way through the certificate's life.
    pub fn renew_at(&self, fraction: f64) -> i64 {
        self.issued_at + ((self.not_after - self.issued_at) as f64 * fraction) as i64
    }
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// A gRPC channel to the hub's API over our own rustls config (the hub CA
/// only, and the agent certificate when renewing), through `proxy` unless
/// its `NO_PROXY` rules exempt the hub: Register and renewals take the same
/// way out as the tunnel.
async fn channel(
    url: &Url,
    tls: rustls::ClientConfig,
    proxy: Option<&otter_tunnel::proxy::Proxy>,
) -> Result<tonic::transport::Channel> {
    let host = url
        .host_str()
        .ok_or_else(|| AgentError::Config(format!("hub URL {url} has no host")))?
        .to_owned();
    let port = url.port_or_known_default().unwrap_or(443);
    let bare_host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let server_name = rustls::pki_types::ServerName::try_from(bare_host.clone())
        .map_err(|e| AgentError::Config(format!("hub host {host}: {e}")))?;
    let connector = TlsConnector::from(Arc::new(tls));
    let proxy = proxy.filter(|p| !p.bypass(&bare_host, port)).cloned();
    let via = proxy
        .as_ref()
        .map(|p| format!(" through the proxy {}", p.display()))
        .unwrap_or_default();
    // tonic only uses this URI for the request line; TLS is done below.
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{host}:{port}"))
        .map_err(|e| AgentError::Config(e.to_string()))?
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(30));
    endpoint
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let (connector, server_name, host, proxy) = (
                connector.clone(),
                server_name.clone(),
                bare_host.clone(),
                proxy.clone(),
            );
            async move {
                let io: Box<dyn otter_tunnel::h2::Io> = match &proxy {
                    Some(p) => p
                        .connect(&host, port)
                        .await
                        .map_err(std::io::Error::other)?,
                    None => {
                        let tcp = TcpStream::connect((host.as_str(), port)).await?;
                        let _ = tcp.set_nodelay(true);
                        Box::new(tcp)
                    }
                };
                let tls = connector.connect(server_name, io).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await
        .map_err(|e| AgentError::Connect(format!("{url}{via}: {}", error_chain(&e))))
}

/// An error with its causes, which name what failed (a refused
/// connection, the proxy's answer, a certificate) where tonic's own text
/// says only "transport error".
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

/// The CAs the hub is verified with: the bundle it last sent over a
/// connection verified with the previous one (so the agent follows a CA
/// rotation), else the configured CA.
pub fn hub_trust<'a>(config: &'a AgentConfig, creds: Option<&'a Credentials>) -> &'a str {
    creds
        .map(|c| c.ca_pem.as_str())
        .filter(|pem| tls::parse_certs(pem).is_ok_and(|certs| !certs.is_empty()))
        .unwrap_or(&config.hub_ca_pem)
}

/// Registers (or, with `current`, renews) and returns the new credentials.
pub async fn register(config: &AgentConfig, current: Option<&Credentials>) -> Result<Credentials> {
    let (key_pem, csr_pem) = otter_pki::csr::generate(&config.cluster, &config.agent_id)?;
    let client_cert = current.map(|c| (c.cert_pem.as_str(), c.key_pem.as_str()));
    let tls = tls::client_config(hub_trust(config, current), client_cert, &[b"h2"])?;
    let mut client =
        LinkServiceClient::new(channel(&config.hub_url, tls, config.proxy.as_ref()).await?);
    let request = RegisterRequest {
        cluster: Some(config.cluster.clone()),
        csr: Some(csr_pem.into_bytes()),
        agent_id: Some(config.agent_id.clone()),
        agent_version: Some(config.agent_version.clone()),
        rancher_project_id: Some(config.rancher_project_id.clone()),
        join_token: current.is_none().then(|| config.join_token.0.clone()),
    };
    let resp = client.register(request).await?.into_inner();
    let cert_pem = String::from_utf8(resp.certificate.unwrap_or_default())
        .map_err(|_| AgentError::Connect("hub sent a certificate that is not PEM".into()))?;
    let peer = otter_pki::tls::parse_certs(&cert_pem)?
        .into_iter()
        .next()
        .ok_or_else(|| AgentError::Connect("hub sent no certificate".into()))?;
    let peer = otter_pki::identity::PeerCertificate::from_der(peer.as_ref())?;
    let tunnel_urls = resp
        .tunnel_urls
        .iter()
        .chain(resp.endpoint.iter())
        .filter_map(|u| Url::parse(u).ok())
        .fold(Vec::new(), |mut v: Vec<Url>, u| {
            if !v.contains(&u) {
                v.push(u);
            }
            v
        });
    let creds = Credentials {
        key_pem,
        cert_pem,
        ca_pem: String::from_utf8(resp.ca_certificate.unwrap_or_default()).unwrap_or_default(),
        serial: peer.serial,
        agent_id: peer.identity.agent_id,
        issued_at: now(),
        not_after: peer.not_after,
        tunnel_urls,
    };
    // A failure to keep them is logged, not returned: the hub has spent
    // the join token by now, so these credentials are the agent's only
    // way back; it serves with them and keeps them at the next renewal.
    if let Some(store) = &config.state
        && let Err(e) = store.save(&creds).await
    {
        tracing::error!(error = %e, "could not keep the agent's identity; it is lost if the agent restarts before the next renewal");
    }
    Ok(creds)
}

impl Credentials {
    /// Credentials kept by an earlier run, if complete and unexpired.
    pub fn from_kept(key_pem: &str, cert_pem: &str, ca_pem: &str, urls: &str) -> Option<Self> {
        let der = otter_pki::tls::parse_certs(cert_pem)
            .ok()?
            .into_iter()
            .next()?;
        let peer = otter_pki::identity::PeerCertificate::from_der(der.as_ref()).ok()?;
        if peer.not_after <= now() {
            return None;
        }
        Some(Credentials {
            key_pem: key_pem.to_owned(),
            cert_pem: cert_pem.to_owned(),
            ca_pem: ca_pem.to_owned(),
            serial: peer.serial,
            agent_id: peer.identity.agent_id,
            // Unknown after a restart: renew as if issued now, which errs early.
            issued_at: now().min(peer.not_after - 1),
            not_after: peer.not_after,
            tunnel_urls: urls.lines().filter_map(|l| Url::parse(l).ok()).collect(),
        })
    }
}
