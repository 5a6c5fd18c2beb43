//! A distant, lossy link between hub and agent: the hub runs as a process
//! in one network namespace, the agent and the Kubernetes API test server
//! in another, joined by [`WanLink`] (100 ms round trip, 100 Mbit/s, random
//! loss on every IP packet, TCP and UDP alike). The clients run beside the
//! hub, inside its namespace, as a dashboard or kubectl near the hub would.
//!
//! Per transport (QUIC, HTTP/2, WebSocket) and loss rate:
//! - `connect.download`: `RuntimeService.PortForward`'s stream, pod → client;
//! - `connect.upload`: `WritePortForward` calls one after another, as
//!   `otter port-forward` sends them, counted by what reached the pod;
//! - `kubectl.download` / `kubectl.upload`: kubectl's WebSocket
//!   port-forward through the hub's Kubernetes API proxy;
//! - `get.p50` / `get.p99`: small calls (a Get of one pod), one at a time;
//! - `get.beside-download.p50` / `.p99`: the same calls while a download
//!   fills the tunnel (what a call waits behind bulk bytes queued on the
//!   way, in the agent's buffers or its kernel's).
//!
//! Each transfer runs for a fixed time and counts what arrived in it, so a
//! stalled path shows as a low rate instead of a bench that never ends.
//! Without the privilege to make namespaces, the scenario is skipped.

use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use otter_e2e::{
    netns::{HUB_IP, in_netns},
    procs::ACK_EVERY,
    wan::{CLUSTER, Impairment, POD, SINK, SOURCE, Scene, WanLink},
};
use otter_proto::resource::v1::GetRequest;
use tokio_tungstenite::tungstenite::Message;

use crate::{
    common::{Figure, Figures, Latency},
    portforward::{CHUNK, Connect, WsTarget, mb_per_s, ws_open},
};

/// Small calls per point.
const GETS: usize = 30;

/// Everything measured at one loss rate, from inside the hub's namespace.
struct Point {
    connect_down: f64,
    connect_up: f64,
    kubectl_down: f64,
    kubectl_up: f64,
    gets: Latency,
    gets_beside: Latency,
}

/// Measures one point from a thread in the hub's namespace.
fn measure_point(scene: &Scene, secs: Duration) -> anyhow::Result<Point> {
    let (ca_pem, token) = (scene.ca_pem.clone(), scene.admin.clone());
    in_netns(&scene.link.pair.hub, move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(measure(ca_pem, token, secs))
    })
    .map_err(anyhow::Error::msg)?
}
async fn measure(ca_pem: String, token: String, secs: Duration) -> anyhow::Result<Point> {
    let addr = std::net::SocketAddr::from((HUB_IP, 8443));
    let name = rustls::pki_types::ServerName::from(std::net::IpAddr::from(HUB_IP));
    let connect = Connect::open_to(addr, name, &ca_pem, &token, POD).await?;
    let ws = WsTarget {
        addr,
        base: format!("https://{HUB_IP}:8443/clusters/{CLUSTER}"),
        ca_pem,
        token,
        pod: POD.into(),
    };
    let mut gets = Vec::with_capacity(GETS);
    let get = GetRequest {
        cluster: Some(CLUSTER.into()),
        version: Some("v1".into()),
        resource: Some("pods".into()),
        namespace: Some("default".into()),
        name: Some(POD.into()),
        ..Default::default()
    };
    for _ in 0..GETS {
        gets.push(timed_get(&connect, &get).await?);
    }
    Ok(Point {
        gets_beside: gets_beside_download(&connect, &get, secs).await?,
        connect_down: connect_download(&connect, secs).await?,
        connect_up: connect_upload(&connect, secs).await?,
        kubectl_down: ws_download(&ws, secs).await?,
        kubectl_up: ws_upload(&ws, secs).await?,
        gets: Latency::of(&gets),
    })
}

