//! Every transport, the same scenarios: real TLS and QUIC on loopback for the
//! network transports, in-memory pipes for the baseline.

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use otter_pki::{AgentIdentity, CertificateAuthority, csr, identity::PeerCertificate, tls};
use otter_tunnel::{
    Acceptor, Caller, Opener,
    frame::Limits,
    h2::{self, H2Settings},
    http::{RequestBody, forward, serve},
    mem,
    quic::{self, QuicSettings},
    transport::Accepted,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

type Resp = http::Response<BoxBody<Bytes, Infallible>>;

/// Test service: `/echo` echoes the body with trailers (`/slow` too, after
/// 50 ms), `/bulk` streams forever, `/hang` never ends and records when it
/// is dropped.
fn service(
    dropped: Arc<AtomicBool>,
) -> impl tower::Service<http::Request<RequestBody>, Response = Resp, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    tower::service_fn(move |req: http::Request<RequestBody>| {
        let dropped = dropped.clone();
        async move {
            let caller = req
                .extensions()
                .get::<Caller>()
                .map(|c| c.user.clone())
                .unwrap_or_default();
            let path = req.uri().path().to_owned();
            let body: BoxBody<Bytes, Infallible> = match path.as_str() {
                "/echo" | "/slow" => {
                    if path == "/slow" {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    let data = req
                        .into_body()
                        .collect()
                        .await
                        .expect("request body")
                        .to_bytes();
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", "0".parse().unwrap());
                    let frames = vec![
                        Ok::<_, Infallible>(http_body::Frame::data(data)),
                        Ok(http_body::Frame::trailers(trailers)),
                    ];
                    BoxBody::new(StreamBody::new(tokio_stream::iter(frames)))
                }
                "/bulk" => {
                    let chunk = Bytes::from(vec![7u8; 64 * 1024]);
                    let s = tokio_stream::iter(
                        std::iter::repeat(chunk).map(|c| Ok(http_body::Frame::data(c))),
                    );
                    BoxBody::new(StreamBody::new(s))
                }
                _ => {
                    struct Flag(Arc<AtomicBool>);
                    impl Drop for Flag {
                        fn drop(&mut self) {
                            self.0.store(true, Ordering::SeqCst);
                        }
                    }
                    let flag = Flag(dropped);
                    let s = futures::stream::unfold(flag, |flag| async move {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                        Some((Ok(http_body::Frame::data(Bytes::new())), flag))
                    });
                    BoxBody::new(StreamBody::new(s))
                }
            };
            let mut resp = http::Response::new(body);
            resp.headers_mut()
                .insert("x-caller", caller.parse().unwrap());
            Ok(resp)
        }
    })
}

/// Runs the agent side: accepts streams and serves each in its own task.
fn spawn_agent(mut acceptor: impl Acceptor, dropped: Arc<AtomicBool>) {
    tokio::spawn(async move {
        while let Ok(Some(stream)) = acceptor.accept().await {
            let svc = service(dropped.clone());
            tokio::spawn(serve(stream, svc, Limits::default()));
        }
    });
}

struct Pki {
    ca: CertificateAuthority,
    server: (String, String),
    client: (String, String),
}

fn pki() -> Pki {
    let ca = CertificateAuthority::generate("tunnel test CA").unwrap();
    let server = ca
        .issue_server_cert(&["localhost".into(), "127.0.0.1".into()])
        .unwrap();
    let (key, csr) = csr::generate("edge-1", "agent-1").unwrap();
    let id = AgentIdentity::new("edge-1", "agent-1").unwrap();
    let cert = ca
        .sign_agent_csr(&csr, &id, Duration::from_secs(3600))
        .unwrap();
    Pki {
        ca,
        server,
        client: (cert.pem, key),
    }
}

/// A hub's and an agent's TLS for QUIC, from a fresh test PKI.
/// A hub's QUIC endpoint on loopback with default settings, its tunnels
/// sent to the receiver until the token is cancelled.
fn quic_hub(
    server: rustls::ServerConfig,
) -> (SocketAddr, mpsc::Receiver<Accepted>, CancellationToken) {
    let settings = QuicSettings::default();
    let endpoint = quic::hub_endpoint("127.0.0.1:0".parse().unwrap(), server, &settings).unwrap();
    let addr = endpoint.local_addr().unwrap();
    let (tx, rx) = mpsc::channel::<Accepted>(4);
    let shutdown = CancellationToken::new();
    tokio::spawn(quic::accept_loop(endpoint, tx, shutdown.clone()));
    (addr, rx, shutdown)
}

fn quic_tls() -> (rustls::ServerConfig, rustls::ClientConfig) {
    tls::install_default_provider();
    let p = pki();
    let server = tls::server_config(
        &p.server.0,
        &p.server.1,
        p.ca.cert_pem(),
        tls::ClientAuth::Required,
        &[quic::ALPN],
    )
    .unwrap();
    let client = tls::client_config(
        p.ca.cert_pem(),
        Some((&p.client.0, &p.client.1)),
        &[quic::ALPN],
    )
    .unwrap();
    (server, client)
}

/// A QUIC tunnel over loopback with the default settings: the agent's
/// side, the hub's, and what stops the hub.
async fn quic_tunnel() -> (quic::QuicAcceptor, Accepted, CancellationToken) {
    let (server, client) = quic_tls();
    let (addr, mut rx, shutdown) = quic_hub(server);
    let acceptor = quic::dial(addr, "localhost", client, &QuicSettings::default())
        .await
        .unwrap();
    let tunnel = rx.recv().await.expect("tunnel accepted");
    (acceptor, tunnel, shutdown)
}

async fn connect(kind: &str, dropped: Arc<AtomicBool>) -> Arc<dyn Opener> {
    if kind == "mem" {
        let (opener, acceptor) = mem::pair();
        spawn_agent(acceptor, dropped);
        return Arc::new(opener);
    }
    let p = pki();
    let (tx, mut rx) = mpsc::channel::<Accepted>(4);
    let shutdown = CancellationToken::new();
    let client = |alpn: &[u8]| {
        tls::client_config(p.ca.cert_pem(), Some((&p.client.0, &p.client.1)), &[alpn]).unwrap()
    };
    let server = |alpn: &[u8]| {
        tls::server_config(
            &p.server.0,
            &p.server.1,
            p.ca.cert_pem(),
            tls::ClientAuth::Required,
            &[alpn],
        )
        .unwrap()
    };
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    if kind == "ws" {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let settings = H2Settings::default();
        let tls = tls::server_config(
            &p.server.0,
            &p.server.1,
            p.ca.cert_pem(),
            tls::ClientAuth::Required,
            &[h2::ALPN, otter_tunnel::ws::ALPN],
        )
        .unwrap();
        tokio::spawn(h2::accept_loop(
            listener,
            Arc::new(tls),
            settings,
            tx,
            shutdown,
        ));
        let name = "localhost".try_into().unwrap();
        let acceptor = otter_tunnel::ws::dial(
            addr,
            name,
            Arc::new(client(otter_tunnel::ws::ALPN)),
            settings,
        )
        .await
        .unwrap();
        assert_eq!(acceptor.kind(), otter_tunnel::TransportKind::Ws);
        spawn_agent(acceptor, dropped);
    } else if kind == "quic" {
        let settings = QuicSettings::default();
        let endpoint = quic::hub_endpoint(addr, server(quic::ALPN), &settings).unwrap();
        let addr = endpoint.local_addr().unwrap();
        tokio::spawn(quic::accept_loop(endpoint, tx, shutdown));
        let acceptor = quic::dial(addr, "localhost", client(quic::ALPN), &settings)
            .await
            .unwrap();
        spawn_agent(acceptor, dropped);
    } else {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let settings = H2Settings::default();
        tokio::spawn(h2::accept_loop(
            listener,
            Arc::new(server(h2::ALPN)),
            settings,
            tx,
            shutdown,
        ));
        let name = "localhost".try_into().unwrap();
        let acceptor = h2::dial(addr, name, Arc::new(client(h2::ALPN)), settings)
            .await
            .unwrap();
        spawn_agent(acceptor, dropped);
    }
    let accepted = rx.recv().await.expect("tunnel accepted");
    let peer =
        PeerCertificate::from_der(accepted.peer_cert.as_ref().expect("client cert")).unwrap();
    assert_eq!(
        peer.identity.cluster, "edge-1",
        "hub reads the cluster from the certificate"
    );
    accepted.opener
}

async fn call(
    opener: &dyn Opener,
    path: &str,
    body: &'static [u8],
) -> http::Response<otter_tunnel::http::ResponseBody> {
    let stream = opener.open().await.unwrap();
    let req = http::Request::post(path)
        .body(Full::new(Bytes::from_static(body)))
        .unwrap();
    let caller = Caller {
        user: "alice".into(),
        groups: vec!["devs".into()],
        ..Default::default()
    };
    forward(stream, "", Some(caller), req, Limits::default(), None)
        .await
        .unwrap()
}

/// Waits (10 s at most) until the agent's `/hang` call has been dropped:
/// the agent noticed its caller leave.
async fn noticed(dropped: &AtomicBool, case: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !dropped.load(Ordering::SeqCst) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{case}: the agent did not notice the cancelled call"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn scenarios(kind: &str) {
    let dropped = Arc::new(AtomicBool::new(false));
    let opener = connect(kind, dropped.clone()).await;

    // Echo: body, headers, trailers and the verified caller make it across.
    let resp = call(&*opener, "/echo", b"hello tunnel").await;
    assert_eq!(resp.headers()["x-caller"], "alice");
    let collected = resp.into_body().collect().await.unwrap();
    assert_eq!(collected.trailers().unwrap()["grpc-status"], "0");
    assert_eq!(collected.to_bytes(), Bytes::from_static(b"hello tunnel"));

    // Head-of-line isolation: a bulk stream nobody reads fills its own
    // window, and small calls on the same tunnel still complete.
    let bulk = call(&*opener, "/bulk", b"").await;
    let mut bulk_body = bulk.into_body();
    let first = bulk_body.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    for _ in 0..20 {
        let resp = tokio::time::timeout(Duration::from_secs(10), call(&*opener, "/echo", b"small"))
            .await
            .expect("small call is not stalled by the bulk stream");
        assert_eq!(
            resp.into_body().collect().await.unwrap().to_bytes(),
            Bytes::from_static(b"small")
        );
    }
    drop(bulk_body);

    // Cancellation: the caller drops a never-ending response; the agent
    // side's body (and with it the work) is dropped.
    let hang = call(&*opener, "/hang", b"").await;
    assert!(!dropped.load(Ordering::SeqCst));
    drop(hang);
    noticed(&dropped, kind).await;

    // Closing the tunnel is seen by both ends.
    opener.close("test over");
    tokio::time::timeout(Duration::from_secs(10), opener.closed())
        .await
        .expect("closed resolves");
    assert!(
        opener.open().await.is_err(),
        "{kind}: a closed tunnel opens no streams"
    );
}

#[tokio::test]
async fn mem_transport() {
    scenarios("mem").await;
}

#[tokio::test]
async fn h2_transport() {
    tls::install_default_provider();
    scenarios("h2").await;
}

#[tokio::test]
async fn quic_transport() {
    tls::install_default_provider();
    scenarios("quic").await;
}

#[tokio::test]
async fn ws_transport() {
    tls::install_default_provider();
    scenarios("ws").await;
}

/// A call that ran to its end closes its QUIC stream with a FIN each way:
/// the agent sends its last bytes with its FIN and then waits for the hub's,
/// so neither side stops or resets the stream. Before, the agent let go of
/// the stream as soon as it had answered, which cost each call a
/// STOP_SENDING from the agent and a RESET_STREAM from the hub (and over
/// HTTP/2 a reset in a write of its own). The same holds once the hub
/// sends its FIN with the request, on a busy machine too: there the
/// agent's FIN now and then trails its trailers, and a hub that let go of
/// the stream at the trailers stopped it (one call in twenty). A call
/// whose caller leaves mid-answer is the control: that stream is reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_quic_calls_end_without_resets() {
    tls::install_default_provider();
    let dropped = Arc::new(AtomicBool::new(false));
    let opener = connect("quic", dropped.clone()).await;
    // Keeps both workers busy, as other tunnels would.
    let busy = tokio::spawn(async {
        loop {
            tokio::task::yield_now().await;
        }
    });
    for _ in 0..200 {
        let resp = call(&*opener, "/echo", b"hello tunnel").await;
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"hello tunnel");
    }
    busy.abort();
    let counts = opener.packets().expect("QUIC counts packets");
    assert_eq!(
        (counts.resets_sent, counts.resets_received),
        (0, 0),
        "{counts:?}"
    );

    let resp = call(&*opener, "/hang", b"").await;
    drop(resp);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while opener.packets().expect("QUIC counts packets").resets_sent == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "an abandoned call was not reset"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The hub sends a request's FIN with the request only to an agent that
