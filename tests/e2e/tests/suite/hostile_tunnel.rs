//! Tunnel identity under attack, through a real hub on loopback: client
//! certificates from another CA, expired ones, and a genuine certificate of
//! cluster A used to try to serve cluster B. None is admitted for what it
//! is not, the hub keeps running, and another agent's calls keep working
//! during and after. An admitted agent that lies about another cluster's
//! session cannot touch that session.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::StreamExt;
use otter_e2e::{
    TestHub,
    double::{Double, WAIT, field, get, start_agent, wait_connected},
    kube::{KubeEnv, sim_config, within},
    procs::echo_server,
    with_token,
};
use otter_pki::{AgentIdentity, CertificateAuthority};
use otter_proto::{
    link::v1::{
        LinkState, ListLinksRequest, RegisterRequest, link_service_client::LinkServiceClient,
    },
    resource::v1::{
        resource_service_client::ResourceServiceClient,
        resource_service_server::ResourceServiceServer,
    },
    runtime::v1 as rt,
};
use otter_tunnel::{Acceptor, TransportKind, frame::Limits};
use tonic::Code;

/// Certificate and key PEM for `cluster`/`agent`, signed by `ca`.
fn cert_from(
    ca: &CertificateAuthority,
    cluster: &str,
    agent: &str,
    life: Duration,
) -> (String, String) {
    let (key, csr) = otter_pki::csr::generate(cluster, agent).unwrap();
    let id = AgentIdentity::new(cluster, agent).unwrap();
    (ca.sign_agent_csr(&csr, &id, life).unwrap().pem, key)
}

/// A Register of `cluster`/`agent` with `csr`, on `token` (empty: a
/// renewal, on the caller's certificate).
fn register_request(cluster: &str, agent: &str, token: &str, csr: &str) -> RegisterRequest {
    RegisterRequest {
        cluster: Some(cluster.into()),
        csr: Some(csr.as_bytes().to_vec()),
        agent_id: Some(agent.into()),
        agent_version: Some("v0.1.0".into()),
        rancher_project_id: None,
        join_token: Some(token.into()),
    }
}

/// Certificate and key PEM of `cluster`/`agent`, enrolled on a fresh join
/// token as its agent would.
async fn enrolled(hub: &TestHub, cluster: &str, agent: &str) -> (String, String) {
    let token = hub.hub.mint_join_token(cluster).unwrap();
    enrolled_with(hub, cluster, agent, &token).await
}

/// Like [`enrolled`], on the join token given.
async fn enrolled_with(hub: &TestHub, cluster: &str, agent: &str, token: &str) -> (String, String) {
    let (key, csr) = otter_pki::csr::generate(cluster, agent).unwrap();
    let cert = LinkServiceClient::new(hub.channel().await)
        .register(register_request(cluster, agent, token, &csr))
        .await
        .unwrap()
        .into_inner()
        .certificate
        .unwrap();
    (String::from_utf8(cert).unwrap(), key)
}

/// Dials the hub's tunnel port as an agent would, presenting `cert`.
async fn dial(
    hub: &TestHub,
    transport: TransportKind,
    cert: &str,
    key: &str,
) -> otter_tunnel::Result<Box<dyn Acceptor>> {
    dial_with(hub, transport, agent_tls(hub, transport, cert, key)).await
}

/// The TLS an agent dials `transport` with, presenting `cert`. Dials with
/// clones of one such config resume each other's sessions (rustls resumes
/// only with the verifier and certificate of the config that made them).
fn agent_tls(
    hub: &TestHub,
    transport: TransportKind,
    cert: &str,
    key: &str,
) -> rustls::ClientConfig {
    let alpn = otter_e2e::tunnel_alpn(transport);
    otter_pki::tls::client_config(hub.hub.ca_pem(), Some((cert, key)), &[alpn]).unwrap()
}

/// Like [`dial`], with the TLS given.
async fn dial_with(
    hub: &TestHub,
    transport: TransportKind,
    tls: rustls::ClientConfig,
) -> otter_tunnel::Result<Box<dyn Acceptor>> {
    otter_e2e::dial_tunnel(hub.hub.tunnel_addr, transport, tls).await
}

/// The error a refused dialler sees: at the handshake, or (TLS 1.3 and
/// QUIC check the client's certificate after the client considers the
/// handshake done) on its first wait for a stream.
async fn refusal(hub: &TestHub, transport: TransportKind, cert: &str, key: &str) -> String {
    refusal_with(hub, transport, agent_tls(hub, transport, cert, key)).await
}

/// Like [`refusal`], with the TLS given.
async fn refusal_with(
    hub: &TestHub,
    transport: TransportKind,
    tls: rustls::ClientConfig,
) -> String {
    match dial_with(hub, transport, tls).await {
        Err(e) => e.to_string(),
        Ok(mut acceptor) => match tokio::time::timeout(WAIT, acceptor.accept()).await {
            Err(_) => panic!("{transport:?}: tunnel neither refused nor closed"),
            Ok(Ok(Some(_))) => panic!("{transport:?}: the hub opened a stream on a refused tunnel"),
            Ok(Ok(None)) => "closed".into(),
            Ok(Err(e)) => e.to_string(),
        },
    }
}

