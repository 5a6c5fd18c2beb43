//! Hub CA rotation without stranding agents: stage, activate, finish, with
//! agents on QUIC and HTTP/2 connected throughout (asked by the hub to renew
//! after each step), an offline agent holding each step back until forced,
//! the listeners switching certificates without a restart, and a restart
//! keeping the result.

use std::sync::Arc;

use bytes::Bytes;
use otter_e2e::{
    TestHub,
    double::{WAIT, field, get, start_agent, wait_connected, wait_until},
    http_call, with_token,
};
use otter_proto::{
    link::v1::{GetAgentManifestRequest, link_service_client::LinkServiceClient},
    resource::v1::resource_service_client::ResourceServiceClient,
};
use otter_tunnel::TransportKind;

/// One call of the admin CA API, trusting the hub's current bundle.
async fn ca_api(hub: &TestHub, method: http::Method, path: &str) -> (u16, String) {
    let req = http::Request::builder()
        .method(method)
        .uri(format!(
            "https://localhost:{}{path}",
            hub.hub.api_addr.port()
        ))
        .header("authorization", format!("Bearer {}", hub.admin_token))
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let (status, _, body) = http_call(hub.hub.api_addr, &hub.hub.ca_bundle(), false, req).await;
    (status.as_u16(), String::from_utf8_lossy(&body).into_owned())
}