/// said it watches for a stop. One that did not (an agent from before, or
/// one whose streams cannot see a stop) takes an early FIN as its caller
/// gone: its slow calls are still answered, because the hub keeps its side
/// open until it has read the answer. Either way a caller that leaves
/// mid-call ends the agent's work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_hub_sends_the_fin_early_only_to_agents_that_watch_for_a_stop() {
    for watches in [false, true] {
        let (mut acceptor, tunnel, _shutdown) = quic_tunnel().await;
        let dropped = Arc::new(AtomicBool::new(false));
        let flag = dropped.clone();
        tokio::spawn(async move {
            while let Ok(Some(stream)) = acceptor.accept().await {
                let stream = match watches {
                    true => stream,
                    false => otter_tunnel::TunnelStream::new(stream.send, stream.recv),
                };
                tokio::spawn(serve(stream, service(flag.clone()), Limits::default()));
            }
        });
        for i in 0..5 {
            let resp = call(&*tunnel.opener, "/slow", b"take your time").await;
            let body = resp.into_body().collect().await;
            let body = body.unwrap_or_else(|e| panic!("watches {watches}, call {i}: {e}"));
            assert_eq!(&body.to_bytes()[..], b"take your time");
        }
        let hang = call(&*tunnel.opener, "/hang", b"").await;
        drop(hang);
        noticed(&dropped, &format!("watches {watches}")).await;
    }
}

