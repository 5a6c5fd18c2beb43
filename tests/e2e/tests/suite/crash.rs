//! Crashes of real processes: the hub or an agent killed with SIGKILL in
//! the middle of calls (a unary call, a Watch, an exec, a port-forward).
//! Callers get an error within a bounded time, never a hang; a restarted
//! hub gets its agents back on their existing certificates with the links
//! intact; nothing is left behind on either side (agent streams and
//! sessions, hub calls in flight and tunnels, all counted).

use std::{
    pin::Pin,
    time::{Duration, Instant},
};

use futures::{Future, StreamExt};
use otter_e2e::{
    double::WAIT,
    fleet::{Fleet, metric, metric_if_present, until_metrics},
    kube::sim_config,
    procs::echo_server,
    with_token,
};
use otter_proto::{
    link::v1::{RegisterRequest, link_service_client::LinkServiceClient},
    resource::v1::{WatchRequest, resource_service_client::ResourceServiceClient},
    runtime::v1::{self as pb, runtime_service_client::RuntimeServiceClient},
};
use tonic::{Code, transport::Channel};

/// How long a caller may wait for its error once a process died. QUIC
/// notices a dead peer after three keepalive intervals (1 s here).
const ERROR_BOUND: Duration = Duration::from_secs(10);

fn sessions(text: &str) -> (f64, f64) {
    (
        metric(text, "otter_agent_sessions{kind=\"exec\"}"),
        metric(text, "otter_agent_sessions{kind=\"port-forward\"}"),
    )
}

/// A unary call in flight.
type PendingCall = Pin<Box<dyn Future<Output = Result<(), tonic::Status>> + Send>>;

/// The calls a crash interrupts, all on one cluster.
struct InFlight {
    watch: tonic::Streaming<otter_proto::resource::v1::WatchEvent>,
    /// The pod's log, followed.
    log: tonic::Streaming<pb::PodLogResponse>,
    exec: tonic::Streaming<pb::ExecuteTtyResponse>,
    port_forward: tonic::Streaming<pb::PortForwardResponse>,
    /// A WriteTTY stalled on a process that does not read its stdin.
    unary: Option<PendingCall>,
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
    let mut log = rt
        .pod_log(with_token(
            pb::PodLogRequest {
                cluster: Some(cluster.into()),
                namespace: Some("default".into()),
                name: Some("web".into()),
                follow: Some(true),
                ..Default::default()
            },
            token,
        ))
        .await
        .expect("log")
        .into_inner();
    let first = tokio::time::timeout(WAIT, log.next())
        .await
        .expect("a log line");
    assert!(matches!(first, Some(Ok(_))), "{first:?}");
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
        log,
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
) -> PendingCall {
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
        let mut call: PendingCall = Box::pin(async move { rt.write_tty(req).await.map(|_| ()) });
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
    let mut fleet = Fleet::start(&sim, &["quic", "h2"]).await;
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
            ("log", ends_with_error("log", &mut c.log).await),
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
        // "None happened yet" on a fresh hub: the labelled counter appears
        // with its first Register, so absent and 0 both mean none (any
        // other value fails).
        assert!(
            matches!(metric_if_present(&hub, &name), None | Some(0.0)),
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
    let mut fleet = Fleet::start(&sim, &["quic", "h2"]).await;
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
        baseline + 4.0 * fleet.agents.len() as f64,
        "{busy}"
    );

    // Exec and port-forward are bound to the tunnel and end with it; the
    // Watches and followed logs wait for the clusters to come back (the
    // hub's grace).
    for (i, c) in calls.iter_mut().enumerate() {
        let transport = fleet.agents[i].transport;
        fleet.agents[i].proc.as_mut().expect("agent").kill9();
        for (what, (e, took)) in [
            ("exec", ends_with_error("exec", &mut c.exec).await),
            (
                "port-forward",
                ends_with_error("port-forward", &mut c.port_forward).await,
            ),
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
    // Each Watch went on across its agent's death and restart, from the
    // last event it passed: the next pod comes once, and nothing before it
    // comes again.
    sim.create_object(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "after-restart", "namespace": "default"},
        "spec": {"containers": [{"name": "app", "image": "app"}]},
    }))
    .expect("a pod made after the restart");
    for (i, c) in calls.iter_mut().enumerate() {
        let transport = fleet.agents[i].transport;
        let mut names = Vec::new();
        while !names.iter().any(|n| n == "after-restart") {
            let ev = tokio::time::timeout(WAIT, c.watch.next())
                .await
                .unwrap_or_else(|_| panic!("{transport}: the watch went quiet; saw {names:?}"))
                .unwrap_or_else(|| panic!("{transport}: the watch ended; saw {names:?}"))
                .unwrap_or_else(|e| panic!("{transport}: the watch failed: {e:?}"));
            if ev.r#type != Some(otter_proto::resource::v1::watch_event::Type::Bookmark as i32) {
                names.push(otter_e2e::double::event_name(&ev));
            }
        }
        eprintln!("agent over {transport} killed and restarted, watch: then {names:?}");
        assert_eq!(
            names,
            ["after-restart"],
            "{transport}: lost or repeated events"
        );
    }
    // And each followed log goes on from its last line: the next line
    // comes once, nothing before it again.
    sim.append_log("default", "web", "app", "after-restart");
    for (i, c) in calls.iter_mut().enumerate() {
        let transport = fleet.agents[i].transport;
        let mut text = String::new();
        while !text.ends_with('\n') || !text.contains("after-restart") {
            let chunk = tokio::time::timeout(WAIT, c.log.next())
                .await
                .unwrap_or_else(|_| panic!("{transport}: the log went quiet; got {text:?}"))
                .unwrap_or_else(|| panic!("{transport}: the log ended; got {text:?}"))
                .unwrap_or_else(|e| panic!("{transport}: the log failed: {e:?}"));
            text.push_str(&String::from_utf8_lossy(&chunk.data.unwrap_or_default()));
        }
        eprintln!("agent over {transport} killed and restarted, log: then {text:?}");
        assert_eq!(
            text, "after-restart\n",
            "{transport}: lost or repeated lines"
        );
    }
    drop(fleet);
    sim.shutdown().await;
}

