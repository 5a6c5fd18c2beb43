//! QUIC (quinn): each tunnel stream is one QUIC bidirectional stream, so
//! calls are independent down to packet loss: a lost packet of one call does
//! not hold up another.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use quinn::{
    Endpoint, TransportConfig, VarInt,
    crypto::rustls::{QuicClientConfig, QuicServerConfig},
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{
    Result, TunnelError,
    transport::{Accepted, Acceptor, BoxFuture, Keepalive, Opener, TransportKind, TunnelStream},
    udp::Unread,
};

/// ALPN protocol of this transport.
pub const ALPN: &[u8] = b"otter-tunnel-quic";

/// Bounds a QUIC handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Flow-control and concurrency settings.
#[derive(Debug, Clone, Copy)]
pub struct QuicSettings {
    /// Per-stream receive window.
    pub stream_window: u32,
    /// Connection receive window, shared by all streams.
    pub connection_window: u32,
    /// Streams the agent accepts at once (the hub bounds itself lower).
    pub max_streams: u32,
    pub keepalive: Keepalive,
    /// Bound of the agent's dial (where UDP is dropped, this is how long
    /// it takes to give up on QUIC and fall back).
    pub connect_timeout: Duration,
}

/// A stream's window covers the bandwidth-delay product of a distant link
/// more than twice over, because a lost packet holds the window's start
/// until its copy arrives, a round trip or more later: over a 100 ms,
/// 100 Mbit/s link one port-forward stream moved 8.8 MB/s with no loss,
/// 4.6 at 1 % and 3.4 at 5 % with 1 MiB; 11.6 / 8.3 / 6.2 with 2 MiB; and
/// 11.7 / 11.3 / 9.9 with 4 MiB (the link's 12.5 at most). The windows
/// are limits, not buffers: a stream holds that much only while its reader
/// stalls. The connection's is four streams' worth, so a few stalled
/// readers do not hold up a tunnel's other calls. The cost is over
/// loopback, where a bulk stream now keeps more in flight: small calls
/// beside it waited about twice as long at p99, as did calls that bypass
/// the tunnel altogether on the same two cores.
impl Default for QuicSettings {
    fn default() -> Self {
        Self {
            stream_window: 4 * 1024 * 1024,
            connection_window: 16 * 1024 * 1024,
            max_streams: 1024,
            keepalive: Keepalive::default(),
            connect_timeout: HANDSHAKE_TIMEOUT,
        }
    }
}

/// How long a stopping hub lets its QUIC close frames leave.
const CLOSE_FLUSH: Duration = Duration::from_millis(250);

/// Ceiling of the path MTU search, and the largest UDP payload either end
/// accepts: what a 9,000-byte jumbo frame carries over IPv6. quinn's
/// default (1,452) fits an Ethernet MTU; where the path carries more
/// (jumbo frames, loopback, a hub beside its agents) larger datagrams cost
/// less CPU per byte: over loopback, 1,452 moved 11.1 Gbit/s, 6,500 19.5.
/// Where the path carries less, the search settles lower after a few lost
/// probes, and a probe larger than the local interface's MTU is refused
/// by the kernel, never sent. A batch of datagrams larger than one send
/// takes is split (see `udp`). Higher would be faster still over loopback
/// only, and every tunnel keeps a send buffer of one probe's size: an
/// idle tunnel's memory grows by about what the ceiling does.
pub const MTU_CEILING: u16 = 8952;
const MAX_UDP_PAYLOAD: u16 = MTU_CEILING;

pub fn transport_config(s: &QuicSettings) -> TransportConfig {
    let mut t = TransportConfig::default();
    t.max_concurrent_bidi_streams(VarInt::from_u32(s.max_streams))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .stream_receive_window(VarInt::from_u32(s.stream_window))
        .receive_window(VarInt::from_u32(s.connection_window))
        .send_window(u64::from(s.connection_window))
        .keep_alive_interval(Some(s.keepalive.interval))
        .congestion_controller_factory(Arc::new(crate::congestion::SteadyBbrConfig::default()));
    if let Ok(idle) = s.keepalive.timeout.try_into() {
        t.max_idle_timeout(Some(idle));
    }
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(MTU_CEILING);
    t.mtu_discovery_config(Some(mtu));
    let mut acks = quinn::AckFrequencyConfig::default();
    acks.ack_eliciting_threshold(VarInt::from_u32(ACK_ELICITING_THRESHOLD))
        .max_ack_delay(Some(ACK_DELAY_BOUND));
    t.ack_frequency_config(Some(acks));
    t
}

/// Packets that need an acknowledgement a peer may receive before it must
/// acknowledge them at once (asked of the peer with QUIC's ACK frequency
/// extension, which quinn speaks on both ends), and how long it may hold
/// back an acknowledgement below that count. quinn's default (at once
/// after every second packet) took five UDP sends for a unary call: the
/// request, the agent's bare acknowledgement, the answer, the hub's bare
/// acknowledgement and the reset that ends the stream. Held back, each
/// acknowledgement rides on the next packet the other way, and the call
/// takes three. The 1 ms bound keeps a sender whose window is full from
/// waiting for the acknowledgements it needs: with quinn's 25 ms, small
/// calls on a tunnel carrying a bulk stream waited 27 ms at p99 where
/// those on a tunnel beside it waited 9-14.
const ACK_ELICITING_THRESHOLD: u32 = 3;
const ACK_DELAY_BOUND: Duration = Duration::from_millis(1);

