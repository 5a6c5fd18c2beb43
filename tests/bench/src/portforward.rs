//! Port-forward end to end: MB/s each way between a client and a TCP server
//! behind a pod's port, through the real hub, tunnel, agent services and
//! Kubernetes API test server.
//!
//! Paths, each measured downloading (pod → client) and uploading:
//! - `tcp`: the same server over loopback TCP, no Kubernetes at all (baseline);
//! - `kube-sim-ws`: kubectl's WebSocket port-forward straight to the test
//!   server (the baseline of the proxy path);
//! - `kubectl-proxy-<transport>`: the same WebSocket through the hub's
//!   Kubernetes API proxy (`/clusters/<name>/…`), relayed over the tunnel;
//! - `connect-<transport>`: `RuntimeService.PortForward` (a server stream)
//!   and `WritePortForward` (one unary call per 256 KiB), spoken as Connect
//!   over HTTP/2 the way a browser dashboard does.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use bytes::{Buf, Bytes, BytesMut};
use futures::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use otter_e2e::kube::{KubeEnv, sim_config};
use otter_proto::runtime::v1::{PortForwardRequest, PortForwardResponse, WritePortForwardRequest};
use otter_tunnel::TransportKind;
use prost::Message as _;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_tungstenite::tungstenite::{Message, client::IntoClientRequest};

use crate::common::Figures;

const POD: &str = "pf";
/// Port of the pod behind which a server sends without end.
pub(crate) const SOURCE: u16 = 8081;
/// Port of the pod behind which a server counts what it receives.
pub(crate) const SINK: u16 = 8082;
pub(crate) const CHUNK: usize = 256 * 1024;
/// Bounds one transfer.
const LIMIT: Duration = Duration::from_secs(120);

/// A server that reads `total` bytes, answers `k`, and drains the rest.
async fn sink(total: u64) -> anyhow::Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 256 * 1024];
                let mut got = 0u64;
                let mut told = false;
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                    got += n as u64;
                    if got >= total && !told {
                        told = true;
                        if s.write_all(b"k").await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    Ok(addr)
}

pub(crate) fn mb_per_s(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / 1e6 / t.as_secs_f64()
}

async fn tcp_download(addr: std::net::SocketAddr, total: u64) -> anyhow::Result<f64> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let mut buf = vec![0u8; CHUNK];
    let t = Instant::now();
    let mut got = 0u64;
    while got < total {
        let n = s.read(&mut buf).await?;
        anyhow::ensure!(n > 0, "source closed early");
        got += n as u64;
    }
    Ok(mb_per_s(got, t.elapsed()))
}

async fn tcp_upload(addr: std::net::SocketAddr, total: u64) -> anyhow::Result<f64> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let chunk = vec![7u8; CHUNK];
    let t = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        s.write_all(&chunk).await?;
        sent += CHUNK as u64;
    }
    let mut k = [0u8; 1];
    s.read_exact(&mut k).await?;
    Ok(mb_per_s(sent, t.elapsed()))
}

// ------------------------------------------------------------- WebSocket

pub(crate) trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}
pub(crate) type Ws = tokio_tungstenite::WebSocketStream<Box<dyn Io>>;

/// Where a WebSocket port-forward goes: the API server's base URL (with a
/// path prefix for the hub's proxy), its CA and a bearer token.
pub(crate) struct WsTarget {
    pub addr: std::net::SocketAddr,
    pub base: String,
    pub ca_pem: String,
    pub token: String,
    pub pod: String,
}

/// Opens kubectl's port-forward WebSocket to `port` of the pod and reads
/// the two port headers (data and error channels).
pub(crate) async fn ws_open(target: &WsTarget, port: u16) -> anyhow::Result<Ws> {
    let tls = otter_pki::tls::client_config(&target.ca_pem, None, &[b"http/1.1"])?;
    let tcp = tokio::net::TcpStream::connect(target.addr).await?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::from(target.addr.ip());
    let name = match url::Url::parse(&target.base)?.host_str() {
        Some("localhost") => rustls::pki_types::ServerName::try_from("localhost")?,
        _ => name,
    };
    let tls = tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect(name, tcp)
        .await?;
    let url = format!(
        "{}/api/v1/namespaces/default/pods/{}/portforward?ports={port}",
        target.base.replacen("https://", "wss://", 1),
        target.pod,
    );
    let mut req = url.into_client_request()?;
    req.headers_mut()
        .insert("authorization", format!("Bearer {}", target.token).parse()?);
    req.headers_mut()
        .insert("sec-websocket-protocol", "v4.channel.k8s.io".parse()?);
    let io: Box<dyn Io> = Box::new(tls);
    let (mut ws, _) = tokio_tungstenite::client_async(req, io).await?;
    for _ in 0..2 {
        match ws.next().await {
            Some(Ok(Message::Binary(b))) if b.len() == 3 => {}
            other => anyhow::bail!("expected a port header, got {other:?}"),
        }
    }
    Ok(ws)
}