/// A UDP relay whose upstream can be switched: what an agent sees when the
/// hub behind a fixed address is replaced by a new process. Packets from any
/// other than the current upstream (the old hub) are dropped.
struct UdpRelay {
    addr: SocketAddr,
    upstream: Arc<std::sync::Mutex<SocketAddr>>,
    stop: CancellationToken,
}

impl UdpRelay {
    async fn start(upstream: SocketAddr) -> UdpRelay {
        let front = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let back = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let addr = front.local_addr().unwrap();
        let upstream = Arc::new(std::sync::Mutex::new(upstream));
        let agent = Arc::new(std::sync::Mutex::new(None::<SocketAddr>));
        let stop = CancellationToken::new();
        let (f, b, up, who) = (front.clone(), back.clone(), upstream.clone(), agent.clone());
        let stopped = stop.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            loop {
                let (n, from) = tokio::select! {
                    Ok(got) = f.recv_from(&mut buf) => got,
                    _ = stopped.cancelled() => return,
                };
                *who.lock().unwrap() = Some(from);
                let to = *up.lock().unwrap();
                let _ = b.send_to(&buf[..n], to).await;
            }
        });
        let (up, stopped) = (upstream.clone(), stop.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            loop {
                let (n, from) = tokio::select! {
                    Ok(got) = back.recv_from(&mut buf) => got,
                    _ = stopped.cancelled() => return,
                };
                let to = *agent.lock().unwrap();
                if let Some(to) = to.filter(|_| from == *up.lock().unwrap()) {
                    let _ = front.send_to(&buf[..n], to).await;
                }
            }
        });
        UdpRelay {
            addr,
            upstream,
            stop,
        }
    }

    fn switch_to(&self, upstream: SocketAddr) {
        *self.upstream.lock().unwrap() = upstream;
    }

    /// Closes the relay's sockets, as a process that died: the kernel
    /// answers what arrives at its port with ICMP port unreachable.
    async fn close(&self) {
        self.stop.cancel();
        // Bounded: both tasks drop their socket handles as they end.
        for _ in 0..100 {
            if std::net::UdpSocket::bind(self.addr).is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the relay's port stays bound");
    }
}