async fn timed_get(c: &Connect, get: &GetRequest) -> anyhow::Result<Duration> {
    let t = Instant::now();
    c.unary("otterscale.resource.v1.ResourceService", "Get", get)
        .await?;
    Ok(t.elapsed())
}

/// Gets one at a time while a download runs through the same tunnel, from
/// a quarter of `secs` (the download at its rate) to three quarters, at
/// most [`GETS`] of them.
async fn gets_beside_download(
    c: &Connect,
    get: &GetRequest,
    secs: Duration,
) -> anyhow::Result<Latency> {
    let gets = async {
        tokio::time::sleep(secs / 4).await;
        let until = Instant::now() + secs / 2;
        let mut took = Vec::with_capacity(GETS);
        while took.len() < GETS && Instant::now() < until {
            took.push(timed_get(c, get).await?);
        }
        anyhow::Ok(took)
    };
    let (_, took) = tokio::try_join!(connect_download(c, secs), gets)?;
    Ok(Latency::of(&took))
}

/// Bytes a download got in `secs`, as MB/s.
async fn connect_download(c: &Connect, secs: Duration) -> anyhow::Result<f64> {
    let t = Instant::now();
    let (_, mut stream) = c.port_forward(CLUSTER, SOURCE).await?;
    let mut got = 0u64;
    let counting = async {
        while let Some(msg) = stream.next().await? {
            got += msg.data.map_or(0, |d| d.len() as u64);
        }
        anyhow::Ok(())
    };
    let _ = tokio::time::timeout(secs.saturating_sub(t.elapsed()), counting).await;
    Ok(mb_per_s(got, secs))
}

/// Writes one chunk after another for `secs` while the pod's answers (one
/// per MiB that reached it) are counted.
async fn connect_upload(c: &Connect, secs: Duration) -> anyhow::Result<f64> {
    let t = Instant::now();
    let (session, mut stream) = c.port_forward(CLUSTER, SINK).await?;
    let chunk = Bytes::from(vec![7u8; CHUNK]);
    let mut acked = 0u64;
    let writing = async {
        loop {
            c.write(&session, chunk.clone()).await?;
        }
        #[allow(unreachable_code)]
        anyhow::Ok(())
    };
    let counting = async {
        while let Some(msg) = stream.next().await? {
            acked += msg.data.map_or(0, |d| d.len() as u64);
        }
        anyhow::Ok(())
    };
    let both = async { tokio::try_join!(writing, counting) };
    if let Ok(Err(e)) = tokio::time::timeout(secs.saturating_sub(t.elapsed()), both).await {
        eprintln!("bench: a Connect upload ended early: {e:#}");
    }
    Ok(mb_per_s(acked * ACK_EVERY, secs))
}

async fn ws_download(target: &WsTarget, secs: Duration) -> anyhow::Result<f64> {
    let t = Instant::now();
    let mut ws = ws_open(target, SOURCE).await?;
    let mut got = 0u64;
    let counting = async {
        while let Some(msg) = ws.next().await {
            if let Message::Binary(b) = msg? {
                anyhow::ensure!(b.first() != Some(&1), "pod error");
                got += b.len().saturating_sub(1) as u64;
            }
        }
        anyhow::Ok(())
    };
    let _ = tokio::time::timeout(secs.saturating_sub(t.elapsed()), counting).await;
    Ok(mb_per_s(got, secs))
}

async fn ws_upload(target: &WsTarget, secs: Duration) -> anyhow::Result<f64> {
    let t = Instant::now();
    let ws = ws_open(target, SINK).await?;
    let (mut tx, mut rx) = ws.split();
    let mut frame = vec![7u8; CHUNK + 1];
    frame[0] = 0;
    let frame = Bytes::from(frame);
    let mut acked = 0u64;
    let writing = async {
        loop {
            tx.send(Message::Binary(frame.clone())).await?;
        }
        #[allow(unreachable_code)]
        anyhow::Ok(())
    };
    let counting = async {
        while let Some(msg) = rx.next().await {
            if let Message::Binary(b) = msg? {
                acked += b.iter().skip(1).filter(|&&c| c == b'k').count() as u64;
            }
        }
        anyhow::Ok(())
    };
    let both = async { tokio::try_join!(writing, counting) };
    let _ = tokio::time::timeout(secs.saturating_sub(t.elapsed()), both).await;
    Ok(mb_per_s(acked * ACK_EVERY, secs))
}

