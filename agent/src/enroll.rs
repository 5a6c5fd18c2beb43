//! Register with the hub: a fresh key and CSR each time, authenticated by the
//! join token on first contact and by the current certificate on renewal.

use std::{sync::Arc, time::Duration};

use otter_pki::tls;
use otter_proto::link::v1::{
    RegisterRequest, RegisterResponse, link_service_client::LinkServiceClient,
};
use otter_tunnel::error_chain;
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
    /// When the hub issued the certificate, by the hub's clock (Unix
    /// seconds), read from the certificate itself.
    pub issued_at: i64,
    /// End of validity, by the hub's clock.
    pub not_after: i64,
    /// How far the hub's clock is ahead of this agent's (seconds; negative
    /// when behind), as seen when the certificate arrived; zero for
    /// credentials kept by an earlier run until the next Register.
    pub skew: i64,
    /// When this agent received them, by its own clock.
    pub received: i64,
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

/// Renewals are never closer together than this (or a tenth of the
/// certificate's life, when shorter), whatever the clocks say.
pub const MIN_RENEW_INTERVAL: i64 = 30;

impl Credentials {
    /// When to renew, by this agent's clock: `fraction` of the way through
    /// the certificate's life as the hub counts it, so an agent whose clock
    /// is off renews on time rather than at once and again (a clock 90 s
    /// ahead with 60 s certificates made thousands of renewals a minute);
    /// and never sooner than the floor after the last one.
    pub fn renew_at(&self, fraction: f64) -> i64 {
        let life = self.not_after - self.issued_at;
        let due = self.issued_at + (life as f64 * fraction) as i64 - self.skew;
        due.max(self.received + MIN_RENEW_INTERVAL.min(life / 10).max(1))
    }

    /// The hub's issue time of a certificate: its start of validity plus
    /// the backdating the hub applies.
    fn hub_issue_time(peer: &otter_pki::identity::PeerCertificate) -> i64 {
        peer.not_before + otter_pki::ca::CLOCK_SKEW.as_secs() as i64
    }
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
    let named = bare_host.clone();
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
                let io = dial_tcp(&host, port, proxy.as_ref()).await?;
                let tls = connector
                    .connect(server_name, io)
                    .await
                    .map_err(name_clock_skew)?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await
        .map_err(|e| {
            // Through a proxy the proxy's own answer says more (in the chain).
            let why = match via.is_empty() {
                true => otter_tunnel::reach::why_unreachable(
                    &e,
                    &named,
                    port,
                    otter_tunnel::reach::CaHint("the manifest's hub CA, --hub-ca-file"),
                ),
                false => None,
            };
            AgentError::Connect(format!(
                "{url}{via}: {}",
                why.unwrap_or_else(|| error_chain(&e))
            ))
        })
}

/// A TCP connection to `host:port`, through `proxy` unless its `NO_PROXY`
/// rules exempt the host: the way out every connection to the hub takes.
pub async fn dial_tcp(
    host: &str,
    port: u16,
    proxy: Option<&otter_tunnel::proxy::Proxy>,
) -> std::io::Result<Box<dyn otter_tunnel::h2::Io>> {
    match proxy.filter(|p| !p.bypass(host, port)) {
        Some(p) => p.connect(host, port).await.map_err(std::io::Error::other),
        None => {
            let tcp = TcpStream::connect((host, port)).await?;
            let _ = tcp.set_nodelay(true);
            Ok(Box::new(tcp))
        }
    }
}