/// Kernel buffer asked for each way of a QUIC socket.
const SOCKET_BUFFER: usize = 4 * 1024 * 1024;

/// Gives a QUIC socket room for a burst: `recv` bytes to receive into,
/// [`SOCKET_BUFFER`] to send from. The kernel's default (about
/// 208 KiB) holds a fraction of a millisecond at loopback speed, or a
/// hundred-odd handshakes: a receiver that falls behind for longer drops
/// datagrams and the sender resends them (at 10 Gbit/s over loopback,
/// 3.5 % of the hub's packets were lost this way; with 4 MiB, a few at
/// start). The kernel caps the size at its `rmem_max`/`wmem_max`; a
/// smaller buffer than asked for is no error.
fn size_buffers(socket: &std::net::UdpSocket, recv: usize) {
    let s = socket2::SockRef::from(socket);
    let _ = s.set_recv_buffer_size(recv);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER);
}

/// Receive buffer of the hub's QUIC socket, which every agent's packets
/// share: when its thousands of agents redial at once (a restart), the
/// first flight of each arrives together, faster than two cores take it
/// in. At [`SOCKET_BUFFER`] the kernel dropped 1,558-11,368 datagrams in
/// a graceful restart of 10,000 agents (eleven runs), and an agent whose
/// Initial is dropped waits a second or more for its retransmission. At
/// 32 MiB a storm dropped none, but a first connect of 10,000 still
/// dropped 5,600-8,800: each agent then searches its path MTU, and its
/// probes of up to 8,952 bytes take that much more room while they wait.
/// At 64 MiB it dropped none and took 23.6-23.7 s against 27.3-30.3 (the
/// hub's CPU 22.0-22.2 s against 22.3-24.8), alternating; 128 MiB did no
/// better. The kernel charges the buffer only for datagrams waiting in it.
const HUB_RECV_BUFFER: usize = 64 * 1024 * 1024;

/// The hub's socket: as [`size_buffers`], with a receive buffer of
/// [`HUB_RECV_BUFFER`] as far as the kernel's `rmem_max` allows, and past it
/// where the hub may (`CAP_NET_ADMIN`). Short of it, the hub says so once at
/// start: a fleet of a few thousand QUIC agents needs `rmem_max` raised on
/// the hub's nodes (it is a node-wide setting, not a pod's).
fn size_hub_buffers(socket: &std::net::UdpSocket) {
    size_buffers(socket, HUB_RECV_BUFFER);
    let s = socket2::SockRef::from(socket);
    #[cfg(target_os = "linux")]
    let _ = nix::sys::socket::setsockopt(
        socket,
        nix::sys::socket::sockopt::RcvBufForce,
        &HUB_RECV_BUFFER,
    );
    // Linux reports twice the size asked for (its bookkeeping share).
    let granted = s.recv_buffer_size().unwrap_or(0) / 2;
    if granted < HUB_RECV_BUFFER {
        tracing::info!(
            granted_bytes = granted,
            wanted_bytes = HUB_RECV_BUFFER,
            "the QUIC socket's receive buffer is smaller than wanted: when many agents reconnect at once their first packets may be dropped and they wait for retransmissions (raise net.core.rmem_max on the hub's nodes)"
        );
    }
}

/// Datagrams the kernel dropped for want of room in the receive buffers of
/// this network namespace's UDP sockets bound to `port` (the last column
/// of /proc/net/udp and udp6), since those sockets were made; `None` where
/// there is no such table or no such socket.
pub fn kernel_drops(port: u16) -> Option<u64> {
    let mut found = None;
    for table in ["/proc/net/udp", "/proc/net/udp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local = fields.get(1).and_then(|a| a.rsplit(':').next());
            if local.and_then(|p| u16::from_str_radix(p, 16).ok()) != Some(port) {
                continue;
            }
            let drops: u64 = fields.last()?.parse().ok()?;
            *found.get_or_insert(0) += drops;
        }
    }
    found
}

/// The hub's side: like [`transport_config`], but accepting no streams.
/// The agent opens none, and quinn sets aside state for every stream a
/// peer may open (1,024 would be most of an idle tunnel's memory).
pub fn hub_transport_config(s: &QuicSettings) -> TransportConfig {
    let mut t = transport_config(s);
    t.max_concurrent_bidi_streams(VarInt::from_u32(0));
    t
}

fn quic_tls_error(e: impl std::fmt::Display) -> TunnelError {
    TunnelError::Tls(format!("QUIC needs TLS 1.3 with AES-128-GCM: {e}"))
}

// ---------------------------------------------------------------- hub side

/// Binds the hub's QUIC endpoint with a secret of its own (see
/// [`hub_endpoint_on`]). `tls` must offer [`ALPN`].
pub fn hub_endpoint(
    addr: SocketAddr,
    tls: rustls::ServerConfig,
    settings: &QuicSettings,
) -> Result<HubEndpoint> {
    let mut secret = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret)
        .map_err(|_| TunnelError::protocol("no randomness for the QUIC reset key"))?;
    hub_endpoint_on(std::net::UdpSocket::bind(addr)?, tls, settings, &secret)
}

