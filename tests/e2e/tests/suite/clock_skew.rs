//! Agent processes whose whole clock is off (libfaketime preloaded, so the
//! system clock rustls and the agent read is the wrong one, as on a node
//! without NTP), against a hub with 60 s certificates:
//! - 10 minutes behind: it cannot join (the hub's certificate is not valid
//!   yet by its clock) and says so in words naming its clock, not
//!   "transport error";
//! - 90 s ahead: it joins, and renews when due in the hub's time, not at
//!   once and again (it used to make thousands of renewals a minute).
//!
//! Needs Debian's `faketime` (`scripts/setup.sh` installs it); without it
//! the test says so and passes, unless `OTTER_REQUIRE_TOOLS=1`.

use std::{sync::Arc, time::Duration};

use otter_agent::gauges::sample;
use otter_e2e::{
    TestHub,
    netns::strings,
    procs::{Proc, Role, free_port},
    tool_missing,
};

const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// Starts an agent process for `cluster` with its clock moved by `offset`
/// (libfaketime's syntax: `-10m`, `+90s`).
fn agent_with_clock(
    hub: &TestHub,
    dir: &std::path::Path,
    cluster: &str,
    offset: &str,
    health: &str,
) -> Proc {
    let token = dir.join(format!("{cluster}.token"));
    std::fs::write(&token, hub.hub.mint_join_token(cluster).unwrap()).unwrap();
    let ca = dir.join("hub-ca.crt");
    std::fs::write(&ca, hub.hub.ca_pem()).unwrap();
    Proc::start_env(
        cluster,
        Role::Agent,
        &strings(&[
            "--hub-url",
            hub.api_url().as_str(),
            "--cluster",
            cluster,
            "--agent-id",
            "a",
            "--hub-ca-file",
            &ca.display().to_string(),
            "--join-token-file",
            &token.display().to_string(),
            "--transports",
            "quic",
            "--health-listen",
            health,
            "--kubeconfig",
            &dir.join("kubeconfig").display().to_string(),
        ]),
        dir,
        None,
        &[
            ("LD_PRELOAD", LIBFAKETIME),
            ("FAKETIME", offset),
            // Timers keep the real monotonic clock; only the wall clock is off.
            ("DONT_FAKE_MONOTONIC", "1"),
        ],
    )
}

fn metrics(health: &str, dir: &std::path::Path) -> Option<String> {
    let mut probe = Proc::start(
        "probe",
        Role::HttpGet,
        &strings(&[health, "/metrics"]),
        dir,
        None,
    );
    let code = probe.wait(Duration::from_secs(10));
    let out = probe.stdout();
    let _ = std::fs::remove_file(dir.join("probe.out"));
    (code == Some(0)).then_some(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_with_a_wrong_clock_say_so_or_follow_the_hubs() {
    if !std::path::Path::new(LIBFAKETIME).exists() {
        tool_missing("faketime (scripts/setup.sh installs it)");
        return;
    }
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir.clone(), None, |c| {
        c.agent_cert_lifetime = Duration::from_secs(60);
    })
    .await;
    let work = tempfile::tempdir().unwrap();
    let d = work.path();
    let sim = kube_sim::KubeSim::start(otter_e2e::kube::sim_config())
        .await
        .unwrap();
    std::fs::write(
        d.join("kubeconfig"),
        sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN),
    )
    .unwrap();

    let (behind_health, ahead_health) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let behind = agent_with_clock(&hub, d, "behind", "-10m", &behind_health);
    let ahead = agent_with_clock(&hub, d, "ahead", "+90s", &ahead_health);

    let (behind_said, ahead_renewals) = tokio::task::block_in_place(|| {
        // Behind: never joins, and says why.
        let started = std::time::Instant::now();
        let said = loop {
            let log = behind.stderr();
            if let Some(line) = log.lines().find(|l| l.contains("behind the hub's")) {
                break line.to_owned();
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the agent 10 minutes behind never named its clock:\n{}",
                behind.tail(20)
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        assert!(
            !behind.stderr().contains("tunnel up"),
            "an agent whose clock is 10 minutes behind joined"
        );
        // Ahead: joins, then no renewal before one is due (40 s into a
        // 60 s certificate by the hub's clock; 90 s ahead, the agent's own
        // clock says it is long overdue).
        let started = std::time::Instant::now();
        while metrics(&ahead_health, d).and_then(|m| sample(&m, "otter_agent_tunnel_up"))
            != Some(1.0)
        {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the agent 90 s ahead never joined:\n{}",
                ahead.tail(20)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(Duration::from_secs(8));
        let m = metrics(&ahead_health, d).expect("metrics");
        (said, sample(&m, "otter_agent_renewals_total"))
    });
    // Measured against the start of the hub's certificate (issued five
    // minutes back when the hub started): a second or more after that the
    // floor is 4m.
    assert!(
        behind_said.contains("clock is at least 5m behind")
            || behind_said.contains("clock is at least 4m behind"),
        "{behind_said}"
    );
    assert_eq!(ahead_renewals, Some(0.0), "renewed before due");
    eprintln!("10 minutes behind: {behind_said}\n90 s ahead: joined, 0 renewals in the 8 s after");
    drop((behind, ahead));
    sim.shutdown().await;
    hub.hub.shutdown().await;
}
