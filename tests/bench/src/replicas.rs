//! Hub replicas on one etcd (Debian's etcd on loopback), each a process of
//! its own: what a replica that does not hold a cluster's tunnel adds to a
//! Get by sending it to the one that does, what idle agents cost etcd in
//! writes, and how long the agents of a replica killed with SIGKILL take to
//! be back through the other one (no load balancer: each agent knows both
//! replicas' API URLs and learns their tunnel URLs from the hub); then, as
//! the rest of a rolling restart, the killed one back and the survivor
//! stopped gracefully.

use std::time::{Duration, Instant};

use anyhow::Context;
use otter_e2e::{etcd::Etcd, with_token};
use otter_proto::resource::v1::{GetRequest, resource_service_client::ResourceServiceClient};
use tonic::transport::Channel;

use crate::{
    calls::hub_channel,
    common::{Figure, Figures, Latency, alternating, cpu_secs},
    scale::{HubProc, ReplicaOf, admin_token, start_agent_on},
};

const TIMEOUT: Duration = Duration::from_secs(10);

fn get(cluster: &str) -> GetRequest {
    let mut req = otter_e2e::double::get(cluster, "web");
    req.namespace = Some("default".into());
    req
}

async fn one_get(ch: &Channel, token: &str, cluster: &str) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let mut client = ResourceServiceClient::new(ch.clone());
    tokio::time::timeout(TIMEOUT, client.get(with_token(get(cluster), token))).await??;
    Ok(t.elapsed())
}

