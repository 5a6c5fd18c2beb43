//! Real hub and agent processes, for tests that kill them with SIGKILL or
//! run them in network namespaces of their own.
//!
//! Cargo builds the binaries of the package under test only, so this crate
//! cannot name `otter` or `otter-agent`. Instead the test binary runs
//! itself again as the process: the child calls the same entry point the
//! binaries' `main` calls (`otter_hub::cli::run`, `otter_agent::cli::run`)
//! with the arguments given. A test file that uses this declares the entry
//! point once:
//!
//! ```ignore
//! #[test]
//! #[ignore = "entry point of the processes the tests start"]
//! fn child_process() {
//!     otter_e2e::procs::child_main();
//! }
//! ```
//!
//! Every [`Proc`] is killed and reaped when dropped, so a failing test
//! leaves no process behind.

use std::{
    io::{BufRead, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    time::Duration,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// Name of the entry-point test in each test file that starts processes.
pub const ENTRY: &str = "child_process";
pub const ROLE_ENV: &str = "OTTER_E2E_ROLE";
const ARGS_ENV: &str = "OTTER_E2E_ARGS";

/// What a child process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The `otter` command line (`otter hub …`, `otter get …`).
    Otter,
    /// The `otter-agent` command line.
    Agent,
    /// The Kubernetes API test server (see [`kube_sim_main`]).
    KubeSim,
    /// One HTTP GET, `<address> <path>`: prints the body of a 200 answer,
    /// exits 1 otherwise (a probe of the agent's `/metrics` from inside
    /// its namespace).
    HttpGet,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::Otter => "otter",
            Role::Agent => "otter-agent",
            Role::KubeSim => "kube-sim",
            Role::HttpGet => "http-get",
        }
    }
}

/// Runs the role named in the environment and exits with its code; does
/// nothing when the test binary was not started as a child.
pub fn child_main() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        eprintln!("{ENTRY}: runs only as a process started by a test");
        return;
    };
    let args: Vec<String> = std::env::var(ARGS_ENV)
        .ok()
        .and_then(|a| serde_json::from_str(&a).ok())
        .unwrap_or_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let code = runtime.block_on(async move {
        match role.as_str() {
            "otter" => {
                use clap::Parser;
                let argv = std::iter::once("otter".to_owned()).chain(args);
                match otter_hub::cli::Cli::try_parse_from(argv) {
                    Ok(cli) => {
                        // As the binary's own main does.
                        otter_tunnel::logging::init(cli.log_format);
                        otter_hub::cli::run(cli).await
                    }
                    Err(e) => {
                        eprintln!("{e}");
                        64
                    }
                }
            }
            "otter-agent" => {
                use clap::Parser;
                let argv = std::iter::once("otter-agent".to_owned()).chain(args);
                match otter_agent::cli::Cli::try_parse_from(argv) {
                    Ok(cli) => {
                        otter_tunnel::logging::init(cli.log_format);
                        otter_agent::cli::run(cli).await
                    }
                    Err(e) => {
                        eprintln!("{e}");
                        64
                    }
                }
            }
            "kube-sim" => {
                otter_tunnel::logging::init(otter_tunnel::logging::LogFormat::Text);
                kube_sim_main(&args).await
            }
            "http-get" => {
                let addr = args.first().and_then(|a| a.parse().ok());
                let path = args.get(1).map_or("/", String::as_str);
                match addr {
                    Some(addr) => match http_get(addr, path).await {
                        Some(body) => {
                            // A line of its own: the harness printed a prefix.
                            println!("\n{body}");
                            0
                        }
                        None => 1,
                    },
                    None => 64,
                }
            }
            other => {
                eprintln!("unknown role {other}");
                64
            }
        }
    });
    // Exit here: the harness must not go on to report on the entry test.
    std::process::exit(code);
}

/// The test server as a process: `<listen address> <kubeconfig file>`.
/// It serves pod `default/web`, writes a kubeconfig for its admin once it
/// listens, and takes commands on stdin, one per line:
/// `configmap <name>` creates a ConfigMap in `default`;
/// `echo <port>` serves a TCP echo on pod `web`'s `<port>`;
/// `source <port>` a server that sends without end ([`source_server`]);
/// `sink <port>` one that counts what it gets ([`ack_sink`]);
/// `log <line>` appends a line to the log of pod `web`'s container `app`.
async fn kube_sim_main(args: &[String]) -> i32 {
    let (Some(listen), Some(kubeconfig)) = (args.first(), args.get(1)) else {
        eprintln!("kube-sim: <listen address> <kubeconfig file>");
        return 64;
    };
    let Ok(listen) = listen.parse() else {
        eprintln!("kube-sim: bad address {listen}");
        return 64;
    };
    let config = crate::kube::sim_config()
        .pod("default", "web", &["app"])
        .listen(listen);
    let sim = match kube_sim::KubeSim::start(config).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kube-sim: {e}");
            return 1;
        }
    };
    let tmp = format!("{kubeconfig}.tmp");
    let written = std::fs::write(&tmp, sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN))
        .and_then(|()| std::fs::rename(&tmp, kubeconfig));
    if let Err(e) = written {
        eprintln!("kube-sim: {kubeconfig}: {e}");
        return 1;
    }
    // Commands come from a blocking reader; the runtime keeps serving.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<String>(16);
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { return };
            if tx.blocking_send(line).is_err() {
                return;
            }
        }
    });
    while let Some(line) = rx.recv().await {
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("configmap"), Some(name)) => {
                let cm = serde_json::json!({
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": name, "namespace": "default"},
                    "data": {"k": "v"},
                });
                if let Err(e) = sim.create_object(cm) {
                    eprintln!("kube-sim: configmap {name}: {e:?}");
                }
            }
            (Some("log"), Some(text)) => sim.append_log("default", "web", "app", text),
            (Some(kind @ ("echo" | "source" | "sink")), Some(port)) => {
                if let Ok(port) = port.parse() {
                    let server = match kind {
                        "echo" => echo_server().await,
                        "source" => source_server().await,
                        _ => ack_sink().await,
                    };
                    sim.add_pod_port("default", "web", port, server);
                }
            }
            _ => eprintln!("kube-sim: unknown command {line:?}"),
        }
    }
    // Stdin closed: the test is done with us.
    0
}

