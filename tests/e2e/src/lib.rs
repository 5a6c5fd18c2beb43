//! Helpers for the end-to-end tests: start a hub in a temp dir, start
//! agents joined the real way, and talk to the hub as a client would.
//!
//! # Layout
//! - [`TestHub`] — a hub on loopback ports with its own data dir.
//! - [`client_channel`] — a gRPC channel to the hub that trusts only its CA.
//! - [`with_token`] — adds the bearer token to a request.
//! - [`dial_tunnel`] — the tunnel port dialled by hand, as an agent would.
//! - [`tools`] — third-party clients run as bounded subprocesses.
//! - [`double`] — agents serving a test double; [`kube`] — an agent with
//!   the real Kubernetes services against the Kubernetes API test server.
//! - [`fleet`] — a hub and agents as processes, with their metrics.
//! - [`procs`] — real hub and agent processes (to kill, or to put in
//!   network namespaces); [`netns`] — two namespaces and a link to cut;
//!   [`wan`] — the same namespaces joined by a distant, lossy link.

pub mod double;
pub mod etcd;
pub mod fleet;
pub mod kube;
pub mod netns;
pub mod procs;
pub mod tools;
pub mod wan;

use std::{path::PathBuf, sync::Arc, time::Duration};

use otter_hub::{Hub, HubConfig};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// A hub for a test, with its data directory.
#[derive(Debug)]
pub struct TestHub {
    pub hub: Hub,
    pub dir: Arc<tempfile::TempDir>,
    pub admin_token: String,
}

impl TestHub {
    /// A hub on free loopback ports.
    pub async fn start() -> TestHub {
        let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
        Self::start_in(dir, None).await
    }

    /// A hub in `dir` (kept across restarts), on the ports of `previous`
    /// when given so agents find it again.
    pub async fn start_in(
        dir: Arc<tempfile::TempDir>,
        previous: Option<(std::net::SocketAddr, std::net::SocketAddr)>,
    ) -> TestHub {
        Self::start_with(dir, previous, |_| {}).await
    }

    /// Like [`TestHub::start_in`], with a chance to change the config.
    pub async fn start_with(
        dir: Arc<tempfile::TempDir>,
        previous: Option<(std::net::SocketAddr, std::net::SocketAddr)>,
        tweak: impl FnOnce(&mut HubConfig),
    ) -> TestHub {
        let mut config = HubConfig::new(dir.path());
        config.api_listen = "127.0.0.1:0".parse().expect("address");
        config.tunnel_listen = "127.0.0.1:0".parse().expect("address");
        if let Some((api, tunnel)) = previous {
            config.api_listen = api;
            config.tunnel_listen = tunnel;
        }
        config.keepalive = otter_tunnel::Keepalive::every(Duration::from_secs(1));
        config.drain_timeout = Duration::from_secs(2);
        tweak(&mut config);
        let hub = Hub::start(config).await.expect("hub starts");
        let admin_token = std::fs::read_to_string(dir.path().join("admin-token"))
            .expect("admin token file")
            .trim()
            .to_owned();
        TestHub {
            hub,
            dir,
            admin_token,
        }
    }

    pub fn api_url(&self) -> url::Url {
        url::Url::parse(&format!("https://localhost:{}", self.hub.api_addr.port())).expect("URL")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().to_owned()
    }

    /// A manifest URL for `cluster`, minted by the admin.
    pub async fn manifest_url(&self, cluster: &str) -> String {
        use otter_proto::link::v1::{
            GetAgentManifestRequest, link_service_client::LinkServiceClient,
        };
        LinkServiceClient::new(self.channel().await)
            .get_agent_manifest(with_token(
                GetAgentManifestRequest {
                    cluster: Some(cluster.into()),
                    ..Default::default()
                },
                &self.admin_token,
            ))
            .await
            .expect("GetAgentManifest")
            .into_inner()
            .url
            .expect("a manifest URL")
    }

    pub async fn channel(&self) -> tonic::transport::Channel {
        client_channel(self.hub.api_addr, self.hub.ca_pem(), None).await
    }

    /// Like [`TestHub::channel`], trusting `ca_pem` (a bundle during a CA
    /// rotation).
    pub async fn channel_with_ca(&self, ca_pem: &str) -> tonic::transport::Channel {
        client_channel(self.hub.api_addr, ca_pem, None).await
    }
}