async fn ws_download(target: &WsTarget, total: u64) -> anyhow::Result<f64> {
    let mut ws = ws_open(target, SOURCE).await?;
    let t = Instant::now();
    let mut got = 0u64;
    while got < total {
        match ws.next().await {
            Some(Ok(Message::Binary(b))) if b.first() == Some(&0) => got += b.len() as u64 - 1,
            Some(Ok(Message::Binary(b))) if b.first() == Some(&1) => {
                anyhow::bail!("pod error: {}", String::from_utf8_lossy(&b[1..]))
            }
            Some(Ok(_)) => {}
            other => anyhow::bail!("port-forward ended: {other:?}"),
        }
    }
    let rate = mb_per_s(got, t.elapsed());
    let _ = ws.close(None).await;
    Ok(rate)
}

async fn ws_upload(target: &WsTarget, total: u64) -> anyhow::Result<f64> {
    let mut ws = ws_open(target, SINK).await?;
    let mut frame = vec![7u8; CHUNK + 1];
    frame[0] = 0;
    let frame = Bytes::from(frame);
    let t = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        ws.feed(Message::Binary(frame.clone())).await?;
        sent += CHUNK as u64;
    }
    ws.flush().await?;
    loop {
        match ws.next().await {
            Some(Ok(Message::Binary(b))) if b.as_ref() == [0, b'k'] => break,
            Some(Ok(_)) => {}
            other => anyhow::bail!("port-forward ended: {other:?}"),
        }
    }
    let rate = mb_per_s(sent, t.elapsed());
    let _ = ws.close(None).await;
    Ok(rate)
}

// --------------------------------------------------------------- Connect

/// A Connect client over one HTTP/2 connection to the hub.
#[derive(Clone)]
pub(crate) struct Connect {
    send: SendRequest<ConnectBody>,
    authority: String,
    token: String,
    pod: String,
}

type ConnectBody = http_body_util::combinators::UnsyncBoxBody<Bytes, std::convert::Infallible>;

pub(crate) const RUNTIME: &str = "otterscale.runtime.v1.RuntimeService";

impl Connect {
    async fn open(env: &KubeEnv) -> anyhow::Result<Connect> {
        let name = rustls::pki_types::ServerName::try_from("localhost")?;
        Self::open_to(
            env.hub.hub.api_addr,
            name,
            env.hub.hub.ca_pem(),
            env.admin_token(),
            POD,
        )
        .await
    }

