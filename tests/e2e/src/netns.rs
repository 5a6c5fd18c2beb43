//! Two network namespaces joined by a veth pair, for tests that cut the
//! path between a hub and an agent for real (the link goes down; packets
//! stop; nothing is told to either side).
//!
//! Everything lives inside the two namespaces this creates: the veth ends
//! are created there directly, with private addresses, so the machine's
//! own namespace (its links, addresses and routes) is never touched. Names
//! are unique per process and pair; dropping the pair deletes both
//! namespaces, which removes the veth pair with them, also when a test
//! panics. Kill the processes inside first (drop them before the pair).

use std::{net::Ipv4Addr, process::Command, sync::atomic::AtomicU32};

/// The hub's end of the link.
pub const HUB_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
/// The agent's end of the link.
pub const AGENT_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 2);
const HUB_IF: &str = "otter-h";
const AGENT_IF: &str = "otter-a";

/// Two namespaces, `hub` and `agent`, joined by one veth pair.
#[derive(Debug)]
pub struct NetPair {
    pub hub: String,
    pub agent: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl NetPair {
    /// Creates the namespaces and the link between them, up. Err when this
    /// machine does not let us (no privilege, no `ip`): a capability of the
    /// machine, so callers skip rather than fail.
    pub fn create() -> Result<NetPair, String> {
        let pair = Self::namespaces()?;
        pair.setup()?;
        Ok(pair)
    }

    /// The two namespaces, each with its loopback up, and no link between
    /// them yet (see [`crate::wan::WanLink`] for another kind of link).
    pub fn namespaces() -> Result<NetPair, String> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let base = format!("otter-e2e-{}-{n}", std::process::id());
        let hub = format!("{base}-hub");
        let agent = format!("{base}-agent");
        ip(&["netns", "add", &hub])?;
        // From here on, Drop cleans up whatever was made.
        let mut pair = NetPair {
            hub,
            agent: String::new(),
        };
        ip(&["netns", "add", &agent])?;
        pair.agent = agent;
        for ns in [&pair.hub, &pair.agent] {
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }

    /// [`NetPair::create`], or `None` with a line saying why this machine
    /// cannot; under `OTTER_REQUIRE_TOOLS=1` (`make test`) that panics
    /// instead, so a green run never means "skipped".
    pub fn create_or_skip() -> Option<NetPair> {
        or_skip(NetPair::create())
    }

    fn setup(&self) -> Result<(), String> {
        let (h, a) = (self.hub.as_str(), self.agent.as_str());
        ip(&[
            "-n", h, "link", "add", HUB_IF, "type", "veth", "peer", "name", AGENT_IF, "netns", a,
        ])?;
        ip(&[
            "-n",
            h,
            "addr",
            "add",
            &format!("{HUB_IP}/30"),
            "dev",
            HUB_IF,
        ])?;
        ip(&[
            "-n",
            a,
            "addr",
            "add",
            &format!("{AGENT_IP}/30"),
            "dev",
            AGENT_IF,
        ])?;
        for (ns, dev) in [(h, HUB_IF), (a, AGENT_IF)] {
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(())
    }

    /// Takes the link down (true) or brings it back up (false), on the
    /// agent's end: the hub's end loses its carrier and drops what it sends,
    /// the agent's end has no route; neither is told anything else.
    pub fn cut(&self, down: bool) {
        let state = if down { "down" } else { "up" };
        ip(&["-n", &self.agent, "link", "set", AGENT_IF, state]).expect("set link state");
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        for ns in [&self.agent, &self.hub] {
            if !ns.is_empty()
                && let Err(e) = ip(&["netns", "delete", ns])
            {
                eprintln!("could not delete network namespace {ns}: {e}");
            }
        }
    }
}

/// `made`, or `None` with a line saying why this machine cannot make
/// network namespaces; under `OTTER_REQUIRE_TOOLS=1` (`make test`) that
/// panics instead, so a green run never means "skipped".
pub fn or_skip<T>(made: Result<T, String>) -> Option<T> {
    match made {
        Ok(p) => Some(p),
        Err(e) if crate::tools::tools_required() => panic!(
            "cannot create the network namespaces and OTTER_REQUIRE_TOOLS=1: {e}\n\
                 (needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN, and `ip` from iproute2: \
                 `scripts/setup.sh apt` installs it)"
        ),
        Err(e) => {
            eprintln!(
                "skipped: this machine does not let the test create network namespaces ({e})"
            );
            None
        }
    }
}

/// Owned strings of `v`, for process arguments.
pub fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

/// `otter-agent`'s arguments for cluster `edge-0` (agent `agent-0`) of a
/// scene: its join token (`token`), state (`state`) and kubeconfig in
/// `dir`, its health port on `health`, then `more`.
pub fn agent_args(
    api: &str,
    ca: &str,
    dir: &std::path::Path,
    transports: &str,
    keepalive_secs: u64,
    health: &str,
    more: &[&str],
) -> Vec<String> {
    let file = |name: &str| dir.join(name).display().to_string();
    let mut args = strings(&[
        "--hub-url",
        api,
        "--cluster",
        "edge-0",
        "--agent-id",
        "agent-0",
        "--hub-ca-file",
        ca,
        "--join-token-file",
        &file("token"),
        "--state-dir",
        &file("state"),
        "--transports",
        transports,
        "--keepalive-secs",
        &keepalive_secs.to_string(),
        "--health-listen",
        health,
        "--kubeconfig",
        &file("kubeconfig"),
    ]);
    args.extend(strings(more));
    args
}

/// Polls `check` every 100 ms until it holds; panics with `what` after
/// `limit`. Returns how long it took.
pub fn until(
    what: &str,
    limit: std::time::Duration,
    mut check: impl FnMut() -> bool,
) -> std::time::Duration {
    let started = std::time::Instant::now();
    while !check() {
        assert!(started.elapsed() < limit, "timed out: {what}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    started.elapsed()
}

/// Prepares a hub's data directory with a hub in this process (the store
/// is then handed to a hub process): mints a join token for `cluster` into
/// `token_file`; returns the admin token.
pub fn prepare_hub(data: &std::path::Path, token_file: &std::path::Path, cluster: &str) -> String {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut config = otter_hub::HubConfig::new(data);
        config.api_listen = "127.0.0.1:0".parse().expect("address");
        config.tunnel_listen = "127.0.0.1:0".parse().expect("address");
        let hub = otter_hub::Hub::start(config).await.expect("setup hub");
        let token = hub.mint_join_token(cluster).expect("join token");
        std::fs::write(token_file, token).expect("token file");
        hub.shutdown().await;
    });
    std::fs::read_to_string(data.join("admin-token"))
        .expect("admin token")
        .trim()
        .to_owned()
}

/// One read of `/metrics` (an agent's, or the hub's) at `health` from
/// inside namespace `netns` (the probe's output file in `dir` is removed
/// after).
pub fn agent_metrics(netns: &str, health: &str, dir: &std::path::Path) -> Option<String> {
    use crate::procs::{Proc, Role};
    let mut probe = Proc::start(
        "probe",
        Role::HttpGet,
        &strings(&[health, "/metrics"]),
        dir,
        Some(netns),
    );
    let code = probe.wait(std::time::Duration::from_secs(10));
    let out = probe.stdout();
    let _ = std::fs::remove_file(dir.join("probe.out"));
    (code == Some(0)).then_some(out)
}

/// Runs `f` on a thread of its own inside network namespace `ns` (sockets
/// it opens belong to that namespace, wherever they are used later), and
/// returns what `f` returns. The calling thread stays where it is.
pub fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let path = format!("/var/run/netns/{ns}");
    let handle = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    std::thread::spawn(move || {
        use std::os::fd::AsFd;
        rustix::thread::move_into_link_name_space(
            handle.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .map_err(|e| format!("setns {path}: {e}"))?;
        Ok(f())
    })
    .join()
    .map_err(|_| "the thread in the namespace panicked".to_owned())?
}

/// The Kubernetes API test server as a process in namespace `ns`, on its
/// loopback port 6443, its kubeconfig written to `dir/kubeconfig`; Err
/// with its last lines when it does not start.
pub fn start_kube_sim(dir: &std::path::Path, ns: &str) -> Result<crate::procs::Proc, String> {
    use crate::procs::{Proc, Role, wait_for_file};
    let kubeconfig = dir.join("kubeconfig");
    let sim = Proc::start(
        "kube-sim",
        Role::KubeSim,
        &strings(&["127.0.0.1:6443", &kubeconfig.display().to_string()]),
        dir,
        Some(ns),
    );
    match wait_for_file(&kubeconfig, std::time::Duration::from_secs(60)) {
        true => Ok(sim),
        false => Err(format!("kube-sim did not start:\n{}", sim.tail(20))),
    }
}

/// `otter hub`'s arguments for a hub on [`HUB_IP`] (API port 8443, tunnel
/// port 8444, which it advertises for `transport`) with its data in
/// `data`, then `more`.
pub fn hub_args(data: &std::path::Path, transport: &str, more: &[&str]) -> Vec<String> {
    let mut args = strings(&[
        "hub",
        "--data-dir",
        &data.display().to_string(),
        "--listen",
        &format!("{HUB_IP}:8443"),
        "--tunnel-listen",
        &format!("{HUB_IP}:8444"),
        "--external-url",
        &format!("https://{HUB_IP}:8443"),
        "--tunnel-url",
        &format!("{transport}://{HUB_IP}:8444"),
    ]);
    args.extend(strings(more));
    args
}
