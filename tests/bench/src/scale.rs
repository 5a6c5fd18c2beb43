//! Scale, reconnect storm and footprint. The hub runs as a child process of
//! this binary (`hub-child`) so its RSS and CPU are its own; the N agents
//! are real agents (join token, certificate, TLS or QUIC) in this process.

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use otter_agent::{Agent, AgentConfig, config::Secret};
use otter_e2e::{double::Double, with_token};
use otter_proto::{
    link::v1::{LinkState, ListLinksRequest, link_service_client::LinkServiceClient},
    resource::v1::resource_service_server::ResourceServiceServer,
};
use otter_tunnel::TransportKind;

use crate::common::{Figure, Figures, Latency, cpu_secs, rss_kib, status_kib};
use otter_tunnel::quic::kernel_drops as udp_drops;

/// A hub child's place among replicas sharing etcd.
#[derive(Debug, Clone)]
pub struct ReplicaOf {
    /// `etcd://…`
    pub store: String,
    pub key_file: PathBuf,
    pub name: String,
}

/// `hub-child`: a hub in `dir` on the given ports (0: free), with join
/// tokens for `clusters` clusters written to `dir/bench-tokens`; a replica
/// on etcd with a peer port when `replica` says so. Prints
/// `READY <api> <tunnel> <metrics>` and runs until stdin closes.
pub async fn hub_child(
    dir: PathBuf,
    api: u16,
    tunnel: u16,
    clusters: usize,
    replica: Option<ReplicaOf>,
) -> anyhow::Result<()> {
    let mut config = otter_hub::HubConfig::new(&dir);
    config.api_listen = SocketAddr::from(([127, 0, 0, 1], api));
    config.tunnel_listen = SocketAddr::from(([127, 0, 0, 1], tunnel));
    config.drain_timeout = Duration::from_secs(2);
    config.metrics_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    if let Some(r) = replica {
        config.store = Some(otter_hub::etcd::EtcdOptions::from_url(&r.store)?);
        config.store_key_file = Some(r.key_file);
        config.replica = r.name;
        config.peer_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    }
    // Every simulated agent dials from 127.0.0.1: the per-source shares,
    // meant for one attacker among many agents, would make the whole fleet
    // one source. The totals still bound the hub. A share of every place
    // would still refuse the fleet when the places are all taken, where
    // agents from many sources wait for one: no share at all.
    config.tunnel_handshakes.per_source = usize::MAX;
    config.api_handshakes.per_source = usize::MAX;
    config.api_connections.per_source = config.api_connections.max_total;
    let hub = otter_hub::Hub::start(config).await?;
    std::fs::write(dir.join("bench-ca.pem"), hub.ca_pem())?;
    let tokens = dir.join("bench-tokens");
    if !tokens.exists() {
        let mut text = String::new();
        for i in 0..clusters {
            text.push_str(&hub.mint_join_token(&format!("c-{i}"))?);
            text.push('\n');
        }
        std::fs::write(&tokens, text)?;
    }
    // A tenant of none of the fleet's links, listing them beside it (made
    // once: replicas sharing a store come here with no clusters).
    let bystander = dir.join("bystander-token");
    if clusters > 0 && !bystander.exists() {
        hub.create_tenant(BYSTANDER)?;
        let spec = otter_hub::tokens::TokenSpec {
            user: "bystander-admin".into(),
            tenants: [(BYSTANDER.to_owned(), otter_hub::tenancy::Role::Admin)].into(),
            ..Default::default()
        };
        std::fs::write(&bystander, hub.mint_token(&spec)?)?;
    }
    let metrics = hub
        .ops_addrs
        .first()
        .map(|(addr, _)| *addr)
        .context("no metrics port")?;
    println!("READY {} {} {metrics}", hub.api_addr, hub.tunnel_addr);
    // Runs until the parent closes stdin (or kills us).
    tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        while std::io::stdin()
            .read_line(&mut line)
            .map(|n| n > 0)
            .unwrap_or(false)
        {
            line.clear();
        }
    })
    .await?;
    // Stdin closed: a graceful stop (tunnels are closed, so agents know at once).
    hub.shutdown().await;
    Ok(())
}

/// A hub child process.
pub struct HubProc {
    child: Child,
    _stdout: BufReader<ChildStdout>,
    pub api: SocketAddr,
    tunnel: SocketAddr,
    /// Plaintext `/metrics`, as a Prometheus server scrapes it.
    metrics: SocketAddr,
}

impl HubProc {
    fn start(dir: &Path, api: u16, tunnel: u16, clusters: usize) -> anyhow::Result<HubProc> {
        Self::start_as(dir, api, tunnel, clusters, None)
    }

    /// A replica on etcd, on free ports.
    pub fn replica(dir: &Path, clusters: usize, of: &ReplicaOf) -> anyhow::Result<HubProc> {
        Self::start_as(dir, 0, 0, clusters, Some(of))
    }

    /// Replica `of` again in `dir`, on the ports `was` listened on (its
    /// agents know those), as a restarted replica comes back.
    pub fn replica_again(dir: &Path, was: (u16, u16), of: &ReplicaOf) -> anyhow::Result<HubProc> {
        Self::start_as(dir, was.0, was.1, 0, Some(of))
    }