/// A gRPC channel to `addr` over TLS, trusting only `ca_pem`, optionally
/// with a client certificate (cert PEM, key PEM).
pub async fn client_channel(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    client: Option<(&str, &str)>,
) -> tonic::transport::Channel {
    client_channel_alpn(addr, ca_pem, client, b"h2").await
}

/// Like [`client_channel`], negotiating `alpn` (the tunnel port's link
/// API, say).
pub async fn client_channel_alpn(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    client: Option<(&str, &str)>,
    alpn: &[u8],
) -> tonic::transport::Channel {
    otter_pki::tls::install_default_provider();
    let tls = otter_pki::tls::client_config(ca_pem, client, &[alpn]).expect("client TLS config");
    let connector = TlsConnector::from(Arc::new(tls));
    tonic::transport::Endpoint::from_shared(format!("http://localhost:{}", addr.port()))
        .expect("endpoint")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let connector = connector.clone();
            async move {
                let tcp = TcpStream::connect(addr).await?;
                // Without it, small gRPC frames wait on delayed ACKs (~40 ms).
                let _ = tcp.set_nodelay(true);
                let tls = connector
                    .connect("localhost".try_into().expect("name"), tcp)
                    .await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await
        .expect("connect to hub")
}

/// The ALPN an agent's TLS offers to dial `transport` (QUIC, or TLS with
/// HTTP/2 on it).
pub fn tunnel_alpn(transport: otter_tunnel::TransportKind) -> &'static [u8] {
    match transport {
        otter_tunnel::TransportKind::Quic => otter_tunnel::quic::ALPN,
        _ => otter_tunnel::h2::ALPN,
    }
}

/// Dials a hub's tunnel port at `addr` by hand, as an agent would over
/// `transport`, with `tls` (offering [`tunnel_alpn`]; a client
/// certificate of the hub's CA to be admitted).
pub async fn dial_tunnel(
    addr: std::net::SocketAddr,
    transport: otter_tunnel::TransportKind,
    tls: rustls::ClientConfig,
) -> otter_tunnel::Result<Box<dyn otter_tunnel::Acceptor>> {
    Ok(match transport {
        otter_tunnel::TransportKind::Quic => {
            Box::new(otter_tunnel::quic::dial(addr, "localhost", tls, &Default::default()).await?)
        }
        _ => Box::new(
            otter_tunnel::h2::dial(
                addr,
                "localhost".try_into().expect("a server name"),
                Arc::new(tls),
                Default::default(),
            )
            .await?,
        ),
    })
}

/// `message` as one gRPC message on the wire: uncompressed, its length
/// first.
pub fn grpc_framed(message: &[u8]) -> bytes::Bytes {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out.into()
}

/// Wraps a message in a request carrying `token`.
pub fn with_token<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("header value"),
    );
    req
}

/// A loopback relay in front of the hub's tunnel port (TCP and UDP on the
/// same port number) that a test can freeze: bytes and datagrams stop
/// flowing but sockets stay open, as when a middlebox drops a connection
/// without telling anyone. Only keepalives can notice that.
#[derive(Debug, Clone)]
pub struct Relay {
    pub addr: std::net::SocketAddr,
    frozen: Arc<std::sync::atomic::AtomicBool>,
    tcp_frozen: Arc<std::sync::atomic::AtomicBool>,
    /// TCP bytes wait (nothing is lost); datagrams are dropped.
    held: Arc<std::sync::atomic::AtomicBool>,
    udp_blocked: Arc<std::sync::atomic::AtomicBool>,
    /// Datagrams larger than this are dropped, both ways (a path whose MTU
    /// is small and whose fragments are lost).
    udp_max: Arc<std::sync::atomic::AtomicUsize>,
    target: Arc<std::sync::Mutex<Option<std::net::SocketAddr>>>,
}

