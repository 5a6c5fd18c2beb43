//! `otter-agent doctor` against a real hub on loopback, healthy and then
//! with one fault at a time: UDP to the tunnel port dropped, a clock ten
//! minutes off, the tunnel port behind something that re-signs TLS, a hub
//! name that does not resolve, nothing to join with. Each fault shows as
//! its own check with its fix; the others stay ok.

use std::sync::Arc;

use otter_agent::{
    AgentConfig,
    doctor::{self, Check, Verdict},
    identity::IdentityStore,
};
use otter_e2e::{Relay, TestHub, double::start_agent_with, with_token};
use otter_proto::{
    fleet::v1::{DescribeLinkRequest, fleet_service_client::FleetServiceClient},
    link::v1::LinkState,
};
use otter_tunnel::TransportKind;

fn verdict_of(checks: &[Check], name: &str) -> (Verdict, String) {
    checks
        .iter()
        .find(|c| c.name == name)
        .map(|c| (c.verdict, c.detail.clone()))
        .unwrap_or_else(|| panic!("no {name} check:\n{}", doctor::render(checks)))
}

/// Every check but `except` passed.
fn others_ok(checks: &[Check], except: &[&str]) {
    for c in checks.iter().filter(|c| !except.contains(&c.name)) {
        assert_eq!(
            c.verdict,
            Verdict::Ok,
            "{} should pass:\n{}",
            c.name,
            doctor::render(checks)
        );
    }
}

