//! A caller that stops reading: a `logs -f` (PodLog follow) and a
//! port-forward whose clients read nothing while 64 MiB each are pushed at
//! them: the pod logs 64 MiB of numbered lines and its port's source sends
//! 64 MiB of a position-dependent pattern, both after the readers stopped.
//! Flow control carries the stall back to the sources (the apiserver's
//! follow stream and the pod's socket stop being able to write), hub and
//! agent memory (processes of their own, measured as RSS) grows by a
//! bounded amount well under what was pushed, other calls on the same
//! tunnels keep working, and once the readers read again every byte and
//! every line arrives, once and in order.

use std::{
    io::Write,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures::StreamExt;
use otter_e2e::{double::WAIT, fleet::Fleet, kube::sim_config, procs::rss_mib, with_token};
use otter_proto::{
    resource::v1::{GetRequest, resource_service_client::ResourceServiceClient},
    runtime::v1::{self as pb, runtime_service_client::RuntimeServiceClient},
};

/// Bytes pushed at each stalled reader.
const TOTAL: u64 = 64 * 1024 * 1024;
/// Growth of hub or agent memory that still counts as bounded: a quarter
/// of what was pushed at one reader, so holding what a stalled reader was
/// sent fails the test (flow-control windows are 4 MiB per stream and
/// 16 MiB per tunnel over QUIC, 1 and 8 MiB over HTTP/2).
const MAX_GROWTH_MIB: f64 = 16.0;
const LOG_LINE: usize = 1024;

/// The byte at `offset` of the port-forward source's stream.
fn pattern(offset: u64) -> u8 {
    (offset % 251) as u8
}

/// A pod port that sends TOTAL bytes to whoever connects, counting what its
/// socket took.
fn source() -> (std::net::SocketAddr, Arc<AtomicU64>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let written = Arc::new(AtomicU64::new(0));
    let w = written.clone();
    std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else {
            return;
        };
        let mut offset = 0u64;
        while offset < TOTAL {
            let chunk: Vec<u8> = (offset..offset + 65536).map(pattern).collect();
            if conn.write_all(&chunk).is_err() {
                return;
            }
            offset += chunk.len() as u64;
            w.store(offset, Ordering::SeqCst);
        }
    });
    (addr, written)
}

/// RSS (MiB) of the hub and the two agents. Panics when one is not running
/// or its `/proc/<pid>/status` cannot be read: a missing process must fail
/// the test, not read as zero growth.
fn rss(fleet: &Fleet) -> [f64; 3] {
    let of = |what: &str, p: &Option<otter_e2e::procs::Proc>| {
        let pid = p
            .as_ref()
            .unwrap_or_else(|| panic!("cannot measure {what}: it is not running"))
            .pid();
        rss_mib(pid).unwrap_or_else(|| {
            panic!("cannot measure {what}: no VmRSS in /proc/{pid}/status (has it exited?)")
        })
    };
    [
        of("the hub", &fleet.hub),
        of("agent 0", &fleet.agents[0].proc),
        of("agent 1", &fleet.agents[1].proc),
    ]
}

/// Log line `i` of the pod, LOG_LINE bytes with its newline.
fn numbered_line(i: usize) -> String {
    let head = format!("seq {i:08} ");
    format!("{head}{}", "l".repeat(LOG_LINE - 1 - head.len()))
}