/// A hub whose process is gone while its host is up: the kernel refuses
/// the agent's datagrams to the closed port (ICMP port unreachable), as it
/// resets a TCP connection. The agent's tunnel counts the refusals after
/// its next keepalive, where silence alone would tell only after several,
/// and a dial to the closed port fails as refused instead of waiting out
/// the handshake's timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_datagrams_refused_by_a_closed_port_are_counted_and_end_a_dial() {
    let (server, client) = quic_tls();
    let settings = QuicSettings {
        keepalive: otter_tunnel::transport::Keepalive::every(Duration::from_millis(300)),
        ..Default::default()
    };
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let endpoint = quic::hub_endpoint_on(socket, server, &settings, &[7u8; 32]).unwrap();
    let (tx, mut rx) = mpsc::channel::<Accepted>(4);
    let shutdown = CancellationToken::new();
    tokio::spawn(quic::accept_loop(endpoint.clone(), tx, shutdown.clone()));
    let relay = UdpRelay::start(endpoint.local_addr().unwrap()).await;
    let acceptor = quic::dial(relay.addr, "localhost", client.clone(), &settings)
        .await
        .unwrap();
    let _tunnel = rx.recv().await.expect("tunnel accepted");
    assert_eq!(acceptor.packets().unwrap().refused, 0);

    relay.close().await;
    let mut counts = acceptor.packets().unwrap();
    for _ in 0..200 {
        if counts.refused > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        counts = acceptor.packets().unwrap();
    }
    assert!(
        counts.refused > 0,
        "the agent's keepalives to the closed port come back refused: {counts:?}"
    );

    // Long enough that a handshake left to time out would fail the bound.
    let patient = QuicSettings {
        connect_timeout: Duration::from_secs(60),
        ..settings
    };
    let err = tokio::time::timeout(
        Duration::from_secs(30),
        quic::dial(relay.addr, "localhost", client, &patient),
    )
    .await
    .expect("the dial ends before its handshake times out")
    .expect_err("nothing listens there");
    assert!(err.to_string().contains("refused"), "{err}");
    shutdown.cancel();
}

