//! Plain kubectl through the hub: `otter kubeconfig` writes the context,
//! kubectl 1.33 talks to `/clusters/edge-1/…` on the hub, the request rides
//! a tunnel stream to the agent, and the agent sends it to the cluster's
//! apiserver (the test server) impersonating the caller, so the cluster's
//! RBAC decides.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use otter_e2e::{
    TestHub,
    double::{WAIT, wait_connected},
    kubectl_133, run_bounded, run_for, tool_missing,
};

use crate::otter;

/// Runs the `otter` CLI with its config in `dir`.
fn otter_in(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let mut cmd = std::process::Command::new(otter());
    cmd.args(args).env("OTTER_CONFIG", dir.join("otter.toml"));
    run_bounded(&mut cmd, Duration::from_secs(60))
}

/// The member cluster's rules: hub admins may do anything, bob only read
/// pods; one pod, web-0, with a container `web`.
fn admins_and_bob() -> kube_sim::SimConfig {
    kube_sim::SimConfig::default_with_admin()
        .allow("group:otter:default:admins", &["*"], &["*"], &["*"])
        .allow(
            "user:otter:bob",
            &["get", "list", "watch"],
            &["pods"],
            &["default"],
        )
        .pod("default", "web-0", &["web"])
}

/// A member cluster (the test server with `cfg`) and its agent, connected
/// to `hub`, with the Kubernetes API proxy on.
async fn start_edge(
    hub: &TestHub,
    cfg: kube_sim::SimConfig,
) -> (kube_sim::KubeSim, otter_agent::Agent) {
    let sim = kube_sim::KubeSim::start(cfg).await.unwrap();
    let join = hub.hub.mint_join_token("edge-1").unwrap();
    // The agent talks to its apiserver with its own (impersonating) identity.
    let kubeconfig =
        kube::config::Kubeconfig::from_yaml(&sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN)).unwrap();
    let kcfg = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let proxy = otter_agent::kube_proxy::KubeProxy::new(kube::Client::try_from(kcfg).unwrap());
    let mut config = otter_agent::AgentConfig::new(hub.api_url(), "edge-1", "a1", hub.hub.ca_pem());
    config.join_token = otter_agent::config::Secret(join);
    let agent = otter_agent::Agent::start_with_proxy(
        config,
        tonic::service::Routes::default(),
        Some(proxy),
    )
    .unwrap();
    agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("agent connects");
    wait_connected(&hub.channel().await, &hub.admin_token, 1).await;
    (sim, agent)
}

