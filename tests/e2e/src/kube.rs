//! An agent with the real Kubernetes services, against the Kubernetes API
//! test server (kube-sim), behind a real hub and tunnel. Each test gets its
//! own hub, test server and agent.

use futures::StreamExt;
use std::time::Duration;

use kube_sim::{ADMIN_TOKEN, KubeSim, SimConfig};
use otter_agent::{Agent, AgentConfig, ServicesConfig, config::Secret};
use otter_proto::{
    resource::v1::{ListRequest, WatchRequest, resource_service_client::ResourceServiceClient},
    runtime::v1::{
        PortForwardRequest, PortForwardResponse, runtime_service_client::RuntimeServiceClient,
    },
};
use otter_tunnel::TransportKind;
use tonic::transport::Channel;

use crate::{
    TestHub,
    double::{WAIT, wait_connected},
};

/// The group of the hub's admin token; tests let it do everything.
pub const HUB_ADMINS: &str = "otter:default:admins";

/// A real agent (its kube-rs services and Kubernetes API proxy, the
/// ceiling a manifest of tenant `default` sets) for `cluster`, joined to
/// `hub` with `token` and serving the test server `sim`; returns once its
/// tunnel is up.
pub async fn kube_agent(
    hub: &TestHub,
    sim: &KubeSim,
    cluster: &str,
    token: &str,
    transport: TransportKind,
    tweak: impl FnOnce(&mut ServicesConfig),
) -> Agent {
    // The agent's own identity may impersonate (the test server's admin).
    let kubeconfig = sim.kubeconfig_yaml(ADMIN_TOKEN);
    kube_agent_with(hub, &kubeconfig, cluster, token, &[transport], tweak).await
}

/// Like [`kube_agent`], reaching its Kubernetes API with `kubeconfig`
/// (the test server through a relay, say).
pub async fn kube_agent_with(
    hub: &TestHub,
    kubeconfig: &str,
    cluster: &str,
    token: &str,
    transports: &[TransportKind],
    tweak: impl FnOnce(&mut ServicesConfig),
) -> Agent {
    // Through a kubeconfig file, as with --kubeconfig.
    let yaml = kubeconfig;
    let kubeconfig = hub.dir.path().join(format!("{cluster}-kubeconfig.yaml"));
    std::fs::write(&kubeconfig, yaml).expect("write kubeconfig");
    let kube_config = otter_agent::kube::load_config(Some(&kubeconfig))
        .await
        .expect("kubeconfig loads");
    let ceiling = otter_agent::impersonation::Ceiling::new(
        vec!["otter:".into(), "oidc:".into()],
        vec!["otter:default:".into()],
    )
    .expect("ceiling");
    let access = otter_agent::kube::KubeAccess::new(kube_config)
        .expect("kube client")
        .with_ceiling(ceiling);
    let mut config = AgentConfig::new(hub.api_url(), cluster, "agent-0", hub.hub.ca_pem());
    let mut services = ServicesConfig::default();
    // One place counts the agent's streams and its sessions.
    services.runtime.gauges = config.gauges.clone();
    tweak(&mut services);
    let proxy = otter_agent::kube_proxy::KubeProxy::for_access(&access);
    let routes = otter_agent::services(access, cluster, services);
    config.join_token = Secret(token.to_owned());
    config.transports = transports.to_vec();
    config.keepalive = otter_tunnel::Keepalive::every(Duration::from_secs(1));
    config.backoff_base = Duration::from_millis(100);
    config.backoff_cap = Duration::from_millis(800);
    let agent = Agent::start_with_proxy(config, routes, Some(proxy)).expect("agent starts");
    agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("agent connects");
    agent
}

/// Hub, test server and agent for one test.
#[derive(Debug)]
pub struct KubeEnv {
    pub hub: TestHub,
    pub sim: KubeSim,
    pub agent: Agent,
    pub channel: Channel,
    pub cluster: String,
}

/// The test server's rules for every test: the hub admin may do anything.
pub fn sim_config() -> SimConfig {
    otter_pki::tls::install_default_provider();
    SimConfig::default_with_admin()
        .allow(&format!("group:{HUB_ADMINS}"), &["*"], &["*"], &["*"])
        .bookmark_interval(Duration::from_millis(200))
}

/// A ConfigMap named `name` in namespace `default`.
pub fn configmap(name: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "default"},
        "data": {"k": "v"},
    })
}

impl KubeEnv {
    /// Everything as [`KubeEnv::start_with_hub`] starts it, with the
    /// agent's tunnel through a relay the test can freeze (a dead path).
    pub async fn behind_relay(
        transport: TransportKind,
        sim: SimConfig,
        hub_tweak: impl FnOnce(&mut otter_hub::HubConfig),
    ) -> (crate::Relay, KubeEnv) {
        let relay = crate::Relay::start().await;
        let port = relay.addr.port();
        let env = Self::start_with_hub(
            transport,
            sim,
            |c| {
                c.tunnel_urls =
                    vec![url::Url::parse(&format!("{transport}://localhost:{port}")).expect("URL")];
                hub_tweak(c);
            },
            |hub| relay.set_target(hub.hub.tunnel_addr),
            |_| {},
        )
        .await;
        (relay, env)
    }

    /// Freezes `relay` (a dead path), runs `meanwhile` against the test
    /// server, and waits until the agent calls its tunnel dead; the relay
    /// stays frozen (the test lets it go).
    pub async fn cut(&self, relay: &crate::Relay, meanwhile: impl FnOnce(&KubeSim)) {
        relay.freeze(true);
        meanwhile(&self.sim);
        self.agent
            .wait_for(Duration::from_secs(20), |s| s.connected.is_none())
            .await
            .expect("the agent calls the frozen tunnel dead");
    }

