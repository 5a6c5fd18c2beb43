//! Debian's kubectl 1.20 (legacy discovery, no WebSocket) against kube-sim: discovery,
//! CRUD, server-side apply, patches, scale, logs and `--as`; exec, attach and port-forward
//! over SPDY/3.1. kubectl 1.20 validates with a
//! protobuf OpenAPI v2 document the server does not serve, so writes pass
//! `--validate=false`. Skipped with a message when `scripts/setup.sh` has not run.

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use common::{Out, run};
use kube_sim::KubeSim;
use serde_json::Value;

const T: Duration = Duration::from_secs(30);

struct Kubectl {
    bin: PathBuf,
    dir: tempfile::TempDir,
}

impl Kubectl {
    fn new(sim: &KubeSim) -> Option<Self> {
        let path = common::workspace_root().join(".tools/kubectl-1.20/usr/bin/kubectl");
        let bin = common::tool_or_skip(Some(path), "kubectl 1.20", "run scripts/setup.sh kubectl")?;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("admin"),
            sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("bob"),
            sim.kubeconfig_yaml(common::BOB_TOKEN),
        )
        .unwrap();
        Some(Self { bin, dir })
    }

    fn cmd(&self, user: &str, args: &[&str]) -> tokio::process::Command {
        let mut c = tokio::process::Command::new(&self.bin);
        c.arg("--kubeconfig")
            .arg(self.dir.path().join(user))
            .args(args);
        c.env("HOME", self.dir.path())
            .env("KUBECACHEDIR", self.dir.path().join("cache"));
        c
    }

    async fn run_as(&self, user: &str, args: &[&str]) -> Out {
        run(self.cmd(user, args), T).await
    }

    async fn ok(&self, args: &[&str]) -> String {
        let o = self.run_as("admin", args).await;
        assert!(o.ok(), "kubectl {args:?} failed: {o:?}");
        o.stdout
    }

    fn file(&self, name: &str, content: &str) -> String {
        let p = self.dir.path().join(name);
        std::fs::write(&p, content).unwrap();
        p.to_string_lossy().into_owned()
    }
}

