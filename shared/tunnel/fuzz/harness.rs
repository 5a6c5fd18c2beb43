//! What each fuzz target does with one input. Plain functions over the
//! crate's public entry points, so `cargo test` can replay the seed corpus
//! and past crashes through exactly the same code (see
//! `tests/fuzz_regressions.rs`). A harness panics only when an invariant
//! breaks; refusing bad input with an error is the expected outcome.

use bytes::{Bytes, BytesMut};
use otter_tunnel::{
    frame::{ChunkCodec, ChunkKind, HEADER_LEN, Limits, from_wire, to_wire},
    http::{parse_request_head, parse_response_head, parse_trailers},
};
use tokio_util::codec::{Decoder, Encoder};

/// Small limits so the fuzzer reaches the "over the limit" paths with short
/// inputs; the default limits are exercised by the seeds.
const SMALL: Limits = Limits {
    max_head: 64,
    max_data: 128,
};

/// Tunnel stream framing: the first byte picks the limits and how the rest
/// is cut into reads, as a socket would hand it over. Every decoded chunk
/// must respect its limit, the decoder must never hold more than one
/// chunk's worth, and a decoded chunk must re-encode to the same bytes.
/// Heads and trailers go on through the parsers the hub and agent use.
pub fn frame_decode(data: &[u8]) {
    let Some((&ctl, input)) = data.split_first() else {
        return;
    };
    let limits = if ctl & 1 == 0 {
        SMALL
    } else {
        Limits::default()
    };
    let biggest = limits.max_data.max(limits.max_head);
    let step = usize::from(ctl >> 1).max(1);
    let mut codec = ChunkCodec { limits };
    let mut buf = BytesMut::new();
    let mut offset = 0;
    'feed: for piece in input.chunks(step) {
        buf.extend_from_slice(piece);
        loop {
            match codec.decode(&mut buf) {
                Ok(Some((kind, payload))) => {
                    let max = match kind {
                        ChunkKind::Data => limits.max_data,
                        ChunkKind::End => 0,
                        _ => limits.max_head,
                    };
                    assert!(payload.len() <= max, "{kind:?} of {} bytes", payload.len());
                    let mut again = BytesMut::new();
                    codec
                        .encode((kind, payload.clone()), &mut again)
                        .expect("a decoded chunk re-encodes");
                    let end = offset + again.len();
                    assert_eq!(&again[..], &input[offset..end], "re-encoding differs");
                    offset = end;
                    match kind {
                        ChunkKind::Open => head_invariants(0, payload),
                        ChunkKind::Head => head_invariants(1, payload),
                        ChunkKind::Trailers => head_invariants(2, payload),
                        ChunkKind::Data | ChunkKind::End => {}
                    }
                }
                Ok(None) => break,
                Err(_) => break 'feed,
            }
        }
        // Waiting for the rest of a chunk: never more than one chunk held.
        assert!(
            buf.len() <= HEADER_LEN + biggest,
            "{} bytes held",
            buf.len()
        );
        assert!(buf.capacity() <= 4 * (HEADER_LEN + biggest + step));
    }
}

/// Heads of a stream: the first byte picks the parser (request head as the
/// agent reads it, response head or trailers as the hub reads them).
pub fn stream_head(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    head_invariants(which % 3, Bytes::copy_from_slice(rest));
}

/// Whatever parses must be valid HTTP and survive a trip through the wire
/// form unchanged: these parsers are all that stands between a peer's bytes
/// and the `http` types the services see.
fn head_invariants(which: u8, payload: Bytes) {
    let round_trips = |headers: &http::HeaderMap| {
        let again = from_wire(to_wire(headers)).expect("our own headers convert back");
        assert_eq!(&again, headers);
    };
    match which {
        0 => {
            if let Ok(head) = parse_request_head(payload) {
                round_trips(&head.headers);
                assert!(!head.method.as_str().is_empty());
            }
        }
        1 => {
            if let Ok(head) = parse_response_head(payload) {
                assert!((100..=999).contains(&head.status.as_u16()));
                round_trips(&head.headers);
            }
        }
        _ => {
            if let Ok(trailers) = parse_trailers(payload) {
                round_trips(&trailers);
            }
        }
    }
}