/// The TLS alert (TCP) or QUIC crypto error naming an unknown issuer.
fn unknown_ca(why: &str) -> bool {
    why.contains("UnknownCA") || why.contains("UnknownIssuer")
}

/// The same naming an expired certificate.
fn expired(why: &str) -> bool {
    why.contains("CertificateExpired") || why.contains("certificate expired")
}

/// Calls `cluster` in a loop until stopped (bounded: at most 10,000 calls),
/// counting answers from `agent` and anything else.
fn keep_calling(
    hub: &TestHub,
    channel: tonic::transport::Channel,
    cluster: &'static str,
    agent: &'static str,
) -> (
    Arc<AtomicBool>,
    tokio::task::JoinHandle<(usize, Vec<String>)>,
) {
    let stop = Arc::new(AtomicBool::new(false));
    let token = hub.admin_token.clone();
    let handle = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut client = ResourceServiceClient::new(channel);
            let (mut ok, mut bad) = (0, Vec::new());
            for i in 0..10_000 {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                match client
                    .get(with_token(get(cluster, &format!("n{i}")), &token))
                    .await
                {
                    Ok(r) if field(r.get_ref(), "agent") == agent => ok += 1,
                    Ok(r) => bad.push(format!("answered by {}", field(r.get_ref(), "agent"))),
                    Err(e) => bad.push(e.to_string()),
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (ok, bad)
        }
    });
    (stop, handle)
}

