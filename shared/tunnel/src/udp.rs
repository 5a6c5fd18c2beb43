//! The UDP socket under a QUIC endpoint: quinn's tokio socket, except that
//! a batch of datagrams larger than the kernel takes in one send goes out
//! as several sends.
//!
//! quinn hands the socket up to 10 datagrams of one size at once, sent
//! with segmentation offload (one system call, the kernel cuts them). The
//! kernel refuses such a batch whole when it exceeds one IP packet's
//! 64 KiB, and quinn counts the refused datagrams as lost. That capped the
//! datagram size at 6,500 bytes: where a path carries more (jumbo frames
//! of 9,000, loopback, a hub beside its agents), a larger datagram carries
//! the same bytes with fewer packets to seal, number and acknowledge.
//!
//! An agent's socket also reads the kernel's reports of datagrams refused
//! on arrival ([`Refusals`]): where a TCP connection to a dead process gets
//! a reset at once, QUIC would otherwise learn only from silence. The
//! hub's tells whether datagrams wait unread ([`Unread`]).

use std::{
    collections::HashMap,
    fmt,
    io::{self, IoSliceMut},
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

use quinn::{AsyncUdpSocket, UdpPoller, udp::RecvMeta, udp::Transmit};

/// The most one send may carry: an IPv4 packet's 65,535 bytes less its
/// IP and UDP headers, rounded down.
const MAX_SEND: usize = 65_000;

/// Wraps quinn's socket for the tokio runtime; its reads tell `unread`
/// whether more datagrams wait.
pub(crate) fn wrap(
    socket: std::net::UdpSocket,
    unread: Unread,
) -> io::Result<Arc<dyn AsyncUdpSocket>> {
    let inner = quinn::Runtime::wrap_udp_socket(&quinn::TokioRuntime, socket)?;
    Ok(Arc::new(Batched {
        inner,
        reports: false,
        unread,
        _reader: None,
    }))
}

/// Whether datagrams wait unread at a socket: set when a read fills every
/// buffer quinn offered (so more are likely queued behind them), cleared
/// when a read finds none.
///
/// In a reconnect storm the hub's socket queues seconds of datagrams
/// behind the handshakes its CPU is busy with (up to 22 MiB of them with
/// 10,000 agents), and an agent's next flight waits there with the rest.
/// Which connection a waiting datagram belongs to is known only once it
/// is read, so while any wait, every QUIC handshake may be owed the hub's
/// move ([`crate::handshakes::Handshake::waits_on`]).
#[derive(Clone, Debug, Default)]
pub struct Unread(Arc<AtomicBool>);

impl Unread {
    /// Whether the last read left datagrams waiting.
    pub fn waiting(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    pub(crate) fn flag(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }

    fn note(&self, read: &Poll<io::Result<usize>>, offered: usize) {
        match read {
            Poll::Ready(Ok(n)) => self.0.store(*n >= offered, Ordering::Relaxed),
            Poll::Pending => self.0.store(false, Ordering::Relaxed),
            Poll::Ready(Err(_)) => {}
        }
    }
}

/// Like [`wrap`], and counts in `refusals` the datagrams to a watched
/// address that came back refused (where the kernel reports them; a socket
/// it cannot ask to is wrapped as by [`wrap`]). Needs a tokio runtime.
pub(crate) fn wrap_counting_refusals(
    socket: std::net::UdpSocket,
    refusals: Arc<Refusals>,
) -> io::Result<Arc<dyn AsyncUdpSocket>> {
    let reader = error_queue::enable(&socket)
        .and_then(|()| socket.try_clone())
        .and_then(|second| read_reports(second, refusals));
    let reader = match reader {
        Ok(stop) => Some(stop),
        Err(e) => {
            tracing::debug!(error = %e, "UDP error reports unavailable: a dead hub is noticed by silence only");
            None
        }
    };
    let inner = quinn::Runtime::wrap_udp_socket(&quinn::TokioRuntime, socket)?;
    Ok(Arc::new(Batched {
        inner,
        reports: reader.is_some(),
        unread: Unread::default(),
        _reader: reader,
    }))
}

/// Datagrams refused by the host they were sent to (ICMP "port
/// unreachable": the host is up, but nothing listens on that port any
/// more, as after its process died), counted per destination the agent
/// dials. Other destinations are not counted, so a forged report names
/// nothing kept here.
#[derive(Debug, Default)]
pub struct Refusals {
    counts: Mutex<HashMap<SocketAddr, u64>>,
    changed: tokio::sync::Notify,
}

/// Destinations counted at once; a dial past it starts the counts anew.
const WATCHED: usize = 16;

impl Refusals {
    /// Counts refusals from `addr` from now on (kept if already counted).
    pub(crate) fn watch(&self, addr: SocketAddr) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if !counts.contains_key(&addr) && counts.len() >= WATCHED {
            counts.clear();
        }
        counts.entry(addr).or_insert(0);
    }

    /// Refusals from `addr` so far (0 for one not watched).
    pub fn count(&self, addr: SocketAddr) -> u64 {
        let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        counts.get(&addr).copied().unwrap_or(0)
    }

    /// Returns once `addr` has refused more than `seen` datagrams.
    pub(crate) async fn refused(&self, addr: SocketAddr, seen: u64) {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            // Registered before the count is read: no report falls between.
            notified.as_mut().enable();
            if self.count(addr) > seen {
                return;
            }
            notified.await;
        }
    }

    fn record(&self, addr: SocketAddr) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = counts.get_mut(&addr) {
            *n += 1;
            drop(counts);
            self.changed.notify_waiters();
        }
    }
}

