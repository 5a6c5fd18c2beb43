//! Settings of `otter-agent`.

use std::{fmt, time::Duration};

use otter_tunnel::{Keepalive, TransportKind};
use url::Url;

/// A secret that never shows in `Debug` output or logs.
#[derive(Clone, Default)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() {
            "<empty>"
        } else {
            "<redacted>"
        })
    }
}

/// The agent's clock: the system's, shifted by `offset_secs` (zero but in
/// tests, which use it to show what a wrong clock does). Renewals are
/// scheduled in the hub's time (see `enroll::Credentials`), so a wrong
/// clock moves nothing but this reading.
#[derive(Debug, Clone, Copy, Default)]
pub struct Clock {
    pub offset_secs: i64,
}

impl Clock {
    /// Unix seconds by this clock.
    pub fn now(&self) -> i64 {
        let system = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        system + self.offset_secs
    }

    /// Unix milliseconds by this clock.
    pub fn now_millis(&self) -> i64 {
        let system = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        system + self.offset_secs * 1000
    }
}

/// Everything the agent needs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The hub's API URL (Register).
    pub hub_url: Url,
    /// Other hub replicas' API URLs, tried in turn when `hub_url` does not
    /// answer (replicas without a load balancer in front).
    pub more_hub_urls: Vec<Url>,
    pub cluster: String,
    pub agent_id: String,
    pub agent_version: String,
    /// From the agent manifest; needed only until the first certificate.
    pub join_token: Secret,
    /// The hub CA (PEM): the agent trusts nothing else for the hub's
    /// tunnel port.
    pub hub_ca_pem: String,
    /// What else verifies the hub's API (Register, renewals) when it shows
    /// a certificate users' tools trust, not one from the hub CA.
    pub api_trust: ApiTrust,
    pub rancher_project_id: String,
    /// Transports in the order to try.
    pub transports: Vec<TransportKind>,
    /// Where key and certificate are kept across restarts (a directory or
    /// a Secret); none keeps them in memory only.
    pub state: Option<crate::identity::IdentityStore>,
    pub keepalive: Keepalive,
    /// Bound of one transport's dial before the next is tried.
    pub connect_timeout: Duration,
    /// HTTP CONNECT proxy for the TCP transports (QUIC is skipped through one).
    pub proxy: Option<otter_tunnel::proxy::Proxy>,
    /// First reconnect delay ceiling and the cap.
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Renew when this fraction of the certificate's life has passed.
    pub renew_at: f64,
    /// What the agent reads the time from.
    pub clock: Clock,
    /// Live counts of streams and sessions; share it with the services
    /// ([`crate::runtime::RuntimeConfig::gauges`]) so one place shows both.
    pub gauges: std::sync::Arc<crate::gauges::Gauges>,
    /// While connected over a transport ranked below the first, try the
    /// better ones this often (with jitter) and switch when one works;
    /// zero never tries.
    pub transport_retry: Duration,
    /// A tunnel that loses more than this share of its packets over a
    /// window (QUIC counts them) moves to the next transport configured,
    /// make before break, and is not tried again for a while; zero never
    /// moves.
    pub max_loss: f64,
}

impl AgentConfig {
    pub fn new(hub_url: Url, cluster: &str, agent_id: &str, hub_ca_pem: &str) -> Self {
        Self {
            hub_url,
            more_hub_urls: Vec::new(),
            cluster: cluster.to_owned(),
            agent_id: agent_id.to_owned(),
            agent_version: crate::VERSION.to_owned(),
            join_token: Secret::default(),
            hub_ca_pem: hub_ca_pem.to_owned(),
            api_trust: ApiTrust::default(),
            rancher_project_id: String::new(),
            transports: vec![TransportKind::Quic, TransportKind::H2, TransportKind::Ws],
            state: None,
            keepalive: Keepalive::default(),
            connect_timeout: Duration::from_secs(10),
            proxy: None,
            backoff_base: Duration::from_millis(500),
            backoff_cap: Duration::from_secs(30),
            renew_at: 2.0 / 3.0,
            clock: Clock::default(),
            gauges: Default::default(),
            transport_retry: Duration::from_secs(120),
            max_loss: 0.2,
        }
    }

    /// Every hub API URL, the first one first.
    pub fn hub_urls(&self) -> impl Iterator<Item = &Url> {
        std::iter::once(&self.hub_url).chain(&self.more_hub_urls)
    }

    /// Checks the settings before anything is dialled.
    pub fn validate(&self) -> crate::Result<()> {
        otter_pki::identity::AgentIdentity::new(&self.cluster, &self.agent_id)?;
        if let Some(url) = self.hub_urls().find(|u| u.scheme() != "https") {
            return Err(crate::AgentError::Config(format!(
                "hub URL {url} must be https://"
            )));
        }
        if self.transports.is_empty() {
            return Err(crate::AgentError::Config(
                "at least one transport is needed".into(),
            ));
        }
        otter_pki::tls::parse_certs(&self.hub_ca_pem)?;
        if !(0.1..=0.95).contains(&self.renew_at) {
            return Err(crate::AgentError::Config(
                "renew_at must be between 0.1 and 0.95".into(),
            ));
        }
        if !(0.0..=1.0).contains(&self.max_loss) {
            return Err(crate::AgentError::Config(
                "the loss limit must be between 0 and 100 percent".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loss_limit_outside_0_to_100_percent_is_refused() {
        let url = Url::parse("https://hub.example:8443").expect("url");
        let ca = otter_pki::CertificateAuthority::generate("test CA").expect("CA");
        let mut c = AgentConfig::new(url, "edge-1", "agent-0", ca.cert_pem());
        for bad in [f64::NAN, -0.01, 1.5] {
            c.max_loss = bad;
            let e = c.validate().expect_err("refused");
            assert!(e.to_string().contains("loss limit"), "{e}");
        }
        c.max_loss = 0.2;
        c.validate().expect("a limit of 20 % is fine");
    }
}

/// Trusted for the hub's API besides the hub CA (the manifest says which).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApiTrust {
    /// The CA (PEM) that issued the API's certificate.
    pub ca_pem: Option<String>,
    /// The public roots: the API's certificate is from a public CA.
    pub public_roots: bool,
}