/// Logs the CLI in as the hub admin (config in `dir`) and writes a
/// kubeconfig for edge-1 there with `otter kubeconfig`; returns its path.
async fn write_kubeconfig(hub: &TestHub, dir: &Path) -> PathBuf {
    let data = hub.data_dir();
    let url = hub.api_url().to_string();
    let kube_path = dir.join("kubeconfig");
    let (d, kp) = (dir.to_owned(), kube_path.clone());
    tokio::task::spawn_blocking(move || {
        let (code, _, err) = otter_in(
            &d,
            &[
                "login",
                "--hub",
                &url,
                "--token-file",
                data.join("admin-token").to_str().unwrap(),
                "--ca-file",
                data.join("ca.crt").to_str().unwrap(),
            ],
        );
        assert_eq!(code, 0, "{err}");
        let (code, out, err) = otter_in(
            &d,
            &[
                "kubeconfig",
                "--cluster",
                "edge-1",
                "--kubeconfig",
                kp.to_str().unwrap(),
            ],
        );
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("otter-edge-1"), "{out}");
    })
    .await
    .unwrap();
    kube_path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_through_the_hub() {
    let Some(kubectl) = kubectl_133() else {
        tool_missing("kubectl 1.33");
        return;
    };
    let cfg = admins_and_bob();
    let hub = TestHub::start().await;
    let (sim, agent) = start_edge(&hub, cfg).await;

    let dir = tempfile::tempdir().unwrap();
    let kube_path = write_kubeconfig(&hub, dir.path()).await;
    let bob = hub.hub.mint_api_token("bob", &["devs".into()]).unwrap();
    let sim_handle = &sim;
    let (d, kp) = (dir.path().to_owned(), kube_path.clone());
    let otter_cmd = move |args: &[&str]| otter_in(&d, args);
    let k = move |args: &[&str]| {
        let mut cmd = std::process::Command::new(&kubectl);
        cmd.arg("--kubeconfig").arg(&kp).args(args);
        cmd
    };

    let outputs = tokio::task::block_in_place(|| {
        let run = |args: &[&str]| run_bounded(&mut k(args), Duration::from_secs(60));
        // Discovery (aggregated), list.
        let (code, out, err) = run(&["get", "pods", "-A"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("web-0"), "{out}");
        // Server-side apply, patch, delete.
        let cm = r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"cm1","namespace":"default"},"data":{"k":"v1"}}"#;
        let cm_file = dir.path().join("cm.json");
        std::fs::write(&cm_file, cm).unwrap();
        let (code, out, err) = run(&["apply", "--server-side", "-f", cm_file.to_str().unwrap()]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("configmap/cm1 serverside-applied"), "{out}");
        let (code, out, err) = run(&[
            "patch",
            "configmap",
            "cm1",
            "--type",
            "merge",
            "-p",
            r#"{"data":{"k":"v2"}}"#,
        ]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("configmap/cm1 patched"), "{out}");
        let (code, out, _) = run(&["get", "configmap", "cm1", "-o", "jsonpath={.data.k}"]);
        assert_eq!((code, out.as_str()), (0, "v2"));
        // Workloads: create, scale, rollout restart.
        let (code, _, err) = run(&["create", "deployment", "web", "--image=nginx"]);
        assert_eq!(code, 0, "{err}");
        let (code, out, err) = run(&["scale", "deployment", "web", "--replicas=3"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("deployment.apps/web scaled"), "{out}");
        let (code, out, err) = run(&["rollout", "restart", "deployment", "web"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("restarted"), "{out}");
        let (code, out, _) = run(&["delete", "configmap", "cm1"]);
        assert_eq!(code, 0);
        assert!(out.contains("deleted"), "{out}");

        // Who the cluster sees: the hub's verified caller, impersonated.
        let (code, out, err) = run(&["auth", "whoami"]);
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains("admin") && out.contains("otter:default:admins"),
            "{out}"
        );

        // Watch and follow, for a bounded time, while things happen.
        let watcher = std::thread::spawn({
            let mut cmd = k(&["get", "pods", "-w"]);
            move || run_for(&mut cmd, Duration::from_secs(4))
        });
        std::thread::sleep(Duration::from_millis(1500));
        let pod = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"late","namespace":"default"},"spec":{"containers":[{"name":"c","image":"x"}]}}"#;
        let pod_file = dir.path().join("pod.json");
        std::fs::write(&pod_file, pod).unwrap();
        let (code, _, err) = run(&["create", "-f", pod_file.to_str().unwrap()]);
        assert_eq!(code, 0, "{err}");
        let (watched, _) = watcher.join().unwrap();
        assert!(
            watched.contains("web-0") && watched.contains("late"),
            "get -w saw: {watched}"
        );
        let follower = std::thread::spawn({
            let mut cmd = k(&["logs", "-f", "web-0"]);
            move || run_for(&mut cmd, Duration::from_secs(3))
        });
        std::thread::sleep(Duration::from_millis(1000));
        sim_handle.append_log("default", "web-0", "web", "hello through the hub");
        let (logs, _) = follower.join().unwrap();
        assert!(
            logs.contains("hello through the hub"),
            "logs -f saw: {logs:?}"
        );

        // A forbidden action fails the usual way, with the cluster's message.
        let (code, _, err) = run(&["--token", &bob, "get", "secrets"]);
        assert_ne!(code, 0);
        assert!(
            err.contains("Forbidden")
                && err.contains("User \"otter:bob\" cannot list resource \"secrets\""),
            "{err}"
        );
        let (code, out, _) = run(&["--token", &bob, "get", "pods"]);
        assert_eq!(code, 0);
        assert!(out.contains("web-0"));
        // A client cannot pick its identity: kubectl's --as is dropped at the hub.
        let (code, out, _) = run(&["--token", &bob, "auth", "whoami", "--as", "admin"]);
        assert!(
            code != 0 || !out.contains("otter:default:admins"),
            "impersonation headers passed through: {out}"
        );
        // The same through the exec credential plugin (`otter token get`).
        let exec_kube = dir.path().join("kubeconfig-exec");
        let (code, _, err) = otter_cmd(&[
            "kubeconfig",
            "--cluster",
            "edge-1",
            "--exec-plugin",
            "--kubeconfig",
            exec_kube.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        let text = std::fs::read_to_string(&exec_kube).unwrap();
        assert!(
            text.contains("exec:") && !text.contains("ots_"),
            "no token stored with the plugin: {text}"
        );
        let mut with_plugin = std::process::Command::new(kubectl_133().unwrap());
        with_plugin
            .arg("--kubeconfig")
            .arg(&exec_kube)
            .args(["get", "pods"]);
        let (code, out, err) = run_bounded(&mut with_plugin, Duration::from_secs(60));
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("web-0"), "{out}");

        // A bad token is refused at the hub.
        let (code, _, err) = run(&["--token", "ots_0000000000000000_bad", "get", "pods"]);
        assert_ne!(code, 0);
        assert!(
            err.contains("Unauthorized") || err.contains("logged in"),
            "{err}"
        );
        watched
    });
    assert!(!outputs.is_empty());
    // The agent gone: kubectl prints the hub's own words (a Status), not
    // only "the server is currently unable to handle the request".
    agent.shutdown().await;
    let (code, _, err) = tokio::task::block_in_place(|| {
        let mut cmd = std::process::Command::new(kubectl_133().unwrap());
        cmd.arg("--kubeconfig")
            .arg(&kube_path)
            .args(["get", "pods"]);
        run_bounded(&mut cmd, Duration::from_secs(60))
    });
    assert_ne!(code, 0);
    assert!(
        err.contains("cluster edge-1 is offline") && err.contains("ServiceUnavailable"),
        "{err}"
    );
    sim.shutdown().await;
    hub.hub.shutdown().await;
}

