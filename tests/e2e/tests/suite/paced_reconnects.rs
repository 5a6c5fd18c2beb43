//! Paced reconnects: a hub restarted under 200 agents (in this process,
//! real TLS on loopback, a third each over QUIC, TLS + HTTP/2 and
//! WebSocket) sets up at most its configured number of tunnels at once and
//! tells the others when to come back; each agent waits at least that
//! long before it dials again, so none retries faster than the hint allows.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use otter_e2e::{
    TestHub,
    double::{TestAgent, WAIT, start_agent, start_agent_with},
    procs::free_port,
    with_token,
};
use otter_proto::link::v1::{LinkState, ListLinksRequest, link_service_client::LinkServiceClient};
use otter_tunnel::TransportKind;

const AGENTS: usize = 200;
/// Tunnels the hub sets up at once.
const CONCURRENCY: usize = 8;
/// What refused agents are told.
const HINT: Duration = Duration::from_millis(300);
/// Bound of getting every agent connected.
const ALL_BACK: Duration = Duration::from_secs(90);

fn paced(c: &mut otter_hub::HubConfig) {
    c.max_concurrent_admissions = CONCURRENCY;
    c.admission_retry_after = HINT;
}

async fn connected(hub: &TestHub, channel: &tonic::transport::Channel) -> usize {
    let _ = hub;
    LinkServiceClient::new(channel.clone())
        .list_links(with_token(ListLinksRequest {}, &hub.admin_token))
        .await
        .map(|r| {
            r.into_inner()
                .links
                .iter()
                .filter(|l| l.state == Some(LinkState::Connected as i32))
                .count()
        })
        .unwrap_or(0)
}

