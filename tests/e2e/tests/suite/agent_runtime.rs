//! RuntimeService end to end through hub and tunnel, against the Kubernetes
//! API test server: logs, exec of real processes, port-forward to a real TCP
//! echo server, sessions (ownership, limits, idling), scale, restart and
//! subresource actions.

use std::time::Duration;

use futures::StreamExt;
use otter_e2e::{
    kube::{KubeEnv, sim_config, within},
    procs::echo_server,
    with_token,
};
use otter_proto::runtime::v1::{self as pb};
use otter_tunnel::TransportKind;
use tonic::{Code, Streaming};

fn exec(cluster: &str, pod: &str, command: &[&str], tty: bool) -> pb::ExecuteTtyRequest {
    pb::ExecuteTtyRequest {
        cluster: Some(cluster.into()),
        namespace: Some("default".into()),
        name: Some(pod.into()),
        container: None,
        command: command.iter().map(|s| (*s).to_owned()).collect(),
        tty: Some(tty),
        rows: None,
        cols: None,
    }
}

fn write(session: &str, data: Option<&[u8]>) -> pb::WriteTtyRequest {
    pb::WriteTtyRequest {
        session_id: Some(session.into()),
        stdin: data.map(<[u8]>::to_vec),
    }
}

/// The first message of a session stream: only the id.
async fn session_id(s: &mut Streaming<pb::ExecuteTtyResponse>) -> String {
    let first = within("session id", s.next()).await.unwrap().unwrap();
    assert!(
        first.stdout.is_none() && first.stderr.is_none(),
        "{first:?}"
    );
    first.session_id.expect("session id first")
}

