//! A hub and agents as real processes on loopback, against a Kubernetes
//! API test server in the test's own process: what the crash and
//! slow-consumer tests start, kill and measure.

use std::{
    net::SocketAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use futures::Future;
use otter_proto::link::v1::{
    Link, LinkState, ListLinksRequest, link_service_client::LinkServiceClient,
};
use tonic::transport::Channel;

use crate::{
    client_channel,
    double::WAIT,
    procs::{Proc, Role, free_port, http_get},
    with_token,
};

/// A hub process, its agents (one per transport) and the test server they
/// serve, all on loopback.
#[derive(Debug)]
pub struct Fleet {
    pub dir: tempfile::TempDir,
    pub data: PathBuf,
    pub api: u16,
    pub tunnel: u16,
    pub hub: Option<Proc>,
    pub hub_starts: u32,
    pub agents: Vec<AgentProc>,
    pub admin_token: String,
    /// An admin of every tenant the agents' clusters are in: sees them all.
    pub viewer_token: String,
    pub ca_pem: String,
    /// More arguments for the hub process.
    pub hub_args: Vec<String>,
    /// The keepalive interval of the hub and the agents (seconds).
    pub keepalive_secs: u64,
}

#[derive(Debug)]
pub struct AgentProc {
    pub cluster: String,
    pub transport: &'static str,
    pub health: SocketAddr,
    pub proc: Option<Proc>,
    pub starts: u32,
}

impl Fleet {
    /// Mints the join tokens with a hub in this process, then starts the
    /// hub and the agents as processes; every cluster in tenant `default`.
    pub async fn start(sim: &kube_sim::KubeSim, transports: &[&'static str]) -> Fleet {
        Self::start_with(sim, transports, &[], &[]).await
    }

    /// Like [`Fleet::start`]: agent `i`'s cluster is in `tenants[i]` (made
    /// first; `default` past the list's end), and the hub process gets
    /// `hub_args` too.
    pub async fn start_with(
        sim: &kube_sim::KubeSim,
        transports: &[&'static str],
        tenants: &[&str],
        hub_args: &[&str],
    ) -> Fleet {
        Self::start_full(sim, transports, tenants, hub_args, 1, true).await
    }

    /// Like [`Fleet::start`], with keepalives every `keepalive_secs` on
    /// the hub and the agents.
    pub async fn start_with_keepalive(
        sim: &kube_sim::KubeSim,
        transports: &[&'static str],
        keepalive_secs: u64,
    ) -> Fleet {
        Self::start_full(sim, transports, &[], &[], keepalive_secs, true).await
    }

    /// Like [`Fleet::start`], without starting the agents: their join
    /// tokens are in the fleet's directory (`token-<i>`) for agents the
    /// test runs itself.
    pub async fn start_hub_only(sim: &kube_sim::KubeSim, transports: &[&'static str]) -> Fleet {
        Self::start_full(sim, transports, &[], &[], 1, false).await
    }

    /// Like [`Fleet::start_hub_only`], the hub process getting `hub_args`
    /// too.
    pub async fn start_hub_only_with(
        sim: &kube_sim::KubeSim,
        transports: &[&'static str],
        hub_args: &[&str],
    ) -> Fleet {
        Self::start_full(sim, transports, &[], hub_args, 1, false).await
    }

    async fn start_full(
        sim: &kube_sim::KubeSim,
        transports: &[&'static str],
        tenants: &[&str],
        hub_args: &[&str],
        keepalive_secs: u64,
        agents: bool,
    ) -> Fleet {
        let tenant_of = |i: usize| tenants.get(i).copied().unwrap_or("default");
        let dir = tempfile::tempdir().expect("temp dir");
        let data = dir.path().join("hub");
        std::fs::create_dir_all(&data).expect("data dir");
        {
            let setup = std::sync::Arc::new(tempfile::TempDir::new_in(dir.path()).expect("dir"));
            let mut config = otter_hub::HubConfig::new(&data);
            config.api_listen = "127.0.0.1:0".parse().expect("address");
            config.tunnel_listen = "127.0.0.1:0".parse().expect("address");
            let hub = otter_hub::Hub::start(config).await.expect("setup hub");
            let mut viewer = otter_hub::tokens::TokenSpec {
                user: "fleet-viewer".into(),
                ..Default::default()
            };
            for (i, _) in transports.iter().enumerate() {
                let tenant = tenant_of(i);
                if tenant != "default" && !viewer.tenants.contains_key(tenant) {
                    hub.create_tenant(tenant).expect("tenant");
                }
                viewer
                    .tenants
                    .insert(tenant.to_owned(), otter_hub::tenancy::Role::Admin);
                let token = hub
                    .mint_join_token_in(&format!("edge-{i}"), tenant)
                    .expect("token");
                std::fs::write(dir.path().join(format!("token-{i}")), token).expect("token file");
            }
            let viewer = hub.mint_token(&viewer).expect("viewer token");
            std::fs::write(dir.path().join("viewer-token"), viewer).expect("token file");
            hub.shutdown().await;
            drop(setup);
        }
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN)).expect("write");
        let admin_token = std::fs::read_to_string(data.join("admin-token"))
            .expect("admin token")
            .trim()
            .to_owned();
        let ca_pem = std::fs::read_to_string(data.join("ca.crt")).expect("CA");
        let viewer_token =
            std::fs::read_to_string(dir.path().join("viewer-token")).expect("viewer token");
        let mut fleet = Fleet {
            data,
            api: free_port(),
            tunnel: free_port(),
            hub: None,
            hub_starts: 0,
            agents: transports
                .iter()
                .enumerate()
                .map(|(i, t)| AgentProc {
                    cluster: format!("edge-{i}"),
                    transport: t,
                    health: SocketAddr::from(([127, 0, 0, 1], free_port())),
                    proc: None,
                    starts: 0,
                })
                .collect(),
            admin_token,
            viewer_token,
            ca_pem,
            hub_args: hub_args.iter().map(|a| (*a).to_owned()).collect(),
            keepalive_secs,
            dir,
        };
        fleet.start_hub();
        if agents {
            for i in 0..fleet.agents.len() {
                fleet.start_agent(i);
            }
        }
        fleet
    }

    pub fn start_hub(&mut self) {
        self.hub_starts += 1;
        let args: Vec<String> = [
            "hub",
            "--data-dir",
            &self.data.display().to_string(),
            "--listen",
            &format!("127.0.0.1:{}", self.api),
            "--tunnel-listen",
            &format!("127.0.0.1:{}", self.tunnel),
            "--keepalive-secs",
            &self.keepalive_secs.to_string(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .chain(self.hub_args.iter().cloned())
        .collect();
        let name = format!("hub-{}", self.hub_starts);
        self.hub = Some(Proc::start(
            &name,
            Role::Otter,
            &args,
            self.dir.path(),
            None,
        ));
    }

    pub fn start_agent(&mut self, i: usize) {
        let d = self.dir.path();
        let keepalive = self.keepalive_secs.to_string();
        let a = &mut self.agents[i];
        a.starts += 1;
        let args: Vec<String> = [
            "--hub-url",
            &format!("https://localhost:{}", self.api),
            "--cluster",
            &a.cluster,
            "--agent-id",
            &format!("agent-{i}"),
            "--hub-ca-file",
            &self.data.join("ca.crt").display().to_string(),
            "--join-token-file",
            &d.join(format!("token-{i}")).display().to_string(),
            "--state-dir",
            &d.join(format!("state-{i}")).display().to_string(),
            "--transports",
            a.transport,
            "--keepalive-secs",
            &keepalive,
            "--health-listen",
            &a.health.to_string(),
            "--kubeconfig",
            &d.join("kubeconfig").display().to_string(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let name = format!("{}-{}", a.cluster, a.starts);
        a.proc = Some(Proc::start(&name, Role::Agent, &args, d, None));
    }

    pub fn api_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.api))
    }

    pub async fn channel(&self) -> Channel {
        // The hub process may still be binding its port.
        let deadline = Instant::now() + WAIT;
        loop {
            if tokio::net::TcpStream::connect(self.api_addr())
                .await
                .is_ok()
            {
                return client_channel(self.api_addr(), &self.ca_pem, None).await;
            }
            assert!(
                Instant::now() < deadline,
                "hub API never listened:\n{}",
                self.hub_log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn hub_log(&self) -> String {
        self.hub.as_ref().map(|h| h.tail(30)).unwrap_or_default()
    }

    pub async fn links(&self, channel: &Channel) -> Vec<Link> {
        LinkServiceClient::new(channel.clone())
            .list_links(with_token(ListLinksRequest {}, &self.viewer_token))
            .await
            .map(|r| r.into_inner().links)
            .unwrap_or_default()
    }

    /// Waits until every agent's link is connected; returns the links.
    pub async fn all_connected(&self, channel: &Channel) -> Vec<Link> {
        let deadline = Instant::now() + WAIT;
        loop {
            let links = self.links(channel).await;
            let up = links
                .iter()
                .filter(|l| l.state == Some(LinkState::Connected as i32))
                .count();
            if up == self.agents.len() {
                return links;
            }
            assert!(
                Instant::now() < deadline,
                "links never all connected: {links:?}\nhub:\n{}",
                self.hub_log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The agent's `/metrics`, read until it answers.
    pub async fn agent_metrics(&self, i: usize) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(m) = http_get(self.agents[i].health, "/metrics").await {
                return m;
            }
            assert!(Instant::now() < deadline, "agent {i} has no /metrics");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts an agent of cluster `edge-<i>` in this process, joined with
    /// its token and serving `routes` (a service of the test's own, a
    /// hostile one say) over `transport`, and waits until it is connected.
    pub async fn own_agent(
        &self,
        i: usize,
        transport: otter_tunnel::TransportKind,
        routes: tonic::service::Routes,
    ) -> otter_agent::Agent {
        let token =
            std::fs::read_to_string(self.dir.path().join(format!("token-{i}"))).expect("token");
        let mut config = otter_agent::AgentConfig::new(
            format!("https://localhost:{}", self.api)
                .parse()
                .expect("URL"),
            &format!("edge-{i}"),
            "agent-0",
            &self.ca_pem,
        );
        config.join_token = otter_agent::config::Secret(token);
        config.transports = vec![transport];
        let agent = otter_agent::Agent::start(config, routes).expect("agent starts");
        agent
            .wait_for(crate::double::WAIT, |s| s.connected.is_some())
            .await
            .expect("the agent connects");
        agent
    }

    /// The hub's `/metrics`.
    pub async fn hub_metrics(&self) -> String {
        let req = http::Request::get("/metrics")
            .header("authorization", format!("Bearer {}", self.admin_token))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .expect("request");
        let (status, _, body) = crate::http_call(self.api_addr(), &self.ca_pem, true, req).await;
        assert_eq!(status, 200);
        String::from_utf8_lossy(&body).into_owned()
    }
}

/// A sample of a text exposition. Panics, naming the series and showing
/// the scraped text, when the series is absent: absent is not zero (a
/// metric renamed or never registered must fail, not read as 0). Use
/// [`metric_if_present`] where absence is a legitimate answer.
pub fn metric(text: &str, name: &str) -> f64 {
    metric_if_present(text, name)
        .unwrap_or_else(|| panic!("no series {name} in the scraped metrics:\n{text}"))
}

/// A sample of a text exposition, `None` when the series is absent (e.g. a
/// labelled counter of a fresh hub before its first increment).
pub fn metric_if_present(text: &str, name: &str) -> Option<f64> {
    otter_agent::gauges::sample(text, name)
}

/// Waits (bounded) until `check` holds for the text `fetch` returns.
pub async fn until_metrics<F: Future<Output = String>>(
    what: &str,
    mut fetch: impl FnMut() -> F,
    check: impl Fn(&str) -> bool,
) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let text = fetch().await;
        if check(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "timed out: {what}\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
