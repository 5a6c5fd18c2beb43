//! TLS over TCP carrying HTTP/2: each tunnel stream is one HTTP/2 stream
//! (a POST whose request body and response body are the two directions), so
//! every call has its own flow-control window and a slow reader stalls only
//! its own call.
//!
//! The agent is the TCP and TLS client; on top of the TLS connection the hub
//! is the HTTP/2 client and the agent the HTTP/2 server.

use std::{
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll, ready},
    time::{Duration, Instant},
};

use std::future::Future;

use bytes::Bytes;
use h2::{RecvStream, SendStream, client, server};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::mpsc,
};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::sync::CancellationToken;

use crate::{
    Result, TunnelError,
    transport::{
        Accepted, Acceptor, BoxFuture, Keepalive, LinkConn, Opener, TransportKind, TunnelStream,
    },
};

/// ALPN protocol of this transport on the hub's tunnel port.
pub const ALPN: &[u8] = b"otter-tunnel-h2";

/// ALPN of the hub's link API (gRPC over HTTP/2, the agent as client) on
/// the tunnel port: an agent renews there, with the certificate it holds,
/// when the tunnel port is the only one its network lets out.
pub const LINK_ALPN: &[u8] = b"otter-link-h2";

/// Bounds a TLS handshake; a client that stalls it is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Flow-control and concurrency settings of the HTTP/2 connection.
#[derive(Debug, Clone, Copy)]
pub struct H2Settings {
    /// Per-stream receive window: how much one call may have in flight.
    pub stream_window: u32,
    /// Connection receive window, shared by all calls.
    pub connection_window: u32,
    pub max_frame_size: u32,
    /// Streams the agent accepts at once (the hub bounds itself lower).
    pub max_streams: u32,
    pub keepalive: Keepalive,
    /// Bound of the agent's dial: TCP connect, TLS and HTTP/2 handshakes.
    pub connect_timeout: Duration,
}

impl Default for H2Settings {
    fn default() -> Self {
        Self {
            stream_window: 1024 * 1024,
            connection_window: 8 * 1024 * 1024,
            max_frame_size: 64 * 1024,
            max_streams: 1024,
            keepalive: Keepalive::default(),
            connect_timeout: HANDSHAKE_TIMEOUT,
        }
    }
}

/// Type-erased I/O, so openers and acceptors do not carry socket types.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

// ---------------------------------------------------------------- hub side

/// Runs the HTTP/2 client on a connection the agent dialled.
pub async fn hub_handshake(io: Box<dyn Io>, settings: H2Settings) -> Result<H2Opener> {
    hub_handshake_as(io, settings, TransportKind::H2).await
}

/// Like [`hub_handshake`], on a byte stream of another transport (`kind`),
/// such as a WebSocket.
pub async fn hub_handshake_as(
    io: Box<dyn Io>,
    settings: H2Settings,
    kind: TransportKind,
) -> Result<H2Opener> {
    // Each exchange ends with a race: the side that has what it needs
    // drops the stream while the other's end may still be on the wire. h2
    // answers a frame for a stream it has forgotten with a reset and counts
    // it; after 1,024 over the connection's life it drops the connection as
    // "excessive load", which killed busy tunnels after about 10,000 calls.
    // The count guards against peers that provoke resets on purpose; a
    // tunnel's peer is authenticated both ways, and a reset is smaller than
    // the frame that drew it. The limit on resets the peer sends stays.
    let (send, mut conn) = client::Builder::new()
        .initial_window_size(settings.stream_window)
        .initial_connection_window_size(settings.connection_window)
        .max_frame_size(settings.max_frame_size)
        .max_send_buffer_size(settings.stream_window as usize)
        .max_header_list_size(64 * 1024)
        .max_local_error_reset_streams(None)
        .handshake::<_, Bytes>(io)
        .await?;
    let ping = conn.ping_pong();
    let closed = CancellationToken::new();
    let reason = Arc::new(Mutex::new(String::new()));
    let rtt = Arc::new(Mutex::new(None));
    let answered = Arc::new(AtomicU64::new(0));
    let driver = {
        let (closed, reason, rtt, answered) = (
            closed.clone(),
            reason.clone(),
            rtt.clone(),
            answered.clone(),
        );
        async move {
            let why = tokio::select! {
                r = conn => match r { Ok(()) => "connection ended".to_owned(), Err(e) => e.to_string() },
                why = keepalive(ping, settings.keepalive, rtt, answered) => why,
                _ = closed.cancelled() => String::new(),
            };
            let mut r = reason
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if r.is_empty() {
                *r = why;
            }
            drop(r);
            closed.cancel();
        }
    };
    tokio::spawn(driver);
    Ok(H2Opener {
        send,
        closed,
        reason,
        rtt,
        answered,
        kind,
    })
}

