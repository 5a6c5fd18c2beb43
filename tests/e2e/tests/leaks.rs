//! Nothing leaks: after 1,000 open/close cycles of a streaming call through
//! hub and tunnel, live tasks, open file descriptors and calls in flight
//! are back to where they started and RSS is within 4 MiB of it.

use std::time::Duration;

use futures::StreamExt;
use otter_e2e::{
    TestHub,
    double::{start_agent, wait_connected, wait_until},
    procs::{own_open_fds, own_rss_kib},
    with_token,
};
use otter_proto::resource::v1::{WatchRequest, resource_service_client::ResourceServiceClient};
use otter_tunnel::TransportKind;

/// Tasks alive in this test's runtime: hub, agent and client all run in it.
fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

async fn cycles(transport: TransportKind, n: usize) {
    let hub = TestHub::start().await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &token, transport);
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 1).await;
    let mut client = ResourceServiceClient::new(channel.clone());
    let watch = || {
        with_token(
            WatchRequest {
                cluster: Some("edge-1".into()),
                ..Default::default()
            },
            &hub.admin_token,
        )
    };

    // Warm up (allocator pools, connection windows), then take the baseline.
    for _ in 0..50 {
        let mut s = client.watch(watch()).await.unwrap().into_inner();
        s.next().await.unwrap().unwrap();
    }
    let live = agent.live_watches.clone();
    wait_until(
        async || live.load(std::sync::atomic::Ordering::SeqCst) == 0,
        "warm-up watches to end",
    )
    .await;
    let (tasks0, fds0, rss0) = (alive_tasks(), own_open_fds(), own_rss_kib());

    let started = std::time::Instant::now();
    for i in 0..n {
        let mut s = client.watch(watch()).await.unwrap().into_inner();
        s.next().await.unwrap().unwrap();
        drop(s);
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "cycle {i}: too slow, something is stuck"
        );
    }
    let live = agent.live_watches.clone();
    wait_until(
        async || live.load(std::sync::atomic::Ordering::SeqCst) == 0,
        "every watch to end on the agent",
    )
    .await;
    let tunnel = hub.hub.state.registry.get("edge-1").expect("tunnel up");
    wait_until(
        async || tunnel.calls_in_flight() == 0,
        "the hub's calls in flight to drain",
    )
    .await;
    wait_until(
        async || alive_tasks() <= tasks0 && own_open_fds() <= fds0,
        "live tasks and open files to return to the baseline",
    )
    .await;
    let (tasks1, fds1, rss1) = (alive_tasks(), own_open_fds(), own_rss_kib());
    println!(
        "{transport}: {n} cycles in {:?}; tasks {tasks0} -> {tasks1}; fds {fds0} -> {fds1}; RSS {rss0} KiB -> {rss1} KiB",
        started.elapsed()
    );
    assert!(fds1 <= fds0, "file descriptors grew: {fds0} -> {fds1}");
    // One cycle's state is kilobytes: 1,000 leaked cycles would be
    // megabytes. The bound docs/reliability.md promises: 4 MiB.
    assert!(
        rss1 <= rss0 + 4 * 1024,
        "RSS grew from {rss0} KiB to {rss1} KiB over {n} cycles"
    );
    agent.agent.shutdown().await;

    hub.hub.shutdown().await;
}

/// One test for both transports, one after the other: file descriptors are
/// counted for the whole process, so nothing else may run beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_cycles_leak_nothing() {
    cycles(TransportKind::H2, 1000).await;
    cycles(TransportKind::Quic, 1000).await;
}
