//! Debian's kubectl 1.20 (legacy discovery, no WebSocket) against kube-sim: discovery,
//! CRUD, server-side apply, patches, scale, logs and `--as`. kubectl 1.20 validates with a
//! protobuf OpenAPI v2 document the server does not serve, so writes pass
//! `--validate=false`. Skipped with a message when `scripts/setup.sh` has not run.

mod common;

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

    async fn run_as(&self, user: &str, args: &[&str]) -> Out {
        let mut c = tokio::process::Command::new(&self.bin);
        c.arg("--kubeconfig")
            .arg(self.dir.path().join(user))
            .args(args);
        c.env("HOME", self.dir.path())
            .env("KUBECACHEDIR", self.dir.path().join("cache"));
        run(c, T).await
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