/// Everything until the stream ends: stdout, stderr and the final status.
async fn drain(
    s: &mut Streaming<pb::ExecuteTtyResponse>,
) -> (String, String, Result<(), tonic::Status>) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let end = within("exec end", async {
        loop {
            match s.next().await {
                None => return Ok(()),
                Some(Err(e)) => return Err(e),
                Some(Ok(m)) => {
                    assert!(m.session_id.is_none());
                    out.extend(m.stdout.unwrap_or_default());
                    err.extend(m.stderr.unwrap_or_default());
                }
            }
        }
    })
    .await;
    (
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
        end,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_log_options_default_container_and_follow() {
    let env = KubeEnv::start(sim_config().pod("default", "web", &["app"]).pod(
        "default",
        "two",
        &["first", "second"],
    ))
    .await;
    let t = env.admin_token().to_owned();
    let c = env.cluster.clone();
    let mut rt = env.runtime();
    for i in 1..=4 {
        env.sim
            .append_log("default", "web", "app", &format!("line {i}"));
    }
    let req = |pod: &str| pb::PodLogRequest {
        cluster: Some(c.clone()),
        namespace: Some("default".into()),
        name: Some(pod.into()),
        ..Default::default()
    };
    let collect = |mut s: Streaming<pb::PodLogResponse>| async move {
        let mut all = Vec::new();
        while let Some(m) = s.next().await {
            all.extend(m.unwrap().data.unwrap_or_default());
        }
        String::from_utf8(all).unwrap()
    };
    let all = within("log", async {
        collect(
            rt.pod_log(with_token(req("web"), &t))
                .await
                .unwrap()
                .into_inner(),
        )
        .await
    })
    .await;
    assert!(
        all.contains("container app started") && all.ends_with("line 4\n"),
        "{all:?}"
    );
    let mut tail = req("web");
    tail.tail_lines = Some(2);
    let s = rt.pod_log(with_token(tail, &t)).await.unwrap().into_inner();
    assert_eq!(within("tail", collect(s)).await, "line 3\nline 4\n");
    let mut stamped = req("web");
    stamped.tail_lines = Some(1);
    stamped.timestamps = Some(true);
    let s = within(
        "timestamps",
        collect(
            rt.pod_log(with_token(stamped, &t))
                .await
                .unwrap()
                .into_inner(),
        ),
    )
    .await;
    assert!(
        s.ends_with(" line 4\n") && s.len() > "line 4\n".len() + 20 && s.contains('T'),
        "{s:?}"
    );
    let mut limited = req("web");
    limited.limit_bytes = Some(5);
    let s = within(
        "limit",
        collect(
            rt.pod_log(with_token(limited, &t))
                .await
                .unwrap()
                .into_inner(),
        ),
    )
    .await;
    assert_eq!(s.len(), 5, "{s:?}");
    let mut since = req("web");
    since.since_seconds = Some(3600);
    since.previous = Some(false);
    let s = within(
        "since",
        collect(
            rt.pod_log(with_token(since, &t))
                .await
                .unwrap()
                .into_inner(),
        ),
    )
    .await;
    assert!(s.contains("line 4"));
    let mut since_time = req("web");
    since_time.since_time = Some(prost_types::Timestamp {
        seconds: 0,
        nanos: 0,
    });
    let s = within(
        "since_time",
        collect(
            rt.pod_log(with_token(since_time, &t))
                .await
                .unwrap()
                .into_inner(),
        ),
    )
    .await;
    assert!(s.contains("line 4"));
    let mut future = req("web");
    future.since_time = Some(prost_types::Timestamp {
        seconds: 4_000_000_000,
        nanos: 0,
    });
    let s = within(
        "since_time later",
        collect(
            rt.pod_log(with_token(future, &t))
                .await
                .unwrap()
                .into_inner(),
        ),
    )
    .await;
    assert!(s.is_empty(), "{s:?}");
    let mut bad = req("web");
    bad.tail_lines = Some(-1);
    assert_eq!(
        rt.pod_log(with_token(bad, &t)).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    let mut wrong = req("web");
    wrong.container = Some("nope".into());
    assert_eq!(
        rt.pod_log(with_token(wrong, &t)).await.unwrap_err().code(),
        Code::InvalidArgument
    );

    // No container named: the pod's first one, as kubectl picks it.
    let s = within(
        "default container",
        collect(
            rt.pod_log(with_token(req("two"), &t))
                .await
                .unwrap()
                .into_inner(),
        ),
    )
    .await;
    assert_eq!(s, "container first started\n");

    // follow: new lines arrive while the caller stays.
    let mut follow = req("web");
    follow.follow = Some(true);
    follow.tail_lines = Some(0);
    let mut s = rt
        .pod_log(with_token(follow, &t))
        .await
        .unwrap()
        .into_inner();
    let mut seen = String::new();
    for i in 5..=6 {
        env.sim
            .append_log("default", "web", "app", &format!("line {i}"));
        within("followed line", async {
            while !seen.contains(&format!("line {i}\n")) {
                let m = s.next().await.unwrap().unwrap();
                seen.push_str(&String::from_utf8(m.data.unwrap()).unwrap());
            }
        })
        .await;
    }
    assert_eq!(seen, "line 5\nline 6\n");
    drop(s);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_stdin_resize_and_exit_codes() {
    let env = KubeEnv::start(sim_config().pod("default", "web", &["app"])).await;
    let t = env.admin_token().to_owned();
    let c = env.cluster.clone();
    let mut rt = env.runtime();

    // No tty: stdin in, stdout and stderr apart, a non-zero exit is an error with the code.
    let script = "read line; echo \"got $line\"; echo oops >&2; exit 3";
    let mut s = within(
        "exec",
        rt.execute_tty(with_token(
            exec(&c, "web", &["sh", "-c", script], false),
            &t,
        )),
    )
    .await
    .unwrap()
    .into_inner();
    let id = session_id(&mut s).await;
    assert!(
        id.starts_with("edge-1:") && id.len() > "edge-1:".len() + 30,
        "{id}"
    );
    within(
        "write",
        rt.write_tty(with_token(write(&id, Some(b"hello\n")), &t)),
    )
    .await
    .unwrap();
    let (out, err, end) = drain(&mut s).await;
    assert_eq!(out, "got hello\n");
    assert_eq!(err, "oops\n");
    let end = end.unwrap_err();
    assert_eq!(end.code(), Code::Unknown, "{end:?}");
    assert!(end.message().contains("exit code 3"), "{end:?}");
    assert_eq!(end.metadata().get("exit-code").unwrap(), "3");
    // The session is gone with its stream.
    let gone = rt
        .write_tty(with_token(write(&id, Some(b"x")), &t))
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);

    // A tty: resize reaches the pod, stdin EOF (a write without stdin) ends `cat`, exit 0 is OK.
    let mut req = exec(&c, "web", &["cat"], true);
    req.rows = Some(24);
    req.cols = Some(80);
    let mut s = rt
        .execute_tty(with_token(req, &t))
        .await
        .unwrap()
        .into_inner();
    let id = session_id(&mut s).await;
    let resize = |rows: u32, cols: u32| pb::ResizeTtyRequest {
        session_id: Some(id.clone()),
        rows: Some(rows),
        cols: Some(cols),
    };
    rt.resize_tty(with_token(resize(50, 132), &t))
        .await
        .unwrap();
    assert_eq!(
        rt.resize_tty(with_token(resize(70000, 10), &t))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    rt.write_tty(with_token(write(&id, Some(b"typed\n")), &t))
        .await
        .unwrap();
    // A real terminal: it echoes the line (CR LF), then `cat` writes it.
    let mut seen = Vec::new();
    while !seen.ends_with(b"typed\r\ntyped\r\n") && seen.len() < 64 {
        let echoed = within("echo", s.next()).await.unwrap().unwrap();
        seen.extend_from_slice(echoed.stdout.as_deref().unwrap_or_default());
    }
    assert_eq!(String::from_utf8_lossy(&seen), "typed\r\ntyped\r\n");
    rt.write_tty(with_token(write(&id, None), &t))
        .await
        .unwrap();
    let (_, err, end) = drain(&mut s).await;
    assert!(err.is_empty());
    end.unwrap();
    let resizes = env.sim.resizes();
    assert!(
        resizes.contains(&("web".into(), "app".into(), 80, 24)),
        "{resizes:?}"
    );
    assert!(
        resizes.contains(&("web".into(), "app".into(), 132, 50)),
        "{resizes:?}"
    );

    // Without a tty there is nothing to resize.
    let mut s = rt
        .execute_tty(with_token(exec(&c, "web", &["cat"], false), &t))
        .await
        .unwrap()
        .into_inner();
    let id2 = session_id(&mut s).await;
    let e = rt
        .resize_tty(with_token(
            pb::ResizeTtyRequest {
                session_id: Some(id2.clone()),
                rows: Some(10),
                cols: Some(10),
            },
            &t,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    rt.write_tty(with_token(write(&id2, None), &t))
        .await
        .unwrap();
    drain(&mut s).await.2.unwrap();

    // Failures before the session: unknown pod, bad input.
    let e = rt
        .execute_tty(with_token(exec(&c, "nope", &["true"], false), &t))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = rt
        .execute_tty(with_token(exec(&c, "web", &[], false), &t))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let mut big = exec(&c, "web", &["true"], true);
    big.rows = Some(65536);
    assert_eq!(
        rt.execute_tty(with_token(big, &t))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_belong_to_their_user_and_are_bounded() {
    let cfg = sim_config().pod("default", "web", &["app"]).allow(
        "group:otter:default:devs",
        &["*"],
        &["pods", "pods/exec", "pods/portforward"],
        &["default"],
    );
    let env = KubeEnv::start_with(cfg, |s| {
        s.runtime.sessions.max_exec = 2;
        s.runtime.sessions.max_port_forward = 1;
    })
    .await;
    let c = env.cluster.clone();
    let alice = env.token_for("alice", &["devs"]);
    let bob = env.token_for("bob", &["devs"]);
    let mut rt = env.runtime();

    let mut a1 = rt
        .execute_tty(with_token(exec(&c, "web", &["cat"], false), &alice))
        .await
        .unwrap()
        .into_inner();
    let id = session_id(&mut a1).await;
    // Bob may exec himself, but not type into Alice's shell.
    let denied = rt
        .write_tty(with_token(write(&id, Some(b"rm -rf /\n")), &bob))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    let denied = rt
        .resize_tty(with_token(
            pb::ResizeTtyRequest {
                session_id: Some(id.clone()),
                rows: Some(1),
                cols: Some(1),
            },
            &bob,
        ))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let denied = rt
        .write_port_forward(with_token(
            pb::WritePortForwardRequest {
                session_id: Some(id.clone()),
                data: Some(b"x".to_vec()),
            },
            &bob,
        ))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    rt.write_tty(with_token(write(&id, Some(b"mine\n")), &alice))
        .await
        .unwrap();
    let m = within("alice's echo", a1.next()).await.unwrap().unwrap();
    assert_eq!(m.stdout.as_deref(), Some(&b"mine\n"[..]));
    // Unknown and malformed ids.
    let unknown = rt
        .write_tty(with_token(write("edge-1:0000", Some(b"x")), &alice))
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);

    // At most two exec sessions on this agent.
    let mut b1 = rt
        .execute_tty(with_token(exec(&c, "web", &["cat"], false), &bob))
        .await
        .unwrap()
        .into_inner();
    session_id(&mut b1).await;
    let full = rt
        .execute_tty(with_token(exec(&c, "web", &["cat"], false), &bob))
        .await
        .unwrap_err();
    assert_eq!(full.code(), Code::ResourceExhausted, "{full:?}");
    // Ending a stream ends its session; the slot is free again.
    drop(a1);
    within("slot freed", async {
        loop {
            match rt
                .execute_tty(with_token(exec(&c, "web", &["cat"], false), &bob))
                .await
            {
                Ok(s) => {
                    let mut s = s.into_inner();
                    session_id(&mut s).await;
                    return s;
                }
                Err(e) => {
                    assert_eq!(e.code(), Code::ResourceExhausted);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    })
    .await;
    let gone = rt
        .write_tty(with_token(write(&id, Some(b"x")), &alice))
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_are_reaped() {
    let env = KubeEnv::start_with(sim_config().pod("default", "web", &["app"]), |s| {
        s.runtime.sessions.idle = Duration::from_millis(600);
    })
    .await;
    let t = env.admin_token().to_owned();
    let c = env.cluster.clone();
    let mut rt = env.runtime();
    let mut s = rt
        .execute_tty(with_token(exec(&c, "web", &["sleep", "30"], false), &t))
        .await
        .unwrap()
        .into_inner();
    let id = session_id(&mut s).await;
    let started = std::time::Instant::now();
    let end = drain(&mut s).await.2.unwrap_err();
    assert_eq!(end.code(), Code::DeadlineExceeded, "{end:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        rt.write_tty(with_token(write(&id, Some(b"x")), &t))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    env.shutdown().await;
}

/// FNV-1a, to compare what went out with what came back.
fn fnv(hash: &mut u64, data: &[u8]) {
    for b in data {
        *hash ^= u64::from(*b);
        *hash = hash.wrapping_mul(0x100000001b3);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_round_trips_bytes_and_reports_pod_errors_over_h2() {
    port_forward(TransportKind::H2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_round_trips_bytes_and_reports_pod_errors_over_quic() {
    port_forward(TransportKind::Quic).await;
}

async fn port_forward(transport: TransportKind) {
    let env = KubeEnv::start_over(
        transport,
        sim_config().pod("default", "web", &["app"]),
        |_| {},
    )
    .await;
    let t = env.admin_token().to_owned();
    let c = env.cluster.clone();
    env.sim
        .add_pod_port("default", "web", 8080, echo_server().await);
    let mut rt = env.runtime();
    let pf = |port: i32| pb::PortForwardRequest {
        cluster: Some(c.clone()),
        namespace: Some("default".into()),
        name: Some("web".into()),
        port: Some(port),
    };
    let mut s = within("port-forward", rt.port_forward(with_token(pf(8080), &t)))
        .await
        .unwrap()
        .into_inner();
    let first = within("session id", s.next()).await.unwrap().unwrap();
    assert!(first.data.is_none());
    let id = first.session_id.unwrap();
    let send = |data: Vec<u8>| pb::WritePortForwardRequest {
        session_id: Some(id.clone()),
        data: Some(data),
    };
    rt.write_port_forward(with_token(send(b"ping".to_vec()), &t))
        .await
        .unwrap();
    let mut back = Vec::new();
    within("echo", async {
        while back.len() < 4 {
            back.extend(s.next().await.unwrap().unwrap().data.unwrap());
        }
    })
    .await;
    assert_eq!(back, b"ping");

    // 64 MiB each way, checksummed.
    const TOTAL: usize = 64 * 1024 * 1024;
    const CHUNK: usize = 256 * 1024;
    let writer = {
        let mut rt = env.runtime();
        let (t, send_id) = (t.clone(), id.clone());
        tokio::spawn(async move {
            let mut hash = 0xcbf29ce484222325u64;
            let mut x = 0x9e3779b97f4a7c15u64;
            for _ in 0..TOTAL / CHUNK {
                let mut chunk = vec![0u8; CHUNK];
                for b in chunk.iter_mut() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    *b = x as u8;
                }
                fnv(&mut hash, &chunk);
                let req = pb::WritePortForwardRequest {
                    session_id: Some(send_id.clone()),
                    data: Some(chunk),
                };
                rt.write_port_forward(with_token(req, &t)).await.unwrap();
            }
            hash
        })
    };
    let started = std::time::Instant::now();
    let (mut got, mut hash) = (0usize, 0xcbf29ce484222325u64);
    tokio::time::timeout(Duration::from_secs(60), async {
        while got < TOTAL {
            let data = s
                .next()
                .await
                .expect("stream open")
                .expect("data")
                .data
                .unwrap();
            fnv(&mut hash, &data);
            got += data.len();
        }
    })
    .await
    .expect("64 MiB echoed within a minute");
    let sent = within("writer", writer).await.unwrap();
    assert_eq!(got, TOTAL);
    assert_eq!(hash, sent, "checksums differ");
    eprintln!(
        "64 MiB echoed through hub and tunnel ({transport}) in {:?}",
        started.elapsed()
    );
    drop(s);

    // The pod cannot connect to the port: an error, not a silent close.
    let mut s = rt
        .port_forward(with_token(pf(9999), &t))
        .await
        .unwrap()
        .into_inner();
    let first = within("session id", s.next()).await.unwrap().unwrap();
    assert!(first.session_id.is_some());
    let end = within("pod error", async {
        loop {
            match s.next().await {
                Some(Ok(_)) => continue,
                Some(Err(e)) => return e,
                None => panic!("port-forward ended without the pod's error"),
            }
        }
    })
    .await;
    assert_eq!(end.code(), Code::Unavailable, "{end:?}");
    assert!(end.message().contains("9999"), "{end:?}");
    assert_eq!(
        rt.port_forward(with_token(pf(0), &t))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_restart_and_subresource_actions() {
    let env = KubeEnv::start(sim_config()).await;
    let t = env.admin_token().to_owned();
    let c = env.cluster.clone();
    env.sim
        .create_object(serde_json::json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "d1", "namespace": "default"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "d1"}},
                     "template": {"metadata": {"labels": {"app": "d1"}},
                                  "spec": {"containers": [{"name": "app", "image": "app:1"}]}}}
        }))
        .expect("deployment");
    let mut rt = env.runtime();
    let scale = |n: Option<i32>| pb::ScaleRequest {
        cluster: Some(c.clone()),
        group: Some("apps".into()),
        version: Some("v1".into()),
        resource: Some("deployments".into()),
        namespace: Some("default".into()),
        name: Some("d1".into()),
        replicas: n,
    };
    let r = within("scale", rt.scale(with_token(scale(Some(3)), &t)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.replicas, Some(3));
    let stored = env
        .sim
        .object("apps", "deployments", "default", "d1")
        .unwrap();
    assert_eq!(stored["spec"]["replicas"], 3);
    let r = rt
        .scale(with_token(scale(Some(0)), &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.replicas, Some(0));
    assert_eq!(
        rt.scale(with_token(scale(Some(-1)), &t))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    assert_eq!(
        rt.scale(with_token(scale(None), &t))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    let mut cm = scale(Some(1));
    cm.group = Some(String::new());
    cm.resource = Some("configmaps".into());
    assert_eq!(
        rt.scale(with_token(cm, &t)).await.unwrap_err().code(),
        Code::InvalidArgument
    );

    let restart = pb::RestartRequest {
        cluster: Some(c.clone()),
        group: Some("apps".into()),
        version: Some("v1".into()),
        resource: Some("deployments".into()),
        namespace: Some("default".into()),
        name: Some("d1".into()),
    };
    within("restart", rt.restart(with_token(restart.clone(), &t)))
        .await
        .unwrap();
    let stored = env
        .sim
        .object("apps", "deployments", "default", "d1")
        .unwrap();
    let at =
        stored["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"]
            .as_str()
            .expect("restartedAt annotation");
    assert!(at.ends_with('Z') && at.contains('T'), "{at}");
    assert_eq!(
        stored["spec"]["template"]["metadata"]["labels"]["app"], "d1",
        "labels kept"
    );
    let mut missing = restart.clone();
    missing.name = Some("nope".into());
    assert_eq!(
        rt.restart(with_token(missing, &t))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    env.sim
        .create_object(serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "plain", "namespace": "default"}}))
        .unwrap();
    let mut not_workload = restart;
    not_workload.group = Some(String::new());
    not_workload.resource = Some("configmaps".into());
    not_workload.name = Some("plain".into());
    let e = rt.restart(with_token(not_workload, &t)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("spec.template"), "{e:?}");

    // PUT to the status subresource; the result comes back as a Struct.
    let mut obj = env
        .sim
        .object("apps", "deployments", "default", "d1")
        .unwrap();
    obj["status"] = serde_json::json!({"observedGeneration": 7, "replicas": 0});
    let action = |method: &str, sub: &str, body: Vec<u8>| pb::SubResourceActionRequest {
        cluster: Some(c.clone()),
        group: Some("apps".into()),
        version: Some("v1".into()),
        resource: Some("deployments".into()),
        namespace: Some("default".into()),
        name: Some("d1".into()),
        subresource: Some(sub.into()),
        method: Some(method.into()),
        body: Some(body),
    };
    let r = within(
        "subresource PUT",
        rt.sub_resource_action(with_token(
            action("PUT", "status", obj.to_string().into_bytes()),
            &t,
        )),
    )
    .await
    .unwrap()
    .into_inner();
    let result = r.result.unwrap();
    let kind = result.fields.get("kind").and_then(|v| v.kind.clone());
    assert_eq!(
        kind,
        Some(prost_types::value::Kind::StringValue("Deployment".into()))
    );
    assert!(
        !result
            .fields
            .get("metadata")
            .map(|m| format!("{m:?}"))
            .unwrap_or_default()
            .contains("managedFields")
    );
    let e = rt
        .sub_resource_action(with_token(action("GET", "status", Vec::new()), &t))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("PUT or POST"), "{e:?}");
    let e = rt
        .sub_resource_action(with_token(action("POST", "status", b"{nope".to_vec()), &t))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = rt
        .sub_resource_action(with_token(action("POST", "frobnicate", b"{}".to_vec()), &t))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    // POST: an eviction of a pod.
    env.sim
        .create_object(serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "victim", "namespace": "default"},
            "spec": {"containers": [{"name": "app", "image": "app:1"}]}}))
        .unwrap();
    let mut evict = action(
        "POST",
        "eviction",
        serde_json::json!({"apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": "victim", "namespace": "default"}, "deleteOptions": {"gracePeriodSeconds": 0}})
        .to_string()
        .into_bytes(),
    );
    evict.group = Some(String::new());
    evict.resource = Some("pods".into());
    evict.name = Some("victim".into());
    within("eviction", rt.sub_resource_action(with_token(evict, &t)))
        .await
        .unwrap();
    within("pod evicted", async {
        while env.sim.object("", "pods", "default", "victim").is_some() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_falls_back_to_v4_with_an_older_kubelet() {
    let env = KubeEnv::start(
        sim_config()
            .pod("default", "web", &["app"])
            .exec_v4_only(true),
    )
    .await;
    let t = env.admin_token().to_owned();
    let c = env.cluster.clone();
    let mut rt = env.runtime();
    let mut s = within(
        "exec",
        rt.execute_tty(with_token(
            exec(
                &c,
                "web",
                &["sh", "-c", "read l; echo \"v4 $l\"; exit 0"],
                false,
            ),
            &t,
        )),
    )
    .await
    .unwrap()
    .into_inner();
    let id = session_id(&mut s).await;
    rt.write_tty(with_token(write(&id, Some(b"works\n")), &t))
        .await
        .unwrap();
    let (out, _, end) = drain(&mut s).await;
    assert_eq!(out, "v4 works\n");
    end.unwrap();
    env.shutdown().await;
}

/// `WritePortForward` answered by the hub once queued: while the path to
/// the cluster stalls (a relay holding every byte, nothing lost), writes after
/// the session's first are answered at once; a session's queue is bounded
/// (a write beyond it waits); when the path moves again every byte reaches
/// the pod once, in order. Another user's write to the session is never
/// answered from the queue, and after the session ends, writes fail.
async fn queued_port_forward_writes(transport: TransportKind) {
    let (relay, env) = KubeEnv::behind_relay(
        transport,
        sim_config().pod("default", "web", &["app"]),
        |_| {},
    )
    .await;
    let t = env.admin_token().to_owned();
    let bob = env.token_for("bob", &["devs"]);
    env.sim
        .add_pod_port("default", "web", 8080, echo_server().await);
    let mut rt = env.runtime();
    let (mut s, id) = env.port_forward(&mut rt, &t, "web", 8080).await;
    let send = |data: &[u8]| pb::WritePortForwardRequest {
        session_id: Some(id.clone()),
        data: Some(data.to_vec()),
    };
    let mut expected = b"first;".to_vec();
    rt.write_port_forward(with_token(send(b"first;"), &t))
        .await
        .unwrap();

    relay.hold(true);
    for i in 0..20 {
        let piece = format!("{i};");
        within(
            "a queued write is answered while the cluster is out of reach",
            rt.write_port_forward(with_token(send(piece.as_bytes()), &t)),
        )
        .await
        .unwrap();
        expected.extend_from_slice(piece.as_bytes());
    }
    // Bob's first write goes through to the agent, which is out of reach:
    // no answer comes from the queue for him. He gives up while his request
    // is still on its way (over HTTP/2 the agent then finds the stream
    // reset before it takes it: that ends the stream, not the tunnel).
    let bobs = tokio::time::timeout(
        Duration::from_millis(300),
        rt.write_port_forward(with_token(send(b"bob"), &bob)),
    )
    .await;
    assert!(bobs.is_err(), "bob's write was answered: {bobs:?}");
    // 4 MiB queue per session: three 1 MiB writes fit, a fourth waits.
    let mib = vec![b'x'; 1024 * 1024];
    for _ in 0..3 {
        within(
            "a 1 MiB write",
            rt.write_port_forward(with_token(send(&mib), &t)),
        )
        .await
        .unwrap();
        expected.extend_from_slice(&mib);
    }
    let full = tokio::time::timeout(
        Duration::from_millis(300),
        rt.write_port_forward(with_token(send(&mib), &t)),
    )
    .await;
    assert!(
        full.is_err(),
        "a write beyond the queue was answered: {full:?}"
    );
    relay.hold(false);

    let mut back = Vec::new();
    within("every queued byte echoed", async {
        while back.len() < expected.len() {
            back.extend(s.next().await.unwrap().unwrap().data.unwrap_or_default());
        }
    })
    .await;
    assert!(back == expected, "bytes arrived out of order or changed");
    let denied = within(
        "bob's write",
        rt.write_port_forward(with_token(send(b"bob"), &bob)),
    )
    .await
    .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");

    // The session ends: writes fail (the first may still be queued).
    drop(s);
    let failed = within("a write after the session ended fails", async {
        loop {
            if let Err(e) = rt.write_port_forward(with_token(send(b"late"), &t)).await {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(failed.code(), Code::NotFound, "{failed:?}");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_port_forward_writes_over_quic() {
    queued_port_forward_writes(TransportKind::Quic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_port_forward_writes_over_h2() {
    queued_port_forward_writes(TransportKind::H2).await;
}
