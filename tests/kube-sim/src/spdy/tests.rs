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

mod connection {
    //! A hand-written client against [`conn::serve`] over an in-memory pipe: the session
    //! accepts every stream and echoes its data back.

    use std::time::Duration;

    use bytes::Bytes;
    use tokio::io::{AsyncWriteExt, DuplexStream, ReadHalf, WriteHalf};

    use crate::spdy::conn::{self, Event, MAX_STREAMS, read_frame};
    use crate::spdy::frame::{self, Frame, goaway, rst};
    use crate::spdy::header::{Deflater, Headers, Inflater};

    const T: Duration = Duration::from_secs(10);

    struct Client {
        rd: ReadHalf<DuplexStream>,
        wr: WriteHalf<DuplexStream>,
        out: Deflater,
        inp: Inflater,
        server: tokio::task::JoinHandle<()>,
    }

    impl Client {
        fn start() -> Client {
            let (a, b) = tokio::io::duplex(1 << 20);
            let server = tokio::spawn(conn::serve(a, |h, mut ev| async move {
                // Bounded by the client: the events end when it goes.
                while let Some(e) = ev.next().await {
                    match e {
                        Event::Open { id, .. } => {
                            h.accept(id).await;
                        }
                        Event::Data { id, data } => {
                            h.send(id, &data).await;
                        }
                        Event::Fin { id } => {
                            h.finish(id).await;
                        }
                        Event::Reset { .. } | Event::GoAway => {}
                    }
                }
            }));
            let (rd, wr) = tokio::io::split(b);
            Client {
                rd,
                wr,
                out: Deflater::new(),
                inp: Inflater::new(),
                server,
            }
        }

        async fn send(&mut self, f: &Frame) {
            let mut buf = Vec::new();
            frame::encode(f, &mut self.out, &mut buf);
            self.wr.write_all(&buf).await.unwrap();
        }

        async fn raw(&mut self, bytes: &[u8]) {
            self.wr.write_all(bytes).await.unwrap();
        }

        async fn recv(&mut self) -> Option<Frame> {
            tokio::time::timeout(T, read_frame(&mut self.rd, &mut self.inp))
                .await
                .expect("the server answers in time")
                .ok()
                .flatten()
        }

        async fn open(&mut self, id: u32, kind: &str) {
            self.send(&Frame::SynStream {
                stream: id,
                associated: 0,
                priority: 0,
                fin: false,
                unidirectional: false,
                headers: Headers::new().with("streamtype", kind),
            })
            .await;
        }

        /// Expects GOAWAY with `status`, then the end of the connection.
        async fn expect_goaway(mut self, status: u32) {
            match self.recv().await {
                Some(Frame::GoAway { status: s, .. }) => assert_eq!(s, status),
                other => panic!("expected GOAWAY, got {other:?}"),
            }
            assert_eq!(self.recv().await, None);
            tokio::time::timeout(T, self.server)
                .await
                .expect("the server task ends")
                .unwrap();
        }
    }

    #[tokio::test]
    async fn streams_pings_and_a_clean_goaway() {
        let mut c = Client::start();
        c.open(1, "data").await;
        assert_eq!(
            c.recv().await,
            Some(Frame::SynReply {
                stream: 1,
                fin: false,
                headers: Headers::new()
            })
        );
        c.send(&Frame::Ping { id: 1 }).await;
        assert_eq!(c.recv().await, Some(Frame::Ping { id: 1 }));
        // The server's own ping ids are even: an even one it did not send is ignored.
        c.send(&Frame::Ping { id: 2 }).await;
        c.send(&Frame::WindowUpdate {
            stream: 0,
            delta: 1 << 20,
        })
        .await;
        c.send(&Frame::Data {
            stream: 1,
            fin: true,
            data: Bytes::from_static(b"echo me"),
        })
        .await;
        assert_eq!(
            c.recv().await,
            Some(Frame::Data {
                stream: 1,
                fin: false,
                data: Bytes::from_static(b"echo me")
            })
        );
        assert_eq!(
            c.recv().await,
            Some(Frame::Data {
                stream: 1,
                fin: true,
                data: Bytes::new()
            })
        );
        // Data for a stream never opened is answered with INVALID_STREAM.
        c.send(&Frame::Data {
            stream: 9,
            fin: false,
            data: Bytes::from_static(b"?"),
        })
        .await;
        assert_eq!(
            c.recv().await,
            Some(Frame::RstStream {
                stream: 9,
                status: rst::INVALID_STREAM
            })
        );
        // The client leaving ends the session; the server says goodbye and closes.
        c.send(&Frame::GoAway {
            last_good: 0,
            status: 0,
        })
        .await;
        c.wr.shutdown().await.unwrap();
        c.expect_goaway(goaway::OK).await;
    }

