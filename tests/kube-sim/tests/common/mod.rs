//! Helpers shared by the kube-sim integration tests.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube_sim::{KubeSim, SimConfig};

/// Tokens of the users every test cluster has.
pub const BOB_TOKEN: &str = "bob-token";
pub const EVE_TOKEN: &str = "eve-token";

/// Admin, plus bob (may read pods in `default` and impersonate users and groups `devs`),
/// plus eve (may only read configmaps in `default`), plus rules for the impersonated jane.
pub fn config() -> SimConfig {
    let _ = rustls::crypto::ring::default_provider().install_default();
    SimConfig::default_with_admin()
        .user(BOB_TOKEN, "bob", &["devs"])
        .user(EVE_TOKEN, "eve", &[])
        .allow(
            "group:devs",
            &["get", "list", "watch"],
            &["pods"],
            &["default"],
        )
        .allow("bob", &["impersonate"], &["users"], &[])
        .allow("bob", &["impersonate"], &["groups"], &[])
        .allow("bob", &["create"], &["selfsubjectreviews"], &[])
        .allow("jane", &["get", "list"], &["configmaps"], &["default"])
        .allow(
            "group:system:authenticated",
            &["create"],
            &["selfsubjectreviews", "selfsubjectaccessreviews"],
            &[],
        )
        .allow("eve", &["get", "list"], &["configmaps"], &["default"])
        .pod("default", "p1", &["c1"])
        .pod("default", "two", &["a", "b"])
        .bookmark_interval(Duration::from_millis(300))
}

pub async fn start() -> KubeSim {
    KubeSim::start(config()).await.expect("start kube-sim")
}

pub async fn client_for(
    sim: &KubeSim,
    token: &str,
    impersonate: Option<(&str, Vec<String>)>,
) -> kube::Client {
    let kc = Kubeconfig::from_yaml(&sim.kubeconfig_yaml(token)).expect("kubeconfig");
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("config");
    if let Some((user, groups)) = impersonate {
        cfg.auth_info.impersonate = Some(user.to_string());
        if !groups.is_empty() {
            cfg.auth_info.impersonate_groups = Some(groups);
        }
    }
    kube::Client::try_from(cfg).expect("client")
}

pub async fn admin(sim: &KubeSim) -> kube::Client {
    client_for(sim, kube_sim::ADMIN_TOKEN, None).await
}

/// The workspace root (tools and the venv live there).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Whether missing external tools fail the test instead of skipping it.
pub fn tools_required() -> bool {
    std::env::var("OTTER_REQUIRE_TOOLS").is_ok_and(|v| v == "1")
}

/// Returns the tool path, or None after printing why the test is skipped (or panics when
/// OTTER_REQUIRE_TOOLS=1).
pub fn tool_or_skip(path: Option<PathBuf>, what: &str, how: &str) -> Option<PathBuf> {
    match path {
        Some(p) if p.exists() => Some(p),
        _ => {
            if tools_required() {
                panic!("{what} is missing and OTTER_REQUIRE_TOOLS=1: {how}");
            }
            eprintln!("skipped: {what} not found ({how})");
            None
        }
    }
}

/// Output of a finished command.
#[derive(Debug)]
pub struct Out {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }
}

/// Runs a command with a timeout; the process is killed if it overruns.
pub async fn run(mut cmd: tokio::process::Command, timeout: Duration) -> Out {
    cmd.kill_on_drop(true)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = cmd.spawn().expect("spawn");
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Ok(Ok(o)) => Out {
            code: o.status.code(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        },
        Ok(Err(e)) => panic!("waiting for {cmd:?}: {e}"),
        Err(_) => panic!("{cmd:?} did not finish within {timeout:?}"),
    }
}