impl Relay {
    /// Binds TCP and UDP on one free loopback port.
    pub async fn start() -> Relay {
        use std::sync::atomic::AtomicBool;
        let (tcp, udp) = loop {
            let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind relay");
            let port = tcp.local_addr().expect("addr").port();
            if let Ok(udp) = tokio::net::UdpSocket::bind(("127.0.0.1", port)).await {
                break (tcp, udp);
            }
        };
        let relay = Relay {
            addr: tcp.local_addr().expect("addr"),
            frozen: Arc::new(AtomicBool::new(false)),
            tcp_frozen: Arc::new(AtomicBool::new(false)),
            held: Arc::new(AtomicBool::new(false)),
            udp_blocked: Arc::new(AtomicBool::new(false)),
            udp_max: Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX)),
            target: Arc::new(std::sync::Mutex::new(None)),
        };
        let r = relay.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = tcp.accept().await {
                let Some(target) = r.target() else { continue };
                let frozen = [r.frozen.clone(), r.tcp_frozen.clone()];
                let held = r.held.clone();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (mut ir, mut iw) = inbound.into_split();
                    let (mut or, mut ow) = outbound.into_split();
                    let (f2, h2) = (frozen.clone(), held.clone());
                    tokio::join!(
                        pump(&mut ir, &mut ow, frozen, held),
                        pump(&mut or, &mut iw, f2, h2)
                    );
                });
            }
        });
        let r = relay.clone();
        tokio::spawn(udp_relay(Arc::new(udp), r));
        relay
    }

    /// Where the relay forwards to (the hub's tunnel port).
    pub fn set_target(&self, target: std::net::SocketAddr) {
        *self.target.lock().expect("lock") = Some(target);
    }

    fn target(&self) -> Option<std::net::SocketAddr> {
        *self.target.lock().expect("lock")
    }

    /// Drops (true) or passes (false) UDP only, like a firewall that lets
    /// TCP through but not QUIC.
    pub fn block_udp(&self, blocked: bool) {
        self.udp_blocked
            .store(blocked, std::sync::atomic::Ordering::SeqCst);
    }

    /// Drops UDP datagrams of more than `bytes` payload, both ways, as a
    /// path with a small MTU that loses fragments would.
    pub fn limit_datagrams(&self, bytes: usize) {
        self.udp_max
            .store(bytes, std::sync::atomic::Ordering::SeqCst);
    }

    /// Stops (true) or resumes (false) all traffic.
    pub fn freeze(&self, frozen: bool) {
        self.frozen
            .store(frozen, std::sync::atomic::Ordering::SeqCst);
    }

    /// Holds (true) or lets go (false) all traffic without losing any
    /// stream's bytes: TCP waits in the relay, datagrams are dropped (QUIC
    /// sends them again). A path that stalls for a moment, where
    /// [`Relay::freeze`] is one that died.
    pub fn hold(&self, held: bool) {
        self.held.store(held, std::sync::atomic::Ordering::SeqCst);
    }

    /// Stops (true) or resumes (false) TCP only; datagrams pass.
    pub fn freeze_tcp(&self, frozen: bool) {
        self.tcp_frozen
            .store(frozen, std::sync::atomic::Ordering::SeqCst);
    }
}

