//! kubectl 1.33 (a client we did not write) against kube-sim: discovery, get, server-side
//! apply, explain, patches, scale, rollout, delete, logs, exec over WebSocket v5 and SPDY,
//! port-forward over SPDY inside WebSocket and over plain SPDY, whoami,
//! watch. Skipped with a message when kubectl 1.33 is not installed.

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use common::{Out, run};
use kube_sim::KubeSim;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);

fn find_kubectl() -> Option<PathBuf> {
    let out = std::process::Command::new("dpkg")
        .args(["-L", "kubectl"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.ends_with("kubectl.1.33"))
        .map(PathBuf::from)
}

struct Kubectl {
    bin: PathBuf,
    dir: tempfile::TempDir,
}

impl Kubectl {
    fn new(sim: &KubeSim) -> Option<Self> {
        let bin = common::tool_or_skip(
            find_kubectl(),
            "kubectl 1.33",
            "install the gcloud kubectl package; `dpkg -L kubectl` must list kubectl.1.33",
        )?;
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
        std::fs::write(
            dir.path().join("eve"),
            sim.kubeconfig_yaml(common::EVE_TOKEN),
        )
        .unwrap();
        Some(Self { bin, dir })
    }

    fn cmd(&self, user: &str, args: &[&str]) -> tokio::process::Command {
        let mut c = tokio::process::Command::new(&self.bin);
        c.arg("--kubeconfig")
            .arg(self.dir.path().join(user))
            .args(args);
        // Keep kubectl's caches inside the test's directory.
        c.env("HOME", self.dir.path())
            .env("KUBECACHEDIR", self.dir.path().join("cache"));
        c
    }

    async fn run(&self, args: &[&str]) -> Out {
        run(self.cmd("admin", args), T).await
    }

    async fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args).await;
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
async fn get_apply_explain_patch() {
    let sim = common::start().await;
    let Some(k) = Kubectl::new(&sim) else { return };
    let pods = k.ok(&["get", "pods", "-A"]).await;
    assert!(
        pods.lines().next().unwrap().split_whitespace().eq([
            "NAMESPACE",
            "NAME",
            "READY",
            "STATUS",
            "RESTARTS",
            "AGE"
        ]),
        "{pods}"
    );
    assert!(
        pods.lines().any(|l| l
            .split_whitespace()
            .take(4)
            .eq(["default", "p1", "1/1", "Running"])),
        "{pods}"
    );
    let wide = k.ok(&["get", "pods", "-o", "wide"]).await;
    assert!(
        wide.lines()
            .next()
            .unwrap()
            .split_whitespace()
            .eq(["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE"]),
        "{wide}"
    );
    assert!(wide.contains("sim-node"), "{wide}");
    let p1: Value = serde_json::from_str(&k.ok(&["get", "pod", "p1", "-o", "json"]).await).unwrap();
    assert_eq!(p1["status"]["phase"], "Running");

    let cm1 = k.file(
        "cm1.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cm1\ndata:\n  k: one\n",
    );
    let cm2 = k.file(
        "cm2.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cm1\ndata:\n  k: two\n",
    );
    assert_eq!(
        k.ok(&["apply", "--server-side", "-f", &cm1]).await.trim(),
        "configmap/cm1 serverside-applied"
    );
    let conflict = k
        .run(&[
            "apply",
            "--server-side",
            "--field-manager=other",
            "-f",
            &cm2,
        ])
        .await;
    assert!(!conflict.ok());
    assert!(
        conflict
            .stderr
            .contains("Apply failed with 1 conflict: conflict with \"kubectl\": .data.k"),
        "{conflict:?}"
    );
    k.ok(&[
        "apply",
        "--server-side",
        "--field-manager=other",
        "--force-conflicts",
        "-f",
        &cm2,
    ])
    .await;
    assert_eq!(
        k.ok(&["get", "cm", "cm1", "-o", "jsonpath={.data.k}"])
            .await,
        "two"
    );
    let managers = k
        .ok(&[
            "get",
            "cm",
            "cm1",
            "--show-managed-fields",
            "-o",
            "jsonpath={.metadata.managedFields[*].manager}",
        ])
        .await;
    assert!(managers.contains("other"), "{managers}");

    let explain = k.ok(&["explain", "deployment.spec.replicas"]).await;
    assert!(explain.contains("FIELD: replicas <integer>"), "{explain}");
    let explain = k.ok(&["explain", "pods.spec.containers"]).await;
    assert!(explain.contains("image\t<string>"), "{explain}");

    k.ok(&[
        "patch",
        "cm",
        "cm1",
        "--type",
        "merge",
        "-p",
        r#"{"data":{"m":"merge"}}"#,
    ])
    .await;
    k.ok(&[
        "patch",
        "cm",
        "cm1",
        "--type",
        "json",
        "-p",
        r#"[{"op":"add","path":"/data/j","value":"json"}]"#,
    ])
    .await;
    let dep = k.file(
        "dep.yaml",
        &serde_json::to_string(&deployment("d1", 1)).unwrap(),
    );
    k.ok(&["create", "-f", &dep]).await;
    k.ok(&[
        "patch",
        "deployment",
        "d1",
        "-p",
        r#"{"spec":{"template":{"spec":{"containers":[{"name":"b","image":"b:2"}]}}}}"#,
    ])
    .await;
    let data: Value =
        serde_json::from_str(&k.ok(&["get", "cm", "cm1", "-o", "jsonpath={.data}"]).await).unwrap();
    assert_eq!(data, json!({"k": "two", "m": "merge", "j": "json"}));
    let images = k
        .ok(&[
            "get",
            "deploy",
            "d1",
            "-o",
            "jsonpath={.spec.template.spec.containers[*].image}",
        ])
        .await;
    assert_eq!(images, "a:1 b:2");

    // CRDs: served at once, explained from their schema, strictly validated.
    let crd = k.file("crd.yaml", &serde_json::to_string(&widget_crd()).unwrap());
    k.ok(&["apply", "--server-side", "-f", &crd]).await;
    let explain = k.ok(&["explain", "widgets.spec.size"]).await;
    assert!(explain.contains("size <integer>"), "{explain}");
    let good = k.file(
        "w.yaml",
        "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w1\nspec:\n  size: 2\n",
    );
    k.ok(&["apply", "--server-side", "-f", &good]).await;
    assert_eq!(
        k.ok(&["get", "widgets", "w1", "-o", "jsonpath={.spec.size}"])
            .await,
        "2"
    );
    let unknown = k.file("u.yaml", "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w2\nspec:\n  size: 2\n  extra: 1\n");
    let strict = k.run(&["create", "-f", &unknown]).await;
    assert!(
        strict.stderr.contains("unknown field \"spec.extra\""),
        "{strict:?}"
    );
    let bad = k.file("b.yaml", "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w3\nspec:\n  size: 20\n  color: green\n");
    let invalid = k.run(&["create", "-f", &bad]).await;
    assert!(
        invalid.stderr.contains(
            "spec.color: Unsupported value: \"green\": supported values: \"red\", \"blue\""
        ),
        "{invalid:?}"
    );
    assert!(
        invalid.stderr.contains("spec.size: Invalid value: 20"),
        "{invalid:?}"
    );
    sim.shutdown().await;
}

fn deployment(name: &str, replicas: i64) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{"name": "a", "image": "a:1"}, {"name": "b", "image": "b:1"}]}}}
    })
}

