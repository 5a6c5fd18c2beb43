//! Framing of one tunnel stream, sans IO.
//!
//! A stream carries chunks: one byte of kind, a big-endian `u32` length, and
//! the payload. Heads and trailers are small protobuf messages; data chunks
//! are raw bytes. Every length is checked against [`Limits`] before anything
//! is allocated, so a peer cannot make us buffer more than the limit.
//!
//! ```text
//! hub → agent:  OPEN(RequestHead)  DATA*  END   … (stream stays open: closing it cancels the call)
//! agent → hub:  HEAD(ResponseHead) DATA*  [TRAILERS]  FIN
//! ```
//!
//! Where the agent has said it watches for a stop
//! ([`ResponseHead::fin_with_request`], QUIC only), a request the hub has
//! whole goes `OPEN DATA* END FIN` in one write, and the hub stops reading
//! the answer (STOP_SENDING) to cancel the call.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

use crate::TunnelError;

/// Bytes of a chunk header: kind and length.
pub const HEADER_LEN: usize = 5;

/// The kinds of chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ChunkKind {
    /// Request head ([`RequestHead`]), first on a stream from the hub.
    Open = 1,
    /// Body bytes, either direction.
    Data = 2,
    /// End of the request body.
    End = 3,
    /// Response head ([`ResponseHead`]), first on a stream from the agent.
    Head = 4,
    /// Response trailers ([`HeaderList`]); nothing but FIN may follow.
    Trailers = 5,
}

impl ChunkKind {
    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Open,
            2 => Self::Data,
            3 => Self::End,
            4 => Self::Head,
            5 => Self::Trailers,
            _ => return None,
        })
    }
}

/// Size limits of one stream's chunks.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest head or trailers message (headers of one call, encoded).
    pub max_head: usize,
    /// Largest data chunk; writers split larger bodies.
    pub max_data: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_head: 64 * 1024,
            max_data: 256 * 1024,
        }
    }
}

/// tokio-util codec for chunks.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChunkCodec {
    pub limits: Limits,
}

/// The kind byte and payload length of the chunk `src` starts with, once
/// its header is whole (neither is checked here).
pub(crate) fn header(src: &[u8]) -> Option<(u8, usize)> {
    let head: [u8; HEADER_LEN] = src.get(..HEADER_LEN)?.try_into().ok()?;
    Some((
        head[0],
        u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize,
    ))
}

impl Decoder for ChunkCodec {
    type Item = (ChunkKind, Bytes);
    type Error = TunnelError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Self::Item>, TunnelError> {
        let Some((kind, len)) = header(src) else {
            return Ok(None);
        };
        let kind = ChunkKind::from_u8(kind)
            .ok_or_else(|| TunnelError::protocol(format!("unknown chunk kind {kind}")))?;
        let max = match kind {
            ChunkKind::Data => self.limits.max_data,
            ChunkKind::End => 0,
            _ => self.limits.max_head,
        };
        if len > max {
            return Err(TunnelError::TooLarge {
                what: "tunnel chunk",
                len,
                max,
            });
        }
        if src.len() < HEADER_LEN + len {
            src.reserve(HEADER_LEN + len - src.len());
            return Ok(None);
        }
        src.advance(HEADER_LEN);
        Ok(Some((kind, src.split_to(len).freeze())))
    }
}

impl Encoder<(ChunkKind, Bytes)> for ChunkCodec {
    type Error = TunnelError;

    fn encode(
        &mut self,
        (kind, payload): (ChunkKind, Bytes),
        dst: &mut BytesMut,
    ) -> Result<(), TunnelError> {
        let max = match kind {
            ChunkKind::Data => self.limits.max_data,
            ChunkKind::End => 0,
            _ => self.limits.max_head,
        };
        if payload.len() > max {
            return Err(TunnelError::TooLarge {
                what: "outgoing chunk",
                len: payload.len(),
                max,
            });
        }
        dst.reserve(HEADER_LEN + payload.len());
        dst.put_u8(kind as u8);
        dst.put_u32(payload.len() as u32);
        dst.extend_from_slice(&payload);
        Ok(())
    }
}

/// One header line. Values are bytes: HTTP allows non-UTF-8 values.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Header {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

/// A list of headers (response trailers).
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderList {
    #[prost(message, repeated, tag = "1")]
    pub headers: Vec<Header>,
}

/// The identity the hub verified for a call. It travels in the request head,
/// never as a header, so nothing a client sends can turn into it.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct Caller {
    #[prost(string, tag = "1")]
    pub user: String,
    #[prost(string, repeated, tag = "2")]
    pub groups: Vec<String>,
    #[prost(string, tag = "3")]
    pub uid: String,
    #[prost(message, repeated, tag = "4")]
    pub extra: Vec<Extra>,
}