/// A TCP server answering every read with `<prefix><bytes>`, for as long
/// as the connection lasts; stands behind a pod's forwarded port.
async fn echo_server(prefix: &'static [u8]) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(&[prefix, &buf[..n]].concat()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, task)
}

/// Waits (bounded) until the hub counts no upgraded connection for the
/// default tenant's hub user `user`: every relay ended and freed its slot.
async fn wait_no_upgrades(hub: &TestHub, user: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let user = format!("{}{user}", otter_hub::auth::HUB_USER_PREFIX);
    let count = || {
        hub.hub
            .state
            .upgrades
            .user_count(otter_hub::tenancy::DEFAULT_TENANT, &user)
    };
    while count() != 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "upgraded connections of {user} still counted: {}",
            count()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// exec, cp and port-forward are HTTP/1.1 upgrades (WebSocket here) the hub
/// relays byte for byte over a tunnel stream: kubectl 1.33's exec and cp, and
/// the Python client's exec and port-forward, through `/clusters/edge-1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_cp_and_port_forward_through_the_hub() {
    let Some(kubectl) = kubectl_133() else {
        tool_missing("kubectl 1.33");
        return;
    };
    let Some(python) = otter_e2e::tools::venv_python() else {
        tool_missing("the project's Python venv");
        return;
    };
    let cfg = admins_and_bob();
    let hub = TestHub::start().await;
    let (sim, agent) = start_edge(&hub, cfg).await;
    let (echo_addr, echo) = echo_server(b"echo: ").await;
    sim.add_pod_port("default", "web-0", 8080, echo_addr);
    let dir = tempfile::tempdir().unwrap();
    let kube_path = write_kubeconfig(&hub, dir.path()).await;
    let bob = hub.hub.mint_api_token("bob", &["devs".into()]).unwrap();
    let k = |args: &[&str]| {
        let mut cmd = std::process::Command::new(&kubectl);
        cmd.arg("--kubeconfig").arg(&kube_path).args(args);
        cmd
    };

    tokio::task::block_in_place(|| {
        // stdin in; stdout, stderr and the exit code out.
        let (code, out, err) = otter_e2e::run_bounded_with_input(
            &mut k(&[
                "exec",
                "-i",
                "web-0",
                "-c",
                "web",
                "--",
                "sh",
                "-c",
                "tr a-z A-Z; echo to-stderr >&2; exit 3",
            ]),
            Some(b"shout through the hub\n".to_vec()),
            Duration::from_secs(60),
        );
        assert_eq!(code, 3, "kubectl's exit code is the command's: {out} {err}");
        assert_eq!(out, "SHOUT THROUGH THE HUB\n");
        assert!(err.contains("to-stderr"), "{err}");

        // exec -it: a terminal, typed input, a window resize, the exit code.
        let script = otter_e2e::tools::workspace_root().join("tests/e2e/clients/pty_exec.py");
        let mut py = std::process::Command::new(&python);
        py.arg(&script)
            .arg(&kubectl)
            .arg("--kubeconfig")
            .arg(&kube_path)
            .args(["exec", "-it", "web-0", "-c", "web", "--", "sh"]);
        let (code, out, err) = run_bounded(&mut py, Duration::from_secs(60));
        assert_eq!(code, 0, "{out}{err}");
        let tty: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        assert!(
            tty["output"].as_str().unwrap().contains("hi-from-the-pty"),
            "{tty}"
        );
        assert_eq!(tty["code"], 3, "kubectl's exit code is the shell's: {tty}");
        assert_eq!(tty["prompt"], true, "a prompt on the pod's terminal: {tty}");
        assert!(
            tty["tty"].as_str().unwrap().starts_with("/dev/pts/"),
            "`tty` names a terminal: {tty}"
        );
        let resizes = sim.resizes();
        assert!(
            resizes.iter().any(|(_, _, w, h)| (*w, *h) == (132, 40)),
            "the resize reached the pod: {resizes:?}"
        );

        // cp is tar over exec, both ways; 1 MiB of varied bytes.
        let payload: Vec<u8> = (0..1024 * 1024u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let local = dir.path().join("payload.bin");
        std::fs::write(&local, &payload).unwrap();
        // The test server runs the pod's commands on this machine, in the
        // pod's own folder; its /tmp is that folder's `tmp` where the server
        // may make a mount namespace (as root), else the machine's, which a
        // relative path keeps clear of.
        let (pod_dir, private_tmp) = sim.pod_dir("default", "web-0").unwrap();
        let (remote, landed) = match private_tmp {
            true => ("web-0:/tmp/in-pod.bin", pod_dir.join("tmp/in-pod.bin")),
            false => {
                eprintln!(
                    "the pod's /tmp is the machine's here (no mount namespace): copying to a relative path"
                );
                ("web-0:in-pod.bin", pod_dir.join("in-pod.bin"))
            }
        };
        let (code, _, err) = run_bounded(
            &mut k(&["cp", "-c", "web", local.to_str().unwrap(), remote]),
            Duration::from_secs(60),
        );
        assert_eq!(code, 0, "{err}");
        assert!(std::fs::read(&landed).unwrap() == payload);
        let back = dir.path().join("back.bin");
        let (code, _, err) = run_bounded(
            &mut k(&["cp", "-c", "web", remote, back.to_str().unwrap()]),
            Duration::from_secs(60),
        );
        assert_eq!(code, 0, "{err}");
        assert!(
            std::fs::read(&back).unwrap() == payload,
            "cp changed the bytes"
        );

        // RBAC still decides: bob may read pods but not exec into them.
        let (code, _, err) = run_bounded(
            &mut k(&["--token", &bob, "exec", "web-0", "-c", "web", "--", "true"]),
            Duration::from_secs(60),
        );
        assert_ne!(code, 0);
        assert!(
            err.contains("Forbidden") || err.contains("forbidden"),
            "{err}"
        );

        // The Python client: exec over WebSocket and port-forward to the echo server.
        let script =
            otter_e2e::tools::workspace_root().join("tests/e2e/clients/kube_proxy_client.py");
        let mut py = std::process::Command::new(&python);
        py.arg(script)
            .arg(&kube_path)
            .args(["web-0", "web", "8080"])
            .env("HOME", dir.path());
        let (code, out, err) = run_bounded(&mut py, Duration::from_secs(90));
        assert_eq!(code, 0, "{out}{err}");
        let seen: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        assert_eq!(seen["exec_stdout"], "typed through the hub\n", "{seen}");
        assert_eq!(seen["exit_stdout"], "out\n", "{seen}");
        assert_eq!(seen["exit_stderr"], "err\n", "{seen}");
        assert_eq!(seen["exit_code"], 3, "{seen}");
        assert_eq!(
            seen["forwarded"],
            serde_json::json!(["echo: one", "echo: two", "echo: three"]),
            "{seen}"
        );
        assert!(seen["forward_error"].is_null(), "{seen}");
    });
    // Every relayed connection ended and gave back its slot.
    wait_no_upgrades(&hub, "admin").await;
    echo.abort();
    agent.shutdown().await;
    sim.shutdown().await;
    hub.hub.shutdown().await;
}

type ExecSocket =
    tokio_tungstenite::WebSocketStream<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;

/// Opens `cat` in web-0 over WebSocket (v5.channel.k8s.io) through the hub
/// as the holder of `token`; the hub's refusal comes back as its HTTP
/// status and body.
async fn ws_exec(hub: &TestHub, token: &str) -> Result<ExecSocket, (u16, String)> {
    use tokio_tungstenite::tungstenite::{self, client::IntoClientRequest};
    otter_pki::tls::install_default_provider();
    let tls = otter_pki::tls::client_config(hub.hub.ca_pem(), None, &[b"http/1.1"]).unwrap();
    let tcp = tokio::net::TcpStream::connect(hub.hub.api_addr)
        .await
        .unwrap();
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    let url = format!(
        "wss://localhost:{}/clusters/edge-1/api/v1/namespaces/default/pods/web-0/exec?container=web&command=cat&stdin=true&stdout=true",
        hub.hub.api_addr.port()
    );
    let mut req = url.into_client_request().unwrap();
    req.headers_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    req.headers_mut().insert(
        "sec-websocket-protocol",
        "v5.channel.k8s.io".parse().unwrap(),
    );
    match tokio_tungstenite::client_async(req, tls).await {
        Ok((ws, _)) => Ok(ws),
        Err(tungstenite::Error::Http(resp)) => Err((
            resp.status().as_u16(),
            String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default()).into_owned(),
        )),
        Err(e) => panic!("exec upgrade failed: {e}"),
    }
}