/// A TLS failure because the hub's certificate is not valid yet or no
/// longer valid by this agent's clock says so in plain words: the clock is
/// the likely culprit, and "transport error" does not name it.
fn name_clock_skew(e: std::io::Error) -> std::io::Error {
    use rustls::CertificateError::{ExpiredContext, NotValidYetContext};
    let Some(rustls::Error::InvalidCertificate(cert)) = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    else {
        return e;
    };
    let text = match cert {
        NotValidYetContext { time, not_before } => format!(
            "this agent's clock is at least {} behind the hub's: the hub's certificate is valid from {} (Unix) and this clock reads {}; set the time (NTP)",
            human_secs(not_before.as_secs().saturating_sub(time.as_secs())),
            not_before.as_secs(),
            time.as_secs()
        ),
        ExpiredContext { time, not_after } => format!(
            "the hub's certificate expired {} ago by this agent's clock ({} Unix); if the hub's clock is right, this agent's is ahead: set the time (NTP)",
            human_secs(time.as_secs().saturating_sub(not_after.as_secs())),
            time.as_secs()
        ),
        _ => return e,
    };
    std::io::Error::new(e.kind(), text)
}

/// Seconds as a person says them: `45s`, `10m`, `3h`.
fn human_secs(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s => format!("{}h", s / 3600),
    }
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

/// Bound of a renewal's try on the tunnel port, so the API port still
/// gets its turn within the renewal's own bound.
const TUNNEL_PORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Which port a Register went to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The hub's API port (every enrollment; a renewal the tunnel port
    /// could not take).
    Api,
    /// The hub's tunnel port ([`otter_tunnel::h2::LINK_ALPN`]).
    TunnelPort,
}

/// Registers (or, with `current`, renews) and returns the new credentials
/// and the port that answered.
///
/// A renewal goes to the tunnel port first: the agent got through there
/// before, and behind a proxy or firewall that lets out only the tunnel
/// port it is the one way, whereas the API port was needed only once, to
/// enroll. When the tunnel port cannot take it (an older hub, a full hub,
/// no TCP tunnel URL) it goes to the API port as before.
pub async fn register(
    config: &AgentConfig,
    current: Option<&Credentials>,
) -> Result<(Credentials, Via)> {
    let (key_pem, csr_pem) = otter_pki::csr::generate(&config.cluster, &config.agent_id)?;
    let request = RegisterRequest {
        cluster: Some(config.cluster.clone()),
        csr: Some(csr_pem.into_bytes()),
        agent_id: Some(config.agent_id.clone()),
        agent_version: Some(config.agent_version.clone()),
        rancher_project_id: Some(config.rancher_project_id.clone()),
        join_token: current.is_none().then(|| config.join_token.0.clone()),
    };
    let on_tunnel_port = match current {
        Some(c) => match tokio::time::timeout(
            TUNNEL_PORT_TIMEOUT,
            call_tunnel_port(config, c, request.clone()),
        )
        .await
        .unwrap_or_else(|_| {
            Err(AgentError::Connect(format!(
                "no answer on the tunnel port within {} s",
                TUNNEL_PORT_TIMEOUT.as_secs()
            )))
        }) {
            Ok(resp) => Some(resp),
            // A busy hub said when to come back: that holds for either port.
            Err(e) if e.retry_after().is_some() => return Err(e),
            Err(e) => {
                tracing::info!(error = %e, "renewal on the tunnel port failed; trying the API port");
                None
            }
        },
        None => None,
    };
    let (resp, via) = match on_tunnel_port {
        Some(resp) => (resp, Via::TunnelPort),
        None => (call_api(config, current, request).await?, Via::Api),
    };
    let creds = credentials_from(config, key_pem, resp)?;
    // A failure to keep them is logged, not returned: the hub has spent
    // the join token by now, so these credentials are the agent's only
    // way back; it serves with them and keeps them at the next renewal.
    if let Some(store) = &config.state
        && let Err(e) = store.save(&creds).await
    {
        tracing::error!(error = %e, "could not keep the agent's identity; it is lost if the agent restarts before the next renewal");
    }
    Ok((creds, via))
}

