//! A caller that opens many streaming calls and then stops reading its
//! connection, having told the hub it may send as much as it likes (the
//! largest HTTP/2 windows there are): the hub holds a bounded part of each
//! answer for it, and once the caller fails to answer the hub's ping, the
//! connection and every call on it end. The same with a hostile agent
//! behind the calls, sending its answers a byte at a time: what the hub
//! holds stays bounded in bytes, not in frames of a byte each.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use bytes::Bytes;
use otter_e2e::{
    double::{small_bulk_watch, start_agent_at, wait_until},
    fleet::{Fleet, metric},
    grpc_framed,
    kube::sim_config,
    procs::{peak_rss_mib, reset_peak_rss, rss_mib},
};
use otter_tunnel::TransportKind;
use prost::Message;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Streams the caller opens: each a Watch of 16 KiB events without end.
const STREAMS: usize = 400;
/// What the hub may hold for a caller that reads nothing: for each stream
/// its send buffer (64 KiB), an event on its way into it and one being
/// gathered from the tunnel (16 KiB each); the tunnel's connection window
/// (16 MiB); and 8 MiB for the socket buffers and the allocator's slack.
/// With hyper's default send buffer (400 KiB) the streams alone could take
/// 156 MiB (the hub grew 73–95 MiB so; 36–38 with ours).
const MAX_GROWTH_MIB: f64 = STREAMS as f64 * (64.0 + 2.0 * 16.0) / 1024.0 + 16.0 + 8.0;
/// The hub's keepalive in this test, in seconds.
const KEEPALIVE_SECS: u64 = 3;
/// The largest flow-control window HTTP/2 allows.
const MAX_WINDOW: u32 = (1 << 31) - 1;