/// Types `line` on the exec's stdin (channel 0) and waits (bounded) for it
/// on stdout (channel 1): `cat` through the relay.
async fn echo_line(ws: &mut ExecSocket, line: &str) {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    ws.send(Message::binary([&[0u8][..], line.as_bytes()].concat()))
        .await
        .unwrap();
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while got != line.as_bytes() {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .expect("stdout in time")
            .expect("connection open")
            .unwrap();
        if let Message::Binary(b) = msg
            && b.first() == Some(&1)
        {
            got.extend_from_slice(&b[1..]);
        }
    }
}

/// Upgraded connections are bounded per user and per cluster (429 beyond,
/// with kubectl's usual Status), give their slot back when they end, and
/// are closed after the configured silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgraded_connections_are_bounded_and_idle_ones_closed() {
    use futures::StreamExt;
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| {
        c.kube_upgrades = otter_hub::config::KubeUpgradeLimits {
            per_user: 1,
            per_cluster: 2,
            idle_timeout: Duration::from_secs(3),
        };
    })
    .await;
    let cfg = kube_sim::SimConfig::default_with_admin()
        .allow("group:otter:default:admins", &["*"], &["*"], &["*"])
        .allow("user:otter:carol", &["*"], &["*"], &["*"])
        .allow("user:otter:dave", &["*"], &["*"], &["*"])
        .pod("default", "web-0", &["web"]);
    let (sim, agent) = start_edge(&hub, cfg).await;
    let carol = hub.hub.mint_api_token("carol", &[]).unwrap();
    let dave = hub.hub.mint_api_token("dave", &[]).unwrap();

    let mut first = ws_exec(&hub, &hub.admin_token).await.expect("first exec");
    echo_line(&mut first, "ping\n").await;
    // The user's bound.
    let (code, body) = ws_exec(&hub, &hub.admin_token).await.unwrap_err();
    assert_eq!(code, 429, "{body}");
    assert!(
        body.contains("TooManyRequests") && body.contains("this user"),
        "{body}"
    );
    // The cluster's bound: carol fits, dave does not.
    let mut second = ws_exec(&hub, &carol).await.expect("carol's exec");
    echo_line(&mut second, "from carol\n").await;
    echo_line(&mut first, "still here\n").await;
    let (code, body) = ws_exec(&hub, &dave).await.unwrap_err();
    assert_eq!(code, 429, "{body}");
    assert!(body.contains("this cluster"), "{body}");
    assert_eq!(hub.hub.state.metrics.kube_upgraded.get(), 2);
    // Counted under the name the wait below looks for, so that wait
    // cannot pass on a key that never existed.
    let admin = format!("{}admin", otter_hub::auth::HUB_USER_PREFIX);
    let tenant = otter_hub::tenancy::DEFAULT_TENANT;
    assert_eq!(hub.hub.state.upgrades.user_count(tenant, &admin), 1);

    // Closing one frees its slot.
    first.close(None).await.unwrap();
    drop(first);
    wait_no_upgrades(&hub, "admin").await;
    let mut again = ws_exec(&hub, &hub.admin_token).await.expect("slot freed");
    echo_line(&mut again, "again\n").await;

    // Silence: after 3 s without a byte the hub closes the connection.
    let ended = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match again.next().await {
                None | Some(Err(_)) => return,
                Some(Ok(tokio_tungstenite::tungstenite::Message::Close(_))) => return,
                Some(Ok(_)) => {}
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "an idle upgraded connection stayed open");
    wait_no_upgrades(&hub, "admin").await;
    wait_no_upgrades(&hub, "carol").await;
    assert_eq!(hub.hub.state.metrics.kube_upgraded.get(), 0);
    agent.shutdown().await;
    sim.shutdown().await;
    hub.hub.shutdown().await;
}

