//! Framing and header compression round trips, and refusal of oversized input.

use bytes::Bytes;

use super::dictionary;
use super::frame::{self, Frame, FrameError, HEAD_LEN, Head, MAX_CONTROL, MAX_DATA};
use super::header::{Deflater, HeaderError, Headers, Inflater, MAX_BLOCK, adler32};

fn roundtrip(frames: &[Frame]) -> Vec<Frame> {
    let (mut d, mut i) = (Deflater::new(), Inflater::new());
    let mut wire = Vec::new();
    for f in frames {
        frame::encode(f, &mut d, &mut wire);
    }
    let mut out = Vec::new();
    let mut at = 0;
    while at < wire.len() {
        let head = Head::parse(wire[at..at + HEAD_LEN].try_into().unwrap());
        head.check().unwrap();
        let body = Bytes::copy_from_slice(&wire[at + HEAD_LEN..at + HEAD_LEN + head.len()]);
        out.push(frame::decode(head, body, &mut i).unwrap());
        at += HEAD_LEN + head.len();
    }
    out
}

#[test]
fn dictionary_is_the_spdy3_one() {
    let d = dictionary::bytes();
    assert_eq!(d.len(), 1423);
    assert_eq!(adler32(d), 0xe3c6_a7c2);
    assert_eq!(&d[..11], b"\0\0\0\x07options");
    assert!(d.ends_with(b"charset=iso-8859-1,utf-,*,enq=0."));
}

#[test]
fn every_frame_kind_round_trips_with_one_context_per_direction() {
    let hdrs = |t: &str| {
        Headers::new()
            .with("streamtype", t)
            .with("port", "8080")
            .with("requestid", "0")
    };
    let frames = vec![
        Frame::SynStream {
            stream: 1,
            associated: 0,
            priority: 3,
            fin: false,
            unidirectional: false,
            headers: hdrs("error"),
        },
        // The second block reuses the context: it compresses against the first.
        Frame::SynStream {
            stream: 3,
            associated: 0,
            priority: 0,
            fin: true,
            unidirectional: true,
            headers: hdrs("data"),
        },
        Frame::SynReply {
            stream: 1,
            fin: false,
            headers: Headers::new(),
        },
        Frame::Headers {
            stream: 3,
            fin: true,
            headers: Headers::new().with("x", "a").with("x", "b"),
        },
        Frame::Data {
            stream: 3,
            fin: true,
            data: Bytes::from_static(b"hello"),
        },
        Frame::RstStream {
            stream: 5,
            status: 3,
        },
        Frame::Settings {
            clear: true,
            entries: vec![(1, 4, 100), (0, 7, 65536)],
        },
        Frame::Ping { id: 7 },
        Frame::GoAway {
            last_good: 3,
            status: 0,
        },
        Frame::WindowUpdate {
            stream: 0,
            delta: 1000,
        },
    ];
    assert_eq!(roundtrip(&frames), frames);
}

#[test]
fn headers_compress_and_survive_many_blocks() {
    let (mut d, mut i) = (Deflater::new(), Inflater::new());
    for n in 0..200 {
        let h = Headers::new()
            .with("streamtype", if n % 2 == 0 { "data" } else { "error" })
            .with("requestid", &n.to_string())
            .with("port", "8080");
        let raw = h.encode();
        let z = d.compress(&raw);
        if n > 0 {
            assert!(
                z.len() < raw.len(),
                "block {n}: {} >= {}",
                z.len(),
                raw.len()
            );
        }
        let back = i.decompress(&z, MAX_BLOCK).unwrap();
        assert_eq!(Headers::decode(&back).unwrap(), h);
    }
}

#[test]
fn oversized_frames_are_refused_before_reading() {
    let data = Head::parse([0, 0, 0, 1, 0, 0xff, 0xff, 0xff]);
    assert_eq!(
        data.check(),
        Err(FrameError::TooLarge {
            len: 0xff_ffff,
            max: MAX_DATA
        })
    );
    let ctl = Head::parse([0x80, 3, 0, 1, 0, 0x10, 0, 0]);
    assert_eq!(
        ctl.check(),
        Err(FrameError::TooLarge {
            len: 0x10_0000,
            max: MAX_CONTROL
        })
    );
    assert!(Head::parse([0x80, 3, 0, 1, 0, 0, 1, 0]).check().is_ok());
}

#[test]
fn header_blocks_that_inflate_too_far_are_refused() {
    // 1 MiB of one byte compresses to about a kilobyte: a small frame, a huge block.
    let mut d = Deflater::new();
    let bomb = d.compress(&vec![b'a'; 1024 * 1024]);
    assert!(bomb.len() < MAX_CONTROL, "{}", bomb.len());
    let mut i = Inflater::new();
    assert_eq!(i.decompress(&bomb, MAX_BLOCK), Err(HeaderError::TooLarge));
}

#[test]
fn malformed_blocks_and_frames_are_refused() {
    // A count of pairs larger than what follows.
    let mut raw = 5u32.to_be_bytes().to_vec();
    raw.extend_from_slice(&1u32.to_be_bytes());
    raw.push(b'a');
    assert!(matches!(
        Headers::decode(&raw),
        Err(HeaderError::Malformed(_))
    ));
    // A name length pointing past the end.
    let mut raw = 1u32.to_be_bytes().to_vec();
    raw.extend_from_slice(&u32::MAX.to_be_bytes());
    assert!(matches!(
        Headers::decode(&raw),
        Err(HeaderError::Malformed(_))
    ));
    // Too many pairs.
    let raw = 100_000u32.to_be_bytes();
    assert!(Headers::decode(&raw).is_err());
    // Not zlib at all.
    let mut i = Inflater::new();
    assert!(matches!(
        i.decompress(b"definitely not zlib", MAX_BLOCK),
        Err(HeaderError::Corrupt(_))
    ));
    // zlib with another dictionary.
    let other = {
        let mut c = flate2::Compress::new(flate2::Compression::default(), true);
        c.set_dictionary(b"some other dictionary").unwrap();
        let mut out = Vec::with_capacity(256);
        c.compress_vec(b"\0\0\0\0", &mut out, flate2::FlushCompress::Sync)
            .unwrap();
        out
    };
    let mut i = Inflater::new();
    assert!(matches!(
        i.decompress(&other, MAX_BLOCK),
        Err(HeaderError::WrongDictionary(_))
    ));
    // Version 2 control frames, short RST_STREAM, stream 0.
    let mut z = Inflater::new();
    let v2 = Head::parse([0x80, 2, 0, 6, 0, 0, 0, 4]);
    assert_eq!(
        frame::decode(v2, Bytes::from_static(&[0, 0, 0, 1]), &mut z),
        Err(FrameError::Version(2))
    );
    let rst = Head::parse([0x80, 3, 0, 3, 0, 0, 0, 4]);
    assert!(frame::decode(rst, Bytes::from_static(&[0, 0, 0, 1]), &mut z).is_err());
    let data0 = Head::parse([0, 0, 0, 0, 0, 0, 0, 0]);
    assert!(frame::decode(data0, Bytes::new(), &mut z).is_err());
}