/// One `extra` attribute of a caller (Kubernetes user info).
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct Extra {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, repeated, tag = "2")]
    pub values: Vec<String>,
}

/// First chunk from the hub: what to call and for whom.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RequestHead {
    #[prost(string, tag = "1")]
    pub method: String,
    /// Path and query.
    #[prost(string, tag = "2")]
    pub path: String,
    #[prost(message, repeated, tag = "3")]
    pub headers: Vec<Header>,
    #[prost(message, optional, tag = "4")]
    pub caller: Option<Caller>,
    /// Which of the agent's services the request is for: empty for its gRPC
    /// services, [`TARGET_KUBE`] for its Kubernetes API proxy.
    #[prost(string, tag = "5")]
    pub target: String,
}

/// [`RequestHead::target`] of requests for the agent's Kubernetes API proxy.
pub const TARGET_KUBE: &str = "kube";

/// [`RequestHead::target`] of the hub's request for the agent's own report
/// on how it connected (transports tried, proxy).
pub const TARGET_DIAG: &str = "diag";

/// [`RequestHead::target`] of the hub's request that the agent renew its
/// certificate now (after a CA rotation step), rather than when due.
pub const TARGET_RENEW: &str = "renew";

/// [`RequestHead::target`] of the hub's goodbye: it is about to close this
/// tunnel, for the reason in [`REASON_HEADER`]. Over TCP a closed
/// connection looks the same whoever closed it (the hub, a proxy, a
/// middlebox); the goodbye is what lets the agent tell the hub's close
/// from the others.
pub const TARGET_BYE: &str = "bye";

/// Header of a goodbye: why the hub closes the tunnel.
pub const REASON_HEADER: &str = "otter-reason";

/// The goodbye's reason when the hub (a replica) stops: its agents should
/// dial another replica first.
pub const BYE_STOPPING: &str = "hub shutting down";

/// In a stopping replica's goodbye, between [`BYE_STOPPING`] and the
/// tunnel URLs of the replicas its agents should dial now (the other live
/// ones). An agent told nothing knows only the replicas it heard of last,
/// maybe none of those still live, and asked the API again only after
/// failed rounds (a rolling restart of 10,000 agents: half back after 14 s).
pub const GO_TO: &str = "; go to ";

/// A stopping replica's goodbye reason: [`BYE_STOPPING`], then [`GO_TO`]
/// and as many of `others` (tunnel URLs) as fit in `max` bytes; just
/// [`BYE_STOPPING`] when none does.
pub fn stopping_reason(others: &[&str], max: usize) -> String {
    let mut reason = BYE_STOPPING.to_owned();
    for (i, url) in others.iter().enumerate() {
        let sep = if i == 0 { GO_TO } else { "," };
        if reason.len() + sep.len() + url.len() > max {
            break;
        }
        reason.push_str(sep);
        reason.push_str(url);
    }
    reason
}

/// A goodbye's reason without the URLs it names, and those URLs.
pub fn go_to(reason: &str) -> (&str, Vec<&str>) {
    match reason.split_once(GO_TO) {
        Some((why, urls)) => (why, urls.split(',').map(str::trim).collect()),
        None => (reason, Vec::new()),
    }
}

/// Header of the hub's diagnosis request: the hub's clock (Unix
/// milliseconds) as it sent the request, so the agent learns its skew on
/// every tunnel, not only when it registers.
pub const HUB_TIME_HEADER: &str = "otter-hub-time";

/// Header of the hub's diagnosis request: the tunnel URLs it serves now,
/// comma-separated, so an agent learns a moved port or a new transport on
/// every connect, not only when it registers.
pub const TUNNEL_URLS_HEADER: &str = "otter-tunnel-urls";

/// Header of a port-forward write the hub sends on: its upload path and
/// its place on it, `<upload>/<seq>` in hexadecimal. The hub sends a few
/// writes of one upload at once, and the agent hands each to the pod only
/// after the one before. The hub drops this header (as every `x-otter-`
/// one) from what clients send, and sets it itself.
pub const UPLOAD_ORDER_HEADER: &str = "x-otter-upload-order";

/// First chunk from the agent.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ResponseHead {
    #[prost(uint32, tag = "1")]
    pub status: u32,
    #[prost(message, repeated, tag = "2")]
    pub headers: Vec<Header>,
    /// The agent takes a FIN right after the request's END as the end of
    /// the request, and watches its answer for a stop (a QUIC
    /// STOP_SENDING) to learn that the caller left: the hub may send its
    /// FIN with the requests it sends whole from then on. An agent that
    /// does not say so takes an early FIN as the call abandoned.
    #[prost(bool, tag = "3")]
    pub fin_with_request: bool,
}