/// The hub's QUIC endpoint on `socket`, keyed by `secret`. `tls` must offer
/// [`ALPN`].
///
/// After a crash, agents' packets for their old connections reach the
/// restarted hub. It answers them with a stateless reset, which an agent
/// recognises (and reconnects at once, instead of waiting out its keepalive
/// timeout) only if the reset token comes from the same key as before; and
/// quinn answers only packets whose connection ID it recognises as one it
/// issued, checked with a second key. A hub that keeps `secret` across
/// restarts gets both.
pub fn hub_endpoint_on(
    socket: std::net::UdpSocket,
    tls: rustls::ServerConfig,
    settings: &QuicSettings,
    secret: &[u8],
) -> Result<HubEndpoint> {
    size_hub_buffers(&socket);
    let crypto = QuicServerConfig::try_from(tls).map_err(quic_tls_error)?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    // The agent is the QUIC client but opens no streams of its own.
    server.transport_config(Arc::new(hub_transport_config(settings)));
    // Connection attempts not yet taken by the accept loop: quinn's
    // defaults (65,536 of them, 100 MiB of early packets) are sized for a
    // web server; a hub's agents retry, so a few thousand and 8 MiB do.
    server
        .max_incoming(4096)
        .incoming_buffer_size(64 * 1024)
        .incoming_buffer_size_total(8 * 1024 * 1024);
    let reset_key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let tag = ring::hmac::sign(&reset_key, b"otter-link quic connection ids");
    let cid_key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, tag.as_ref());
    let mut config = quinn::EndpointConfig::new(Arc::new(reset_key));
    // Agents may send datagrams up to the search's ceiling: a Watch, logs
    // or a port-forward's download from a cluster moves in jumbo datagrams
    // where the path carries them (over loopback a bulk Watch ran at
    // 9.5-11.8 Gbit/s against 7.5 in Ethernet-sized ones). An agent
    // searches its path toward a hub host once and starts every later
    // tunnel there ([`PathMtus`]): when every agent searched after each
    // connect, a reconnect storm of 10,000 doubled the hub's CPU.
    config
        .max_udp_payload_size(MAX_UDP_PAYLOAD)
        .map_err(|e| TunnelError::protocol(format!("QUIC endpoint: {e}")))?;
    config.cid_generator(move || {
        Box::new(KeyedCids {
            key: cid_key.clone(),
            drawn: 0,
        })
    });
    // quinn sends at most one reset per interval (20 ms by default), and
    // reads the clock once per pass over the socket, so any interval lets
    // one reset out of a whole batch of received datagrams: after a crash
    // under 10,000 agents most keepalives drew none, and half the QUIC
    // agents noticed only after two to four keepalives (up to the idle
    // timeout). No interval is needed: a reset is always smaller than the
    // packet that drew it, so it cannot amplify, and quinn answers only
    // connection IDs that carry this hub's keyed hash.
    config.min_reset_interval(Duration::ZERO);
    let unread = Unread::default();
    let endpoint = Endpoint::new_with_abstract_socket(
        config,
        Some(server),
        crate::udp::wrap(socket, unread.clone())?,
        Arc::new(quinn::TokioRuntime),
    )?;
    Ok(HubEndpoint { endpoint, unread })
}

/// The hub's QUIC endpoint, with what its socket tells of the datagrams
/// waiting to be read (the accept loop's handshakes go by it).
#[derive(Clone, Debug)]
pub struct HubEndpoint {
    endpoint: Endpoint,
    unread: Unread,
}

impl std::ops::Deref for HubEndpoint {
    type Target = Endpoint;

    fn deref(&self) -> &Endpoint {
        &self.endpoint
    }
}

/// Random part of a connection ID the hub issues, and the keyed hash of it
/// that follows.
const CID_NONCE: usize = 6;
const CID_TAG: usize = 6;

/// The hub's connection IDs: a random nonce and its keyed hash, so the hub
/// recognises the IDs it issued (and answers only those with a stateless
/// reset) across restarts.
///
/// quinn's own keyed generator draws 3 random bytes: 16.7 million IDs.
/// With 10,000 tunnels holding a few IDs each, the ID of a Retry (which
/// quinn does not check against the IDs in use) matched a live
/// connection's 15 times in 13,309 Retries of one bench run; the agent's
/// next Initial then went to that connection, which could not read it,
/// and so did every resend: the attempt hung until the agent's 10 s bound,
/// and the last agents of a reconnect storm came back 7 s after the
/// others. Six random bytes make a match about a million times rarer.
struct KeyedCids {
    key: ring::hmac::Key,
    /// IDs made without the system's randomness.
    drawn: u64,
}

impl KeyedCids {
    fn tag(&self, nonce: &[u8]) -> ring::hmac::Tag {
        ring::hmac::sign(&self.key, nonce)
    }
}