/// Reports read at once at most before other tasks get a turn.
const DRAIN_MAX: usize = 64;

/// Reads the kernel's error reports of an agent's socket (`socket` is a
/// second descriptor of it) in a task of its own until the returned guard
/// is dropped: each report takes room from the socket's receive buffer
/// until read, and the error it leaves pending would fail quinn's next
/// send (that datagram would be lost) or receive, so it is taken here.
fn read_reports(
    socket: std::net::UdpSocket,
    refusals: Arc<Refusals>,
) -> io::Result<tokio_util::sync::DropGuard> {
    use tokio::io::{Interest, unix::AsyncFd};
    let ipv6 = socket.local_addr()?.is_ipv6();
    socket.set_nonblocking(true)?;
    // Registered for urgent data only, which a UDP socket never has: the
    // kernel then wakes this registration for nothing but errors (always
    // reported), not for every datagram sent or received, as a readable
    // or writable interest would (10-18 % more CPU for 3,000 agents in one
    // process). The constructor is deprecated for inner types whose
    // descriptor could change under it; a `UdpSocket` owns its one.
    #[allow(deprecated)]
    let fd = AsyncFd::with_interest(socket, Interest::PRIORITY)?;
    let stop = tokio_util::sync::CancellationToken::new();
    let guard = stop.clone().drop_guard();
    tokio::spawn(async move {
        loop {
            let mut ready = tokio::select! {
                ready = fd.ready(Interest::ERROR) => match ready {
                    Ok(ready) => ready,
                    Err(_) => return,
                },
                _ = stop.cancelled() => return,
            };
            let _ = fd.get_ref().take_error();
            let mut emptied = false;
            for _ in 0..DRAIN_MAX {
                match error_queue::next(fd.get_ref(), ipv6) {
                    Ok(Some(addr)) => refusals.record(addr),
                    Ok(None) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    // Empty (would block), or unreadable.
                    Err(_) => {
                        emptied = true;
                        break;
                    }
                }
            }
            if emptied {
                // Until the next report (an edge: a new one wakes again).
                ready.clear_ready();
            } else {
                tokio::task::yield_now().await;
            }
        }
    });
    Ok(guard)
}

/// Errors a receive returns once because an ICMP report arrived (the
/// kernel's conversion of each ICMP type): never the socket's own failure.
fn set_by_report(e: &io::Error) -> bool {
    error_queue::SET_BY_REPORT.contains(&e.raw_os_error().unwrap_or(0))
}