/// The hub's handle on an HTTP/2 tunnel.
pub struct H2Opener {
    send: client::SendRequest<Bytes>,
    closed: CancellationToken,
    reason: Arc<Mutex<String>>,
    rtt: Arc<Mutex<Option<Duration>>>,
    /// Keepalives the agent answered.
    answered: Arc<AtomicU64>,
    kind: TransportKind,
}

impl std::fmt::Debug for H2Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H2Opener")
            .field("closed", &self.closed.is_cancelled())
            .finish()
    }
}

impl Opener for H2Opener {
    fn open(&self) -> BoxFuture<'_, Result<TunnelStream>> {
        Box::pin(async move {
            if self.closed.is_cancelled() {
                return Err(TunnelError::Closed(self.reason()));
            }
            let mut send = self.send.clone().ready().await?;
            let request = http::Request::post("/")
                .body(())
                .expect("static request is valid");
            let (response, stream) = send.send_request(request, false)?;
            Ok(TunnelStream {
                send: Box::new(H2Send::open(stream)),
                recv: reader(RecvState::Waiting(response)),
                sent_before: None,
                fin_with_request: None,
                stopped: None,
            })
        })
    }

    fn closed(&self) -> BoxFuture<'static, String> {
        let (closed, reason) = (self.closed.clone(), self.reason.clone());
        Box::pin(async move {
            closed.cancelled().await;
            reason
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
        })
    }

    fn close(&self, why: &str) {
        let mut r = self
            .reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if r.is_empty() {
            *r = why.to_owned();
        }
        drop(r);
        self.closed.cancel();
    }

    fn rtt(&self) -> Option<Duration> {
        *self
            .rtt
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn heard(&self) -> Option<u64> {
        Some(self.answered.load(Ordering::Relaxed))
    }

    fn kind(&self) -> TransportKind {
        self.kind
    }
}

