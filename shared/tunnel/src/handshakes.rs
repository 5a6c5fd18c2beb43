//! Handshakes in progress on the tunnel port, bounded before anyone is
//! authenticated.
//!
//! Until its TLS (or QUIC) handshake has verified a client certificate, a
//! connection is anyone's: it holds a descriptor and a little memory and
//! may never send another byte. So it takes no tunnel admission slot (see
//! [`crate::pace`]); it takes a place among the pending handshakes, and
//! those are bounded three ways:
//!
//! - **a deadline** per handshake (the listeners' `HANDSHAKE_TIMEOUT`);
//! - **a fair share per source**: once half the places are taken, a source
//!   address (an IPv6 /64) holding more than its share is refused at once,
//!   so one machine can never hold more than half;
//! - **eviction of the oldest**: when every place is taken, the oldest
//!   handshake is dropped if it is waiting for its peer and has been
//!   pending longer than a genuine agent needs
//!   ([`HandshakeLimits::evict_after`]), or comes from a source holding
//!   more than half its share, so many sources stalling on purpose cannot
//!   keep an agent out for the whole deadline. A connection whose next move is the hub's
//!   (its bytes came and wait for a busy CPU) is never dropped: that work
//!   would be lost, and its agent would come back for more. When no
//!   pending handshake may go (a real reconnect storm), new connections
//!   wait in the kernel's backlog instead. Whose move it is, is known
//!   where the connection's reads are [`watched`](Handshake::watch); a
//!   QUIC handshake's is the hub's while datagrams wait unread at its
//!   socket ([`waits_on`](Handshake::waits_on)): in a reconnect storm an
//!   agent's next flight waits there, seconds behind the others'. A
//!   connection neither watched nor waiting on a socket counts as waiting
//!   for its peer.
//!
//! A handshake leaves the pending set as soon as the client certificate is
//! verified; from then on the agent is paced by admission as before.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Bounds of the pending handshakes of one hub's tunnel port.
#[derive(Debug, Clone, Copy)]
pub struct HandshakeLimits {
    /// Handshakes in progress at once, all sources together.
    pub max_pending: usize,
    /// What one source may hold once half of `max_pending` is taken.
    pub per_source: usize,
    /// Age past which a pending handshake may be dropped for a newcomer.
    /// A genuine agent's handshake takes a few round trips; a loaded hub
    /// (a reconnect storm on two cores) has been seen to take about a
    /// second.
    pub evict_after: Duration,
}

impl Default for HandshakeLimits {
    fn default() -> Self {
        Self {
            max_pending: 1024,
            per_source: 32,
            evict_after: Duration::from_secs(2),
        }
    }
}

/// The pending handshakes of a tunnel port (TCP and QUIC share one set).
#[derive(Debug)]
pub struct Handshakes {
    limits: HandshakeLimits,
    state: Mutex<State>,
    freed: Notify,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    /// By id, so the first is the oldest.
    pending: BTreeMap<u64, Pending>,
    by_source: HashMap<IpAddr, usize>,
    /// Sources holding more than `heavy` places: while there are none,
    /// only age can make a victim, and the scan for one stops at the
    /// first young handshake (the map is in age order).
    heavy_sources: usize,
    /// Half a source's share, the holding past which it is heavy.
    heavy: usize,
    refused: u64,
    evicted: u64,
}

#[derive(Debug)]
struct Pending {
    started: Instant,
    source: IpAddr,
    evict: CancellationToken,
    /// Set while the hub owes the connection its next move.
    hubs_move: Arc<AtomicBool>,
    /// `hubs_move` is a socket's, shared by every QUIC handshake
    /// ([`Handshake::waits_on`]).
    on_socket: bool,
}

/// What a new connection gets.
#[derive(Debug)]
pub enum Verdict {
    /// Go ahead; the place frees when this is dropped or verified.
    Go(Handshake),
    /// Its source holds more than its share: close it now.
    Refused,
    /// Every place is taken by young handshakes: try again shortly.
    Full,
}

/// A place among the pending handshakes.
#[derive(Debug)]
pub struct Handshake {
    gate: Arc<Handshakes>,
    id: u64,
    evict: CancellationToken,
    hubs_move: Arc<AtomicBool>,
}

impl Handshake {
    /// `io` with its reads watched: from its accept until a read finds no
    /// bytes waiting, and again whenever bytes come, the next move is the
    /// hub's and this handshake is not dropped for a newcomer.
    pub fn watch<S>(&self, io: S) -> Watched<S> {
        self.hubs_move.store(true, Ordering::Relaxed);
        Watched {
            io,
            hubs_move: self.hubs_move.clone(),
        }
    }

