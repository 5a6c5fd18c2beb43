//! Link core end to end, once per transport: one hub, three agents for
//! three clusters, calls routed by cluster over real TLS/QUIC on loopback.
//!
//! The agents serve a test double of ResourceService (the real Kubernetes
//! services are tested in their own suite); it answers with the cluster and
//! agent it runs in and the caller the hub verified, so each answer shows
//! where it came from and for whom.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::{Stream, StreamExt};
use otter_agent::{Agent, AgentConfig, config::Secret};
use otter_e2e::{TestHub, client_channel, with_token};
use otter_proto::{
    link::v1::{
        LinkState, ListLinksRequest, RegisterRequest, link_service_client::LinkServiceClient,
    },
    resource::v1::{
        self as res, GetRequest, Resource, WatchEvent, WatchRequest,
        resource_service_client::ResourceServiceClient,
        resource_service_server::{ResourceService, ResourceServiceServer},
    },
};
use otter_tunnel::{Caller, TransportKind};
use prost_types::{Struct, Value, value::Kind};
use tonic::{Code, Request, Response, Status};

const WAIT: Duration = Duration::from_secs(20);

/// Test double of the agent's ResourceService.
#[derive(Clone)]
struct Double {
    cluster: String,
    agent: String,
    /// Watch streams currently alive on this agent.
    live_watches: Arc<AtomicUsize>,
}

fn object(fields: &[(&str, String)]) -> Struct {
    Struct {
        fields: fields
            .iter()
            .map(|(k, v)| {
                (
                    (*k).to_owned(),
                    Value {
                        kind: Some(Kind::StringValue(v.clone())),
                    },
                )
            })
            .collect(),
    }
}

struct LiveGuard(Arc<AtomicUsize>);
impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<WatchEvent, Status>> + Send>>;

#[tonic::async_trait]
impl ResourceService for Double {
    async fn get(&self, request: Request<GetRequest>) -> Result<Response<Resource>, Status> {
        let caller = request
            .extensions()
            .get::<Caller>()
            .cloned()
            .unwrap_or_default();
        let req = request.into_inner();
        Ok(Response::new(Resource {
            object: Some(object(&[
                ("cluster", self.cluster.clone()),
                ("agent", self.agent.clone()),
                ("user", caller.user),
                ("groups", caller.groups.join(",")),
                ("name", req.name.unwrap_or_default()),
            ])),
        }))
    }

    type WatchStream = EventStream;