async fn refuses_foreign_and_expired(transport: TransportKind) {
    let hub = TestHub::start().await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &token, transport);
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 1).await;
    let (stop, calls) = keep_calling(&hub, channel.clone(), "edge-1", "a1");

    // The same identity as the live agent, signed by another CA.
    let rogue_ca = CertificateAuthority::generate("rogue CA").unwrap();
    let (cert, key) = cert_from(&rogue_ca, "edge-1", "a1", Duration::from_secs(3600));
    let why = refusal(&hub, transport, &cert, &key).await;
    assert!(unknown_ca(&why), "{transport:?}: {why}");

    // The live agent's identity from the hub's own CA, but expired.
    let cas = hub.hub.state.authority.current();
    let (cert, key) = cert_from(&cas.active, "edge-1", "a1", Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let why = refusal(&hub, transport, &cert, &key).await;
    assert!(expired(&why), "{transport:?}: {why}");

    // A burst of both at once does not disturb the live agent either.
    let burst: Vec<_> = (0..8)
        .map(|i| {
            let (cert, key) = if i % 2 == 0 {
                cert_from(&rogue_ca, "edge-1", "a1", Duration::from_secs(3600))
            } else {
                (cert.clone(), key.clone())
            };
            let hub = &hub;
            async move { refusal(hub, transport, &cert, &key).await }
        })
        .collect();
    for why in futures::future::join_all(burst).await {
        assert!(unknown_ca(&why) || expired(&why), "{why}");
    }

    stop.store(true, Ordering::SeqCst);
    let (ok, bad) = calls.await.unwrap();
    assert!(bad.is_empty(), "the live agent's calls failed: {bad:?}");
    assert!(ok > 0);
    // After: still the same agent, still connected, still answering.
    let r = ResourceServiceClient::new(channel.clone())
        .get(with_token(get("edge-1", "after"), &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(field(r.get_ref(), "agent"), "a1");
    assert_eq!(
        agent.agent.status().connects,
        1,
        "the live tunnel was dropped"
    );
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_ca_and_expired_certificates_are_refused_over_quic() {
    refuses_foreign_and_expired(TransportKind::Quic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_ca_and_expired_certificates_are_refused_over_h2() {
    refuses_foreign_and_expired(TransportKind::H2).await;
}

/// Serves the test double on a tunnel dialled by hand.
fn serve(
    mut acceptor: Box<dyn Acceptor>,
    cluster: &str,
    agent: &str,
) -> tokio::task::JoinHandle<()> {
    let routes = tonic::service::Routes::new(ResourceServiceServer::new(Double {
        cluster: cluster.into(),
        agent: agent.into(),
        live_watches: Arc::new(AtomicUsize::new(0)),
    }));
    tokio::spawn(async move {
        while let Ok(Some(stream)) = acceptor.accept().await {
            let routes = routes.clone();
            tokio::spawn(otter_tunnel::http::serve(stream, routes, Limits::default()));
        }
    })
}

/// A genuine certificate of cluster A cannot serve cluster B: the hub reads
/// the cluster from the certificate, so the tunnel is A's, B's calls keep
/// going to B's agent, and when B's agent is gone they fail as offline
/// rather than reach A's tunnel. Nor can A's certificate be renewed into
/// B's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_of_cluster_a_cannot_serve_cluster_b() {
    let hub = TestHub::start().await;
    let token_b = hub.hub.mint_join_token("edge-b").unwrap();
    let agent_b = start_agent(&hub, "edge-b", "b1", &token_b, TransportKind::Quic);
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 1).await;
    let (stop, calls) = keep_calling(&hub, channel.clone(), "edge-b", "b1");

    // Cluster A's agent registers the ordinary way and gets its certificate.
    let (key, csr) = otter_pki::csr::generate("edge-a", "a1").unwrap();
    let token_a = hub.hub.mint_join_token("edge-a").unwrap();
    let register =
        |cluster: &str, token: &str, csr: &str| register_request(cluster, "a1", token, csr);
    let resp = LinkServiceClient::new(channel.clone())
        .register(register("edge-a", &token_a, &csr))
        .await
        .unwrap()
        .into_inner();
    let cert = String::from_utf8(resp.certificate.unwrap()).unwrap();

    // It renews into cluster B: refused.
    let mtls =
        otter_e2e::client_channel(hub.hub.api_addr, hub.hub.ca_pem(), Some((&cert, &key))).await;
    let (_, csr_b) = otter_pki::csr::generate("edge-b", "a1").unwrap();
    let e = LinkServiceClient::new(mtls)
        .register(register("edge-b", "", &csr_b))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");

    // It dials the tunnel with its certificate and serves a double that
    // would answer anything, as whoever it likes.
    let acceptor = dial(&hub, TransportKind::H2, &cert, &key).await.unwrap();
    let rogue = serve(acceptor, "edge-b", "rogue");
    wait_connected(&channel, &hub.admin_token, 2).await;
    let links = LinkServiceClient::new(channel.clone())
        .list_links(with_token(ListLinksRequest {}, &hub.admin_token))
        .await
        .unwrap()
        .into_inner()
        .links;
    let link = |c: &str| {
        links
            .iter()
            .find(|l| l.cluster.as_deref() == Some(c))
            .unwrap()
            .clone()
    };
    assert_eq!(link("edge-b").agent_id.as_deref(), Some("b1"));
    assert_eq!(link("edge-b").transport.as_deref(), Some("quic"));
    assert_eq!(link("edge-a").transport.as_deref(), Some("h2"));
    // Its tunnel carries cluster A's calls only.
    let r = ResourceServiceClient::new(channel.clone())
        .get(with_token(get("edge-a", "x"), &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(field(r.get_ref(), "agent"), "rogue");

    stop.store(true, Ordering::SeqCst);
    let (ok, bad) = calls.await.unwrap();
    assert!(bad.is_empty(), "cluster B's calls went wrong: {bad:?}");
    assert!(ok > 0);

    // B's agent goes away: B's calls fail as offline, never reach A's tunnel.
    agent_b.agent.shutdown().await;
    wait_connected(&channel, &hub.admin_token, 1).await;
    let e = ResourceServiceClient::new(channel.clone())
        .get(with_token(get("edge-b", "x"), &hub.admin_token))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("offline"), "{e:?}");
    let still = LinkServiceClient::new(channel.clone())
        .list_links(with_token(ListLinksRequest {}, &hub.admin_token))
        .await
        .unwrap()
        .into_inner()
        .links;
    let b = still
        .iter()
        .find(|l| l.cluster.as_deref() == Some("edge-b"))
        .unwrap();
    assert_eq!(b.state, Some(LinkState::Offline as i32));
    assert_eq!(b.agent_id.as_deref(), Some("b1"));
    rogue.abort();
    hub.hub.shutdown().await;
}

/// A tunnel lives no longer than the certificate it was opened with: the
/// hub closes it when that certificate expires, though the connection was
/// admitted (and carried calls) while it was valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_tunnel_is_closed_when_its_certificate_expires() {
    let hub = TestHub::start().await;
    let channel = hub.channel().await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &token, TransportKind::H2);
    agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connects");
    agent.agent.shutdown().await;
    let cas = hub.hub.state.authority.current();
    for transport in [TransportKind::H2, TransportKind::Quic] {
        // The same agent's identity on a certificate valid for 3 seconds,
        // made the link's current one (as a renewal would).
        let (cert, key) = cert_from(&cas.active, "edge-1", "a1", Duration::from_secs(3));
        let der = otter_pki::tls::parse_certs(&cert).unwrap().remove(0);
        let peer = otter_pki::identity::PeerCertificate::from_der(&der).unwrap();
        set_serials(&hub, "edge-1", &peer.serial, None);
        let started = tokio::time::Instant::now();
        let tunnel = serve(
            dial(&hub, transport, &cert, &key).await.expect("dials"),
            "edge-1",
            "a1",
        );
        // Admitted: a call reaches the agent through it.
        otter_e2e::double::wait_until(
            async || {
                ResourceServiceClient::new(channel.clone())
                    .get(with_token(get("edge-1", "x"), &hub.admin_token))
                    .await
                    .is_ok_and(|r| field(r.get_ref(), "agent") == "a1")
            },
            "a call through the short-lived certificate's tunnel",
        )
        .await;
        let ended = tokio::time::timeout(Duration::from_secs(20), tunnel).await;
        assert!(
            ended.is_ok(),
            "{transport}: the tunnel outlived its certificate"
        );
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        // Closed at expiry, not refused or dropped before it.
        assert!(
            now + 1.0 >= peer.not_after as f64,
            "{transport}: closed {:.1} s before the certificate expired",
            peer.not_after as f64 - now
        );
        println!(
            "{transport}: closed {:.1} s after a 3 s certificate's tunnel was opened",
            started.elapsed().as_secs_f64()
        );
    }
    hub.hub.shutdown().await;
}

/// Of two tunnels of one agent, the one dialled last is kept, whichever the
/// hub admits last. A connection that reached the hub before the agent's
/// live tunnel did (a dial the agent gave up on, its handshake or its
/// admission outlasting the agent's bound) is refused when it completes,
/// and the live tunnel goes on serving; a dial that comes after the live
/// tunnel still replaces it (make before break).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_dialled_before_the_live_one_does_not_displace_it() {
    let hub = TestHub::start().await;
    let channel = hub.channel().await;
    let (cert, key) = enrolled(&hub, "edge-d", "d1").await;
    let handshakes = hub.hub.state.pacer.handshakes().clone();

    // The early dial reaches the hub and stalls before its TLS handshake.
    let early = tokio::net::TcpStream::connect(hub.hub.tunnel_addr)
        .await
        .unwrap();
    otter_e2e::double::wait_until(
        async || handshakes.pending() == 1,
        "the hub took the early connection",
    )
    .await;
    // The agent's live tunnel, dialled after it.
    let live = serve(
        dial(&hub, TransportKind::H2, &cert, &key).await.unwrap(),
        "edge-d",
        "live",
    );
    wait_connected(&channel, &hub.admin_token, 1).await;
    let via = async || {
        ResourceServiceClient::new(channel.clone())
            .get(with_token(get("edge-d", "x"), &hub.admin_token))
            .await
            .map(|r| field(r.get_ref(), "agent"))
            .unwrap_or_default()
    };
    assert_eq!(via().await, "live");

    // The early dial completes now, with the same certificate: refused.
    let tls = Arc::new(agent_tls(&hub, TransportKind::H2, &cert, &key));
    let mut stale = otter_tunnel::h2::dial_tcp(
        Box::new(early),
        "localhost".try_into().unwrap(),
        tls,
        Default::default(),
    )
    .await
    .expect("the TLS handshake itself completes");
    match tokio::time::timeout(WAIT, stale.accept()).await {
        Ok(Ok(Some(_))) => panic!("the hub admitted the stale tunnel"),
        Ok(_) => {}
        Err(_) => panic!("the stale tunnel was neither refused nor closed"),
    }
    assert!(!live.is_finished(), "the live tunnel was closed");
    assert_eq!(via().await, "live");

    // A dial after the live tunnel replaces it, and the hub closes the old.
    let newer = serve(
        dial(&hub, TransportKind::H2, &cert, &key).await.unwrap(),
        "edge-d",
        "newer",
    );
    otter_e2e::double::wait_until(
        async || via().await == "newer",
        "calls through the newer tunnel",
    )
    .await;
    tokio::time::timeout(WAIT, live)
        .await
        .expect("the replaced tunnel is closed")
        .unwrap();
    assert!(!newer.is_finished());
}

/// Opens a tunnel with the `old` certificate (admitted), ends it, then one
/// with the `new`, and waits until the hub retired the old serial: from
/// then on the old one is refused over either transport. The new tunnel's
/// task.
async fn old_then_new(
    hub: &TestHub,
    cluster: &str,
    agent: &str,
    old: (&str, &str),
    new: (&str, &str),
) -> tokio::task::JoinHandle<()> {
    use otter_hub::store::StoreExt;
    let channel = hub.channel().await;
    let first = serve(
        dial(hub, TransportKind::H2, old.0, old.1).await.unwrap(),
        cluster,
        agent,
    );
    wait_connected(&channel, &hub.admin_token, 1).await;
    first.abort();
    let second = serve(
        dial(hub, TransportKind::Quic, new.0, new.1).await.unwrap(),
        cluster,
        agent,
    );
    otter_e2e::double::wait_until(
        async || {
            hub.hub
                .state
                .store
                .get::<otter_hub::link_service::LinkRecord>("links", cluster)
                .unwrap()
                .is_some_and(|l| l.prev_serial.is_none())
        },
        "the old serial retired",
    )
    .await;
    for transport in [TransportKind::H2, TransportKind::Quic] {
        let why = refusal(hub, transport, old.0, old.1).await;
        assert!(!why.is_empty(), "{transport:?}");
    }
    second
}

/// The certificate serial is pinned: once an agent renewed and its new
/// certificate carried a tunnel, a copy of the old certificate (and key)
/// is refused at the tunnel and at renewal. Until then the old one still
/// works, in case the agent never received the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_certificate_is_refused_at_the_tunnel_and_at_renewal() {
    let hub = TestHub::start().await;
    let channel = hub.channel().await;
    let (cert1, key1) = enrolled(&hub, "edge-c", "c1").await;
    // Renews with it (a copy of it is kept: the attacker's).
    let renew = |cert: String, key: String| {
        let channel_ca = hub.hub.ca_pem().to_owned();
        let addr = hub.hub.api_addr;
        async move {
            let mtls = otter_e2e::client_channel(addr, &channel_ca, Some((&cert, &key))).await;
            let (key, csr) = otter_pki::csr::generate("edge-c", "c1").unwrap();
            LinkServiceClient::new(mtls)
                .register(register_request("edge-c", "c1", "", &csr))
                .await
                .map(|r| {
                    (
                        String::from_utf8(r.into_inner().certificate.unwrap()).unwrap(),
                        key,
                    )
                })
        }
    };
    let (cert2, key2) = renew(cert1.clone(), key1.clone()).await.unwrap();
    // The agent may not have the new certificate yet: the old one still
    // opens a tunnel, until the new one carries one.
    let new = old_then_new(&hub, "edge-c", "c1", (&cert1, &key1), (&cert2, &key2)).await;
    tokio::time::sleep(otter_hub::link_service::MIN_RENEWAL_GAP).await;
    let e = renew(cert1.clone(), key1.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("superseded"), "{e:?}");
    // The real agent renews on.
    renew(cert2, key2)
        .await
        .expect("the current certificate renews");
    // And its tunnel was never disturbed.
    let r = ResourceServiceClient::new(channel.clone())
        .get(with_token(get("edge-c", "x"), &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(field(r.get_ref(), "agent"), "c1");
    new.abort();
    hub.hub.shutdown().await;
}

/// An agent that asked for its enrollment again on its token (the answer
/// to the first was lost on the way, or came after it had given up) holds
/// the certificate of whichever answer reached it: every one opens a
/// tunnel until the newest has carried one, up to the newest two and
/// `RETRIES_KEPT` before them. In a first connect of 10,000 agents on
/// two replicas, two Registers of one agent answered in the opposite order
/// left that agent refused everywhere (its certificate superseded, its
/// token spent) until an admin re-enrolled it; with one previous serial
/// kept, three that raced could still. A re-enrollment keeps none of the
/// replaced agent's certificates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enrollment_asked_again_honours_every_answer() {
    use otter_hub::link_service::RETRIES_KEPT;
    use otter_hub::store::StoreExt;
    let hub = TestHub::start().await;
    let enroll = async |token: &str| enrolled_with(&hub, "edge-r", "r1", token).await;
    let link = || {
        hub.hub
            .state
            .store
            .get::<otter_hub::link_service::LinkRecord>("links", "edge-r")
            .unwrap()
            .unwrap()
    };
    let token = hub.hub.mint_join_token("edge-r").unwrap();
    // One answer more than are kept, each written after the one before.
    let mut answers = Vec::new();
    for _ in 0..RETRIES_KEPT + 3 {
        answers.push(enroll(&token).await);
    }
    let (beyond, kept) = answers.split_first().unwrap();
    let (newest, older) = kept.split_last().unwrap();
    for transport in [TransportKind::H2, TransportKind::Quic] {
        let why = refusal(&hub, transport, &beyond.0, &beyond.1).await;
        assert!(!why.is_empty(), "{transport:?}");
    }
    // The agent kept the oldest answer still honoured: its tunnel is
    // admitted, until the newest carries one; then none of the older.
    let (cert1, key1) = &older[0];
    let (cert2, key2) = newest;
    let newest = old_then_new(&hub, "edge-r", "r1", (cert1, key1), (cert2, key2)).await;
    for (cert, key) in &older[1..] {
        let why = refusal(&hub, TransportKind::Quic, cert, key).await;
        assert!(!why.is_empty());
    }
    newest.abort();

    // An admin re-enrolls the cluster; the new agent (same name) enrolls
    // on a new token: the replaced agent's certificate is refused.
    otter_hub::link_service::open_for_reenrollment(&*hub.hub.state.store, "edge-r")
        .unwrap()
        .expect("a link");
    let token = hub.hub.mint_join_token("edge-r").unwrap();
    let (cert3, _) = enroll(&token).await;
    let der = otter_pki::tls::parse_certs(&cert3).unwrap()[0].clone();
    let serial3 = otter_pki::identity::PeerCertificate::from_der(&der)
        .unwrap()
        .serial;
    assert_eq!(link().cert_serial, serial3);
    assert!(!link().keeps_older());
    for transport in [TransportKind::H2, TransportKind::Quic] {
        let why = refusal(&hub, transport, cert2, key2).await;
        assert!(!why.is_empty(), "{transport:?}");
    }
    hub.hub.shutdown().await;
}

/// The tunnel port's link API ([`otter_tunnel::h2::LINK_ALPN`]), where an
/// agent renews when the tunnel port is its only way out, answers Register
/// with the agent's own certificate and nothing else: not without a
/// certificate, not with a join token, not for another cluster, and no
/// other method, however the caller is authenticated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tunnel_port_renews_and_answers_nothing_else() {
    let hub = TestHub::start().await;
    let channel = hub.channel().await;
    let token = hub.hub.mint_join_token("edge-r").unwrap();
    let other_token = hub.hub.mint_join_token("edge-s").unwrap();
    let register =
        |cluster: &str, token: &str, csr: &str| register_request(cluster, "r1", token, csr);
    let (key, csr) = otter_pki::csr::generate("edge-r", "r1").unwrap();
    let cert = LinkServiceClient::new(channel.clone())
        .register(register("edge-r", &token, &csr))
        .await
        .unwrap()
        .into_inner()
        .certificate
        .unwrap();
    let cert = String::from_utf8(cert).unwrap();
    // Without a certificate: no TLS session at all.
    let anonymous = tokio::spawn({
        let (addr, ca) = (hub.hub.tunnel_addr, hub.hub.ca_pem().to_owned());
        async move {
            let ch =
                otter_e2e::client_channel_alpn(addr, &ca, None, otter_tunnel::h2::LINK_ALPN).await;
            LinkServiceClient::new(ch)
                .list_links(ListLinksRequest::default())
                .await
        }
    })
    .await;
    assert!(
        !matches!(anonymous, Ok(Ok(_))),
        "answered without a certificate: {anonymous:?}"
    );
    let mtls = otter_e2e::client_channel_alpn(
        hub.hub.tunnel_addr,
        hub.hub.ca_pem(),
        Some((&cert, &key)),
        otter_tunnel::h2::LINK_ALPN,
    )
    .await;
    let mut link = LinkServiceClient::new(mtls);
    // Another method, even with the admin's token: not here.
    let e = link
        .list_links(with_token(ListLinksRequest::default(), &hub.admin_token))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("API port"), "{e:?}");
    // A join token (another cluster's, still unspent): enroll on the API port.
    let (_, csr_s) = otter_pki::csr::generate("edge-s", "r1").unwrap();
    let e = link
        .register(register("edge-s", &other_token, &csr_s))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("API port"), "{e:?}");
    // This certificate for another cluster.
    let e = link
        .register(register("edge-s", "", &csr_s))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // Its own renewal: answered, with a certificate of the same agent.
    let (_, csr) = otter_pki::csr::generate("edge-r", "r1").unwrap();
    let renewed = link
        .register(register("edge-r", "", &csr))
        .await
        .expect("the tunnel port renews");
    let pem = String::from_utf8(renewed.into_inner().certificate.unwrap()).unwrap();
    let der = otter_pki::tls::parse_certs(&pem).unwrap().remove(0);
    let peer = otter_pki::identity::PeerCertificate::from_der(der.as_ref()).unwrap();
    assert_eq!(
        (
            peer.identity.cluster.as_str(),
            peer.identity.agent_id.as_str()
        ),
        ("edge-r", "r1")
    );
    // edge-s's token was not spent by the refused attempt.
    let (_, csr_s) = otter_pki::csr::generate("edge-s", "s1").unwrap();
    LinkServiceClient::new(channel)
        .register(RegisterRequest {
            agent_id: Some("s1".into()),
            ..register("edge-s", &other_token, &csr_s)
        })
        .await
        .expect("the other cluster's token is still good");
    hub.hub.shutdown().await;
}

