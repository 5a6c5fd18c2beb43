//! A site whose only way out is an authenticating proxy, for real: the
//! agent and its cluster run as processes in one network namespace, the
//! hub and tinyproxy (Basic auth) in another, joined by a veth pair. The
//! hub listens on its namespace's loopback only, so the agent has no route
//! to it but through the proxy, and QUIC (UDP) has none at all. The agent
//! knows the proxy only from `HTTPS_PROXY` in its environment, as clusters
//! inject it; `NO_PROXY` keeps its apiserver direct.
//!
//! Shown: a fresh agent joins through the proxy (Register), renews its
//! 60 s certificate three times through it with calls flowing throughout
//! and the tunnel never dropped; its diagnosis names the proxy and the
//! QUIC attempt that could not go through; the password shows nowhere; a
//! proxy that goes away is named in the agent's log as the proxy, and the
//! tunnel comes back when it returns; a cut link ends a `kubectl
//! port-forward` through the hub with an error within the dead-path
//! interval, and the agent names the network.
//!
//! Needs root (network namespaces), `ip` and tinyproxy; kubectl 1.33 for
//! the port-forward part. Without them the test says so and passes, unless
//! `OTTER_REQUIRE_TOOLS=1` (set by `make test`).

use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

use otter_agent::gauges::sample;
use otter_e2e::{
    netns::{
        AGENT_IP, HUB_IP, NetPair, agent_args, agent_metrics, prepare_hub, start_kube_sim, strings,
        until,
    },
    procs::{Proc, Role},
    tool_missing,
};

const KEEPALIVE_SECS: u64 = 1;
const WAIT: Duration = Duration::from_secs(30);
const AGENT_HEALTH: &str = "127.0.0.1:9090";
const PROXY_PORT: u16 = 3128;
const PASSWORD: &str = "s3cret";

/// tinyproxy in the hub's namespace, on the link's address, with Basic
/// auth; killed on drop.
struct Tinyproxy {
    child: Child,
    log: PathBuf,
}

impl Tinyproxy {
    fn start(netns: &str, dir: &Path) -> Tinyproxy {
        let log = dir.join("tinyproxy.log");
        let conf = dir.join("tinyproxy.conf");
        std::fs::write(
            &conf,
            format!(
                "Port {PROXY_PORT}\nListen {HUB_IP}\nAllow {AGENT_IP}\nTimeout 60\nMaxClients 20\n\
                 LogLevel Info\nLogFile \"{}\"\nPidFile \"{}\"\nBasicAuth otter {PASSWORD}\n",
                log.display(),
                dir.join("tinyproxy.pid").display()
            ),
        )
        .expect("tinyproxy config");
        let child = Command::new("ip")
            .args(["netns", "exec", netns, "/usr/bin/tinyproxy", "-d", "-c"])
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start tinyproxy");
        Tinyproxy { child, log }
    }

    /// CONNECTs the proxy opened to `localhost:<port>`.
    fn connects_to(&self, port: u16) -> usize {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("CONNECT") && l.contains(&format!("localhost:{port}")))
            .count()
    }
}