/// Starts `kubectl port-forward` to web-0's 8080 and returns the child and
/// the local port it printed (bounded wait).
fn port_forward(mut cmd: std::process::Command) -> (std::process::Child, u16) {
    use std::io::BufRead;
    let mut child = cmd
        .args([
            "port-forward",
            "--address",
            "127.0.0.1",
            "pod/web-0",
            ":8080",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            // "Forwarding from 127.0.0.1:43210 -> 8080"
            if let Some(port) = line
                .strip_prefix("Forwarding from 127.0.0.1:")
                .and_then(|r| r.split_whitespace().next())
                .and_then(|p| p.parse::<u16>().ok())
            {
                let _ = tx.send(port);
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(port) => (child, port),
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("port-forward printed no local port");
        }
    }
}

/// Sends `data` through a forwarded port to the echo server and checks that
/// the same bytes come back.
fn round_trip(port: u16, data: &[u8], what: &str) {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut writer = conn.try_clone().unwrap();
    let out = data.to_vec();
    let sender = std::thread::spawn(move || writer.write_all(&out).unwrap());
    let mut back = vec![0u8; data.len()];
    conn.read_exact(&mut back)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    sender.join().unwrap();
    assert!(back == data, "{what}: the bytes came back changed");
}

/// SPDY through the hub: kubectl 1.20 speaks only SPDY/3.1 for exec and
/// port-forward; kubectl 1.33's port-forward tunnels SPDY inside a
/// WebSocket, or upgrades to SPDY when told not to use WebSockets. The hub
/// relays each upgrade byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spdy_exec_and_port_forward_through_the_hub() {
    let Some(k133) = kubectl_133() else {
        tool_missing("kubectl 1.33");
        return;
    };
    let Some(k120) = otter_e2e::tools::kubectl_120() else {
        return;
    };
    let cfg = kube_sim::SimConfig::default_with_admin()
        .allow("group:otter:default:admins", &["*"], &["*"], &["*"])
        .pod("default", "web-0", &["web"]);
    let hub = TestHub::start().await;
    let (sim, agent) = start_edge(&hub, cfg).await;
    let (echo_addr, echo) = echo_server(b"").await;
    sim.add_pod_port("default", "web-0", 8080, echo_addr);
    let dir = tempfile::tempdir().unwrap();
    let kube_path = write_kubeconfig(&hub, dir.path()).await;
    let k = |bin: &Path, args: &[&str]| {
        let mut cmd = std::process::Command::new(bin);
        cmd.arg("--kubeconfig").arg(&kube_path).args(args);
        cmd
    };

    tokio::task::block_in_place(|| {
        // kubectl 1.20: exec with stdin and an exit code over SPDY.
        let (code, out, err) = otter_e2e::run_bounded_with_input(
            &mut k(
                &k120,
                &[
                    "exec",
                    "-i",
                    "web-0",
                    "-c",
                    "web",
                    "--",
                    "sh",
                    "-c",
                    "tr a-z A-Z; exit 5",
                ],
            ),
            Some(b"old kubectl\n".to_vec()),
            Duration::from_secs(60),
        );
        assert_eq!(
            code, 5,
            "kubectl 1.20's exit code is the command's: {out} {err}"
        );
        assert_eq!(out, "OLD KUBECTL\n");

        // Port-forward, 1 MiB each way and back, per client and transport.
        let data: Vec<u8> = (0..1024 * 1024 + 17u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        let cases = [
            ("kubectl 1.20 (SPDY)", k(&k120, &[]), None),
            (
                "kubectl 1.33 (SPDY inside WebSocket)",
                k(&k133, &[]),
                Some("true"),
            ),
            ("kubectl 1.33 (SPDY)", k(&k133, &[]), Some("false")),
        ];
        for (what, mut cmd, websockets) in cases {
            if let Some(w) = websockets {
                cmd.env("KUBECTL_PORT_FORWARD_WEBSOCKETS", w);
            }
            let (mut child, port) = port_forward(cmd);
            for round in 0..2 {
                round_trip(port, &data, &format!("{what}, round {round}"));
            }
            assert!(
                child.try_wait().unwrap().is_none(),
                "{what}: port-forward exited"
            );
            let _ = child.kill();
            let _ = child.wait();
        }
    });
    let sessions: Vec<(String, String)> = sim
        .stream_sessions()
        .into_iter()
        .map(|s| (s.subresource, s.transport))
        .collect();
    for want in [
        ("exec", "spdy"),
        ("portforward", "spdy"),
        ("portforward", "spdy-over-websocket"),
    ] {
        assert!(
            sessions
                .iter()
                .any(|(s, t)| (s.as_str(), t.as_str()) == want),
            "{want:?} reached the cluster: {sessions:?}"
        );
    }
    wait_no_upgrades(&hub, "admin").await;
    echo.abort();
    agent.shutdown().await;
    sim.shutdown().await;
    hub.hub.shutdown().await;
}

/// Request headers are bounded: a head over 64 KiB is refused (431) before
/// anything reaches a cluster, over HTTP/1.1 and HTTP/2 alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_headers_are_refused() {
    let hub = TestHub::start().await;
    for http2 in [false, true] {
        let req = http::Request::get(format!(
            "https://localhost:{}/clusters/edge-1/api/v1/pods",
            hub.hub.api_addr.port()
        ))
        .header("authorization", format!("Bearer {}", hub.admin_token))
        .header("x-padding", "a".repeat(100 * 1024))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
        let (status, _, _) =
            otter_e2e::http_call(hub.hub.api_addr, hub.hub.ca_pem(), http2, req).await;
        assert_eq!(status, 431, "http2: {http2}");
    }
    hub.hub.shutdown().await;
}