#[tokio::test]
async fn kubectl_120_suite() {
    let sim = common::start().await;
    let Some(k) = Kubectl::new(&sim) else { return };

    // Legacy discovery.
    let res = k.ok(&["api-resources"]).await;
    let deploy = res
        .lines()
        .find(|l| l.starts_with("deployments "))
        .unwrap_or_default();
    assert!(
        deploy
            .split_whitespace()
            .eq(["deployments", "deploy", "apps/v1", "true", "Deployment"]),
        "{res}"
    );
    let versions = k.ok(&["api-versions"]).await;
    assert!(
        versions.lines().any(|l| l == "apps/v1") && versions.lines().any(|l| l == "v1"),
        "{versions}"
    );
    let pods = k.ok(&["get", "pods", "-A"]).await;
    assert!(
        pods.lines().any(|l| l
            .split_whitespace()
            .take(4)
            .eq(["default", "p1", "1/1", "Running"])),
        "{pods}"
    );

    // CRUD.
    let cm = k.file(
        "cm.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: legacy\ndata:\n  k: one\n",
    );
    assert_eq!(
        k.ok(&["create", "--validate=false", "-f", &cm])
            .await
            .trim(),
        "configmap/legacy created"
    );
    let dup = k
        .run_as("admin", &["create", "--validate=false", "-f", &cm])
        .await;
    assert!(
        dup.stderr.contains("configmaps \"legacy\" already exists"),
        "{dup:?}"
    );
    let got: Value =
        serde_json::from_str(&k.ok(&["get", "cm", "legacy", "-o", "json"]).await).unwrap();
    assert_eq!(got["data"]["k"], "one");
    let cm2 = k.file(
        "cm2.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: legacy\ndata:\n  k: two\n",
    );
    assert_eq!(
        k.ok(&["replace", "--validate=false", "-f", &cm2])
            .await
            .trim(),
        "configmap/legacy replaced"
    );
    assert_eq!(
        k.ok(&["get", "cm", "legacy", "-o", "jsonpath={.data.k}"])
            .await,
        "two"
    );

    // Server-side apply with a conflict, then forced.
    let ssa = k.file(
        "ssa.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ssa\ndata:\n  k: a\n",
    );
    let ssa2 = k.file(
        "ssa2.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ssa\ndata:\n  k: b\n",
    );
    assert_eq!(
        k.ok(&["apply", "--server-side", "--validate=false", "-f", &ssa])
            .await
            .trim(),
        "configmap/ssa serverside-applied"
    );
    let conflict = k
        .run_as(
            "admin",
            &[
                "apply",
                "--server-side",
                "--validate=false",
                "--field-manager=other",
                "-f",
                &ssa2,
            ],
        )
        .await;
    assert!(
        conflict.stderr.contains("conflict with \"kubectl"),
        "{conflict:?}"
    );
    k.ok(&[
        "apply",
        "--server-side",
        "--validate=false",
        "--field-manager=other",
        "--force-conflicts",
        "-f",
        &ssa2,
    ])
    .await;
    assert_eq!(
        k.ok(&["get", "cm", "ssa", "-o", "jsonpath={.data.k}"])
            .await,
        "b"
    );

    // Patches of every kind.
    k.ok(&[
        "patch",
        "cm",
        "legacy",
        "--type",
        "merge",
        "-p",
        r#"{"data":{"m":"1"}}"#,
    ])
    .await;
    k.ok(&[
        "patch",
        "cm",
        "legacy",
        "--type",
        "json",
        "-p",
        r#"[{"op":"remove","path":"/data/k"}]"#,
    ])
    .await;
    k.ok(&[
        "patch",
        "pod",
        "p1",
        "-p",
        r#"{"metadata":{"labels":{"patched":"yes"}}}"#,
    ])
    .await;
    assert_eq!(
        k.ok(&["get", "cm", "legacy", "-o", "jsonpath={.data}"])
            .await
            .replace(' ', ""),
        r#"{"m":"1"}"#
    );
    assert_eq!(
        k.ok(&["get", "pods", "-l", "patched=yes", "-o", "name"])
            .await
            .trim(),
        "pod/p1"
    );

    // Scale a deployment.
    let dep = k.file(
        "dep.yaml",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: old\nspec:\n  replicas: 1\n  selector:\n    matchLabels: {app: old}\n  template:\n    metadata:\n      labels: {app: old}\n    spec:\n      containers:\n      - name: c\n        image: c:1\n",
    );
    k.ok(&["create", "--validate=false", "-f", &dep]).await;
    assert_eq!(
        k.ok(&["scale", "deployment", "old", "--replicas=4"])
            .await
            .trim(),
        "deployment.apps/old scaled"
    );
    assert_eq!(
        k.ok(&["get", "deploy", "old", "-o", "jsonpath={.spec.replicas}"])
            .await,
        "4"
    );

    // Logs.
    sim.append_log("default", "p1", "c1", "first");
    sim.append_log("default", "p1", "c1", "second");
    assert_eq!(k.ok(&["logs", "p1", "--tail=1"]).await, "second\n");
    assert_eq!(
        k.ok(&["logs", "two", "-c", "a"]).await,
        "container a started\n"
    );

    // Impersonation and RBAC.
    let as_jane = k
        .ok(&["get", "cm", "legacy", "--as", "jane", "-o", "name"])
        .await;
    assert_eq!(as_jane.trim(), "configmap/legacy");
    let jane_pods = k.run_as("admin", &["get", "pods", "--as", "jane"]).await;
    assert!(
        jane_pods
            .stderr
            .contains("pods is forbidden: User \"jane\" cannot list resource \"pods\""),
        "{jane_pods:?}"
    );
    let bob_secrets = k.run_as("bob", &["get", "secrets"]).await;
    assert!(
        bob_secrets
            .stderr
            .contains("User \"bob\" cannot list resource \"secrets\""),
        "{bob_secrets:?}"
    );

    // Delete.
    assert_eq!(
        k.ok(&["delete", "cm", "legacy"]).await.trim(),
        "configmap \"legacy\" deleted"
    );
    assert_eq!(
        k.ok(&["delete", "pod", "p1", "--grace-period=1"])
            .await
            .trim(),
        "pod \"p1\" deleted"
    );
    assert!(
        !k.ok(&["get", "pods", "-o", "name"])
            .await
            .contains("pod/p1")
    );
    sim.shutdown().await;
}