impl H2Opener {
    fn reason(&self) -> String {
        self.reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// Accepts agents' TLS connections that negotiated [`ALPN`] and hands each,
/// with its verified client certificate, to `out`. Each handshake runs in
/// its own task with a timeout, so one slow client blocks nobody.
pub async fn accept_loop(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    settings: H2Settings,
    out: mpsc::Sender<Accepted>,
    shutdown: CancellationToken,
) {
    let pacer = crate::pace::Pacer::unlimited();
    accept_loop_paced(listener, tls, settings, out, None, shutdown, pacer).await;
}

/// Like [`accept_loop`], setting up at most what `pacer` allows at once;
/// the others get the pacer's hint after the TLS handshake (a refusal line
/// instead of the HTTP/2 preface, or a 503 to the WebSocket upgrade).
///
/// Before the client certificate is verified a connection holds only a
/// place among the pacer's pending handshakes ([`crate::handshakes`]): one
/// refused there is closed at once, one evicted for a newcomer is dropped.
///
/// Connections that negotiated [`LINK_ALPN`] go to `links`, unpaced (a
/// renewal is one short call, and the hub paces Register itself); without
/// `links`, or when it is full, they are closed and the agent renews on
/// the API port.
pub async fn accept_loop_paced(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    settings: H2Settings,
    out: mpsc::Sender<Accepted>,
    links: Option<mpsc::Sender<LinkConn>>,
    shutdown: CancellationToken,
    pacer: Arc<crate::pace::Pacer>,
) {
    let acceptor = TlsAcceptor::from(tls);
    let handshakes = pacer.handshakes().clone();
    loop {
        let (tcp, remote) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    tracing::warn!(error = %e, "tunnel accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => return,
        };
        let began = std::time::Instant::now();
        let place = tokio::select! {
            p = handshakes.begin(remote.ip()) => p,
            _ = shutdown.cancelled() => return,
        };
        let Some(place) = place else {
            tracing::debug!(%remote, "tunnel connection refused: its source holds too many handshakes");
            continue;
        };
        let (acceptor, links, pacer) = (acceptor.clone(), links.clone(), pacer.clone());
        let evicted = place.evicted();
        let handshake = async move {
            let _ = tcp.set_nodelay(true);
            // Not dropped for a newcomer while its bytes wait for the hub.
            let tcp = place.watch(tcp);
            let mut tls = acceptor.accept(tcp).await?;
            // The listener requires a client certificate, so a finished
            // handshake is a verified agent: it leaves the pending set
            // and is paced like any agent from here on.
            place.verified();
            let (_, conn) = tls.get_ref();
            let peer_cert = conn.peer_certificates().and_then(|c| c.first()).cloned();
            if conn.alpn_protocol() == Some(LINK_ALPN) {
                let link = LinkConn {
                    io: Box::new(tls),
                    peer_cert,
                    remote,
                };
                if links.is_none_or(|l| l.try_send(link).is_err()) {
                    tracing::debug!(%remote, "link connection on the tunnel port closed: not served here or too many at once");
                }
                return Ok(None);
            }
            let ws = conn.alpn_protocol() == Some(crate::ws::ALPN);
            let admission = match pacer.try_enter() {
                Ok(a) => a,
                Err(after) if ws => {
                    crate::ws::refuse(Box::new(tls), after).await;
                    return Ok(None);
                }
                Err(after) => {
                    use tokio::io::AsyncWriteExt;
                    let line = format!("{}\n", crate::pace::reason(after));
                    let _ = tls
                        .write_all(&[crate::pace::H2_REFUSED, line.as_bytes()].concat())
                        .await;
                    let _ = tls.shutdown().await;
                    return Ok(None);
                }
            };
            // The same port serves HTTP/2 directly and HTTP/2 inside a
            // WebSocket; ALPN tells them apart.
            let (_, conn) = tls.get_ref();
            let (opener, transport) = match conn.alpn_protocol() {
                Some(p) if p == ALPN => (
                    hub_handshake(Box::new(tls), settings).await?,
                    TransportKind::H2,
                ),
                Some(p) if p == crate::ws::ALPN => {
                    let ws = crate::ws::accept(Box::new(tls)).await?;
                    let opener =
                        hub_handshake_as(Box::new(ws), settings, TransportKind::Ws).await?;
                    (opener, TransportKind::Ws)
                }
                _ => {
                    return Err(TunnelError::protocol(
                        "client did not negotiate a tunnel ALPN",
                    ));
                }
            };
            Ok::<_, TunnelError>(Some(Accepted {
                opener: Arc::new(opener),
                peer_cert,
                remote,
                transport,
                admission: Some(admission),
                began,
            }))
        };
        crate::handshakes::spawn(
            TransportKind::H2,
            remote,
            evicted,
            HANDSHAKE_TIMEOUT,
            out.clone(),
            shutdown.clone(),
            handshake,
        );
    }
}

// -------------------------------------------------------------- agent side

/// Dials the hub, verifies it with `tls` and serves HTTP/2 on the result.
pub async fn dial(
    addr: SocketAddr,
    server_name: rustls::pki_types::ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
    settings: H2Settings,
) -> Result<H2Acceptor> {
    let connect = async {
        let tcp = TcpStream::connect(addr).await?;
        let _ = tcp.set_nodelay(true);
        dial_tcp(Box::new(tcp), server_name, tls, settings).await
    };
    tokio::time::timeout(settings.connect_timeout, connect)
        .await
        .map_err(|_| TunnelError::Timeout("TLS tunnel handshake"))?
}

/// Like [`dial`], over a connection already open (through a proxy).
pub async fn dial_tcp(
    tcp: Box<dyn Io>,
    server_name: rustls::pki_types::ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
    settings: H2Settings,
) -> Result<H2Acceptor> {
    let connect = async {
        let tls = TlsConnector::from(tls).connect(server_name, tcp).await?;
        if tls.get_ref().1.alpn_protocol() != Some(ALPN) {
            return Err(TunnelError::protocol(
                "hub did not negotiate the tunnel ALPN",
            ));
        }
        agent_handshake(Box::new(tls), settings).await
    };
    tokio::time::timeout(settings.connect_timeout, connect)
        .await
        .map_err(|_| TunnelError::Timeout("TLS tunnel handshake"))?
}

/// Runs the HTTP/2 server on a connection to the hub.
pub async fn agent_handshake(io: Box<dyn Io>, settings: H2Settings) -> Result<H2Acceptor> {
    agent_handshake_as(io, settings, TransportKind::H2).await
}

/// Like [`agent_handshake`], on a byte stream of another transport.
pub async fn agent_handshake_as(
    io: Box<dyn Io>,
    settings: H2Settings,
    kind: TransportKind,
) -> Result<H2Acceptor> {
    let io = admitted(io).await?;
    // No count of the resets we answer with: see `hub_handshake_as`.
    let mut conn = server::Builder::new()
        .initial_window_size(settings.stream_window)
        .initial_connection_window_size(settings.connection_window)
        .max_frame_size(settings.max_frame_size)
        .max_concurrent_streams(settings.max_streams)
        .max_send_buffer_size(settings.stream_window as usize)
        .max_header_list_size(64 * 1024)
        .max_local_error_reset_streams(None)
        .handshake::<_, Bytes>(io)
        .await?;
    let dead = CancellationToken::new();
    let reason = Arc::new(Mutex::new(String::new()));
    let rtt = Arc::new(Mutex::new(None));
    if let Some(ping) = conn.ping_pong() {
        let (dead, reason, rtt) = (dead.clone(), reason.clone(), rtt.clone());
        tokio::spawn(async move {
            let why = tokio::select! {
                why = keepalive(Some(ping), settings.keepalive, rtt, Default::default()) => why,
                _ = dead.cancelled() => return,
            };
            *reason
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = why;
            dead.cancel();
        });
    }
    Ok(H2Acceptor {
        conn,
        dead,
        reason,
        rtt,
        kind,
    })
}

/// Length of the HTTP/2 client preface, which starts every admitted tunnel.
const PREFACE_LEN: usize = 24;

/// Reads what the hub sends first: the HTTP/2 preface (admitted; handed
/// back to be read again by HTTP/2) or a paced refusal with its hint.
async fn admitted(mut io: Box<dyn Io>) -> Result<Box<dyn Io>> {
    use tokio::io::AsyncReadExt;
    let mut head = vec![0u8; PREFACE_LEN];
    io.read_exact(&mut head).await?;
    if !head.starts_with(crate::pace::H2_REFUSED) {
        return Ok(Box::new(Rewound {
            head: Bytes::from(head),
            io,
        }));
    }
    // The rest of the refusal line, bounded.
    let mut line = head[crate::pace::H2_REFUSED.len()..].to_vec();
    let mut byte = [0u8; 1];
    while !line.ends_with(b"\n") && line.len() < 128 {
        if io.read(&mut byte).await? == 0 {
            break;
        }
        line.push(byte[0]);
    }
    let hint = crate::pace::parse_reason(&String::from_utf8_lossy(&line))
        .ok_or_else(|| TunnelError::protocol("malformed refusal from the hub"))?;
    Err(TunnelError::Refused { retry_after: hint })
}

/// A byte stream with bytes already read put back in front.
struct Rewound {
    head: Bytes,
    io: Box<dyn Io>,
}

impl AsyncRead for Rewound {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.head.is_empty() {
            let n = self.head.len().min(out.remaining());
            out.put_slice(&self.head.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, out)
    }
}

impl AsyncWrite for Rewound {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    // h2 writes a DATA frame's head and payload as two buffers: over a
    // stream without vectored writes it copies a frame's first KiB behind
    // its head and writes the rest apart, and TLS seals each write as a
    // record of its own, so an answer of a few KiB left the agent in two
    // records and two system calls. Passed through, they leave as one.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The agent's side of an HTTP/2 tunnel. Polling [`Acceptor::accept`] also
/// drives the connection, so the agent keeps calling it.
pub struct H2Acceptor {
    conn: server::Connection<Box<dyn Io>, Bytes>,
    dead: CancellationToken,
    reason: Arc<Mutex<String>>,
    rtt: Arc<Mutex<Option<Duration>>>,
    kind: TransportKind,
}

impl std::fmt::Debug for H2Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("H2Acceptor")
    }
}

impl Drop for H2Acceptor {
    fn drop(&mut self) {
        // Stops the keepalive task.
        self.dead.cancel();
    }
}

impl Acceptor for H2Acceptor {
    fn accept(&mut self) -> BoxFuture<'_, Result<Option<TunnelStream>>> {
        Box::pin(async move {
            let next = tokio::select! {
                n = self.conn.accept() => n,
                _ = self.dead.cancelled() => {
                    let why = self.reason.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
                    return Err(TunnelError::Closed(why));
                }
            };
            let (request, respond) = match next {
                None => return Ok(None),
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(pair)) => pair,
            };
            // The response's HEADERS wait for its first bytes, so they
            // leave in one write: sent here, they went out alone and woke
            // the hub's call for nothing, a write and a wake-up more per
            // call. A stream the peer reset before it is answered fails
            // its first write, which ends the stream, not the connection.
            Ok(Some(TunnelStream {
                send: Box::new(H2Send::unanswered(respond)),
                recv: reader(RecvState::Ready(request.into_body())),
                sent_before: None,
                fin_with_request: None,
                stopped: None,
            }))
        })
    }

    fn rtt(&self) -> Option<Duration> {
        *self
            .rtt
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn kind(&self) -> TransportKind {
        self.kind
    }
}

