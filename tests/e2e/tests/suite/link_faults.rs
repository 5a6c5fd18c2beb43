//! Link core under stress: the per-tunnel call bound, a path that dies
//! without telling anyone, and certificate renewal under a live tunnel.

use std::{sync::Arc, time::Duration};

use futures::StreamExt;
use otter_e2e::{
    Relay, TestHub,
    double::{
        WAIT, bulk_watch, field, get, start_agent, start_agent_at, start_agent_with,
        wait_connected, wait_until, watch,
    },
    with_token,
};
use otter_proto::{
    link::v1::{LinkState, ListLinksRequest, link_service_client::LinkServiceClient},
    resource::v1::resource_service_client::ResourceServiceClient,
};
use otter_tunnel::TransportKind;
use tonic::Code;

/// Calls beyond a tunnel's bound are refused at once, not queued forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_beyond_the_tunnel_bound_get_resource_exhausted() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| c.max_calls_per_tunnel = 2).await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let _agent = start_agent(&hub, "edge-1", "a1", &token, TransportKind::Quic);
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 1).await;
    let mut client = ResourceServiceClient::new(channel.clone());

    let mut w1 = client
        .watch(with_token(watch("edge-1"), &hub.admin_token))
        .await
        .unwrap()
        .into_inner();
    let mut w2 = client
        .watch(with_token(watch("edge-1"), &hub.admin_token))
        .await
        .unwrap()
        .into_inner();
    w1.next().await.unwrap().unwrap();
    w2.next().await.unwrap().unwrap();
    let e = client
        .get(with_token(get("edge-1", "x"), &hub.admin_token))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("calls in flight"), "{}", e.message());

    // A slot frees when a call ends.
    drop(w1);
    wait_until(
        async || {
            let mut c = ResourceServiceClient::new(channel.clone());
            c.get(with_token(get("edge-1", "x"), &hub.admin_token))
                .await
                .is_ok()
        },
        "a slot to free up",
    )
    .await;
    drop(w2);
    hub.hub.shutdown().await;
}

