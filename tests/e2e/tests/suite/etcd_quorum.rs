//! Two hub replicas on a real 3-member etcd (loopback), a cluster connected
//! to one of them. With one member down nothing changes. Without quorum
//! the replicas keep serving the tunnels they hold, through either replica,
//! and refuse what needs a write (Register, manifests, token changes) with
//! `Unavailable` (503 on the admin API), and readiness says so; with the
//! quorum back, writes work again.

use std::sync::atomic::Ordering;

use otter_e2e::{
    TestHub, admin_call,
    double::{get, start_agent, wait_connected, wait_until},
    etcd::{Etcd, start_replicas_on},
    with_token,
};
use otter_proto::{
    link::v1::{GetAgentManifestRequest, link_service_client::LinkServiceClient},
    resource::v1::resource_service_client::ResourceServiceClient,
};
use otter_tunnel::TransportKind;
use serde_json::json;
use tonic::Code;

async fn get_via(hub: &TestHub, token: &str, name: &str) -> Result<(), tonic::Status> {
    ResourceServiceClient::new(hub.channel().await)
        .get(with_token(get("edge-1", name), token))
        .await
        .map(drop)
}

async fn manifest_via(hub: &TestHub, token: &str, cluster: &str) -> Result<(), tonic::Status> {
    LinkServiceClient::new(hub.channel().await)
        .get_agent_manifest(with_token(
            GetAgentManifestRequest {
                cluster: Some(cluster.into()),
                ..Default::default()
            },
            token,
        ))
        .await
        .map(drop)
}

async fn mint_token(hub: &TestHub, by: &str, name: &str) -> (u16, String) {
    admin_call(
        hub.hub.api_addr,
        hub.hub.ca_pem(),
        by,
        http::Method::POST,
        "/admin/v1/tokens",
        Some(json!({"name": name, "tenant": "default", "role": "member"})),
    )
    .await
}

fn ready(hub: &TestHub) -> bool {
    hub.hub.state.store_writable.load(Ordering::Acquire)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_ride_out_a_member_down_and_refuse_writes_without_quorum() {
    let Some(mut members) = Etcd::cluster(3) else {
        return;
    };
    let (hubs, root) = start_replicas_on(&Etcd::urls(&members), 2, true).await;
    let (a, b) = (&hubs[0], &hubs[1]);
    let token = a.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(a, "edge-1", "a1", &token, TransportKind::H2);
    wait_connected(&a.channel().await, &root, 1).await;
    // The replica without the tunnel routes to it once its watch has
    // brought the tunnel's record, a moment after the agent connected.
    for hub in [a, b] {
        wait_until(
            async || get_via(hub, &root, "before").await.is_ok(),
            "a call before",
        )
        .await;
    }

    // One member down: nothing changes, writes included.
    members[2].stop();
    for hub in [a, b] {
        get_via(hub, &root, "member-down")
            .await
            .expect("a call with a member down");
    }
    manifest_via(b, &root, "edge-2")
        .await
        .expect("a manifest with a member down");
    let (code, body) = mint_token(a, &root, "ann").await;
    assert_eq!(code, 200, "{body}");
    let join = a.hub.mint_join_token("edge-3").unwrap();

    // Quorum lost.
    members[1].stop();
    let lost = tokio::time::Instant::now();
    wait_until(
        async || !ready(a) && !ready(b),
        "both replicas to report the store not writable",
    )
    .await;
    let noticed = lost.elapsed();
    // Serving goes on: the tunnel a holds, through a and through b.
    for hub in [a, b] {
        get_via(hub, &root, "no-quorum")
            .await
            .expect("a call to a connected cluster without quorum");
    }
    // Writes waiting out the store's bound must not hold the hub's
    // threads: four at once, on a runtime of two threads that also runs
    // both replicas and the agent, and a call to the cluster sent while
    // they wait is answered before any of them is refused (a write waits
    // out the store's bound, seconds; a held thread would hold the call
    // until a write gave up).
    let tunnel = a.hub.state.registry.get("edge-1").map(|t| t.id);
    let refused_any = std::sync::atomic::AtomicBool::new(false);
    let waiting = futures::future::join_all((0..4).map(|i| {
        let (root, refused_any) = (root.clone(), &refused_any);
        async move {
            let r = manifest_via(a, &root, &format!("edge-w{i}")).await;
            refused_any.store(true, Ordering::Release);
            r
        }
    }));
    let (waited, answered_first) = tokio::join!(waiting, async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        get_via(a, &root, "while-writes-wait")
            .await
            .expect("a call to the cluster while writes wait on the store");
        !refused_any.load(Ordering::Acquire)
    });
    for w in waited {
        assert_eq!(w.unwrap_err().code(), Code::Unavailable);
    }
    assert!(
        answered_first,
        "the call waited for a write to be refused: writes waiting on the store held the hub's threads"
    );

    // Writes are refused, saying so.
    let refused = tokio::time::Instant::now();
    let e = manifest_via(a, &root, "edge-4").await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("store"), "{e:?}");
    let e = otter_e2e::register(b, "edge-3", "a", &join)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    let (code, body) = mint_token(b, &root, "bob").await;
    assert_eq!(code, 503, "{body}");
    let refusals = refused.elapsed();
    assert_eq!(
        a.hub.state.registry.get("edge-1").map(|t| t.id),
        tunnel,
        "the tunnel a held was dropped while writes waited on the store"
    );

    // Quorum back: writes work again, readiness with them.
    members[1].restart();
    wait_until(async || ready(a) && ready(b), "both replicas ready again").await;
    manifest_via(a, &root, "edge-4")
        .await
        .expect("a manifest with the quorum back");
    // The Register refused above may have been applied by etcd once the
    // quorum was back (its write was in flight when the hub gave up on
    // it): the same agent retrying with the same token still enrolls.
    otter_e2e::register(b, "edge-3", "a", &join)
        .await
        .expect("the agent's retry with its join token, once the quorum is back");
    // A replica whose lease etcd let go while it had no quorum writes its
    // records (who holds the tunnel) again under a new one, a moment after
    // the quorum is back.
    for (name, hub) in [("a", a), ("b", b)] {
        let deadline = tokio::time::Instant::now() + otter_e2e::double::WAIT;
        let mut answer = get_via(hub, &root, "after").await;
        while answer.is_err() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            answer = get_via(hub, &root, "after").await;
        }
        if let Err(e) = answer {
            // What each replica knew then, so a failure says which side
            // lost the cluster: a's tunnel, or b's view of who holds it.
            let held = |h: &TestHub| h.hub.state.registry.get("edge-1").is_some();
            let owner = |h: &TestHub| otter_hub::peers::owner(&*h.hub.state.store, "edge-1", "");
            panic!(
                "a call after, through {name}: {e:?}; tunnel held by a: {}, by b: {}; \
                 owner as a reads it: {:?}, as b reads it: {:?}",
                held(a),
                held(b),
                owner(a),
                owner(b)
            );
        }
    }
    eprintln!(
        "etcd quorum lost: both replicas not ready within {noticed:?}; calls to the connected \
         cluster answered through both; 3 writes refused (Unavailable, Unavailable, 503) in {refusals:?}"
    );
    agent.agent.shutdown().await;
    for h in hubs {
        h.hub.shutdown().await;
    }
    drop(members);
}