// ------------------------------------------------------------------ shared

/// Pings every interval; returns why the connection is dead: a ping
/// unanswered for [`Keepalive::timeout`]. That is QUIC's rule too (its idle
/// timer restarts with the first keepalive sent after the peer was last
/// heard), so a silent path is dropped after the same time on every
/// transport: three intervals after the first unanswered keepalive.
async fn keepalive(
    ping: Option<h2::PingPong>,
    ka: Keepalive,
    rtt: Arc<Mutex<Option<Duration>>>,
    answered: Arc<AtomicU64>,
) -> String {
    let Some(mut ping) = ping else {
        return std::future::pending().await;
    };
    let mut tick = tokio::time::interval(ka.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let start = Instant::now();
        // One ping at a time (h2 allows no more): an answer is awaited up
        // to the timeout, past the next tick if need be.
        match tokio::time::timeout(ka.timeout, ping.ping(h2::Ping::opaque())).await {
            Ok(Ok(_)) => {
                *rtt.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(start.elapsed());
                answered.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Err(e)) => return format!("keepalive ping failed: {e}"),
            Err(_) => {
                return format!(
                    "no answer to a keepalive within {:?} (one every {:?})",
                    ka.timeout, ka.interval
                );
            }
        }
    }
}

fn h2_io_error(e: h2::Error) -> io::Error {
    if e.is_io() {
        e.into_io()
            .unwrap_or_else(|| io::Error::other("h2 I/O error"))
    } else {
        io::Error::new(io::ErrorKind::ConnectionReset, e)
    }
}

