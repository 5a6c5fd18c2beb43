//! Nothing leaks from the runtime calls either: open/close cycles of a
//! followed PodLog, an Exec session and a PortForward session, through hub,
//! tunnel, agent and the Kubernetes API test server, leave live tasks, open
//! file descriptors and memory where they started, and the agent's session
//! slots free (the limit is kept small, so a leaked session would soon
//! refuse new ones).
//!
//! Cycles per kind: `OTTER_LEAK_CYCLES` (default 1,000, about two and a half
//! minutes on two cores; fewer for a quick look). This
//! file is a test binary of its own with a single test: file descriptors
//! and tasks are counted for the whole process.

use std::time::Duration;

use futures::StreamExt;
use otter_e2e::{
    double::wait_until,
    kube::{KubeEnv, sim_config, within},
    procs::{own_open_fds, own_rss_kib},
    with_token,
};
use otter_proto::runtime::v1 as pb;
use tonic::Code;

fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

fn cycles_wanted() -> usize {
    std::env::var("OTTER_LEAK_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// A TCP echo server on loopback.
async fn echo_server() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = sock.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// Opens a call, retrying (bounded) while the agent's session slots are
/// all taken by sessions that are still winding down.
async fn open<T, F>(what: &str, mut call: impl FnMut() -> F) -> T
where
    F: std::future::Future<Output = Result<T, tonic::Status>>,
{
    within(what, async {
        loop {
            match call().await {
                Ok(v) => return v,
                Err(e) if e.code() == Code::ResourceExhausted => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("{what}: {e:?}"),
            }
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_cycles_leak_nothing() {
    let n = cycles_wanted();
    let cfg = sim_config().pod("default", "web", &["app"]);
    let env = KubeEnv::start_with(cfg, |s| {
        s.runtime.sessions.max_exec = 4;
        s.runtime.sessions.max_port_forward = 4;
    })
    .await;
    env.sim
        .add_pod_port("default", "web", 8080, echo_server().await);
    env.sim.append_log("default", "web", "app", "hello");
    let t = env.admin_token().to_owned();
    let c = env.cluster.clone();
    let rt = env.runtime();

    let log_cycle = || {
        let mut rt = rt.clone();
        let req = with_token(
            pb::PodLogRequest {
                cluster: Some(c.clone()),
                namespace: Some("default".into()),
                name: Some("web".into()),
                follow: Some(true),
                ..Default::default()
            },
            &t,
        );
        async move {
            let mut s = rt.pod_log(req).await.unwrap().into_inner();
            let first = within("log line", s.next()).await.unwrap().unwrap();
            assert!(first.data.is_some());
        }
    };
    let exec_cycle = || {
        let rt = rt.clone();
        let (c, t) = (c.clone(), t.clone());
        async move {
            let mut s = open("exec", || {
                let mut rt = rt.clone();
                let req = with_token(
                    pb::ExecuteTtyRequest {
                        cluster: Some(c.clone()),
                        namespace: Some("default".into()),
                        name: Some("web".into()),
                        command: vec!["cat".into()],
                        tty: Some(false),
                        ..Default::default()
                    },
                    &t,
                );
                async move { rt.execute_tty(req).await.map(|r| r.into_inner()) }
            })
            .await;
            let id = within("exec session", s.next())
                .await
                .unwrap()
                .unwrap()
                .session_id
                .unwrap();
            let mut w = rt.clone();
            w.write_tty(with_token(
                pb::WriteTtyRequest {
                    session_id: Some(id),
                    stdin: Some(b"x\n".to_vec()),
                },
                &t,
            ))
            .await
            .unwrap();
            let echoed = within("exec echo", s.next()).await.unwrap().unwrap();
            assert_eq!(echoed.stdout.as_deref(), Some(&b"x\n"[..]));
        }
    };
    let forward_cycle = || {
        let rt = rt.clone();
        let (c, t) = (c.clone(), t.clone());
        async move {
            let mut s = open("port-forward", || {
                let mut rt = rt.clone();
                let req = with_token(
                    pb::PortForwardRequest {
                        cluster: Some(c.clone()),
                        namespace: Some("default".into()),
                        name: Some("web".into()),
                        port: Some(8080),
                    },
                    &t,
                );
                async move { rt.port_forward(req).await.map(|r| r.into_inner()) }
            })
            .await;
            let id = within("forward session", s.next())
                .await
                .unwrap()
                .unwrap()
                .session_id
                .unwrap();
            let mut w = rt.clone();
            w.write_port_forward(with_token(
                pb::WritePortForwardRequest {
                    session_id: Some(id),
                    data: Some(b"y".to_vec()),
                },
                &t,
            ))
            .await
            .unwrap();
            let echoed = within("forward echo", s.next()).await.unwrap().unwrap();
            assert_eq!(echoed.data.as_deref(), Some(&b"y"[..]));
        }
    };

    // Warm up (allocator pools, connection windows, caches), then settle.
    for _ in 0..20 {
        log_cycle().await;
        exec_cycle().await;
        forward_cycle().await;
    }
    let tunnel = env.hub.hub.state.registry.get("edge-1").expect("tunnel up");
    let settle = async |what: &str| {
        wait_until(async || tunnel.calls_in_flight() == 0, what).await;
        // Sessions end a moment after their calls (their tasks see the
        // stream go and stop their process or connection).
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    settle("warm-up calls to end").await;
    let (tasks0, fds0, rss0) = (alive_tasks(), own_open_fds(), own_rss_kib());

    let started = std::time::Instant::now();
    for i in 0..n {
        log_cycle().await;
        exec_cycle().await;
        forward_cycle().await;
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "cycle {i}: too slow, something is stuck"
        );
    }
    settle("every call to end").await;
    // A port-forward's upload path at the hub ends with its session.
    let uploads = &env.hub.hub.state.uploads;
    wait_until(
        async || uploads.open() == 0,
        "the hub's upload paths to end with their sessions",
    )
    .await;
    // Tasks wind down on their own schedule: wait (bounded) for them.
    wait_until(
        async || alive_tasks() <= tasks0 && own_open_fds() <= fds0,
        "live tasks and open files to return to the baseline",
    )
    .await;
    let (tasks1, fds1, rss1) = (alive_tasks(), own_open_fds(), own_rss_kib());
    println!(
        "{n} cycles each of PodLog(follow), Exec, PortForward in {:?}; tasks {tasks0} -> {tasks1}; fds {fds0} -> {fds1}; RSS {rss0} KiB -> {rss1} KiB",
        started.elapsed()
    );
    assert!(tasks1 <= tasks0, "tasks grew: {tasks0} -> {tasks1}");
    assert!(fds1 <= fds0, "file descriptors grew: {fds0} -> {fds1}");
    // One cycle's state is kilobytes: hundreds of leaked cycles would be
    // megabytes. The bound docs/reliability.md promises: 4 MiB.
    assert!(
        rss1 <= rss0 + 4 * 1024,
        "RSS grew from {rss0} KiB to {rss1} KiB over {n} cycles"
    );
    env.shutdown().await;
}