async fn status(hub: &TestHub) -> serde_json::Value {
    let (code, body) = ca_api(hub, http::Method::GET, "/admin/v1/ca").await;
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

async fn step(hub: &TestHub, path: &str) -> serde_json::Value {
    let (code, body) = ca_api(hub, http::Method::POST, path).await;
    assert_eq!(code, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// Whether a TLS handshake with the API port succeeds trusting only `ca`.
async fn handshake_ok(hub: &TestHub, ca: &str) -> bool {
    let tls = otter_pki::tls::client_config(ca, None, &[b"h2"]).unwrap();
    let tcp = tokio::net::TcpStream::connect(hub.hub.api_addr)
        .await
        .unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .is_ok()
}

async fn get_through(hub: &TestHub, cluster: &str) {
    let r = ResourceServiceClient::new(hub.channel_with_ca(&hub.hub.ca_bundle()).await)
        .get(with_token(get(cluster, "x"), &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(field(r.get_ref(), "cluster"), cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ca_rotation_strands_no_agent() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_in(dir.clone(), None).await;
    let first_ca = hub.hub.ca_pem().to_owned();
    let token = |c: &str| hub.hub.mint_join_token(c).unwrap();
    let q = start_agent(&hub, "edge-q", "a1", &token("edge-q"), TransportKind::Quic);
    let h = start_agent(&hub, "edge-h", "a1", &token("edge-h"), TransportKind::H2);
    // An agent that registered once and is offline now.
    let off = start_agent(
        &hub,
        "edge-off",
        "a1",
        &token("edge-off"),
        TransportKind::H2,
    );
    for a in [&q, &h, &off] {
        a.agent
            .wait_for(WAIT, |s| s.connected.is_some())
            .await
            .expect("agent connects");
    }
    off.agent.shutdown().await;
    wait_connected(&hub.channel().await, &hub.admin_token, 2).await;
    let f0 = status(&hub).await["active"].as_str().unwrap().to_owned();

    // 1. Stage: a second CA, trusted, not signing. The hub asks the
    // connected agents to renew, which hands them both CAs.
    let s = step(&hub, "/admin/v1/ca/stage").await;
    assert_eq!(s["phase"], "staged", "{s}");
    assert_eq!(s["active"], f0.as_str());
    let f1 = s["other"].as_str().unwrap().to_owned();
    for a in [&q, &h] {
        a.agent
            .wait_for(WAIT, |s| s.renewals >= 1)
            .await
            .expect("asked to renew after staging");
    }
    assert_eq!(
        status(&hub).await["pending"],
        serde_json::json!(["edge-off"]),
        "only the offline agent lacks the new CA"
    );
    // New manifests carry both CAs.
    let manifest = LinkServiceClient::new(hub.channel().await)
        .get_agent_manifest(with_token(
            GetAgentManifestRequest {
                cluster: Some("edge-new".into()),
                ..Default::default()
            },
            &hub.admin_token,
        ))
        .await
        .unwrap()
        .into_inner()
        .manifest
        .unwrap();
    assert_eq!(manifest.matches("BEGIN CERTIFICATE").count(), 2);

    // 2. Activate: refused while it would strand the offline agent.
    let (code, body) = ca_api(&hub, http::Method::POST, "/admin/v1/ca/activate").await;
    assert_eq!(code, 409, "{body}");
    assert!(
        body.contains("edge-off") && body.contains("force"),
        "{body}"
    );
    let s = step(&hub, "/admin/v1/ca/activate?force=true").await;
    assert_eq!(s["phase"], "activated", "{s}");
    assert_eq!(s["active"], f1.as_str());
    assert_eq!(s["other"], f0.as_str());
    for a in [&q, &h] {
        a.agent
            .wait_for(WAIT, |s| s.renewals >= 2)
            .await
            .expect("asked to renew after activation");
    }
    // The listeners present the new CA's certificate, with no restart...
    assert!(
        !handshake_ok(&hub, &first_ca).await,
        "old CA alone no longer verifies the hub"
    );
    assert!(handshake_ok(&hub, &hub.hub.ca_bundle()).await);
    // ...while the agents never dropped their tunnels, and calls go through.
    for (a, c) in [(&q, "edge-q"), (&h, "edge-h")] {
        assert_eq!(a.agent.status().connects, 1, "{c} reconnected");
        get_through(&hub, c).await;
    }
    // A fresh tunnel handshake verifies the new certificate with what the
    // agent learnt. The tunnel closed may be one its renewal is already
    // replacing (make before break): then the replacement is that fresh
    // handshake, counted as a redial rather than a connect.
    let redials = q.agent.status().redials;
    hub.hub
        .state
        .registry
        .get("edge-q")
        .unwrap()
        .opener
        .close("test: reconnect");
    q.agent
        .wait_for(WAIT, |s| {
            (s.connects >= 2 || s.redials > redials) && s.connected.is_some()
        })
        .await
        .expect("reconnects through the new server certificate");
    get_through(&hub, "edge-q").await;

    // 3. Finish: refused while the offline agent's certificate is from the
    // old CA; forced, the old CA is gone.
    assert_eq!(
        status(&hub).await["pending"],
        serde_json::json!(["edge-off"])
    );
    let (code, body) = ca_api(&hub, http::Method::POST, "/admin/v1/ca/finish").await;
    assert_eq!(code, 409, "{body}");
    let s = step(&hub, "/admin/v1/ca/finish?force=true").await;
    assert_eq!(s["phase"], "steady", "{s}");
    assert!(s["other"].is_null(), "{s}");
    assert_eq!(hub.hub.ca_bundle().matches("BEGIN CERTIFICATE").count(), 1);
    // A step out of order is refused.
    let (code, body) = ca_api(&hub, http::Method::POST, "/admin/v1/ca/activate").await;
    assert_eq!(code, 409, "{body}");

    // A restart keeps the new CA; the agents come back with what they hold.
    let ports = (hub.hub.api_addr, hub.hub.tunnel_addr);
    hub.hub.shutdown().await;
    let hub = TestHub::start_in(dir, Some(ports)).await;
    let s = status(&hub).await;
    assert_eq!(
        (s["phase"].as_str(), s["active"].as_str()),
        (Some("steady"), Some(f1.as_str()))
    );
    wait_connected(
        &hub.channel_with_ca(&hub.hub.ca_bundle()).await,
        &hub.admin_token,
        2,
    )
    .await;
    for c in ["edge-q", "edge-h"] {
        get_through(&hub, c).await;
    }
    // The data dir's ca.crt is what clients should trust now.
    let on_disk = std::fs::read_to_string(hub.data_dir().join("ca.crt")).unwrap();
    assert_eq!(otter_pki::ca::fingerprint_pem(&on_disk).unwrap(), f1);
    q.agent.shutdown().await;
    h.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// A rotation on replicas sharing etcd: each step taken on one replica is
/// taken up by the other (its listeners, its agents asked to renew, its
/// peer connections), the steps alternate between replicas, two replicas
/// stepping at once cannot both succeed, and a call through a replica that
/// does not hold the cluster's tunnel still reaches it after the old CA is
/// gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_follows_a_rotation_made_on_one() {
    let Some(etcd) = otter_e2e::etcd::Etcd::start() else {
        return;
    };
    let (hubs, _) = otter_e2e::etcd::start_replicas(&etcd, 2, true).await;
    let mut hubs = hubs.into_iter();
    let (a, b) = (hubs.next().unwrap(), hubs.next().unwrap());
    let first_ca = a.hub.ca_pem().to_owned();
    // One agent on each replica.
    let on_a = start_agent(
        &a,
        "edge-a",
        "a1",
        &a.hub.mint_join_token("edge-a").unwrap(),
        TransportKind::Quic,
    );
    let on_b = start_agent(
        &b,
        "edge-b",
        "b1",
        &a.hub.mint_join_token("edge-b").unwrap(),
        TransportKind::H2,
    );
    for t in [&on_a, &on_b] {
        t.agent
            .wait_for(WAIT, |s| s.connected.is_some())
            .await
            .expect("agent connects");
    }
    let f0 = status(&a).await["active"].as_str().unwrap().to_owned();

    // Staged on a: b takes it up and asks its own agent to renew.
    let s = step(&a, "/admin/v1/ca/stage").await;
    let f1 = s["other"].as_str().unwrap().to_owned();
    for t in [&on_a, &on_b] {
        t.agent
            .wait_for(WAIT, |s| s.renewals >= 1)
            .await
            .expect("both replicas' agents renew after staging");
    }
    let seen_by_b = status(&b).await;
    assert_eq!(seen_by_b["phase"], "staged", "{seen_by_b}");
    assert_eq!(seen_by_b["other"], f1.as_str());
    assert_eq!(seen_by_b["pending"], serde_json::json!([]), "{seen_by_b}");

    // Activated on b, by both at once: the store takes one.
    let (ra, rb) = tokio::join!(
        ca_api(&a, http::Method::POST, "/admin/v1/ca/activate"),
        ca_api(&b, http::Method::POST, "/admin/v1/ca/activate"),
    );
    let mut codes = [ra.0, rb.0];
    codes.sort();
    assert_eq!(codes, [200, 409], "a: {ra:?}, b: {rb:?}");
    eprintln!(
        "the refused one: {}",
        if ra.0 == 409 { &ra.1 } else { &rb.1 }
    );
    for t in [&on_a, &on_b] {
        t.agent
            .wait_for(WAIT, |s| s.renewals >= 2)
            .await
            .expect("both replicas' agents renew after activation");
    }
    for hub in [&a, &b] {
        let s = status(hub).await;
        assert_eq!(
            (s["phase"].as_str(), s["active"].as_str()),
            (Some("activated"), Some(f1.as_str())),
            "{s}"
        );
        wait_until(
            async || !handshake_ok(hub, &first_ca).await,
            "the old CA alone to stop verifying the replica",
        )
        .await;
        assert!(handshake_ok(hub, &hub.hub.ca_bundle()).await);
    }

    // Finished on a, once both links hold the new CA's certificates.
    wait_until(
        async || status(&a).await["pending"] == serde_json::json!([]),
        "both links to hold the new CA's certificates",
    )
    .await;
    let s = step(&a, "/admin/v1/ca/finish").await;
    assert_eq!(s["phase"], "steady", "{s}");
    wait_until(
        async || status(&b).await["phase"] == "steady",
        "b to take up the finish",
    )
    .await;
    let new_only = b.hub.ca_bundle();
    assert_eq!(new_only.matches("BEGIN CERTIFICATE").count(), 1);
    assert_eq!(otter_pki::ca::fingerprint_pem(&new_only).unwrap(), f1);
    assert_ne!(f0, f1);
    // Calls cross between the replicas on peer connections made with the
    // new CA's replica certificates (the old CA is trusted nowhere now).
    for (through, cluster) in [(&a, "edge-b"), (&b, "edge-a"), (&a, "edge-a")] {
        let r = ResourceServiceClient::new(through.channel_with_ca(&new_only).await)
            .get(with_token(get(cluster, "x"), &through.admin_token))
            .await
            .unwrap_or_else(|e| panic!("{cluster} through a replica: {e:?}"));
        assert_eq!(field(r.get_ref(), "cluster"), cluster);
    }
    // No tunnel was dropped on the way.
    for t in [&on_a, &on_b] {
        assert_eq!(t.agent.status().connects, 1);
    }
    on_a.agent.shutdown().await;
    on_b.agent.shutdown().await;
    a.hub.shutdown().await;
    b.hub.shutdown().await;
}
