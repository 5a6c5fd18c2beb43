//! Hub replicas on one etcd (Debian's etcd on loopback): what a replica
//! that does not hold a cluster's tunnel adds to a Get by sending it to
//! the one that does, and what idle agents cost etcd in writes.

use std::time::{Duration, Instant};

use anyhow::Context;
use otter_e2e::{double::start_agent, etcd::Etcd, with_token};
use otter_proto::resource::v1::{GetRequest, resource_service_client::ResourceServiceClient};
use otter_tunnel::TransportKind;
use tonic::transport::Channel;

use crate::{
    calls::hub_channel,
    common::{Figures, Latency},
};

const TIMEOUT: Duration = Duration::from_secs(10);

fn get(cluster: &str) -> GetRequest {
    let mut req = otter_e2e::double::get(cluster, "web");
    req.namespace = Some("default".into());
    req
}

async fn one_get(ch: &Channel, token: &str) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let mut client = ResourceServiceClient::new(ch.clone());
    tokio::time::timeout(TIMEOUT, client.get(with_token(get("edge-b"), token))).await??;
    Ok(t.elapsed())
}

/// `calls` Gets through each replica (alternating, one client each) and
/// etcd's writes per second while `agents` idle agents stay connected for
/// `idle`.
pub async fn run(calls: usize, agents: usize, idle: Duration) -> anyhow::Result<Figures> {
    let etcd = Etcd::start().context("etcd is not installed (scripts/setup.sh installs it)")?;
    let (hubs, root) = otter_e2e::etcd::start_replicas(&etcd, 2, true).await;
    let (a, b) = (&hubs[0], &hubs[1]);
    let join = a.hub.mint_join_token_in("edge-b", "default")?;
    let _agent = start_agent(b, "edge-b", "agent-b", &join, TransportKind::Quic);
    let via_a = hub_channel(a.hub.api_addr, a.hub.ca_pem()).await?;
    let via_b = hub_channel(b.hub.api_addr, b.hub.ca_pem()).await?;
    otter_e2e::double::wait_connected(&via_b, &root, 1).await;
    // Warm both ways (the peer connection is made on first use).
    let deadline = Instant::now() + Duration::from_secs(30);
    while one_get(&via_a, &root).await.is_err() {
        anyhow::ensure!(Instant::now() < deadline, "replica a never reached edge-b");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let warmup = (calls / 10).max(100);
    let (mut owner, mut forwarded) = (Vec::new(), Vec::new());
    for i in 0..warmup + calls {
        let (o, f) = (one_get(&via_b, &root).await?, one_get(&via_a, &root).await?);
        if i >= warmup {
            owner.push(o);
            forwarded.push(f);
        }
    }
    let (o, f) = (Latency::of(&owner), Latency::of(&forwarded));
    let mut figs = Figures::default();
    for (q, ov, fv) in [("p50", o.p50, f.p50), ("p99", o.p99, f.p99)] {
        let base = format!("replicas.owner.{q}");
        figs.add(&base, "µs", None, ov);
        figs.add(&format!("replicas.forwarded.{q}"), "µs", Some(&base), fv);
    }
    figs.add("replicas.forward-added.p50", "µs", None, f.p50 - o.p50);
    eprintln!(
        "bench: Get p50 through the owning replica {:.0} µs, through the other {:.0} µs",
        o.p50, f.p50
    );

    // Idle agents spread over both replicas: what etcd is written while
    // nothing happens.
    let mut idle_agents = Vec::with_capacity(agents);
    for i in 0..agents {
        let cluster = format!("idle-{i}");
        let join = a.hub.mint_join_token_in(&cluster, "default")?;
        let hub = if i % 2 == 0 { a } else { b };
        idle_agents.push(start_agent(
            hub,
            &cluster,
            "idle",
            &join,
            TransportKind::Quic,
        ));
    }
    otter_e2e::double::wait_connected(&via_a, &root, agents + 1).await;
    // Settle: the last admissions' writes are not idle ones.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = etcd.revision().context("etcd revision")?;
    tokio::time::sleep(idle).await;
    let after = etcd.revision().context("etcd revision")?;
    let rate = (after - before) as f64 / idle.as_secs_f64();
    figs.add(
        &format!("replicas.etcd-writes-idle-{agents}"),
        "writes/s",
        None,
        rate,
    );
    eprintln!("bench: {agents} idle agents on 2 replicas: {rate:.2} etcd writes/s");
    drop(idle_agents);
    for hub in hubs {
        hub.hub.shutdown().await;
    }
    Ok(figs)
}
