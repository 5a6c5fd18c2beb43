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
    double::{TestAgent, start_agent},
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_under_200_agents_is_paced() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir.clone(), None, paced).await;
    let transports = [TransportKind::Quic, TransportKind::H2, TransportKind::Ws];
    let agents: Vec<TestAgent> = (0..AGENTS)
        .map(|i| {
            let cluster = format!("edge-{i}");
            let token = hub.hub.mint_join_token(&cluster).unwrap();
            start_agent(&hub, &cluster, "a", &token, transports[i % 3])
        })
        .collect();
    let first = all_connected(&hub, &agents).await;
    eprintln!(
        "{AGENTS} agents connected in {first:?}; the hub set up at most {} at once and turned {} away",
        hub.hub.state.pacer.peak(),
        hub.hub.state.pacer.refused()
    );
    let before: Vec<_> = agents.iter().map(|a| a.agent.status()).collect();

    // Restart on the same ports and data.
    let addrs = (hub.hub.api_addr, hub.hub.tunnel_addr);
    let stopped = Instant::now();
    hub.hub.shutdown().await;
    let hub = TestHub::start_with(dir, Some(addrs), paced).await;
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
        hub.hub.state.metrics.pacer(pacer);
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
        if refusals > 0 {
            assert_eq!(
                s.last_retry_after,
                Some(HINT),
                "agent {i}: the hint arrived intact"
            );
        }
    }
    eprintln!(
        "dial rounds per agent at most {most_dials}; refusals by transport (quic, h2, ws): {refused_by_transport:?}"
    );
    assert_eq!(
        pacer.refused(),
        u64::from(refused_by_transport.iter().sum::<u32>()),
        "every refusal reached an agent as a refusal"
    );
    for a in agents {
        a.agent.shutdown().await;
    }
    hub.hub.shutdown().await;
}