/// A loopback TCP server running `handle` on each connection; returns its
/// address.
async fn serve_each<F, Fut>(handle: F) -> std::net::SocketAddr
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(handle(tcp));
        }
    });
    addr
}

/// A loopback TCP echo server; returns its address.
pub async fn echo_server() -> std::net::SocketAddr {
    serve_each(|mut tcp| async move {
        let (mut r, mut w) = tcp.split();
        let _ = tokio::io::copy(&mut r, &mut w).await;
        let _ = w.shutdown().await;
    })
    .await
}

/// A loopback server that sends a pattern to each client until it goes
/// away (the far end of a download): byte `i` of every 64 KiB is `i * 7`
/// (mod 256). Returns its address.
pub async fn source_server() -> std::net::SocketAddr {
    let block: Vec<u8> = (0..64 * 1024).map(|i| (i * 7) as u8).collect();
    let block = bytes::Bytes::from(block);
    serve_each(move |mut tcp| {
        let block = block.clone();
        async move { while tcp.write_all(&block).await.is_ok() {} }
    })
    .await
}

/// Bytes [`ack_sink`] takes for each byte it answers.
pub const ACK_EVERY: u64 = 1024 * 1024;

/// A loopback server that reads what each client sends and answers one
/// byte (`k`) for every [`ACK_EVERY`] bytes it got (the far end of an
/// upload: the client counts what arrived); returns its address.
pub async fn ack_sink() -> std::net::SocketAddr {
    serve_each(|mut tcp| async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut got = 0u64;
        while let Ok(n) = tcp.read(&mut buf).await {
            if n == 0 {
                return;
            }
            let before = got / ACK_EVERY;
            got += n as u64;
            let acks = (got / ACK_EVERY - before) as usize;
            if acks > 0 && tcp.write_all(&b"k".repeat(acks)).await.is_err() {
                return;
            }
        }
    })
    .await
}

/// A running child process: killed (SIGKILL) and reaped when dropped. Its
/// stdout and stderr go to files in `dir`, for the test to read or show.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    out: PathBuf,
    err: PathBuf,
}

impl Proc {
    /// Starts `role` with `args`; inside network namespace `netns` when
    /// given (through `ip netns exec`, which execs in place, so the pid is
    /// the process's own).
    pub fn start(name: &str, role: Role, args: &[String], dir: &Path, netns: Option<&str>) -> Proc {
        Self::start_env(name, role, args, dir, netns, &[])
    }