    /// For a QUIC handshake, whose datagrams share the hub's socket with
    /// every other connection's and cannot be told apart before they are
    /// read: its next move is taken to be the hub's while that socket has
    /// datagrams waiting (see [`crate::udp::Unread`]), as a TCP
    /// connection's is while bytes wait on it.
    pub fn waits_on(mut self, socket: &crate::udp::Unread) -> Self {
        self.hubs_move = socket.flag();
        if let Some(p) = self.gate.lock().pending.get_mut(&self.id) {
            p.hubs_move = self.hubs_move.clone();
            p.on_socket = true;
        }
        self
    }

    /// Cancelled when this handshake is dropped for a newcomer: the
    /// connection should be closed then.
    pub fn evicted(&self) -> CancellationToken {
        self.evict.clone()
    }

    /// The client certificate was verified: the place frees for the next
    /// connection and this one can no longer be evicted.
    pub fn verified(self) {}
}

/// The part of a tunnel accept loop every transport shares: runs
/// `handshake` (TLS or QUIC, then admission) on a task of its own, bounded
/// by `limit`, dropped when a newer one evicts it (`evicted`, from its
/// [`Handshake`]) or the hub shuts down. An admitted tunnel goes to `out`;
/// `Ok(None)` is a connection told to come back later or handed elsewhere.
pub fn spawn<F>(
    transport: crate::TransportKind,
    remote: std::net::SocketAddr,
    evicted: CancellationToken,
    limit: Duration,
    out: tokio::sync::mpsc::Sender<crate::transport::Accepted>,
    shutdown: CancellationToken,
    handshake: F,
) where
    F: std::future::Future<Output = crate::Result<Option<crate::transport::Accepted>>>
        + Send
        + 'static,
{
    tokio::spawn(async move {
        let accepted = tokio::select! {
            r = tokio::time::timeout(limit, handshake) => r,
            _ = evicted.cancelled() => {
                return tracing::debug!(%remote, %transport, "tunnel handshake dropped for a newer one");
            }
            _ = shutdown.cancelled() => return,
        };
        match accepted {
            Ok(Ok(Some(a))) => {
                let _ = out.send(a).await;
            }
            Ok(Ok(None)) => tracing::debug!(
                %remote,
                %transport,
                "no tunnel: paced (told to retry later) or a link connection handed on"
            ),
            // Closed before a first byte: a port check (an agent's, a load
            // balancer's), not a refusal worth a line per connection.
            Ok(Err(crate::TunnelError::Io(e))) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                tracing::debug!(%remote, %transport, "tunnel connection closed before its handshake")
            }
            Ok(Err(e)) => {
                tracing::info!(%remote, %transport, error = %e, "tunnel handshake refused")
            }
            Err(_) => tracing::info!(%remote, %transport, "tunnel handshake timed out"),
        }
    });
}

impl Drop for Handshake {
    fn drop(&mut self) {
        self.gate.release(self.id);
    }
}

/// A connection whose reads tell its [`Handshake`] whose move it is (see
/// [`Handshake::watch`]). Writes pass through.
#[derive(Debug)]
pub struct Watched<S> {
    io: S,
    hubs_move: Arc<AtomicBool>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        // Bytes (or an end) mean the hub has work; nothing waiting means
        // the peer has the move.
        this.hubs_move.store(r.is_ready(), Ordering::Relaxed);
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The key a source is counted under: an IPv4 address, or an IPv6 /64
/// (one host can use all of its /64).
pub fn source_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut seg = v6.segments();
                seg[4..].fill(0);
                IpAddr::V6(seg.into())
            }
        },
    }
}