impl quinn_proto::ConnectionIdGenerator for KeyedCids {
    fn generate_cid(&mut self) -> quinn_proto::ConnectionId {
        let mut id = [0u8; CID_NONCE + CID_TAG];
        // The system's randomness fails only on a broken kernel, and quinn
        // leaves no way to report it; a count still gives distinct IDs
        // (quinn draws again while an ID is taken: a fixed one would spin).
        if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut id[..CID_NONCE])
            .is_err()
        {
            self.drawn = self.drawn.wrapping_add(1);
            id[..CID_NONCE].copy_from_slice(&self.drawn.to_le_bytes()[..CID_NONCE]);
        }
        let tag = self.tag(&id[..CID_NONCE]);
        id[CID_NONCE..].copy_from_slice(&tag.as_ref()[..CID_TAG]);
        quinn_proto::ConnectionId::new(&id)
    }

    fn validate(
        &self,
        cid: &quinn_proto::ConnectionId,
    ) -> std::result::Result<(), quinn_proto::InvalidCid> {
        if cid.len() != CID_NONCE + CID_TAG {
            return Err(quinn_proto::InvalidCid);
        }
        let tag = self.tag(&cid[..CID_NONCE]);
        if tag.as_ref()[..CID_TAG] == cid[CID_NONCE..] {
            Ok(())
        } else {
            Err(quinn_proto::InvalidCid)
        }
    }

    fn cid_len(&self) -> usize {
        CID_NONCE + CID_TAG
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

/// Accepts QUIC connections and hands each, with its verified client
/// certificate, to `out`.
pub async fn accept_loop(
    endpoint: HubEndpoint,
    out: mpsc::Sender<Accepted>,
    shutdown: CancellationToken,
) {
    let wait = place_wait(&QuicSettings::default());
    accept_loop_paced(
        endpoint,
        out,
        shutdown,
        crate::pace::Pacer::unlimited(),
        wait,
    )
    .await;
}

/// Like [`accept_loop`], setting up at most what `pacer` allows at once;
/// the others are closed after the handshake with the pacer's hint
/// ([`crate::pace::QUIC_REFUSED`]).
///
/// Before the client certificate is verified a connection attempt holds
/// only a place among the pacer's pending handshakes
/// ([`crate::handshakes`]). While handshakes queue up, a source that has
/// not proved its address is sent a Retry first (stateless: it costs the
/// hub nothing), so spoofed Initial packets cannot take places, nor wait
/// for one when all are taken, which an attempt does for up to
/// `place_wait` (see [`place_wait`]).
pub async fn accept_loop_paced(
    endpoint: HubEndpoint,
    out: mpsc::Sender<Accepted>,
    shutdown: CancellationToken,
    pacer: Arc<crate::pace::Pacer>,
    place_wait: Duration,
) {
    let handshakes = pacer.handshakes().clone();
    loop {
        let incoming = tokio::select! {
            i = endpoint.accept() => match i { Some(i) => i, None => return },
            _ = shutdown.cancelled() => {
                endpoint.close(VarInt::from_u32(0), b"hub shutting down");
                // Long enough for the close frames to leave. Waiting until
                // closed connections have drained (three probe timeouts,
                // seconds under load) would hold up a graceful restart;
                // the process ends before that, and a hub restarted in the
                // same process waits for the port when it binds.
                let _ = tokio::time::timeout(CLOSE_FLUSH, endpoint.wait_idle()).await;
                return;
            }
        };
        let remote = incoming.remote_address();
        let began = std::time::Instant::now();
        if handshakes.busy() && !incoming.remote_address_validated() && incoming.may_retry() {
            let _ = incoming.retry();
            continue;
        }
        let attempt = Attempt {
            incoming,
            unread: endpoint.unread.clone(),
            pacer: pacer.clone(),
            out: out.clone(),
            shutdown: shutdown.clone(),
            began,
        };
        match handshakes.try_begin(remote.ip()) {
            crate::handshakes::Verdict::Go(place) => attempt.start(place),
            crate::handshakes::Verdict::Refused => attempt.incoming.refuse(),
            // Every place is taken (a reconnect storm): the attempt waits
            // for one, as a TCP connection waits in the kernel's backlog,
            // in a task of its own so the loop goes on taking packets.
            // Refused at once, each agent would count a failed round and
            // back off for ever longer: in a storm of 10,000 the last QUIC
            // agents came back 10 s after the HTTP/2 ones. quinn holds at
            // most `max_incoming` waiting attempts, and the agent's own
            // retransmissions join the one it has.
            crate::handshakes::Verdict::Full => {
                let handshakes = handshakes.clone();
                tokio::spawn(async move {
                    let waited = std::time::Instant::now();
                    let place = tokio::select! {
                        p = tokio::time::timeout(place_wait, handshakes.begin(remote.ip())) => p.ok().flatten(),
                        _ = attempt.shutdown.cancelled() => None,
                    };
                    tracing::debug!(%remote, waited_ms = waited.elapsed().as_millis() as u64, placed = place.is_some(), "QUIC attempt waited for a handshake place");
                    match place {
                        Some(place) => attempt.start(place),
                        None => attempt.incoming.refuse(),
                    }
                });
            }
        }
    }
}

/// How long a QUIC attempt waits for a place among the pending handshakes
/// before it is refused: half the agent's dial bound, so the handshake
/// still fits in the other half.
const WAIT_FOR_PLACE: Duration = Duration::from_secs(5);

/// [`WAIT_FOR_PLACE`], or less when the idle timeout of `settings` is
/// short: quinn abandons, without a word to the agent, an attempt accepted
/// an idle timeout after its first packet, and the agent then waits for
/// its next retransmission (seconds). The agent hears nothing while it
/// waits either, so its own idle timeout (three keepalives, 15 s by
/// default) bounds the wait from its side.
pub fn place_wait(settings: &QuicSettings) -> Duration {
    WAIT_FOR_PLACE.min(settings.keepalive.timeout / 2)
}

/// A connection attempt the accept loop took, with what its handshake needs
/// once it has a place among the pending handshakes.
struct Attempt {
    incoming: quinn::Incoming,
    /// The hub socket's datagrams waiting: whose move the handshake's is.
    unread: Unread,
    pacer: Arc<crate::pace::Pacer>,
    out: mpsc::Sender<Accepted>,
    shutdown: CancellationToken,
    began: std::time::Instant,
}

impl Attempt {
    fn start(self, place: crate::handshakes::Handshake) {
        handshake(
            self.incoming,
            place.waits_on(&self.unread),
            self.pacer,
            self.out,
            self.shutdown,
            self.began,
        );
    }
}

/// Runs the handshake of `incoming`, which holds `place`, and admits the
/// verified agent as `pacer` allows.
fn handshake(
    incoming: quinn::Incoming,
    place: crate::handshakes::Handshake,
    pacer: Arc<crate::pace::Pacer>,
    out: mpsc::Sender<Accepted>,
    shutdown: CancellationToken,
    began: std::time::Instant,
) {
    let remote = incoming.remote_address();
    let evicted = place.evicted();
    let handshake = async move {
        let conn = incoming.await?;
        // The endpoint requires a client certificate: the agent is
        // verified, and paced like any agent from here on.
        place.verified();
        let admission = match pacer.try_enter() {
            Ok(a) => a,
            Err(after) => {
                // Only an established connection can carry a reason.
                conn.close(
                    VarInt::from_u32(crate::pace::QUIC_REFUSED),
                    crate::pace::reason(after).as_bytes(),
                );
                return Ok(None);
            }
        };
        let peer_cert = conn
            .peer_identity()
            .and_then(|any| {
                any.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                    .ok()
            })
            .and_then(|certs| certs.first().cloned());
        Ok::<_, TunnelError>(Some(Accepted {
            opener: Arc::new(QuicOpener {
                conn,
                fin_with_request: Arc::default(),
            }),
            peer_cert,
            remote,
            transport: TransportKind::Quic,
            admission: Some(admission),
            began,
        }))
    };
    crate::handshakes::spawn(
        TransportKind::Quic,
        remote,
        evicted,
        HANDSHAKE_TIMEOUT,
        out,
        shutdown,
        handshake,
    );
}

/// The hub's handle on a QUIC tunnel.
#[derive(Debug)]
pub struct QuicOpener {
    conn: quinn::Connection,
    /// Whether the agent takes a request's FIN with the request (see
    /// [`TunnelStream`]): learnt from its answers, shared by the streams.
    fin_with_request: Arc<AtomicBool>,
}

impl Opener for QuicOpener {
    fn open(&self) -> BoxFuture<'_, Result<TunnelStream>> {
        Box::pin(async move {
            let (send, recv) = self.conn.open_bi().await?;
            let sent_before = Arc::new(AtomicU64::new(0));
            Ok(TunnelStream {
                send: Box::new(Prioritized::request(send, sent_before.clone())),
                recv: Box::new(recv),
                sent_before: Some(sent_before),
                fin_with_request: Some(self.fin_with_request.clone()),
                stopped: None,
            })
        })
    }

    fn closed(&self) -> BoxFuture<'static, String> {
        let conn = self.conn.clone();
        Box::pin(async move { conn.closed().await.to_string() })
    }

    fn close(&self, reason: &str) {
        self.conn.close(VarInt::from_u32(0), reason.as_bytes());
    }

    fn rtt(&self) -> Option<Duration> {
        Some(self.conn.rtt())
    }

    fn heard(&self) -> Option<u64> {
        // Both ends send a keepalive every interval, so a live agent's
        // datagrams (its pings, its acknowledgements of the hub's) keep
        // coming however idle the tunnel.
        Some(self.conn.stats().udp_rx.datagrams)
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Quic
    }

    fn packets(&self) -> Option<crate::PathCounts> {
        Some(path_counts(&self.conn))
    }
}

