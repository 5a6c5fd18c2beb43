//! Call latency and head-of-line isolation through the real hub and agent.
//!
//! The agent serves a bench ResourceService whose Get reads the pod from the
//! Kubernetes API test server over HTTPS, the way the real service does; the
//! agent's Kubernetes client is kept out of this figure. The same Get is
//! also sent straight to that service (plaintext gRPC on loopback, no hub)
//! and straight to the test server.

use std::{
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kube_sim::{KubeSim, SimConfig};
use otter_e2e::{TestHub, with_token};
use otter_proto::resource::v1::{
    self as res, GetRequest, Resource, WatchEvent, WatchRequest,
    resource_service_client::ResourceServiceClient,
    resource_service_server::{ResourceService, ResourceServiceServer},
};
use otter_tunnel::TransportKind;
use prost_types::{Struct, Value, value::Kind};
use tonic::{Request, Response, Status, transport::Channel};

use anyhow::Context;

use crate::common::{Figures, Latency, alternating, cpu_secs, packets_sent, thread_sleeps};

/// Group of the hub's admin token, allowed everything on the test server.
const HUB_ADMINS: &str = "otter:default:admins";

const POD: &str = "bench-0";
const TIMEOUT: Duration = Duration::from_secs(10);
/// How long the head-of-line scenario's bulk stream runs alone, measured,
/// before the small calls start beside it.
const BULK_ALONE: Duration = Duration::from_secs(2);

/// HTTPS client of the test server: one HTTP/2 connection, shared.
#[derive(Clone, Debug)]
pub struct Kube {
    send: SendRequest<Empty<Bytes>>,
    authority: String,
}

impl Kube {
    pub async fn connect(sim: &KubeSim) -> anyhow::Result<Kube> {
        let mut roots = rustls::RootCertStore::empty();
        for c in otter_pki::tls::parse_certs(&sim.ca_pem())? {
            roots.add(c)?;
        }
        let mut config = rustls::ClientConfig::builder_with_provider(otter_pki::tls::provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let tcp = tokio::net::TcpStream::connect(sim.addr()).await?;
        tcp.set_nodelay(true)?;
        let name = rustls::pki_types::ServerName::from(sim.addr().ip());
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await?;
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await?;
        tokio::spawn(conn);
        Ok(Kube {
            send,
            authority: sim.addr().to_string(),
        })
    }

    /// GET of one pod; the JSON body.
    pub async fn get_pod(&self, name: &str) -> anyhow::Result<Bytes> {
        let req = http::Request::get(format!(
            "https://{}/api/v1/namespaces/default/pods/{name}",
            self.authority
        ))
        .header("authorization", format!("Bearer {}", kube_sim::ADMIN_TOKEN))
        .body(Empty::new())?;
        let resp = self.send.clone().send_request(req).await?;
        anyhow::ensure!(resp.status().is_success(), "status {}", resp.status());
        Ok(resp.into_body().collect().await?.to_bytes())
    }
}

/// The bench ResourceService: Get reads the pod from the test server; Watch
/// of resource "bulk" streams 256 KiB events for as long as it is read.
#[derive(Debug, Clone)]
pub struct BenchService {
    pub kube: Kube,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<WatchEvent, Status>> + Send>>;

#[tonic::async_trait]
impl ResourceService for BenchService {
    async fn get(&self, request: Request<GetRequest>) -> Result<Response<Resource>, Status> {
        let name = request.into_inner().name.unwrap_or_default();
        let body = self
            .kube
            .get_pod(&name)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let json: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&body).map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(Resource {
            object: Some(otter_proto::json::to_struct(serde_json::Value::Object(
                json,
            ))),
        }))
    }

    type WatchStream = EventStream;

    async fn watch(&self, request: Request<WatchRequest>) -> Result<Response<EventStream>, Status> {
        if request.into_inner().resource.as_deref() != Some("bulk") {
            return Err(Status::unimplemented("bench service"));
        }
        let payload = "x".repeat(256 * 1024);
        let stream = futures::stream::repeat_with(move || {
            Ok(WatchEvent {
                r#type: Some(res::watch_event::Type::Added as i32),
                resource: Some(Resource {
                    object: Some(Struct {
                        fields: [(
                            "payload".to_owned(),
                            Value {
                                kind: Some(Kind::StringValue(payload.clone())),
                            },
                        )]
                        .into(),
                    }),
                }),
                resource_version: None,
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn discovery(
        &self,
        _: Request<res::DiscoveryRequest>,
    ) -> Result<Response<res::DiscoveryResponse>, Status> {
        Err(Status::unimplemented("bench service"))
    }
    async fn schema(
        &self,
        _: Request<res::SchemaRequest>,
    ) -> Result<Response<res::SchemaResponse>, Status> {
        Err(Status::unimplemented("bench service"))
    }
    async fn list(
        &self,
        _: Request<res::ListRequest>,
    ) -> Result<Response<res::ListResponse>, Status> {
        Err(Status::unimplemented("bench service"))
    }
    async fn describe(
        &self,
        _: Request<res::DescribeRequest>,
    ) -> Result<Response<res::DescribeResponse>, Status> {
        Err(Status::unimplemented("bench service"))
    }
    async fn create(&self, _: Request<res::CreateRequest>) -> Result<Response<Resource>, Status> {
        Err(Status::unimplemented("bench service"))
    }
    async fn apply(&self, _: Request<res::ApplyRequest>) -> Result<Response<Resource>, Status> {
        Err(Status::unimplemented("bench service"))
    }
    async fn update(&self, _: Request<res::UpdateRequest>) -> Result<Response<Resource>, Status> {
        Err(Status::unimplemented("bench service"))
    }
    async fn delete(&self, _: Request<res::DeleteRequest>) -> Result<Response<()>, Status> {
        Err(Status::unimplemented("bench service"))
    }
}

fn get(cluster: &str) -> GetRequest {
    GetRequest {
        cluster: Some(cluster.into()),
        version: Some("v1".into()),
        resource: Some("pods".into()),
        namespace: Some("default".into()),
        name: Some(POD.into()),
        ..Default::default()
    }
}

/// Times `n` sequential calls of `call`.
async fn series<F, Fut>(n: usize, mut call: F) -> anyhow::Result<Vec<Duration>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        tokio::time::timeout(TIMEOUT, call()).await??;
        out.push(t.elapsed());
    }
    Ok(out)
}

/// What a call costs in work, over `n` sequential calls of `call`: CPU
/// time (µs) of this whole process (client, hub, agent, test server),
/// steadier than latency on a shared machine, and the packets sent on
/// loopback, UDP and TCP (each a system call, a wakeup and a pass through
/// a protocol stack), and how often a thread of this process went to
/// sleep (a hand-off that had to wake a thread).
struct Work {
    cpu: f64,
    udp: f64,
    tcp: f64,
    sleeps: f64,
}

async fn work_per_call<F, Fut>(n: usize, call: F) -> anyhow::Result<Work>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let before = cpu_secs("self").unwrap_or(0.0);
    let sent = packets_sent();
    let slept = thread_sleeps();
    series(n, call).await?;
    let cpu = (cpu_secs("self").unwrap_or(0.0) - before) * 1e6 / n as f64;
    let sleeps = match (slept, thread_sleeps()) {
        (Some(s0), Some(s1)) => s1.saturating_sub(s0) as f64 / n as f64,
        _ => f64::NAN,
    };
    let (udp, tcp) = match (sent, packets_sent()) {
        (Some((u0, t0)), Some((u1, t1))) => {
            ((u1 - u0) as f64 / n as f64, (t1 - t0) as f64 / n as f64)
        }
        _ => (f64::NAN, f64::NAN),
    };
    Ok(Work {
        cpu,
        udp,
        tcp,
        sleeps,
    })
}

impl Work {
    /// Adds the figures of path `path`, against `baseline`'s.
    fn add_to(&self, figs: &mut Figures, path: &str, baseline: Option<&str>) {
        for (what, unit, v) in [
            ("cpu-per-call", "µs", self.cpu),
            ("udp-sends-per-call", "sends", self.udp),
            ("tcp-segments-per-call", "segments", self.tcp),
            ("thread-sleeps-per-call", "sleeps", self.sleeps),
        ] {
            let base = baseline.map(|b| format!("{what}.{b}"));
            figs.add(&format!("{what}.{path}"), unit, base.as_deref(), v);
        }
    }
}

struct Setup {
    _sim: KubeSim,
    kube: Kube,
    hub: TestHub,
    _agents: Vec<otter_agent::Agent>,
    direct: Channel,
    /// The agent's real services (kube-rs, impersonating), no hub.
    direct_real: Channel,
    /// [`serve_bare_proxy`] in front of `direct`.
    bare_proxy: Channel,
    via_hub: Channel,
    bulk: Channel,
    /// A member of a tenant that holds none of the bench's clusters.
    outsider: String,
}

/// Serves `routes` as plaintext gRPC on loopback; every call carries
/// `caller`, as the tunnel would attach it.
async fn serve_plain(
    routes: tonic::service::Routes,
    caller: Option<otter_tunnel::Caller>,
) -> anyhow::Result<Channel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let attach = tower::util::MapRequestLayer::new(move |mut req: http::Request<_>| {
        if let Some(c) = &caller {
            req.extensions_mut().insert(c.clone());
        }
        req
    });
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .layer(attach)
            .add_routes(routes)
            .serve_with_incoming(
                tokio_stream::wrappers::TcpListenerStream::new(listener).map(|r| {
                    r.inspect(|tcp| {
                        let _ = tcp.set_nodelay(true);
                    })
                }),
            )
            .await;
    });
    Ok(Channel::from_shared(format!("http://{addr}"))?
        .tcp_nodelay(true)
        .connect()
        .await?)
}