    /// A connection to the hub at `addr`, known by `name` in its
    /// certificate, for port-forwards to `pod`.
    pub(crate) async fn open_to(
        addr: std::net::SocketAddr,
        name: rustls::pki_types::ServerName<'static>,
        ca_pem: &str,
        token: &str,
        pod: &str,
    ) -> anyhow::Result<Connect> {
        let tls = otter_pki::tls::client_config(ca_pem, None, &[b"h2"])?;
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect(name, tcp)
            .await?;
        let (send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(4 * 1024 * 1024)
            .initial_connection_window_size(8 * 1024 * 1024)
            .handshake(TokioIo::new(tls))
            .await?;
        tokio::spawn(conn);
        Ok(Connect {
            send,
            authority: addr.to_string(),
            token: token.to_owned(),
            pod: pod.to_owned(),
        })
    }

    /// One unary Connect call of `service`: its answer's bytes.
    pub(crate) async fn unary(
        &self,
        service: &str,
        method: &str,
        msg: &impl prost::Message,
    ) -> anyhow::Result<Bytes> {
        let req = self.request(
            service,
            method,
            "application/proto",
            msg.encode_to_vec().into(),
        );
        let resp = self.send.clone().send_request(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        anyhow::ensure!(
            status.is_success(),
            "{method}: {status} {}",
            String::from_utf8_lossy(&body)
        );
        Ok(body)
    }

    /// One unary Connect call with a JSON body, as a browser sends it
    /// (gzip accepted): the answer's bytes as they came.
    pub(crate) async fn unary_json(
        &self,
        service: &str,
        method: &str,
        json: &'static str,
    ) -> anyhow::Result<Bytes> {
        let mut req = self.request(service, method, "application/json", Bytes::from(json));
        req.headers_mut().insert(
            http::header::ACCEPT_ENCODING,
            http::HeaderValue::from_static("gzip"),
        );
        let resp = self.send.clone().send_request(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        anyhow::ensure!(status.is_success(), "{method}: {status}");
        Ok(body)
    }

    fn request(
        &self,
        service: &str,
        method: &str,
        content_type: &str,
        body: Bytes,
    ) -> http::Request<ConnectBody> {
        http::Request::post(format!("https://{}/{service}/{method}", self.authority))
            .header("content-type", content_type)
            .header("connect-protocol-version", "1")
            .header("authorization", format!("Bearer {}", self.token))
            .body(Full::new(body).boxed_unsync())
            .expect("static request")
    }

    /// Opens a PortForward stream; returns the session id and the stream's
    /// body (Connect envelopes).
    pub(crate) async fn port_forward(
        &self,
        cluster: &str,
        port: u16,
    ) -> anyhow::Result<(String, Envelopes)> {
        let msg = PortForwardRequest {
            cluster: Some(cluster.into()),
            namespace: Some("default".into()),
            name: Some(self.pod.clone()),
            port: Some(port.into()),
        };
        let mut framed = BytesMut::new();
        framed.extend_from_slice(&[0]);
        framed.extend_from_slice(&(msg.encoded_len() as u32).to_be_bytes());
        msg.encode(&mut framed)?;
        let req = self.request(
            RUNTIME,
            "PortForward",
            "application/connect+proto",
            framed.freeze(),
        );
        let resp = self.send.clone().send_request(req).await?;
        anyhow::ensure!(resp.status().is_success(), "PortForward: {}", resp.status());
        let mut envelopes = Envelopes {
            body: resp.into_body(),
            buf: BytesMut::new(),
        };
        let first = envelopes.next().await?.context("no session id")?;
        let session = first
            .session_id
            .context("first message without session id")?;
        Ok((session, envelopes))
    }

    pub(crate) async fn write(&self, session: &str, data: Bytes) -> anyhow::Result<()> {
        let msg = WritePortForwardRequest {
            session_id: Some(session.to_owned()),
            data: Some(data.to_vec()),
        };
        self.unary(RUNTIME, "WritePortForward", &msg).await?;
        Ok(())
    }
}

/// The messages of a Connect server stream.
pub(crate) struct Envelopes {
    body: hyper::body::Incoming,
    buf: BytesMut,
}

impl Envelopes {
    /// The next message; `None` at the end-of-stream envelope (an error in
    /// it is returned as one).
    pub(crate) async fn next(&mut self) -> anyhow::Result<Option<PortForwardResponse>> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                anyhow::ensure!(len <= 16 * 1024 * 1024, "envelope of {len} bytes");
                if self.buf.len() >= 5 + len {
                    let flags = self.buf[0];
                    self.buf.advance(5);
                    let payload = self.buf.split_to(len).freeze();
                    if flags & 0x02 != 0 {
                        let end: serde_json::Value = serde_json::from_slice(&payload)?;
                        anyhow::ensure!(end.get("error").is_none(), "stream ended: {end}");
                        return Ok(None);
                    }
                    return Ok(Some(PortForwardResponse::decode(payload)?));
                }
            }
            match self.body.frame().await {
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                None => anyhow::bail!("stream ended without its end envelope"),
            }
        }
    }
}

async fn connect_download(c: &Connect, cluster: &str, total: u64) -> anyhow::Result<f64> {
    let (_, mut stream) = c.port_forward(cluster, SOURCE).await?;
    let t = Instant::now();
    let mut got = 0u64;
    while got < total {
        let msg = stream.next().await?.context("stream ended early")?;
        got += msg.data.map_or(0, |d| d.len() as u64);
    }
    Ok(mb_per_s(got, t.elapsed()))
}