/// exec over SPDY/3.1 (`v4.channel.k8s.io`): stdin reaches the process, stdout and stderr
/// come back on their own streams, and the exit code becomes kubectl's.
#[tokio::test]
async fn kubectl_120_exec_and_attach_over_spdy() {
    let sim = common::start().await;
    let Some(k) = Kubectl::new(&sim) else { return };
    let mut c = k.cmd(
        "admin",
        &[
            "exec",
            "-i",
            "p1",
            "--",
            "sh",
            "-c",
            "cat; echo oops >&2; exit 3",
        ],
    );
    c.kill_on_drop(true)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"through stdin\n").await.unwrap();
        // Dropping stdin is EOF: kubectl half-closes the stdin stream.
    }
    let out = tokio::time::timeout(T, child.wait_with_output())
        .await
        .expect("exec finished in time")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stdout:?} {stderr:?}");
    assert_eq!(stdout, "through stdin\n");
    assert!(stderr.contains("oops\n"), "{stderr:?}");
    assert!(
        stderr.contains("command terminated with exit code 3"),
        "{stderr:?}"
    );

    let ok = k
        .run_as(
            "admin",
            &["exec", "p1", "--", "sh", "-c", "echo fine; echo warn >&2"],
        )
        .await;
    assert_eq!(ok.code, Some(0), "{ok:?}");
    assert_eq!(ok.stdout, "fine\n");
    assert_eq!(ok.stderr, "warn\n");
    let missing = k
        .run_as("admin", &["exec", "p1", "--", "/nonexistent/tool"])
        .await;
    assert_ne!(missing.code, Some(0), "{missing:?}");
    assert!(
        missing.stderr.contains("no such file or directory")
            || missing.stderr.contains("No such file or directory"),
        "{missing:?}"
    );

    // A client that goes away takes its process with it.
    let mut c = k.cmd(
        "admin",
        &["exec", "p1", "--", "sh", "-c", "echo $$; exec sleep 300"],
    );
    c.kill_on_drop(true)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut child = c.spawn().unwrap();
    let mut line = String::new();
    {
        use tokio::io::AsyncBufReadExt;
        let mut out = tokio::io::BufReader::new(child.stdout.take().unwrap());
        tokio::time::timeout(T, out.read_line(&mut line))
            .await
            .expect("the process reports its pid")
            .unwrap();
    }
    let pid: u32 = line.trim().parse().expect("a pid");
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                // The state follows the parenthesised command name.
                let state = s.rsplit(')').next().unwrap_or_default().trim_start();
                !state.starts_with('Z') && !state.starts_with('X')
            })
            .unwrap_or(false)
    };
    assert!(alive(pid), "sleep {pid} should be running");
    child.kill().await.unwrap();
    let mut gone = false;
    for _ in 0..100 {
        if !alive(pid) {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "process {pid} outlived its exec session");

    // RBAC is checked before the upgrade.
    let bob = k.run_as("bob", &["exec", "p1", "--", "true"]).await;
    assert!(
        bob.stderr.contains("cannot create resource \"pods/exec\""),
        "{bob:?}"
    );

    // attach: typed lines go into the container's log, which comes back on stdout.
    let mut a = k.cmd("admin", &["attach", "-i", "p1", "-c", "c1"]);
    a.kill_on_drop(true)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = a.spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = String::new();
    tokio::time::timeout(T, async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = [0u8; 256];
        // kubectl may start reading after the first line was typed: keep typing (a bounded
        // number of times) until the echo shows up.
        for _ in 0..100 {
            stdin.write_all(b"typed into attach\n").await.unwrap();
            let n = tokio::time::timeout(Duration::from_millis(300), stdout.read(&mut buf)).await;
            if let Ok(Ok(n)) = n {
                assert!(n > 0, "attach ended early: {seen}");
                seen.push_str(&String::from_utf8_lossy(&buf[..n]));
            }
            if seen.contains("typed into attach") {
                break;
            }
        }
    })
    .await
    .expect("attach echoes typed input");
    assert!(seen.contains("typed into attach"), "{seen}");
    drop(stdin);
    let status = tokio::time::timeout(T, child.wait())
        .await
        .expect("attach ends after stdin closes")
        .unwrap();
    assert!(status.success(), "{status:?}");
    let logs = k.ok(&["logs", "p1", "-c", "c1"]).await;
    assert!(logs.contains("typed into attach"), "{logs}");

    let sessions = sim.stream_sessions();
    assert!(
        sessions.iter().any(|s| s.subresource == "exec"
            && s.transport == "spdy"
            && s.protocol == "v4.channel.k8s.io"),
        "{sessions:?}"
    );
    assert!(
        sessions
            .iter()
            .any(|s| s.subresource == "attach" && s.transport == "spdy"),
        "{sessions:?}"
    );
    sim.shutdown().await;
}

