//! A port-forward across a distant, lossy link: the hub as a process in
//! one network namespace, the agent and the Kubernetes API test server in
//! another, joined by the emulated link of `otter_e2e::wan` (every IP
//! packet, TCP and UDP alike, delayed and dropped at random). At 5 % loss
//! a QUIC tunnel whose congestion control took random loss for congestion
//! stalled (a 20 MB transfer had moved 15.6 MB after 300 s); here bytes
//! move both ways over QUIC and HTTP/2, in order, and the link really lost
//! packets meanwhile.
//!
//! Needs the privilege to create network namespaces and TUN devices
//! (root); without it the test says so in one line and passes, unless
//! `OTTER_REQUIRE_TOOLS=1` (set by `make test`), which makes it fail.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures::StreamExt;
use otter_e2e::{
    netns::{HUB_IP, in_netns},
    procs::ACK_EVERY,
    wan::{CLUSTER, Impairment, POD, SINK, SOURCE, Scene, WanLink},
    with_token,
};
use otter_proto::runtime::v1::{self as pb, runtime_service_client::RuntimeServiceClient};

/// Bytes each way.
const TOTAL: u64 = 4 * 1024 * 1024;
/// Bounds each direction: a second or two here (`make bench` measures the
/// rates); with the congestion control QUIC had before (Cubic), about 50 s.
const BOUND: Duration = Duration::from_secs(30);

async fn both_ways(ca_pem: String, token: String) {
    let channel =
        otter_e2e::client_channel(std::net::SocketAddr::from((HUB_IP, 8443)), &ca_pem, None).await;
    let mut rt = RuntimeServiceClient::new(channel);
    let pf = |port: u16| pb::PortForwardRequest {
        cluster: Some(CLUSTER.into()),
        namespace: Some("default".into()),
        name: Some(POD.into()),
        port: Some(port.into()),
    };

    // Down: the pod's source sends a pattern; check every byte's place.
    let mut down = rt
        .port_forward(with_token(pf(SOURCE), &token))
        .await
        .expect("port-forward")
        .into_inner();
    let mut got = 0u64;
    tokio::time::timeout(BOUND, async {
        while got < TOTAL {
            let data = down.next().await.expect("open").expect("data").data;
            for b in data.unwrap_or_default() {
                let at = got % (64 * 1024);
                assert_eq!(b, (at * 7) as u8, "byte {got} out of place");
                got += 1;
            }
        }
    })
    .await
    .expect("the download moved on");
    drop(down);

    // Up: one write after another; the pod's sink answers a byte per MiB.
    let mut up = rt
        .port_forward(with_token(pf(SINK), &token))
        .await
        .expect("port-forward")
        .into_inner();
    let id = up
        .next()
        .await
        .expect("open")
        .expect("session id")
        .session_id
        .expect("session id");
    let chunk = vec![7u8; 256 * 1024];
    tokio::time::timeout(BOUND, async {
        for _ in 0..TOTAL / chunk.len() as u64 {
            let req = pb::WritePortForwardRequest {
                session_id: Some(id.clone()),
                data: Some(chunk.clone()),
            };
            rt.write_port_forward(with_token(req, &token))
                .await
                .expect("write");
        }
        let mut acks = 0u64;
        while acks < TOTAL / ACK_EVERY {
            acks += up
                .next()
                .await
                .expect("open")
                .expect("ack")
                .data
                .map_or(0, |d| d.len() as u64);
        }
    })
    .await
    .expect("the upload reached the pod");
}

fn across_a_lossy_link(transport: &str) {
    // 100 ms round trip, 100 Mbit/s, 5 % loss each way.
    let impairment = Impairment {
        loss: 0.05,
        ..Impairment::default()
    };
    let Some(link) = WanLink::create_or_skip(impairment) else {
        return;
    };
    let scene = Scene::start(transport, link).expect("scene");
    let (ca_pem, token) = (scene.ca_pem.clone(), scene.admin.clone());
    in_netns(&scene.link.pair.hub, move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(both_ways(ca_pem, token));
    })
    .expect("in the hub's namespace");
    let lost: u64 = scene
        .link
        .counters
        .iter()
        .map(|c| c.lost.load(Ordering::Relaxed))
        .sum();
    let packets: u64 = scene
        .link
        .counters
        .iter()
        .map(|c| c.packets.load(Ordering::Relaxed))
        .sum();
    eprintln!("{transport}: {lost} of {packets} packets lost on the link");
    assert!(
        lost > 0 && packets > 1000,
        "the link lost {lost} of {packets} packets"
    );
}

