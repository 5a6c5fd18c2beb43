//! A real network cut between hub and agent: each runs as a process in a
//! network namespace of its own, joined by a veth pair, and the link goes
//! down for longer than keepalives take to call the tunnel dead. A Watch
//! (`otter get -w`, a process beside the hub) is open throughout; objects
//! are created while the link is down. When the link is back the tunnel
//! returns and the hub opens the Watch again from the last resourceVersion
//! it passed on, while the caller's stream stays open: every object shows
//! exactly once, none lost, none repeated, and `otter get -w` never had to
//! resume on its own. A followed log (`otter logs -f`), a line written with
//! each object, goes on the same way: every line once.
//!
//! Needs the privilege to create network namespaces (root) and `ip` from
//! iproute2; without them the test says so in one line and passes, unless
//! `OTTER_REQUIRE_TOOLS=1` (set by `make test`), which makes it fail.

use std::time::{Duration, Instant};

use otter_agent::gauges::sample;
use otter_e2e::{
    netns::{
        HUB_IP, NetPair, agent_args, agent_metrics, hub_args, prepare_hub, start_kube_sim, strings,
        until,
    },
    procs::{Proc, Role},
};

/// Keepalive of both ends: a dead tunnel is called after three of these.
const KEEPALIVE_SECS: u64 = 1;
/// How long the link stays down: well past the three keepalive intervals.
const CUT: Duration = Duration::from_secs(6);
const WAIT: Duration = Duration::from_secs(30);
const AGENT_HEALTH: &str = "127.0.0.1:9090";
/// The hub's Prometheus port, inside the hub's namespace.
const HUB_METRICS: &str = "127.0.0.1:9091";