/// Makes `current` the serial of `cluster`'s link, and `previous` the one its
/// agent renewed with (as a renewal the agent has not yet used would).
fn set_serials(hub: &TestHub, cluster: &str, current: &str, previous: Option<&str>) {
    otter_hub::link_service::update_link(&*hub.hub.state.store, cluster, |l| {
        l.cert_serial = current.to_owned();
        l.prev_serial = previous.map(str::to_owned);
        true
    })
    .unwrap();
}

/// Tickets the hub's tunnel port opened so far, over TCP and QUIC.
fn tickets_accepted(hub: &TestHub, transport: TransportKind) -> u64 {
    let t = &hub.hub.state.tickets;
    match transport {
        TransportKind::Quic => t.quic.accepted(),
        _ => t.tcp.accepted(),
    }
}

/// A resumed TLS session carries the certificate of the handshake it
/// resumes, unverified: the hub checks it again on admission. A session
/// of a certificate that has expired since, or that a renewal superseded,
/// resumes at the TLS layer (the hub opened its ticket) and is refused as
/// the tunnel it would carry; a current certificate's session resumes and
/// is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_sessions_of_expired_or_superseded_certificates_are_refused() {
    use otter_hub::{link_service::LinkRecord, store::StoreExt};
    let hub = TestHub::start().await;
    let channel = hub.channel().await;
    let cas = hub.hub.state.authority.current();
    let serial_of = |pem: &str| {
        let der = otter_pki::tls::parse_certs(pem).unwrap().remove(0);
        otter_pki::identity::PeerCertificate::from_der(&der)
            .unwrap()
            .serial
    };
    // The link's current certificate is one the test made: valid 4 s.
    let token = hub.hub.mint_join_token("edge-r").unwrap();
    let agent = start_agent(&hub, "edge-r", "r1", &token, TransportKind::H2);
    agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connects");
    agent.agent.shutdown().await;
    for transport in [TransportKind::H2, TransportKind::Quic] {
        let (cert, key) = cert_from(&cas.active, "edge-r", "r1", Duration::from_secs(4));
        let serial = serial_of(&cert);
        set_serials(&hub, "edge-r", &serial, None);
        let tls = agent_tls(&hub, transport, &cert, &key);
        let first = serve(
            dial_with(&hub, transport, tls.clone())
                .await
                .expect("dials"),
            "edge-r",
            "r1",
        );
        wait_connected(&channel, &hub.admin_token, 1).await;
        first.abort();
        // Still valid: the session resumes and the tunnel is admitted.
        let before = tickets_accepted(&hub, transport);
        let again = serve(
            dial_with(&hub, transport, tls.clone())
                .await
                .expect("resumes"),
            "edge-r",
            "r1",
        );
        wait_connected(&channel, &hub.admin_token, 1).await;
        assert!(
            tickets_accepted(&hub, transport) > before,
            "{transport}: the session was not resumed"
        );
        again.abort();
        // Expired: the session resumes, the tunnel is refused.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let before = tickets_accepted(&hub, transport);
        let why = refusal_with(&hub, transport, tls.clone()).await;
        assert!(
            tickets_accepted(&hub, transport) > before,
            "{transport}: the expired certificate's session was not even resumed: {why}"
        );
        assert!(!why.is_empty(), "{transport}");
        println!("{transport}: an expired certificate's resumed session: {why}");
    }

    // Superseded: a session of the certificate before a renewal.
    let (cert1, key1) = cert_from(&cas.active, "edge-r", "r1", Duration::from_secs(600));
    let (cert2, key2) = cert_from(&cas.active, "edge-r", "r1", Duration::from_secs(600));
    let (s1, s2) = (serial_of(&cert1), serial_of(&cert2));
    set_serials(&hub, "edge-r", &s1, None);
    for transport in [TransportKind::H2, TransportKind::Quic] {
        let tls = agent_tls(&hub, transport, &cert1, &key1);
        let old = serve(
            dial_with(&hub, transport, tls.clone())
                .await
                .expect("dials"),
            "edge-r",
            "r1",
        );
        wait_connected(&channel, &hub.admin_token, 1).await;
        old.abort();
        // A renewal to cert2, whose tunnel then retires cert1.
        set_serials(&hub, "edge-r", &s2, Some(&s1));
        let new = serve(
            dial(&hub, transport, &cert2, &key2).await.expect("dials"),
            "edge-r",
            "r1",
        );
        otter_e2e::double::wait_until(
            async || {
                hub.hub
                    .state
                    .store
                    .get::<LinkRecord>("links", "edge-r")
                    .unwrap()
                    .is_some_and(|l| !l.keeps_older())
            },
            "the old serial retired",
        )
        .await;
        let before = tickets_accepted(&hub, transport);
        let why = refusal_with(&hub, transport, tls.clone()).await;
        assert!(
            tickets_accepted(&hub, transport) > before,
            "{transport}: the superseded certificate's session was not resumed: {why}"
        );
        assert!(!why.is_empty(), "{transport}");
        println!("{transport}: a superseded certificate's resumed session: {why}");
        // The current tunnel was not disturbed.
        let r = ResourceServiceClient::new(channel.clone())
            .get(with_token(get("edge-r", "x"), &hub.admin_token))
            .await
            .unwrap();
        assert_eq!(field(r.get_ref(), "agent"), "r1");
        new.abort();
        // Back to cert1 as the current one for the next transport.
        set_serials(&hub, "edge-r", &s1, None);
    }
    hub.hub.shutdown().await;
}

