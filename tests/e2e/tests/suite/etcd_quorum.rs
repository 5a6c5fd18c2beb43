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
    link::v1::{GetAgentManifestRequest, RegisterRequest, link_service_client::LinkServiceClient},
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

async fn register_via(hub: &TestHub, cluster: &str, join: &str) -> Result<(), tonic::Status> {
    let (_, csr) = otter_pki::csr::generate(cluster, "a").unwrap();
    LinkServiceClient::new(hub.channel().await)
        .register(RegisterRequest {
            cluster: Some(cluster.into()),
            csr: Some(csr.into_bytes()),
            agent_id: Some("a".into()),
            agent_version: Some("v0.1.0".into()),
            join_token: Some(join.into()),
            ..Default::default()
        })
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
    for hub in [a, b] {
        get_via(hub, &root, "before").await.expect("a call before");
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
    // Writes are refused, saying so.
    let refused = tokio::time::Instant::now();
    let e = manifest_via(a, &root, "edge-4").await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("store"), "{e:?}");
    let e = register_via(b, "edge-3", &join).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    let (code, body) = mint_token(b, &root, "bob").await;
    assert_eq!(code, 503, "{body}");
    let refusals = refused.elapsed();

    // Quorum back: writes work again, readiness with them.
    members[1].restart();
    wait_until(async || ready(a) && ready(b), "both replicas ready again").await;
    manifest_via(a, &root, "edge-4")
        .await
        .expect("a manifest with the quorum back");
    // The Register refused above may have been applied by etcd once the
    // quorum was back (its write was in flight when the hub gave up on
    // it): the same agent retrying with the same token still enrolls.
    register_via(b, "edge-3", &join)
        .await
        .expect("the agent's retry with its join token, once the quorum is back");
    for hub in [a, b] {
        get_via(hub, &root, "after").await.expect("a call after");
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