/// A hub that crashed and came back on the same address answers the
/// agent's next packet with a stateless reset the agent accepts, so the
/// agent reconnects at once, if (and only if) it keeps its secret. One
/// that does not is silent, and the agent waits out its keepalive timeout.
#[tokio::test]
async fn quic_restarted_hub_resets_old_connections_when_it_keeps_its_secret() {
    tls::install_default_provider();
    let p = pki();
    let server = || {
        tls::server_config(
            &p.server.0,
            &p.server.1,
            p.ca.cert_pem(),
            tls::ClientAuth::Required,
            &[quic::ALPN],
        )
        .unwrap()
    };
    let client = tls::client_config(
        p.ca.cert_pem(),
        Some((&p.client.0, &p.client.1)),
        &[quic::ALPN],
    )
    .unwrap();
    let settings = QuicSettings {
        keepalive: otter_tunnel::transport::Keepalive::every(Duration::from_millis(300)),
        ..Default::default()
    };
    let endpoint = |secret: &[u8]| {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        quic::hub_endpoint_on(socket, server(), &settings, secret).unwrap()
    };
    let kept = [7u8; 32];

    for (restarted_with, want) in [(kept, "reset"), ([8u8; 32], "timed out")] {
        let first = endpoint(&kept);
        let (tx, mut rx) = mpsc::channel::<Accepted>(4);
        let shutdown = CancellationToken::new();
        tokio::spawn(quic::accept_loop(first.clone(), tx, shutdown.clone()));
        let relay = UdpRelay::start(first.local_addr().unwrap()).await;
        let mut acceptor = quic::dial(relay.addr, "localhost", client.clone(), &settings)
            .await
            .unwrap();
        let tunnel = rx.recv().await.expect("tunnel accepted");
        // One stream each way first: the handshake is confirmed, and the
        // agent's packets carry short headers, which a hub may reset.
        let round_trip = async {
            tokio::join!(call(&*tunnel.opener, "/echo", b"hi"), async {
                let stream = acceptor.accept().await.unwrap().expect("a stream");
                tokio::spawn(serve(
                    stream,
                    service(Default::default()),
                    Limits::default(),
                ));
            })
            .0
        };
        let resp = tokio::time::timeout(Duration::from_secs(10), round_trip)
            .await
            .expect("a round trip before the restart");
        assert_eq!(resp.status(), 200);

        // The old hub vanishes without a goodbye; a new one takes its place.
        let second = endpoint(&restarted_with);
        relay.switch_to(second.local_addr().unwrap());
        let err = tokio::time::timeout(Duration::from_secs(30), acceptor.accept())
            .await
            .expect("the agent notices within its keepalive timeout")
            .expect_err("the old tunnel ends with an error");
        assert!(
            err.to_string().contains(want),
            "restarted with {}: {err}",
            if restarted_with == kept {
                "the same secret"
            } else {
                "another secret"
            }
        );
        shutdown.cancel();
    }
}