/// A compromised agent's RuntimeService: every PortForward answers with
/// the session id it was told to name (another cluster's), then ends.
#[derive(Clone)]
struct LyingRuntime {
    names: String,
}

type Answers<T> =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<T, tonic::Status>> + Send + 'static>>;

fn refused<T>() -> Result<tonic::Response<T>, tonic::Status> {
    Err(tonic::Status::unimplemented("this agent only lies"))
}

#[tonic::async_trait]
impl rt::runtime_service_server::RuntimeService for LyingRuntime {
    type PodLogStream = Answers<rt::PodLogResponse>;
    type ExecuteTTYStream = Answers<rt::ExecuteTtyResponse>;
    type PortForwardStream = Answers<rt::PortForwardResponse>;

    async fn pod_log(
        &self,
        _: tonic::Request<rt::PodLogRequest>,
    ) -> Result<tonic::Response<Self::PodLogStream>, tonic::Status> {
        refused()
    }
    async fn execute_tty(
        &self,
        _: tonic::Request<rt::ExecuteTtyRequest>,
    ) -> Result<tonic::Response<Self::ExecuteTTYStream>, tonic::Status> {
        refused()
    }
    async fn write_tty(
        &self,
        _: tonic::Request<rt::WriteTtyRequest>,
    ) -> Result<tonic::Response<()>, tonic::Status> {
        refused()
    }
    async fn resize_tty(
        &self,
        _: tonic::Request<rt::ResizeTtyRequest>,
    ) -> Result<tonic::Response<()>, tonic::Status> {
        refused()
    }
    async fn port_forward(
        &self,
        _: tonic::Request<rt::PortForwardRequest>,
    ) -> Result<tonic::Response<Self::PortForwardStream>, tonic::Status> {
        let lie = rt::PortForwardResponse {
            session_id: Some(self.names.clone()),
            data: None,
        };
        Ok(tonic::Response::new(Box::pin(futures::stream::iter([Ok(
            lie,
        )]))))
    }
    async fn write_port_forward(
        &self,
        _: tonic::Request<rt::WritePortForwardRequest>,
    ) -> Result<tonic::Response<()>, tonic::Status> {
        refused()
    }
    async fn scale(
        &self,
        _: tonic::Request<rt::ScaleRequest>,
    ) -> Result<tonic::Response<rt::ScaleResponse>, tonic::Status> {
        refused()
    }
    async fn restart(
        &self,
        _: tonic::Request<rt::RestartRequest>,
    ) -> Result<tonic::Response<()>, tonic::Status> {
        refused()
    }
    async fn sub_resource_action(
        &self,
        _: tonic::Request<rt::SubResourceActionRequest>,
    ) -> Result<tonic::Response<rt::SubResourceActionResponse>, tonic::Status> {
        refused()
    }
    async fn show_chart(
        &self,
        _: tonic::Request<rt::ShowChartRequest>,
    ) -> Result<tonic::Response<rt::ShowChartResponse>, tonic::Status> {
        refused()
    }
}

