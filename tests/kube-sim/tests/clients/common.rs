//! Helpers shared by the kube-sim integration tests.

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

/// A loopback echo server: each connection gets back what it sends, then EOF once the
/// client has half-closed. Runs until the returned task is aborted (or the runtime ends).
pub async fn echo_server() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                use tokio::io::AsyncWriteExt;
                let _ = w.shutdown().await;
            });
        }
    });
    (addr, task)
}

/// Reads `kubectl port-forward` output until it has named `n` local ports it listens on
/// (`Forwarding from 127.0.0.1:LOCAL -> REMOTE`); returns (local, remote) pairs.
pub async fn forwarded_ports(
    out: &mut tokio::process::ChildStdout,
    n: usize,
    timeout: Duration,
) -> Vec<(u16, u16)> {
    use tokio::io::AsyncReadExt;
    let mut text = String::new();
    let mut buf = [0u8; 256];
    let parse = |text: &str| -> Vec<(u16, u16)> {
        text.lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("Forwarding from 127.0.0.1:")?;
                let (local, remote) = rest.split_once(" -> ")?;
                Some((local.trim().parse().ok()?, remote.trim().parse().ok()?))
            })
            .collect()
    };
    tokio::time::timeout(timeout, async {
        loop {
            let found = parse(&text);
            if found.len() >= n {
                return found;
            }
            let got = out.read(&mut buf).await.unwrap();
            assert!(got > 0, "port-forward ended before listening: {text}");
            text.push_str(&String::from_utf8_lossy(&buf[..got]));
        }
    })
    .await
    .unwrap_or_else(|_| panic!("port-forward did not report its ports: {text}"))
}

/// A deterministic pseudo-random payload.
pub fn payload(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// FNV-1a, 64 bits: a checksum to compare what went out with what came back.
pub fn fnv64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Connects to a forwarded local port, sends `data` (then half-closes) while reading, and
/// returns everything read until EOF.
pub async fn echo_through(port: u16, data: &[u8], timeout: Duration) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the forwarded port");
    let (mut r, mut w) = s.into_split();
    // A port kubectl cannot forward ends with a close or, as timing has
    // it, a reset: either way what came back is what the caller checks.
    let send = async {
        for chunk in data.chunks(64 * 1024) {
            if w.write_all(chunk).await.is_err() {
                return;
            }
        }
        let _ = w.shutdown().await;
    };
    let recv = async {
        let mut got = Vec::with_capacity(data.len());
        let _ = r.read_to_end(&mut got).await;
        got
    };
    tokio::time::timeout(timeout, async { tokio::join!(send, recv).1 })
        .await
        .expect("echo through port-forward finished in time")
}