/// One end's counts of its path.
fn path_counts(conn: &quinn::Connection) -> crate::PathCounts {
    counts_of(&conn.stats())
}

fn counts_of(stats: &quinn::ConnectionStats) -> crate::PathCounts {
    crate::PathCounts {
        sent: stats.path.sent_packets,
        lost: stats.path.lost_packets,
        received: stats.udp_rx.datagrams,
        mtu: stats.path.current_mtu,
        mtu_probes: stats.path.sent_plpmtud_probes,
        resets_sent: stats.frame_tx.reset_stream + stats.frame_tx.stop_sending,
        resets_received: stats.frame_rx.reset_stream + stats.frame_rx.stop_sending,
        refused: 0,
    }
}

// -------------------------------------------------------------- agent side

/// Dials the hub over QUIC from an endpoint of its own (see [`Dialer`]),
/// verifying it with `tls` (which must offer [`ALPN`]).
pub async fn dial(
    addr: SocketAddr,
    server_name: &str,
    tls: rustls::ClientConfig,
    settings: &QuicSettings,
) -> Result<QuicAcceptor> {
    Dialer::default()
        .dial(addr, server_name, tls, settings)
        .await
}

/// An agent's QUIC endpoints (one per address family), bound on first use
/// and kept for every later dial.
///
/// quinn gives each endpoint a receive buffer sized for its largest batch
/// of coalesced datagrams, megabytes even with [`MAX_UDP_PAYLOAD`]. Binding
/// a fresh endpoint per dial made every reconnect allocate (and, once the
/// allocator stops handing such blocks straight from the kernel, touch)
/// that much again; one endpoint for the agent's life pays it once.
///
/// Each endpoint's socket also counts the datagrams the hub's host refused
/// ([`crate::udp::Refusals`]): a dial to a port where nothing listens fails
/// at once, as a TCP connect does, and a tunnel's counts show a hub whose
/// process is gone one keepalive after its last word, where silence alone
/// shows it later.
///
/// It also keeps the path MTU each hub host's tunnels reached ([`PathMtus`]).
#[derive(Debug, Default)]
pub struct Dialer {
    endpoints: std::sync::Mutex<[Option<Endpoint>; 2]>,
    refusals: [Arc<crate::udp::Refusals>; 2],
    mtus: Arc<PathMtus>,
}

