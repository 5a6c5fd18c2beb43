//! The hub's public ports under anonymous floods, through a real hub on
//! loopback: idle TCP connections, TLS handshakes that stall, UDP junk and
//! half-sent request heads take no place an agent or a user needs, and
//! unauthenticated bodies are not buffered.
//!
//! Attackers come from loopback addresses of their own (127.0.0.2 and up),
//! as they would from machines of their own; the agents and users from
//! 127.0.0.1.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use otter_e2e::{
    TestHub,
    double::{WAIT, start_agent, start_agent_at, start_agent_with, wait_connected},
    procs::{self, Proc, Role},
    with_token,
};
use otter_proto::link::v1::{ListLinksRequest, link_service_client::LinkServiceClient};
use otter_tunnel::{TransportKind, handshakes::HandshakeLimits};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpSocket, TcpStream, UdpSocket},
};

#[test]
#[ignore = "entry point of the processes the tests start"]
fn child_process() {
    procs::child_main();
}

/// A TCP connection to `to` from the loopback address `from`.
async fn connect_from(from: &str, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from.parse().expect("address"), 0))?;
    tokio::time::timeout(Duration::from_secs(3), socket.connect(to))
        .await
        .map_err(|_| std::io::Error::other("connect timed out"))?
}

/// The first flight of a TLS client: what a handshake that then stalls
/// has sent.
fn client_hello() -> Vec<u8> {
    otter_pki::tls::install_default_provider();
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let mut conn =
        rustls::ClientConnection::new(Arc::new(config), "localhost".try_into().expect("name"))
            .expect("client");
    let mut hello = Vec::new();
    conn.write_tls(&mut hello).expect("hello");
    hello
}

/// `n` connections to `to` spread over the sources `from`, each sending
/// `first` (nothing when empty) and then nothing more; the ones the hub
/// accepted or queued are held open by the caller.
async fn stalled(from: &[String], to: SocketAddr, n: usize, first: &[u8]) -> Vec<TcpStream> {
    stalled_at_once(from, to, n, first, 256).await
}

/// Like [`stalled`], with `at_once` connection attempts in flight.
async fn stalled_at_once(
    from: &[String],
    to: SocketAddr,
    n: usize,
    first: &[u8],
    at_once: usize,
) -> Vec<TcpStream> {
    use futures::StreamExt;
    let first = Arc::new(first.to_vec());
    futures::stream::iter(0..n)
        .map(|i| {
            let (source, first) = (from[i % from.len()].clone(), first.clone());
            async move {
                let mut c = connect_from(&source, to).await.ok()?;
                if !first.is_empty() {
                    c.write_all(&first).await.ok()?;
                }
                Some(c)
            }
        })
        .buffer_unordered(at_once)
        .filter_map(|c| async move { c })
        .collect()
        .await
}

/// Sends junk datagrams to `to` until `stop`, at most `max`; returns how
/// many were sent.
fn udp_junk(to: SocketAddr, stop: Arc<AtomicBool>, max: u64) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let socket = UdpSocket::bind("127.0.0.4:0").await.expect("udp");
        let mut sent = 0u64;
        let mut junk = [0u8; 1200];
        while !stop.load(Ordering::Relaxed) && sent < max {
            for (i, b) in junk.iter_mut().enumerate() {
                *b = (sent as usize).wrapping_mul(31).wrapping_add(i * 7) as u8;
            }
            // Every other one looks like a QUIC long-header packet.
            junk[0] = if sent.is_multiple_of(2) {
                0xc0
            } else {
                junk[0]
            };
            let _ = socket.send_to(&junk, to).await;
            sent += 1;
            if sent.is_multiple_of(64) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        sent
    })
}

