//! The Python `kubernetes` client (from the project's venv) against kube-sim: runs the
//! pytest suite in `py/` with a timeout and checks every test passed. Skipped with a
//! message when the venv is missing (run `scripts/setup.sh python`).

use crate::common;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn python_client_suite() {
    let python = common::workspace_root().join(".venv/bin/python");
    let Some(python) = common::tool_or_skip(
        Some(python),
        "the Python venv",
        "run scripts/setup.sh python",
    ) else {
        return;
    };
    // A short event history makes resourceVersion 1 too old for the 410 test.
    let sim = kube_sim::KubeSim::start(common::config().event_window(5))
        .await
        .unwrap();
    sim.append_log("default", "p1", "c1", "from rust");

    // An echo server behind the pod's forwarded port.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = listener.local_addr().unwrap();
    let echo = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1024];
                if let Ok(n) = s.read(&mut buf).await {
                    let _ = s.write_all(b"echo: ").await;
                    let _ = s.write_all(&buf[..n]).await;
                }
            });
        }
    });
    let port = 8080;
    sim.add_pod_port("default", "p1", port, target);

    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN)).unwrap();
    let suite = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("py");
    let mut cmd = tokio::process::Command::new(python);
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"])
        .arg(&suite)
        .env("KUBESIM_KUBECONFIG", &kubeconfig)
        .env("KUBESIM_FORWARDED_PORT", port.to_string())
        .env("HOME", dir.path());
    let out = common::run(cmd, Duration::from_secs(120)).await;
    echo.abort();
    sim.shutdown().await;
    assert!(out.ok(), "pytest failed:\n{}\n{}", out.stdout, out.stderr);
    let summary = out.stdout.lines().last().unwrap_or_default().to_string();
    assert!(
        summary.contains("10 passed") && !summary.contains("skipped"),
        "{summary}"
    );
}