    /// The API and tunnel ports, to start the hub again on them.
    pub fn ports(&self) -> (u16, u16) {
        (self.api.port(), self.tunnel.port())
    }

    fn start_as(
        dir: &Path,
        api: u16,
        tunnel: u16,
        clusters: usize,
        replica: Option<&ReplicaOf>,
    ) -> anyhow::Result<HubProc> {
        let replica_args = replica.map_or_else(Vec::new, |r| {
            vec![
                r.store.clone(),
                r.key_file.display().to_string(),
                r.name.clone(),
            ]
        });
        // OTTER_BENCH_HUB_WRAP runs the hub under a tool (`heaptrack`,
        // `perf record -g --`), split at spaces, to see where it spends.
        let wrap = std::env::var("OTTER_BENCH_HUB_WRAP").unwrap_or_default();
        let mut argv = wrap.split_whitespace().map(std::ffi::OsString::from);
        let exe = std::env::current_exe()?.into_os_string();
        let mut child = Command::new(argv.next().unwrap_or_else(|| exe.clone()))
            .args(argv)
            .args((!wrap.trim().is_empty()).then_some(exe))
            .arg("hub-child")
            .arg(dir)
            .args([api.to_string(), tunnel.to_string(), clusters.to_string()])
            .args(replica_args)
            // OTTER_BENCH_HUB_LOG: the hub's log filter, to see why
            // (the agents in this process keep OTTER_LOG's). Warnings by
            // default: a run without trouble has none, and a slow stop
            // says which of its steps took the time.
            .env(
                "OTTER_LOG",
                std::env::var("OTTER_BENCH_HUB_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let mut stdout = BufReader::new(child.stdout.take().context("stdout")?);
        let mut line = String::new();
        // Minting 10,000 tokens takes a while; the child prints READY after
        // (a wrapping tool may print a few lines of its own first).
        for _ in 0..16 {
            line.clear();
            if stdout.read_line(&mut line)? == 0 || line.starts_with("READY") {
                break;
            }
        }
        let parts: Vec<&str> = line.split_whitespace().collect();
        if parts.len() != 4 || parts[0] != "READY" {
            let _ = child.kill();
            bail!("hub child did not start: {line:?}");
        }
        Ok(HubProc {
            child,
            _stdout: stdout,
            api: parts[1].parse()?,
            tunnel: parts[2].parse()?,
            metrics: parts[3].parse()?,
        })
    }

    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    pub fn tunnel_port(&self) -> u16 {
        self.tunnel.port()
    }

    /// Handshakes the hub dropped for a newer connection since it started
    /// (`otter_hub_tunnel_handshakes_evicted`): each is work thrown away
    /// and an agent sent back to retry.
    async fn handshakes_evicted(&self) -> anyhow::Result<f64> {
        self.metric("otter_hub_tunnel_handshakes_evicted").await
    }

    /// One figure of the hub's `/metrics`.
    async fn metric(&self, name: &str) -> anyhow::Result<f64> {
        let text = otter_e2e::procs::http_get(self.metrics, "/metrics")
            .await
            .context("the hub's /metrics did not answer")?;
        otter_agent::gauges::sample(&text, name).with_context(|| format!("no {name} on /metrics"))
    }

    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Closes stdin, as [`HubProc::stop`] does, and waits off the
    /// runtime's workers (agents of this process are served meanwhile)
    /// until the process has ended: how long its graceful stop took, or
    /// none when it had to be killed after `limit`.
    pub async fn stop_timed(mut self, limit: Duration) -> Option<Duration> {
        let begun = Instant::now();
        drop(self.child.stdin.take());
        while begun.elapsed() < limit {
            if let Ok(Some(_)) = self.child.try_wait() {
                return Some(begun.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        None
    }

    /// Closes stdin: the hub shuts down gracefully (killed after 15 s).
    fn stop(mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for HubProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The tenant whose admin lists links beside the fleet's.
const BYSTANDER: &str = "bystander";

pub fn admin_token(dir: &Path) -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(dir.join("admin-token"))?
        .trim()
        .to_owned())
}

pub async fn connected_links(ch: &tonic::transport::Channel, token: &str) -> Option<usize> {
    let r = LinkServiceClient::new(ch.clone())
        .list_links(with_token(ListLinksRequest {}, token))
        .await
        .ok()?;
    Some(
        r.into_inner()
            .links
            .iter()
            .filter(|l| l.state == Some(LinkState::Connected as i32))
            .count(),
    )
}

/// A dashboard's way to list links: gRPC, or Connect with JSON as a
/// browser speaks it (the hub transcodes the answer and gzips it).
#[derive(Clone)]
enum Dashboard {
    Grpc(tonic::transport::Channel, String),
    Json(crate::portforward::Connect),
}

impl Dashboard {
    async fn open(json: bool, api: SocketAddr, ca: &str, token: &str) -> anyhow::Result<Self> {
        Ok(if json {
            let name = rustls::pki_types::ServerName::try_from("localhost")?;
            Self::Json(crate::portforward::Connect::open_to(api, name, ca, token, "").await?)
        } else {
            Self::Grpc(crate::calls::hub_channel(api, ca).await?, token.to_owned())
        })
    }

    /// One ListLinks: the answer's size in bytes as it came.
    async fn list(&self) -> anyhow::Result<usize> {
        match self {
            Self::Grpc(ch, token) => list_links_size(ch, token).await,
            Self::Json(c) => Ok(c
                .unary_json("otterscale.link.v1.LinkService", "ListLinks", "{}")
                .await?
                .len()),
        }
    }

    fn suffix(&self) -> &'static str {
        match self {
            Self::Grpc(..) => "",
            Self::Json(_) => "-json",
        }
    }
}

/// A hundred ListLinks, one after another: the hub's CPU per call in ms
/// (less what it spends idle meanwhile), the answer's size, the calls'
/// latency. The CPU is read in 10 ms ticks, so twenty calls of 7 ms left
/// each call's figure half a millisecond apart from run to run.
async fn list_links_cost(
    dashboard: &Dashboard,
    hub: &HubProc,
    idle_cpu: f64,
) -> anyhow::Result<(f64, usize, Latency)> {
    const CALLS: usize = 100;
    let (mut lat, c0) = (Vec::new(), cpu_secs(&hub.pid()).unwrap_or(0.0));
    let (t0, mut size) = (Instant::now(), 0);
    for _ in 0..CALLS {
        let t = Instant::now();
        size = dashboard.list().await?;
        lat.push(t.elapsed());
    }
    let cpu = cpu_secs(&hub.pid()).unwrap_or(0.0) - c0 - idle_cpu * t0.elapsed().as_secs_f64();
    Ok((
        cpu.max(0.0) * 1000.0 / CALLS as f64,
        size,
        Latency::of(&lat),
    ))
}

/// The size of a ListLinks answer, in bytes.
async fn list_links_size(ch: &tonic::transport::Channel, token: &str) -> anyhow::Result<usize> {
    let r = LinkServiceClient::new(ch.clone())
        .max_decoding_message_size(64 << 20)
        .list_links(with_token(ListLinksRequest {}, token))
        .await?;
    Ok(prost::Message::encoded_len(&r.into_inner()))
}

/// Gets to one cluster through the hub, alone and while dashboards poll
/// ListLinks over the whole fleet back to back, each on a connection of
/// its own: listings of every link must not hold up the calls beside them.
async fn gets_beside_list_links(
    figs: &mut Figures,
    ch: &tonic::transport::Channel,
    hub: &HubProc,
    ca: &str,
    token: &str,
    n: usize,
    json: bool,
) -> anyhow::Result<()> {
    const GETS: usize = 400;
    const DASHBOARDS: usize = 3;
    let gets = || async {
        let mut out = Vec::with_capacity(GETS);
        for _ in 0..GETS {
            let t = Instant::now();
            tokio::time::timeout(
                Duration::from_secs(10),
                otter_proto::resource::v1::resource_service_client::ResourceServiceClient::new(
                    ch.clone(),
                )
                .get(with_token(
                    otter_proto::resource::v1::GetRequest {
                        cluster: Some("c-0".into()),
                        version: Some("v1".into()),
                        resource: Some("pods".into()),
                        name: Some("p".into()),
                        ..Default::default()
                    },
                    token,
                )),
            )
            .await??;
            out.push(t.elapsed());
        }
        anyhow::Ok(Latency::of(&out))
    };
    let alone = gets().await?;
    let polling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let listed = Arc::new(AtomicU32::new(0));
    // Each dashboard is a program of its own: a thread and runtime apart,
    // so decoding its answers does not hold up this runtime's Gets. More
    // of them than the hub has cores, each listing back to back.
    let dashboards: Vec<_> = (0..DASHBOARDS)
        .map(|_| {
            let (polling, listed, token) = (polling.clone(), listed.clone(), token.to_owned());
            let (api, ca) = (hub.api, ca.to_owned());
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            Ok(std::thread::spawn(move || {
                runtime.block_on(async move {
                    let dashboard = Dashboard::open(json, api, &ca, &token).await?;
                    // Bounded by the flag and by this cap.
                    let deadline = Instant::now() + Duration::from_secs(120);
                    while polling.load(Ordering::Relaxed) && Instant::now() < deadline {
                        if dashboard.list().await.is_ok() {
                            listed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    anyhow::Ok(())
                })
            }))
        })
        .collect::<anyhow::Result<_>>()?;
    let beside = gets().await;
    polling.store(false, Ordering::Relaxed);
    for dashboard in dashboards {
        dashboard
            .join()
            .map_err(|_| anyhow::anyhow!("a dashboard thread panicked"))??;
    }
    let beside = beside?;
    let suffix = if json { "-json" } else { "" };
    for (q, a, b) in [
        ("p50", alone.p50, beside.p50),
        ("p99", alone.p99, beside.p99),
    ] {
        let base = format!("scale.get-{q}{suffix}.n{n}");
        figs.add(&base, "µs", None, a);
        figs.add(
            &format!("scale.get-{q}-beside-listlinks{suffix}.n{n}"),
            "µs",
            Some(&base),
            b,
        );
    }
    eprintln!(
        "bench: Get p99 {:.0} µs alone, {:.0} µs beside {} ListLinks{}",
        alone.p99,
        beside.p99,
        listed.load(Ordering::Relaxed),
        if json { " in JSON" } else { "" }
    );
    Ok(())
}

/// Waits until all `agents` have had a tunnel up since `since_ms` and the
/// hub lists as many links connected; the time it took. The agents' own
/// status says when to ask: a ListLinks over 10,000 links costs the hub
/// about 35 ms of CPU and this process as much to decode, and polled five
/// times a second through a graceful storm it took 1.2-1.5 of the hub's
/// 9.2-9.5 CPU s and slowed what it measured.
async fn wait_links(
    ch: &tonic::transport::Channel,
    token: &str,
    agents: &[(Agent, Arc<Marks>)],
    since_ms: u64,
    limit: Duration,
) -> anyhow::Result<Duration> {
    let (start, n) = (Instant::now(), agents.len());
    loop {
        let up = agents.iter().filter(|(_, m)| m.up_since(since_ms)).count();
        // The hub has the last word; asked only once the agents agree.
        let listed = if up >= n {
            connected_links(ch, token).await.unwrap_or(0)
        } else {
            0
        };
        if listed >= n {
            return Ok(start.elapsed());
        }
        if start.elapsed() > limit {
            bail!("only {up} of {n} agents up ({listed} links listed connected) after {limit:?}");
        }
        let pause = if up >= n { 200 } else { 20 };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

fn start_agent(
    hub: &HubProc,
    ca: &str,
    i: usize,
    token: &str,
) -> anyhow::Result<(Agent, Arc<Marks>)> {
    start_agent_on(&[hub], ca, i, token)
}

/// Agent `c-<i>`, registering through the first of `hubs` that answers.
pub fn start_agent_on(
    hubs: &[&HubProc],
    ca: &str,
    i: usize,
    token: &str,
) -> anyhow::Result<(Agent, Arc<Marks>)> {
    let mut urls = hubs
        .iter()
        .map(|h| url::Url::parse(&format!("https://localhost:{}", h.api.port())));
    let url = urls.next().context("a hub")??;
    let cluster = format!("c-{i}");
    let mut config = AgentConfig::new(url, &cluster, "agent-0", ca);
    config.more_hub_urls = urls.collect::<Result<_, _>>()?;
    config.join_token = Secret(token.to_owned());
    config.transports = vec![transport_of(i)];
    let double = Double {
        cluster: cluster.clone(),
        agent: "agent-0".into(),
        live_watches: Default::default(),
    };
    let routes = tonic::service::Routes::new(ResourceServiceServer::new(double));
    let agent = Agent::start(config, routes)?;
    // Counts failed connect rounds (status updates that report an error
    // while no tunnel is up); updates that coalesce count once. A paced
    // refusal is left out: the hub answered and said when to return, and
    // the agent waits at least that long rather than backing off.
    let marks = Arc::new(Marks::default());
    let (mut rx, m) = (agent.status_watch(), marks.clone());
    tokio::spawn(async move {
        let (mut refusals, mut up, mut dials, mut tunnels) = (0, false, 0, 0);
        while rx.changed().await.is_ok() {
            let s = rx.borrow_and_update();
            if s.dials != dials {
                dials = s.dials;
                m.dial_at_ms.store(Marks::now_ms(), Ordering::Relaxed);
            }
            // Updates coalesce: a tunnel that went down and came back
            // between two of them shows only as one more set up (a connect,
            // or a redial beside a tunnel gone quiet).
            let set_up = s.connects + s.redials;
            let again = set_up != tunnels && up && s.connected.is_some();
            tunnels = set_up;
            if s.connected.is_some() != up || again {
                up = s.connected.is_some();
                let at = if up { &m.up_at_ms } else { &m.down_at_ms };
                at.store(Marks::now_ms(), Ordering::Relaxed);
                m.up.store(up, Ordering::Relaxed);
            }
            if s.refusals != refusals {
                refusals = s.refusals;
                m.refusals.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if !up && s.attempts.iter().any(|(_, r)| r.is_err()) {
                m.failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    Ok((agent, marks))
}

/// Agent `i`'s transport: half the agents on each of QUIC and HTTP/2,
/// unless OTTER_BENCH_TRANSPORT names one (to see what each costs).
fn transport_of(i: usize) -> TransportKind {
    match std::env::var("OTTER_BENCH_TRANSPORT").as_deref() {
        Ok("quic") => TransportKind::Quic,
        Ok("h2") => TransportKind::H2,
        Ok("ws") => TransportKind::Ws,
        _ if i.is_multiple_of(2) => TransportKind::Quic,
        _ => TransportKind::H2,
    }
}

/// What a bench agent went through, from its status updates.
#[derive(Debug, Default)]
pub struct Marks {
    /// Failed connect rounds.
    failures: AtomicU32,
    /// Times the hub said when to come back.
    refusals: AtomicU32,
    /// When a tunnel last came up, in [`Marks::now_ms`].
    up_at_ms: AtomicU64,
    /// When the agent last knew its tunnel was down.
    down_at_ms: AtomicU64,
    /// When its last connect round began.
    dial_at_ms: AtomicU64,
    /// Whether a tunnel is up now.
    up: AtomicBool,
}

impl Marks {
    /// Milliseconds since this process first asked.
    fn now_ms() -> u64 {
        static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
    }

    /// Whether its tunnel is up, and came up at `since_ms` or later.
    fn up_since(&self, since_ms: u64) -> bool {
        self.up.load(Ordering::Relaxed) && self.up_at_ms.load(Ordering::Relaxed) >= since_ms
    }

    fn reset(&self) {
        self.failures.store(0, Ordering::Relaxed);
        self.refusals.store(0, Ordering::Relaxed);
    }
}

/// Connect rounds an agent may make in `outage` under the backoff: the
/// rounds that fit if every delay were a tenth of its ceiling (full jitter
/// makes shorter delays possible, but not ten in a row).
fn backoff_bound(outage: Duration) -> u32 {
    let defaults = AgentConfig::new(
        url::Url::parse("https://localhost").expect("static URL"),
        "c",
        "a",
        "",
    );
    let mut b = otter_agent::backoff::Backoff::new(defaults.backoff_base, defaults.backoff_cap);
    let (mut spent, mut rounds) = (Duration::ZERO, 1u32);
    while spent <= outage && rounds < 10_000 {
        spent += b.ceiling() / 10;
        b.next_with(0.0);
        rounds += 1;
    }
    rounds
}

/// Scale and reconnect storm with `n` agents; hub idle RSS with none.
pub async fn run(n: usize, idle_secs: u64) -> anyhow::Result<Figures> {
    otter_pki::tls::install_default_provider();
    let mut figs = Figures::default();
    let dir = tempfile::tempdir()?;
    let hub = HubProc::start(dir.path(), 0, 0, n)?;
    let token = admin_token(dir.path())?;
    let ca = std::fs::read_to_string(dir.path().join("bench-ca.pem"))?;
    let ch = crate::calls::hub_channel(hub.api, &ca).await?;
    connected_links(&ch, &token).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss0 = rss_kib(&hub.pid()).unwrap_or(0);
    figs.add("footprint.hub-idle-rss", "MiB", None, rss0 as f64 / 1024.0);
    // Heap and stacks only, as for the agent: the rest is the binary's
    // pages, which follow its size and what the kernel keeps cached.
    if let Some(kib) = status_kib(&hub.pid(), "RssAnon:") {
        figs.add(
            "footprint.hub-idle-rss-anon",
            "MiB",
            None,
            kib as f64 / 1024.0,
        );
    }

    // N agents, started together.
    eprintln!("bench: starting {n} agents");
    let tokens: Vec<String> = std::fs::read_to_string(dir.path().join("bench-tokens"))?
        .lines()
        .map(str::to_owned)
        .collect();
    // The CPU the first connect takes, hub and agents apart: on 2 shared
    // cores their sum over 2 is the least time it can take.
    let (hub_cpu0, own_cpu0) = (cpu_secs(&hub.pid()), cpu_secs("self"));
    let (t, since_ms) = (Instant::now(), Marks::now_ms());
    let mut agents = Vec::with_capacity(n);
    for (i, tok) in tokens.iter().enumerate().take(n) {
        agents.push(start_agent(&hub, &ca, i, tok)?);
    }
    let limit = Duration::from_secs(60 + n as u64 / 20);
    let connect_all = wait_links(&ch, &token, &agents, since_ms, limit).await?;
    let _ = t;
    figs.add(
        &format!("scale.connect-all.n{n}"),
        "s",
        None,
        connect_all.as_secs_f64(),
    );
    for (who, before, now) in [
        ("hub", hub_cpu0, cpu_secs(&hub.pid())),
        ("agents", own_cpu0, cpu_secs("self")),
    ] {
        if let (Some(before), Some(now)) = (before, now) {
            figs.add(
                &format!("scale.connect-all-cpu-{who}.n{n}"),
                "CPU s",
                None,
                now - before,
            );
        }
    }
    // Agents that ran their doctor (three failed rounds in a row).
    let doctors: u32 = agents.iter().map(|(a, _)| a.status().doctor_runs).sum();
    figs.add(
        &format!("scale.doctor-runs.n{n}"),
        "runs",
        None,
        f64::from(doctors),
    );
    // Handshakes the hub's QUIC socket had no room for: each costs its
    // agent a retransmission timeout.
    if let Some(drops) = udp_drops(hub.tunnel.port()) {
        figs.add(
            &format!("scale.hub-udp-drops.n{n}"),
            "datagrams",
            None,
            drops as f64,
        );
    }
    figs.add(
        &format!("scale.handshakes-evicted.n{n}"),
        "handshakes",
        None,
        hub.handshakes_evicted().await?,
    );
    // The API port's, where every agent Registers first: connections it
    // dropped before their first request for newer ones, and those it
    // closed at once over its cap. Each sends an agent back to retry.
    for (figure, metric) in [
        ("api-handshakes-evicted", "otter_hub_api_handshakes_evicted"),
        (
            "api-connections-refused",
            "otter_hub_api_connections_refused",
        ),
    ] {
        figs.add(
            &format!("scale.{figure}.n{n}"),
            "connections",
            None,
            hub.metric(metric).await?,
        );
    }

    // Idle with keepalives.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (c0, t0) = (cpu_secs(&hub.pid()).unwrap_or(0.0), Instant::now());
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let idle_cpu = (cpu_secs(&hub.pid()).unwrap_or(0.0) - c0) / t0.elapsed().as_secs_f64();
    let rss = rss_kib(&hub.pid()).unwrap_or(0);
    figs.add(
        &format!("scale.hub-rss-per-tunnel.n{n}"),
        "KiB",
        None,
        (rss.saturating_sub(rss0)) as f64 / n as f64,
    );
    figs.add(
        &format!("scale.hub-rss.n{n}"),
        "MiB",
        None,
        rss as f64 / 1024.0,
    );
    figs.add(
        &format!("scale.hub-idle-cpu.n{n}"),
        "% of a core",
        None,
        idle_cpu * 100.0,
    );
    let grpc = Dashboard::Grpc(ch.clone(), token.clone());
    let (list_cpu, size, l) = list_links_cost(&grpc, &hub, idle_cpu).await?;
    figs.add(
        &format!("scale.listlinks-hub-cpu.n{n}"),
        "ms",
        None,
        list_cpu,
    );
    figs.add(
        &format!("scale.listlinks-size.n{n}"),
        "KiB",
        None,
        size as f64 / 1024.0,
    );
    figs.add(
        &format!("scale.listlinks-p50.n{n}"),
        "ms",
        None,
        l.p50 / 1000.0,
    );
    figs.add(
        &format!("scale.listlinks-max.n{n}"),
        "ms",
        None,
        l.max / 1000.0,
    );
    // Another tenant's admin, whose listing holds none of those links.
    let bystander = std::fs::read_to_string(dir.path().join("bystander-token"))?;
    let bystander = Dashboard::Grpc(ch.clone(), bystander.trim().to_owned());
    let (other_cpu, _, other) = list_links_cost(&bystander, &hub, idle_cpu).await?;
    figs.add(
        &format!("scale.listlinks-bystander-hub-cpu.n{n}"),
        "ms",
        Some(&format!("scale.listlinks-hub-cpu.n{n}")),
        other_cpu,
    );
    figs.add(
        &format!("scale.listlinks-bystander-p50.n{n}"),
        "ms",
        None,
        other.p50 / 1000.0,
    );

    // The same listing as a browser dashboard asks it: Connect with JSON,
    // gzip accepted, so the hub transcodes and compresses the answer.
    let browser = Dashboard::open(true, hub.api, &ca, &token).await?;
    let (json_cpu, json_size, json) = list_links_cost(&browser, &hub, idle_cpu).await?;
    figs.add(
        &format!("scale.listlinks{}-hub-cpu.n{n}", browser.suffix()),
        "ms",
        Some(&format!("scale.listlinks-hub-cpu.n{n}")),
        json_cpu,
    );
    figs.add(
        &format!("scale.listlinks{}-gzip-size.n{n}", browser.suffix()),
        "KiB",
        None,
        json_size as f64 / 1024.0,
    );
    figs.add(
        &format!("scale.listlinks{}-p50.n{n}", browser.suffix()),
        "ms",
        None,
        json.p50 / 1000.0,
    );

    for json in [false, true] {
        gets_beside_list_links(&mut figs, &ch, &hub, &ca, &token, n, json).await?;
    }
    fan_out(&mut figs, &ch, &token, &hub.pid(), n).await?;

    // Reconnect storm: the hub stops (gracefully, then by SIGKILL as in a
    // crash) and starts again on the same ports and data.
    let (api, tunnel) = (hub.api.port(), hub.tunnel.port());
    let mut hub = Some(hub);
    for mode in ["graceful", "crash"] {
        eprintln!("bench: reconnect storm ({mode}) with {n} agents");
        for (_, m) in &agents {
            m.reset();
        }
        let old = hub.take().context("hub")?;
        let down = Instant::now();
        let down_ms = Marks::now_ms();
        if mode == "crash" {
            old.kill();
        } else {
            old.stop();
        }
        let restarted = HubProc::start(dir.path(), api, tunnel, n)?;
        let hub_back = down.elapsed();
        figs.add(
            &format!("storm-{mode}.hub-down.n{n}"),
            "s",
            None,
            hub_back.as_secs_f64(),
        );
        let pid = restarted.pid();
        let ch = crate::calls::hub_channel(restarted.api, &ca).await?;
        let back = wait_links(&ch, &token, &agents, down_ms, limit).await;
        let outage = down.elapsed();
        let cpu = cpu_secs(&pid).unwrap_or(0.0);
        let peak = status_kib(&pid, "VmHWM:").unwrap_or(0);
        let name = |what: &str| format!("storm-{mode}.{what}.n{n}");
        match back {
            Ok(_) => figs.add(&name("reconnect-all"), "s", None, outage.as_secs_f64()),
            Err(e) => figs.push(Figure::skipped(name("reconnect-all"), e.to_string())),
        }
        figs.add(&name("hub-peak-rss"), "MiB", None, peak as f64 / 1024.0);
        figs.add(&name("hub-cpu"), "CPU s", None, cpu);
        if let Some(drops) = udp_drops(tunnel) {
            figs.add(&name("hub-udp-drops"), "datagrams", None, drops as f64);
        }
        figs.add(
            &name("handshakes-evicted"),
            "handshakes",
            None,
            restarted.handshakes_evicted().await?,
        );
        let bound = backoff_bound(outage);
        let rounds: Vec<u32> = agents
            .iter()
            .map(|(_, m)| m.failures.load(Ordering::Relaxed))
            .collect();
        let max = rounds.iter().copied().max().unwrap_or(0);
        let over = rounds.iter().filter(|r| **r > bound).count();
        figs.add(&name("max-failed-rounds"), "rounds", None, f64::from(max));
        // By transport, when each agent knew its tunnel was gone and when
        // it was back: whether the last one is a straggler or the tail of a
        // slow crowd, and how much of it is noticing.
        for kind in [TransportKind::Quic, TransportKind::H2, TransportKind::Ws] {
            let since_down = |at: &AtomicU64| {
                let at = at.load(Ordering::Relaxed);
                (at >= down_ms).then(|| Duration::from_millis(at - down_ms))
            };
            let ours = || {
                agents
                    .iter()
                    .enumerate()
                    .filter(move |(i, _)| transport_of(*i) == kind)
            };
            let noticed: Vec<Duration> = ours()
                .filter_map(|(_, (_, m))| since_down(&m.down_at_ms))
                .collect();
            let back: Vec<Duration> = ours()
                .filter_map(|(_, (_, m))| since_down(&m.up_at_ms))
                .collect();
            for (what, times) in [("noticed", noticed), ("back", back)] {
                if times.is_empty() {
                    continue;
                }
                let l = Latency::of(&times);
                for (q, v) in [
                    ("p50", l.p50),
                    ("p90", l.p90),
                    ("p99", l.p99),
                    ("max", l.max),
                ] {
                    figs.add(&name(&format!("{what}-{kind}-{q}")), "s", None, v / 1e6);
                }
            }
        }
        // The slowest agents' story, for whoever reads the bench's log.
        let mut by_time: Vec<(u64, usize)> = agents
            .iter()
            .enumerate()
            .map(|(i, (_, m))| (m.up_at_ms.load(Ordering::Relaxed), i))
            .collect();
        by_time.sort_unstable();
        for &(at, i) in by_time.iter().rev().take(3) {
            let (agent, m) = &agents[i];
            let s = agent.status();
            let dialled = m.dial_at_ms.load(Ordering::Relaxed);
            eprintln!(
                "bench: {mode}: c-{i} over {} back after {:.1} s (its last round began at {:.1} s, \
                 the hub was back at {:.1} s): {} failed rounds, {} refusals, \
                 dials {} in all, last error {:?}, last end {:?}",
                transport_of(i),
                at.saturating_sub(down_ms) as f64 / 1e3,
                dialled.saturating_sub(down_ms) as f64 / 1e3,
                hub_back.as_secs_f64(),
                m.failures.load(Ordering::Relaxed),
                m.refusals.load(Ordering::Relaxed),
                s.dials,
                s.last_error,
                s.last_tunnel_end.map(|e| e.to_string()),
            );
        }
        let refused = agents
            .iter()
            .filter(|(_, m)| m.refusals.load(Ordering::Relaxed) > 0)
            .count();
        figs.add(&name("agents-told-to-wait"), "agents", None, refused as f64);
        // Over the bench so far: new tunnels dialled beside a quiet one (a
        // restarted hub's reset that never arrived), and the agents' own
        // doctor runs (after a few failed rounds in a row; each costs the
        // hub TLS handshakes).
        let (quiet, doctors) = agents
            .iter()
            .map(|(a, _)| a.status())
            .fold((0u32, 0u32), |(q, d), s| {
                (q + s.quiet_probes, d + s.doctor_runs)
            });
        for (what, unit, sum) in [
            ("quiet-probes-so-far", "tunnels", quiet),
            ("doctor-runs-so-far", "runs", doctors),
        ] {
            figs.add(&name(what), unit, None, f64::from(sum));
        }
        figs.add(&name("agents-over-backoff"), "agents", None, over as f64);
        figs.note(
            &name("agents-over-backoff"),
            &format!("bound {bound} rounds in the outage (every delay a tenth of its ceiling)"),
        );
        hub = Some(restarted);
    }
    for (a, _) in agents {
        tokio::spawn(a.shutdown());
    }
    drop(hub);
    Ok(figs)
}

/// A FleetService List over all `n` connected clusters (each agent's
/// double answers a small fixed list), five times: when the first and the
/// last cluster's answer arrive, and the hub's RSS meanwhile (sampled every
/// 5 ms).
async fn fan_out(
    figs: &mut Figures,
    ch: &tonic::transport::Channel,
    token: &str,
    hub_pid: &str,
    n: usize,
) -> anyhow::Result<()> {
    use otter_proto::fleet::v1::{
        FanOut, ListResourcesRequest, fleet_service_client::FleetServiceClient,
        list_resources_response,
    };
    eprintln!("bench: fan-out List over {n} clusters");
    for _ in 0..5 {
        let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let sampler = {
            let (sampling, peak, pid) = (sampling.clone(), peak.clone(), hub_pid.to_owned());
            tokio::spawn(async move {
                while sampling.load(Ordering::Relaxed) {
                    peak.fetch_max(rss_kib(&pid).unwrap_or(0), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        };
        let t = Instant::now();
        let mut stream = FleetServiceClient::new(ch.clone())
            .max_decoding_message_size(16 << 20)
            .list_resources(with_token(
                ListResourcesRequest {
                    fan_out: Some(FanOut::default()),
                    version: Some("v1".into()),
                    resource: Some("pods".into()),
                    ..Default::default()
                },
                token,
            ))
            .await?
            .into_inner();
        let (mut first, mut ok, mut answers) = (None, 0usize, 0usize);
        while let Some(m) = stream.message().await? {
            first.get_or_insert_with(|| t.elapsed());
            answers += 1;
            if matches!(m.result, Some(list_resources_response::Result::List(_))) {
                ok += 1;
            }
        }
        let all = t.elapsed();
        sampling.store(false, Ordering::Relaxed);
        sampler.await?;
        anyhow::ensure!(answers == n, "fan-out: {answers} answers from {n} clusters");
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        figs.add(
            &format!("fanout.first.n{n}"),
            "ms",
            None,
            ms(first.unwrap_or(all)),
        );
        figs.add(&format!("fanout.all.n{n}"), "ms", None, ms(all));
        figs.add(&format!("fanout.listed.n{n}"), "clusters", None, ok as f64);
        figs.add(
            &format!("fanout.hub-rss.n{n}"),
            "MiB",
            None,
            peak.load(Ordering::Relaxed) as f64 / 1024.0,
        );
    }
    figs.note(
        &format!("fanout.all.n{n}"),
        &format!(
            "one ListResources over every cluster, {} at a time",
            otter_hub::fleet::CONCURRENCY
        ),
    );
    Ok(())
}

/// `agent-child`: one agent serving the test double; prints CONNECTED once up.
pub async fn agent_child(
    api: u16,
    ca_file: PathBuf,
    cluster: String,
    token: String,
) -> anyhow::Result<()> {
    let ca = std::fs::read_to_string(ca_file)?;
    let url = url::Url::parse(&format!("https://localhost:{api}"))?;
    let mut config = AgentConfig::new(url, &cluster, "agent-0", &ca);
    config.join_token = Secret(token);
    let double = Double {
        cluster,
        agent: "agent-0".into(),
        live_watches: Default::default(),
    };
    let agent = Agent::start(
        config,
        tonic::service::Routes::new(ResourceServiceServer::new(double)),
    )?;
    agent
        .wait_for(Duration::from_secs(30), |s| s.connected.is_some())
        .await
        .context("agent did not connect")?;
    println!("CONNECTED");
    tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        while std::io::stdin()
            .read_line(&mut line)
            .map(|n| n > 0)
            .unwrap_or(false)
        {
            line.clear();
        }
    })
    .await?;
    Ok(())
}

/// Agent idle RSS (an agent process connected to a hub, idle) and the size
/// of the stripped release agent binary when given.
pub async fn footprint(agent_bin: Option<PathBuf>, runs: usize) -> anyhow::Result<Figures> {
    let mut figs = Figures::default();
    let dir = tempfile::tempdir()?;
    let hub = HubProc::start(dir.path(), 0, 0, runs)?;
    let ca_file = dir.path().join("bench-ca.pem");
    let tokens: Vec<String> = std::fs::read_to_string(dir.path().join("bench-tokens"))?
        .lines()
        .map(str::to_owned)
        .collect();
    for (run, token) in tokens.iter().enumerate().take(runs) {
        eprintln!("bench: footprint run {}/{runs}", run + 1);
        let mut child = Command::new(std::env::current_exe()?)
            .arg("agent-child")
            .arg(hub.api.port().to_string())
            .arg(&ca_file)
            .arg(format!("c-{run}"))
            .arg(token)
            .env("RUST_LOG", "error")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let mut out = BufReader::new(child.stdout.take().context("stdout")?);
        let mut line = String::new();
        out.read_line(&mut line)?;
        if line.trim() == "CONNECTED" {
            tokio::time::sleep(Duration::from_secs(3)).await;
            let pid = child.id().to_string();
            if let Some(kib) = rss_kib(&pid) {
                figs.add("footprint.agent-idle-rss", "MiB", None, kib as f64 / 1024.0);
            }
            // Heap and stacks only: the rest is the binary's pages (here the
            // whole bench binary's), which grow with its size, not with
            // what the agent holds.
            if let Some(kib) = status_kib(&pid, "RssAnon:") {
                figs.add(
                    "footprint.agent-idle-rss-anon",
                    "MiB",
                    None,
                    kib as f64 / 1024.0,
                );
            }
        } else {
            eprintln!("bench: agent child did not connect");
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    figs.note(
        "footprint.agent-idle-rss",
        "the agent library serving the test double, in the bench binary",
    );
    figs.note(
        "footprint.agent-idle-rss-anon",
        "of which heap and stacks; the rest is pages of the bench binary",
    );
    drop(hub);
    match agent_bin {
        Some(bin) => {
            let stripped = dir.path().join("agent-stripped");
            std::fs::copy(&bin, &stripped)?;
            let ok = Command::new("strip")
                .arg(&stripped)
                .status()
                .map(|s| s.success());
            if ok.unwrap_or(false) {
                let size = std::fs::metadata(&stripped)?.len();
                figs.add(
                    "footprint.agent-binary",
                    "MiB",
                    None,
                    size as f64 / 1048576.0,
                );
            } else {
                figs.push(Figure::skipped("footprint.agent-binary", "strip failed"));
            }
        }
        None => figs.push(Figure::skipped(
            "footprint.agent-binary",
            "no release agent binary given",
        )),
    }
    Ok(figs)
}