/// Where the path carries jumbo datagrams (loopback does), the hub's MTU
/// search reaches the ceiling and stays there under a bulk transfer to the
/// agent: quinn sends 10 datagrams at once, 89 KiB at this size, more than
/// the kernel takes in one send. Were such a batch refused, its datagrams
/// would count as lost and the search would take the path for a black
/// hole and fall to 1,200. The agent's search toward the hub reaches the
/// ceiling as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_bulk_goes_in_jumbo_datagrams_where_the_path_carries_them() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut acceptor, tunnel, shutdown) = quic_tunnel().await;

    // The hub sends 64 MiB down one stream.
    const BULK: usize = 64 * 1024 * 1024;
    let hub = async {
        let mut stream = tunnel.opener.open().await.unwrap();
        let chunk = vec![0x5au8; 64 * 1024];
        for _ in 0..BULK / chunk.len() {
            stream.send.write_all(&chunk).await.unwrap();
        }
        stream.send.shutdown().await.unwrap();
    };
    let agent = async {
        let mut stream = acceptor.accept().await.unwrap().expect("a stream");
        let mut buf = vec![0u8; 256 * 1024];
        let mut got = 0;
        loop {
            match stream.recv.read(&mut buf).await.unwrap() {
                0 => break got,
                n => got += n,
            }
        }
    };
    let ((), got) =
        tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(hub, agent) })
            .await
            .expect("64 MiB over loopback within a minute");
    assert_eq!(got, BULK);

    let hub_side = tunnel.opener.packets().expect("QUIC counts packets");
    assert_eq!(hub_side.mtu, quic::MTU_CEILING, "{hub_side:?}");
    // A refused batch would be 10 datagrams lost at once, again and again.
    assert!(hub_side.lost * 100 <= hub_side.sent, "{hub_side:?}");
    let agent_side = acceptor.packets().expect("QUIC counts packets");
    assert_eq!(agent_side.mtu, quic::MTU_CEILING, "{agent_side:?}");
    shutdown.cancel();
}

/// Over QUIC a hub's request whose upload has sent more yields to one
/// whose upload has sent less, whichever was opened and written first: a
/// port-forward's upload path sends a few batches at once, and the agent
/// takes each only after the one before, so sent in turn each batch was
/// whole only once all were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_the_request_whose_upload_sent_less_goes_first() {
    use std::sync::atomic::AtomicUsize;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut acceptor, tunnel, shutdown) = quic_tunnel().await;

    // 8 MiB each: a later batch (its upload sent 64 MiB before it), opened
    // first, and an earlier one (1 MiB before it).
    const EACH: usize = 8 * 1024 * 1024;
    let later = tunnel.opener.open().await.unwrap();
    later.continues(64 << 20);
    let earlier = tunnel.opener.open().await.unwrap();
    earlier.continues(1 << 20);
    let write = |mut stream: otter_tunnel::TunnelStream, fill: u8| async move {
        let chunk = vec![fill; 64 * 1024];
        for _ in 0..EACH / chunk.len() {
            stream.send.write_all(&chunk).await.unwrap();
        }
        stream.send.shutdown().await.unwrap();
    };
    // Bytes read of each (later, earlier), and of the later one when the
    // earlier one ended.
    let got = [AtomicUsize::new(0), AtomicUsize::new(0)];
    let later_at_end = AtomicUsize::new(usize::MAX);
    let read = |mut stream: otter_tunnel::TunnelStream| {
        let (got, later_at_end) = (&got, &later_at_end);
        async move {
            let mut buf = vec![0u8; 256 * 1024];
            let mut which = None;
            loop {
                let n = stream.recv.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                let i = *which.get_or_insert(usize::from(buf[0] == b'E'));
                got[i].fetch_add(n, Ordering::SeqCst);
            }
            if which == Some(1) {
                later_at_end.store(got[0].load(Ordering::SeqCst), Ordering::SeqCst);
            }
        }
    };
    let agent = async {
        let a = acceptor.accept().await.unwrap().expect("a stream");
        let b = acceptor.accept().await.unwrap().expect("a stream");
        tokio::join!(read(a), read(b));
    };
    tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(write(later, b'L'), write(earlier, b'E'), agent)
    })
    .await
    .expect("16 MiB over loopback within a minute");
    assert_eq!(got[0].load(Ordering::SeqCst), EACH);
    assert_eq!(got[1].load(Ordering::SeqCst), EACH);
    // In turn, the later one would have had about as much as the earlier.
    let later = later_at_end.load(Ordering::SeqCst);
    assert!(
        later < EACH / 4,
        "the later batch had {later} of {EACH} bytes through when the earlier one ended"
    );
    shutdown.cancel();
}