/// port-forward over SPDY/3.1 (`portforward.k8s.io`): real bytes to a local echo server,
/// several connections in turn, and an unregistered port reported on the error stream.
#[tokio::test]
async fn kubectl_120_port_forward_over_spdy() {
    let sim = common::start().await;
    let Some(k) = Kubectl::new(&sim) else { return };
    let (echo, echo_task) = common::echo_server().await;
    sim.add_pod_port("default", "p1", 8080, echo);
    let mut pf = k.cmd(
        "admin",
        &[
            "port-forward",
            "--address",
            "127.0.0.1",
            "pod/p1",
            ":8080",
            ":9090",
        ],
    );
    pf.kill_on_drop(true)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = pf.spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let ports = common::forwarded_ports(&mut stdout, 2, T).await;
    let local = |remote: u16| {
        ports
            .iter()
            .find(|(_, r)| *r == remote)
            .map(|(l, _)| *l)
            .unwrap_or_else(|| panic!("no local port for {remote}: {ports:?}"))
    };
    // Nothing listens behind 9090: the error stream says so and the connection closes.
    let refused = common::echo_through(local(9090), b"anyone?", T).await;
    assert!(refused.is_empty(), "{refused:?}");
    let data = common::payload(3 * 1024 * 1024 + 17);
    for round in 0..3 {
        let back = common::echo_through(local(8080), &data, T).await;
        assert_eq!(back.len(), data.len(), "round {round}");
        assert_eq!(common::fnv64(&back), common::fnv64(&data), "round {round}");
    }
    let sessions = sim.stream_sessions();
    assert_eq!(
        sessions
            .iter()
            .filter(|s| s.subresource == "portforward")
            .map(|s| (s.transport.as_str(), s.protocol.as_str()))
            .collect::<Vec<_>>(),
        vec![("spdy", "portforward.k8s.io")],
    );
    assert!(child.try_wait().unwrap().is_none(), "port-forward exited");
    child.kill().await.unwrap();
    let mut stderr = String::new();
    {
        use tokio::io::AsyncReadExt;
        let mut e = child.stderr.take().unwrap();
        let _ = tokio::time::timeout(T, e.read_to_string(&mut stderr)).await;
    }
    assert!(
        stderr.contains("error forwarding port 9090 to pod"),
        "{stderr}"
    );
    echo_task.abort();
    sim.shutdown().await;
}

/// `kubectl cp` runs tar through exec: a file of a few MiB goes in over stdin and comes
/// back over stdout. The "container" is a process on this machine working in the pod's
/// own directory, where a relative path lands.
#[tokio::test]
async fn kubectl_120_cp_over_spdy() {
    let sim = common::start().await;
    let Some(k) = Kubectl::new(&sim) else { return };
    let (pod_dir, _) = sim.pod_dir("default", "p1").unwrap();
    let data = common::payload(3 * 1024 * 1024 + 3);
    let src = k.file("payload.bin", "");
    std::fs::write(&src, &data).unwrap();
    let in_pod = pod_dir.join("copied.bin");
    let dest = "p1:copied.bin".to_owned();
    let up = k.run_as("admin", &["cp", &src, &dest]).await;
    assert_eq!(up.code, Some(0), "{up:?}");
    let there = std::fs::read(&in_pod).unwrap();
    assert_eq!(common::fnv64(&there), common::fnv64(&data));
    let back = k.dir.path().join("back.bin");
    let down = k
        .run_as("admin", &["cp", &dest, back.to_str().unwrap()])
        .await;
    assert_eq!(down.code, Some(0), "{down:?}");
    let here = std::fs::read(&back).unwrap();
    assert_eq!(here.len(), data.len());
    assert_eq!(common::fnv64(&here), common::fnv64(&data));
    sim.shutdown().await;
}
