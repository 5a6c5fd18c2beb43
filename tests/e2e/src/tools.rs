//! Third-party clients run as subprocesses: where they are, skipping when
//! they are missing (failing instead under `OTTER_REQUIRE_TOOLS=1`, as
//! `make test` runs), and running them with a time bound.

use std::{
    path::{Path, PathBuf},
    process::Output,
    time::Duration,
};

/// The workspace root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("workspace root")
        .to_owned()
}

/// Whether missing tools fail the test instead of skipping it.
pub fn tools_required() -> bool {
    std::env::var("OTTER_REQUIRE_TOOLS").is_ok_and(|v| v == "1")
}

/// `Some(path)` when `path` exists; otherwise prints why the test is
/// skipped and returns `None`, or panics under `OTTER_REQUIRE_TOOLS=1`.
pub fn tool(path: PathBuf, what: &str, how: &str) -> Option<PathBuf> {
    if path.exists() {
        return Some(path);
    }
    if tools_required() {
        panic!(
            "{what} is missing ({}) and OTTER_REQUIRE_TOOLS=1: {how}",
            path.display()
        );
    }
    eprintln!("skipped: {what} is missing ({}); {how}", path.display());
    None
}

/// The Python of the project's venv (grpcio, schemathesis).
pub fn venv_python() -> Option<PathBuf> {
    tool(
        workspace_root().join(".venv/bin/python"),
        "the Python venv",
        "run `scripts/setup.sh python`",
    )
}

/// Debian's curl, the client probes and scrape checks are written with.
pub fn curl() -> Option<PathBuf> {
    tool(
        PathBuf::from("/usr/bin/curl"),
        "curl",
        "run `scripts/setup.sh apt`",
    )
}

/// Debian's kubectl 1.20 (extracted by `scripts/setup.sh kubectl`): the
/// client that speaks only SPDY for exec and port-forward.
pub fn kubectl_120() -> Option<PathBuf> {
    tool(
        workspace_root().join(".tools/kubectl-1.20/usr/bin/kubectl"),
        "Debian's kubectl 1.20",
        "run `scripts/setup.sh kubectl`",
    )
}

/// The npm packages of `ts/` (buf, tsc, connect-node).
pub fn ts_node_modules() -> Option<PathBuf> {
    let dir = workspace_root().join("ts/node_modules");
    tool(
        dir.join("@connectrpc/connect-node/package.json"),
        "the npm packages of ts/",
        "run `scripts/setup.sh npm`",
    )?;
    Some(dir)
}

/// Runs `cmd`, killing it after `limit`. Panics when it cannot start or
/// runs over.
pub async fn run_bounded(cmd: &mut tokio::process::Command, limit: Duration) -> Output {
    cmd.kill_on_drop(true)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let what = format!("{:?}", cmd.as_std());
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    match tokio::time::timeout(limit, child.wait_with_output()).await {
        Ok(out) => out.unwrap_or_else(|e| panic!("{what}: {e}")),
        Err(_) => panic!("{what} ran over {limit:?}"),
    }
}

/// Like [`run_bounded`], and the command must succeed; returns stdout.
pub async fn run_ok(cmd: &mut tokio::process::Command, limit: Duration) -> String {
    let out = run_bounded(cmd, limit).await;
    assert!(
        out.status.success(),
        "{:?} failed ({}):\n{}\n{}",
        cmd.as_std(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// The last line of `stdout` that parses as JSON.
pub fn last_json(stdout: &str) -> serde_json::Value {
    stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l.trim()).ok())
        .unwrap_or_else(|| panic!("no JSON line in output:\n{stdout}"))
}

/// A server process a test started (tinyproxy, stunnel, a registry):
/// killed and reaped when dropped, its scratch directory removed.
#[derive(Debug)]
pub struct Daemon {
    child: std::process::Child,
    pub addr: std::net::SocketAddr,
    pub port: u16,
    dir: tempfile::TempDir,
}

impl Daemon {
    /// The daemon's scratch directory (its configuration and logs).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port.
pub fn free_port() -> u16 {
    crate::procs::free_port()
}

/// Starts `cmd` and waits (bounded) until it listens on 127.0.0.1:`port`.
pub fn daemon(cmd: std::process::Command, port: u16, dir: tempfile::TempDir) -> Daemon {
    daemon_at(cmd, std::net::SocketAddr::from(([127, 0, 0, 1], port)), dir)
}

/// Starts `cmd` and waits (bounded) until it listens on `addr`.
pub fn daemon_at(
    mut cmd: std::process::Command,
    addr: std::net::SocketAddr,
    dir: tempfile::TempDir,
) -> Daemon {
    let child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let d = Daemon {
        child,
        addr,
        port: addr.port(),
        dir,
    };
    for _ in 0..100 {
        if std::net::TcpStream::connect(addr).is_ok() {
            return d;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{cmd:?} did not start listening on {addr}");
}