/// An agent searches its path MTU toward a hub host once: a tunnel dialled
/// again from the same dialer starts at the size the last one reached and
/// sends no probes (after a hub restart, every agent's probes would
/// otherwise reach the hub at once), while a dialer of its own searches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_dialled_again_starts_at_the_path_mtu_found_before() {
    let (server, client) = quic_tls();
    let settings = QuicSettings::default();
    let (addr, mut rx, shutdown) = quic_hub(server);

    // Waits (bounded) until the agent's search has reached the ceiling.
    async fn searched(acceptor: &quic::QuicAcceptor) -> otter_tunnel::PathCounts {
        for _ in 0..500 {
            let counts = acceptor.packets().expect("QUIC counts packets");
            if counts.mtu == quic::MTU_CEILING {
                return counts;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "the search never reached the ceiling: {:?}",
            acceptor.packets()
        );
    }

    let dialer = quic::Dialer::default();
    let first = dialer
        .dial(addr, "localhost", client.clone(), &settings)
        .await
        .unwrap();
    let _first_hub = rx.recv().await.expect("tunnel accepted");
    let found = searched(&first).await;
    assert!(found.mtu_probes > 0, "the first tunnel searched: {found:?}");
    drop(first);

    let again = dialer
        .dial(addr, "localhost", client.clone(), &settings)
        .await
        .unwrap();
    let again_hub = rx.recv().await.expect("tunnel accepted");
    // A call each way: the datagrams are as large as the path carries.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut acceptor = again;
        // (A QUIC stream reaches the agent with its first bytes.)
        let hub = async {
            let mut stream = again_hub.opener.open().await.unwrap();
            stream.send.write_all(&[7u8; 20_000]).await.unwrap();
            stream.send.shutdown().await.unwrap();
            let mut back = Vec::new();
            stream.recv.read_to_end(&mut back).await.unwrap();
            back.len()
        };
        let agent = async {
            let mut accepted = acceptor.accept().await.unwrap().expect("a stream");
            let mut got = Vec::new();
            accepted.recv.read_to_end(&mut got).await.unwrap();
            accepted.send.write_all(&got).await.unwrap();
            accepted.send.shutdown().await.unwrap();
        };
        let (back, ()) =
            tokio::time::timeout(Duration::from_secs(30), async { tokio::join!(hub, agent) })
                .await
                .expect("20 KB each way within 30 s");
        assert_eq!(back, 20_000);
        let counts = acceptor.packets().expect("QUIC counts packets");
        assert_eq!(counts.mtu, quic::MTU_CEILING, "{counts:?}");
        assert_eq!(counts.mtu_probes, 0, "dialled again, no search: {counts:?}");
    }

    // Another dialer knows nothing of this hub and searches.
    let other = quic::Dialer::default()
        .dial(addr, "localhost", client, &settings)
        .await
        .unwrap();
    let _other_hub = rx.recv().await.expect("tunnel accepted");
    let found = searched(&other).await;
    assert!(found.mtu_probes > 0, "{found:?}");
    shutdown.cancel();
}

/// Each exchange ends with a race: the side that has what it needs drops
/// the stream while the other's end is still on the way. HTTP/2 answers a
/// frame for a stream it has already forgotten with a reset of its own and,
/// after 1,024 of those over a connection's life, drops the connection as
/// "excessive load": a busy tunnel died after about 10,000 calls (10,538
/// here). Bounded in calls; it stops at the first failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_tunnel_survives_many_calls() {
    tls::install_default_provider();
    let opener = connect("h2", Arc::new(AtomicBool::new(false))).await;
    let started = std::time::Instant::now();
    for i in 0..CALLS {
        let stream = match opener.open().await {
            Ok(s) => s,
            Err(e) => panic!("call {i} of {CALLS}: the tunnel is gone: {e}"),
        };
        let req = http::Request::post("/echo")
            .body(Full::new(Bytes::from_static(b"x")))
            .unwrap();
        let resp = forward(stream, "", None, req, Limits::default(), None).await;
        let resp = resp.unwrap_or_else(|e| panic!("call {i} of {CALLS}: {e}"));
        resp.into_body()
            .collect()
            .await
            .unwrap_or_else(|e| panic!("call {i} of {CALLS}: body: {e}"));
    }
    eprintln!("{CALLS} calls in {:?}", started.elapsed());
}

const CALLS: usize = 20_000;