/// Register on the API port: the first replica that answers, or the
/// error of the last when none does.
async fn call_api(
    config: &AgentConfig,
    current: Option<&Credentials>,
    request: RegisterRequest,
) -> Result<RegisterResponse> {
    let client_cert = current.map(|c| (c.cert_pem.as_str(), c.key_pem.as_str()));
    let tls = tls::api_client_config(
        hub_trust(config, current),
        config.api_trust.ca_pem.as_deref(),
        config.api_trust.public_roots,
        client_cert,
        &[b"h2"],
    )?;
    call_first(config.hub_urls(), tls, config, request).await
}

/// Register on the tunnel port, over the TCP tunnel URLs the hub gave
/// (HTTP/2, WebSocket: one port), verified as the tunnel is (the hub CA
/// only) and with the certificate being renewed.
async fn call_tunnel_port(
    config: &AgentConfig,
    current: &Credentials,
    request: RegisterRequest,
) -> Result<RegisterResponse> {
    let urls = tunnel_port_urls(&current.tunnel_urls);
    if urls.is_empty() {
        return Err(AgentError::Config(
            "the hub gave no TCP tunnel URL to renew on".into(),
        ));
    }
    let tls = tls::client_config(
        hub_trust(config, Some(current)),
        Some((current.cert_pem.as_str(), current.key_pem.as_str())),
        &[otter_tunnel::h2::LINK_ALPN],
    )?;
    call_first(urls.iter(), tls, config, request).await
}

/// The distinct `https://host:port` of the tunnel URLs the hub gave:
/// those of HTTP/2 and WebSocket first (one TCP port), then QUIC's (the
/// hub serves every transport on its one tunnel port number).
fn tunnel_port_urls(tunnel_urls: &[Url]) -> Vec<Url> {
    let mut out: Vec<Url> = Vec::new();
    let tcp_first = tunnel_urls
        .iter()
        .filter(|u| matches!(u.scheme(), "h2" | "wss"))
        .chain(tunnel_urls.iter().filter(|u| u.scheme() == "quic"));
    for url in tcp_first {
        let Some(host) = url.host_str() else { continue };
        let port = url
            .port_or_known_default()
            .unwrap_or(crate::tunnel::DEFAULT_TUNNEL_PORT);
        if let Ok(https) = Url::parse(&format!("https://{host}:{port}"))
            && !out.contains(&https)
        {
            out.push(https);
        }
    }
    out
}

/// Calls Register on the first of `urls` that answers.
async fn call_first<'a>(
    urls: impl Iterator<Item = &'a Url>,
    tls: rustls::ClientConfig,
    config: &AgentConfig,
    request: RegisterRequest,
) -> Result<RegisterResponse> {
    let mut failed = None;
    for url in urls {
        match channel(url, tls.clone(), config.proxy.as_ref()).await {
            Ok(ch) => {
                let mut client = LinkServiceClient::new(ch);
                return Ok(client.register(request).await?.into_inner());
            }
            Err(e) => failed = Some(e),
        }
    }
    Err(failed.unwrap_or_else(|| AgentError::Config("no hub URL".into())))
}

/// The credentials a Register answer carries, with the key made for it.
fn credentials_from(
    config: &AgentConfig,
    key_pem: String,
    resp: RegisterResponse,
) -> Result<Credentials> {
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
    Ok(Credentials {
        key_pem,
        cert_pem,
        ca_pem: String::from_utf8(resp.ca_certificate.unwrap_or_default()).unwrap_or_default(),
        issued_at: Credentials::hub_issue_time(&peer),
        skew: Credentials::hub_issue_time(&peer) - config.clock.now(),
        received: config.clock.now(),
        serial: peer.serial,
        agent_id: peer.identity.agent_id,
        not_after: peer.not_after,
        tunnel_urls,
    })
}