    /// A List of the ConfigMaps in `default`.
    pub fn list_configmaps(&self) -> ListRequest {
        ListRequest {
            cluster: Some(self.cluster.clone()),
            version: Some("v1".into()),
            resource: Some("configmaps".into()),
            namespace: Some("default".into()),
            ..Default::default()
        }
    }

    /// A Watch of the ConfigMaps in `default`, from `rv`.
    pub fn watch_configmaps(&self, rv: Option<String>) -> WatchRequest {
        WatchRequest {
            cluster: Some(self.cluster.clone()),
            version: Some("v1".into()),
            resource: Some("configmaps".into()),
            namespace: Some("default".into()),
            resource_version: rv,
            ..Default::default()
        }
    }

    /// Starts everything with default service settings.
    pub async fn start(sim: SimConfig) -> KubeEnv {
        Self::start_with(sim, |_| {}).await
    }

    /// Starts everything; `tweak` changes the agent's service settings.
    pub async fn start_with(sim: SimConfig, tweak: impl FnOnce(&mut ServicesConfig)) -> KubeEnv {
        Self::start_over(TransportKind::H2, sim, tweak).await
    }

    /// Like [`KubeEnv::start_with`], with the agent's tunnel over `transport`.
    pub async fn start_over(
        transport: TransportKind,
        sim: SimConfig,
        tweak: impl FnOnce(&mut ServicesConfig),
    ) -> KubeEnv {
        Self::start_full(transport, sim, |_| {}, tweak).await
    }

    /// Like [`KubeEnv::start_over`], with a chance to change the hub's
    /// config too (say, tunnel URLs pointing at a [`crate::Relay`], whose
    /// target is set by `hub_tweak`'s caller once the hub runs).
    pub async fn start_full(
        transport: TransportKind,
        sim: SimConfig,
        hub_tweak: impl FnOnce(&mut otter_hub::HubConfig),
        tweak: impl FnOnce(&mut ServicesConfig),
    ) -> KubeEnv {
        Self::start_with_hub(transport, sim, hub_tweak, |_| {}, tweak).await
    }

    /// The most general start: `hub_tweak` changes the hub's config,
    /// `started` runs once the hub listens (before the agent dials), and
    /// `tweak` changes the agent's service settings.
    pub async fn start_with_hub(
        transport: TransportKind,
        sim: SimConfig,
        hub_tweak: impl FnOnce(&mut otter_hub::HubConfig),
        started: impl FnOnce(&TestHub),
        tweak: impl FnOnce(&mut ServicesConfig),
    ) -> KubeEnv {
        otter_pki::tls::install_default_provider();
        let sim = KubeSim::start(sim).await.expect("kube-sim starts");
        let dir = std::sync::Arc::new(tempfile::tempdir().expect("temp dir"));
        let hub = TestHub::start_with(dir, None, hub_tweak).await;
        started(&hub);
        let cluster = "edge-1".to_owned();
        let token = hub.hub.mint_join_token(&cluster).expect("join token");
        let agent = kube_agent(&hub, &sim, &cluster, &token, transport, tweak).await;
        let channel = hub.channel().await;
        wait_connected(&channel, &hub.admin_token, 1).await;
        KubeEnv {
            hub,
            sim,
            agent,
            channel,
            cluster,
        }
    }

    /// A hub API token for `user` in `groups`.
    pub fn token_for(&self, user: &str, groups: &[&str]) -> String {
        let groups: Vec<String> = groups.iter().map(|g| (*g).to_owned()).collect();
        self.hub
            .hub
            .mint_api_token(user, &groups)
            .expect("mint token")
    }

    pub fn admin_token(&self) -> &str {
        &self.hub.admin_token
    }

    pub fn resources(&self) -> ResourceServiceClient<Channel> {
        ResourceServiceClient::new(self.channel.clone())
    }

    pub fn runtime(&self) -> RuntimeServiceClient<Channel> {
        RuntimeServiceClient::new(self.channel.clone())
            .max_decoding_message_size(8 * 1024 * 1024)
            .max_encoding_message_size(8 * 1024 * 1024)
    }

    /// Opens a PortForward to `port` of pod `name` in `default` as the
    /// holder of `token`: the stream and the session id its first message
    /// carries (alone).
    pub async fn port_forward(
        &self,
        runtime: &mut RuntimeServiceClient<Channel>,
        token: &str,
        name: &str,
        port: i32,
    ) -> (tonic::Streaming<PortForwardResponse>, String) {
        let request = PortForwardRequest {
            cluster: Some(self.cluster.clone()),
            namespace: Some("default".into()),
            name: Some(name.into()),
            port: Some(port),
        };
        let mut stream = within(
            "port-forward",
            runtime.port_forward(crate::with_token(request, token)),
        )
        .await
        .expect("port-forward opens")
        .into_inner();
        let first = within("session id", stream.next())
            .await
            .expect("a first message")
            .expect("a first message");
        assert!(first.data.is_none(), "{first:?}");
        (stream, first.session_id.expect("session id first"))
    }

    /// Stops the agent, the hub and the test server.
    pub async fn shutdown(self) {
        self.agent.shutdown().await;
        self.hub.hub.shutdown().await;
        self.sim.shutdown().await;
    }
}

/// Bounds a step of a test.
pub async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}