/// The least one TLS gRPC hop costs here: a proxy that terminates TLS and
/// HTTP/2 as the hub's API port does (rustls, hyper) and hands every call
/// as it is to `direct`, with no token, routing or tunnel. The hub's added
/// time set against this hop's says how much of it is the machine's.
async fn serve_bare_proxy(direct: Channel) -> anyhow::Result<Channel> {
    let ca = otter_pki::CertificateAuthority::generate("bench proxy")?;
    let (cert, key) = ca.issue_server_cert(&["localhost".to_owned()])?;
    let tls = otter_pki::tls::server_config(
        &cert,
        &key,
        ca.cert_pem(),
        otter_pki::tls::ClientAuth::None,
        &[b"h2"],
    )?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = tcp.set_nodelay(true);
            let (acceptor, direct) = (acceptor.clone(), direct.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let direct = direct.clone();
                        tower::ServiceExt::oneshot(direct, req.map(tonic::body::Body::new))
                    });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    hub_channel(addr, ca.cert_pem()).await
}

async fn setup() -> anyhow::Result<Setup> {
    otter_pki::tls::install_default_provider();
    let sim = KubeSim::start(
        SimConfig::default_with_admin()
            .allow(&format!("group:{HUB_ADMINS}"), &["*"], &["*"], &["*"])
            .pod("default", POD, &["app"]),
    )
    .await?;
    let kube = Kube::connect(&sim).await?;
    let svc = BenchService { kube: kube.clone() };

    // The service without the hub: plaintext gRPC on loopback.
    let direct = serve_plain(
        tonic::service::Routes::new(ResourceServiceServer::new(svc.clone())),
        None,
    )
    .await?;
    // The agent's real services on the same test server: kube-rs with the
    // agent's credentials, impersonating the caller the hub verified.
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN))?;
    let access = otter_agent::kube::KubeAccess::new(
        otter_agent::kube::load_config(Some(&kubeconfig)).await?,
    )?;
    let real = otter_agent::services(access, "real", Default::default());
    let admin = otter_tunnel::Caller {
        user: "otter:admin".into(),
        groups: vec!["system:authenticated".into(), HUB_ADMINS.into()],
        ..Default::default()
    };
    let direct_real = serve_plain(real.clone(), Some(admin)).await?;
    let bare_proxy = serve_bare_proxy(direct.clone()).await?;

    // One cluster per transport, each with its own agent, and a neighbour
    // of each transport: the head-of-line series' second control.
    let hub = TestHub::start_with(Arc::new(tempfile::tempdir()?), None, |c| {
        c.keepalive = otter_tunnel::Keepalive::default()
    })
    .await;
    let mut agents = Vec::new();
    for (cluster, kind) in [
        ("quic", TransportKind::Quic),
        ("h2", TransportKind::H2),
        ("real", TransportKind::Quic),
        ("quic-neighbour", TransportKind::Quic),
        ("h2-neighbour", TransportKind::H2),
    ] {
        let token = hub.hub.mint_join_token(cluster)?;
        let mut config =
            otter_agent::AgentConfig::new(hub.api_url(), cluster, "agent-0", hub.hub.ca_pem());
        config.join_token = otter_agent::config::Secret(token);
        config.transports = vec![kind];
        let routes = match cluster {
            "real" => real.clone(),
            _ => tonic::service::Routes::new(ResourceServiceServer::new(svc.clone())),
        };
        let agent = otter_agent::Agent::start(config, routes)?;
        agent
            .wait_for(Duration::from_secs(20), |s| s.connected.is_some())
            .await
            .ok_or_else(|| anyhow::anyhow!("agent over {kind} did not connect"))?;
        agents.push(agent);
    }
    let via_hub = hub_channel(hub.hub.api_addr, hub.hub.ca_pem()).await?;
    otter_e2e::double::wait_connected(&via_hub, &hub.admin_token, 5).await;
    let bulk = hub_channel(hub.hub.api_addr, hub.hub.ca_pem()).await?;
    hub.hub.create_tenant("outsiders")?;
    let outsider = hub.hub.mint_token(&otter_hub::tokens::TokenSpec::member(
        "outsider",
        &[],
        "outsiders",
    ))?;
    Ok(Setup {
        _sim: sim,
        kube,
        hub,
        _agents: agents,
        direct,
        direct_real,
        bare_proxy,
        via_hub,
        bulk,
        outsider,
    })
}

