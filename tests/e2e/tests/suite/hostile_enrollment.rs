//! Enrollment under attack, through a real hub on loopback: a join token
//! enrolls its cluster once, so one found later (in the agent's Secret, a
//! manifest, a log) or minted by a manifest URL fetched again takes no
//! cluster over; manifest URLs serve a bounded number of fetches; only an
//! admin's re-enrollment lets a new agent replace a cluster's agent.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use otter_e2e::{
    TestHub,
    double::{field, get, start_agent, wait_connected, wait_until},
    http_call, with_token,
};
use otter_proto::resource::v1::resource_service_client::ResourceServiceClient;
use otter_tunnel::TransportKind;
use tonic::Code;

/// A Register with `token` for `cluster` as agent `agent`: its refusal, or
/// OK.
async fn register(hub: &TestHub, cluster: &str, agent: &str, token: &str) -> tonic::Status {
    otter_e2e::register(hub, cluster, agent, token)
        .await
        .err()
        .unwrap_or_else(|| tonic::Status::ok("registered"))
}

/// Which agent answers for `cluster`.
async fn answering(hub: &TestHub, cluster: &str) -> String {
    let r = ResourceServiceClient::new(hub.channel().await)
        .get(with_token(get(cluster, "x"), &hub.admin_token))
        .await
        .expect("get");
    field(r.get_ref(), "agent")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_token_enrolls_its_cluster_once() {
    let hub = TestHub::start().await;
    let channel = hub.channel().await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    // Minted before the cluster is enrolled, unspent: what an attacker gets
    // by fetching a manifest URL again.
    let unspent = hub.hub.mint_join_token("edge-1").unwrap();
    let _real = start_agent(&hub, "edge-1", "real", &token, TransportKind::H2);
    wait_connected(&channel, &hub.admin_token, 1).await;
    assert_eq!(answering(&hub, "edge-1").await, "real");

    // The spent token, replayed.
    let s = register(&hub, "edge-1", "rogue", &token).await;
    assert_eq!(s.code(), Code::Unauthenticated, "{s:?}");
    assert!(s.message().contains("already used"), "{s:?}");
    // An unspent one: the cluster is enrolled, and says how to replace its agent.
    let s = register(&hub, "edge-1", "rogue", &unspent).await;
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(s.message().contains("otter re-enroll edge-1"), "{s:?}");
    // A rogue agent serving another cluster with it never serves edge-1.
    let rogue = start_agent(&hub, "edge-1", "rogue", &unspent, TransportKind::H2);
    wait_until(
        async || rogue.agent.status().last_error.contains("already enrolled"),
        "the rogue agent to be refused",
    )
    .await;
    for _ in 0..5 {
        assert_eq!(answering(&hub, "edge-1").await, "real");
    }
    let routed = hub
        .hub
        .state
        .registry
        .get("edge-1")
        .map(|t| t.agent_id.clone());
    assert_eq!(routed.as_deref(), Some("real"));
    drop(rogue);

    // An admin re-enrolls the cluster: tokens from before still do not
    // count, a new one does, and its agent replaces the old one.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(hub.hub.re_enroll("edge-1").unwrap());
    let s = register(&hub, "edge-1", "rogue", &unspent).await;
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(s.message().contains("made before"), "{s:?}");
    let fresh = hub.hub.mint_join_token("edge-1").unwrap();
    let _new = start_agent(&hub, "edge-1", "new", &fresh, TransportKind::H2);
    wait_until(
        async || {
            hub.hub
                .state
                .registry
                .get("edge-1")
                .map(|t| t.agent_id.clone())
                == Some("new".into())
        },
        "the re-enrolled agent to take over",
    )
    .await;
    assert_eq!(answering(&hub, "edge-1").await, "new");
    // The re-enrollment is used up with that token.
    let another = hub.hub.mint_join_token("edge-1").unwrap();
    let s = register(&hub, "edge-1", "rogue", &another).await;
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    hub.hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_urls_serve_a_bounded_number_of_fetches() {
    let hub = TestHub::start().await;
    let url = hub.manifest_url("edge-1").await;
    let path = url
        .split_once(&format!(":{}", hub.hub.api_addr.port()))
        .unwrap()
        .1
        .to_owned();
    let fetch = || async {
        let req = http::Request::get(path.as_str())
            .body(Full::new(Bytes::new()))
            .unwrap();
        http_call(hub.hub.api_addr, hub.hub.ca_pem(), false, req).await
    };
    let tokens_before = hub
        .hub
        .state
        .store
        .scan_raw(otter_hub::store::tree::JOIN_TOKENS)
        .unwrap()
        .len();
    for _ in 0..otter_hub::manifest::MAX_URL_FETCHES {
        let (status, _, _) = fetch().await;
        assert_eq!(status, 200);
    }
    for _ in 0..20 {
        let (status, _, body) = fetch().await;
        assert_eq!(status, 410, "{}", String::from_utf8_lossy(&body));
        assert!(String::from_utf8_lossy(&body).contains("otter agent-manifest"));
    }
    let tokens_after = hub
        .hub
        .state
        .store
        .scan_raw(otter_hub::store::tree::JOIN_TOKENS)
        .unwrap()
        .len();
    // One join token per fetch served, none for the refused ones.
    assert_eq!(
        tokens_after - tokens_before,
        otter_hub::manifest::MAX_URL_FETCHES as usize
    );
    hub.hub.shutdown().await;
}