impl Drop for Tinyproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits (bounded) for the agent's log to say its tunnel ended by `who`.
fn names(agent: &Proc, who: &str) {
    let line = format!("closed_by={who}");
    let started = Instant::now();
    while !format!("{}{}", agent.stdout(), agent.stderr()).contains(&line) {
        assert!(
            started.elapsed() < WAIT,
            "the agent never logged {line}:\n{}",
            agent.tail(30)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `otter <args…>` as a user runs it, beside the hub; its exit code and
/// output.
fn otter(netns: &str, dir: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let mut p = Proc::start_env(
        "otter-cli",
        Role::Otter,
        &strings(args),
        dir,
        Some(netns),
        &[(
            "OTTER_CONFIG",
            &dir.join("otter.toml").display().to_string(),
        )],
    );
    let code = p.wait(WAIT);
    let out = (code, p.stdout(), p.stderr());
    for f in ["otter-cli.out", "otter-cli.err"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    out
}

#[test]
fn an_agent_whose_only_way_out_is_an_authenticating_proxy() {
    if !Path::new("/usr/bin/tinyproxy").exists() {
        tool_missing("tinyproxy (scripts/setup.sh installs it)");
        return;
    }
    let Some(pair) = NetPair::create_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    let data = d.join("hub");
    std::fs::create_dir_all(&data).expect("data dir");
    let admin = prepare_hub(&data, &d.join("token"), "edge-0");
    let ca = data.join("ca.crt").display().to_string();
    let api = "https://localhost:8443";
    let metric =
        |name: &str| agent_metrics(&pair.agent, AGENT_HEALTH, d).and_then(|m| sample(&m, name));

    // The hub's side: the hub on its namespace's loopback, the proxy on
    // the link.
    let hub = Proc::start(
        "hub",
        Role::Otter,
        &strings(&[
            "hub",
            "--data-dir",
            &data.display().to_string(),
            "--listen",
            "127.0.0.1:8443",
            "--tunnel-listen",
            "127.0.0.1:8444",
            "--external-url",
            api,
            "--tunnel-url",
            "quic://localhost:8444",
            "--tunnel-url",
            "h2://localhost:8444",
            "--keepalive-secs",
            &KEEPALIVE_SECS.to_string(),
            "--agent-cert-lifetime-secs",
            "60",
        ]),
        d,
        Some(&pair.hub),
    );
    let mut proxy = Some(Tinyproxy::start(&pair.hub, d));

    // The cluster's side: the test server and the agent.
    let mut sim = start_kube_sim(d, &pair.agent).expect("kube-sim");
    let https_proxy = format!("http://otter:{PASSWORD}@{HUB_IP}:{PROXY_PORT}");
    let agent = Proc::start_env(
        "agent",
        Role::Agent,
        &agent_args(
            api,
            &ca,
            d,
            "quic,h2",
            KEEPALIVE_SECS,
            AGENT_HEALTH,
            &["--renew-at", "0.1"],
        ),
        d,
        Some(&pair.agent),
        &[
            ("HTTPS_PROXY", https_proxy.as_str()),
            ("NO_PROXY", "127.0.0.1"),
            ("RUST_LOG", "info"),
        ],
    );
    let joined = until("the agent joins through the proxy", WAIT, || {
        metric("otter_agent_tunnel_up") == Some(1.0)
    });
    {
        let p = proxy.as_ref().expect("proxy");
        assert!(
            p.connects_to(8443) >= 1 && p.connects_to(8444) >= 1,
            "Register and the tunnel went through the proxy"
        );
    }

    // Calls flow while the 60 s certificate is renewed (every 6 s here)
    // three times, each renewal a connection through the proxy.
    let login = otter(
        &pair.hub,
        d,
        &["login", "--hub", api, "--token", &admin, "--ca-file", &ca],
    );
    assert_eq!(login.0, Some(0), "{}", login.2);
    let started = Instant::now();
    let mut calls = 0;
    while metric("otter_agent_renewals_total").unwrap_or(0.0) < 3.0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "three renewals through the proxy:\n{}",
            agent.tail(30)
        );
        let (code, out, err) = otter(&pair.hub, d, &["get", "configmaps", "--cluster", "edge-0"]);
        assert_eq!(code, Some(0), "a call during the renewals: {out}{err}");
        calls += 1;
    }
    let renewing = started.elapsed();
    let m = agent_metrics(&pair.agent, AGENT_HEALTH, d).expect("agent metrics");
    assert_eq!(sample(&m, "otter_agent_connects_total"), Some(1.0), "{m}");
    assert_eq!(
        sample(&m, "otter_agent_registrations_total"),
        Some(1.0),
        "{m}"
    );
    // Renewals take the tunnel port first (the API port is the fallback).
    assert!(
        proxy.as_ref().expect("proxy").connects_to(8444) >= 4,
        "the renewals went through the proxy"
    );
    assert!(
        sample(&m, "otter_agent_renewals_on_tunnel_port_total") >= Some(3.0),
        "{m}"
    );

    // What `otter links -o wide` shows: the proxy (no password) and QUIC
    // that could not get out.
    let (code, out, err) = otter(&pair.hub, d, &["links", "-o", "json"]);
    assert_eq!(code, Some(0), "{err}");
    // The child runs under the test harness, which prints its own lines
    // around the command's output.
    let json = out
        .find('[')
        .zip(out.rfind(']'))
        .map_or("", |(a, b)| &out[a..=b]);
    let links: serde_json::Value = serde_json::from_str(json).expect("links JSON");
    let diag = &links[0]["diagnosis"];
    let quic = &diag["attempts"][0];
    assert!(
        diag["proxy"] == format!("http://{HUB_IP}:{PROXY_PORT}/").as_str()
            && quic["transport"] == "quic"
            && quic["ok"] == false,
        "{out}"
    );

    // The proxy goes away, then comes back: just after a renewal's move,
    // not during one (a proxy gone while the agent moves to its renewed
    // tunnel ends the old one as replaced before the new one is in use, and
    // the agent rightly names the hub for that).
    let moves = || {
        format!("{}{}", agent.stdout(), agent.stderr())
            .matches("moved to a new tunnel")
            .count()
    };
    let before = moves();
    until("the next renewal's move", WAIT, || moves() > before);
    drop(proxy.take());
    until("the agent notices the proxy is gone", WAIT, || {
        metric("otter_agent_tunnel_up") == Some(0.0)
    });
    names(&agent, "proxy");
    proxy = Some(Tinyproxy::start(&pair.hub, d));
    let back = until("the tunnel is back through the new proxy", WAIT * 2, || {
        metric("otter_agent_tunnel_up") == Some(1.0)
    });

    // A cut link ends a kubectl port-forward through the hub.
    // The link stays cut until the agent has noticed on its own: lifted
    // earlier, the hub's close reaches it through the proxy first and it
    // rightly names the proxy instead.
    let forward = kubectl_port_forward_across_a_cut(&pair, d, &mut sim);
    names(&agent, "network");
    pair.cut(false);

    let output = format!("{}{}", agent.stdout(), agent.stderr());
    assert!(!output.contains(PASSWORD), "the password leaked:\n{output}");
    eprintln!(
        "joined through the proxy in {joined:?}; 3 renewals in {renewing:?} with {calls} calls, \
         tunnel never dropped; back {back:?} after the proxy returned; {forward}"
    );
    drop((agent, sim, hub, proxy));
    drop(pair);
}

/// `kubectl port-forward` through the hub (beside it) to the simulated
/// pod, then the link cut: kubectl must exit with an error within the
/// dead-path interval. Returns what happened, for the summary line, and
/// leaves the link cut.
fn kubectl_port_forward_across_a_cut(pair: &NetPair, d: &Path, sim: &mut Proc) -> String {
    let Some(kubectl) = otter_e2e::kubectl_133() else {
        tool_missing("kubectl 1.33");
        pair.cut(true);
        return "kubectl 1.33 absent: port-forward part skipped".into();
    };
    sim.send("echo 8080");
    let kube_path = d.join("hub-kubeconfig");
    let (code, _, err) = otter(
        &pair.hub,
        d,
        &[
            "kubeconfig",
            "--cluster",
            "edge-0",
            "--kubeconfig",
            &kube_path.display().to_string(),
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    let out = d.join("port-forward.out");
    let mut child = Command::new("ip")
        .args(["netns", "exec", &pair.hub])
        .arg(&kubectl)
        .arg("--kubeconfig")
        .arg(&kube_path)
        .args(["port-forward", "--address", "127.0.0.1", "pod/web", ":8080"])
        .stdout(std::fs::File::create(&out).expect("output file"))
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start kubectl");
    let ready = std::iter::repeat_with(|| {
        std::thread::sleep(Duration::from_millis(100));
        std::fs::read_to_string(&out).unwrap_or_default()
    })
    .take(300)
    .any(|o| o.contains("Forwarding from"));
    if !ready {
        let _ = child.kill();
        let _ = child.wait();
        panic!("kubectl port-forward did not start");
    }
    pair.cut(true);
    let cut = Instant::now();
    let limit = Duration::from_secs(30);
    let code = loop {
        if let Some(status) = child.try_wait().expect("kubectl status") {
            break status.code();
        }
        if cut.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kubectl port-forward still running {limit:?} after the cut");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = cut.elapsed();
    assert_ne!(code, Some(0), "kubectl reports the lost connection");
    // The promise: the tunnel is called dead after three unanswered
    // keepalives, the first leaving up to one interval after the cut; the
    // hub then ends the upgraded connection. 2 s of slack for two cores.
    assert!(
        took <= Duration::from_secs(4 * KEEPALIVE_SECS + 2),
        "kubectl port-forward exited only {took:?} after the cut"
    );
    format!("kubectl port-forward exited {code:?} {took:?} after the link was cut")
}