/// A `kubectl port-forward` and an interactive `kubectl exec -i` through
/// the hub end, with an error kubectl shows, soon after their tunnel dies
/// (a path that goes silent: the relay in front of the tunnel port
/// swallows every byte), instead of hanging on a dead stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_ends_when_its_tunnel_dies() {
    let Some(k133) = kubectl_133() else {
        tool_missing("kubectl 1.33");
        return;
    };
    let relay = otter_e2e::Relay::start().await;
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let port = relay.addr.port();
    let hub = TestHub::start_with(dir, None, |c| {
        c.tunnel_urls = vec![url::Url::parse(&format!("h2://localhost:{port}")).unwrap()];
    })
    .await;
    relay.set_target(hub.hub.tunnel_addr);
    let cfg = kube_sim::SimConfig::default_with_admin()
        .allow("group:otter:default:admins", &["*"], &["*"], &["*"])
        .pod("default", "web-0", &["web"]);
    let (sim, agent) = start_edge(&hub, cfg).await;
    let (echo_addr, echo) = echo_server(b"").await;
    sim.add_pod_port("default", "web-0", 8080, echo_addr);
    let work = tempfile::tempdir().unwrap();
    let kube_path = write_kubeconfig(&hub, work.path()).await;

    let ends = tokio::task::block_in_place(|| {
        let mut cmd = std::process::Command::new(&k133);
        cmd.arg("--kubeconfig").arg(&kube_path);
        let (forward, local) = port_forward(cmd);
        round_trip(local, b"before the cut", "before the cut");
        // A connection kept open through the forward, as a client would.
        let _held = std::net::TcpStream::connect(("127.0.0.1", local)).unwrap();
        // An interactive exec whose input stays open, echoing it back.
        let mut exec = std::process::Command::new(&k133)
            .arg("--kubeconfig")
            .arg(&kube_path)
            .args(["exec", "-i", "web-0", "--", "cat"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Kept open until kubectl has ended.
        let mut input = exec.stdin.take().unwrap();
        {
            use std::io::{BufRead, Write};
            input.write_all(b"before the cut\n").unwrap();
            input.flush().unwrap();
            let mut line = String::new();
            std::io::BufReader::new(exec.stdout.as_mut().unwrap())
                .read_line(&mut line)
                .unwrap();
            assert_eq!(line, "before the cut\n");
        }
        relay.freeze(true);
        let cut = std::time::Instant::now();
        let deadline = cut + Duration::from_secs(60);
        let mut running = vec![("port-forward", forward), ("exec", exec)];
        let mut ends = Vec::new();
        while !running.is_empty() {
            let mut i = 0;
            while i < running.len() {
                if let Some(status) = running[i].1.try_wait().unwrap() {
                    ends.push((running[i].0, status.code(), cut.elapsed()));
                    running.remove(i);
                } else {
                    i += 1;
                }
            }
            if std::time::Instant::now() > deadline {
                let names: Vec<&str> = running.iter().map(|(what, _)| *what).collect();
                for (_, child) in &mut running {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                panic!("kubectl {names:?} still running 60 s after the tunnel died");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        drop(input);
        ends
    });
    for (what, code, took) in ends {
        assert_ne!(code, Some(0), "kubectl {what} reports the lost connection");
        println!("kubectl {what} exited {code:?} {took:?} after the tunnel's path went silent");
    }
    wait_no_upgrades(&hub, "admin").await;
    echo.abort();
    agent.shutdown().await;
    sim.shutdown().await;
    hub.hub.shutdown().await;
}

/// Ages differ by the second between two runs: each written as `<age>`.
fn without_ages(text: &str) -> String {
    let age = regex::Regex::new(r"\b\d+(s|m(\d+s)?|h(\d+m)?|d(\d+h)?|y(\d+d)?)\b").unwrap();
    age.replace_all(text, "<age>").into_owned()
}

/// `otter describe` prints what kubectl 1.33's `describe` prints, for a
/// pod (with its events), a deployment, a service, a node and an event,
/// through the hub against the same cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otter_describe_prints_what_kubectl_describe_prints() {
    let Some(kubectl) = kubectl_133() else {
        tool_missing("kubectl 1.33");
        return;
    };
    // A real agent: its kube-rs services (what otter calls) and its
    // Kubernetes API proxy (what kubectl calls).
    let env = otter_e2e::kube::KubeEnv::start(otter_e2e::kube::sim_config().pod(
        "default",
        "web-0",
        &["web"],
    ))
    .await;
    let sim = &env.sim;
    let dir = tempfile::tempdir().unwrap();
    let kube_path = write_kubeconfig(&env.hub, dir.path()).await;
    let (d, kp) = (dir.path().to_owned(), kube_path.clone());
    let k = move |args: &[&str]| {
        let mut cmd = std::process::Command::new(&kubectl);
        cmd.arg("--kubeconfig").arg(&kp).args(args);
        run_bounded(&mut cmd, Duration::from_secs(60))
    };
    tokio::task::block_in_place(|| {
        for args in [
            &["create", "deployment", "web", "--image=nginx", "--port=80"][..],
            &["create", "service", "clusterip", "web", "--tcp=80:8080"],
            &["label", "pod", "web-0", "tier=front", "app=web"],
            &["annotate", "pod", "web-0", "note=kept for the test"],
        ] {
            let (code, _, err) = k(args);
            assert_eq!(code, 0, "{args:?}: {err}");
        }
        let event = serde_json::json!({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": "web-0.pulled", "namespace": "default"},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": "web-0", "namespace": "default",
                "uid": sim.object("", "pods", "default", "web-0").unwrap()["metadata"]["uid"]},
            "reason": "Pulled", "message": "Container image \"nginx\" already present on machine",
            "type": "Normal", "count": 1, "source": {"component": "kubelet", "host": "sim-node"},
            "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:00:00Z",
        });
        // A pod that uses most of what a pod description shows.
        let rich = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "rich-0", "namespace": "default", "labels": {"app": "rich"},
                "annotations": {"long": "x".repeat(150), "multi": "one\ntwo"}},
            "spec": {
                "nodeSelector": {"disk": "ssd"},
                "tolerations": [
                    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                    {"key": "dedicated", "operator": "Equal", "value": "edge", "effect": "NoSchedule"}
                ],
                "initContainers": [{"name": "init", "image": "busybox", "command": ["sh", "-c", "true"]}],
                "containers": [{
                    "name": "app", "image": "nginx:1.27",
                    "args": ["--port", "8080"],
                    "ports": [{"containerPort": 8080, "protocol": "TCP"}, {"containerPort": 9090, "protocol": "UDP", "hostPort": 9090}],
                    "env": [
                        {"name": "PLAIN", "value": "v"},
                        {"name": "POD", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
                        {"name": "PASS", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
                        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode", "optional": true}}}
                    ],
                    "envFrom": [{"configMapRef": {"name": "cfg"}}, {"prefix": "S_", "secretRef": {"name": "creds", "optional": true}}],
                    "resources": {"requests": {"cpu": "250m", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "128Mi"}},
                    "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "initialDelaySeconds": 3, "periodSeconds": 5},
                    "readinessProbe": {"tcpSocket": {"port": 8080}},
                    "volumeMounts": [
                        {"name": "cache", "mountPath": "/cache"},
                        {"name": "cfg", "mountPath": "/etc/app", "readOnly": true, "subPath": "app.conf"}
                    ]
                }],
                "volumes": [
                    {"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}},
                    {"name": "cfg", "configMap": {"name": "cfg"}},
                    {"name": "creds", "secret": {"secretName": "creds", "optional": true}}
                ]
            }
        });
        for (name, doc) in [("event.json", &event), ("rich.json", &rich)] {
            let file = d.join(name);
            std::fs::write(&file, doc.to_string()).unwrap();
            let (code, _, err) = k(&["create", "-f", file.to_str().unwrap()]);
            assert_eq!(code, 0, "{name}: {err}");
        }
        // A service that selects pods, with named ports.
        let svc = serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "rich", "namespace": "default"},
            "spec": {"selector": {"app": "rich"}, "ports": [
                {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
                {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "UDP"}
            ]}
        });
        let file = d.join("svc.json");
        std::fs::write(&file, svc.to_string()).unwrap();
        let (code, _, err) = k(&["create", "-f", file.to_str().unwrap()]);
        assert_eq!(code, 0, "{err}");
        for (kind, name) in [
            ("pod", "web-0"),
            ("pod", "rich-0"),
            ("deployment", "web"),
            ("service", "web"),
            ("service", "rich"),
            ("node", "sim-node"),
            ("event", "web-0.pulled"),
        ] {
            let (code, want, err) = k(&["describe", kind, name]);
            assert_eq!(code, 0, "kubectl describe {kind}: {err}");
            let (code, got, err) = otter_in(&d, &["describe", kind, name, "--cluster", "edge-1"]);
            assert_eq!(code, 0, "otter describe {kind}: {err}");
            let (want, got) = (without_ages(&want), without_ages(&got));
            if want != got {
                let first = want
                    .lines()
                    .zip(got.lines())
                    .position(|(a, b)| a != b)
                    .unwrap_or(want.lines().count().min(got.lines().count()));
                panic!(
                    "otter describe {kind} differs from kubectl's at line {}:\n--- kubectl\n{want}\n--- otter\n{got}",
                    first + 1
                );
            }
        }
    });
    env.shutdown().await;
}
