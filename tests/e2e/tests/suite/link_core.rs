//! Link core end to end, once per transport: one hub, three agents for
//! three clusters, calls routed by cluster over real TLS/QUIC on loopback.
//!
//! The agents serve a test double of ResourceService (the real Kubernetes
//! services are tested in their own suite); it answers with the cluster and
//! agent it runs in and the caller the hub verified, so each answer shows
//! where it came from and for whom.

use std::{sync::atomic::Ordering, time::Duration};

use futures::StreamExt;
use otter_e2e::{
    TestHub, client_channel,
    double::{WAIT, bulk_watch, field, get, start_agent, wait_connected, wait_until},
    with_token,
};
use otter_proto::{
    link::v1::{
        LinkState, ListLinksRequest, RegisterRequest, link_service_client::LinkServiceClient,
    },
    resource::v1::{WatchRequest, resource_service_client::ResourceServiceClient},
};
use otter_tunnel::TransportKind;
use tonic::{Code, Request};

async fn link_core(transport: TransportKind) {
    let hub = TestHub::start().await;
    let clusters = ["edge-1", "edge-2", "edge-3"];
    let mut agents = Vec::new();
    for (i, c) in clusters.iter().enumerate() {
        let token = hub.hub.mint_join_token(c).unwrap();
        agents.push(start_agent(
            &hub,
            c,
            &format!("agent-{i}"),
            &token,
            transport,
        ));
    }
    for a in &agents {
        let s = a
            .agent
            .wait_for(WAIT, |s| s.connected.is_some())
            .await
            .expect("agent connects");
        assert_eq!(s.connected, Some(transport));
        assert_eq!(s.registrations, 1);
    }

    let channel = hub.channel().await;
    let mut resources = ResourceServiceClient::new(channel.clone());
    let mut links = LinkServiceClient::new(channel.clone());
    wait_connected(&channel, &hub.admin_token, 3).await;

    // Each call is answered by the agent of the cluster it names, for the
    // caller the hub authenticated.
    for (i, c) in clusters.iter().enumerate() {
        let r = resources
            .get(with_token(get(c, "web"), &hub.admin_token))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(field(&r, "cluster"), *c);
        assert_eq!(field(&r, "agent"), format!("agent-{i}"));
        assert_eq!(field(&r, "user"), "otter:admin");
        assert!(field(&r, "groups").contains("system:authenticated"));
    }

    // ListLinks: every cluster connected over this transport.
    let listed = links
        .list_links(with_token(ListLinksRequest {}, &hub.admin_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.links.len(), 3);
    for l in &listed.links {
        assert_eq!(l.state, Some(LinkState::Connected as i32), "{l:?}");
        assert_eq!(l.transport.as_deref(), Some(transport.as_str()));
    }

    // Errors: no token, unknown cluster.
    let e = resources
        .get(Request::new(get("edge-1", "x")))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let e = resources
        .get(with_token(get("nowhere", "x"), &hub.admin_token))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(
        e.message().contains("nowhere is not registered"),
        "{}",
        e.message()
    );

    // Streaming, and cancellation reaching the agent.
    let mut watch = resources
        .watch(with_token(
            WatchRequest {
                cluster: Some("edge-2".into()),
                ..Default::default()
            },
            &hub.admin_token,
        ))
        .await
        .unwrap()
        .into_inner();
    for i in 0..3 {
        let ev = watch.next().await.unwrap().unwrap();
        assert_eq!(ev.resource_version.as_deref(), Some(i.to_string().as_str()));
        assert_eq!(field(ev.resource.as_ref().unwrap(), "cluster"), "edge-2");
    }
    assert_eq!(agents[1].live_watches.load(Ordering::SeqCst), 1);
    drop(watch);
    let live = agents[1].live_watches.clone();
    wait_until(
        async || live.load(Ordering::SeqCst) == 0,
        "the agent to end the cancelled watch",
    )
    .await;

    // Head-of-line: a bulk stream that the caller does not read, and small
    // calls on the same tunnel still finish.
    let mut bulk = resources
        .watch(with_token(bulk_watch("edge-1"), &hub.admin_token))
        .await
        .unwrap()
        .into_inner();
    bulk.next().await.unwrap().unwrap();
    for _ in 0..10 {
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            resources.get(with_token(get("edge-1", "small"), &hub.admin_token)),
        )
        .await
        .expect("small call finished while the bulk stream is stalled")
        .unwrap();
        assert_eq!(field(r.get_ref(), "name"), "small");
    }
    assert_eq!(
        agents[0].live_watches.load(Ordering::SeqCst),
        1,
        "bulk stream still running"
    );
    drop(bulk);

    // Agent replaced for the same cluster: the old tunnel is closed and the
    // new agent answers.
    // A join token enrolls a cluster once: an admin re-enrolls it first.
    assert!(hub.hub.re_enroll("edge-3").unwrap());
    let token = hub.hub.mint_join_token("edge-3").unwrap();
    let replacement = start_agent(&hub, "edge-3", "agent-3b", &token, transport);
    replacement
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("replacement connects");
    agents[2]
        .agent
        .wait_for(WAIT, |s| s.connected.is_none())
        .await
        .expect("old tunnel closed");
    wait_until(
        async || {
            let mut c = ResourceServiceClient::new(channel.clone());
            match c
                .get(with_token(get("edge-3", "x"), &hub.admin_token))
                .await
            {
                Ok(r) => field(r.get_ref(), "agent") == "agent-3b",
                Err(e) => {
                    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
                    false
                }
            }
        },
        "the replacement agent to answer for edge-3",
    )
    .await;
    // The replaced agent cannot come back with its old certificate: its
    // handshakes complete on its side, but the hub refuses to route to it
    // (it may look connected for the instant before the hub closes it).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for _ in 0..5 {
        let r = resources
            .get(with_token(get("edge-3", "x"), &hub.admin_token))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            field(&r, "agent"),
            "agent-3b",
            "the replaced agent never serves again"
        );
    }
    let routed = hub
        .hub
        .state
        .registry
        .get("edge-3")
        .map(|t| t.agent_id.clone());
    assert_eq!(routed.as_deref(), Some("agent-3b"));

    let old = agents.remove(2);
    old.agent.shutdown().await;

    // Hub restart: same data dir and ports; agents reconnect with the
    // certificates they have, without registering again.
    let ports = (hub.hub.api_addr, hub.hub.tunnel_addr);
    let dir = hub.dir.clone();
    let connects_before: Vec<u32> = agents.iter().map(|a| a.agent.status().connects).collect();
    hub.hub.shutdown().await;
    drop(channel);
    for a in &agents {
        a.agent
            .wait_for(WAIT, |s| s.connected.is_none())
            .await
            .expect("agent sees the hub go");
    }
    let hub = TestHub::start_in(dir, Some(ports)).await;
    for (a, before) in agents.iter().zip(connects_before) {
        let s = a
            .agent
            .wait_for(WAIT, |s| s.connected.is_some() && s.connects > before)
            .await
            .expect("agent reconnects");
        assert_eq!(
            s.registrations, 1,
            "no second registration after a hub restart"
        );
    }
    replacement
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("replacement reconnects");
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 3).await;
    let mut resources = ResourceServiceClient::new(channel.clone());
    let r = resources
        .get(with_token(get("edge-2", "after"), &hub.admin_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(field(&r, "cluster"), "edge-2");
    let listed = LinkServiceClient::new(channel.clone())
        .list_links(with_token(ListLinksRequest {}, &hub.admin_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.links.len(), 3, "links survived the restart");

    // Offline cluster: registered, no tunnel.
    for a in agents {
        a.agent.shutdown().await;
    }
    wait_until(
        async || {
            let mut c = ResourceServiceClient::new(channel.clone());
            // A call racing the tunnel's close says the tunnel failed;
            // once the hub has seen it close, the cluster is offline.
            matches!(c.get(with_token(get("edge-1", "x"), &hub.admin_token)).await, Err(e) if e.code() == Code::Unavailable && e.message().contains("is offline"))
        },
        "edge-1 to be reported offline",
    )
    .await;
    let e = resources
        .get(with_token(get("edge-1", "x"), &hub.admin_token))
        .await
        .unwrap_err();
    assert!(
        e.message().contains("cluster edge-1 is offline (last seen"),
        "{}",
        e.message()
    );
    replacement.agent.shutdown().await;
    hub.hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_core_over_quic() {
    link_core(TransportKind::Quic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_core_over_websocket() {
    link_core(TransportKind::Ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_core_over_h2() {
    link_core(TransportKind::H2).await;
}

/// Register refuses bad tokens and CSRs with the right codes.
#[tokio::test]
async fn register_rejects_bad_input() {
    let hub = TestHub::start().await;
    let mut link = LinkServiceClient::new(hub.channel().await);
    let (_key, csr) = otter_pki::csr::generate("edge-1", "a1").unwrap();
    let register = |cluster: &str, token: &str, csr: &str| RegisterRequest {
        cluster: Some(cluster.into()),
        csr: Some(csr.as_bytes().to_vec()),
        agent_id: Some("a1".into()),
        agent_version: Some("v0.1.0".into()),
        rancher_project_id: None,
        join_token: Some(token.into()),
    };
    let token_a = hub.hub.mint_join_token("edge-1").unwrap();

    let e = link
        .register(register("edge-1", "otj_0000000000000000_forged", &csr))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let e = link
        .register(register("edge-1", "", &csr))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("join token"), "{}", e.message());
    let e = link
        .register(register("edge-2", &token_a, &csr))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = link
        .register(register(
            "edge-1",
            &token_a,
            "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = link
        .register(register("Bad_Name", &token_a, &csr))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let expired = {
        let mut c = otter_hub::HubConfig::new(hub.data_dir());
        c.join_token_ttl = Duration::ZERO;
        otter_hub::tokens::mint_join_token(
            &*hub.hub.state.store,
            "edge-1",
            "default",
            c.join_token_ttl,
        )
        .unwrap()
    };
    let e = link
        .register(register("edge-1", &expired, &csr))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    assert!(e.message().contains("expired"), "{}", e.message());

    // A good registration, then a renewal over mTLS with the issued certificate.
    let resp = link
        .register(register("edge-1", &token_a, &csr))
        .await
        .unwrap()
        .into_inner();
    let cert = String::from_utf8(resp.certificate.unwrap()).unwrap();
    assert_eq!(
        resp.ca_certificate.as_deref(),
        Some(hub.hub.ca_pem().as_bytes())
    );
    assert!(
        resp.tunnel_urls.iter().any(|u| u.starts_with("quic://"))
            && resp.tunnel_urls.iter().any(|u| u.starts_with("h2://"))
    );
    let (key2, csr2) = otter_pki::csr::generate("edge-1", "a1").unwrap();
    let _ = key2;
    let mtls = client_channel(hub.hub.api_addr, hub.hub.ca_pem(), Some((&cert, &_key))).await;
    let renewed = LinkServiceClient::new(mtls.clone())
        .register(register("edge-1", "", &csr2))
        .await
        .unwrap()
        .into_inner();
    assert!(renewed.certificate.is_some());
    // The same certificate cannot register another cluster.
    let e = LinkServiceClient::new(mtls)
        .register(register("edge-2", "", &csr2))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    hub.hub.shutdown().await;
}
