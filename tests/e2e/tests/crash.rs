//! Crashes of real processes: the hub or an agent killed with SIGKILL in
//! the middle of calls (a unary call, a Watch, an exec, a port-forward).
//! Callers get an error within a bounded time, never a hang; a restarted
//! hub gets its agents back on their existing certificates with the links
//! intact; nothing is left behind on either side (agent streams and
//! sessions, hub calls in flight and tunnels, all counted).

use std::{
    net::SocketAddr,
    path::PathBuf,
    pin::Pin,
    time::{Duration, Instant},
};

use futures::{Future, StreamExt};
use otter_agent::gauges::sample;
use otter_e2e::{
    client_channel,
    double::WAIT,
    kube::sim_config,
    procs::{Proc, Role, echo_server, free_port, http_get},
    with_token,
};
use otter_proto::{
    link::v1::{Link, LinkState, ListLinksRequest, link_service_client::LinkServiceClient},
    resource::v1::{WatchRequest, resource_service_client::ResourceServiceClient},
    runtime::v1::{self as pb, runtime_service_client::RuntimeServiceClient},
};
use tonic::{Code, transport::Channel};

#[test]
#[ignore = "entry point of the processes the tests start"]
fn child_process() {
    otter_e2e::procs::child_main();
}

/// How long a caller may wait for its error once a process died. QUIC
/// notices a dead peer after three keepalive intervals (1 s here).
const ERROR_BOUND: Duration = Duration::from_secs(10);

/// A hub process, its agents (one per transport) and the test server they
/// serve, all on loopback.
struct Fleet {
    dir: tempfile::TempDir,
    data: PathBuf,
    api: u16,
    tunnel: u16,
    hub: Option<Proc>,
    hub_starts: u32,
    agents: Vec<AgentProc>,
    admin_token: String,
    ca_pem: String,
}

struct AgentProc {
    cluster: String,
    transport: &'static str,
    health: SocketAddr,
    proc: Option<Proc>,
    starts: u32,
}

impl Fleet {
    /// Mints the join tokens with a hub in this process, then starts the
    /// hub and the agents as processes.
    async fn start(sim: &kube_sim::KubeSim) -> Fleet {
        let dir = tempfile::tempdir().expect("temp dir");
        let data = dir.path().join("hub");
        std::fs::create_dir_all(&data).expect("data dir");
        let transports = ["quic", "h2"];
        {
            let setup = std::sync::Arc::new(tempfile::TempDir::new_in(dir.path()).expect("dir"));
            let mut config = otter_hub::HubConfig::new(&data);
            config.api_listen = "127.0.0.1:0".parse().expect("address");
            config.tunnel_listen = "127.0.0.1:0".parse().expect("address");
            let hub = otter_hub::Hub::start(config).await.expect("setup hub");
            for (i, _) in transports.iter().enumerate() {
                let token = hub.mint_join_token(&format!("edge-{i}")).expect("token");
                std::fs::write(dir.path().join(format!("token-{i}")), token).expect("token file");
            }
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
            ca_pem,
            dir,
        };
        fleet.start_hub();
        for i in 0..fleet.agents.len() {
            fleet.start_agent(i);
        }
        fleet
    }

    fn start_hub(&mut self) {
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
            "1",
        ]
        .iter()
        .map(|s| (*s).to_owned())
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