/// A TLS server on loopback showing a certificate for `localhost` from a
/// CA of its own, as a middlebox that inspects TLS would.
async fn re_signing_server() -> std::net::SocketAddr {
    let ca = otter_pki::CertificateAuthority::generate("inspecting middlebox").unwrap();
    let (cert, key) = ca.issue_server_cert(&["localhost".into()]).unwrap();
    otter_e2e::tls_server(&cert, &key, otter_tunnel::h2::ALPN).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_doctor_names_what_stands_between_the_agent_and_its_hub() {
    // The tunnel URLs lead through a relay, where UDP can be dropped and
    // the target swapped for a re-signing server.
    let relay = Relay::start().await;
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| {
        let port = relay.addr.port();
        c.tunnel_urls = ["quic", "h2"]
            .iter()
            .map(|s| url::Url::parse(&format!("{s}://localhost:{port}")).unwrap())
            .collect();
    })
    .await;
    relay.set_target(hub.hub.tunnel_addr);
    // An agent enrolled once, its identity kept.
    let state = tempfile::tempdir().unwrap();
    let keep = || Some(IdentityStore::Dir(state.path().to_owned()));
    otter_e2e::double::enrolled_once(&hub, "edge-1", "a1", state.path()).await;
    let config = |tweak: &dyn Fn(&mut AgentConfig)| {
        let mut c = AgentConfig::new(hub.api_url(), "edge-1", "a1", hub.hub.ca_pem());
        c.state = keep();
        c.transports = vec![TransportKind::Quic, TransportKind::H2];
        tweak(&mut c);
        c
    };

    let healthy = doctor::run(&config(&|_| {})).await;
    println!("healthy:\n{}", doctor::render(&healthy));
    let names: Vec<&str> = healthy.iter().map(|c| c.name).collect();
    for name in [
        "dns",
        "proxy",
        "api-tcp",
        "api-tls",
        "clock",
        "tunnel-tcp",
        "tunnel-tls",
        "quic",
        "path-mtu",
        "identity",
    ] {
        assert!(names.contains(&name), "{name} missing: {names:?}");
    }
    others_ok(&healthy, &[]);
    let (_, detail) = verdict_of(&healthy, "path-mtu");
    assert!(detail.contains("datagrams of 1472 bytes"), "{detail}");

    // A path that loses datagrams above 1400 bytes: QUIC still works, with
    // smaller packets, and the doctor says how large they may be; below
    // QUIC's 1200 bytes, QUIC gets no answer at all.
    relay.limit_datagrams(1400);
    let checks = doctor::run(&config(&|_| {})).await;
    println!("datagrams up to 1400 bytes:\n{}", doctor::render(&checks));
    let (v, detail) = verdict_of(&checks, "path-mtu");
    assert_eq!(v, Verdict::Ok, "{detail}");
    assert!(detail.contains("up to 1400 bytes"), "{detail}");
    others_ok(&checks, &[]);
    relay.limit_datagrams(1100);
    let checks = doctor::run(&config(&|_| {})).await;
    println!("datagrams up to 1100 bytes:\n{}", doctor::render(&checks));
    let (v, detail) = verdict_of(&checks, "quic");
    assert_eq!(v, Verdict::Warn, "{detail}");
    assert!(detail.contains("1200 bytes"), "{detail}");
    assert_eq!(verdict_of(&checks, "path-mtu").0, Verdict::Skip);
    others_ok(&checks, &["quic", "path-mtu"]);
    relay.limit_datagrams(usize::MAX);

    // UDP dropped on the way to the tunnel port.
    relay.block_udp(true);
    let checks = doctor::run(&config(&|_| {})).await;
    println!("UDP blocked:\n{}", doctor::render(&checks));
    let (v, detail) = verdict_of(&checks, "quic");
    assert_eq!(v, Verdict::Warn, "{detail}");
    assert!(
        detail.contains("UDP") && detail.contains("HTTP/2"),
        "{detail}"
    );
    others_ok(&checks, &["quic", "path-mtu"]);
    relay.block_udp(false);

    // This agent's clock ten minutes ahead.
    let checks = doctor::run(&config(&|c| c.clock.offset_secs = 600)).await;
    println!("clock ahead:\n{}", doctor::render(&checks));
    let (v, detail) = verdict_of(&checks, "clock");
    assert_eq!(v, Verdict::Fail, "{detail}");
    assert!(
        detail.contains("ahead of") && detail.contains("NTP"),
        "{detail}"
    );

    // Something on the way to the tunnel port re-signs TLS.
    relay.set_target(re_signing_server().await);
    let checks = doctor::run(&config(&|c| c.transports = vec![TransportKind::H2])).await;
    println!("tunnel port re-signed:\n{}", doctor::render(&checks));
    let (v, detail) = verdict_of(&checks, "tunnel-tls");
    assert_eq!(v, Verdict::Fail, "{detail}");
    assert!(
        detail.contains("something on the way re-signs TLS")
            && detail.contains("without inspection"),
        "{detail}"
    );
    others_ok(&checks, &["tunnel-tls", "quic", "path-mtu"]);
    relay.set_target(hub.hub.tunnel_addr);

    // A hub name that does not resolve; nothing to join with.
    let checks = doctor::run(&config(&|c| {
        c.hub_url = url::Url::parse("https://hub.invalid:8443").unwrap();
        c.state = None;
    }))
    .await;
    println!("unknown name, no identity:\n{}", doctor::render(&checks));
    let (v, detail) = verdict_of(&checks, "dns");
    assert_eq!(v, Verdict::Fail, "{detail}");
    assert!(
        detail.contains("hub.invalid") && detail.contains("DNS"),
        "{detail}"
    );
    let (v, detail) = verdict_of(&checks, "identity");
    assert_eq!(v, Verdict::Fail, "{detail}");
    assert!(
        detail.contains("otter agent-manifest --cluster edge-1"),
        "{detail}"
    );
    hub.hub.shutdown().await;
}