#[cfg(target_os = "linux")]
mod error_queue {
    use std::{
        io::{self, IoSliceMut},
        net::SocketAddr,
        os::fd::AsRawFd,
    };

    use nix::{
        errno::Errno,
        libc,
        sys::socket::{
            ControlMessageOwned, MsgFlags, SockaddrIn, SockaddrIn6, SockaddrLike, recvmsg,
            setsockopt, sockopt,
        },
    };

    pub(super) const SET_BY_REPORT: [i32; 10] = [
        libc::ECONNREFUSED,
        libc::EHOSTUNREACH,
        libc::ENETUNREACH,
        libc::EHOSTDOWN,
        libc::ENONET,
        libc::ENOPROTOOPT,
        libc::EMSGSIZE,
        libc::EOPNOTSUPP,
        libc::EPROTO,
        libc::EACCES,
    ];

    /// Asks the kernel to report ICMP errors for an unconnected socket
    /// (without, it reports them only to connected ones).
    pub(super) fn enable(socket: &std::net::UdpSocket) -> io::Result<()> {
        if socket.local_addr()?.is_ipv6() {
            setsockopt(socket, sockopt::Ipv6RecvErr, &true)?;
        } else {
            setsockopt(socket, sockopt::Ipv4RecvErr, &true)?;
        }
        Ok(())
    }

    /// The next report: the destination of a datagram refused as "port
    /// unreachable", `None` for any other report; an error of kind
    /// `WouldBlock` when there is none.
    pub(super) fn next(socket: &std::net::UdpSocket, ipv6: bool) -> io::Result<Option<SocketAddr>> {
        if ipv6 {
            read::<SockaddrIn6>(socket).map(|r| r.map(|a| std::net::SocketAddrV6::from(a).into()))
        } else {
            read::<SockaddrIn>(socket).map(|r| r.map(|a| std::net::SocketAddrV4::from(a).into()))
        }
    }

    fn read<S: SockaddrLike>(socket: &std::net::UdpSocket) -> io::Result<Option<S>> {
        // The refused datagram's payload is not wanted: one byte of it.
        let mut payload = [0u8; 1];
        let mut iov = [IoSliceMut::new(&mut payload)];
        let mut control = [0u8; 256];
        let msg = recvmsg::<S>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut control),
            MsgFlags::MSG_ERRQUEUE | MsgFlags::MSG_DONTWAIT,
        )
        .map_err(|e: Errno| io::Error::from_raw_os_error(e as i32))?;
        let refused = msg
            .cmsgs()
            .map_err(|e: Errno| io::Error::from_raw_os_error(e as i32))?
            .any(|c| match c {
                ControlMessageOwned::Ipv4RecvErr(e, _) => {
                    e.ee_origin == libc::SO_EE_ORIGIN_ICMP
                        && e.ee_errno == libc::ECONNREFUSED as u32
                }
                ControlMessageOwned::Ipv6RecvErr(e, _) => {
                    e.ee_origin == libc::SO_EE_ORIGIN_ICMP6
                        && e.ee_errno == libc::ECONNREFUSED as u32
                }
                _ => false,
            });
        Ok(msg.address.filter(|_| refused))
    }
}

#[cfg(not(target_os = "linux"))]
mod error_queue {
    use std::{io, net::SocketAddr};

    pub(super) const SET_BY_REPORT: [i32; 0] = [];

    pub(super) fn enable(_: &std::net::UdpSocket) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "error queue reports are read on Linux only",
        ))
    }

    pub(super) fn next(_: &std::net::UdpSocket, _: bool) -> io::Result<Option<SocketAddr>> {
        Err(io::ErrorKind::WouldBlock.into())
    }
}

/// quinn's socket, with batches over [`MAX_SEND`] split (and, on an
/// agent's, the error reports read).
struct Batched {
    inner: Arc<dyn AsyncUdpSocket>,
    /// The kernel reports errors to this socket ([`read_reports`]).
    reports: bool,
    /// Whether the last read left datagrams waiting.
    unread: Unread,
    /// Stops the reports' reader with the socket.
    _reader: Option<tokio_util::sync::DropGuard>,
}

