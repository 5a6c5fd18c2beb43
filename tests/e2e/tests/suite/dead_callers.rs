//! A caller whose path dies without a word (a closed laptop, a NAT that
//! forgot the connection) is noticed by the hub's keepalive: its calls end,
//! their tunnel slots free and the agent's watches stop, while a caller
//! that is merely quiet keeps its calls.

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use otter_e2e::{
    Relay, TestHub, client_channel,
    double::{get, start_agent, wait_connected, wait_until},
    with_token,
};
use otter_proto::resource::v1::{WatchRequest, resource_service_client::ResourceServiceClient};
use otter_tunnel::{Keepalive, TransportKind};

const SECOND: Duration = Duration::from_secs(1);

fn watch(cluster: &str, token: &str) -> tonic::Request<WatchRequest> {
    with_token(
        WatchRequest {
            cluster: Some(cluster.into()),
            ..Default::default()
        },
        token,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_callers_watch_ends_and_a_quiet_one_stays() {
    let hub = TestHub::start_with(
        std::sync::Arc::new(tempfile::tempdir().unwrap()),
        None,
        |c| {
            c.api_keepalive = Keepalive {
                interval: SECOND,
                timeout: SECOND,
            }
        },
    )
    .await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &token, TransportKind::Quic);
    let quiet = hub.channel().await;
    wait_connected(&quiet, &hub.admin_token, 1).await;
    // The caller that will vanish reaches the hub through a relay the test
    // freezes: its bytes stop both ways, its sockets stay open.
    let relay = Relay::start().await;
    relay.set_target(hub.hub.api_addr);
    let vanishing = client_channel(relay.addr, hub.hub.ca_pem(), None).await;

    let mut streams = Vec::new();
    for channel in [&quiet, &vanishing] {
        let mut s = ResourceServiceClient::new(channel.clone())
            .watch(watch("edge-1", &hub.admin_token))
            .await
            .expect("watch opens")
            .into_inner();
        // The double sends three events, then stays open and silent.
        for _ in 0..3 {
            s.next().await.expect("an event").expect("not an error");
        }
        streams.push(s);
    }
    let tunnel = hub.hub.state.registry.get("edge-1").expect("tunnel up");
    let live = agent.live_watches.clone();
    assert_eq!(live.load(Ordering::SeqCst), 2);
    assert_eq!(tunnel.calls_in_flight(), 2);

    // Both callers silent for several keepalive periods: pings answered,
    // nothing ends.
    tokio::time::sleep(4 * SECOND).await;
    assert_eq!(
        live.load(Ordering::SeqCst),
        2,
        "a quiet caller lost a watch"
    );
    assert_eq!(tunnel.calls_in_flight(), 2);

    relay.freeze(true);
    let frozen = std::time::Instant::now();
    wait_until(
        async || tunnel.calls_in_flight() == 1 && live.load(Ordering::SeqCst) == 1,
        "the vanished caller's watch to end at the hub and at the agent",
    )
    .await;
    let noticed = frozen.elapsed();
    println!("vanished caller's watch ended {noticed:?} after its path froze");
    // Within one interval of silence, the ping's timeout and a margin.
    assert!(noticed < 2 * SECOND + 5 * SECOND, "took {noticed:?}");

    // The quiet caller's watch lives on, and its connection serves calls.
    tokio::time::sleep(3 * SECOND).await;
    assert_eq!(
        live.load(Ordering::SeqCst),
        1,
        "the quiet caller's watch ended"
    );
    ResourceServiceClient::new(quiet.clone())
        .get(with_token(get("edge-1", "x"), &hub.admin_token))
        .await
        .expect("the quiet caller's connection serves a Get");
    drop(streams);
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}