/// Write half of an HTTP/2 stream as `AsyncWrite`.
struct H2Send {
    /// The agent's side before its first byte: the response is not sent
    /// yet (see [`H2Acceptor::accept`]).
    respond: Option<server::SendResponse<Bytes>>,
    stream: Option<SendStream<Bytes>>,
    /// The last bytes written, not handed to h2 until the next write, a
    /// flush or the end: written and then ended, they leave as one DATA
    /// frame carrying END_STREAM (h2 writes a frame after a large one in a
    /// write of its own, so a separate empty END_STREAM cost a write).
    held: Option<Bytes>,
    /// END_STREAM went out. The stream is kept: dropped early, h2 could
    /// reset a stream whose other half still reads.
    ended: bool,
}

impl H2Send {
    fn open(stream: SendStream<Bytes>) -> Self {
        Self {
            respond: None,
            stream: Some(stream),
            held: None,
            ended: false,
        }
    }

    fn unanswered(respond: server::SendResponse<Bytes>) -> Self {
        Self {
            respond: Some(respond),
            stream: None,
            held: None,
            ended: false,
        }
    }

    /// The stream to write on, answering the request first where that is
    /// still to do (with `end`, the answer ends the stream at once).
    fn stream(&mut self, end: bool) -> io::Result<&mut SendStream<Bytes>> {
        if let Some(mut respond) = self.respond.take() {
            let stream = respond
                .send_response(http::Response::new(()), end)
                .map_err(h2_io_error)?;
            self.stream = Some(stream);
            self.ended = end;
        }
        self.stream
            .as_mut()
            .ok_or_else(|| io::ErrorKind::BrokenPipe.into())
    }

