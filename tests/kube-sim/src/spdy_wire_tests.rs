//! A hand-written SPDY client against a running server, over TLS: the paths kubectl does
//! not take (older stream protocols, resize, refused negotiations) checked frame by frame.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::client::TlsStream;

use crate::spdy::conn::read_frame;
use crate::spdy::frame::{self, Frame};
use crate::spdy::header::{Deflater, Headers, Inflater};
use crate::{ADMIN_TOKEN, KubeSim, SimConfig};

const T: Duration = Duration::from_secs(10);

async fn start() -> KubeSim {
    let _ = rustls::crypto::ring::default_provider().install_default();
    KubeSim::start(SimConfig::default_with_admin().pod("default", "p1", &["c1"]))
        .await
        .unwrap()
}

struct Client {
    io: TlsStream<tokio::net::TcpStream>,
    out: Deflater,
    inp: Inflater,
}

/// Sends the upgrade request; returns the response head and, after a 101, the connection.
async fn upgrade(sim: &KubeSim, path: &str, protocols: &[&str]) -> (String, Option<Client>) {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(sim.ca_pem().as_bytes()).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(sim.addr()).await.unwrap();
    let mut io = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap();
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nContent-Length: 0\r\n"
    );
    for p in protocols {
        req.push_str(&format!("X-Stream-Protocol-Version: {p}\r\n"));
    }
    req.push_str("\r\n");
    io.write_all(req.as_bytes()).await.unwrap();
    // Byte by byte up to the blank line, so no SPDY byte is taken with the head.
    let mut head = Vec::new();
    tokio::time::timeout(T, async {
        while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
            let mut b = [0u8; 1];
            if io.read(&mut b).await.unwrap() == 0 {
                break;
            }
            head.push(b[0]);
        }
    })
    .await
    .unwrap();
    let head = String::from_utf8_lossy(&head).into_owned();
    if !head.starts_with("HTTP/1.1 101") {
        // The rest is the body of the refusal.
        let mut body = vec![0u8; 4096];
        let n = tokio::time::timeout(T, io.read(&mut body))
            .await
            .unwrap()
            .unwrap_or(0);
        return (head + &String::from_utf8_lossy(&body[..n]), None);
    }
    let c = Client {
        io,
        out: Deflater::new(),
        inp: Inflater::new(),
    };
    (head, Some(c))
}