impl Handshakes {
    pub fn new(limits: HandshakeLimits) -> Arc<Handshakes> {
        let limits = HandshakeLimits {
            max_pending: limits.max_pending.max(2),
            per_source: limits.per_source.max(1),
            ..limits
        };
        Arc::new(Handshakes {
            limits,
            state: Mutex::new(State {
                heavy: limits.per_source / 2,
                ..State::default()
            }),
            freed: Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for a handshake from `source`, decided at once.
    pub fn try_begin(self: &Arc<Self>, source: IpAddr) -> Verdict {
        let source = source_key(source);
        let mut s = self.lock();
        let held = s.by_source.get(&source).copied().unwrap_or(0);
        if held >= self.limits.per_source && s.pending.len() >= self.limits.max_pending / 2 {
            s.refused += 1;
            return Verdict::Refused;
        }
        if s.pending.len() >= self.limits.max_pending {
            // The oldest whose peer has the move and that is old enough,
            // or (at any age) comes from a source holding more than half
            // its share: a few sources flooding on purpose make room for
            // anyone else at once, while a storm of genuine agents (one or
            // two handshakes a source) waits its turn.
            // One clock read for the whole scan: in a storm every place is
            // taken and every new connection scans.
            let now = Instant::now();
            let evict_after = self.limits.evict_after;
            let any_heavy = s.heavy_sources > 0;
            let victim = s
                .pending
                .iter()
                .take_while(|(_, p)| any_heavy || now.duration_since(p.started) >= evict_after)
                .find(|(_, p)| {
                    let heavy = || s.by_source.get(&p.source).is_some_and(|n| *n > s.heavy);
                    if p.hubs_move.load(Ordering::Relaxed) {
                        // A socket with datagrams waiting does not shelter
                        // a heavy source: a flood of junk could keep it so.
                        p.on_socket && heavy()
                    } else {
                        now.duration_since(p.started) >= evict_after || heavy()
                    }
                })
                .map(|(id, _)| *id);
            let Some(id) = victim else {
                return Verdict::Full;
            };
            let gone = s.remove(id).expect("the victim is pending");
            gone.evict.cancel();
            s.evicted += 1;
        }
        let id = s.next_id;
        s.next_id += 1;
        let evict = CancellationToken::new();
        let hubs_move = Arc::new(AtomicBool::new(false));
        s.pending.insert(
            id,
            Pending {
                started: Instant::now(),
                source,
                evict: evict.clone(),
                hubs_move: hubs_move.clone(),
                on_socket: false,
            },
        );
        let heavy = s.heavy;
        let held = s.by_source.entry(source).or_default();
        *held += 1;
        if *held == heavy + 1 {
            s.heavy_sources += 1;
        }
        Verdict::Go(Handshake {
            gate: self.clone(),
            id,
            evict,
            hubs_move,
        })
    }

    /// Like [`Self::try_begin`], waiting while every place is taken by
    /// young handshakes (the caller stops accepting meanwhile, so new
    /// connections wait in the kernel's backlog). `None`: refused.
    pub async fn begin(self: &Arc<Self>, source: IpAddr) -> Option<Handshake> {
        loop {
            match self.try_begin(source) {
                Verdict::Go(h) => return Some(h),
                Verdict::Refused => return None,
                // A place frees, or the oldest grows old enough to evict.
                Verdict::Full => {
                    let _ = tokio::time::timeout(Duration::from_millis(100), self.freed.notified())
                        .await;
                }
            }
        }
    }

    fn release(&self, id: u64) {
        if self.lock().remove(id).is_some() {
            self.freed.notify_one();
        }
    }

    /// Handshakes pending now.
    pub fn pending(&self) -> usize {
        self.lock().pending.len()
    }

    /// Connections refused for holding more than their source's share.
    pub fn refused(&self) -> u64 {
        self.lock().refused
    }

    /// Handshakes dropped to make room for a newcomer.
    pub fn evicted(&self) -> u64 {
        self.lock().evicted
    }

    /// Whether handshakes are queueing up: QUIC then makes unvalidated
    /// sources prove their address (Retry) before it spends a handshake.
    pub fn busy(&self) -> bool {
        self.pending() >= self.limits.max_pending / 8
    }

    pub fn limits(&self) -> HandshakeLimits {
        self.limits
    }
}

impl State {
    fn remove(&mut self, id: u64) -> Option<Pending> {
        let gone = self.pending.remove(&id)?;
        if let Some(n) = self.by_source.get_mut(&gone.source) {
            if *n == self.heavy + 1 {
                self.heavy_sources -= 1;
            }
            *n -= 1;
            if *n == 0 {
                self.by_source.remove(&gone.source);
            }
        }
        Some(gone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn go(v: Verdict) -> Handshake {
        match v {
            Verdict::Go(h) => h,
            other => panic!("expected a place, got {other:?}"),
        }
    }

    #[test]
    fn a_source_over_its_share_is_refused_only_under_pressure() {
        let gate = Handshakes::new(HandshakeLimits {
            max_pending: 8,
            per_source: 2,
            evict_after: Duration::from_secs(60),
        });
        // Below half the places, one source may hold more than its share.
        let held: Vec<_> = (0..4).map(|_| go(gate.try_begin(ip("10.0.0.1")))).collect();
        assert!(matches!(gate.try_begin(ip("10.0.0.1")), Verdict::Refused));
        // Others still get in, up to the total.
        let others: Vec<_> = (0..2)
            .map(|i| go(gate.try_begin(ip(&format!("10.0.1.{i}")))))
            .collect();
        // The same /64 counts as one source.
        let _v6 = go(gate.try_begin(ip("2001:db8::1")));
        assert!(matches!(gate.try_begin(ip("2001:db8::2")), Verdict::Go(_)));
        assert_eq!(gate.pending(), 7);
        assert_eq!(gate.refused(), 1);
        drop(held);
        drop(others);
        assert_eq!(gate.pending(), 1);
    }

    #[test]
    fn when_full_the_oldest_is_evicted_once_old_enough() {
        let gate = Handshakes::new(HandshakeLimits {
            max_pending: 2,
            per_source: 8,
            evict_after: Duration::from_millis(30),
        });
        let a = go(gate.try_begin(ip("10.0.0.1")));
        let b = go(gate.try_begin(ip("10.0.0.2")));
        assert!(matches!(gate.try_begin(ip("10.0.0.3")), Verdict::Full));
        std::thread::sleep(Duration::from_millis(40));
        let evicted = a.evicted();
        let c = go(gate.try_begin(ip("10.0.0.3")));
        assert!(evicted.is_cancelled());
        assert!(!b.evicted().is_cancelled());
        assert_eq!((gate.pending(), gate.evicted()), (2, 1));
        // Dropping the evicted handshake later frees nothing twice.
        drop(a);
        assert_eq!(gate.pending(), 2);
        c.verified();
        drop(b);
        assert_eq!(gate.pending(), 0);
    }

    #[tokio::test]
    async fn a_handshake_waiting_for_the_hub_is_not_dropped() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let gate = Handshakes::new(HandshakeLimits {
            max_pending: 2,
            per_source: 8,
            evict_after: Duration::ZERO,
        });
        let a = go(gate.try_begin(ip("10.0.0.1")));
        let b = go(gate.try_begin(ip("10.0.0.2")));
        // Accepted and not read yet: the hub's move, for both.
        let (a_io, mut a_peer) = tokio::io::duplex(64);
        let (b_io, _b_peer) = tokio::io::duplex(64);
        let mut a_io = a.watch(a_io);
        let _b_io = b.watch(b_io);
        assert!(matches!(gate.try_begin(ip("10.0.0.3")), Verdict::Full));
        // Bytes came and were read: still the hub's move.
        a_peer.write_all(b"hello").await.unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(a_io.read(&mut buf).await.unwrap(), 5);
        assert!(matches!(gate.try_begin(ip("10.0.0.3")), Verdict::Full));
        // A read finds nothing: the peer's move, and `a` may go.
        let nothing = tokio::time::timeout(Duration::from_millis(10), a_io.read(&mut buf)).await;
        assert!(nothing.is_err());
        let _c = go(gate.try_begin(ip("10.0.0.3")));
        assert!(a.evicted().is_cancelled());
        assert!(!b.evicted().is_cancelled());
        assert_eq!(gate.evicted(), 1);
    }

    /// A QUIC handshake is not dropped while datagrams wait unread at the
    /// hub's socket (its agent's next flight may be among them), and may
    /// be once a read finds none. Real datagrams on a loopback socket.
    #[tokio::test]
    async fn a_quic_handshake_is_not_dropped_while_datagrams_wait_at_its_socket() {
        use std::{io::IoSliceMut, task::Poll};
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = socket.local_addr().unwrap();
        let unread = crate::udp::Unread::default();
        let socket = crate::udp::wrap(socket, unread.clone()).unwrap();
        let gate = Handshakes::new(HandshakeLimits {
            max_pending: 2,
            per_source: 8,
            evict_after: Duration::ZERO,
        });
        let quic = go(gate.try_begin(ip("10.0.0.1"))).waits_on(&unread);
        let tcp = go(gate.try_begin(ip("10.0.0.2")));
        let _tcp_io = tcp.watch(tokio::io::empty());

        let peer = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        for _ in 0..8 {
            peer.send_to(b"flight", to).unwrap();
        }
        let mut storage = [[0u8; 64]; 2];
        let mut meta = [quinn::udp::RecvMeta::default(); 2];
        let mut read = |cx: &mut std::task::Context<'_>| {
            let [a, b] = &mut storage;
            let mut bufs = [IoSliceMut::new(a), IoSliceMut::new(b)];
            socket.poll_recv(cx, &mut bufs, &mut meta)
        };
        // A read that fills both buffers: more wait behind them.
        let first = tokio::time::timeout(Duration::from_secs(5), std::future::poll_fn(&mut read))
            .await
            .expect("the datagrams arrive");
        assert_eq!(first.unwrap(), 2);
        assert!(unread.waiting());
        assert!(matches!(gate.try_begin(ip("10.0.0.3")), Verdict::Full));
        assert_eq!(gate.evicted(), 0);
        // Read until none is left: the peer's move, and the QUIC one goes.
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut reads = 0;
        while let Poll::Ready(r) = read(&mut cx) {
            r.unwrap();
            reads += 1;
            assert!(reads < 8, "the socket never ran dry");
        }
        assert!(!unread.waiting());
        let _newcomer = go(gate.try_begin(ip("10.0.0.3")));
        assert!(quic.evicted().is_cancelled());
        assert!(!tcp.evicted().is_cancelled());
        assert_eq!(gate.evicted(), 1);
    }

    /// A busy socket does not shelter a source holding more than half its
    /// share: a junk flood could keep the socket busy for ever.
    #[test]
    fn a_busy_socket_does_not_shelter_a_heavy_source() {
        let gate = Handshakes::new(HandshakeLimits {
            max_pending: 4,
            per_source: 4,
            evict_after: Duration::from_secs(60),
        });
        let busy = crate::udp::Unread::default();
        busy.flag().store(true, Ordering::Relaxed);
        let light = go(gate.try_begin(ip("10.0.0.1"))).waits_on(&busy);
        let heavy: Vec<_> = (0..3)
            .map(|_| go(gate.try_begin(ip("10.0.0.2"))).waits_on(&busy))
            .collect();
        let _newcomer = go(gate.try_begin(ip("10.0.0.3")));
        assert!(heavy[0].evicted().is_cancelled());
        assert!(!light.evicted().is_cancelled());
    }

    #[test]
    fn a_source_over_half_its_share_makes_room_at_once() {
        let gate = Handshakes::new(HandshakeLimits {
            max_pending: 4,
            per_source: 4,
            evict_after: Duration::from_secs(60),
        });
        let light = go(gate.try_begin(ip("10.0.0.1")));
        let heavy: Vec<_> = (0..3).map(|_| go(gate.try_begin(ip("10.0.0.2")))).collect();
        // Young, but their source holds 3 of a share of 4: its oldest goes.
        let _newcomer = go(gate.try_begin(ip("10.0.0.3")));
        assert!(heavy[0].evicted().is_cancelled());
        assert!(!light.evicted().is_cancelled());
        // Holding 2 (half) is no longer more than half: the next waits.
        assert!(matches!(gate.try_begin(ip("10.0.0.4")), Verdict::Full));
        assert_eq!(gate.evicted(), 1);
    }

    #[test]
    fn a_source_back_under_half_its_share_is_light_again() {
        let gate = Handshakes::new(HandshakeLimits {
            max_pending: 4,
            per_source: 4,
            evict_after: Duration::from_secs(60),
        });
        let mut heavy: Vec<_> = (0..3).map(|_| go(gate.try_begin(ip("10.0.0.2")))).collect();
        // It lets one go itself: holding 2 of 4 is no longer heavy, so
        // none of its young handshakes is a victim any more.
        drop(heavy.pop());
        let light: Vec<_> = (1..=2)
            .map(|i| go(gate.try_begin(ip(&format!("10.0.1.{i}")))))
            .collect();
        assert!(matches!(gate.try_begin(ip("10.0.0.3")), Verdict::Full));
        // Heavy again: its oldest goes at once.
        drop(light);
        heavy.push(go(gate.try_begin(ip("10.0.0.2"))));
        let _l = go(gate.try_begin(ip("10.0.1.1")));
        let _newcomer = go(gate.try_begin(ip("10.0.0.3")));
        assert!(heavy[0].evicted().is_cancelled());
        assert_eq!(gate.evicted(), 1);
    }

    #[tokio::test]
    async fn begin_waits_for_a_place() {
        let gate = Handshakes::new(HandshakeLimits {
            max_pending: 2,
            per_source: 8,
            evict_after: Duration::from_secs(60),
        });
        let a = go(gate.try_begin(ip("10.0.0.1")));
        let _b = go(gate.try_begin(ip("10.0.0.2")));
        let waiter = tokio::spawn({
            let gate = gate.clone();
            async move { gate.begin(ip("10.0.0.3")).await.is_some() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        drop(a);
        assert!(waiter.await.unwrap());
    }
}