/// A gRPC channel to the hub over TLS, trusting only its CA, with Nagle off
/// (as any latency-minded client has it).
pub async fn hub_channel(addr: std::net::SocketAddr, ca_pem: &str) -> anyhow::Result<Channel> {
    let tls = otter_pki::tls::client_config(ca_pem, None, &[b"h2"])?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
    Ok(
        Channel::from_shared(format!("http://localhost:{}", addr.port()))?
            .connect_with_connector(tower::service_fn(move |_: http::Uri| {
                let connector = connector.clone();
                async move {
                    let tcp = tokio::net::TcpStream::connect(addr).await?;
                    tcp.set_nodelay(true)?;
                    let tls = connector
                        .connect("localhost".try_into().expect("static name"), tcp)
                        .await?;
                    Ok::<_, std::io::Error>(TokioIo::new(tls))
                }
            }))
            .await?,
    )
}

async fn hub_get(ch: &Channel, token: &str, cluster: &str) -> anyhow::Result<()> {
    ResourceServiceClient::new(ch.clone())
        .get(with_token(get(cluster), token))
        .await?;
    Ok(())
}

/// A Get without a token, as the direct and bare-proxy paths take it.
fn plain_get(ch: &Channel, cluster: &str) -> impl Future<Output = anyhow::Result<()>> + use<> {
    let mut client = ResourceServiceClient::new(ch.clone());
    let request = get(cluster);
    async move { client.get(request).await.map(drop).map_err(Into::into) }
}

