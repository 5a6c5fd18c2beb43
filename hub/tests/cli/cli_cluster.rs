//! The `otter` CLI against a real cluster path: hub, tunnel, the agent's
//! Kubernetes services and the Kubernetes API test server. get, apply,
//! describe, scale, restart, delete, logs -f, exec through a pseudo-terminal
//! (input, resize, exit code) and port-forward with real bytes.

use std::{
    io::{Read, Write},
    time::Duration,
};

use otter_e2e::{
    kube::{KubeEnv, sim_config},
    run_bounded, run_for, tool_missing,
};

use crate::otter;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_against_a_cluster() {
    let env = KubeEnv::start(sim_config().pod("default", "web-0", &["web"]).pod(
        "default",
        "two",
        &["a", "b"],
    ))
    .await;
    // A real TCP echo server behind the pod's port 80.
    let echo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    env.sim
        .add_pod_port("default", "web-0", 80, echo.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in echo.incoming().take(4) {
            let Ok(mut c) = conn else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 || c.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });

    let dir = tempfile::tempdir().unwrap();
    let data = env.hub.data_dir();
    let cluster = env.cluster.clone();
    let (d, url) = (dir.path().to_owned(), env.hub.api_url().to_string());
    let cmd = move |args: &[&str]| {
        let mut c = std::process::Command::new(otter());
        c.args(args).env("OTTER_CONFIG", d.join("otter.toml"));
        c
    };
    let sim = &env.sim;
    tokio::task::block_in_place(|| {
        let run = |args: &[&str]| run_bounded(&mut cmd(args), Duration::from_secs(60));
        let tok = data.join("admin-token").display().to_string();
        let ca = data.join("ca.crt").display().to_string();
        let (code, _, err) = run(&[
            "login",
            "--hub",
            &url,
            "--token-file",
            &tok,
            "--ca-file",
            &ca,
        ]);
        assert_eq!(code, 0, "{err}");
        let c = cluster.as_str();

        // No cluster named and none set: the error says how to name one.
        let (code, _, err) = run(&["get", "pods"]);
        assert!(
            code != 0 && err.contains("otter config use-cluster"),
            "{code} {err}"
        );
        // A default cluster, as kubectl's current context.
        let (code, _, err) = run(&["config", "use-cluster", c]);
        assert_eq!(code, 0, "{err}");
        let (code, out, err) = run(&["config", "current-cluster"]);
        assert_eq!((code, out.trim()), (0, c), "{err}");
        let (code, out, err) = run(&["get", "pods"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("web-0"), "{out}");
        let (code, _, err) = run(&["config", "use-cluster", "Not A Name"]);
        assert_ne!(code, 0, "{err}");

        let (code, out, err) = run(&["get", "pods", "--cluster", c]);
        assert_eq!(code, 0, "{err}");
        let row = out
            .lines()
            .find(|l| l.starts_with("web-0"))
            .unwrap_or_else(|| panic!("{out}"));
        assert!(row.contains("1/1") && row.contains("Running"), "{out}");
        let (code, out, _) = run(&["get", "po", "web-0", "--cluster", c, "-o", "json"]);
        assert_eq!(code, 0);
        let pod: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(pod["metadata"]["name"], "web-0");
        assert!(pod["metadata"].get("managedFields").is_none());
        let (code, _, err) = run(&["get", "nothings", "--cluster", c]);
        assert_ne!(code, 0);
        assert!(err.contains("doesn't have a resource type"), "{err}");

        let manifest = dir.path().join("app.yaml");
        std::fs::write(
            &manifest,
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cm1\ndata:\n  k: v1\n---\n\
             apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: d1\nspec:\n  replicas: 1\n  selector:\n    matchLabels: {app: d1}\n  template:\n    metadata:\n      labels: {app: d1}\n    spec:\n      containers:\n      - {name: c, image: nginx}\n",
        )
        .unwrap();
        let (code, out, err) = run(&["apply", "-f", manifest.to_str().unwrap(), "--cluster", c]);
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains("configmap/cm1 serverside-applied")
                && out.contains("deployment.apps/d1 serverside-applied"),
            "{out}"
        );
        let (code, out, err) = run(&["describe", "deploy", "d1", "--cluster", c]);
        assert_eq!(code, 0, "{err}");
        // kubectl's describe (compared line for line with kubectl's in
        // kubectl_proxy.rs).
        assert!(
            out.starts_with("Name:") && out.contains("Replicas:") && out.contains("Events:"),
            "{out}"
        );
        let (code, out, err) = run(&[
            "scale",
            "deployment",
            "d1",
            "--replicas",
            "3",
            "--cluster",
            c,
        ]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("scaled to 3"), "{out}");
        let (code, out, _) = run(&["get", "deploy", "d1", "--cluster", c, "-o", "yaml"]);
        assert_eq!(code, 0);
        assert!(out.contains("replicas: 3"), "{out}");
        let (code, _, err) = run(&["restart", "deploy", "d1", "--cluster", c]);
        assert_eq!(code, 0, "{err}");
        let (code, out, _) = run(&["get", "deploy", "d1", "--cluster", c, "-o", "json"]);
        assert_eq!(code, 0);
        assert!(out.contains("kubectl.kubernetes.io/restartedAt"), "{out}");
        let (code, out, _) = run(&["delete", "configmap", "cm1", "--cluster", c]);
        assert_eq!(code, 0);
        assert!(out.contains("deleted"));
        let (code, _, err) = run(&["get", "cm", "cm1", "--cluster", c]);
        assert_ne!(code, 0);
        assert!(err.contains("not found"), "{err}");

        // -c is the container, as in kubectl.
        sim.append_log("default", "two", "a", "from a");
        sim.append_log("default", "two", "b", "from b");
        let (code, out, err) = run(&["logs", "two", "-c", "b", "--cluster", c]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("from b") && !out.contains("from a"), "{out}");
        let (code, out, err) = run(&["logs", "two", "--container", "a", "--cluster", c]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("from a") && !out.contains("from b"), "{out}");

        // logs -f for a bounded time, while the pod writes.
        sim.append_log("default", "web-0", "web", "first line");
        let follower = std::thread::spawn({
            let mut f = cmd(&["logs", "web-0", "--cluster", c, "-f"]);
            move || run_for(&mut f, Duration::from_secs(3))
        });
        std::thread::sleep(Duration::from_millis(1200));
        sim.append_log("default", "web-0", "web", "second line");
        let (logs, _) = follower.join().unwrap();
        assert!(
            logs.contains("first line") && logs.contains("second line"),
            "{logs:?}"
        );

        // port-forward: each local connection a session, real bytes both ways.
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = free.local_addr().unwrap().port();
        drop(free);
        let mut pf = cmd(&[
            "port-forward",
            "web-0",
            &format!("{port}:80"),
            "--cluster",
            c,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
        let mut conn = None;
        for _ in 0..100 {
            if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                conn = Some(s);
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut conn = conn.expect("port-forward listens");
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let writer = {
            let mut w = conn.try_clone().unwrap();
            let p = payload.clone();
            std::thread::spawn(move || w.write_all(&p).unwrap())
        };
        let mut back = vec![0u8; payload.len()];
        conn.read_exact(&mut back).unwrap();
        writer.join().unwrap();
        assert!(back == payload, "bytes came back changed");
        // Mistakes name the address and port, and what to do.
        let (code, _, err) = run_bounded(
            &mut cmd(&[
                "port-forward",
                "web-0",
                &format!("{port}:80"),
                "--cluster",
                c,
            ]),
            Duration::from_secs(30),
        );
        assert!(
            code != 0 && err.contains(&format!("127.0.0.1:{port}")) && err.contains("in use"),
            "{code} {err}"
        );
        let (code, _, err) = run_bounded(
            &mut cmd(&["port-forward", "web-0", "80x", "--cluster", c]),
            Duration::from_secs(30),
        );
        assert!(
            code != 0 && err.contains("\"80x\"") && err.contains("LOCAL:REMOTE"),
            "{code} {err}"
        );
        let _ = pf.kill();
        let _ = pf.wait();

        // exec -it through a pseudo-terminal: input, resize, exit code.
        let Some(python) = otter_e2e::tools::venv_python() else {
            tool_missing("the project's Python venv");
            return;
        };
        let script = otter_e2e::tools::workspace_root().join("tests/e2e/clients/pty_exec.py");
        let mut py = std::process::Command::new(python);
        py.arg(script)
            .arg(otter())
            .args(["exec", "-it", "web-0", "--cluster", c, "--", "sh"])
            .env("OTTER_CONFIG", dir.path().join("otter.toml"));
        let (code, out, err) = run_bounded(&mut py, Duration::from_secs(60));
        assert_eq!(code, 0, "{out}{err}");
        let result: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        assert!(
            result["output"]
                .as_str()
                .unwrap()
                .contains("hi-from-the-pty"),
            "{result}"
        );
        assert_eq!(
            result["code"], 3,
            "the remote exit code is otter's: {result}"
        );
        // A real terminal in the pod: a prompt, and `tty` names it.
        assert_eq!(result["prompt"], true, "{result}");
        assert!(
            result["tty"].as_str().unwrap().starts_with("/dev/pts/"),
            "{result}"
        );
        let resizes = sim.resizes();
        assert!(
            resizes.iter().any(|(_, _, w, h)| (*w, *h) == (132, 40)),
            "resize reached the pod: {resizes:?}"
        );
    });
    env.shutdown().await;
}