/// The largest datagram that got through to each hub host, as the agent's
/// tunnels there found it, so a tunnel dialled again starts at that size
/// instead of searching up from 1,200 bytes. The search costs the hub a
/// handful of probes to decrypt and acknowledge per tunnel; after a
/// restart, every agent's at once.
///
/// Keyed by IP address (the path is the host's, whatever the port, so the
/// replicas of a hub behind one address share it); at most [`MTUS_KEPT`]
/// hosts, the oldest forgotten first. A tunnel whose path turned out to
/// carry less (quinn detected a black hole) and a dial that started at the
/// kept size and timed out forget their host's size: the next dial
/// searches again.
#[derive(Debug, Default)]
struct PathMtus(std::sync::Mutex<Vec<(std::net::IpAddr, u16)>>);

/// Hub hosts whose path MTU an agent keeps.
const MTUS_KEPT: usize = 16;

/// quinn's first datagram size, and the least any path carries.
const BASE_MTU: u16 = 1200;

impl PathMtus {
    fn kept(&self) -> std::sync::MutexGuard<'_, Vec<(std::net::IpAddr, u16)>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn get(&self, host: std::net::IpAddr) -> Option<u16> {
        let kept = self.kept();
        kept.iter().find(|(h, _)| *h == host).map(|&(_, mtu)| mtu)
    }

    fn forget(&self, host: std::net::IpAddr) {
        let mut kept = self.kept();
        kept.retain(|(h, _)| *h != host);
    }

    /// Keeps what a tunnel to `host` has found so far.
    fn note(&self, host: std::net::IpAddr, path: &quinn::PathStats) {
        if path.black_holes_detected > 0 {
            return self.forget(host);
        }
        if path.current_mtu <= BASE_MTU {
            return;
        }
        let mut kept = self.kept();
        match kept.iter_mut().find(|(h, _)| *h == host) {
            Some(entry) => entry.1 = path.current_mtu,
            None => {
                if kept.len() >= MTUS_KEPT {
                    kept.remove(0);
                }
                kept.push((host, path.current_mtu));
            }
        }
    }
}

impl Dialer {
    /// Dials the hub, verifying it with `tls` (which must offer [`ALPN`]).
    pub async fn dial(
        &self,
        addr: SocketAddr,
        server_name: &str,
        tls: rustls::ClientConfig,
        settings: &QuicSettings,
    ) -> Result<QuicAcceptor> {
        let crypto = QuicClientConfig::try_from(tls).map_err(quic_tls_error)?;
        let mut config = quinn::ClientConfig::new(Arc::new(crypto));
        let mut transport = transport_config(settings);
        let known_mtu = self.mtus.get(addr.ip());
        if let Some(mtu) = known_mtu {
            transport.initial_mtu(mtu.clamp(BASE_MTU, MTU_CEILING));
        }
        config.transport_config(Arc::new(transport));
        let dialled = self.connect(addr, server_name, config, settings).await;
        if known_mtu.is_some() && matches!(dialled, Err(TunnelError::Timeout(_))) {
            // Unanswered: the path may carry less than it did, and the
            // handshake's larger datagrams were lost. Search again next
            // time. (A refusal or a TLS error says nothing of the path.)
            self.mtus.forget(addr.ip());
        }
        dialled
    }