/// The hub closes a port-forward session's upload path when that session's
/// stream ends, taking the id from the agent's first answer. An agent of
/// another cluster that answers its own PortForward with the victim's
/// session id must not end the victim's path: the victim's upload path
/// stays, and every byte written before and after reaches the pod in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_naming_another_clusters_session_cannot_end_its_uploads() {
    let env = KubeEnv::start_over(
        TransportKind::Quic,
        sim_config().pod("default", "web", &["app"]),
        |_| {},
    )
    .await;
    let t = env.admin_token().to_owned();
    env.sim
        .add_pod_port("default", "web", 8080, echo_server().await);
    let mut runtime = env.runtime();
    let (mut victim, id) = env.port_forward(&mut runtime, &t, "web", 8080).await;
    let send = |data: &[u8]| rt::WritePortForwardRequest {
        session_id: Some(id.clone()),
        data: Some(data.to_vec()),
    };
    runtime
        .write_port_forward(with_token(send(b"before;"), &t))
        .await
        .unwrap();
    let uploads = &env.hub.hub.state.uploads;
    assert_eq!(
        uploads.open(),
        1,
        "the victim's session has its upload path"
    );

    // The liar: a genuine agent of cluster "liar", its services replaced.
    let token = env.hub.hub.mint_join_token("liar").unwrap();
    let mut config =
        otter_agent::AgentConfig::new(env.hub.api_url(), "liar", "agent-0", env.hub.hub.ca_pem());
    config.join_token = otter_agent::config::Secret(token);
    config.transports = vec![TransportKind::Quic];
    let routes = tonic::service::Routes::new(
        rt::runtime_service_server::RuntimeServiceServer::new(LyingRuntime { names: id.clone() }),
    );
    let liar = otter_agent::Agent::start(config, routes).unwrap();
    liar.wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("the liar connects");
    let lie = rt::PortForwardRequest {
        cluster: Some("liar".into()),
        namespace: Some("default".into()),
        name: Some("any".into()),
        port: Some(1),
    };
    let mut lied = within(
        "the liar's port-forward",
        runtime.port_forward(with_token(lie, &t)),
    )
    .await
    .unwrap()
    .into_inner();
    let first = within("the liar's answer", lied.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.session_id.as_deref(), Some(id.as_str()));
    assert!(within("the liar's end", lied.next()).await.is_none());
    drop(lied);
    // Its stream is over: had the hub believed it, the path would be gone
    // within moments.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            uploads.open(),
            1,
            "a lying agent ended another cluster's upload path"
        );
    }

    let mut expected = b"before;".to_vec();
    for i in 0..20 {
        let piece = format!("{i};");
        runtime
            .write_port_forward(with_token(send(piece.as_bytes()), &t))
            .await
            .unwrap();
        expected.extend_from_slice(piece.as_bytes());
    }
    let mut back = Vec::new();
    within("every byte echoed", async {
        while back.len() < expected.len() {
            back.extend(
                victim
                    .next()
                    .await
                    .unwrap()
                    .unwrap()
                    .data
                    .unwrap_or_default(),
            );
        }
    })
    .await;
    assert_eq!(back, expected, "bytes lost or reordered");
    liar.shutdown().await;
    drop(victim);
    env.shutdown().await;
}