/// A Get the hub must refuse as for an absent cluster.
async fn refused_get(ch: &Channel, token: &str, cluster: &str) -> anyhow::Result<()> {
    let mut client = ResourceServiceClient::new(ch.clone());
    let call = client.get(with_token(get(cluster), token));
    match tokio::time::timeout(TIMEOUT, call).await? {
        Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
        other => anyhow::bail!("{cluster}: expected NotFound, got {other:?}"),
    }
}

fn add_latency(figs: &mut Figures, path: &str, l: Latency, baseline: Option<&str>) {
    for (q, v) in [
        ("p50", l.p50),
        ("p90", l.p90),
        ("p99", l.p99),
        ("max", l.max),
    ] {
        let base = baseline.map(|b| format!("latency.{b}.{q}"));
        figs.add(&format!("latency.{path}.{q}"), "µs", base.as_deref(), v);
    }
}

/// Latency of `calls` Gets per path and run, and head-of-line isolation.
pub async fn run(calls: usize, hol_calls: usize, runs: usize) -> anyhow::Result<Figures> {
    let s = tokio::time::timeout(Duration::from_secs(60), setup())
        .await
        .context("setup timed out")??;
    eprintln!("bench: hub, agents and test server up");
    let token = s.hub.admin_token.clone();
    let mut figs = Figures::default();
    let warmup = (calls / 10).max(100);
    for run in 0..runs {
        eprintln!("bench: latency run {}/{runs}", run + 1);
        // Straight to the test server.
        let kube = s.kube.clone();
        series(warmup, || async { kube.get_pod(POD).await.map(drop) }).await?;
        let k = Latency::of(&series(calls, || async { kube.get_pod(POD).await.map(drop) }).await?);
        add_latency(&mut figs, "kube-sim", k, None);
        eprintln!("bench: kube-sim p50 {:.0} µs", k.p50);
        // Straight to the agent's service, no hub.
        let one = || plain_get(&s.direct, "direct");
        series(warmup, one).await?;
        let d = Latency::of(&series(calls, one).await?);
        add_latency(&mut figs, "direct-agent", d, Some("kube-sim"));
        let work = work_per_call(calls, one).await?;
        work.add_to(&mut figs, "direct-agent", None);
        eprintln!(
            "bench: direct-agent p50 {:.0} µs, {:.0} µs CPU, {:.1} thread sleeps per call",
            d.p50, work.cpu, work.sleeps
        );
        // Through the hub and the tunnel, each call beside a direct one:
        // the hub-added figures are the pairs' differences.
        let mut hub_added = Vec::new();
        for cluster in ["quic", "h2"] {
            let (ch, token) = (&s.via_hub, token.as_str());
            let (direct, via) =
                alternating(warmup, calls, one, || hub_get(ch, token, cluster)).await?;
            let h = Latency::of(&via);
            add_latency(
                &mut figs,
                &format!("hub-{cluster}"),
                h,
                Some("direct-agent"),
            );
            let added = Latency::added(&direct, &via);
            eprintln!(
                "bench: hub-{cluster} p50 {:.0} µs, {:.0} µs over the direct call beside it",
                h.p50, added.p50
            );
            for (q, v) in [("p50", added.p50), ("p99", added.p99)] {
                figs.add(&format!("hub-added.{cluster}.{q}"), "µs", None, v);
            }
            hub_added.push((cluster, added));
            let work = work_per_call(calls, || hub_get(ch, token, cluster)).await?;
            work.add_to(&mut figs, &format!("hub-{cluster}"), Some("direct-agent"));
            eprintln!(
                "bench: hub-{cluster} {:.0} µs CPU, {:.1} UDP sends, {:.1} TCP segments, {:.1} thread sleeps per call",
                work.cpu, work.udp, work.tcp, work.sleeps
            );
        }

        // One bare TLS gRPC hop in front of the direct service, each call
        // beside a direct one: the floor a hop costs on this machine.
        let via_proxy = || plain_get(&s.bare_proxy, "direct");
        let (direct, via) = alternating(warmup, calls, one, via_proxy).await?;
        let added = Latency::added(&direct, &via);
        for (q, v) in [("p50", added.p50), ("p99", added.p99)] {
            figs.add(&format!("bare-tls-hop-added.{q}"), "µs", None, v);
        }
        for (cluster, hub) in &hub_added {
            for (q, v) in [("p50", hub.p50), ("p99", hub.p99)] {
                figs.add(
                    &format!("hub-added-vs-bare-hop.{cluster}.{q}"),
                    "µs",
                    Some(&format!("bare-tls-hop-added.{q}")),
                    v,
                );
            }
        }
        let work = work_per_call(calls, via_proxy).await?;
        work.add_to(&mut figs, "bare-tls-hop", Some("direct-agent"));
        eprintln!(
            "bench: a bare TLS gRPC hop adds {:.0} µs at p50 to the direct call beside it, {:.0} µs CPU, {:.1} thread sleeps per call",
            added.p50, work.cpu, work.sleeps
        );

        // The agent's real ResourceService (kube-rs, impersonation), without
        // and with the hub.
        let one = || plain_get(&s.direct_real, "real");
        series(warmup, one).await?;
        let dr = Latency::of(&series(calls, one).await?);
        add_latency(&mut figs, "direct-real-agent", dr, Some("kube-sim"));
        eprintln!("bench: direct-real-agent p50 {:.0} µs", dr.p50);
        let (ch, tok) = (&s.via_hub, token.as_str());
        let (direct, via) = alternating(warmup, calls, one, || hub_get(ch, tok, "real")).await?;
        let hr = Latency::of(&via);
        add_latency(&mut figs, "hub-real-agent", hr, Some("direct-real-agent"));
        let added = Latency::added(&direct, &via);
        eprintln!(
            "bench: hub-real-agent p50 {:.0} µs, {:.0} µs over the direct call beside it",
            hr.p50, added.p50
        );
        for (q, v) in [("p50", added.p50), ("p99", added.p99)] {
            figs.add(&format!("hub-added.real-quic.{q}"), "µs", None, v);
        }

        // A refusal's timing class: another tenant's connected cluster
        // against a cluster that does not exist, alternating, same client,
        // same moment. The ratio near 1 says the answer's time tells
        // nothing the answer's text does not.
        let outsider = s.outsider.clone();
        let (foreign, absent) = alternating(
            warmup,
            calls,
            || refused_get(&s.via_hub, &outsider, "quic"),
            || refused_get(&s.via_hub, &outsider, "nowhere"),
        )
        .await?;
        let (f, a) = (Latency::of(&foreign), Latency::of(&absent));
        for (q, fv, av) in [("p50", f.p50, a.p50), ("p99", f.p99, a.p99)] {
            let base = format!("refusal.absent.{q}");
            figs.add(&base, "µs", None, av);
            figs.add(&format!("refusal.other-tenant.{q}"), "µs", Some(&base), fv);
        }
        eprintln!(
            "bench: refusal p50 other tenant {:.0} µs, absent {:.0} µs",
            f.p50, a.p50
        );

        // Head-of-line: small Gets while a bulk watch saturates the tunnel.
        for cluster in ["quic", "h2"] {
            let (ch, token) = (&s.via_hub, token.as_str());
            let idle = Latency::of(&series(hol_calls, || hub_get(ch, token, cluster)).await?);
            // The bulk stream has its own client connection, so only the
            // tunnel is shared with the small calls.
            let mut watch = ResourceServiceClient::new(s.bulk.clone())
                .watch(with_token(
                    WatchRequest {
                        cluster: Some(cluster.into()),
                        version: Some("v1".into()),
                        resource: Some("bulk".into()),
                        ..Default::default()
                    },
                    token,
                ))
                .await?
                .into_inner();
            let bulk_bytes = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let counted = bulk_bytes.clone();
            let reader = tokio::spawn(async move {
                // Bounded by the abort below and by this cap.
                let deadline = Instant::now() + Duration::from_secs(300);
                while let Some(Ok(_)) = watch.next().await {
                    counted.fetch_add(256 * 1024, std::sync::atomic::Ordering::Relaxed);
                    if Instant::now() > deadline {
                        break;
                    }
                }
            });
            tokio::time::sleep(Duration::from_millis(500)).await;
            // The bulk stream's rate alone, to read its rate beside the
            // small calls against.
            let (a0, alone_from) = (
                bulk_bytes.load(std::sync::atomic::Ordering::Relaxed),
                Instant::now(),
            );
            tokio::time::sleep(BULK_ALONE).await;
            let alone = (bulk_bytes.load(std::sync::atomic::Ordering::Relaxed) - a0) as f64 * 8.0
                / 1e9
                / alone_from.elapsed().as_secs_f64();
            // How late a 10 ms timer fires while the bulk stream runs: a
            // task that never yields holds its worker thread, and whatever
            // is queued behind it (another tunnel's keepalive) waits.
            let late = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let ticker = {
                let late = late.clone();
                tokio::spawn(async move {
                    let tick = Duration::from_millis(10);
                    loop {
                        let t = Instant::now();
                        tokio::time::sleep(tick).await;
                        let over = t.elapsed().saturating_sub(tick).as_micros() as u64;
                        late.fetch_max(over, std::sync::atomic::Ordering::Relaxed);
                    }
                })
            };
            // Gets through the hub and the tunnel, each beside a control
            // Get that bypasses both (same client, same moment of the bulk
            // stream): what the control grows by is CPU contention on this
            // machine, not queueing in the tunnel.
            let one = || plain_get(&s.direct, "direct");
            let t = Instant::now();
            let b0 = bulk_bytes.load(std::sync::atomic::Ordering::Relaxed);
            let (control, busy) =
                alternating(0, hol_calls, one, || hub_get(ch, token, cluster)).await?;
            let (control, busy) = (Latency::of(&control), Latency::of(&busy));
            // The same Gets beside a control that takes the same path
            // (client, hub, a tunnel of the same kind, an agent) to a
            // neighbour cluster whose tunnel carries no bulk stream: the
            // hops cost the same on the shared cores, so what remains is
            // the wait behind bulk bytes on the shared tunnel.
            let neighbour = format!("{cluster}-neighbour");
            let (beside, shared) = alternating(
                0,
                hol_calls,
                || hub_get(ch, token, &neighbour),
                || hub_get(ch, token, cluster),
            )
            .await?;
            let (beside, shared) = (Latency::of(&beside), Latency::of(&shared));
            let rate = (bulk_bytes.load(std::sync::atomic::Ordering::Relaxed) - b0) as f64 * 8.0
                / 1e9
                / t.elapsed().as_secs_f64();
            reader.abort();
            ticker.abort();
            figs.add(
                &format!("hol.{cluster}.timer-late-max"),
                "ms",
                None,
                late.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1000.0,
            );
            figs.add(
                &format!("hol.{cluster}.bulk-direct-p99"),
                "µs",
                Some("latency.direct-agent.p99"),
                control.p99,
            );
            let idle_name = format!("hol.{cluster}.idle-p99");
            figs.add(&idle_name, "µs", None, idle.p99);
            figs.add(
                &format!("hol.{cluster}.bulk-p99"),
                "µs",
                Some(&idle_name),
                busy.p99,
            );
            // The same p99 against the control's, for the ratio the
            // target is set in.
            figs.add(
                &format!("hol.{cluster}.bulk-p99-vs-control"),
                "µs",
                Some(&format!("hol.{cluster}.bulk-direct-p99")),
                busy.p99,
            );
            let neighbour_name = format!("hol.{cluster}.bulk-neighbour-p99");
            figs.add(&neighbour_name, "µs", None, beside.p99);
            figs.add(
                &format!("hol.{cluster}.bulk-p99-vs-neighbour"),
                "µs",
                Some(&neighbour_name),
                shared.p99,
            );
            let alone_name = format!("hol.{cluster}.bulk-alone-rate");
            figs.add(&alone_name, "Gbit/s", None, alone);
            figs.add(
                &format!("hol.{cluster}.bulk-rate"),
                "Gbit/s",
                Some(&alone_name),
                rate,
            );
        }
    }
    figs.note(
        "latency.direct-agent.p50",
        "bench ResourceService (Get reads the pod from the test server), isolating hub and tunnel from the agent's Kubernetes client",
    );
    figs.note(
        "latency.hub-quic.p50",
        "client→hub over TLS; the direct path is plaintext gRPC",
    );
    Ok(figs)
}