impl Client {
    async fn send(&mut self, f: &Frame) {
        let mut buf = Vec::new();
        frame::encode(f, &mut self.out, &mut buf);
        self.io.write_all(&buf).await.unwrap();
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

    /// Every frame until the server's GOAWAY: (stream, data received, FIN seen) per stream,
    /// starting with the streams already `replied` to.
    async fn collect(&mut self, replied: &[u32]) -> Vec<(u32, Vec<u8>, bool)> {
        let mut streams: Vec<(u32, Vec<u8>, bool)> =
            replied.iter().map(|id| (*id, Vec::new(), false)).collect();
        tokio::time::timeout(T, async {
            // Bounded by the server closing; the timeout guards the test.
            while let Some(f) = read_frame(&mut self.io, &mut self.inp).await.unwrap() {
                match f {
                    Frame::SynReply { stream, .. } => streams.push((stream, Vec::new(), false)),
                    Frame::Data { stream, fin, data } => {
                        let s = streams
                            .iter_mut()
                            .find(|s| s.0 == stream)
                            .expect("data only after SYN_REPLY");
                        assert!(!s.2, "data after FIN on {stream}");
                        s.1.extend_from_slice(&data);
                        s.2 |= fin;
                    }
                    Frame::GoAway { status, .. } => {
                        assert_eq!(status, 0);
                        break;
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
        })
        .await
        .expect("the session ends in time");
        streams
    }
}

fn exec_path(script: &str, extra: &str) -> String {
    let script: String = url::form_urlencoded::byte_serialize(script.as_bytes()).collect();
    format!(
        "/api/v1/namespaces/default/pods/p1/exec?command=sh&command=-c&command={script}&stdout=true{extra}"
    )
}

#[tokio::test]
async fn older_protocols_send_only_a_failure_message() {
    let sim = start().await;
    // The client's order decides, whatever the server prefers.
    let (head, c) = upgrade(
        &sim,
        &exec_path("echo out; echo err >&2; exit 4", "&stderr=true"),
        &["v2.channel.k8s.io", "v4.channel.k8s.io"],
    )
    .await;
    assert!(
        head.to_ascii_lowercase()
            .contains("x-stream-protocol-version: v2.channel.k8s.io"),
        "{head}"
    );
    let mut c = c.expect("101");
    c.open(1, "error").await;
    c.open(3, "stdout").await;
    c.open(5, "stderr").await;
    let s = c.collect(&[]).await;
    assert_eq!(
        s,
        vec![
            (1, b"command terminated with non-zero exit code: error executing command [sh -c echo out; echo err >&2; exit 4], exit code 4".to_vec(), true),
            (3, b"out\n".to_vec(), true),
            (5, b"err\n".to_vec(), true),
        ]
    );

    let (_, c) = upgrade(&sim, &exec_path("echo fine", ""), &["channel.k8s.io"]).await;
    let mut c = c.expect("101");
    c.open(1, "error").await;
    // A stream the request did not ask for is refused.
    c.open(3, "stdin").await;
    match read_frame(&mut c.io, &mut c.inp).await.unwrap() {
        Some(Frame::SynReply { stream: 1, .. }) => {}
        other => panic!("{other:?}"),
    }
    match read_frame(&mut c.io, &mut c.inp).await.unwrap() {
        Some(Frame::RstStream { stream: 3, status }) => {
            assert_eq!(status, frame::rst::REFUSED_STREAM)
        }
        other => panic!("{other:?}"),
    }
    c.open(5, "stdout").await;
    let s = c.collect(&[1]).await;
    assert_eq!(
        s,
        vec![(1, Vec::new(), true), (5, b"fine\n".to_vec(), true)]
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn v3_records_resizes_and_stdin_fin_is_eof() {
    let sim = start().await;
    let (_, c) = upgrade(
        &sim,
        &exec_path(
            "read line; echo got $line $(stty size)",
            "&stdin=true&tty=true",
        ),
        &["v3.channel.k8s.io"],
    )
    .await;
    let mut c = c.expect("101");
    c.open(1, "error").await;
    c.open(3, "stdin").await;
    c.open(5, "stdout").await;
    c.open(7, "resize").await;
    c.send(&Frame::Data {
        stream: 7,
        fin: false,
        data: Bytes::from_static(b"{\"Width\":100,\"Height\":30}\n{\"Width\":120,"),
    })
    .await;
    c.send(&Frame::Data {
        stream: 7,
        fin: false,
        data: Bytes::from_static(b"\"Height\":40}\n"),
    })
    .await;
    c.send(&Frame::Data {
        stream: 3,
        fin: true,
        data: Bytes::from_static(b"hello\n"),
    })
    .await;
    let s = c.collect(&[]).await;
    // A real terminal: it echoes what is typed, ends lines with CR LF,
    // and has the size of the last resize.
    let stdout = s.iter().find(|x| x.0 == 5).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&stdout.1),
        "hello\r\ngot hello 40 120\r\n"
    );
    let error = s.iter().find(|x| x.0 == 1).unwrap();
    assert_eq!(error.1, b"");
    let resizes = sim.resizes();
    assert_eq!(
        resizes,
        vec![
            ("p1".to_string(), "c1".to_string(), 100, 30),
            ("p1".to_string(), "c1".to_string(), 120, 40)
        ]
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn refused_negotiations() {
    let sim = start().await;
    let (head, c) = upgrade(&sim, &exec_path("true", ""), &["v9.channel.k8s.io"]).await;
    assert!(c.is_none());
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(
        lower.contains("x-accepted-stream-protocol-versions: v4.channel.k8s.io"),
        "{head}"
    );
    assert!(head.contains("unable to negotiate protocol"), "{head}");
    let (head, c) = upgrade(&sim, &exec_path("true", ""), &[]).await;
    assert!(c.is_none());
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    assert!(
        head.contains("X-Stream-Protocol-Version is required"),
        "{head}"
    );
    let (head, c) = upgrade(
        &sim,
        "/api/v1/namespaces/default/pods/p1/portforward",
        &["v4.channel.k8s.io"],
    )
    .await;
    assert!(c.is_none());
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    sim.shutdown().await;
}

#[tokio::test]
async fn port_forward_pairs_without_request_ids_and_a_missing_target() {
    let sim = start().await;
    let (_, c) = upgrade(
        &sim,
        "/api/v1/namespaces/default/pods/p1/portforward",
        &["portforward.k8s.io"],
    )
    .await;
    let mut c = c.expect("101");
    // No requestID header (as very old clients did): ids 1 and 3 pair up. Port 7 has no
    // registered target, so the error stream says so and both streams end.
    for (id, kind) in [(1, "error"), (3, "data")] {
        c.send(&Frame::SynStream {
            stream: id,
            associated: 0,
            priority: 0,
            fin: false,
            unidirectional: false,
            headers: Headers::new().with("streamtype", kind).with("port", "7"),
        })
        .await;
    }
    // A stream without a valid port is refused.
    c.send(&Frame::SynStream {
        stream: 5,
        associated: 0,
        priority: 0,
        fin: false,
        unidirectional: false,
        headers: Headers::new().with("streamtype", "data").with("port", "0"),
    })
    .await;
    let mut error = Vec::new();
    let mut fins = 0;
    let mut refused = false;
    tokio::time::timeout(T, async {
        while fins < 2 || !refused {
            match read_frame(&mut c.io, &mut c.inp).await.unwrap().unwrap() {
                Frame::SynReply { .. } => {}
                Frame::Data {
                    stream: 1,
                    data,
                    fin,
                } => {
                    error.extend_from_slice(&data);
                    fins += fin as usize;
                }
                Frame::Data { stream: 3, fin, .. } => fins += fin as usize,
                Frame::RstStream { stream: 5, .. } => refused = true,
                other => panic!("{other:?}"),
            }
        }
    })
    .await
    .expect("the failure is reported in time");
    let error = String::from_utf8(error).unwrap();
    assert!(
        error.starts_with("error forwarding port 7 to pod ")
            && error.contains("connection refused"),
        "{error}"
    );
    sim.shutdown().await;
}