/// Names printed by `otter get -w` (first column), in order.
fn printed_names(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .map(|l| l.trim_start_matches("test child_process ... "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("cm-"))
        .map(str::to_owned)
        .collect()
}

struct Scene {
    pair: NetPair,
    dir: tempfile::TempDir,
}

impl Scene {
    fn agent_metric(&self, name: &str) -> Option<f64> {
        self.agent_metrics().and_then(|m| sample(&m, name))
    }

    fn agent_metrics(&self) -> Option<String> {
        agent_metrics(&self.pair.agent, AGENT_HEALTH, self.dir.path())
    }
}

fn watch_resumes_across_a_cut(transport: &str) {
    let Some(pair) = NetPair::create_or_skip() else {
        return;
    };
    let scene = Scene {
        pair,
        dir: tempfile::tempdir().expect("temp dir"),
    };
    let d = scene.dir.path();
    let data = d.join("hub");
    std::fs::create_dir_all(&data).expect("data dir");
    let admin = prepare_hub(&data, &d.join("token"), "edge-0");
    let ca = data.join("ca.crt").display().to_string();
    let api = format!("https://{HUB_IP}:8443");

    // The cluster side: the test server and the agent, in the agent's namespace.
    let mut sim = start_kube_sim(d, &scene.pair.agent).expect("kube-sim");
    let hub = Proc::start(
        "hub",
        Role::Otter,
        &hub_args(
            &data,
            transport,
            &[
                "--keepalive-secs",
                &KEEPALIVE_SECS.to_string(),
                "--metrics-listen",
                HUB_METRICS,
            ],
        ),
        d,
        Some(&scene.pair.hub),
    );
    let agent = Proc::start(
        "agent",
        Role::Agent,
        &agent_args(&api, &ca, d, transport, KEEPALIVE_SECS, AGENT_HEALTH, &[]),
        d,
        Some(&scene.pair.agent),
    );
    until("the tunnel comes up", WAIT, || {
        scene.agent_metric("otter_agent_tunnel_up") == Some(1.0)
    });

    for i in 0..3 {
        sim.send(&format!("configmap cm-before-{i}"));
        sim.send(&format!("log cm-before-{i}"));
    }
    // `otter` commands as a user runs them, beside the hub: `get -w`, and
    // `logs -f` of a pod whose log is written along with the objects.
    let otter = |name: &str, args: &[&str]| {
        let hub_flags = [
            "--cluster",
            "edge-0",
            "--hub",
            &api,
            "--token",
            &admin,
            "--ca-file",
            &ca,
        ];
        let args: Vec<&str> = args.iter().chain(hub_flags.iter()).copied().collect();
        Proc::start(name, Role::Otter, &strings(&args), d, Some(&scene.pair.hub))
    };
    let mut watcher = otter("watcher", &["get", "configmaps", "-w"]);
    let mut follower = otter("follower", &["logs", "web", "-c", "app", "-f"]);
    // The test lines (the pod's own first line, and the test harness's
    // lines of the child process, left out).
    let logged = |follower: &Proc| -> Vec<String> {
        follower
            .stdout()
            .lines()
            .filter_map(|l| l.rsplit(' ').next())
            .filter(|w| w.starts_with("cm-"))
            .map(str::to_owned)
            .collect()
    };
    let shows = |names: &[String]| {
        let printed = printed_names(&watcher.stdout());
        names.iter().all(|n| printed.contains(n)) && {
            // Each object comes with a log line of its name.
            let lines = logged(&follower);
            names.iter().all(|n| lines.contains(n))
        }
    };
    let names = |prefix: &str, n: usize| -> Vec<String> {
        (0..n).map(|i| format!("cm-{prefix}-{i}")).collect()
    };
    until("the watcher lists what is there", WAIT, || {
        shows(&names("before", 3))
    });
    for n in names("live", 3) {
        sim.send(&format!("configmap {n}"));
        sim.send(&format!("log {n}"));
    }
    until("the watcher sees live changes", WAIT, || {
        shows(&names("live", 3))
    });

    // The cut.
    scene.pair.cut(true);
    let cut_at = Instant::now();
    for n in names("cut", 5) {
        sim.send(&format!("configmap {n}"));
        sim.send(&format!("log {n}"));
        std::thread::sleep(Duration::from_millis(200));
    }
    until("the agent calls the tunnel dead", CUT + WAIT, || {
        scene.agent_metric("otter_agent_tunnel_up") == Some(0.0)
    });
    let noticed = cut_at.elapsed();
    // The promise: a keepalive unanswered for three intervals ends the
    // tunnel, and the first unanswered one leaves within an interval of
    // the cut; 2 s of slack for two shared cores and the metric's polling.
    assert!(
        noticed <= Duration::from_secs(4 * KEEPALIVE_SECS + 2),
        "{transport}: the agent called the tunnel dead only {noticed:?} after the cut"
    );
    let rest = CUT.saturating_sub(cut_at.elapsed());
    std::thread::sleep(rest);
    assert!(
        !shows(&names("cut", 1)),
        "an object made during the cut crossed a link that was down"
    );
    scene.pair.cut(false);
    let restored = Instant::now();
    until("the watcher catches up after the cut", WAIT, || {
        shows(&names("cut", 5))
    });
    let caught_up = restored.elapsed();
    for n in names("after", 2) {
        sim.send(&format!("configmap {n}"));
        sim.send(&format!("log {n}"));
    }
    until("the watcher sees changes after the cut", WAIT, || {
        shows(&names("after", 2))
    });
    let m = scene.agent_metrics().expect("agent metrics");
    watcher.kill9();
    follower.kill9();

    // Count: every object exactly once, in the order made.
    let printed = printed_names(&watcher.stdout());
    let expected: Vec<String> = ["before", "live", "cut", "after"]
        .iter()
        .zip([3, 3, 5, 2])
        .flat_map(|(p, n)| names(p, n))
        .collect();
    eprintln!(
        "{transport}: link down {CUT:?}, tunnel dead on the agent within {noticed:?}; \
         watch caught up {caught_up:?} after the link came back; {} objects printed, {} expected",
        printed.len(),
        expected.len()
    );
    assert_eq!(printed, expected, "lost, repeated or reordered events");
    // The followed log: every line once, in order.
    let lines = logged(&follower);
    eprintln!(
        "{transport}: {} log lines printed, {} expected",
        lines.len(),
        expected.len()
    );
    assert_eq!(lines, expected, "lost, repeated or reordered log lines");
    let err = watcher.stderr();
    assert!(
        !err.contains("resuming from resourceVersion"),
        "the hub let the watch end; the client had to resume it:\n{err}"
    );
    let hub_metrics = agent_metrics(&scene.pair.hub, HUB_METRICS, d).expect("hub metrics");
    assert!(
        sample(&hub_metrics, "otter_hub_streams_resumed_total").is_some_and(|n| n >= 2.0),
        "the hub did not resume both the watch and the log:\n{hub_metrics}"
    );
    assert_eq!(sample(&m, "otter_agent_connects_total"), Some(2.0), "{m}");
    assert_eq!(
        sample(&m, "otter_agent_registrations_total"),
        Some(1.0),
        "{m}"
    );
    drop((watcher, agent, hub, sim));
}

#[test]
fn watch_resumes_across_a_network_cut_over_quic() {
    watch_resumes_across_a_cut("quic");
}

#[test]
fn watch_resumes_across_a_network_cut_over_h2() {
    watch_resumes_across_a_cut("h2");
}