fn get(cluster: &str) -> GetRequest {
    GetRequest {
        cluster: Some(cluster.into()),
        version: Some("v1".into()),
        resource: Some("pods".into()),
        namespace: Some("default".into()),
        name: Some("web".into()),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_readers_hold_bounded_memory_and_other_calls_work() {
    let sim = kube_sim::KubeSim::start(sim_config().pod("default", "web", &["app"]))
        .await
        .expect("kube-sim");
    let (source_addr, written) = source();
    sim.add_pod_port("default", "web", 8080, source_addr);
    // edge-0 over QUIC follows the log; edge-1 over HTTP/2 forwards the port.
    let fleet = Fleet::start(&sim, &["quic", "h2"]).await;
    let channel = fleet.channel().await;
    fleet.all_connected(&channel).await;
    let token = fleet.admin_token.clone();
    let mut resources = ResourceServiceClient::new(channel.clone());
    let mut rt = RuntimeServiceClient::new(channel.clone()).max_decoding_message_size(8 << 20);

    // Warm up each path once, so the baseline includes what any call costs.
    for c in ["edge-0", "edge-1"] {
        resources
            .get(with_token(get(c), &token))
            .await
            .expect("get");
    }
    sim.append_log("default", "web", "app", "warm-up");
    let log_req = |follow: bool| pb::PodLogRequest {
        cluster: Some("edge-0".into()),
        namespace: Some("default".into()),
        name: Some("web".into()),
        follow: Some(follow),
        ..Default::default()
    };
    let mut warm = rt
        .pod_log(with_token(log_req(false), &token))
        .await
        .expect("logs")
        .into_inner();
    // What the log holds before the 64 MiB (the warm-up line and anything
    // the pod said at start); the follower reads it too.
    let mut before_bytes = 0u64;
    while let Some(m) = warm.next().await {
        before_bytes += m.expect("log").data.unwrap_or_default().len() as u64;
    }
    let mut logs = rt
        .pod_log(with_token(log_req(true), &token))
        .await
        .expect("follow")
        .into_inner();
    // The follower reads what the log held, then nothing more.
    let mut log_bytes = 0u64;
    while log_bytes < before_bytes {
        let m = tokio::time::timeout(WAIT, logs.next())
            .await
            .expect("log data");
        log_bytes += m.unwrap().unwrap().data.unwrap_or_default().len() as u64;
    }
    let mut pf = rt
        .port_forward(with_token(
            pb::PortForwardRequest {
                cluster: Some("edge-1".into()),
                namespace: Some("default".into()),
                name: Some("web".into()),
                port: Some(8080),
            },
            &token,
        ))
        .await
        .expect("port-forward")
        .into_inner();
    let first = tokio::time::timeout(WAIT, pf.next())
        .await
        .expect("session id");
    assert!(first.unwrap().unwrap().session_id.is_some());
    let base = rss(&fleet);

    // Nobody reads now. The pod keeps logging, 64 MiB of numbered lines,
    // and the port's source keeps sending: both must stall at the source
    // (the apiserver's follow stream, the pod's socket) once flow control
    // has reached them, not pile up in the hub or the agents.
    let lines = TOTAL as usize / LOG_LINE;
    let producer = {
        let pod = sim.log_writer("default", "web", "app");
        std::thread::spawn(move || {
            for i in 0..lines {
                pod.append(&numbered_line(i));
            }
        })
    };
    let started = Instant::now();
    let counters = || (written.load(Ordering::SeqCst), sim.followed_log_bytes());
    let mut last = (counters(), Instant::now());
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = counters();
        if now != last.0 || !producer.is_finished() {
            last = (now, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(2) {
            break;
        }
        assert!(
            now.0 < TOTAL,
            "all {TOTAL} bytes went out to a reader that reads nothing"
        );
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the sources never stalled"
        );
    }
    producer.join().expect("the pod's logging");
    let (stalled_at, log_stalled_at) = last.0;
    // Where the follow stream stops depends on more than our windows: the
    // test server's own queue (64 batches of up to 64 lines) and the
    // kernel's buffers on two TCP hops (test server → agent, hub →
    // caller), which grow with the rate seen before the reader stopped.
    // Alone it stops after 9–14 MiB; on a loaded machine once after 32
    // MiB. Flow control failing would write all of it.
    assert!(
        log_stalled_at < TOTAL * 3 / 4,
        "the log stream wrote {log_stalled_at} of {TOTAL} bytes to a reader that reads nothing"
    );
    let during = rss(&fleet);
    let growth: Vec<f64> = during.iter().zip(base).map(|(d, b)| d - b).collect();
    eprintln!(
        "stalled readers: the port-forward source stopped after {:.1} MiB of {} MiB, the log \
         stream after {:.1} MiB while the pod logged all {} MiB; \
         RSS MiB hub {:.1} -> {:.1}, agent (logs, quic) {:.1} -> {:.1}, agent (port-forward, h2) {:.1} -> {:.1}",
        stalled_at as f64 / 1048576.0,
        TOTAL >> 20,
        log_stalled_at as f64 / 1048576.0,
        TOTAL >> 20,
        base[0],
        during[0],
        base[1],
        during[1],
        base[2],
        during[2]
    );
    for (who, g) in ["hub", "agent edge-0", "agent edge-1"].iter().zip(&growth) {
        assert!(
            *g < MAX_GROWTH_MIB,
            "{who} grew by {g:.1} MiB holding data for a stalled reader"
        );
    }

    // Other calls on the same tunnels still work.
    for c in ["edge-0", "edge-1"] {
        let r = tokio::time::timeout(WAIT, resources.get(with_token(get(c), &token)))
            .await
            .unwrap_or_else(|_| panic!("a Get on {c} hung behind a stalled stream"));
        r.unwrap_or_else(|e| panic!("a Get on {c} failed beside a stalled stream: {e:?}"));
    }

    // Reading again: everything arrives, in order.
    let drained = Instant::now();
    let log_total = TOTAL + before_bytes;
    let mut got = 0u64;
    let mut next_line = 0usize;
    tokio::time::timeout(Duration::from_secs(120), async {
        while got < TOTAL {
            let data = pf
                .next()
                .await
                .expect("port-forward open")
                .expect("data")
                .data
                .unwrap();
            for (i, b) in data.iter().enumerate() {
                assert_eq!(
                    *b,
                    pattern(got + i as u64),
                    "byte {} differs",
                    got + i as u64
                );
            }
            got += data.len() as u64;
        }
        // Every numbered line, once, in order.
        let mut partial = Vec::new();
        while next_line < lines {
            let data = logs
                .next()
                .await
                .expect("log open")
                .expect("log data")
                .data
                .unwrap();
            log_bytes += data.len() as u64;
            partial.extend_from_slice(&data);
            while let Some(end) = partial.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = partial.drain(..=end).collect();
                assert_eq!(
                    line,
                    format!("{}\n", numbered_line(next_line)).into_bytes(),
                    "log line {next_line} lost, repeated, reordered or changed"
                );
                next_line += 1;
            }
        }
        assert!(partial.is_empty(), "a partial line after the last");
    })
    .await
    .expect("both readers catch up within two minutes");
    assert_eq!(got, TOTAL);
    assert_eq!(next_line, lines);
    assert_eq!(log_bytes, log_total);
    eprintln!(
        "readers caught up in {:?}; RSS MiB after: {:?}",
        drained.elapsed(),
        rss(&fleet).map(|m| (m * 10.0).round() / 10.0)
    );
    drop((pf, logs));
    drop(fleet);
    sim.shutdown().await;
}