impl Credentials {
    /// Credentials kept by an earlier run, if complete and unexpired (by
    /// this clock, `now`).
    pub fn from_kept(
        key_pem: &str,
        cert_pem: &str,
        ca_pem: &str,
        urls: &str,
        now: i64,
    ) -> Option<Self> {
        let der = otter_pki::tls::parse_certs(cert_pem)
            .ok()?
            .into_iter()
            .next()?;
        let peer = otter_pki::identity::PeerCertificate::from_der(der.as_ref()).ok()?;
        if peer.not_after <= now {
            return None;
        }
        Some(Credentials {
            key_pem: key_pem.to_owned(),
            cert_pem: cert_pem.to_owned(),
            ca_pem: ca_pem.to_owned(),
            issued_at: Credentials::hub_issue_time(&peer),
            // Unknown until the next Register: a clock far off renews early
            // once, and learns it then.
            skew: 0,
            received: now,
            serial: peer.serial,
            agent_id: peer.identity.agent_id,
            not_after: peer.not_after,
            tunnel_urls: urls.lines().filter_map(|l| Url::parse(l).ok()).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewals_go_to_each_tcp_tunnel_port_once() {
        let urls: Vec<Url> = [
            "quic://hub.example:8444",
            "h2://hub.example:8444",
            "wss://hub.example:8444",
            "wss://edge.example",
            "h2://[::1]:9000",
            "quic://other.example:7000",
            "h2://bare.example",
        ]
        .iter()
        .map(|u| Url::parse(u).unwrap())
        .collect();
        let got: Vec<String> = tunnel_port_urls(&urls)
            .iter()
            .map(|u| u.to_string())
            .collect();
        assert_eq!(
            got,
            [
                "https://hub.example:8444/",
                "https://edge.example/",
                "https://[::1]:9000/",
                "https://bare.example:8444/",
                "https://other.example:7000/"
            ]
        );
    }

    fn creds(issued_at: i64, life: i64, skew: i64, received: i64) -> Credentials {
        Credentials {
            key_pem: String::new(),
            cert_pem: String::new(),
            ca_pem: String::new(),
            serial: String::new(),
            agent_id: "a".into(),
            issued_at,
            not_after: issued_at + life,
            skew,
            received,
            tunnel_urls: Vec::new(),
        }
    }

    #[test]
    fn renewals_follow_the_hubs_clock_and_keep_a_floor() {
        let hub = 1_000_000;
        // The agent's clock 90 s ahead, 60 s certificates: due two thirds
        // through by the hub's clock, i.e. 40 s after issue, whatever the
        // agent's clock reads (it used to be "now", and again at once).
        let ahead = creds(hub, 60, -90, hub + 90);
        assert_eq!(ahead.renew_at(2.0 / 3.0), hub + 40 + 90);
        // 10 minutes behind: the same moment, 600 s lower on its clock.
        let behind = creds(hub, 60, 600, hub - 600);
        assert_eq!(behind.renew_at(2.0 / 3.0), hub + 40 - 600);
        // Kept credentials (skew unknown) with a clock far ahead renew
        // early once, but never sooner than the floor after arriving.
        let kept = creds(hub, 60, 0, hub + 3600);
        assert_eq!(kept.renew_at(2.0 / 3.0), hub + 3600 + 6);
        let day = creds(hub, 86_400, 0, hub);
        assert_eq!(day.renew_at(0.1), hub + 8_640);
        assert_eq!(
            creds(hub, 86_400, 0, hub).renew_at(0.0),
            hub + MIN_RENEW_INTERVAL
        );
    }

    #[test]
    fn a_hub_certificate_from_the_future_names_the_clock() {
        use rustls::pki_types::UnixTime;
        let tls = |cert| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                rustls::Error::InvalidCertificate(cert),
            )
        };
        let e = name_clock_skew(tls(rustls::CertificateError::NotValidYetContext {
            time: UnixTime::since_unix_epoch(Duration::from_secs(1_000_000)),
            not_before: UnixTime::since_unix_epoch(Duration::from_secs(1_000_000 + 600)),
        }));
        assert!(
            e.to_string()
                .contains("this agent's clock is at least 10m behind the hub's"),
            "{e}"
        );
        let other = name_clock_skew(tls(rustls::CertificateError::UnknownIssuer));
        assert!(other.to_string().contains("UnknownIssuer"), "{other}");
    }
}