    async fn connect(
        &self,
        addr: SocketAddr,
        server_name: &str,
        config: quinn::ClientConfig,
        settings: &QuicSettings,
    ) -> Result<QuicAcceptor> {
        let refusals = self.refusals[usize::from(addr.is_ipv6())].clone();
        refusals.watch(addr);
        let refused_before = refusals.count(addr);
        let mut endpoint = self.endpoint(addr.is_ipv6(), false)?;
        let connecting = match endpoint.connect_with(config.clone(), addr, server_name) {
            // The endpoint's driver ended (its socket failed): bind anew.
            Err(quinn::ConnectError::EndpointStopping) => {
                endpoint = self.endpoint(addr.is_ipv6(), true)?;
                endpoint.connect_with(config, addr, server_name)?
            }
            other => other?,
        };
        let mut connecting = connecting;
        let handshake = async {
            tokio::select! {
                conn = &mut connecting => Some(conn),
                // The agent's first datagrams come back refused: nothing
                // listens there, and nothing will answer the rest.
                _ = refusals.refused(addr, refused_before) => None,
            }
        };
        let conn = match tokio::time::timeout(settings.connect_timeout, handshake).await {
            Ok(Some(c)) => c?,
            Ok(None) => {
                return Err(TunnelError::Io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    format!(
                        "QUIC: {addr} refused the datagrams (ICMP port unreachable: nothing listens on that UDP port)"
                    ),
                )));
            }
            Err(_) => {
                use futures::FutureExt;
                let answered = connecting.handshake_data().now_or_never().is_some();
                tracing::debug!(local = ?endpoint.local_addr().ok(), remote = %addr, answered, "QUIC handshake timed out");
                return Err(TunnelError::Timeout("QUIC handshake"));
            }
        };
        Ok(QuicAcceptor {
            conn,
            refusals,
            mtus: self.mtus.clone(),
            _endpoint: endpoint,
        })
    }

    /// The endpoint for one address family, bound if there is none yet
    /// (or `rebind`).
    fn endpoint(&self, ipv6: bool, rebind: bool) -> Result<Endpoint> {
        let mut endpoints = self
            .endpoints
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let slot = &mut endpoints[usize::from(ipv6)];
        if let Some(e) = slot.as_ref().filter(|_| !rebind) {
            return Ok(e.clone());
        }
        let bind: SocketAddr = if ipv6 { "[::]:0" } else { "0.0.0.0:0" }
            .parse()
            .expect("static address");
        // quinn sizes an endpoint's receive buffers from the largest
        // datagram it accepts (64 KiB by default) times its batch; the hub
        // sends nothing above the path MTU search's ceiling, and an agent
        // talks to one hub. (Untouched pages of the buffer cost no RSS.)
        let mut endpoint_config = quinn::EndpointConfig::default();
        endpoint_config
            .max_udp_payload_size(MAX_UDP_PAYLOAD)
            .map_err(|e| TunnelError::protocol(format!("QUIC endpoint: {e}")))?;
        let socket = std::net::UdpSocket::bind(bind)?;
        size_buffers(&socket, SOCKET_BUFFER);
        let endpoint = Endpoint::new_with_abstract_socket(
            endpoint_config,
            None,
            crate::udp::wrap_counting_refusals(socket, self.refusals[usize::from(ipv6)].clone())?,
            Arc::new(quinn::TokioRuntime),
        )?;
        *slot = Some(endpoint.clone());
        Ok(endpoint)
    }
}

/// The agent's side of a QUIC tunnel.
#[derive(Debug)]
pub struct QuicAcceptor {
    conn: quinn::Connection,
    /// Refusals counted by the endpoint's socket, the hub's address among
    /// them.
    refusals: Arc<crate::udp::Refusals>,
    /// Where the path MTU this tunnel finds is kept for the next dial.
    mtus: Arc<PathMtus>,
    /// Keeps the endpoint's driver running for this connection (it may be
    /// shared with the agent's other tunnels, so it is not closed here).
    _endpoint: Endpoint,
}

impl Drop for QuicAcceptor {
    fn drop(&mut self) {
        self.mtus
            .note(self.conn.remote_address().ip(), &self.conn.stats().path);
        self.conn
            .close(VarInt::from_u32(0), b"agent closed the tunnel");
    }
}

impl Acceptor for QuicAcceptor {
    fn accept(&mut self) -> BoxFuture<'_, Result<Option<TunnelStream>>> {
        Box::pin(async move {
            match self.conn.accept_bi().await {
                Ok((send, recv)) => {
                    // Made now, while the stream is at hand; polled only
                    // once a request has come with its FIN.
                    let stopped = send.stopped();
                    Ok(Some(TunnelStream {
                        stopped: Some(Box::pin(async move {
                            let _ = stopped.await;
                        })),
                        ..TunnelStream::new(Prioritized::answer(send), recv)
                    }))
                }
                Err(quinn::ConnectionError::LocallyClosed) => Ok(None),
                Err(e) => Err(e.into()),
            }
        })
    }

    fn rtt(&self) -> Option<Duration> {
        Some(self.conn.rtt())
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Quic
    }

    /// Also keeps the path MTU found so far for the next dial (the agent
    /// asks several times a keepalive, so a tunnel dialled beside this
    /// one while it lives starts there too).
    fn packets(&self) -> Option<crate::PathCounts> {
        let stats = self.conn.stats();
        let hub = self.conn.remote_address();
        self.mtus.note(hub.ip(), &stats.path);
        Some(crate::PathCounts {
            refused: self.refusals.count(hub),
            ..counts_of(&stats)
        })
    }
}

/// Bytes a stream sends before it counts as bulk; on the hub's side, also
/// the step by which a request's place falls as it sends more.
const BULK_AFTER: u64 = 256 * 1024;

/// The lowest place a request's bytes fall to (2^30 steps of
/// [`BULK_AFTER`]: 256 TiB sent).
const LOWEST: u64 = 1 << 30;