async fn pump(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    to: &mut (impl tokio::io::AsyncWrite + Unpin),
    frozen: [Arc<std::sync::atomic::AtomicBool>; 2],
    held: Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Frozen: swallow the bytes, as a dead path would.
        if frozen
            .iter()
            .any(|f| f.load(std::sync::atomic::Ordering::SeqCst))
        {
            continue;
        }
        while held.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// UDP: one upstream socket per client address.
async fn udp_relay(socket: Arc<tokio::net::UdpSocket>, relay: Relay) {
    use std::collections::HashMap;
    let mut upstreams: HashMap<std::net::SocketAddr, Arc<tokio::net::UdpSocket>> = HashMap::new();
    let mut buf = vec![0u8; 65536];
    loop {
        let Ok((n, client)) = socket.recv_from(&mut buf).await else {
            return;
        };
        if relay.frozen.load(std::sync::atomic::Ordering::SeqCst)
            || relay.held.load(std::sync::atomic::Ordering::SeqCst)
            || relay.udp_blocked.load(std::sync::atomic::Ordering::SeqCst)
            || n > relay.udp_max.load(std::sync::atomic::Ordering::SeqCst)
        {
            continue;
        }
        let Some(target) = relay.target() else {
            continue;
        };
        let up = match upstreams.get(&client) {
            Some(u) => u.clone(),
            None => {
                let Ok(u) = tokio::net::UdpSocket::bind("127.0.0.1:0").await else {
                    continue;
                };
                let u = Arc::new(u);
                upstreams.insert(client, u.clone());
                let (down, up2, frozen) = (socket.clone(), u.clone(), relay.frozen.clone());
                let (max, held) = (relay.udp_max.clone(), relay.held.clone());
                tokio::spawn(async move {
                    let mut b = vec![0u8; 65536];
                    while let Ok((n, _)) = up2.recv_from(&mut b).await {
                        if !frozen.load(std::sync::atomic::Ordering::SeqCst)
                            && !held.load(std::sync::atomic::Ordering::SeqCst)
                            && n <= max.load(std::sync::atomic::Ordering::SeqCst)
                        {
                            let _ = down.send_to(&b[..n], client).await;
                        }
                    }
                });
                u
            }
        };
        let _ = up.send_to(&buf[..n], target).await;
    }
}

/// A plain HTTP exchange with the hub over TLS (HTTP/1.1 or HTTP/2), as a
/// browser or `fetch` would make it. Returns status, headers and the whole
/// body (trailers, if any, are appended to the headers).
pub async fn http_call(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    http2: bool,
    req: http::Request<http_body_util::Full<bytes::Bytes>>,
) -> (http::StatusCode, http::HeaderMap, bytes::Bytes) {
    use http_body_util::BodyExt;
    otter_pki::tls::install_default_provider();
    let alpn: &[&[u8]] = if http2 { &[b"h2"] } else { &[b"http/1.1"] };
    let tls = otter_pki::tls::client_config(ca_pem, None, alpn).expect("TLS config");
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let tls = TlsConnector::from(Arc::new(tls))
        .connect("localhost".try_into().expect("name"), tcp)
        .await
        .expect("TLS handshake");
    let io = hyper_util::rt::TokioIo::new(tls);
    let resp = if http2 {
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                .await
                .expect("h2 handshake");
        tokio::spawn(conn);
        send.send_request(req).await.expect("request")
    } else {
        let (mut send, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .expect("h1 handshake");
        tokio::spawn(conn);
        send.send_request(req).await.expect("request")
    };
    let (parts, body) = resp.into_parts();
    let collected = body.collect().await.expect("body");
    let mut headers = parts.headers;
    if let Some(t) = collected.trailers() {
        headers.extend(t.clone());
    }
    (parts.status, headers, collected.to_bytes())
}

/// A call of the hub's admin API as the CLI makes it: (status, body).
pub async fn admin_call(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    token: &str,
    method: http::Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> (u16, String) {
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {token}"))
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .expect("request");
    let (status, _, body) = http_call(addr, ca_pem, false, req).await;
    (status.as_u16(), String::from_utf8_lossy(&body).into_owned())
}

/// A Register with join token `join` for `cluster` as agent `agent` (a key
/// of its own), without a client certificate.
pub async fn register(
    hub: &TestHub,
    cluster: &str,
    agent: &str,
    join: &str,
) -> Result<(), tonic::Status> {
    use otter_proto::link::v1::{RegisterRequest, link_service_client::LinkServiceClient};
    let (_key, csr) = otter_pki::csr::generate(cluster, agent).expect("a CSR");
    LinkServiceClient::new(hub.channel().await)
        .register(RegisterRequest {
            cluster: Some(cluster.into()),
            csr: Some(csr.into_bytes()),
            agent_id: Some(agent.into()),
            agent_version: Some("test/1".into()),
            join_token: Some(join.into()),
            ..Default::default()
        })
        .await
        .map(drop)
}

/// Mints a token through the admin API as `by`: (token, id).
pub async fn mint_via_admin(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    by: &str,
    body: serde_json::Value,
) -> (String, String) {
    let (status, text) = admin_call(
        addr,
        ca_pem,
        by,
        http::Method::POST,
        "/admin/v1/tokens",
        Some(body),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let field = |k: &str| v[k].as_str().expect("minted token").to_owned();
    (field("token"), field("id"))
}

/// Revokes hub token `id` through the admin API as `by`.
pub async fn revoke_via_admin(addr: std::net::SocketAddr, ca_pem: &str, by: &str, id: &str) {
    let path = format!("/admin/v1/tokens/{id}");
    let (status, text) = admin_call(addr, ca_pem, by, http::Method::DELETE, &path, None).await;
    assert_eq!(status, 200, "{text}");
}

/// The status a stream ends with, its events skipped; fails the test if
/// it is still open after [`double::WAIT`] or ends without one.
pub async fn end_of_stream<T: std::fmt::Debug>(
    what: &str,
    s: &mut tonic::Streaming<T>,
) -> tonic::Status {
    use futures::StreamExt;
    let deadline = tokio::time::Instant::now() + double::WAIT;
    loop {
        match tokio::time::timeout_at(deadline, s.next()).await {
            Err(_) => panic!("{what} still open after {:?}", double::WAIT),
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(status))) => return status,
            Ok(None) => panic!("{what} ended without a status"),
        }
    }
}

/// Whether a missing external tool fails the test (`OTTER_REQUIRE_TOOLS=1`,
/// as `make test` sets) or skips it with a message.
pub fn tool_missing(what: &str) -> bool {
    if std::env::var("OTTER_REQUIRE_TOOLS").is_ok_and(|v| v == "1") {
        panic!("required tool missing: {what}");
    }
    eprintln!("skipped: {what} is not on this machine");
    true
}

/// kubectl 1.33 from the machine's kubectl package, if installed.
pub fn kubectl_133() -> Option<PathBuf> {
    let out = std::process::Command::new("dpkg")
        .args(["-L", "kubectl"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.ends_with("kubectl.1.33"))
        .map(PathBuf::from)
        .filter(|p| p.exists())
}

/// A spawned child with threads collecting its stdout and stderr.
struct Captured {
    child: std::process::Child,
    out: std::thread::JoinHandle<String>,
    err: std::thread::JoinHandle<String>,
}

fn spawn_captured(cmd: &mut std::process::Command, input: Option<Vec<u8>>) -> Captured {
    use std::io::{Read, Write};
    let stdin = match input {
        Some(_) => std::process::Stdio::piped(),
        None => std::process::Stdio::null(),
    };
    let mut child = cmd
        .stdin(stdin)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    if let (Some(input), Some(mut pipe)) = (input, child.stdin.take()) {
        // Written from a thread so a child that reads slowly cannot block us;
        // dropping the pipe closes the child's stdin.
        std::thread::spawn(move || {
            let _ = pipe.write_all(&input);
        });
    }
    let reader = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = reader(Box::new(child.stdout.take().expect("stdout")));
    let err = reader(Box::new(child.stderr.take().expect("stderr")));
    Captured { child, out, err }
}

/// Runs a command with a time bound; returns (exit code, stdout, stderr).
pub fn run_bounded(cmd: &mut std::process::Command, limit: Duration) -> (i32, String, String) {
    run_bounded_with_input(cmd, None, limit)
}

/// Like [`run_bounded`], feeding `input` to the command's stdin (then
/// closing it) when given.
pub fn run_bounded_with_input(
    cmd: &mut std::process::Command,
    input: Option<Vec<u8>>,
    limit: Duration,
) -> (i32, String, String) {
    let Captured {
        mut child,
        out,
        err,
    } = spawn_captured(cmd, input);
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("command did not finish within {limit:?}: {cmd:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status.code().unwrap_or(-1),
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    )
}

/// Runs a command that does not end by itself (`get -w`, `logs -f`) for
/// `duration`, then stops it; returns what it printed (stdout, stderr).
pub fn run_for(cmd: &mut std::process::Command, duration: Duration) -> (String, String) {
    let Captured {
        mut child,
        out,
        err,
    } = spawn_captured(cmd, None);
    std::thread::sleep(duration);
    let _ = child.kill();
    let _ = child.wait();
    (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    )
}

/// A TLS server on loopback presenting `cert` (with `key`, over `alpn`):
/// it completes the handshakes clients accept and says nothing else. What
/// a client meets when something that is not the hub answers: a server of
/// another CA, for another name, expired, or a middlebox re-signing TLS.
pub async fn tls_server(cert: &str, key: &str, alpn: &[u8]) -> std::net::SocketAddr {
    let config =
        otter_pki::tls::server_config(cert, key, cert, otter_pki::tls::ClientAuth::None, &[alpn])
            .expect("server TLS");
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let _ = acceptor.accept(tcp).await;
            });
        }
    });
    addr
}