async fn connect_upload(c: &Connect, cluster: &str, total: u64) -> anyhow::Result<f64> {
    let (session, mut stream) = c.port_forward(cluster, SINK).await?;
    let chunk = Bytes::from(vec![7u8; CHUNK]);
    let t = Instant::now();
    let mut sent = 0u64;
    // One write at a time: their order is the bytes' order.
    while sent < total {
        c.write(&session, chunk.clone()).await?;
        sent += CHUNK as u64;
    }
    loop {
        let msg = stream
            .next()
            .await?
            .context("stream ended before the answer")?;
        if msg.data.is_some_and(|d| d == b"k") {
            break;
        }
    }
    Ok(mb_per_s(sent, t.elapsed()))
}

// ----------------------------------------------------------------- runner

type Transfer<'a> = Box<dyn Fn() -> futures::future::BoxFuture<'a, anyhow::Result<f64>> + 'a>;

/// Runs `f` `runs` times (bounded) and records each rate.
async fn measure(
    figs: &mut Figures,
    name: &str,
    baseline: Option<&str>,
    runs: usize,
    f: Transfer<'_>,
) -> anyhow::Result<()> {
    for _ in 0..runs {
        let rate = tokio::time::timeout(LIMIT, f())
            .await
            .with_context(|| format!("{name} timed out"))??;
        eprintln!("bench: {name} {rate:.0} MB/s");
        figs.add(name, "MB/s", baseline, rate);
    }
    Ok(())
}

/// `mib` MiB each way per path and run.
pub async fn run(mib: u64, runs: usize) -> anyhow::Result<Figures> {
    let total = mib * 1024 * 1024;
    let (src, snk) = (otter_e2e::procs::source_server().await, sink(total).await?);
    let mut figs = Figures::default();
    let mut envs = Vec::new();
    for kind in [TransportKind::Quic, TransportKind::H2] {
        let env =
            KubeEnv::start_over(kind, sim_config().pod("default", POD, &["app"]), |_| {}).await;
        env.sim.add_pod_port("default", POD, SOURCE, src);
        env.sim.add_pod_port("default", POD, SINK, snk);
        envs.push((kind, env));
    }
    eprintln!("bench: hubs, agents and test servers up");

    for dir in ["download", "upload"] {
        let up = dir == "upload";
        let base = format!("portforward.tcp.{dir}");
        measure(
            &mut figs,
            &base,
            None,
            runs,
            Box::new(|| {
                Box::pin(async move {
                    if up {
                        tcp_upload(snk, total).await
                    } else {
                        tcp_download(src, total).await
                    }
                })
            }),
        )
        .await?;

        let env = &envs[0].1;
        let sim = WsTarget {
            addr: env.sim.addr(),
            base: env.sim.url(),
            ca_pem: env.sim.ca_pem(),
            token: kube_sim::ADMIN_TOKEN.to_owned(),
            pod: POD.into(),
        };
        let sim_name = format!("portforward.kube-sim-ws.{dir}");
        measure(
            &mut figs,
            &sim_name,
            Some(&base),
            runs,
            Box::new(|| {
                let sim = &sim;
                Box::pin(async move {
                    if up {
                        ws_upload(sim, total).await
                    } else {
                        ws_download(sim, total).await
                    }
                })
            }),
        )
        .await?;

        for (kind, env) in &envs {
            let hub = WsTarget {
                addr: env.hub.hub.api_addr,
                base: format!("{}clusters/{}", env.hub.api_url(), env.cluster),
                ca_pem: env.hub.hub.ca_pem().to_owned(),
                token: env.admin_token().to_owned(),
                pod: POD.into(),
            };
            let name = format!("portforward.kubectl-proxy-{kind}.{dir}");
            measure(
                &mut figs,
                &name,
                Some(&sim_name),
                runs,
                Box::new(|| {
                    let hub = &hub;
                    Box::pin(async move {
                        if up {
                            ws_upload(hub, total).await
                        } else {
                            ws_download(hub, total).await
                        }
                    })
                }),
            )
            .await?;

            let connect = Connect::open(env).await?;
            let cluster = env.cluster.clone();
            let name = format!("portforward.connect-{kind}.{dir}");
            measure(
                &mut figs,
                &name,
                Some(&base),
                runs,
                Box::new(|| {
                    let (c, cluster) = (&connect, cluster.as_str());
                    Box::pin(async move {
                        if up {
                            connect_upload(c, cluster, total).await
                        } else {
                            connect_download(c, cluster, total).await
                        }
                    })
                }),
            )
            .await?;
        }
    }
    for (_, env) in envs {
        env.shutdown().await;
    }
    Ok(figs)
}
