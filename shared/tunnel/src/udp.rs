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

use std::{
    fmt,
    io::{self, IoSliceMut},
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use quinn::{AsyncUdpSocket, UdpPoller, udp::RecvMeta, udp::Transmit};

/// The most one send may carry: an IPv4 packet's 65,535 bytes less its
/// IP and UDP headers, rounded down.
const MAX_SEND: usize = 65_000;

/// Wraps quinn's socket for the tokio runtime.
pub(crate) fn wrap(socket: std::net::UdpSocket) -> io::Result<Arc<dyn AsyncUdpSocket>> {
    let inner = quinn::Runtime::wrap_udp_socket(&quinn::TokioRuntime, socket)?;
    Ok(Arc::new(Batched { inner }))
}

/// quinn's socket, with batches over [`MAX_SEND`] split.
struct Batched {
    inner: Arc<dyn AsyncUdpSocket>,
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
        self.inner.poll_recv(cx, bufs, meta)
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