    /// Hands the held bytes to h2, with END_STREAM if `end`.
    fn send_held(&mut self, end: bool) -> io::Result<()> {
        let data = self.held.take().unwrap_or_default();
        if data.is_empty() && !end {
            return Ok(());
        }
        self.stream(false)?
            .send_data(data, end)
            .map_err(h2_io_error)?;
        self.ended = end;
        Ok(())
    }
}

impl AsyncWrite for H2Send {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if self.ended {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        self.send_held(false)?;
        let stream = self.stream(false)?;
        stream.reserve_capacity(buf.len());
        loop {
            match ready!(stream.poll_capacity(cx)) {
                None => return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
                Some(Err(e)) => return Poll::Ready(Err(h2_io_error(e))),
                Some(Ok(0)) => continue,
                Some(Ok(n)) => {
                    // The capacity stays reserved for the held bytes.
                    let n = n.min(buf.len());
                    self.held = Some(Bytes::copy_from_slice(&buf[..n]));
                    return Poll::Ready(Ok(n));
                }
            }
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // h2 sends as soon as the connection task runs.
        Poll::Ready(self.send_held(false))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.ended {
            return Poll::Ready(Ok(()));
        }
        if self.respond.is_some() {
            // An answer without a byte: its HEADERS end the stream.
            self.stream(true)?;
            return Poll::Ready(Ok(()));
        }
        Poll::Ready(self.send_held(true))
    }
}

enum RecvState {
    Waiting(client::ResponseFuture),
    Ready(RecvStream),
}

/// The read half of an HTTP/2 stream as bytes. Each DATA frame's window
/// capacity is released as the frame is taken, and the reader holds at
/// most one frame, so the peer can never have more than the stream window
/// in flight to us.
fn reader(mut state: RecvState) -> Box<dyn AsyncRead + Send + Unpin> {
    let frames = futures::stream::poll_fn(move |cx| {
        loop {
            match &mut state {
                RecvState::Waiting(response) => {
                    let response = ready!(Pin::new(response).poll(cx)).map_err(h2_io_error)?;
                    state = RecvState::Ready(response.into_body());
                }
                RecvState::Ready(stream) => {
                    return match ready!(stream.poll_data(cx)) {
                        None => Poll::Ready(None),
                        Some(Err(e)) => Poll::Ready(Some(Err(h2_io_error(e)))),
                        Some(Ok(data)) => {
                            let _ = stream.flow_control().release_capacity(data.len());
                            Poll::Ready(Some(Ok::<_, io::Error>(data)))
                        }
                    };
                }
            }
        }
    });
    Box::new(tokio_util::io::StreamReader::new(frames))
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tokio::io::AsyncWriteExt;

    use super::*;

    /// A connection that takes vectored writes and notes the length of
    /// each write it is given.
    struct Noted(Arc<Mutex<Vec<usize>>>);

    impl AsyncRead for Noted {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for Noted {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.0.lock().unwrap().push(buf.len());
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_write_vectored(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            let n = bufs.iter().map(|b| b.len()).sum();
            self.0.lock().unwrap().push(n);
            Poll::Ready(Ok(n))
        }
        fn is_write_vectored(&self) -> bool {
            true
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// The agent's connection after the hub's preface was read: a DATA
    /// frame's head and payload (two buffers) reach TLS in one write, so
    /// they are sealed as one record and sent in one system call.
    #[tokio::test]
    async fn a_connection_with_its_first_bytes_put_back_keeps_vectored_writes() {
        let noted = Arc::new(Mutex::new(Vec::new()));
        let mut io = Rewound {
            head: Bytes::from_static(b"PRI * HTTP/2.0"),
            io: Box::new(Noted(noted.clone())),
        };
        assert!(io.is_write_vectored());
        let (head, payload) = ([0u8; 9], [1u8; 3000]);
        let bufs = [io::IoSlice::new(&head), io::IoSlice::new(&payload)];
        let n = io.write_vectored(&bufs).await.unwrap();
        assert_eq!(n, 3009, "both buffers taken at once");
        assert_eq!(*noted.lock().unwrap(), [3009], "one write");
    }
}