/// Waits (bounded) until every agent's link is up at the hub and every
/// agent says so; returns how long it took.
async fn all_connected(hub: &TestHub, agents: &[TestAgent]) -> Duration {
    let started = Instant::now();
    let channel = hub.channel().await;
    loop {
        let agents_up = agents.iter().all(|a| a.agent.status().connected.is_some());
        if agents_up && connected(hub, &channel).await == agents.len() {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < ALL_BACK,
            "only {} of {} agents connected after {ALL_BACK:?}",
            connected(hub, &channel).await,
            agents.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The most spans open at one moment (an end and a start at the same
/// instant do not overlap).
fn most_at_once(spans: &[(Instant, Instant)]) -> usize {
    let mut edges: Vec<(Instant, i32)> = spans
        .iter()
        .flat_map(|&(start, end)| [(start, 1), (end, -1)])
        .collect();
    edges.sort();
    let (mut open, mut most) = (0i32, 0i32);
    for (_, step) in edges {
        open += step;
        most = most.max(open);
    }
    most as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_under_200_agents_is_paced() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    // The first connect is not what is measured: a wider gate keeps it short.
    // Ports of our choosing, outside the range the agents' own sockets use.
    let port = |p: u16| std::net::SocketAddr::from(([127, 0, 0, 1], p));
    let ports = (port(free_port()), port(free_port()));
    let hub = TestHub::start_with(dir.clone(), Some(ports), |c| {
        c.max_concurrent_admissions = AGENTS;
    })
    .await;
    let transports = [TransportKind::Quic, TransportKind::H2, TransportKind::Ws];
    let agents: Vec<TestAgent> = (0..AGENTS)
        .map(|i| {
            let cluster = format!("edge-{i}");
            let token = hub.hub.mint_join_token(&cluster).unwrap();
            // Impatient agents: while the hub is down they keep redialling
            // within 200 ms, so they come back as one wave.
            start_agent_with(&hub, &cluster, "a", &token, transports[i % 3], |c| {
                c.backoff_base = Duration::from_millis(50);
                c.backoff_cap = Duration::from_millis(200);
            })
        })
        .collect();
    let first = all_connected(&hub, &agents).await;
    eprintln!(
        "{AGENTS} agents connected in {first:?} (at most {} set up at once)",
        hub.hub.state.pacer.peak()
    );
    let before: Vec<_> = agents.iter().map(|a| a.agent.status()).collect();

    // Restart on the same ports and data, now with a narrow gate.
    let (hub, stopped) = restart_in_place(hub, dir, paced).await;
    let started = Instant::now();
    let back = all_connected(&hub, &agents).await;
    let since_stop = stopped.elapsed();
    let pacer = &hub.hub.state.pacer;
    eprintln!(
        "restart: hub down {:?}; all {AGENTS} agents back {back:?} after it started; \
         at most {} tunnels set up at once (limit {CONCURRENCY}), {} dials told to wait {HINT:?}",
        started - stopped,
        pacer.peak(),
        pacer.refused()
    );
    // The agents resumed the TLS sessions the hub made before the restart
    // (its ticket keys are in the store): at least as many resumptions as
    // agents, over each kind of port. QUIC agents too, though a QUIC try spends a
    // ticket even when nothing answers: while the hub's API port refused
    // connections they did not try, and kept their tickets.
    let tickets = &hub.hub.state.tickets;
    let (tcp, quic) = (tickets.tcp.accepted(), tickets.quic.accepted());
    let quic_agents = (0..AGENTS).filter(|i| i % 3 == 0).count() as u64;
    let tcp_agents = AGENTS as u64 - quic_agents;
    eprintln!(
        "restart: TLS sessions resumed: {tcp} over TCP ({tcp_agents} agents), \
         {quic} over QUIC ({quic_agents} agents)"
    );
    assert!(tcp >= tcp_agents, "{tcp} TCP sessions resumed");
    assert!(quic >= quic_agents, "{quic} QUIC sessions resumed");
    // From outside the hub: each agent's own span of its set-up (the hub's
    // first sign of admitting it to its answer to the diagnosis request),
    // which lies inside the hub's admission window; overlapping spans
    // across agents are set-ups the hub was running at once.
    let spans: Vec<_> = agents
        .iter()
        .flat_map(|a| a.agent.status().setups)
        .filter(|(start, _)| *start >= stopped)
        .collect();
    let seen_at_once = most_at_once(&spans);
    eprintln!(
        "agents' own spans: {} set-ups after the restart, at most {seen_at_once} at once",
        spans.len()
    );
    assert!(
        spans.len() >= AGENTS,
        "every agent's set-up after the restart was recorded"
    );
    assert!(
        seen_at_once <= CONCURRENCY,
        "the agents saw {seen_at_once} tunnels set up at once, over the hub's limit of {CONCURRENCY}"
    );
    assert!(
        pacer.peak() <= CONCURRENCY,
        "the hub set up {} tunnels at once, over its limit of {CONCURRENCY}",
        pacer.peak()
    );
    assert!(
        pacer.refused() > 0,
        "{AGENTS} agents coming back at once never met the limit of {CONCURRENCY}: the test shows nothing"
    );
    let text = {
        hub.hub
            .state
            .metrics
            .pacers(pacer, &hub.hub.state.register_pacer);
        hub.hub.state.metrics.render()
    };
    let metric = |name: &str| otter_agent::gauges::sample(&text, name);
    assert_eq!(
        metric("otter_hub_tunnel_admissions_max"),
        Some(CONCURRENCY as f64)
    );
    assert_eq!(
        metric("otter_hub_tunnel_refusals"),
        Some(pacer.refused() as f64)
    );

    // Per agent: every refusal was followed by a wait of at least the
    // hint, so refusals × hint fit in the time since the stop.
    let mut most_dials = 0;
    let mut refused_by_transport = [0u32; 3];
    let mut shortest = Duration::MAX;
    for (i, (a, b)) in agents.iter().zip(&before).enumerate() {
        let s = a.agent.status();
        let dials = s.dials - b.dials;
        let refusals = s.refusals - b.refusals;
        most_dials = most_dials.max(dials);
        refused_by_transport[i % 3] += refusals;
        assert!(
            HINT * refusals <= since_stop,
            "agent {i} was refused {refusals} times in {since_stop:?}: it did not wait {HINT:?} each time"
        );
        assert!(
            refusals < dials,
            "agent {i}: {refusals} refusals in {dials} dials"
        );
        // Every other failed dial (the hub was down) was followed by a
        // pause of at least the agent's 50 ms floor: no spinning.
        let other_failures = dials - 1 - refusals;
        assert!(
            HINT * refusals + Duration::from_millis(50) * other_failures <= since_stop,
            "agent {i}: {dials} dials ({refusals} refused) in {since_stop:?} is faster than its pauses allow"
        );
        if refusals > 0 {
            assert_eq!(
                s.last_retry_after,
                Some(HINT),
                "agent {i}: the hint arrived intact"
            );
            // Measured by the agent, refusal by refusal: never back before
            // the hint was up.
            let waited = s
                .shortest_wait_after_refusal
                .expect("an agent that was refused measured its wait");
            assert!(
                waited >= HINT,
                "agent {i} came back {waited:?} after a refusal, before the hint of {HINT:?}"
            );
            shortest = shortest.min(waited);
        }
    }
    eprintln!(
        "dial rounds per agent at most {most_dials}; refusals by transport (quic, h2, ws): {refused_by_transport:?}; \
         shortest wait after a refusal {shortest:?} (hint {HINT:?})"
    );
    // Each transport carries the refusal its own way (QUIC close reason,
    // a refusal line, 503 + Retry-After): each must have been exercised.
    for (transport, refused) in ["QUIC", "HTTP/2", "WebSocket"]
        .iter()
        .zip(refused_by_transport)
    {
        assert!(
            refused > 0,
            "no agent over {transport} was refused: the test shows nothing for it"
        );
    }
    // A refusal written on a connection whose agent had just given up on
    // its dial (its own timeout, on a loaded machine) is not seen: a few
    // in thousands, never more than one in a hundred.
    let (sent, seen) = (
        pacer.refused(),
        u64::from(refused_by_transport.iter().sum::<u32>()),
    );
    assert!(
        seen <= sent && sent - seen <= sent / 100,
        "refusals reached agents as refusals: {seen} of {sent}"
    );
    for a in agents {
        a.agent.shutdown().await;
    }
    hub.hub.shutdown().await;
}

/// New agents registering all at once: the hub signs at most its limit of
/// certificates at a time and tells the others when to come back; each
/// agent registers exactly once, after waiting at least the hint per
/// refusal.
/// Stops `hub` and starts it again on the same ports and data with
/// `configure`; also when it was stopped.
async fn restart_in_place(
    hub: TestHub,
    dir: Arc<tempfile::TempDir>,
    configure: fn(&mut otter_hub::HubConfig),
) -> (TestHub, Instant) {
    let addrs = (hub.hub.api_addr, hub.hub.tunnel_addr);
    let stopped = Instant::now();
    let stopped_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    hub.hub.shutdown().await;
    // Every tunnel the stop closed recorded when it was last seen, and the
    // hub wrote it before it let go of its store.
    {
        use otter_hub::store::StoreExt;
        let store = otter_hub::store::SledStore::open(dir.path()).expect("the stopped hub's store");
        let links: Vec<otter_hub::link_service::LinkRecord> =
            store.scan(otter_hub::store::tree::LINKS).unwrap();
        let stale: Vec<_> = links
            .iter()
            .filter(|l| !l.last_transport.is_empty() && l.last_seen < stopped_unix)
            .map(|l| (&l.cluster, l.last_seen))
            .collect();
        assert!(
            stale.is_empty(),
            "links last seen before the stop at {stopped_unix}: {stale:?}"
        );
        eprintln!("{} links last seen at the stop", links.len());
    }
    // A hub stopped inside this process leaves its QUIC endpoint draining
    // the connections it closed (three probe timeouts each, longer on a
    // loaded machine); a restarted process would find the port free at once.
    let stopped_at = Instant::now();
    // Bounded generously: this waits on the test's in-process stand-in for a
    // restart, not on anything the hub promises, and the suite's other
    // tests share the two cores.
    let deadline = stopped_at + Duration::from_secs(90);
    while std::net::UdpSocket::bind(addrs.1).is_err() {
        assert!(
            Instant::now() < deadline,
            "the stopped hub's QUIC port stayed bound"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "hub stopped in {:?}; its QUIC port drained {:?} later",
        stopped_at - stopped,
        stopped_at.elapsed()
    );
    (
        TestHub::start_with(dir, Some(addrs), configure).await,
        stopped,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quic_agent_whose_first_hub_url_is_gone_comes_back_after_a_restart() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let port = |p: u16| std::net::SocketAddr::from(([127, 0, 0, 1], p));
    let hub = TestHub::start_with(
        dir.clone(),
        Some((port(free_port()), port(free_port()))),
        |_| {},
    )
    .await;
    // The agent's first API URL leads nowhere any more (a replica retired
    // for good: nothing listens there); it registered through its second.
    let gone = url::Url::parse(&format!("https://localhost:{}/", free_port())).unwrap();
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent_with(&hub, "edge-1", "a", &token, TransportKind::Quic, |c| {
        c.more_hub_urls = vec![c.hub_url.clone()];
        c.hub_url = gone.clone();
        c.backoff_base = Duration::from_millis(50);
        c.backoff_cap = Duration::from_millis(500);
    });
    agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connected through the second URL");

    // While the hub is down the agent's QUIC dials fail; once it is back
    // they must be tried again, though the first URL still refuses.
    let (_hub, stopped) = restart_in_place(hub, dir, |_| {}).await;
    let back = agent
        .agent
        .wait_for(Duration::from_secs(60), |s| {
            s.connected.is_some() && s.connects >= 2
        })
        .await;
    let s = agent.agent.status();
    assert!(
        back.is_some(),
        "not back over QUIC: last error {:?}, attempts {:?}",
        s.last_error,
        s.attempts
    );
    eprintln!(
        "back over QUIC {:?} after the stop; dials {}",
        stopped.elapsed(),
        s.dials
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_registering_at_once_are_paced() {
    const NEW: usize = 100;
    // Signing runs without awaiting, so on two worker threads at most two
    // run at once: a gate of one is what can be exceeded here.
    const GATE: usize = 1;
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| {
        c.max_concurrent_registrations = GATE;
        c.admission_retry_after = HINT;
    })
    .await;
    let tokens: Vec<String> = (0..NEW)
        .map(|i| hub.hub.mint_join_token(&format!("new-{i}")).unwrap())
        .collect();
    let started = Instant::now();
    let agents: Vec<TestAgent> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| start_agent(&hub, &format!("new-{i}"), "a", t, TransportKind::H2))
        .collect();
    let took = all_connected(&hub, &agents).await;
    let since_start = started.elapsed();
    let gate = &hub.hub.state.register_pacer;
    eprintln!(
        "{NEW} new agents registered and connected in {took:?}; at most {} Register calls served at once (limit {GATE}), {} told to wait {HINT:?}",
        gate.peak(),
        gate.refused()
    );
    assert!(gate.peak() <= GATE, "{} registrations at once", gate.peak());
    assert!(
        gate.refused() > 0,
        "{NEW} agents at once never met the limit of {GATE}"
    );
    let mut refusals = 0;
    for (i, a) in agents.iter().enumerate() {
        let s = a.agent.status();
        assert_eq!(s.registrations, 1, "agent {i} registered once");
        assert!(
            HINT * s.refusals <= since_start,
            "agent {i} was turned away {} times in {since_start:?}",
            s.refusals
        );
        if s.refusals > 0 {
            let waited = s.shortest_wait_after_refusal.expect("wait measured");
            assert!(
                waited >= HINT,
                "agent {i} registered again {waited:?} after a refusal, before the hint of {HINT:?}"
            );
        }
        refusals += u64::from(s.refusals);
    }
    assert_eq!(
        refusals,
        gate.refused(),
        "every refusal reached an agent with its hint"
    );
    let text = {
        hub.hub.state.metrics.pacers(&hub.hub.state.pacer, gate);
        hub.hub.state.metrics.render()
    };
    assert_eq!(
        otter_agent::gauges::sample(&text, "otter_hub_registers_total{outcome=\"busy\"}"),
        Some(gate.refused() as f64),
        "{text}"
    );
    for a in agents {
        a.agent.shutdown().await;
    }
    hub.hub.shutdown().await;
}