/// A path that silently stops carrying packets: keepalives notice on both
/// ends within three intervals, and the tunnel comes back once the path does.
async fn dead_path_is_noticed(transport: TransportKind) {
    let relay = Relay::start().await;
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let scheme = transport.as_str();
    let hub = TestHub::start_with(dir, None, |c| {
        c.tunnel_urls =
            vec![url::Url::parse(&format!("{scheme}://localhost:{}", relay.addr.port())).unwrap()];
    })
    .await;
    relay.set_target(hub.hub.tunnel_addr);
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &token, transport);
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 1).await;
    // The hub lists the tunnel before the agent's own status says so: a
    // freeze in between made the wait for the agent's notice below return
    // at once (a loaded CI run read no tunnel end yet).
    agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("the agent's side of the tunnel is up");

    relay.freeze(true);
    let frozen_at = tokio::time::Instant::now();
    // What `otter links` shows meanwhile: Unresponsive once a keepalive
    // is missed, then Offline once the tunnel is dropped.
    let timeline = {
        let (channel, token) = (channel.clone(), hub.admin_token.clone());
        tokio::spawn(async move {
            let mut unresponsive = None;
            loop {
                let link = otter_e2e::double::link_of(&channel, &token, "edge-1").await;
                match link.state.and_then(|s| LinkState::try_from(s).ok()) {
                    Some(LinkState::Unresponsive) => {
                        unresponsive.get_or_insert(frozen_at.elapsed());
                    }
                    Some(LinkState::Offline) => return (unresponsive, frozen_at.elapsed()),
                    _ => {}
                }
                assert!(frozen_at.elapsed() < WAIT, "the link never went offline");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    // Keepalive is 1 s on both ends: dead within 3 s, plus scheduling slack.
    agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_none())
        .await
        .expect("agent notices the dead tunnel");
    let (unresponsive, offline) = timeline.await.unwrap();
    let noticed = frozen_at.elapsed();
    let unresponsive = unresponsive.expect("the link showed Unresponsive before Offline");
    println!(
        "{transport}: the link showed Unresponsive after {unresponsive:?}, Offline after {offline:?}"
    );
    assert!(unresponsive < offline);
    // The promise: a keepalive (every 1 s here) unanswered for three
    // intervals is a dead tunnel, on every transport; the first unanswered
    // one leaves up to one interval after the path went silent. 2 s of
    // slack for two shared cores.
    println!("{transport}: a silent path noticed after {noticed:?}");
    assert!(
        noticed < Duration::from_secs(3 + 1 + 2),
        "took {noticed:?} to notice"
    );
    // And named as the network's doing, not the hub's.
    let end = agent.agent.status().last_tunnel_end.expect("an end named");
    assert_eq!(end.by, otter_agent::ended::EndedBy::Network, "{end}");
    assert!(end.why.contains("silent"), "{end}");

    let connects = agent.agent.status().connects;
    relay.freeze(false);
    agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some() && s.connects > connects)
        .await
        .expect("tunnel comes back");
    wait_connected(&channel, &hub.admin_token, 1).await;
    let r = ResourceServiceClient::new(channel)
        .get(with_token(get("edge-1", "back"), &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(field(r.get_ref(), "name"), "back");
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_path_is_noticed_over_quic() {
    dead_path_is_noticed(TransportKind::Quic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_path_is_noticed_over_h2() {
    dead_path_is_noticed(TransportKind::H2).await;
}

/// With a one-minute certificate the agent renews early (here at a tenth of
/// its life) over mTLS, and the tunnel it has stays up throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_is_renewed_without_dropping_the_tunnel() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| {
        c.agent_cert_lifetime = Duration::from_secs(60)
    })
    .await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::H2, |c| {
        c.renew_at = 0.1
    });
    let first = agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connects");
    let channel = hub.channel().await;
    let mut links = LinkServiceClient::new(channel.clone());
    let serial_before = links
        .list_links(with_token(ListLinksRequest {}, &hub.admin_token))
        .await
        .unwrap()
        .into_inner()
        .links[0]
        .certificate_serial
        .clone();

    let renewed = agent
        .agent
        .wait_for(WAIT, |s| s.renewals >= 1)
        .await
        .expect("renews before expiry");
    assert_eq!(
        renewed.connects, first.connects,
        "the tunnel was not dropped to renew"
    );
    assert_eq!(renewed.registrations, 1, "renewal needs no join token");
    assert_ne!(renewed.cert_serial, first.cert_serial);
    // The hub honours a tunnel only while its certificate is valid: the
    // agent moves to a tunnel on the new one, make before break.
    let moved = agent
        .agent
        .wait_for(WAIT, |s| s.redials >= 1)
        .await
        .expect("a tunnel on the renewed certificate");
    assert_eq!(moved.connects, first.connects, "without a reconnect");
    let link = links
        .list_links(with_token(ListLinksRequest {}, &hub.admin_token))
        .await
        .unwrap()
        .into_inner()
        .links
        .remove(0);
    assert_ne!(link.certificate_serial, serial_before);
    assert_eq!(link.state, Some(LinkState::Connected as i32));
    let r = ResourceServiceClient::new(channel)
        .get(with_token(get("edge-1", "x"), &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(field(r.get_ref(), "cluster"), "edge-1");
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// A renewal runs beside the tunnel: while neither place a renewal goes
/// answers (relays in front of the tunnel port's TCP side, where it goes
/// first, and of the API port swallow every byte) the renewal hangs and
/// fails, calls on the QUIC tunnel keep being served without a stall, the
/// failure is reported, and the renewal succeeds once the hub answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_renewal_does_not_stall_calls() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let tunnel = Relay::start().await;
    let hub = TestHub::start_with(dir, None, |c| {
        c.agent_cert_lifetime = Duration::from_secs(60);
        c.diagnosis_max_age = Duration::from_millis(200);
        c.tunnel_urls = ["quic", "h2"]
            .iter()
            .map(|s| url::Url::parse(&format!("{s}://localhost:{}", tunnel.addr.port())).unwrap())
            .collect();
    })
    .await;
    tunnel.set_target(hub.hub.tunnel_addr);
    // Register and renewals on the API port go through this relay.
    let api = Relay::start().await;
    api.set_target(hub.hub.api_addr);
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent_at(
        format!("https://localhost:{}", api.addr.port())
            .parse()
            .unwrap(),
        hub.hub.ca_pem(),
        "edge-1",
        "a1",
        &token,
        TransportKind::Quic,
        |c| c.renew_at = 0.1,
    );
    let first = agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connects");
    // The tunnel port's TCP side silent first: the renewal gives up on it
    // after 10 s and is made on the API port.
    tunnel.freeze_tcp(true);
    let frozen = tokio::time::Instant::now();
    let fell_back = agent
        .agent
        .wait_for(Duration::from_secs(40), |s| s.renewals >= 1)
        .await
        .expect("renews on the API port when the tunnel port does not answer");
    assert_eq!(fell_back.renewals_on_tunnel_port, 0, "{fell_back:?}");
    assert_eq!(fell_back.renewal_failures, 0, "{fell_back:?}");
    println!(
        "renewed on the API port {:?} after the tunnel port went silent",
        frozen.elapsed()
    );
    api.freeze(true);

    // Calls until a renewal has hung and failed (due 6 s after the
    // certificate was issued, then 10 s on the tunnel port and the rest
    // of its 30 s on the API port).
    let mut resources = ResourceServiceClient::new(hub.channel().await);
    let mut slowest = Duration::ZERO;
    let mut calls = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(50);
    while agent.agent.status().renewal_failures == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no renewal failed");
        let started = tokio::time::Instant::now();
        let r = resources
            .get(with_token(get("edge-1", "x"), &hub.admin_token))
            .await
            .expect("calls are served while the renewal hangs");
        assert_eq!(field(r.get_ref(), "agent"), "a1");
        slowest = slowest.max(started.elapsed());
        calls += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = agent.agent.status();
    assert!(!status.last_renewal_error.is_empty());
    assert_eq!(status.connects, first.connects, "the tunnel stayed up");
    // The hang lasted seconds; no call waited for it.
    assert!(
        slowest < Duration::from_secs(3),
        "a call waited {slowest:?} during the hanging renewal"
    );
    println!(
        "{calls} calls while a renewal hung and failed ({}), the slowest {slowest:?}",
        status.last_renewal_error
    );
    // The hub's link listing shows it too (`otter links -o wide`), from the
    // agent's report fetched again once the one kept is stale.
    let channel = hub.channel().await;
    let listed = |failing: bool| {
        let channel = channel.clone();
        let token = hub.admin_token.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            loop {
                let link = otter_e2e::double::link_of(&channel, &token, "edge-1").await;
                let d = link.diagnosis.unwrap_or_default();
                if d.last_renewal_error.is_some() == failing {
                    return d;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "ListLinks never showed the renewal {}: {d:?}",
                    if failing { "failing" } else { "recovered" }
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let d = listed(true).await;
    assert!(d.renewal_failures.unwrap_or(0) >= 1, "{d:?}");

    api.freeze(false);
    tunnel.freeze_tcp(false);
    let renewed = agent
        .agent
        .wait_for(Duration::from_secs(90), |s| s.renewals >= 2)
        .await
        .expect("renews once the hub answers");
    assert!(renewed.last_renewal_error.is_empty());
    assert_eq!(renewed.connects, first.connects);
    listed(false).await;
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// A hub whose QUIC and HTTP/2 tunnel URLs lead through a relay that drops
/// UDP (until told otherwise).
async fn hub_behind_udp_blocking_relay() -> (TestHub, Relay) {
    let relay = Relay::start().await;
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| {
        let port = relay.addr.port();
        c.tunnel_urls = vec![
            url::Url::parse(&format!("quic://localhost:{port}")).unwrap(),
            url::Url::parse(&format!("h2://localhost:{port}")).unwrap(),
        ];
    })
    .await;
    relay.set_target(hub.hub.tunnel_addr);
    relay.block_udp(true);
    (hub, relay)
}

/// QUIC first; where UDP gets no answer the agent falls back to TLS +
/// HTTP/2 on its own and says why in its status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn falls_back_to_h2_when_udp_is_blocked() {
    let (hub, _relay) = hub_behind_udp_blocking_relay().await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::Quic, |c| {
        c.transports = vec![TransportKind::Quic, TransportKind::H2];
        c.connect_timeout = Duration::from_secs(1);
    });
    let s = agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connects");
    assert_eq!(s.connected, Some(TransportKind::H2));
    assert_eq!(s.attempts.len(), 2);
    assert_eq!(s.attempts[0].0, TransportKind::Quic);
    assert!(
        s.attempts[0].1.as_ref().unwrap_err().contains("timed out"),
        "{:?}",
        s.attempts
    );
    assert!(s.attempts[1].1.is_ok());
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 1).await;
    let links = LinkServiceClient::new(channel)
        .list_links(with_token(ListLinksRequest {}, &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(links.get_ref().links[0].transport.as_deref(), Some("h2"));
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// A hub that comes back without a word the agent understands (its
/// goodbye lost behind a frozen path, its stateless reset keyed anew): the
/// QUIC tunnel goes quiet, and the agent dials a new one beside it after
/// one and a half keepalive intervals, make before break, instead of
/// waiting out the keepalive timeout (three intervals) and reconnecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_quic_tunnel_is_replaced_before_its_keepalive_timeout() {
    use otter_hub::store::{SledStore, Store, tree};
    let relay = Relay::start().await;
    let dir = Arc::new(tempfile::tempdir().unwrap());
    // Long enough that the hub's restart fits well inside the quiet spell
    // (6 s) and the move well inside the keepalive timeout (12 s).
    let keepalive = otter_tunnel::Keepalive::every(Duration::from_secs(4));
    let port = relay.addr.port();
    let tweak = move |c: &mut otter_hub::config::HubConfig| {
        c.keepalive = keepalive;
        c.tunnel_urls = vec![url::Url::parse(&format!("quic://localhost:{port}")).unwrap()];
    };
    let hub = TestHub::start_with(dir.clone(), None, tweak).await;
    relay.set_target(hub.hub.tunnel_addr);
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::Quic, |c| {
        c.keepalive = keepalive;
    });
    wait_connected(&hub.channel().await, &hub.admin_token, 1).await;
    let before = agent.agent.status();
    assert_eq!(before.quiet_probes, 0, "{before:?}");

    relay.freeze(true);
    let frozen = tokio::time::Instant::now();
    let ports = (hub.hub.api_addr, hub.hub.tunnel_addr);
    hub.hub.shutdown().await;
    // The store's lock is released a moment after the hub stops.
    let store = loop {
        match SledStore::open(dir.path()) {
            Ok(store) => break store,
            Err(e) => {
                assert!(frozen.elapsed() < WAIT, "the store stays locked: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    store.delete(tree::META, "quic-reset-key").unwrap();
    drop(store);
    let hub = TestHub::start_with(dir, Some(ports), tweak).await;
    relay.freeze(false);
    let restarted = frozen.elapsed();

    let s = agent
        .agent
        .wait_for(WAIT, |s| s.redials > before.redials)
        .await
        .expect("the agent moves to a new tunnel");
    let moved = frozen.elapsed();
    println!("hub back {restarted:?} after the path froze; the agent moved after {moved:?}");
    assert_eq!(s.quiet_probes, 1, "{s:?}");
    assert_eq!(
        s.connects, before.connects,
        "the agent moved, make before break, without reconnecting: {s:?}"
    );
    assert_eq!(s.connected, Some(TransportKind::Quic));
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 1).await;
    let r = ResourceServiceClient::new(channel)
        .get(with_token(get("edge-1", "moved"), &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(field(r.get_ref(), "name"), "moved");
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// The agent dies mid-stream and does not come back within the hub's
/// grace for Watches: the caller's stream ends with Unavailable naming the
/// cluster, not a hang or a bare reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_gone_mid_stream_ends_the_call_with_unavailable() {
    for transport in [TransportKind::Quic, TransportKind::H2] {
        let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
        let hub = TestHub::start_with(dir, None, |c| {
            c.watch_resume_grace = Duration::from_secs(1);
        })
        .await;
        let token = hub.hub.mint_join_token("edge-1").unwrap();
        let agent = start_agent(&hub, "edge-1", "a1", &token, transport);
        let channel = hub.channel().await;
        wait_connected(&channel, &hub.admin_token, 1).await;
        let mut stream = ResourceServiceClient::new(channel)
            .watch(with_token(watch("edge-1"), &hub.admin_token))
            .await
            .unwrap()
            .into_inner();
        for _ in 0..3 {
            stream.next().await.unwrap().unwrap();
        }
        agent.agent.shutdown().await;
        let end = tokio::time::timeout(WAIT, stream.next())
            .await
            .expect("stream ends, no hang");
        let e = end.expect("an error, not a clean end").unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{transport}: {e:?}");
        assert!(e.message().contains("edge-1"), "{}", e.message());
        hub.hub.shutdown().await;
    }
}

/// Make before break: an agent that fell back to HTTP/2 because UDP was
/// blocked tries QUIC again now and then while connected; once UDP passes,
/// it opens a QUIC tunnel, new calls take it, and a stream that was in
/// flight on the HTTP/2 tunnel keeps flowing until its caller ends it, after
/// which the hub closes the drained tunnel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switches_to_a_better_transport_without_dropping_calls() {
    let (hub, relay) = hub_behind_udp_blocking_relay().await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::Quic, |c| {
        c.transports = vec![TransportKind::Quic, TransportKind::H2];
        c.connect_timeout = Duration::from_secs(1);
        c.transport_retry = Duration::from_secs(1);
    });
    let s = agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connects");
    assert_eq!(s.connected, Some(TransportKind::H2));
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 1).await;

    // A stream in flight on the HTTP/2 tunnel.
    let mut bulk = ResourceServiceClient::new(channel.clone())
        .max_decoding_message_size(1024 * 1024)
        .watch(with_token(bulk_watch("edge-1"), &hub.admin_token))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..5 {
        bulk.next().await.unwrap().unwrap();
    }
    // Probes fail while UDP is blocked; nothing changes.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(agent.agent.status().switches, 0);
    assert_eq!(agent.agent.status().connected, Some(TransportKind::H2));

    relay.block_udp(false);
    let s = agent
        .agent
        .wait_for(WAIT, |s| s.switches == 1)
        .await
        .expect("switches once QUIC works");
    assert_eq!(s.connected, Some(TransportKind::Quic));
    // The stream from before the switch still flows.
    for _ in 0..20 {
        tokio::time::timeout(WAIT, bulk.next())
            .await
            .expect("in time")
            .expect("open")
            .expect("an event");
    }
    // New calls go over QUIC.
    wait_until(
        async || {
            LinkServiceClient::new(channel.clone())
                .list_links(with_token(ListLinksRequest {}, &hub.admin_token))
                .await
                .unwrap()
                .into_inner()
                .links
                .first()
                .is_some_and(|l| l.transport.as_deref() == Some("quic"))
        },
        "the link to show quic",
    )
    .await;
    let r = ResourceServiceClient::new(channel.clone())
        .get(with_token(get("edge-1", "after-switch"), &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(field(r.get_ref(), "name"), "after-switch");
    // The caller ends its stream: the drained HTTP/2 tunnel is closed.
    drop(bulk);
    let h2 = hub
        .hub
        .state
        .metrics
        .tunnels
        .get_or_create(&otter_hub::metrics::TransportLabel {
            transport: "h2".into(),
        })
        .clone();
    wait_until(async || h2.get() == 0, "the old tunnel to close").await;
    assert_eq!(agent.agent.status().connected, Some(TransportKind::Quic));
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// A hub that comes back with its tunnel port moved: its agents ask for
/// its tunnel URLs again (a renewal) once their dials have failed for 10 s
/// while the API answers, and are back then, not when their certificate is
/// next due (16 h with the default lifetime).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_find_a_moved_tunnel_port() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_in(dir.clone(), None).await;
    let api = hub.hub.api_addr;
    let old_tunnel = hub.hub.tunnel_addr;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &token, TransportKind::H2);
    let first = agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connects");
    hub.hub.shutdown().await;

    // Same data and API port, another tunnel port.
    let hub = TestHub::start_in(dir, Some((api, "127.0.0.1:0".parse().unwrap()))).await;
    assert_ne!(hub.hub.tunnel_addr, old_tunnel);
    let moved = tokio::time::Instant::now();
    let back = agent
        .agent
        .wait_for(WAIT, |s| {
            s.connects > first.connects && s.connected.is_some()
        })
        .await
        .expect("back on the moved port");
    assert!(
        back.renewals >= 1,
        "learned the URLs by a renewal: {back:?}"
    );
    assert_eq!(back.registrations, 1, "with its certificate, no join token");
    println!(
        "back {:.2} s after the hub came up on another tunnel port",
        moved.elapsed().as_secs_f64()
    );
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// The hub tells its tunnel URLs on every tunnel (with its diagnosis
/// request), so an agent learns where it serves now while its old URL
/// still leads there: here the old URL is a relay in front of a hub that
/// came back on another tunnel port and lists its own. When the relay's
/// path goes silent, the agent is back on the new port within its backoff,
/// with no renewal and no failed rounds to wait out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_learn_the_hubs_tunnel_urls_on_every_tunnel() {
    let relay = Relay::start().await;
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let via_relay = url::Url::parse(&format!("h2://localhost:{}", relay.addr.port())).unwrap();
    let hub = TestHub::start_with(dir.clone(), None, |c| {
        c.tunnel_urls = vec![via_relay.clone()]
    })
    .await;
    relay.set_target(hub.hub.tunnel_addr);
    let api = hub.hub.api_addr;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &token, TransportKind::H2);
    agent
        .agent
        .wait_for(WAIT, |s| s.advertised_urls == [via_relay.clone()])
        .await
        .expect("connects through the relay, which the hub lists");
    hub.hub.shutdown().await;

    // The same hub data on another tunnel port, listing that port.
    let hub = TestHub::start_in(dir, Some((api, "127.0.0.1:0".parse().unwrap()))).await;
    relay.set_target(hub.hub.tunnel_addr);
    let own = format!(":{}", hub.hub.tunnel_addr.port());
    let told = agent
        .agent
        .wait_for(WAIT, |s| {
            s.connected.is_some() && s.advertised_urls.iter().any(|u| u.as_str().contains(&own))
        })
        .await
        .expect("back through the relay and told the new URLs");
    relay.freeze(true);
    let back = agent
        .agent
        .wait_for(WAIT, |s| {
            s.connected.is_some() && s.connects > told.connects
        })
        .await
        .expect("back on the URL the hub told, without the relay");
    assert_eq!(back.renewals, 0, "no renewal was needed: {back:?}");
    assert_eq!(back.registrations, 1);
    let remote = hub.hub.state.registry.get("edge-1").expect("tunnel").remote;
    assert_ne!(remote, relay.addr, "dialled the hub directly");
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// An agent limited to WebSocket, on a hub that lists only QUIC and
/// HTTP/2 URLs but serves WebSocket on the same port, still connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_is_not_stranded_on_a_transport_the_hub_does_not_list() {
    let port = otter_e2e::procs::free_port();
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| {
        c.tunnel_listen = format!("127.0.0.1:{port}").parse().unwrap();
        c.tunnel_urls = ["quic", "h2"]
            .iter()
            .map(|s| url::Url::parse(&format!("{s}://localhost:{port}")).unwrap())
            .collect();
    })
    .await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &token, TransportKind::Ws);
    let s = agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connects over WebSocket");
    assert_eq!(s.connected, Some(TransportKind::Ws));
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// Renewals follow the hub's clock: an agent whose clock runs 90 s ahead,
/// with one-minute certificates, renews when its share of the life (here
/// 30 %) has passed by the hub's clock, not at once and again (it made
/// thousands a minute). And the hub keeps one cluster's renewals two seconds apart
/// however they come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_follow_the_hubs_clock_and_are_paced_per_cluster() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| {
        c.agent_cert_lifetime = Duration::from_secs(60)
    })
    .await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::H2, |c| {
        c.clock.offset_secs = 90;
        c.renew_at = 0.3;
    });
    agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connects");
    tokio::time::sleep(Duration::from_secs(8)).await;
    let s = agent.agent.status();
    assert_eq!(s.renewals, 0, "no renewal before it is due: {s:?}");
    assert!(s.connected.is_some());
    // Due 18 s after issue by the hub's clock.
    let renewed = agent
        .agent
        .wait_for(Duration::from_secs(60), |s| s.renewals >= 1)
        .await
        .expect("renews when due");
    assert_eq!(renewed.renewals, 1);
    agent.agent.shutdown().await;

    // A certificate of the link (the serial is pinned, so one the hub
    // issued: re-enrolled with a join token), renewing twice in a row.
    assert!(hub.hub.re_enroll("edge-1").unwrap());
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let (key, csr) = otter_pki::csr::generate("edge-1", "a1").unwrap();
    let cert = LinkServiceClient::new(hub.channel().await)
        .register(otter_proto::link::v1::RegisterRequest {
            cluster: Some("edge-1".into()),
            csr: Some(csr.into_bytes()),
            agent_id: Some("a1".into()),
            agent_version: Some("test/1".into()),
            join_token: Some(token),
            ..Default::default()
        })
        .await
        .expect("re-enrolled")
        .into_inner()
        .certificate
        .unwrap();
    let cert = String::from_utf8(cert).unwrap();
    let channel =
        otter_e2e::client_channel(hub.hub.api_addr, hub.hub.ca_pem(), Some((&cert, &key))).await;
    let renew = || {
        let mut link = LinkServiceClient::new(channel.clone());
        let csr = otter_pki::csr::generate("edge-1", "a1").unwrap().1;
        async move {
            link.register(otter_proto::link::v1::RegisterRequest {
                cluster: Some("edge-1".into()),
                csr: Some(csr.into_bytes()),
                agent_id: Some("a1".into()),
                agent_version: Some("test/1".into()),
                ..Default::default()
            })
            .await
        }
    };
    tokio::time::sleep(otter_hub::link_service::MIN_RENEWAL_GAP).await;
    renew().await.expect("a renewal");
    let e = renew().await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.metadata().get("retry-after-ms").is_some(), "{e:?}");
    hub.hub.shutdown().await;
}