/// An agent killed without a goodbye over QUIC (no TCP reset tells the
/// hub): `otter links` shows it `Unresponsive` once it has missed a
/// keepalive, then `Offline` when the keepalive timeout ends its tunnel;
/// never `Connected … 0s` all that time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_agent_shows_unresponsive_then_offline() {
    let sim = kube_sim::KubeSim::start(sim_config())
        .await
        .expect("kube-sim");
    // Keepalives every 3 s: Unresponsive after two silent intervals,
    // Offline after three (QUIC's idle timeout), a window wide enough for
    // the CLI to look in.
    let mut fleet = Fleet::start_with_keepalive(&sim, &["quic"], 3).await;
    let channel = fleet.channel().await;
    fleet.all_connected(&channel).await;
    let login = otter_cli(&fleet, "links-before", &["links"]);
    assert!(login.contains("Connected"), "{login}");

    fleet.agents[0].proc.as_mut().expect("agent").kill9();
    let killed = Instant::now();
    let state = |links: &[otter_proto::link::v1::Link]| {
        links[0]
            .state
            .and_then(|s| otter_proto::link::v1::LinkState::try_from(s).ok())
    };
    let mut unresponsive = None;
    let mut shown = String::new();
    let offline = loop {
        let links = fleet.links(&channel).await;
        match state(&links) {
            Some(otter_proto::link::v1::LinkState::Unresponsive) if unresponsive.is_none() => {
                unresponsive = Some(killed.elapsed());
                shown = otter_cli(&fleet, "links-after", &["links"]);
            }
            Some(otter_proto::link::v1::LinkState::Offline) => break killed.elapsed(),
            _ => {}
        }
        assert!(
            killed.elapsed() < WAIT,
            "the killed agent's link never went offline"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let unresponsive = unresponsive.expect("Unresponsive before Offline");
    eprintln!(
        "agent killed over QUIC (3 s keepalives): Unresponsive after {unresponsive:?}, Offline after {offline:?}; otter links showed:\n{shown}"
    );
    let row = shown
        .lines()
        .find(|l| l.starts_with("edge-0"))
        .unwrap_or_else(|| panic!("{shown}"));
    assert!(row.contains("Unresponsive"), "{shown}");
    // LAST SEEN is the last sign of life, not "0s".
    assert!(!row.contains(" 0s"), "{shown}");
    assert!(unresponsive < offline);
    drop(fleet);
    sim.shutdown().await;
}

/// Runs the `otter` CLI against the fleet's hub as its admin; `name` names
/// its output files.
fn otter_cli(fleet: &Fleet, name: &str, args: &[&str]) -> String {
    let ca = fleet.dir.path().join("hub-ca.pem");
    std::fs::write(&ca, &fleet.ca_pem).expect("CA file");
    let mut all: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    all.extend([
        "--hub".into(),
        format!("https://localhost:{}", fleet.api),
        "--token".into(),
        fleet.admin_token.clone(),
        "--ca-file".into(),
        ca.display().to_string(),
    ]);
    let mut p = otter_e2e::procs::Proc::start_env(
        name,
        otter_e2e::procs::Role::Otter,
        &all,
        fleet.dir.path(),
        None,
        &[(
            "OTTER_CONFIG",
            &fleet.dir.path().join("otter.toml").display().to_string(),
        )],
    );
    let code = p.wait(WAIT);
    assert_eq!(code, Some(0), "{}", p.tail(20));
    p.stdout()
}

/// A hub that falls behind its QUIC socket (frozen here with SIGSTOP, as a
/// reconnect storm's first packets outrun two busy cores) loses datagrams
/// in the kernel, and says how many on `/metrics`, so an operator sees when
/// `net.core.rmem_max` is too small. Afterwards it serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_behind_its_quic_socket_counts_the_drops() {
    let sim = kube_sim::KubeSim::start(sim_config())
        .await
        .expect("kube-sim");
    let fleet = Fleet::start(&sim, &["quic"]).await;
    let channel = fleet.channel().await;
    fleet.all_connected(&channel).await;
    let before = metric(&fleet.hub_metrics().await, "otter_hub_quic_socket_drops");

    // Far more than the hub's buffer holds (32 MiB asked; about 2.3 KiB of
    // it per small datagram on loopback), sent while it reads nothing.
    const SENT: u64 = 80_000;
    let pid = fleet.hub.as_ref().expect("hub").pid().to_string();
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, pid.as_str()])
            .status()
            .expect("kill")
            .success();
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    let junk = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    let datagram = [0x5a_u8; 1200];
    for _ in 0..SENT {
        // Loopback: a datagram the receiver has no room for is dropped at
        // its socket, not held back here.
        let _ = junk.send_to(&datagram, ("127.0.0.1", fleet.tunnel));
    }
    signal("-CONT");

    let m = until_metrics(
        "the drops counted",
        || fleet.hub_metrics(),
        |m| metric(m, "otter_hub_quic_socket_drops") > before,
    )
    .await;
    let dropped = metric(&m, "otter_hub_quic_socket_drops") - before;
    eprintln!("quic socket: {SENT} junk datagrams sent to a frozen hub, {dropped} dropped");
    assert!(dropped <= SENT as f64, "{m}");
    // The hub and its QUIC agent go on.
    fleet.all_connected(&channel).await;
    drop(fleet);
    sim.shutdown().await;
}