    fn start_agent(&mut self, i: usize) {
        let d = self.dir.path();
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
            "1",
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

    fn api_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.api))
    }

    async fn channel(&self) -> Channel {
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

    fn hub_log(&self) -> String {
        self.hub.as_ref().map(|h| h.tail(30)).unwrap_or_default()
    }

    async fn links(&self, channel: &Channel) -> Vec<Link> {
        LinkServiceClient::new(channel.clone())
            .list_links(with_token(ListLinksRequest {}, &self.admin_token))
            .await
            .map(|r| r.into_inner().links)
            .unwrap_or_default()
    }

    /// Waits until every agent's link is connected; returns the links.
    async fn all_connected(&self, channel: &Channel) -> Vec<Link> {
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
    async fn agent_metrics(&self, i: usize) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(m) = http_get(self.agents[i].health, "/metrics").await {
                return m;
            }
            assert!(Instant::now() < deadline, "agent {i} has no /metrics");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The hub's `/metrics`.
    async fn hub_metrics(&self) -> String {
        let req = http::Request::get("/metrics")
            .header("authorization", format!("Bearer {}", self.admin_token))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .expect("request");
        let (status, _, body) =
            otter_e2e::http_call(self.api_addr(), &self.ca_pem, true, req).await;
        assert_eq!(status, 200);
        String::from_utf8_lossy(&body).into_owned()
    }
}

/// A sample of a text exposition; 0 when absent (an empty family).
fn metric(text: &str, name: &str) -> f64 {
    sample(text, name).unwrap_or(0.0)
}

/// Waits (bounded) until `check` holds for the text `fetch` returns.
async fn until_metrics<F: Future<Output = String>>(
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

fn sessions(text: &str) -> (f64, f64) {
    (
        metric(text, "otter_agent_sessions{kind=\"exec\"}"),
        metric(text, "otter_agent_sessions{kind=\"port-forward\"}"),
    )
}

/// The calls a crash interrupts, all on one cluster.
struct InFlight {
    watch: tonic::Streaming<otter_proto::resource::v1::WatchEvent>,
    exec: tonic::Streaming<pb::ExecuteTtyResponse>,
    port_forward: tonic::Streaming<pb::PortForwardResponse>,
    /// A WriteTTY stalled on a process that does not read its stdin.
    unary: Option<Pin<Box<dyn Future<Output = Result<(), tonic::Status>> + Send>>>,
}

fn exec_req(cluster: &str, command: &[&str]) -> pb::ExecuteTtyRequest {
    pb::ExecuteTtyRequest {
        cluster: Some(cluster.into()),
        namespace: Some("default".into()),
        name: Some("web".into()),
        command: command.iter().map(|s| (*s).to_owned()).collect(),
        tty: Some(false),
        ..Default::default()
    }
}

/// Opens a Watch, an exec of `cat` (echoing a line), a port-forward
/// (echoing a line) and, with `unary`, a WriteTTY that stalls.
async fn start_calls(channel: &Channel, token: &str, cluster: &str, unary: bool) -> InFlight {
    let mut resources = ResourceServiceClient::new(channel.clone());
    let mut watch = resources
        .watch(with_token(
            WatchRequest {
                cluster: Some(cluster.into()),
                version: Some("v1".into()),
                resource: Some("pods".into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            token,
        ))
        .await
        .expect("watch")
        .into_inner();
    let first = tokio::time::timeout(WAIT, watch.next())
        .await
        .expect("watch event");
    assert!(matches!(first, Some(Ok(_))), "{first:?}");

    let mut rt = RuntimeServiceClient::new(channel.clone())
        .max_decoding_message_size(8 << 20)
        .max_encoding_message_size(8 << 20);
    let mut exec = rt
        .execute_tty(with_token(exec_req(cluster, &["cat"]), token))
        .await
        .expect("exec")
        .into_inner();
    let id = exec
        .next()
        .await
        .expect("id")
        .expect("id")
        .session_id
        .expect("id");
    rt.write_tty(with_token(
        pb::WriteTtyRequest {
            session_id: Some(id),
            stdin: Some(b"hi\n".to_vec()),
        },
        token,
    ))
    .await
    .expect("write");
    let echoed = tokio::time::timeout(WAIT, exec.next()).await.expect("echo");
    assert_eq!(echoed.unwrap().unwrap().stdout.unwrap(), b"hi\n");

    let mut port_forward = rt
        .port_forward(with_token(
            pb::PortForwardRequest {
                cluster: Some(cluster.into()),
                namespace: Some("default".into()),
                name: Some("web".into()),
                port: Some(8080),
            },
            token,
        ))
        .await
        .expect("port-forward")
        .into_inner();
    let pf_id = port_forward
        .next()
        .await
        .unwrap()
        .unwrap()
        .session_id
        .unwrap();
    rt.write_port_forward(with_token(
        pb::WritePortForwardRequest {
            session_id: Some(pf_id),
            data: Some(b"ping".to_vec()),
        },
        token,
    ))
    .await
    .expect("write port-forward");
    let back = tokio::time::timeout(WAIT, port_forward.next())
        .await
        .expect("echo");
    assert_eq!(back.unwrap().unwrap().data.unwrap(), b"ping");

    let unary = if unary {
        Some(stalled_write(rt, token, cluster).await)
    } else {
        None
    };
    InFlight {
        watch,
        exec,
        port_forward,
        unary,
    }
}

/// A WriteTTY still in flight: 1 MiB chunks to `sleep`, which reads no
/// stdin, until one waits for room (the session's input budget is full).
async fn stalled_write(
    mut rt: RuntimeServiceClient<Channel>,
    token: &str,
    cluster: &str,
) -> Pin<Box<dyn Future<Output = Result<(), tonic::Status>> + Send>> {
    let mut s = rt
        .execute_tty(with_token(exec_req(cluster, &["sleep", "600"]), token))
        .await
        .expect("exec sleep")
        .into_inner();
    let id = s.next().await.unwrap().unwrap().session_id.unwrap();
    // Keep the session's stream open for as long as the call is.
    tokio::spawn(async move { while s.next().await.is_some() {} });
    for _ in 0..256 {
        let (mut rt, req) = (
            rt.clone(),
            with_token(
                pb::WriteTtyRequest {
                    session_id: Some(id.clone()),
                    stdin: Some(vec![b'x'; 1 << 20]),
                },
                token,
            ),
        );
        let mut call: Pin<Box<dyn Future<Output = Result<(), tonic::Status>> + Send>> =
            Box::pin(async move { rt.write_tty(req).await.map(|_| ()) });
        tokio::select! {
            r = &mut call => r.expect("write while there is room"),
            _ = tokio::time::sleep(Duration::from_secs(2)) => return call,
        }
    }
    panic!("256 MiB of stdin were taken by a process that reads none");
}

/// Waits (bounded) for the end of a stream; returns the error it ended with.
async fn ends_with_error<T: std::fmt::Debug>(
    what: &str,
    s: &mut tonic::Streaming<T>,
) -> (tonic::Status, Duration) {
    let started = Instant::now();
    let end = tokio::time::timeout(ERROR_BOUND, async {
        loop {
            match s.next().await {
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Some(e),
                None => return None,
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: no error within {ERROR_BOUND:?} (a hang)"));
    let e = end.unwrap_or_else(|| panic!("{what}: ended cleanly, not with an error"));
    (e, started.elapsed())
}

/// The codes a caller may see when the process at the other end vanished:
/// Unavailable from the hub (agent gone), or the client's transport error
/// (hub gone: tonic reports a broken connection as Unavailable or Unknown
/// with the transport's message).
fn is_connection_loss(e: &tonic::Status) -> bool {
    e.code() == Code::Unavailable
        || (e.code() == Code::Unknown
            && ["transport", "connection", "stream", "reset", "broken"]
                .iter()
                .any(|w| e.message().to_ascii_lowercase().contains(w)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hub_killed_mid_call_then_restarted_on_the_same_data() {
    let sim = kube_sim::KubeSim::start(sim_config().pod("default", "web", &["app"]))
        .await
        .expect("kube-sim");
    sim.add_pod_port("default", "web", 8080, echo_server().await);
    let mut fleet = Fleet::start(&sim).await;
    let channel = fleet.channel().await;
    let before = fleet.all_connected(&channel).await;
    let token = fleet.admin_token.clone();

    let mut calls = Vec::new();
    for (i, a) in fleet.agents.iter().enumerate() {
        calls.push(start_calls(&channel, &token, &a.cluster, i == 0).await);
    }
    for i in 0..fleet.agents.len() {
        let m = fleet.agent_metrics(i).await;
        let want = if i == 0 { (2.0, 1.0) } else { (1.0, 1.0) };
        assert_eq!(sessions(&m), want, "agent {i} before the crash:\n{m}");
        assert_eq!(metric(&m, "otter_agent_registrations_total"), 1.0);
    }

    // SIGKILL: no goodbye to the callers or the agents.
    fleet.hub.as_mut().expect("hub").kill9();
    let killed = Instant::now();
    for (i, c) in calls.iter_mut().enumerate() {
        for (what, (e, took)) in [
            ("watch", ends_with_error("watch", &mut c.watch).await),
            ("exec", ends_with_error("exec", &mut c.exec).await),
            (
                "port-forward",
                ends_with_error("port-forward", &mut c.port_forward).await,
            ),
        ] {
            eprintln!(
                "edge-{i} {what}: {:?} {:?} after {took:?}",
                e.code(),
                e.message()
            );
            assert!(is_connection_loss(&e), "edge-{i} {what}: {e:?}");
        }
        if let Some(unary) = c.unary.take() {
            let e = tokio::time::timeout(ERROR_BOUND, unary)
                .await
                .expect("the stalled WriteTTY ends, no hang")
                .expect_err("an error, not a success");
            eprintln!("edge-{i} unary WriteTTY: {:?} {:?}", e.code(), e.message());
            assert!(is_connection_loss(&e), "unary: {e:?}");
        }
    }
    eprintln!(
        "every caller had its error {:?} after the kill",
        killed.elapsed()
    );

    // The agents end what the dead hub's streams were carrying.
    for i in 0..fleet.agents.len() {
        let m = until_metrics(
            "agent sessions and streams end with the hub",
            || fleet.agent_metrics(i),
            |m| sessions(m) == (0.0, 0.0) && metric(m, "otter_agent_tunnel_streams") == 0.0,
        )
        .await;
        assert_eq!(metric(&m, "otter_agent_tunnel_up"), 0.0, "{m}");
    }

    let restarted = Instant::now();
    fleet.start_hub();
    let channel = fleet.channel().await;
    let after = fleet.all_connected(&channel).await;
    eprintln!(
        "all agents back {:?} after the hub restarted",
        restarted.elapsed()
    );
    for l in &before {
        let now = after
            .iter()
            .find(|a| a.cluster == l.cluster)
            .unwrap_or_else(|| panic!("link {:?} lost: {after:?}", l.cluster));
        assert_eq!(now.agent_id, l.agent_id);
        assert_eq!(
            now.certificate_serial, l.certificate_serial,
            "same certificate"
        );
        assert_eq!(now.first_seen, l.first_seen);
    }
    for i in 0..fleet.agents.len() {
        let m = until_metrics(
            "agent reconnected",
            || fleet.agent_metrics(i),
            |m| metric(m, "otter_agent_tunnel_up") == 1.0,
        )
        .await;
        assert_eq!(metric(&m, "otter_agent_connects_total"), 2.0, "{m}");
        assert_eq!(
            metric(&m, "otter_agent_registrations_total"),
            1.0,
            "no new Register: {m}"
        );
        assert_eq!(sessions(&m), (0.0, 0.0), "no orphaned session: {m}");
    }
    let hub = fleet.hub_metrics().await;
    for outcome in ["registered", "renewed"] {
        let name = format!("otter_hub_registers_total{{outcome=\"{outcome}\"}}");
        assert_eq!(
            metric(&hub, &name),
            0.0,
            "no Register after the restart: {hub}"
        );
    }
    // The restarted hub serves calls again.
    let back = start_calls(&channel, &token, "edge-1", false).await;
    drop(back);
    drop(fleet);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_exec_and_port_forward() {
    let sim = kube_sim::KubeSim::start(sim_config().pod("default", "web", &["app"]))
        .await
        .expect("kube-sim");
    sim.add_pod_port("default", "web", 8080, echo_server().await);
    let mut fleet = Fleet::start(&sim).await;
    let channel = fleet.channel().await;
    fleet.all_connected(&channel).await;
    let token = fleet.admin_token.clone();
    let idle = fleet.hub_metrics().await;
    let baseline = metric(&idle, "otter_hub_calls_in_flight");

    let mut calls = Vec::new();
    for a in &fleet.agents {
        calls.push(start_calls(&channel, &token, &a.cluster, false).await);
    }
    let busy = fleet.hub_metrics().await;
    assert_eq!(
        metric(&busy, "otter_hub_calls_in_flight"),
        baseline + 3.0 * fleet.agents.len() as f64,
        "{busy}"
    );

    for (i, c) in calls.iter_mut().enumerate() {
        let transport = fleet.agents[i].transport;
        fleet.agents[i].proc.as_mut().expect("agent").kill9();
        for (what, (e, took)) in [
            ("exec", ends_with_error("exec", &mut c.exec).await),
            (
                "port-forward",
                ends_with_error("port-forward", &mut c.port_forward).await,
            ),
            ("watch", ends_with_error("watch", &mut c.watch).await),
        ] {
            eprintln!(
                "agent over {transport} killed, {what}: {:?} after {took:?}",
                e.code()
            );
            assert_eq!(e.code(), Code::Unavailable, "{transport} {what}: {e:?}");
            assert!(e.message().contains(&fleet.agents[i].cluster), "{e:?}");
        }
    }
    let m = until_metrics(
        "hub back to its baseline",
        || fleet.hub_metrics(),
        |m| {
            metric(m, "otter_hub_calls_in_flight") == baseline
                && metric(m, "otter_hub_tunnels{transport=\"quic\"}") == 0.0
                && metric(m, "otter_hub_tunnels{transport=\"h2\"}") == 0.0
        },
    )
    .await;
    eprintln!(
        "hub after the agents died: calls in flight {}, tunnels 0",
        metric(&m, "otter_hub_calls_in_flight")
    );

    // Restarted agents come back on the certificate they kept.
    for i in 0..fleet.agents.len() {
        fleet.start_agent(i);
    }
    fleet.all_connected(&channel).await;
    for i in 0..fleet.agents.len() {
        let m = until_metrics(
            "agent reconnected",
            || fleet.agent_metrics(i),
            |m| metric(m, "otter_agent_tunnel_up") == 1.0,
        )
        .await;
        assert_eq!(
            metric(&m, "otter_agent_registrations_total"),
            0.0,
            "kept its certificate: {m}"
        );
        assert_eq!(sessions(&m), (0.0, 0.0), "{m}");
    }
    drop(fleet);
    sim.shutdown().await;
}