    /// Like [`Proc::start`], with `env` set for the process besides what
    /// it inherits.
    pub fn start_env(
        name: &str,
        role: Role,
        args: &[String],
        dir: &Path,
        netns: Option<&str>,
        env: &[(&str, &str)],
    ) -> Proc {
        let exe = std::env::current_exe().expect("test binary");
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        cmd.args([
            ENTRY,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, role.as_str())
        .env(ARGS_ENV, serde_json::to_string(args).expect("JSON"))
        .envs(env.iter().copied());
        Self::spawn(name, cmd, dir)
    }

    fn spawn(name: &str, mut cmd: Command, dir: &Path) -> Proc {
        let out = dir.join(format!("{name}.out"));
        let err = dir.join(format!("{name}.err"));
        let file = |p: &Path| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .expect("log file")
        };
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(file(&out))
            .stderr(file(&err))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let stdin = child.stdin.take();
        Proc {
            name: name.to_owned(),
            child: Some(child),
            stdin,
            out,
            err,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// SIGKILL, then reap: the process gets no chance to clean up.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.stdin = None;
    }

    /// Waits (bounded) for the process to exit by itself; its exit code
    /// (-1 when killed by a signal), or None when it ran over `limit` (then
    /// it is killed).
    pub fn wait(&mut self, limit: Duration) -> Option<i32> {
        let deadline = std::time::Instant::now() + limit;
        let child = self.child.as_mut()?;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status.code().unwrap_or(-1));
            }
            if std::time::Instant::now() > deadline {
                self.kill9();
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Writes one command line to the process's stdin.
    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}").expect("write to child");
        stdin.flush().expect("flush");
    }

    /// What the process printed on stdout so far.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// What the process printed on stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// The last `n` lines of stderr, to explain a failure.
    pub fn tail(&self, n: usize) -> String {
        let err = self.stderr();
        let lines: Vec<&str> = err.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Resident memory of process `pid` in MiB (VmRSS), if it runs.
pub fn rss_mib(pid: u32) -> Option<f64> {
    Some(rss_kib_of(&format!("/proc/{pid}/status"))? as f64 / 1024.0)
}

/// Resident memory of this process in KiB (VmRSS). Panics when
/// `/proc/self/status` cannot be read or has no VmRSS: a leak check must
/// not read an unmeasurable process as using nothing.
pub fn own_rss_kib() -> u64 {
    let path = "/proc/self/status";
    let status = std::fs::read_to_string(path).unwrap_or_else(|e| {
        panic!("cannot measure this process's memory: reading {path} failed: {e}")
    });
    vm_rss_kib(&status).unwrap_or_else(|| {
        panic!("cannot measure this process's memory: no VmRSS line in {path}:\n{status}")
    })
}

/// File descriptors this process has open. Panics when `/proc/self/fd`
/// cannot be listed: a leak check must not read that as none open.
pub fn own_open_fds() -> usize {
    let path = "/proc/self/fd";
    std::fs::read_dir(path)
        .unwrap_or_else(|e| {
            panic!("cannot count this process's open files: listing {path} failed: {e}")
        })
        .count()
}

fn rss_kib_of(status: &str) -> Option<u64> {
    vm_rss_kib(&std::fs::read_to_string(status).ok()?)
}

/// Starts process `pid`'s peak resident memory (VmHWM) again from what it
/// holds now; false when the kernel refused (not its owner, or too old).
pub fn reset_peak_rss(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// The most resident memory process `pid` has had, in MiB (VmHWM), if it
/// runs.
pub fn peak_rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some(status_kib(&status, "VmHWM:")? as f64 / 1024.0)
}

/// Runs `work` and returns its output with how far process `pid`'s peak
/// resident memory rose above what it held before, in MiB. Panics when
/// the peak cannot be reset or read: unmeasured is not "no growth".
pub async fn peak_growth_mib<T>(pid: u32, work: impl Future<Output = T>) -> (T, f64) {
    // The peak from here on: the process's start-up peak is above its idle
    // memory, and would hide growth below it.
    assert!(
        reset_peak_rss(pid),
        "cannot reset the peak memory of process {pid} (/proc/{pid}/clear_refs)"
    );
    let before = rss_mib(pid).expect("memory of the process");
    let out = work.await;
    let peak = peak_rss_mib(pid).expect("memory of the process");
    (out, peak - before)
}

/// The VmRSS (KiB) of the text of a `/proc/<pid>/status`.
fn vm_rss_kib(status: &str) -> Option<u64> {
    status_kib(status, "VmRSS:")
}

/// The figure (KiB) of line `key` of a `/proc/<pid>/status` text.
fn status_kib(status: &str, key: &str) -> Option<u64> {
    status
        .lines()
        .find(|l| l.starts_with(key))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// A free loopback TCP port whose UDP twin is free too (the hub's tunnel
/// port serves both), so a hub restarted on it finds it again.
///
/// It is taken from below the kernel's ephemeral range: every agent binds
/// an ephemeral UDP port for QUIC, and while a hub restarts an agent that
/// starts meanwhile could take the very port the hub is about to bind
/// again (on separate machines, as in production, that cannot happen).
pub fn free_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let span = low.saturating_sub(10_000).max(1);
    for _ in 0..256 {
        let port = 10_000 + rand_below(span);
        let tcp = std::net::TcpListener::bind(("127.0.0.1", port));
        if tcp.is_ok() && std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port with a free UDP twin below {low}");
}

/// A number in [0, n), random enough to spread tests over ports.
fn rand_below(n: u16) -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() % u64::from(n)) as u16
}

/// Waits (bounded) until `path` exists.
pub fn wait_for_file(path: &Path, limit: Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// The contents of a file another process writes, once `whole` says they
/// are all there (the file can exist before its last byte is written).
pub fn read_when_whole(
    path: &Path,
    limit: Duration,
    whole: impl Fn(&str) -> bool,
) -> Option<String> {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        if let Ok(text) = std::fs::read_to_string(path)
            && whole(&text)
        {
            return Some(text);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// A PEM bundle written to its end.
pub fn whole_pem(text: &str) -> bool {
    text.trim_end().ends_with("-----END CERTIFICATE-----")
}

/// One plain HTTP/1.1 GET to `addr` (the agent's health listener);
/// the body, or None when nothing answers.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fetch = async {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        tcp.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        tcp.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, body) = text.split_once("\r\n\r\n")?;
        head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
    };
    tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .ok()
        .flatten()
}