/// A stream's sending side with its place among the connection's
/// senders (quinn sends a higher priority's data first, and streams of
/// one priority in turn).
///
/// An agent's answer steps back once it has sent [`BULK_AFTER`] bytes, so
/// a small call's answer is not queued behind a bulk transfer's bytes on
/// the same connection (a Get beside a saturating Watch or port-forward).
///
/// A hub's request steps back one place per [`BULK_AFTER`] it has sent,
/// counting what its upload sent before it ([`TunnelStream::continues`]):
/// the request that has sent least goes first. A port-forward's upload
/// path sends a few batches at once, each a stream of its own, and the
/// agent hands each to the pod only after the one before; sent in turn,
/// every batch was only whole when all of them were, and each loss held
/// all of them. In order, with 100 ms and 1 % loss between hub and agent,
/// the upload went from 7.6-9.8 MB/s to 10.4-10.9 (kubectl's, on one
/// stream: 11.0-11.1). Two uploads share the path by what each has sent,
/// so neither waits for the other to end; small requests still go first.
struct Prioritized {
    send: quinn::SendStream,
    written: u64,
    /// A hub's request: its place falls as it sends ...
    request: bool,
    /// ... from what its upload sent before it, read at the first write.
    sent_before: Option<Arc<AtomicU64>>,
    priority: i32,
}

impl Prioritized {
    fn answer(send: quinn::SendStream) -> Self {
        Prioritized {
            send,
            written: 0,
            request: false,
            sent_before: None,
            priority: 0,
        }
    }

    fn request(send: quinn::SendStream, sent_before: Arc<AtomicU64>) -> Self {
        Prioritized {
            request: true,
            sent_before: Some(sent_before),
            ..Self::answer(send)
        }
    }

    /// The place of a stream that has sent `written` bytes.
    fn place(&self, written: u64) -> i32 {
        let steps = match self.request {
            true => (written / BULK_AFTER).min(LOWEST),
            false => u64::from(written >= BULK_AFTER),
        };
        -i32::try_from(steps).unwrap_or(i32::MAX)
    }

    fn take_place(&mut self) {
        let priority = self.place(self.written);
        if priority != self.priority {
            self.priority = priority;
            // Fails only on a stream already closed or reset.
            let _ = self.send.set_priority(priority);
        }
    }
}

impl tokio::io::AsyncWrite for Prioritized {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = &mut *self;
        if let Some(before) = this.sent_before.take() {
            this.written = before.load(Ordering::Relaxed);
            this.take_place();
        }
        let n = std::task::ready!(std::pin::Pin::new(&mut this.send).poll_write(cx, buf))?;
        this.written += n as u64;
        this.take_place();
        std::task::Poll::Ready(Ok(n))
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.send).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.send).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use quinn_proto::{ConnectionId, ConnectionIdGenerator};

    use super::KeyedCids;

    /// The hub's socket takes a storm-sized receive buffer: all of it where
    /// the process may go past `rmem_max`, else as much as `rmem_max` lets.
    #[cfg(target_os = "linux")]
    #[test]
    fn the_hubs_quic_socket_asks_for_a_storm_sized_receive_buffer() {
        use super::{HUB_RECV_BUFFER, size_hub_buffers};
        let bind = || std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let may_force = nix::sys::socket::setsockopt(
            &bind(),
            nix::sys::socket::sockopt::RcvBufForce,
            &HUB_RECV_BUFFER,
        )
        .is_ok();
        let rmem_max: usize = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        let socket = bind();
        size_hub_buffers(&socket);
        let granted = socket2::SockRef::from(&socket)
            .recv_buffer_size()
            .expect("SO_RCVBUF")
            / 2;
        let expected = if may_force {
            HUB_RECV_BUFFER
        } else {
            HUB_RECV_BUFFER.min(rmem_max)
        };
        assert!(
            granted >= expected,
            "granted {granted} bytes, expected at least {expected} (may force: {may_force}, rmem_max {rmem_max})"
        );
    }

    fn keyed(secret: &[u8]) -> KeyedCids {
        KeyedCids {
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret),
            drawn: 0,
        }
    }

    #[test]
    fn the_hub_knows_its_own_connection_ids_and_no_others() {
        let mut ours = keyed(b"this hub");
        let id = ours.generate_cid();
        assert_eq!(id.len(), ours.cid_len());
        assert!(ours.validate(&id).is_ok());
        // The same secret after a restart.
        assert!(keyed(b"this hub").validate(&id).is_ok());
        assert!(keyed(b"another hub").validate(&id).is_err());
        let mut flipped = id.to_vec();
        flipped[0] ^= 1;
        assert!(ours.validate(&ConnectionId::new(&flipped)).is_err());
        assert!(ours.validate(&ConnectionId::new(&id[..8])).is_err());
    }

    /// As many IDs as a hub of 10,000 tunnels holds, and the Retries of a
    /// reconnect storm, without one repeating: quinn's keyed generator
    /// (3 random bytes) repeats about 300 in as many.
    #[test]
    fn connection_ids_do_not_repeat_across_a_fleet() {
        let mut ids = keyed(b"k");
        let mut seen = std::collections::HashSet::new();
        for _ in 0..100_000 {
            assert!(seen.insert(ids.generate_cid()));
        }
    }
}