/// Converts an HTTP header map to wire headers.
pub fn to_wire(map: &http::HeaderMap) -> Vec<Header> {
    map.iter()
        .map(|(name, value)| Header {
            name: name.as_str().to_owned(),
            value: value.as_bytes().to_vec(),
        })
        .collect()
}

/// Converts wire headers back, refusing names or values HTTP does not allow.
pub fn from_wire(headers: Vec<Header>) -> Result<http::HeaderMap, TunnelError> {
    let mut map = http::HeaderMap::with_capacity(headers.len());
    for h in headers {
        let name = http::HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| TunnelError::protocol(format!("bad header name {:?}", h.name)))?;
        let value = http::HeaderValue::from_bytes(&h.value)
            .map_err(|_| TunnelError::protocol(format!("bad value for header {name}")))?;
        map.append(name, value);
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codec() -> ChunkCodec {
        ChunkCodec {
            limits: Limits {
                max_head: 16,
                max_data: 32,
            },
        }
    }

    #[test]
    fn a_stopping_goodbye_names_the_urls_that_fit() {
        let others = ["quic://b:7443", "https://b:7443", "quic://c:7443"];
        let full = stopping_reason(&others, 256);
        assert_eq!(
            full,
            "hub shutting down; go to quic://b:7443,https://b:7443,quic://c:7443"
        );
        assert_eq!(go_to(&full), (BYE_STOPPING, others.to_vec()));
        // Cut at a URL's end, never inside one.
        let cut = stopping_reason(&others, 60);
        assert_eq!(go_to(&cut).1, others[..2].to_vec());
        assert!(cut.len() <= 60);
        assert_eq!(stopping_reason(&others, 20), BYE_STOPPING);
        assert_eq!(stopping_reason(&[], 256), BYE_STOPPING);
        assert_eq!(
            go_to("the link was deleted"),
            ("the link was deleted", vec![])
        );
    }

    #[test]
    fn round_trips_and_waits_for_whole_chunks() {
        let mut buf = BytesMut::new();
        let mut c = codec();
        c.encode((ChunkKind::Data, Bytes::from_static(b"hello")), &mut buf)
            .unwrap();
        c.encode((ChunkKind::End, Bytes::new()), &mut buf).unwrap();
        let mut partial = buf.split_to(7);
        assert!(c.decode(&mut partial).unwrap().is_none());
        partial.unsplit(buf);
        assert_eq!(
            c.decode(&mut partial).unwrap(),
            Some((ChunkKind::Data, Bytes::from_static(b"hello")))
        );
        assert_eq!(
            c.decode(&mut partial).unwrap(),
            Some((ChunkKind::End, Bytes::new()))
        );
        assert!(partial.is_empty());
    }

    #[test]
    fn refuses_oversized_and_unknown_chunks_before_buffering() {
        let mut c = codec();
        // A DATA header announcing 4 GiB: refused from the header alone.
        let mut buf = BytesMut::from(&[2u8, 0xff, 0xff, 0xff, 0xff][..]);
        assert!(matches!(
            c.decode(&mut buf),
            Err(TunnelError::TooLarge { .. })
        ));
        let mut buf = BytesMut::from(&[1u8, 0, 0, 0, 17][..]);
        assert!(matches!(
            c.decode(&mut buf),
            Err(TunnelError::TooLarge { .. })
        ));
        let mut buf = BytesMut::from(&[3u8, 0, 0, 0, 1, 0][..]);
        assert!(matches!(
            c.decode(&mut buf),
            Err(TunnelError::TooLarge { .. })
        ));
        let mut buf = BytesMut::from(&[9u8, 0, 0, 0, 0][..]);
        assert!(matches!(c.decode(&mut buf), Err(TunnelError::Protocol(_))));
    }

    #[test]
    fn header_conversion_rejects_invalid_names() {
        let ok = vec![Header {
            name: "x-a".into(),
            value: b"1".to_vec(),
        }];
        assert_eq!(from_wire(ok).unwrap()["x-a"], "1");
        let bad = vec![Header {
            name: "bad name".into(),
            value: b"1".to_vec(),
        }];
        assert!(from_wire(bad).is_err());
        let bad = vec![Header {
            name: "x".into(),
            value: b"a\nb".to_vec(),
        }];
        assert!(from_wire(bad).is_err());
    }
}