impl fmt::Debug for Batched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batched")
            .field("inner", &self.inner)
            .finish()
    }
}

/// The sends `t` goes out in: one, unless it is a batch over [`MAX_SEND`];
/// then as many whole datagrams per send as fit.
fn parts<'a>(t: &'a Transmit<'a>) -> impl Iterator<Item = Transmit<'a>> + 'a {
    let per_send = match t.segment_size {
        Some(size) if t.contents.len() > MAX_SEND && size > 0 => (MAX_SEND / size).max(1) * size,
        _ => t.contents.len().max(1),
    };
    t.contents.chunks(per_send).map(move |contents| Transmit {
        destination: t.destination,
        ecn: t.ecn,
        contents,
        // A last part of one datagram is sent as a plain datagram.
        segment_size: t.segment_size.filter(|s| contents.len() > *s),
        src_ip: t.src_ip,
    })
}

impl AsyncUdpSocket for Batched {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    /// A part refused for want of buffer space fails the whole batch, and
    /// quinn sends it again once the socket is writable: the parts already
    /// sent arrive twice, and the peer drops the copies by packet number.
    /// (With the socket's 4 MiB buffer, this is rare; losing the rest
    /// instead would read as congestion.)
    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        for part in parts(transmit) {
            self.inner.try_send(&part)?;
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let offered = bufs.len().min(meta.len());
        loop {
            let read = self.inner.poll_recv(cx, bufs, meta);
            self.unread.note(&read, offered);
            match read {
                // quinn ends the endpoint on any receive error but a reset:
                // one that only says a report arrived (the reader takes it
                // too, but may come second) is passed over.
                Poll::Ready(Err(e)) if self.reports && set_by_report(&e) => continue,
                other => return other,
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(contents: &[u8], segment: Option<usize>) -> Transmit<'_> {
        Transmit {
            destination: "127.0.0.1:9".parse().expect("static"),
            ecn: None,
            contents,
            segment_size: segment,
            src_ip: None,
        }
    }

    fn sizes(t: &Transmit<'_>) -> Vec<(usize, Option<usize>)> {
        parts(t)
            .map(|p| (p.contents.len(), p.segment_size))
            .collect()
    }

    #[test]
    fn a_batch_the_kernel_takes_goes_out_as_it_came() {
        let bytes = vec![0u8; 10 * 6_500];
        assert_eq!(sizes(&batch(&bytes, Some(6_500))), [(65_000, Some(6_500))]);
        assert_eq!(sizes(&batch(&bytes[..1_200], None)), [(1_200, None)]);
    }

    #[test]
    fn a_larger_batch_is_split_on_datagram_boundaries() {
        // 10 datagrams of 16,000 and a short last one: four per send.
        let bytes = vec![0u8; 10 * 16_000 + 700];
        assert_eq!(
            sizes(&batch(&bytes, Some(16_000))),
            [
                (64_000, Some(16_000)),
                (64_000, Some(16_000)),
                (32_700, Some(16_000)),
            ]
        );
        let bytes = vec![0u8; 8 * 16_000 + 700];
        assert_eq!(
            sizes(&batch(&bytes, Some(16_000))),
            [(64_000, Some(16_000)), (64_000, Some(16_000)), (700, None)]
        );
        // Each send but possibly the last holds whole datagrams.
        let jumbo = vec![0u8; 10 * 8_952];
        let parts = sizes(&batch(&jumbo, Some(8_952)));
        assert_eq!(parts, [(7 * 8_952, Some(8_952)), (3 * 8_952, Some(8_952))]);
        assert_eq!(parts.iter().map(|p| p.0).sum::<usize>(), jumbo.len());
    }

    #[test]
    fn datagrams_over_a_send_go_one_per_send() {
        let bytes = vec![0u8; 3 * 40_000];
        assert_eq!(sizes(&batch(&bytes, Some(40_000))), [(40_000, None); 3]);
    }
}