fn sources(prefix: &str, n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("{prefix}.{i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_port_floods_do_not_keep_agents_out() {
    let hub = TestHub::start().await;
    let port = hub.hub.tunnel_addr;
    let stop = Arc::new(AtomicBool::new(false));
    let junk = udp_junk(port, stop.clone(), 200_000);

    let idle = stalled(&["127.0.0.2".into()], port, 300, &[]).await;
    let half_tls = stalled(&["127.0.0.3".into()], port, 300, &client_hello()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pacer = hub.hub.state.pacer.clone();
    let handshakes = pacer.handshakes().clone();
    // Anonymous connections hold no admission slot, only pending places,
    // and one source no more than half of those.
    assert_eq!(pacer.in_progress(), 0);
    assert_eq!(pacer.refused(), 0);
    let pending = handshakes.pending();
    assert!(
        pending >= 300 && pending <= handshakes.limits().max_pending / 2 + 1,
        "pending handshakes: {pending}"
    );

    let started = Instant::now();
    let channel = hub.channel().await;
    let token_h2 = hub.hub.mint_join_token("edge-h2").expect("token");
    let token_quic = hub.hub.mint_join_token("edge-quic").expect("token");
    let _h2 = start_agent(&hub, "edge-h2", "a", &token_h2, TransportKind::H2);
    let _quic = start_agent(&hub, "edge-quic", "b", &token_quic, TransportKind::Quic);
    wait_connected(&channel, &hub.admin_token, 2).await;
    let took = started.elapsed();

    stop.store(true, Ordering::Relaxed);
    let datagrams = junk.await.expect("junk sender");
    println!(
        "tunnel flood: {} idle TCP + {} stalled TLS held, {datagrams} junk datagrams; \
         {pending} pending handshakes, {} refused for their source; \
         agents over HTTP/2 and QUIC connected {:.2} s after starting",
        idle.len(),
        half_tls.len(),
        handshakes.refused(),
        took.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_handshakes_from_many_sources_are_evicted_for_an_agent() {
    // A small pending set, so a flood from 50 sources fills it.
    let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
    let hub = TestHub::start_with(dir, None, |c| {
        c.tunnel_handshakes = HandshakeLimits {
            max_pending: 64,
            ..Default::default()
        };
    })
    .await;
    let port = hub.hub.tunnel_addr;
    let held = stalled(&sources("127.0.1", 50), port, 200, &client_hello()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let handshakes = hub.hub.state.pacer.handshakes().clone();
    assert_eq!(handshakes.pending(), 64);

    let started = Instant::now();
    let channel = hub.channel().await;
    let token = hub.hub.mint_join_token("edge-1").expect("token");
    let _agent = start_agent(&hub, "edge-1", "a", &token, TransportKind::H2);
    wait_connected(&channel, &hub.admin_token, 1).await;
    let took = started.elapsed();
    assert!(handshakes.evicted() > 0);
    // An operator sees it: the pending places and the evictions.
    let state = &hub.hub.state;
    state.metrics.pacers(&state.pacer, &state.register_pacer);
    let text = state.metrics.render();
    let metric = |name: &str| otter_agent::gauges::sample(&text, name).unwrap_or(-1.0);
    let shown = metric("otter_hub_tunnel_handshakes_evicted");
    assert!(
        shown >= 1.0 && shown <= handshakes.evicted() as f64,
        "evictions on /metrics: {shown}"
    );
    assert!(metric("otter_hub_tunnel_handshakes_pending") >= 1.0);
    assert_eq!(
        metric("otter_hub_tunnel_handshakes_refused"),
        handshakes.refused() as f64
    );
    println!(
        "{} stalled handshakes from 50 sources, 64 places: {} evicted; the agent connected {:.2} s after starting",
        held.len(),
        handshakes.evicted(),
        took.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quic_agent_waits_for_a_handshake_place_as_tcp_waits_in_the_backlog() {
    // Every place taken by handshakes too young to evict: a reconnect
    // storm as the hub sees it.
    let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
    let hub = TestHub::start_with(dir, None, |c| {
        c.tunnel_handshakes = HandshakeLimits {
            max_pending: 8,
            per_source: 8,
            evict_after: Duration::from_secs(60),
        };
        // The hub's default keepalive, not the suite's 1 s: it bounds how
        // long an attempt may wait (`quic::place_wait`).
        c.keepalive = otter_tunnel::Keepalive::default();
    })
    .await;
    let port = hub.hub.tunnel_addr;
    // One each from 8 sources, as agents reconnecting: a source holding
    // more than half its share would be dropped for the newcomer at once.
    let held = stalled(&sources("127.0.4", 8), port, 8, &client_hello()).await;
    let handshakes = hub.hub.state.pacer.handshakes().clone();
    let deadline = Instant::now() + WAIT;
    while handshakes.pending() < 8 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        handshakes.pending(),
        8,
        "the stalled handshakes hold every place"
    );

    let channel = hub.channel().await;
    let token = hub.hub.mint_join_token("edge-1").expect("token");
    // The agent's own keepalives, not the suite's 1 s: a QUIC client
    // gives up a handshake after its idle timeout (three keepalives)
    // without a packet, and a waiting attempt hears nothing from the hub
    // after the Retry. With 3 s, a CI machine slow to free the places
    // timed the attempt out.
    let agent = start_agent_with(&hub, "edge-1", "a", &token, TransportKind::Quic, |c| {
        c.keepalive = otter_tunnel::Keepalive::default();
    });
    let dialing = agent
        .agent
        .wait_for(WAIT, |s| s.dials >= 1)
        .await
        .expect("the agent dials");
    assert!(dialing.connected.is_none());
    // Longer than the agent's first QUIC retransmission: the attempt is
    // still waiting, not refused.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let waiting = agent.agent.status();
    assert!(waiting.connected.is_none(), "no place, no tunnel");
    assert_eq!(waiting.dials, 1, "refused and dialled again: {waiting:?}");

    drop(held);
    wait_connected(&channel, &hub.admin_token, 1).await;
    // The hub lists the link as it admits the tunnel, a moment before the
    // agent hears it was admitted.
    let s = agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("the agent sees its tunnel up");
    assert_eq!(s.connected, Some(TransportKind::Quic));
    assert_eq!(s.dials, 1, "the first dial got the place: {s:?}");
    assert!(
        s.attempts.iter().all(|(_, r)| r.is_ok()),
        "no failed attempt: {:?}",
        s.attempts
    );
    println!(
        "QUIC attempt waited for one of 8 taken places and connected on its first dial ({} pending now)",
        handshakes.pending()
    );
}

/// The hub as a process of its own, so its memory is its own.
struct HubProc {
    proc: Proc,
    api: SocketAddr,
    ca_pem: String,
    admin: String,
    join_token: String,
    _dir: tempfile::TempDir,
}

fn start_hub_proc() -> HubProc {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("hub");
    // A first start makes the CA and the admin token; a join token for the
    // agent that reconnects under the flood.
    let join_token = tokio::task::block_in_place(|| {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        rt.block_on(async {
            let mut config = otter_hub::HubConfig::new(&data);
            config.api_listen = "127.0.0.1:0".parse().expect("address");
            config.tunnel_listen = "127.0.0.1:0".parse().expect("address");
            let hub = otter_hub::Hub::start(config).await.expect("setup hub");
            let token = hub.mint_join_token("edge-1").expect("join token");
            hub.shutdown().await;
            token
        })
    });
    let api: SocketAddr = format!("127.0.0.1:{}", procs::free_port())
        .parse()
        .expect("address");
    let tunnel = format!("127.0.0.1:{}", procs::free_port());
    let proc = Proc::start(
        "hub",
        Role::Otter,
        &[
            "hub".into(),
            "--data-dir".into(),
            data.display().to_string(),
            "--listen".into(),
            api.to_string(),
            "--tunnel-listen".into(),
            tunnel,
        ],
        dir.path(),
        None,
    );
    let read = |name: &str| {
        std::fs::read_to_string(data.join(name))
            .expect(name)
            .trim()
            .to_owned()
    };
    HubProc {
        proc,
        api,
        ca_pem: read("ca.crt"),
        admin: read("admin-token"),
        join_token,
        _dir: dir,
    }
}

/// The hub's resident memory, sampled every 50 ms until `stop`; the most
/// seen.
fn watch_rss(pid: u32, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<f64> {
    tokio::spawn(async move {
        let mut most = 0f64;
        while !stop.load(Ordering::Relaxed) {
            most = most.max(procs::rss_mib(pid).unwrap_or(0.0));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        most
    })
}

/// An unauthenticated Connect POST of `len` bytes over its own TLS
/// connection: the HTTP status the hub answered with (0 if none could be
/// read) and how many body bytes got out before the hub closed.
async fn unauthenticated_upload(api: SocketAddr, ca_pem: &str, len: usize) -> (u16, usize) {
    let tls = otter_pki::tls::client_config(ca_pem, None, &[b"http/1.1"]).expect("tls");
    let Ok(tcp) = TcpStream::connect(api).await else {
        return (0, 0);
    };
    let Ok(stream) = tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect("localhost".try_into().expect("name"), tcp)
        .await
    else {
        return (0, 0);
    };
    let (mut rd, mut wr) = tokio::io::split(stream);
    let head = format!(
        "POST /otterscale.link.v1.LinkService/ListLinks HTTP/1.1\r\nhost: localhost\r\n\
         content-type: application/json\r\ncontent-length: {len}\r\n\r\n"
    );
    let send = tokio::spawn(async move {
        let mut sent = 0;
        if wr.write_all(head.as_bytes()).await.is_err() {
            return sent;
        }
        let chunk = vec![b' '; 64 * 1024];
        while sent < len {
            let n = (len - sent).min(chunk.len());
            if wr.write_all(&chunk[..n]).await.is_err() {
                break;
            }
            sent += n;
        }
        sent
    });
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(60), rd.read(&mut buf))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or(0);
    let status = String::from_utf8_lossy(&buf[..n])
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .unwrap_or(0);
    // The answer came (or the hub closed): the upload is abandoned.
    drop(rd);
    let sent = tokio::time::timeout(Duration::from_secs(60), send)
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or(len);
    (status, sent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_port_floods_leave_room_for_users_and_agents() {
    // The slow heads need a descriptor each on this side too.
    let limit = otter_hub::limits::raise_open_file_limit().unwrap_or(1024);
    let slow_heads = 20_000usize.min(usize::try_from(limit).unwrap_or(0).saturating_sub(2_000));
    let hub = start_hub_proc();
    let pid = hub.proc.pid();
    let started = Instant::now();
    while TcpStream::connect(hub.api).await.is_err() {
        assert!(started.elapsed() < WAIT, "hub did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Each on a connection of its own, made then.
    let list_links = || {
        let (api, ca, admin) = (hub.api, hub.ca_pem.clone(), hub.admin.clone());
        async move {
            let channel = otter_e2e::client_channel(api, &ca, None).await;
            LinkServiceClient::new(channel)
                .list_links(with_token(ListLinksRequest {}, &admin))
                .await
        }
    };
    list_links().await.expect("ListLinks before the flood");
    let baseline = procs::rss_mib(pid).expect("hub RSS");

    // 64 unauthenticated uploads of 15 MiB at once.
    let stop = Arc::new(AtomicBool::new(false));
    let rss = watch_rss(pid, stop.clone());
    let uploads: Vec<_> = (0..64)
        .map(|_| {
            let ca = hub.ca_pem.clone();
            let api = hub.api;
            tokio::spawn(async move { unauthenticated_upload(api, &ca, 15 << 20).await })
        })
        .collect();
    let mut answers = Vec::new();
    for u in uploads {
        answers.push(u.await.expect("upload task"));
    }
    stop.store(true, Ordering::Relaxed);
    let upload_peak = rss.await.expect("rss");
    // Refused from the headers: a 401, or (when the hub's close reset the
    // connection before the client read it) cut off long before the end.
    let refused_401 = answers.iter().filter(|(s, _)| *s == 401).count();
    let most_sent = answers.iter().map(|(_, n)| *n).max().unwrap_or(0);
    assert!(
        answers
            .iter()
            .all(|(s, n)| *s == 401 || (*s == 0 && *n < 15 << 20)),
        "every unauthenticated upload is refused before its body: {answers:?}"
    );

    // Slow heads from 40 sources: connections that start a TLS handshake
    // and never finish it.
    let stop = Arc::new(AtomicBool::new(false));
    let rss = watch_rss(pid, stop.clone());
    let hello = client_hello();
    let half = hello[..hello.len() / 2].to_vec();
    let flood_started = Instant::now();
    let api = hub.api;
    let flood = tokio::spawn(async move {
        stalled_at_once(&sources("127.0.2", 40), api, slow_heads, &half, 1024).await
    });
    // Meanwhile a user lists links and an agent joins and connects.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = Instant::now();
    let links = list_links().await;
    let list_took = started.elapsed();
    assert!(links.is_ok(), "ListLinks under the flood: {links:?}");
    let started = Instant::now();
    let _agent = start_agent_at(
        format!("https://{}", hub.api).parse().expect("url"),
        &hub.ca_pem,
        "edge-1",
        "agent-1",
        &hub.join_token,
        TransportKind::H2,
        |_| {},
    );
    let channel = otter_e2e::client_channel(hub.api, &hub.ca_pem, None).await;
    wait_connected(&channel, &hub.admin, 1).await;
    let agent_took = started.elapsed();
    let held = flood.await.expect("flood");
    let flood_took = flood_started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let flood_peak = rss.await.expect("rss");
    let closed_by_hub = count_closed(&held).await;

    println!(
        "API flood: hub RSS baseline {baseline:.1} MiB; 64 x 15 MiB unauthenticated uploads: \
         peak {upload_peak:.1} MiB, {refused_401} read their 401, the rest were cut off, \
         at most {:.1} MiB of a body got out; {} slow heads from 40 sources opened in {:.1} s \
         ({} already closed by the hub): peak {flood_peak:.1} MiB; ListLinks took {:.2} s, \
         the agent registered and connected in {:.2} s",
        most_sent as f64 / f64::from(1 << 20),
        held.len(),
        flood_took.as_secs_f64(),
        closed_by_hub,
        list_took.as_secs_f64(),
        agent_took.as_secs_f64()
    );
    assert!(
        upload_peak - baseline < 64.0 && flood_peak - baseline < 64.0,
        "hub RSS grew from {baseline:.1} MiB to {upload_peak:.1} / {flood_peak:.1} MiB"
    );
    assert!(held.len() >= slow_heads / 2, "the flood could not be held");
    drop(held);

    // What the API port turned away shows on /metrics, for an operator
    // to tell a flood (or a first connect of many agents) from a fault.
    let req = http::Request::get("/metrics")
        .header("authorization", format!("Bearer {}", hub.admin))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .expect("request");
    let (status, _, body) = otter_e2e::http_call(hub.api, &hub.ca_pem, true, req).await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body).into_owned();
    let metric = |name: &str| {
        otter_agent::gauges::sample(&text, name).unwrap_or_else(|| panic!("no {name}:\n{text}"))
    };
    let turned_away = [
        "otter_hub_api_handshakes_evicted",
        "otter_hub_api_handshakes_refused",
        "otter_hub_api_connections_refused",
    ]
    .map(metric);
    println!(
        "API port after the flood: evicted, refused for their source's share, over a cap: {turned_away:?}"
    );
    assert!(
        turned_away.iter().sum::<f64>() >= 1.0,
        "{} slow heads turned nobody away: {turned_away:?}",
        slow_heads
    );
    assert!(metric("otter_hub_api_connections_open") >= 1.0, "this one");
}

/// How many of `held` the other end has closed.
async fn count_closed(held: &[TcpStream]) -> usize {
    let mut closed = 0;
    for c in held {
        let mut buf = [0u8; 1];
        // A closed connection reads end-of-file or an error at once.
        if let Ok(Ok(0) | Err(_)) = tokio::time::timeout(Duration::ZERO, c.peek(&mut buf)).await {
            closed += 1;
        }
    }
    closed
}

/// Descriptors the process `pid` holds open.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// One TLS attempt on a peer port presenting `client` (or nothing): what
/// happened, for the log. Never an answer to a request: strangers are
/// refused in the handshake or right after it.
async fn stranger(peer: SocketAddr, ca_pem: &str, client: Option<(&str, &str)>) -> String {
    let tls = otter_pki::tls::client_config(ca_pem, client, &[b"h2"]).expect("client TLS");
    let tcp = match connect_from("127.0.3.1", peer).await {
        Ok(t) => t,
        Err(e) => return format!("connect: {e}"),
    };
    let tls = match tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect("localhost".try_into().expect("name"), tcp)
        .await
    {
        Ok(t) => t,
        Err(e) => return format!("handshake: {e}"),
    };
    let (mut send, conn) = match hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    {
        Ok(h) => h,
        Err(e) => return format!("h2: {e}"),
    };
    tokio::spawn(conn);
    let req = http::Request::get("https://localhost/clusters/edge-p/api/v1/namespaces")
        .header(otter_hub::peers::PRINCIPAL_HEADER, "e30")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    match tokio::time::timeout(WAIT, send.send_request(req)).await {
        Ok(Ok(resp)) => panic!("a stranger was answered: {}", resp.status()),
        Ok(Err(e)) => format!("request: {e}"),
        Err(_) => panic!("a stranger's request hung"),
    }
}

/// The peer port of hub replicas run as processes on etcd, to an attacker
/// with a socket: idle connections, stalled TLS handshakes from many
/// sources and junk bytes hold places among a bounded set of pending
/// handshakes (never a replica's), strangers without a replica certificate
/// of the hub CA get no answer, and meanwhile a call through the other
/// replica, which must open its first peer connection under the flood,
/// reaches the cluster. When the flood ends its descriptors are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_port_floods_and_strangers_leave_replicas_talking() {
    let Some(etcd) = otter_e2e::etcd::Etcd::start() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let key = otter_e2e::etcd::store_key(dir.path());
    let otter_e2e::etcd::ReplicaProcs {
        procs: replicas,
        ports,
        token,
        ca,
    } = otter_e2e::etcd::replica_procs(
        dir.path(),
        &etcd.url(),
        &key,
        2,
        &["--keepalive-secs".into(), "1".into()],
    )
    .await;
    let addr = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    let join = otter_e2e::etcd::join_token_on(&etcd.url(), &key, "edge-p");
    // The agent on r1; calls come through r0.
    let _agent = start_agent_at(
        format!("https://localhost:{}", ports[1].0)
            .parse()
            .expect("url"),
        &ca,
        "edge-p",
        "agent-p",
        &join,
        TransportKind::H2,
        |_| {},
    );
    let via_r1 = otter_e2e::client_channel(addr(ports[1].0), &ca, None).await;
    wait_connected(&via_r1, &token, 1).await;
    let r1_pid = replicas[1].pid();
    let peer = addr(ports[1].2);
    let fds_before = open_fds(r1_pid);

    // The flood on r1's peer port, before r0 ever connected to it.
    let idle = stalled(&sources("127.0.4", 10), peer, 200, &[]).await;
    let half_tls = stalled(&sources("127.0.5", 50), peer, 600, &client_hello()).await;
    let junk: Vec<u8> = (0..65_536u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let junked = stalled(&sources("127.0.6", 5), peer, 50, &junk).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fds_flood = open_fds(r1_pid);

    // Strangers: no certificate; a replica certificate of another CA.
    let other_ca = otter_pki::CertificateAuthority::generate("a stranger's CA").expect("CA");
    let (forged_cert, forged_key) = other_ca
        .issue_replica_cert("r0", &[], Duration::from_secs(3600))
        .expect("forged replica certificate");
    let no_cert = stranger(peer, &ca, None).await;
    let forged = stranger(peer, &ca, Some((&forged_cert, &forged_key))).await;

    // A call through r0 needs a new peer connection to r1, under the flood.
    let started = Instant::now();
    let via_r0 = otter_e2e::client_channel(addr(ports[0].0), &ca, None).await;
    let got =
        otter_proto::resource::v1::resource_service_client::ResourceServiceClient::new(via_r0)
            .get(with_token(otter_e2e::double::get("edge-p", "web"), &token))
            .await;
    let call_took = started.elapsed();
    assert!(
        got.is_ok(),
        "a call through r0 to r1's cluster under the flood: {got:?}"
    );

    let attackers = idle.len() + half_tls.len() + junked.len();
    drop((idle, half_tls, junked));
    let started = Instant::now();
    let fds_after = loop {
        let n = open_fds(r1_pid);
        if n <= fds_before + 8 || started.elapsed() > WAIT {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!(
        "peer port flood: {attackers} attacker connections held (idle, stalled TLS from 50 sources, \
         64 KiB of junk); r1's descriptors {fds_before} before, {fds_flood} under the flood, \
         {fds_after} after; no certificate: {no_cert}; another CA's replica certificate: {forged}; \
         a call through r0 (a new peer connection) answered in {:.3} s",
        call_took.as_secs_f64()
    );
    // The pending places (256) bound what the flood holds in the hub.
    assert!(
        fds_flood <= fds_before + 256 + 16,
        "r1 held {fds_flood} descriptors under the flood (before: {fds_before})"
    );
    assert!(
        fds_after <= fds_before + 8,
        "r1 kept {fds_after} descriptors after the flood (before: {fds_before})"
    );
}