/// The doctor beside a live tunnel (an owner runs `otter-agent doctor` on
/// a working agent, or the agent runs it itself after a few failed rounds
/// just as its hub comes back) leaves that tunnel alone: its QUIC check
/// carries no identity and is not a tunnel, so the hub admits nothing and
/// replaces nothing. (It used to present the agent's certificate: the hub
/// admitted the check and closed the agent's tunnel as replaced.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_doctor_beside_a_live_tunnel_leaves_it_alone() {
    let hub = TestHub::start().await;
    let state = tempfile::tempdir().unwrap();
    let keep = IdentityStore::Dir(state.path().to_owned());
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::Quic, |c| {
        c.state = Some(keep.clone());
    });
    let up = agent
        .agent
        .wait_for(std::time::Duration::from_secs(60), |s| {
            s.connected == Some(TransportKind::Quic)
        })
        .await
        .expect("the agent connects over QUIC");

    let mut config = AgentConfig::new(hub.api_url(), "edge-1", "a1", hub.hub.ca_pem());
    config.state = Some(keep);
    config.transports = vec![TransportKind::Quic, TransportKind::H2];
    for _ in 0..3 {
        let checks = doctor::run(&config).await;
        let (v, detail) = verdict_of(&checks, "quic");
        assert_eq!(v, Verdict::Ok, "{detail}");
        // The doctor had the agent's identity to hand.
        let (v, detail) = verdict_of(&checks, "identity");
        assert_eq!(v, Verdict::Ok, "{detail}");
    }
    // A replaced tunnel is drained and closed at once when idle: well
    // within this.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let now = agent.agent.status();
    assert_eq!(now.connected, Some(TransportKind::Quic));
    assert_eq!(
        (now.connects, now.last_tunnel_end.map(|e| e.to_string())),
        (up.connects, None),
        "the agent's tunnel was closed beside the doctor"
    );
}

/// An agent whose tunnel never comes up runs the doctor itself after a few
/// failed rounds, keeps what it found in its status and logs it: here the
/// hub lists a tunnel port where nothing listens, and the doctor says so
/// while the API port answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_cannot_connect_runs_the_doctor_itself() {
    let closed = otter_e2e::tools::free_port();
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| {
        c.tunnel_urls = vec![url::Url::parse(&format!("h2://localhost:{closed}")).unwrap()];
    })
    .await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::H2, |c| {
        c.transports = vec![TransportKind::H2];
    });
    let status = agent
        .agent
        .wait_for(std::time::Duration::from_secs(60), |s| !s.doctor.is_empty())
        .await
        .expect("the agent ran its doctor");
    println!("{}", doctor::render(&status.doctor));
    assert!(status.connected.is_none());
    assert!(
        status.dials >= otter_agent::tunnel::DOCTOR_AFTER_ROUNDS,
        "{}",
        status.dials
    );
    let (v, detail) = verdict_of(&status.doctor, "tunnel-tcp");
    assert_eq!(v, Verdict::Fail, "{detail}");
    assert!(detail.contains(&closed.to_string()), "{detail}");
    others_ok(
        &status.doctor,
        &["tunnel-tcp", "tunnel-tls", "quic", "path-mtu"],
    );

    // The port opens (a forwarder to the hub's tunnel port): the agent
    // connects, and the hub shows what its doctor found to the tenant's
    // admins, not to a member.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", closed))
        .await
        .unwrap();
    let tunnel = hub.hub.tunnel_addr;
    let forwarder = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(tunnel).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    agent
        .agent
        .wait_for(std::time::Duration::from_secs(60), |s| {
            s.connected.is_some()
        })
        .await
        .expect("the agent connects once the port is open");
    let channel = hub.channel().await;
    let describe = |token: String| {
        let channel = channel.clone();
        async move {
            FleetServiceClient::new(channel)
                .describe_link(with_token(
                    DescribeLinkRequest {
                        cluster: Some("edge-1".into()),
                    },
                    &token,
                ))
                .await
                .unwrap()
                .into_inner()
        }
    };
    // The hub asks for the agent's report once the tunnel is up.
    let mut described = describe(hub.admin_token.clone()).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while described.doctor_checks.is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        described = describe(hub.admin_token.clone()).await;
    }
    let tcp = described
        .doctor_checks
        .iter()
        .find(|c| c.name() == "tunnel-tcp")
        .unwrap_or_else(|| panic!("{described:?}"));
    assert_eq!(tcp.verdict(), "fail");
    assert!(tcp.detail().contains(&closed.to_string()), "{tcp:?}");
    assert_eq!(described.doctor_checks.len(), status.doctor.len());
    assert!(described.doctor_ran_at.is_some());
    let link = described.link.unwrap();
    assert_eq!(link.state, Some(LinkState::Connected as i32));
    let member = hub.hub.mint_api_token("mia", &[]).unwrap();
    let seen = describe(member).await;
    assert!(seen.doctor_checks.is_empty() && seen.link.unwrap().diagnosis.is_none());
    forwarder.abort();
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}