/// A connection whose reading side the test can stop for good: writes go
/// on, reads never complete again, as a client that stopped reading.
struct Deaf<T> {
    io: T,
    deaf: Arc<AtomicBool>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Deaf<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.deaf.load(Ordering::SeqCst) {
            return Poll::Pending;
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Deaf<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A caller of the test's own on the hub's API port: TLS and HTTP/2 with
/// every window as large as the protocol allows, `n` calls of `method`
/// (each sending `request`) open, and its reading stopped for good once
/// they are on their way.
struct DeafCaller {
    conn: tokio::task::JoinHandle<Result<(), h2::Error>>,
    _calls: Vec<(h2::client::ResponseFuture, h2::SendStream<Bytes>)>,
}

impl DeafCaller {
    /// `recv_buffer`: the socket's receive buffer, when what the caller's
    /// kernel takes in before it stops should be small.
    async fn open(
        fleet: &Fleet,
        recv_buffer: Option<u32>,
        method: &str,
        request: &[u8],
        n: usize,
    ) -> DeafCaller {
        otter_pki::tls::install_default_provider();
        let tls = otter_pki::tls::client_config(&fleet.ca_pem, None, &[b"h2"]).expect("TLS config");
        let tcp = tokio::net::TcpSocket::new_v4().expect("socket");
        if let Some(size) = recv_buffer {
            tcp.set_recv_buffer_size(size).expect("receive buffer");
        }
        let tcp = tcp.connect(fleet.api_addr()).await.expect("connect");
        let tls = tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect("localhost".try_into().expect("name"), tcp)
            .await
            .expect("TLS");
        let deaf = Arc::new(AtomicBool::new(false));
        let io = Deaf {
            io: tls,
            deaf: deaf.clone(),
        };
        let (mut send, conn) = h2::client::Builder::new()
            .initial_window_size(MAX_WINDOW)
            .initial_connection_window_size(MAX_WINDOW)
            .handshake::<_, Bytes>(io)
            .await
            .expect("HTTP/2 handshake");
        let conn = tokio::spawn(conn);
        let body = grpc_framed(request);
        let mut calls = Vec::new();
        for _ in 0..n {
            send = send.ready().await.expect("a stream to send on");
            let req = http::Request::post(format!(
                "https://localhost:{}/otterscale.resource.v1.ResourceService/{method}",
                fleet.api
            ))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("authorization", format!("Bearer {}", fleet.admin_token))
            .body(())
            .expect("request");
            let (answer, mut stream) = send.send_request(req, false).expect("send");
            stream.send_data(body.clone(), true).expect("request body");
            calls.push((answer, stream));
        }
        // Requests on their way; from here on nothing is read.
        tokio::time::sleep(Duration::from_millis(200)).await;
        deaf.store(true, Ordering::SeqCst);
        DeafCaller {
            conn,
            _calls: calls,
        }
    }
}

impl Drop for DeafCaller {
    fn drop(&mut self) {
        self.conn.abort();
    }
}

/// Once every agent is connected: the hub's process and its memory now
/// (MiB), its peak counted from here.
async fn hub_memory_from_now(fleet: &Fleet) -> (u32, f64) {
    let channel = fleet.channel().await;
    fleet.all_connected(&channel).await;
    let hub = fleet.hub.as_ref().expect("hub").pid();
    assert!(reset_peak_rss(hub), "cannot reset the hub's peak memory");
    (hub, rss_mib(hub).expect("hub memory"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_stops_reading_holds_bounded_hub_memory_and_is_cut() {
    let sim = kube_sim::KubeSim::start(sim_config()).await.expect("sim");
    let keepalive = KEEPALIVE_SECS.to_string();
    let fleet =
        Fleet::start_hub_only_with(&sim, &["quic"], &["--api-keepalive-secs", &keepalive]).await;
    let token = std::fs::read_to_string(fleet.dir.path().join("token-0")).expect("token");
    let agent = start_agent_at(
        format!("https://localhost:{}", fleet.api).parse().unwrap(),
        &fleet.ca_pem,
        "edge-0",
        "agent-0",
        &token,
        TransportKind::Quic,
        |_| {},
    );
    let (hub, before) = hub_memory_from_now(&fleet).await;
    let caller = DeafCaller::open(
        &fleet,
        None,
        "Watch",
        &small_bulk_watch("edge-0").encode_to_vec(),
        STREAMS,
    )
    .await;
    let deafened = Instant::now();

    let live = agent.live_watches.clone();
    wait_until(
        async || live.load(Ordering::SeqCst) == STREAMS,
        "every Watch to reach the agent",
    )
    .await;
    // The answers pile up until every buffer on the way is full.
    let mut last = 0.0;
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = peak_rss_mib(hub).expect("hub memory");
        if now - last < 0.5 || deafened.elapsed() > Duration::from_secs(KEEPALIVE_SECS) {
            break;
        }
        last = now;
    }
    let peak = peak_rss_mib(hub).expect("hub memory");
    let growth = peak - before;

    // The hub's ping goes unanswered: the connection ends, and with it
    // every Watch, at the hub and at the agent.
    let metrics = async || fleet.hub_metrics().await;
    wait_until(
        async || live.load(Ordering::SeqCst) == 0,
        "the agent's watches to end",
    )
    .await;
    let ended = deafened.elapsed();
    assert_eq!(metric(&metrics().await, "otter_hub_calls_in_flight"), 0.0);
    let after = rss_mib(hub).expect("hub memory");
    println!(
        "{STREAMS} unread Watches of 16 KiB events: hub memory {before:.1} MiB, peak {peak:.1} (+{growth:.1}, \
         bound {MAX_GROWTH_MIB:.1}); every Watch ended {ended:.1?} after the caller stopped \
         reading; hub memory then {after:.1} MiB"
    );
    assert!(
        growth < MAX_GROWTH_MIB,
        "the hub held {growth:.1} MiB for a caller that reads nothing"
    );
    // Silent for the interval, then unanswered for as long: the margin is
    // for the answers the hub was still passing when reading stopped.
    assert!(
        ended < Duration::from_secs(2 * KEEPALIVE_SECS + 8),
        "took {ended:?}"
    );
    drop(caller);
    agent.agent.shutdown().await;
}

/// The agent's ResourceService, replaced: every call is answered with an
/// endless message sent a byte at a time, each its own DATA chunk a little
/// after the one before, so that the hub reads them one by one.
#[derive(Clone, Default)]
struct Trickle {
    /// Bytes the answers have let go of so far.
    sent: Arc<std::sync::atomic::AtomicU64>,
}

impl tonic::server::NamedService for Trickle {
    const NAME: &'static str = "otterscale.resource.v1.ResourceService";
}

impl tower::Service<http::Request<tonic::body::Body>> for Trickle {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, std::convert::Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), std::convert::Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<tonic::body::Body>) -> Self::Future {
        // A message prefix announcing 64 MiB, then its bytes one by one.
        let mut prefix = vec![0u8];
        prefix.extend_from_slice(&(64u32 << 20).to_be_bytes());
        let head = futures::stream::iter([Ok::<_, std::convert::Infallible>(
            hyper::body::Frame::data(Bytes::from(prefix)),
        )]);
        let sent = self.sent.clone();
        let bytes = futures::stream::unfold(0u64, move |i| {
            let sent = sent.clone();
            async move {
                if i % 64 == 63 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                } else {
                    tokio::task::yield_now().await;
                }
                sent.fetch_add(1, Ordering::Relaxed);
                Some((
                    Ok(hyper::body::Frame::data(Bytes::from_static(b"x"))),
                    i + 1,
                ))
            }
        });
        let body = tonic::body::Body::new(http_body_util::StreamBody::new(
            futures::StreamExt::chain(head, bytes),
        ));
        std::future::ready(Ok(http::Response::builder()
            .header("content-type", "application/grpc")
            .body(body)
            .expect("response")))
    }
}

/// Streams of the trickling agent's caller.
const TRICKLED: usize = 20;
/// What the hub may hold for them: 64 KiB of bytes a stream in frames of
/// 4 KiB or more, sixteen small frames and 4 KiB gathered (say 128 KiB a
/// stream); the HTTP/2 tunnel's connection window (8 MiB), full of
/// one-byte chunks; and 8 MiB of slack. In frames of a few bytes each, as
/// the agent cut them, the same 64 KiB a stream took 0.9 MiB.
const MAX_TRICKLED_GROWTH_MIB: f64 = TRICKLED as f64 * 128.0 / 1024.0 + 8.0 + 8.0;
/// How long the trickle must have stood still to be taken as stopped.
const STILL: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_trickling_bytes_to_a_caller_that_reads_nothing_costs_the_hub_bounded_memory() {
    let sim = kube_sim::KubeSim::start(sim_config()).await.expect("sim");
    // The caller is cut by the keepalive only after the measurement.
    let fleet = Fleet::start_hub_only_with(&sim, &["h2"], &["--api-keepalive-secs", "60"]).await;
    let trickle = Trickle::default();
    let sent = trickle.sent.clone();
    let agent = fleet
        .own_agent(0, TransportKind::H2, tonic::service::Routes::new(trickle))
        .await;
    let (hub, before) = hub_memory_from_now(&fleet).await;
    // A small receive buffer: what the caller's kernel takes in before it
    // stops is not the hub's memory, and would take the trickle long to fill.
    let caller = DeafCaller::open(
        &fleet,
        Some(4096),
        "Get",
        &otter_e2e::double::get("edge-0", "x").encode_to_vec(),
        TRICKLED,
    )
    .await;
    let started = Instant::now();
    // Until every buffer on the way is full: the agent's answers have not
    // moved for five seconds (a hub busy with frames can stall them for
    // two), or for 30 s at most.
    let (mut last, mut still_since) = (0, Instant::now());
    while still_since.elapsed() < STILL && started.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = sent.load(Ordering::Relaxed);
        if now != last {
            (last, still_since) = (now, Instant::now());
        }
    }
    let peak = peak_rss_mib(hub).expect("hub memory");
    let growth = peak - before;
    println!(
        "{TRICKLED} answers trickled a byte at a time to a caller that reads nothing: hub memory \
         {before:.1} MiB, peak {peak:.1} (+{growth:.1}, bound {MAX_TRICKLED_GROWTH_MIB:.1}); the \
         agent's answers had let go of {last} bytes after {:.1?}",
        started.elapsed().saturating_sub(STILL)
    );
    assert!(
        growth < MAX_TRICKLED_GROWTH_MIB,
        "the hub held {growth:.1} MiB for {TRICKLED} trickled answers"
    );
    drop(caller);
    agent.shutdown().await;
}