#[test]
fn port_forward_across_a_lossy_link_over_quic() {
    across_a_lossy_link("quic");
}

#[test]
fn port_forward_across_a_lossy_link_over_h2() {
    across_a_lossy_link("h2");
}

/// Reads the pod's source through a port-forward until `stop` says so or
/// `limit` bytes came (whichever first); returns the bytes read.
async fn download(ca_pem: String, token: String, limit: u64, stop: Arc<AtomicBool>) -> u64 {
    let channel =
        otter_e2e::client_channel(std::net::SocketAddr::from((HUB_IP, 8443)), &ca_pem, None).await;
    let mut rt = RuntimeServiceClient::new(channel);
    let req = pb::PortForwardRequest {
        cluster: Some(CLUSTER.into()),
        namespace: Some("default".into()),
        name: Some(POD.into()),
        port: Some(SOURCE.into()),
    };
    let mut down = rt
        .port_forward(with_token(req, &token))
        .await
        .expect("port-forward")
        .into_inner();
    let mut got = 0u64;
    let read = async {
        while got < limit && !stop.load(Ordering::Relaxed) {
            match down.next().await {
                Some(Ok(m)) => got += m.data.map_or(0, |d| d.len() as u64),
                other => panic!("the download ended: {other:?}"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(90), read)
        .await
        .expect("the download moved on");
    got
}

/// A path that polices UDP (40 % of UDP packets dropped, TCP untouched):
/// the agent sees its QUIC tunnel lose far more than its limit (20 %)
/// while it carries a download, sets up an HTTP/2 tunnel beside it and
/// moves there without dropping the tunnel, and new calls go through.
#[test]
fn a_quic_tunnel_on_a_path_that_polices_udp_moves_to_http2() {
    let Some(link) = WanLink::create_or_skip(Impairment::default()) else {
        return;
    };
    let scene = Scene::start_on(&["quic", "h2"], link).expect("scene");
    let metric = |name: &str| scene.agent_metric(name).unwrap_or(-1.0);
    assert_eq!(metric("otter_agent_quality_moves_total"), 0.0);
    scene.link.set_udp_loss(0.4);

    let (ca_pem, token) = (scene.ca_pem.clone(), scene.admin.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let reading = {
        let (ca_pem, token, stop, hub) = (
            ca_pem.clone(),
            token.clone(),
            stop.clone(),
            scene.link.pair.hub.clone(),
        );
        std::thread::spawn(move || {
            in_netns(&hub, move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime")
                    .block_on(download(ca_pem, token, u64::MAX, stop))
            })
            .expect("in the hub's namespace")
        })
    };
    // Two loss windows of 10 s, then the HTTP/2 tunnel's set-up across the
    // 100 ms link.
    let started = std::time::Instant::now();
    while metric("otter_agent_switches_total") < 1.0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the agent did not move off QUIC: quality moves {}\n{}",
            metric("otter_agent_quality_moves_total"),
            scene.agent_tail(20)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, Ordering::Relaxed);
    let before = reading.join().expect("the download");
    assert_eq!(metric("otter_agent_quality_moves_total"), 1.0);
    assert_eq!(metric("otter_agent_tunnel_up"), 1.0);
    // On HTTP/2 now: a new download is not slowed by the UDP losses.
    let after = in_netns(&scene.link.pair.hub, move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(download(
                ca_pem,
                token,
                1024 * 1024,
                Arc::new(AtomicBool::new(false)),
            ))
    })
    .expect("in the hub's namespace");
    eprintln!(
        "moved to HTTP/2 {:?} after UDP began losing 40 %; {before} bytes read over QUIC meanwhile, then {after} over HTTP/2",
        started.elapsed()
    );
    assert!(after >= 1024 * 1024, "{after} bytes over HTTP/2");
}
