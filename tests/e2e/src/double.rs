//! A test double of the agent's ResourceService and helpers to start agents
//! that serve it. It answers with the cluster and agent it runs in and the
//! caller the hub verified, so each answer shows where it came from and for
//! whom. The real Kubernetes services are tested in their own suite.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::Stream;
use otter_agent::{Agent, AgentConfig, config::Secret};
use otter_proto::{
    link::v1::{LinkState, ListLinksRequest, link_service_client::LinkServiceClient},
    resource::v1::{
        self as res, GetRequest, Resource, WatchEvent, WatchRequest,
        resource_service_server::{ResourceService, ResourceServiceServer},
    },
};
use otter_tunnel::{Caller, TransportKind};
use prost_types::{Struct, Value, value::Kind};
use tonic::{Request, Response, Status};

use crate::{TestHub, with_token};

/// Bound of every wait in the end-to-end tests.
pub const WAIT: Duration = Duration::from_secs(20);

/// Test double of the agent's ResourceService.
#[derive(Debug, Clone)]
pub struct Double {
    pub cluster: String,
    pub agent: String,
    /// Watch streams currently alive on this agent.
    pub live_watches: Arc<AtomicUsize>,
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
        // Events without end of this many bytes each, or three small ones.
        let bulk = match req.resource.as_deref() {
            Some("bulk") => Some(256 * 1024),
            Some("bulk-small") => Some(16 * 1024),
            _ => None,
        };
        let cluster = self.cluster.clone();
        // Event i has resourceVersion i; a Watch from version v goes on
        // with v + 1, as an apiserver's would.
        let first = req
            .resource_version
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |v| v + 1);
        let stream = futures::stream::unfold(first, move |i| {
            let (guard, cluster) = (guard.clone(), cluster.clone());
            async move {
                let _keep = guard;
                if bulk.is_none() && i >= first + 3 {
                    // Stay open like a real watch, until the caller leaves.
                    std::future::pending::<()>().await;
                }
                let payload = match bulk {
                    Some(size) => "x".repeat(size),
                    None => format!("event-{i}"),
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
        Ok(Response::new(res::DiscoveryResponse::default()))
    }
    async fn schema(
        &self,
        _: Request<res::SchemaRequest>,
    ) -> Result<Response<res::SchemaResponse>, Status> {
        Ok(Response::new(res::SchemaResponse::default()))
    }
    /// Two objects named `<cluster>-<resource>-<i>` (in `metadata.name`).
    async fn list(
        &self,
        request: Request<res::ListRequest>,
    ) -> Result<Response<res::ListResponse>, Status> {
        let resource = request.into_inner().resource.unwrap_or_default();
        let items = (0..2)
            .map(|i| {
                let metadata = object(&[("name", format!("{}-{resource}-{i}", self.cluster))]);
                Resource {
                    object: Some(Struct {
                        fields: [(
                            "metadata".to_owned(),
                            Value {
                                kind: Some(Kind::StructValue(metadata)),
                            },
                        )]
                        .into(),
                    }),
                }
            })
            .collect();
        Ok(Response::new(res::ListResponse {
            items,
            resource_version: Some("1".into()),
            ..Default::default()
        }))
    }
    async fn describe(
        &self,
        _: Request<res::DescribeRequest>,
    ) -> Result<Response<res::DescribeResponse>, Status> {
        Ok(Response::new(res::DescribeResponse::default()))
    }
    async fn create(
        &self,
        request: Request<res::CreateRequest>,
    ) -> Result<Response<Resource>, Status> {
        Ok(Response::new(self.written("create", caller_of(&request))))
    }
    async fn apply(
        &self,
        request: Request<res::ApplyRequest>,
    ) -> Result<Response<Resource>, Status> {
        Ok(Response::new(self.written("apply", caller_of(&request))))
    }
    async fn update(
        &self,
        request: Request<res::UpdateRequest>,
    ) -> Result<Response<Resource>, Status> {
        Ok(Response::new(self.written("update", caller_of(&request))))
    }
    async fn delete(&self, _: Request<res::DeleteRequest>) -> Result<Response<()>, Status> {
        Ok(Response::new(()))
    }
}

fn caller_of<T>(request: &Request<T>) -> Caller {
    request
        .extensions()
        .get::<Caller>()
        .cloned()
        .unwrap_or_default()
}

impl Double {
    /// The answer to a write: where it ran, for whom, and which verb.
    fn written(&self, verb: &str, caller: Caller) -> Resource {
        Resource {
            object: Some(object(&[
                ("cluster", self.cluster.clone()),
                ("agent", self.agent.clone()),
                ("user", caller.user),
                ("verb", verb.to_owned()),
            ])),
        }
    }
}

/// An agent serving the double.
#[derive(Debug)]
pub struct TestAgent {
    pub agent: Agent,
    pub live_watches: Arc<AtomicUsize>,
}

/// Starts an agent for `cluster` joined with `token`.
pub fn start_agent(
    hub: &TestHub,
    cluster: &str,
    agent_id: &str,
    token: &str,
    transport: TransportKind,
) -> TestAgent {
    start_agent_with(hub, cluster, agent_id, token, transport, |_| {})
}

/// Enrolls `agent_id` of `cluster` once (a fresh join token), its
/// identity kept in the directory `state`, and stops it: an agent that
/// joined before, as a restart or a doctor run finds it.
pub async fn enrolled_once(hub: &TestHub, cluster: &str, agent_id: &str, state: &std::path::Path) {
    let token = hub.hub.mint_join_token(cluster).unwrap();
    let state = state.to_owned();
    let agent = start_agent_with(hub, cluster, agent_id, &token, TransportKind::H2, |c| {
        c.state = Some(otter_agent::identity::IdentityStore::Dir(state));
    });
    agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("enrolls");
    agent.agent.shutdown().await;
}

/// Like [`start_agent`], with a chance to change the agent's config.
pub fn start_agent_with(
    hub: &TestHub,
    cluster: &str,
    agent_id: &str,
    token: &str,
    transport: TransportKind,
    tweak: impl FnOnce(&mut AgentConfig),
) -> TestAgent {
    start_agent_at(
        hub.api_url(),
        hub.hub.ca_pem(),
        cluster,
        agent_id,
        token,
        transport,
        tweak,
    )
}

/// Like [`start_agent_with`], for a hub at `api_url` trusting `ca_pem` (a
/// hub running as a process of its own).
pub fn start_agent_at(
    api_url: url::Url,
    ca_pem: &str,
    cluster: &str,
    agent_id: &str,
    token: &str,
    transport: TransportKind,
    tweak: impl FnOnce(&mut AgentConfig),
) -> TestAgent {
    let mut config = AgentConfig::new(api_url, cluster, agent_id, ca_pem);
    config.join_token = Secret(token.to_owned());
    config.transports = vec![transport];
    config.keepalive = otter_tunnel::Keepalive::every(Duration::from_secs(1));
    config.backoff_base = Duration::from_millis(100);
    config.backoff_cap = Duration::from_millis(800);
    tweak(&mut config);
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

/// A Watch of the double's events (three, then it stays open).
pub fn watch(cluster: &str) -> WatchRequest {
    WatchRequest {
        cluster: Some(cluster.into()),
        ..Default::default()
    }
}

/// A Watch of the double's `bulk` resource: 256 KiB events without end,
/// to saturate a tunnel.
pub fn bulk_watch(cluster: &str) -> WatchRequest {
    WatchRequest {
        cluster: Some(cluster.into()),
        resource: Some("bulk".into()),
        ..Default::default()
    }
}

/// Like [`bulk_watch`], with 16 KiB events.
pub fn small_bulk_watch(cluster: &str) -> WatchRequest {
    WatchRequest {
        resource: Some("bulk-small".into()),
        ..bulk_watch(cluster)
    }
}

/// A Get for `name` in `cluster`.
pub fn get(cluster: &str, name: &str) -> GetRequest {
    GetRequest {
        cluster: Some(cluster.into()),
        version: Some("v1".into()),
        resource: Some("pods".into()),
        name: Some(name.into()),
        ..Default::default()
    }
}

/// A string field of the double's answer.
pub fn field(r: &Resource, key: &str) -> String {
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

/// The name (metadata.name) of a watch event's object; empty when it has
/// none (a bookmark, an error).
pub fn event_name(ev: &otter_proto::resource::v1::WatchEvent) -> String {
    let meta = ev
        .resource
        .as_ref()
        .and_then(|r| r.object.as_ref())
        .and_then(|o| o.fields.get("metadata"))
        .and_then(|m| m.kind.as_ref());
    match meta {
        Some(Kind::StructValue(m)) => match m.fields.get("name").and_then(|n| n.kind.as_ref()) {
            Some(Kind::StringValue(n)) => n.clone(),
            _ => String::new(),
        },
        _ => String::new(),
    }
}

/// Polls `check` until it holds; fails the test after [`WAIT`].
pub async fn wait_until(mut check: impl AsyncFnMut() -> bool, what: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The hub's links as `token` lists them.
pub async fn list_links(
    channel: &tonic::transport::Channel,
    token: &str,
) -> Vec<otter_proto::link::v1::Link> {
    LinkServiceClient::new(channel.clone())
        .list_links(with_token(ListLinksRequest {}, token))
        .await
        .expect("ListLinks")
        .into_inner()
        .links
}

/// The link of `cluster`, as `token` lists it.
pub async fn link_of(
    channel: &tonic::transport::Channel,
    token: &str,
    cluster: &str,
) -> otter_proto::link::v1::Link {
    list_links(channel, token)
        .await
        .into_iter()
        .find(|l| l.cluster.as_deref() == Some(cluster))
        .unwrap_or_else(|| panic!("no link for {cluster}"))
}

/// Waits until the hub has `n` links connected (the agent sees its side of
/// the handshake a moment before the hub has admitted the tunnel).
pub async fn wait_connected(channel: &tonic::transport::Channel, token: &str, n: usize) {
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

/// A ResourceService a compromised agent might serve: every call answered
/// with fixed gRPC-framed bytes (`watch` for a Watch, `get` for anything
/// else), cut into DATA frames of `cut` bytes, then an OK status. The
/// bytes need not be a valid message.
#[derive(Debug, Clone)]
pub struct Canned {
    pub watch: bytes::Bytes,
    pub get: bytes::Bytes,
    pub cut: usize,
}

impl tonic::server::NamedService for Canned {
    const NAME: &'static str = "otterscale.resource.v1.ResourceService";
}

impl tower::Service<http::Request<tonic::body::Body>> for Canned {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        use hyper::body::Frame;
        let message = if req.uri().path().ends_with("/Watch") {
            self.watch.clone()
        } else {
            self.get.clone()
        };
        let cut = self.cut.max(1);
        let mut status = http::HeaderMap::new();
        status.insert("grpc-status", http::HeaderValue::from_static("0"));
        let frames = (0..message.len().div_ceil(cut))
            .map(move |i| {
                let end = (i + 1).saturating_mul(cut).min(message.len());
                Ok::<_, std::convert::Infallible>(Frame::data(message.slice(i * cut..end)))
            })
            .chain(std::iter::once(Ok(Frame::trailers(status))));
        let body = tonic::body::Body::new(http_body_util::StreamBody::new(futures::stream::iter(
            frames,
        )));
        std::future::ready(Ok(http::Response::builder()
            .header("content-type", "application/grpc")
            .body(body)
            .expect("response")))
    }
}