    #[tokio::test]
    async fn an_oversized_data_frame_closes_the_connection() {
        let mut c = Client::start();
        c.open(1, "data").await;
        assert!(matches!(c.recv().await, Some(Frame::SynReply { .. })));
        // 16 MiB - 1 announced; nothing of it is read.
        c.raw(&[0, 0, 0, 1, 0, 0xff, 0xff, 0xff]).await;
        c.expect_goaway(goaway::PROTOCOL_ERROR).await;
    }

    #[tokio::test]
    async fn a_header_block_bomb_closes_the_connection() {
        let mut c = Client::start();
        // A SYN_STREAM whose block inflates to 1 MiB.
        let block = c.out.compress(&vec![0u8; 1024 * 1024]);
        let mut p = 1u32.to_be_bytes().to_vec();
        p.extend_from_slice(&0u32.to_be_bytes());
        p.extend_from_slice(&[0, 0]);
        p.extend_from_slice(&block);
        let mut f = vec![0x80, 3, 0, 1, 0];
        f.extend_from_slice(&(p.len() as u32).to_be_bytes()[1..]);
        f.extend_from_slice(&p);
        c.raw(&f).await;
        c.expect_goaway(goaway::PROTOCOL_ERROR).await;
    }

    #[tokio::test]
    async fn stream_ids_must_increase() {
        let mut c = Client::start();
        c.open(5, "data").await;
        assert!(matches!(c.recv().await, Some(Frame::SynReply { .. })));
        c.open(3, "data").await;
        c.expect_goaway(goaway::PROTOCOL_ERROR).await;
    }

    #[tokio::test]
    async fn streams_beyond_the_limit_are_refused() {
        let mut c = Client::start();
        for i in 0..MAX_STREAMS as u32 {
            c.open(2 * i + 1, "data").await;
            assert!(
                matches!(c.recv().await, Some(Frame::SynReply { .. })),
                "{i}"
            );
        }
        let over = 2 * MAX_STREAMS as u32 + 1;
        c.open(over, "data").await;
        assert_eq!(
            c.recv().await,
            Some(Frame::RstStream {
                stream: over,
                status: rst::REFUSED_STREAM
            })
        );
        // Closing one (both directions) makes room again.
        c.send(&Frame::Data {
            stream: 1,
            fin: true,
            data: Bytes::new(),
        })
        .await;
        assert!(matches!(
            c.recv().await,
            Some(Frame::Data {
                stream: 1,
                fin: true,
                ..
            })
        ));
        c.open(over + 2, "data").await;
        assert!(matches!(
            c.recv().await,
            Some(Frame::SynReply { stream, .. }) if stream == over + 2
        ));
        c.wr.shutdown().await.unwrap();
        c.expect_goaway(goaway::OK).await;
    }

    #[tokio::test]
    async fn garbage_closes_the_connection() {
        let mut c = Client::start();
        // A SYN_STREAM whose block is not zlib at all.
        c.raw(&[
            0x80, 3, 0, 1, 0, 0, 0, 14, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, b'n', b'o', b'p', b'e',
        ])
        .await;
        c.expect_goaway(goaway::PROTOCOL_ERROR).await;
    }
}

#[test]
fn negotiation_follows_the_clients_order() {
    use http::{HeaderMap, HeaderValue};
    let mut h = HeaderMap::new();
    for p in [
        "v9.channel.k8s.io",
        "v3.channel.k8s.io",
        "v4.channel.k8s.io",
    ] {
        h.append(super::PROTOCOL_HEADER, HeaderValue::from_static(p));
    }
    let supported = &["v4.channel.k8s.io", "v3.channel.k8s.io"];
    assert_eq!(
        super::negotiate(&h, supported).unwrap(),
        "v3.channel.k8s.io"
    );
    let none = super::negotiate(&HeaderMap::new(), supported).unwrap_err();
    assert_eq!(none.status(), 400);
    let mut other = HeaderMap::new();
    other.append(super::PROTOCOL_HEADER, HeaderValue::from_static("v9"));
    let refused = super::negotiate(&other, supported).unwrap_err();
    assert_eq!(refused.status(), 403);
    assert_eq!(
        refused
            .headers()
            .get_all(super::ACCEPTED_HEADER)
            .iter()
            .collect::<Vec<_>>(),
        vec!["v4.channel.k8s.io", "v3.channel.k8s.io"]
    );
}