/// Every transport at every loss rate in `losses` (fractions), `secs` per
/// transfer.
pub fn run(secs: u64, losses: &[f64]) -> anyhow::Result<Figures> {
    let secs = Duration::from_secs(secs);
    let mut figs = Figures::default();
    // OTTER_BENCH_TRANSPORT names one transport, to repeat its points alone.
    let only = std::env::var("OTTER_BENCH_TRANSPORT").ok();
    for transport in ["quic", "h2", "ws"] {
        if only.as_deref().is_some_and(|o| o != transport) {
            continue;
        }
        let link = match WanLink::create(Impairment::default()) {
            Ok(l) => l,
            Err(e) => {
                figs.push(Figure::skipped(
                    "wan",
                    format!("cannot make the network namespaces and TUN link here: {e}"),
                ));
                return Ok(figs);
            }
        };
        let scene = Scene::start(transport, link).map_err(anyhow::Error::msg)?;
        for &loss in losses {
            scene.link.set_loss(loss);
            let at = format!("{:.0}%", loss * 100.0);
            let point =
                measure_point(&scene, secs).with_context(|| format!("{transport} at {at} loss"))?;
            eprintln!(
                "bench: wan {transport} {at}: connect ↓{:.2} ↑{:.2}, kubectl ↓{:.2} ↑{:.2} MB/s, get p50 {:.0} p99 {:.0} ms, beside a download p50 {:.0} p99 {:.0} ms",
                point.connect_down,
                point.connect_up,
                point.kubectl_down,
                point.kubectl_up,
                point.gets.p50 / 1000.0,
                point.gets.p99 / 1000.0,
                point.gets_beside.p50 / 1000.0,
                point.gets_beside.p99 / 1000.0,
            );
            let name = |what: &str| format!("wan.{at}.{transport}.{what}");
            let kubectl_down = name("kubectl.download");
            let kubectl_up = name("kubectl.upload");
            figs.add(&kubectl_down, "MB/s", None, point.kubectl_down);
            figs.add(&kubectl_up, "MB/s", None, point.kubectl_up);
            figs.add(
                &name("connect.download"),
                "MB/s",
                Some(&kubectl_down),
                point.connect_down,
            );
            figs.add(
                &name("connect.upload"),
                "MB/s",
                Some(&kubectl_up),
                point.connect_up,
            );
            let (alone50, alone99) = (name("get.p50"), name("get.p99"));
            figs.add(&alone50, "ms", None, point.gets.p50 / 1000.0);
            figs.add(&alone99, "ms", None, point.gets.p99 / 1000.0);
            figs.add(
                &name("get.beside-download.p50"),
                "ms",
                Some(&alone50),
                point.gets_beside.p50 / 1000.0,
            );
            figs.add(
                &name("get.beside-download.p99"),
                "ms",
                Some(&alone99),
                point.gets_beside.p99 / 1000.0,
            );
        }
        let [down, up] = &scene.link.counters;
        eprintln!(
            "bench: wan {transport}: link hub→agent {} packets ({} lost, {} overflowed), agent→hub {} ({} lost, {} overflowed)",
            down.packets.load(std::sync::atomic::Ordering::Relaxed),
            down.lost.load(std::sync::atomic::Ordering::Relaxed),
            down.overflowed.load(std::sync::atomic::Ordering::Relaxed),
            up.packets.load(std::sync::atomic::Ordering::Relaxed),
            up.lost.load(std::sync::atomic::Ordering::Relaxed),
            up.overflowed.load(std::sync::atomic::Ordering::Relaxed),
        );
    }
    Ok(figs)
}