    async fn watch(&self, request: Request<WatchRequest>) -> Result<Response<EventStream>, Status> {
        let req = request.into_inner();
        self.live_watches.fetch_add(1, Ordering::SeqCst);
        let guard = Arc::new(LiveGuard(self.live_watches.clone()));
        let bulk = req.resource.as_deref() == Some("bulk");
        let cluster = self.cluster.clone();
        let stream = futures::stream::unfold(0u64, move |i| {
            let (guard, cluster) = (guard.clone(), cluster.clone());
            async move {
                let _keep = guard;
                if !bulk && i >= 3 {
                    // Stay open like a real watch, until the caller leaves.
                    std::future::pending::<()>().await;
                }
                let payload = if bulk {
                    "x".repeat(256 * 1024)
                } else {
                    format!("event-{i}")
                };
                let event = WatchEvent {
                    r#type: Some(res::watch_event::Type::Added as i32),
                    resource: Some(Resource {
                        object: Some(object(&[("cluster", cluster), ("payload", payload)])),
                    }),
                    resource_version: Some(i.to_string()),
                };
                Some((Ok(event), i + 1))
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn discovery(
        &self,
        _: Request<res::DiscoveryRequest>,
    ) -> Result<Response<res::DiscoveryResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn schema(
        &self,
        _: Request<res::SchemaRequest>,
    ) -> Result<Response<res::SchemaResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn list(
        &self,
        _: Request<res::ListRequest>,
    ) -> Result<Response<res::ListResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn describe(
        &self,
        _: Request<res::DescribeRequest>,
    ) -> Result<Response<res::DescribeResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn create(&self, _: Request<res::CreateRequest>) -> Result<Response<Resource>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn apply(&self, _: Request<res::ApplyRequest>) -> Result<Response<Resource>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn update(&self, _: Request<res::UpdateRequest>) -> Result<Response<Resource>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn delete(&self, _: Request<res::DeleteRequest>) -> Result<Response<()>, Status> {
        Err(Status::unimplemented("test double"))
    }
}

struct TestAgent {
    agent: Agent,
    live_watches: Arc<AtomicUsize>,
}

fn start_agent(
    hub: &TestHub,
    cluster: &str,
    agent_id: &str,
    token: &str,
    transport: TransportKind,
) -> TestAgent {
    let mut config = AgentConfig::new(hub.api_url(), cluster, agent_id, hub.hub.ca_pem());
    config.join_token = Secret(token.to_owned());
    config.transports = vec![transport];
    config.keepalive = otter_tunnel::Keepalive::every(Duration::from_secs(1));
    config.backoff_base = Duration::from_millis(100);
    config.backoff_cap = Duration::from_millis(800);
    let live_watches = Arc::new(AtomicUsize::new(0));
    let double = Double {
        cluster: cluster.into(),
        agent: agent_id.into(),
        live_watches: live_watches.clone(),
    };
    let routes = tonic::service::Routes::new(ResourceServiceServer::new(double));
    TestAgent {
        agent: Agent::start(config, routes).expect("agent starts"),
        live_watches,
    }
}

fn get(cluster: &str, name: &str) -> GetRequest {
    GetRequest {
        cluster: Some(cluster.into()),
        version: Some("v1".into()),
        resource: Some("pods".into()),
        name: Some(name.into()),
        ..Default::default()
    }
}

fn field(r: &Resource, key: &str) -> String {
    match &r
        .object
        .as_ref()
        .and_then(|o| o.fields.get(key))
        .and_then(|v| v.kind.clone())
    {
        Some(Kind::StringValue(s)) => s.clone(),
        other => panic!("field {key} missing: {other:?}"),
    }
}

async fn wait_until(mut check: impl AsyncFnMut() -> bool, what: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the hub has `n` links connected (the agent sees its side of
/// the handshake a moment before the hub has admitted the tunnel).
async fn wait_connected(channel: &tonic::transport::Channel, token: &str, n: usize) {
    wait_until(
        async || {
            let mut links = LinkServiceClient::new(channel.clone());
            links
                .list_links(with_token(ListLinksRequest {}, token))
                .await
                .map(|r| {
                    r.into_inner()
                        .links
                        .iter()
                        .filter(|l| l.state == Some(LinkState::Connected as i32))
                        .count()
                        == n
                })
                .unwrap_or(false)
        },
        "the hub to list every link as connected",
    )
    .await;
}

async fn link_core(transport: TransportKind) {
    let hub = TestHub::start().await;
    let clusters = ["edge-1", "edge-2", "edge-3"];
    let mut agents = Vec::new();
    for (i, c) in clusters.iter().enumerate() {
        let token = hub.hub.mint_join_token(c).unwrap();
        agents.push(start_agent(
            &hub,
            c,
            &format!("agent-{i}"),
            &token,
            transport,
        ));
    }
    for a in &agents {
        let s = a
            .agent
            .wait_for(WAIT, |s| s.connected.is_some())
            .await
            .expect("agent connects");
        assert_eq!(s.connected, Some(transport));
        assert_eq!(s.registrations, 1);
    }

    let channel = hub.channel().await;
    let mut resources = ResourceServiceClient::new(channel.clone());
    let mut links = LinkServiceClient::new(channel.clone());
    wait_connected(&channel, &hub.admin_token, 3).await;

    // Each call is answered by the agent of the cluster it names, for the
    // caller the hub authenticated.
    for (i, c) in clusters.iter().enumerate() {
        let r = resources
            .get(with_token(get(c, "web"), &hub.admin_token))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(field(&r, "cluster"), *c);
        assert_eq!(field(&r, "agent"), format!("agent-{i}"));
        assert_eq!(field(&r, "user"), "admin");
        assert!(field(&r, "groups").contains("system:authenticated"));
    }

    // ListLinks: every cluster connected over this transport.
    let listed = links
        .list_links(with_token(ListLinksRequest {}, &hub.admin_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.links.len(), 3);
    for l in &listed.links {
        assert_eq!(l.state, Some(LinkState::Connected as i32), "{l:?}");
        assert_eq!(l.transport.as_deref(), Some(transport.as_str()));
    }

    // Errors: no token, unknown cluster.
    let e = resources
        .get(Request::new(get("edge-1", "x")))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let e = resources
        .get(with_token(get("nowhere", "x"), &hub.admin_token))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(
        e.message().contains("nowhere is not registered"),
        "{}",
        e.message()
    );

    // Streaming, and cancellation reaching the agent.
    let mut watch = resources
        .watch(with_token(
            WatchRequest {
                cluster: Some("edge-2".into()),
                ..Default::default()
            },
            &hub.admin_token,
        ))
        .await
        .unwrap()
        .into_inner();
    for i in 0..3 {
        let ev = watch.next().await.unwrap().unwrap();
        assert_eq!(ev.resource_version.as_deref(), Some(i.to_string().as_str()));
        assert_eq!(field(ev.resource.as_ref().unwrap(), "cluster"), "edge-2");
    }
    assert_eq!(agents[1].live_watches.load(Ordering::SeqCst), 1);
    drop(watch);
    let live = agents[1].live_watches.clone();
    wait_until(
        async || live.load(Ordering::SeqCst) == 0,
        "the agent to end the cancelled watch",
    )
    .await;

    // Head-of-line: a bulk stream that the caller does not read, and small
    // calls on the same tunnel still finish.
    let mut bulk = resources
        .watch(with_token(
            WatchRequest {
                cluster: Some("edge-1".into()),
                resource: Some("bulk".into()),
                ..Default::default()
            },
            &hub.admin_token,
        ))
        .await
        .unwrap()
        .into_inner();
    bulk.next().await.unwrap().unwrap();
    for _ in 0..10 {
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            resources.get(with_token(get("edge-1", "small"), &hub.admin_token)),
        )
        .await
        .expect("small call finished while the bulk stream is stalled")
        .unwrap();
        assert_eq!(field(r.get_ref(), "name"), "small");
    }
    assert_eq!(
        agents[0].live_watches.load(Ordering::SeqCst),
        1,
        "bulk stream still running"
    );
    drop(bulk);

    // Agent replaced for the same cluster: the old tunnel is closed and the
    // new agent answers.
    let token = hub.hub.mint_join_token("edge-3").unwrap();
    let replacement = start_agent(&hub, "edge-3", "agent-3b", &token, transport);
    replacement
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("replacement connects");
    agents[2]
        .agent
        .wait_for(WAIT, |s| s.connected.is_none())
        .await
        .expect("old tunnel closed");
    wait_until(
        async || {
            let mut c = ResourceServiceClient::new(channel.clone());
            match c
                .get(with_token(get("edge-3", "x"), &hub.admin_token))
                .await
            {
                Ok(r) => field(r.get_ref(), "agent") == "agent-3b",
                Err(e) => {
                    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
                    false
                }
            }
        },
        "the replacement agent to answer for edge-3",
    )
    .await;
    // The replaced agent cannot come back with its old certificate.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(agents[2].agent.status().connected.is_none());
    let old = agents.remove(2);
    old.agent.shutdown().await;

    // Hub restart: same data dir and ports; agents reconnect with the
    // certificates they have, without registering again.
    let ports = (hub.hub.api_addr, hub.hub.tunnel_addr);
    let dir = hub.dir.clone();
    let connects_before: Vec<u32> = agents.iter().map(|a| a.agent.status().connects).collect();
    hub.hub.shutdown().await;
    drop(channel);
    for a in &agents {
        a.agent
            .wait_for(WAIT, |s| s.connected.is_none())
            .await
            .expect("agent sees the hub go");
    }
    let hub = TestHub::start_in(dir, Some(ports)).await;
    for (a, before) in agents.iter().zip(connects_before) {
        let s = a
            .agent
            .wait_for(WAIT, |s| s.connected.is_some() && s.connects > before)
            .await
            .expect("agent reconnects");
        assert_eq!(
            s.registrations, 1,
            "no second registration after a hub restart"
        );
    }
    replacement
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("replacement reconnects");
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 3).await;
    let mut resources = ResourceServiceClient::new(channel.clone());
    let r = resources
        .get(with_token(get("edge-2", "after"), &hub.admin_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(field(&r, "cluster"), "edge-2");
    let listed = LinkServiceClient::new(channel.clone())
        .list_links(with_token(ListLinksRequest {}, &hub.admin_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.links.len(), 3, "links survived the restart");

    // Offline cluster: registered, no tunnel.
    for a in agents {
        a.agent.shutdown().await;
    }
    wait_until(
        async || {
            let mut c = ResourceServiceClient::new(channel.clone());
            matches!(c.get(with_token(get("edge-1", "x"), &hub.admin_token)).await, Err(e) if e.code() == Code::Unavailable)
        },
        "edge-1 to be reported offline",
    )
    .await;
    let e = resources
        .get(with_token(get("edge-1", "x"), &hub.admin_token))
        .await
        .unwrap_err();
    assert!(
        e.message().contains("cluster edge-1 is offline (last seen"),
        "{}",
        e.message()
    );
    replacement.agent.shutdown().await;
    hub.hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_core_over_quic() {
    link_core(TransportKind::Quic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_core_over_h2() {
    link_core(TransportKind::H2).await;
}

/// Register refuses bad tokens and CSRs with the right codes.
#[tokio::test]
async fn register_rejects_bad_input() {
    let hub = TestHub::start().await;
    let mut link = LinkServiceClient::new(hub.channel().await);
    let (_key, csr) = otter_pki::csr::generate("edge-1", "a1").unwrap();
    let register = |cluster: &str, token: &str, csr: &str| RegisterRequest {
        cluster: Some(cluster.into()),
        csr: Some(csr.as_bytes().to_vec()),
        agent_id: Some("a1".into()),
        agent_version: Some("v0.1.0".into()),
        rancher_project_id: None,
        join_token: Some(token.into()),
    };
    let token_a = hub.hub.mint_join_token("edge-1").unwrap();

    let e = link
        .register(register("edge-1", "otj_0000000000000000_forged", &csr))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let e = link
        .register(register("edge-1", "", &csr))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("join token"), "{}", e.message());
    let e = link
        .register(register("edge-2", &token_a, &csr))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = link
        .register(register(
            "edge-1",
            &token_a,
            "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = link
        .register(register("Bad_Name", &token_a, &csr))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let expired = {
        let mut c = otter_hub::HubConfig::new(hub.data_dir());
        c.join_token_ttl = Duration::ZERO;
        otter_hub::tokens::mint_join_token(&*hub.hub.state.store, "edge-1", c.join_token_ttl)
            .unwrap()
    };
    let e = link
        .register(register("edge-1", &expired, &csr))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    assert!(e.message().contains("expired"), "{}", e.message());

    // A good registration, then a renewal over mTLS with the issued certificate.
    let resp = link
        .register(register("edge-1", &token_a, &csr))
        .await
        .unwrap()
        .into_inner();
    let cert = String::from_utf8(resp.certificate.unwrap()).unwrap();
    assert_eq!(
        resp.ca_certificate.as_deref(),
        Some(hub.hub.ca_pem().as_bytes())
    );
    assert!(
        resp.tunnel_urls.iter().any(|u| u.starts_with("quic://"))
            && resp.tunnel_urls.iter().any(|u| u.starts_with("h2://"))
    );
    let (key2, csr2) = otter_pki::csr::generate("edge-1", "a1").unwrap();
    let _ = key2;
    let mtls = client_channel(hub.hub.api_addr, hub.hub.ca_pem(), Some((&cert, &_key))).await;
    let renewed = LinkServiceClient::new(mtls.clone())
        .register(register("edge-1", "", &csr2))
        .await
        .unwrap()
        .into_inner();
    assert!(renewed.certificate.is_some());
    // The same certificate cannot register another cluster.
    let e = LinkServiceClient::new(mtls)
        .register(register("edge-2", "", &csr2))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    hub.hub.shutdown().await;
}