/// A Register the hub answered is on disk: the hub killed with SIGKILL the
/// moment the certificates arrived keeps the links, with those
/// certificates' serials, when it starts again on the same data. (The
/// embedded store writes to disk on its own every half second; Register
/// flushes before it answers, while a tunnel's first write waits for the
/// next batch of last-seen times.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_register_answered_survives_a_kill_at_once() {
    let sim = kube_sim::KubeSim::start(sim_config())
        .await
        .expect("kube-sim");
    let mut fleet = Fleet::start_hub_only(&sim, &["quic", "h2", "quic"]).await;
    let channel = fleet.channel().await;
    let link = LinkServiceClient::new(channel);
    // Three at once.
    let registers = (0..3).map(|i| {
        let token =
            std::fs::read_to_string(fleet.dir.path().join(format!("token-{i}"))).expect("token");
        let (_key, csr) = otter_pki::csr::generate(&format!("edge-{i}"), "a1").expect("csr");
        let mut link = link.clone();
        async move {
            link.register(RegisterRequest {
                cluster: Some(format!("edge-{i}")),
                csr: Some(csr.into_bytes()),
                agent_id: Some("a1".into()),
                agent_version: Some("v0.1.0".into()),
                rancher_project_id: None,
                join_token: Some(token),
            })
            .await
            .expect("registered")
            .into_inner()
        }
    });
    let answers = futures::future::join_all(registers).await;
    fleet.hub.as_mut().expect("hub").kill9();

    fleet.start_hub();
    let links = fleet.links(&fleet.channel().await).await;
    for (i, answer) in answers.iter().enumerate() {
        let pem =
            std::str::from_utf8(answer.certificate.as_deref().expect("certificate")).expect("PEM");
        let der = otter_pki::tls::parse_certs(pem).expect("certificate")[0].clone();
        let serial = otter_pki::identity::PeerCertificate::from_der(&der)
            .expect("ours")
            .serial;
        let kept = links
            .iter()
            .find(|l| l.cluster.as_deref() == Some(&format!("edge-{i}")))
            .unwrap_or_else(|| panic!("edge-{i} lost in the crash: {links:?}"));
        assert_eq!(kept.agent_id.as_deref(), Some("a1"));
        assert_eq!(kept.certificate_serial.as_deref(), Some(serial.as_str()));
    }
    // Nothing else dials: `link` was the only caller.
    drop(link);
    drop(fleet);
    sim.shutdown().await;
}