/// `calls` Gets through each replica (alternating, one client each);
/// etcd's writes per second while `agents` idle agents stay connected for
/// `idle`; then the replica holding them killed, and the time until every
/// one of them has a tunnel again.
pub async fn run(calls: usize, agents: usize, idle: Duration) -> anyhow::Result<Figures> {
    otter_pki::tls::install_default_provider();
    let etcd = Etcd::start().context("etcd is not installed (scripts/setup.sh installs it)")?;
    let dir = tempfile::tempdir()?;
    let replica_of = |name: &str| ReplicaOf {
        store: etcd.url(),
        key_file: dir.path().join("store.key"),
        name: name.to_owned(),
    };
    otter_e2e::etcd::store_key(dir.path());
    // r0 makes the CA, the admin token and a join token per cluster (the
    // store is shared, so r1 takes them too); the latency agent is the last.
    let r0 = HubProc::replica(&dir.path().join("r0"), agents + 1, &replica_of("r0"))?;
    let r1 = HubProc::replica(&dir.path().join("r1"), 0, &replica_of("r1"))?;
    let root = admin_token(&dir.path().join("r0"))?;
    let ca = std::fs::read_to_string(dir.path().join("r0").join("bench-ca.pem"))?;
    let tokens: Vec<String> = std::fs::read_to_string(dir.path().join("r0").join("bench-tokens"))?
        .lines()
        .map(str::to_owned)
        .collect();
    let via_r0 = hub_channel(r0.api, &ca).await?;
    let via_r1 = hub_channel(r1.api, &ca).await?;

    // One agent on r1; Gets through r1 (its owner) and through r0.
    let probe = format!("c-{agents}");
    let (_probe_agent, _) = start_agent_on(&[&r1], &ca, agents, &tokens[agents])?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while one_get(&via_r0, &root, &probe).await.is_err() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "replica r0 never reached {probe}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let warmup = (calls / 10).max(100);
    // Each forwarded Get beside one through the owner: the forward-added
    // figures are the pairs' differences. r0 serves nothing but the
    // forwarded calls meanwhile: its CPU time over them (warm-up included,
    // a tenth more calls) is what forwarding costs the replica a call
    // reaches.
    let r0_cpu = cpu_secs(&r0.pid()).unwrap_or(0.0);
    let (owner, forwarded) = alternating(
        warmup,
        calls,
        || async { one_get(&via_r1, &root, &probe).await.map(drop) },
        || async { one_get(&via_r0, &root, &probe).await.map(drop) },
    )
    .await?;
    let r0_cpu = cpu_secs(&r0.pid()).unwrap_or(0.0) - r0_cpu;
    let (o, f) = (Latency::of(&owner), Latency::of(&forwarded));
    let added = Latency::added(&owner, &forwarded);
    let mut figs = Figures::default();
    for (q, ov, fv) in [("p50", o.p50, f.p50), ("p99", o.p99, f.p99)] {
        let base = format!("replicas.owner.{q}");
        figs.add(&base, "µs", None, ov);
        figs.add(&format!("replicas.forwarded.{q}"), "µs", Some(&base), fv);
    }
    figs.add("replicas.forward-added.p50", "µs", None, added.p50);
    figs.add("replicas.forward-added.p99", "µs", None, added.p99);
    figs.add(
        "replicas.forwarder-cpu-per-call",
        "µs",
        None,
        r0_cpu * 1e6 / (warmup + calls) as f64,
    );
    eprintln!(
        "bench: Get p50 through the owning replica {:.0} µs, through the other {:.0} µs",
        o.p50, f.p50
    );

    // Idle agents, all registered through r1 (r0's URL second): what etcd
    // is written while nothing happens.
    eprintln!("bench: starting {agents} idle agents on replica r1");
    let mut idle_agents = Vec::with_capacity(agents);
    for (i, token) in tokens.iter().enumerate().take(agents) {
        idle_agents.push(start_agent_on(&[&r1, &r0], &ca, i, token)?.0);
    }
    let limit = Duration::from_secs(60 + agents as u64 / 20);
    // Tunnels made: a reconnect, or a move to a new tunnel beside a quiet
    // one (make before break: the agent never counts itself down).
    let tunnels = |s: &otter_agent::AgentStatus| s.connects + s.redials;
    let up = |a: &otter_agent::Agent, made: u32| {
        let s = a.status();
        s.connected.is_some() && tunnels(&s) >= made
    };
    // etcd's key-value requests while they register and connect: what
    // each new agent costs the shared store.
    let requests = etcd.kv_requests();
    let started = Instant::now();
    while !idle_agents.iter().all(|a| up(a, 1)) {
        anyhow::ensure!(
            started.elapsed() < limit,
            "the idle agents did not all connect"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let connected = started.elapsed().as_secs_f64();
    let per_agent = etcd.kv_requests().saturating_sub(requests) as f64 / agents as f64;
    figs.add(
        &format!("replicas.first-connect.n{agents}"),
        "s",
        None,
        connected,
    );
    figs.add(
        "replicas.etcd-requests-per-connect",
        "requests",
        None,
        per_agent,
    );
    eprintln!(
        "bench: {agents} agents registered and connected in {connected:.1} s, \
         {per_agent:.1} etcd requests each"
    );
    // Settle: the last admissions' writes are not idle ones.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = etcd.revision().context("etcd revision")?;
    tokio::time::sleep(idle).await;
    let after = etcd.revision().context("etcd revision")?;
    let rate = (after - before) as f64 / idle.as_secs_f64();
    figs.add(
        &format!("replicas.etcd-writes-idle-{agents}"),
        "writes/s",
        None,
        rate,
    );
    eprintln!("bench: {agents} idle agents on 2 replicas: {rate:.2} etcd writes/s");

    // r1 dies: its agents' tunnels end (TCP at once; QUIC when its
    // keepalive goes unanswered), and they come back through r0. Agents
    // that a busy r1 turned away during the first storm went on to r0
    // (the next replica the hub listed) and are not counted.
    let r1_port = r1.tunnel_port();
    let on_r1: Vec<Option<u32>> = idle_agents
        .iter()
        .map(|a| {
            let s = a.status();
            (s.advertised_urls.first().and_then(url::Url::port) == Some(r1_port))
                .then_some(tunnels(&s))
        })
        .collect();
    let moved = on_r1.iter().flatten().count();
    let r1_ports = r1.ports();
    eprintln!("bench: killing replica r1, which holds {moved} of the {agents} tunnels");
    let killed = Instant::now();
    r1.kill();
    // When each agent was seen back (polled every 100 ms).
    let mut back: Vec<Option<Duration>> = on_r1
        .iter()
        .map(|c| c.is_none().then_some(Duration::ZERO))
        .collect();
    while back.iter().any(Option::is_none) && killed.elapsed() < limit {
        for ((b, a), c) in back.iter_mut().zip(&idle_agents).zip(&on_r1) {
            if b.is_none() && up(a, c.unwrap_or(0) + 1) {
                *b = Some(killed.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let name = |what: &str| format!("replicas.failover-{what}.n{agents}");
    figs.add(&name("moved"), "agents", None, moved as f64);
    // The agents that were on r1, when each was back. Half the agents are
    // on QUIC, half on HTTP/2 (see `start_agent_on`).
    let of = |quic: Option<bool>| -> Vec<Duration> {
        back.iter()
            .zip(&on_r1)
            .enumerate()
            .filter(|(i, (_, c))| c.is_some() && quic.is_none_or(|q| i.is_multiple_of(2) == q))
            .filter_map(|(_, (b, _))| *b)
            .collect()
    };
    let times = of(None);
    if back.iter().all(Option::is_some) {
        let of = |quic: bool| of(Some(quic));
        let all = Latency::of(&times);
        figs.add(&name("p50"), "s", None, all.p50 / 1e6);
        figs.add(&name("all"), "s", None, all.max / 1e6);
        figs.add(
            &name("all-h2"),
            "s",
            None,
            Latency::of(&of(false)).max / 1e6,
        );
        let quic = Latency::of(&of(true));
        figs.add(&name("p50-quic"), "s", None, quic.p50 / 1e6);
        figs.add(&name("all-quic"), "s", None, quic.max / 1e6);
        figs.note(
            &name("all-quic"),
            "a QUIC agent learns its replica died from the refusal of its next datagram (ICMP port \
             unreachable; its next keepalive, within 5 s) or else when it has heard nothing for \
             1.5 keepalives (7.5 s), and dials the next replica beside the dead tunnel",
        );
        let (refused, quiet) = idle_agents.iter().fold((0, 0), |(r, q), a| {
            let s = a.status();
            (r + s.refused_probes, q + s.quiet_probes)
        });
        figs.add(&name("refused-probes"), "agents", None, f64::from(refused));
        figs.add(&name("quiet-probes"), "agents", None, f64::from(quiet));
        eprintln!(
            "bench: the {moved} agents of r1 back through r0: half {:.1} s, all {:.1} s after r1 was killed",
            all.p50 / 1e6,
            all.max / 1e6
        );
        // And calls reach them through the survivor.
        for i in (0..agents).step_by((agents / 10).max(1)) {
            one_get(&via_r0, &root, &format!("c-{i}")).await?;
        }
    } else {
        let missing: Vec<String> = back
            .iter()
            .zip(&idle_agents)
            .enumerate()
            .filter(|(_, (b, _))| b.is_none())
            .map(|(i, (_, a))| {
                let s = a.status();
                format!(
                    "c-{i}: connects {}, connected {:?}, last error {}",
                    s.connects, s.connected, s.last_error
                )
            })
            .collect();
        eprintln!(
            "bench: not back: {}",
            missing
                .iter()
                .take(5)
                .cloned()
                .collect::<Vec<_>>()
                .join("; ")
        );
        figs.push(Figure::skipped(
            name("all"),
            format!(
                "{} of {agents} agents not back after {limit:?}",
                missing.len()
            ),
        ));
    }
    if back.iter().all(Option::is_some) {
        let _r1 = HubProc::replica_again(&dir.path().join("r1"), r1_ports, &replica_of("r1"))?;
        rolling_restart(&mut figs, r0, r1_ports.1, &idle_agents, limit).await?;
        for i in (0..agents).step_by((agents / 10).max(1)) {
            one_get(&via_r1, &root, &format!("c-{i}")).await?;
        }
    } else {
        drop(r0);
    }
    for a in idle_agents {
        tokio::spawn(a.shutdown());
    }
    Ok(figs)
}

/// The second step of a rolling restart: `r0`, holding every agent, stops
/// gracefully while `r1` (back on its old ports) serves. How long the stop
/// took (it says goodbye on each tunnel and clears each tunnel's record in
/// etcd) and when each agent had a tunnel again, now through `r1`.
async fn rolling_restart(
    figs: &mut Figures,
    r0: HubProc,
    r1_tunnel_port: u16,
    agents: &[otter_agent::Agent],
    limit: Duration,
) -> anyhow::Result<()> {
    let n = agents.len();
    let made: Vec<u32> = agents
        .iter()
        .map(|a| {
            let s = a.status();
            s.connects + s.redials
        })
        .collect();
    // r1's record reaches r0 through etcd's watch; agents learn r1's
    // tunnel URL from r0's goodbye round (it is the one they knew).
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Those r0 has told of r1 already (its diagnosis requests, a few at a
    // time): the others learn of it from the goodbye.
    let knew = agents
        .iter()
        .filter(|a| {
            a.status()
                .advertised_urls
                .iter()
                .any(|u| u.port() == Some(r1_tunnel_port))
        })
        .count();
    figs.add(
        &format!("replicas.rolling-knew-r1.n{n}"),
        "agents",
        None,
        knew as f64,
    );
    eprintln!(
        "bench: stopping replica r0 gracefully, which holds the {n} tunnels ({knew} know r1)"
    );
    let stopping = Instant::now();
    let stop = tokio::spawn(r0.stop_timed(Duration::from_secs(60)));
    let mut back: Vec<Option<Duration>> = vec![None; n];
    while back.iter().any(Option::is_none) && stopping.elapsed() < limit {
        for ((b, a), m) in back.iter_mut().zip(agents).zip(&made) {
            let s = a.status();
            if b.is_none() && s.connected.is_some() && s.connects + s.redials > *m {
                *b = Some(stopping.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stopped = stop.await?;
    let name = |what: &str| format!("replicas.rolling-{what}.n{n}");
    match stopped {
        Some(took) => figs.add(&name("stop"), "s", None, took.as_secs_f64()),
        None => figs.push(Figure::skipped(
            name("stop"),
            "r0 had not stopped after 60 s",
        )),
    }
    let times: Vec<Duration> = back.iter().flatten().copied().collect();
    if times.len() < n {
        figs.push(Figure::skipped(
            name("all"),
            format!("{} of {n} agents not back after {limit:?}", n - times.len()),
        ));
        return Ok(());
    }
    let all = Latency::of(&times);
    figs.add(&name("p50"), "s", None, all.p50 / 1e6);
    figs.add(&name("all"), "s", None, all.max / 1e6);
    // Whose tunnel ended with r0's goodbye (the others saw it cut).
    let told = agents
        .iter()
        .filter(|a| {
            a.status().last_tunnel_end.is_some_and(|e| {
                e.by == otter_agent::ended::EndedBy::Hub
                    && e.why == otter_tunnel::frame::BYE_STOPPING
            })
        })
        .count();
    figs.add(&name("told-goodbye"), "agents", None, told as f64);
    eprintln!(
        "bench: r0 stopped in {:.2} s; its {n} agents back through r1: half {:.1} s, all {:.1} s; \
         {told} took its goodbye",
        stopped.map_or(f64::NAN, |d| d.as_secs_f64()),
        all.p50 / 1e6,
        all.max / 1e6
    );
    Ok(())
}