fn widget_crd() -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com", "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [{"name": "v1", "served": true, "storage": true, "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {"spec": {"type": "object", "description": "Desired widget.", "properties": {
                    "size": {"type": "integer", "minimum": 1, "maximum": 10, "description": "How big."},
                    "color": {"type": "string", "enum": ["red", "blue"]}
                }}}
            }}}]
        }
    })
}

#[tokio::test]
async fn scale_rollout_delete() {
    let sim = common::start().await;
    let Some(k) = Kubectl::new(&sim) else { return };
    let dep = k.file(
        "dep.yaml",
        &serde_json::to_string(&deployment("web", 1)).unwrap(),
    );
    k.ok(&["apply", "--server-side", "-f", &dep]).await;
    assert_eq!(
        k.ok(&["scale", "deployment", "web", "--replicas=3"])
            .await
            .trim(),
        "deployment.apps/web scaled"
    );
    assert_eq!(
        k.ok(&[
            "get",
            "deploy",
            "web",
            "-o",
            "jsonpath={.spec.replicas}/{.status.readyReplicas}"
        ])
        .await,
        "3/3"
    );
    let table = k.ok(&["get", "deploy", "web"]).await;
    assert!(
        table
            .lines()
            .nth(1)
            .unwrap()
            .split_whitespace()
            .take(2)
            .eq(["web", "3/3"]),
        "{table}"
    );
    assert_eq!(
        k.ok(&["rollout", "restart", "deployment", "web"])
            .await
            .trim(),
        "deployment.apps/web restarted"
    );
    let ann = k
        .ok(&[
            "get",
            "deploy",
            "web",
            "-o",
            "jsonpath={.spec.template.metadata.annotations}",
        ])
        .await;
    assert!(ann.contains("kubectl.kubernetes.io/restartedAt"), "{ann}");
    let status = k
        .ok(&["rollout", "status", "deployment", "web", "--timeout=20s"])
        .await;
    assert!(status.contains("successfully rolled out"), "{status}");

    let out = k.ok(&["delete", "pod", "p1", "--grace-period=2"]).await;
    assert_eq!(out.trim(), "pod \"p1\" deleted");
    let pods = k.ok(&["get", "pods", "-o", "name"]).await;
    assert_eq!(pods.trim(), "pod/two");
    let missing = k.run(&["delete", "pod", "p1"]).await;
    assert!(
        missing.stderr.contains("pods \"p1\" not found"),
        "{missing:?}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn logs_and_exec() {
    let sim = common::start().await;
    let Some(k) = Kubectl::new(&sim) else { return };
    for i in 1..=4 {
        sim.append_log("default", "p1", "c1", &format!("line {i}"));
    }
    sim.append_log("default", "two", "b", "from b");
    assert_eq!(k.ok(&["logs", "p1", "--tail=2"]).await, "line 3\nline 4\n");
    assert_eq!(
        k.ok(&["logs", "p1", "--tail=1", "--limit-bytes=4"]).await,
        "line"
    );
    let ts = k.ok(&["logs", "p1", "--tail=1", "--timestamps"]).await;
    assert!(ts.ends_with("Z line 4\n"), "{ts}");
    assert!(k.ok(&["logs", "p1", "--since=1h"]).await.contains("line 1"));
    assert_eq!(
        k.ok(&["logs", "two", "-c", "b"]).await,
        "container b started\nfrom b\n"
    );
    let prev = k.run(&["logs", "p1", "--previous"]).await;
    assert!(
        prev.stderr
            .contains("previous terminated container \"c1\" in pod \"p1\" not found"),
        "{prev:?}"
    );

    // Follow for a bounded time: once the tail has arrived the stream is live; then feed a
    // line and wait for it.
    let mut follow = k.cmd("admin", &["logs", "-f", "p1", "--tail=1"]);
    follow
        .kill_on_drop(true)
        .stdout(std::process::Stdio::piped());
    let mut child = follow.spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = String::new();
    let mut fed = false;
    tokio::time::timeout(T, async {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 256];
        while !seen.contains("followed!") {
            let n = stdout.read(&mut buf).await.unwrap();
            assert!(n > 0, "logs -f ended early: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
            if !fed && seen.contains("line 4\n") {
                sim.append_log("default", "p1", "c1", "followed!");
                fed = true;
            }
        }
    })
    .await
    .expect("follow sees the new line");
    assert_eq!(seen, "line 4\nfollowed!\n");
    child.kill().await.unwrap();

    let exec = k
        .run(&[
            "exec",
            "p1",
            "--",
            "sh",
            "-c",
            "echo hi; echo oops >&2; exit 3",
        ])
        .await;
    assert_eq!(exec.code, Some(3), "{exec:?}");
    assert_eq!(exec.stdout, "hi\n");
    assert!(exec.stderr.contains("oops"), "{exec:?}");
    let mut cat = k.cmd("admin", &["exec", "-i", "p1", "--", "cat"]);
    cat.kill_on_drop(true)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    let mut child = cat.spawn().unwrap();
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"through stdin\n").await.unwrap();
    }
    let out = tokio::time::timeout(T, child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "through stdin\n");
    assert!(out.status.success());
    let bob = run(k.cmd("bob", &["exec", "p1", "--", "true"]), T).await;
    assert!(
        bob.stderr.contains("cannot create resource \"pods/exec\""),
        "{bob:?}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn whoami_rbac_and_watch() {
    let sim = common::start().await;
    let Some(k) = Kubectl::new(&sim) else { return };
    let me = k
        .ok(&["auth", "whoami", "--as", "jane", "--as-group", "devs"])
        .await;
    let rows: Vec<Vec<&str>> = me.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows[1], vec!["Username", "jane"]);
    assert_eq!(rows[2], vec!["Groups", "[devs", "system:authenticated]"]);
    let bob = run(
        k.cmd(
            "bob",
            &[
                "auth",
                "whoami",
                "-o",
                "jsonpath={.status.userInfo.username}",
            ],
        ),
        T,
    )
    .await;
    assert_eq!(bob.stdout, "bob");
    let denied = run(k.cmd("bob", &["get", "secrets"]), T).await;
    assert!(denied.stderr.contains("Error from server (Forbidden): secrets is forbidden: User \"bob\" cannot list resource \"secrets\""), "{denied:?}");
    // bob may impersonate; jane's own rules then apply.
    let as_jane = run(k.cmd("bob", &["get", "pods", "--as", "jane"]), T).await;
    assert!(
        as_jane
            .stderr
            .contains("User \"jane\" cannot list resource \"pods\""),
        "{as_jane:?}"
    );
    assert!(
        run(k.cmd("bob", &["get", "configmaps", "--as", "jane"]), T)
            .await
            .ok()
    );
    // eve may not impersonate at all.
    let as_denied = run(k.cmd("eve", &["get", "configmaps", "--as", "jane"]), T).await;
    assert!(
        as_denied.stderr.contains(
            "users \"jane\" is forbidden: User \"eve\" cannot impersonate resource \"users\""
        ),
        "{as_denied:?}"
    );

    // get --watch for a bounded time while objects change: read until the event shows up.
    let mut watch = k.cmd(
        "admin",
        &["get", "configmaps", "--watch", "--output-watch-events"],
    );
    watch
        .kill_on_drop(true)
        .stdout(std::process::Stdio::piped());
    let mut child = watch.spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    sim.create_object(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "watched", "namespace": "default"}})).unwrap();
    let mut text = String::new();
    tokio::time::timeout(T, async {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 512];
        while !text
            .lines()
            .any(|l| l.split_whitespace().take(2).eq(["ADDED", "watched"]))
        {
            let n = stdout.read(&mut buf).await.unwrap();
            assert!(n > 0, "watch ended early: {text}");
            text.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no ADDED event for the new config map: {text}"));
    assert!(
        text.lines()
            .next()
            .unwrap()
            .split_whitespace()
            .eq(["EVENT", "NAME", "DATA", "AGE"]),
        "{text}"
    );
    child.kill().await.unwrap();
    sim.shutdown().await;
}

/// kubectl's typed clients send protobuf bodies: create ns/deployment/secret/configmap/
/// service/serviceaccount, can-i, create token.
#[tokio::test]
async fn typed_create_commands_send_protobuf() {
    let sim = common::start().await;
    let Some(k) = Kubectl::new(&sim) else { return };
    assert_eq!(
        k.ok(&["create", "namespace", "team-a"]).await.trim(),
        "namespace/team-a created"
    );
    assert_eq!(
        k.ok(&[
            "-n",
            "team-a",
            "create",
            "deployment",
            "api",
            "--image=api:1",
            "--replicas=2",
            "--port=8080"
        ])
        .await
        .trim(),
        "deployment.apps/api created"
    );
    let dep: Value = serde_json::from_str(
        &k.ok(&["-n", "team-a", "get", "deploy", "api", "-o", "json"])
            .await,
    )
    .unwrap();
    assert_eq!(dep["spec"]["replicas"], 2);
    assert_eq!(
        dep["spec"]["selector"]["matchLabels"],
        json!({"app": "api"})
    );
    assert_eq!(
        dep["spec"]["template"]["spec"]["containers"][0],
        json!({"name": "api", "image": "api:1", "ports": [{"containerPort": 8080}], "resources": {}})
    );
    k.ok(&[
        "create",
        "secret",
        "generic",
        "pw",
        "--from-literal=user=admin",
    ])
    .await;
    assert_eq!(
        k.ok(&["get", "secret", "pw", "-o", "jsonpath={.data.user}"])
            .await,
        "YWRtaW4="
    );
    k.ok(&[
        "create",
        "configmap",
        "settings",
        "--from-literal=mode=fast",
    ])
    .await;
    assert_eq!(
        k.ok(&["get", "cm", "settings", "-o", "jsonpath={.data.mode}"])
            .await,
        "fast"
    );
    k.ok(&["create", "service", "clusterip", "api", "--tcp=80:8080"])
        .await;
    assert_eq!(
        k.ok(&[
            "get",
            "svc",
            "api",
            "-o",
            "jsonpath={.spec.ports[0].port}/{.spec.ports[0].targetPort}"
        ])
        .await,
        "80/8080"
    );
    assert_eq!(k.ok(&["auth", "can-i", "list", "pods"]).await.trim(), "yes");
    let bob = run(k.cmd("bob", &["auth", "can-i", "list", "secrets"]), T).await;
    assert_eq!(bob.stdout.trim(), "no");
    assert!(
        k.ok(&["create", "token", "default"])
            .await
            .starts_with("kube-sim-token-")
    );
    sim.shutdown().await;
}

/// port-forward: kubectl 1.33 tunnels SPDY inside a WebSocket
/// (`SPDY/3.1+portforward.k8s.io`); with the WebSocket path switched off it upgrades
/// straight to SPDY/3.1. Both move real bytes to a local echo server.
#[tokio::test]
async fn port_forward_spdy_over_websocket_and_plain_spdy() {
    let sim = common::start().await;
    let Some(k) = Kubectl::new(&sim) else { return };
    let (echo, echo_task) = common::echo_server().await;
    sim.add_pod_port("default", "p1", 8080, echo);
    let data = common::payload(2 * 1024 * 1024 + 5);
    for (websockets, transport) in [("true", "spdy-over-websocket"), ("false", "spdy")] {
        let mut pf = k.cmd(
            "admin",
            &["port-forward", "--address", "127.0.0.1", "pod/p1", ":8080"],
        );
        pf.env("KUBECTL_PORT_FORWARD_WEBSOCKETS", websockets)
            .kill_on_drop(true)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        let mut child = pf.spawn().unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let ports = common::forwarded_ports(&mut stdout, 1, T).await;
        assert_eq!(ports[0].1, 8080);
        for round in 0..2 {
            let back = common::echo_through(ports[0].0, &data, T).await;
            assert_eq!(back.len(), data.len(), "{transport} round {round}");
            assert_eq!(
                common::fnv64(&back),
                common::fnv64(&data),
                "{transport} round {round}"
            );
        }
        let last = sim.stream_sessions().pop().expect("a recorded session");
        assert_eq!(
            (
                last.subresource.as_str(),
                last.transport.as_str(),
                last.protocol.as_str()
            ),
            ("portforward", transport, "portforward.k8s.io")
        );
        assert!(child.try_wait().unwrap().is_none(), "port-forward exited");
        child.kill().await.unwrap();
    }
    echo_task.abort();
    sim.shutdown().await;
}

/// exec with the WebSocket path switched off: kubectl 1.33 falls back to SPDY/3.1 and
/// negotiates `v4.channel.k8s.io`.
#[tokio::test]
async fn exec_over_spdy() {
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
            "tr a-z A-Z; echo err >&2; exit 7",
        ],
    );
    c.env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false")
        .kill_on_drop(true)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"shout\n").await.unwrap();
    }
    let out = tokio::time::timeout(T, child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "SHOUT\n");
    assert!(stderr.contains("err\n"), "{stderr}");
    assert!(
        stderr.contains("command terminated with exit code 7"),
        "{stderr}"
    );
    let last = sim.stream_sessions().pop().expect("a recorded session");
    assert_eq!(
        (last.transport.as_str(), last.protocol.as_str()),
        ("spdy", "v4.channel.k8s.io")
    );
    sim.shutdown().await;
}
