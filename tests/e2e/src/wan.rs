//! A distant, lossy link between the two namespaces of a [`NetPair`]: each
//! namespace gets a TUN device instead of a veth end, and threads of this
//! process carry every IP packet from one device to the other with a
//! one-way delay, a rate limit, a bounded queue and random loss. TCP and
//! UDP go through the same link, so HTTP/2 and QUIC tunnels meet the same
//! conditions (the kernel here has no `netem` to do this for us).
//!
//! The loss can change while the link carries traffic ([`WanLink::set_loss`]),
//! so one scene can be measured at several loss rates.

use std::{
    collections::VecDeque,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::netns::{AGENT_IP, HUB_IP, NetPair, in_netns};

/// Name of the TUN device in each namespace.
const DEVICE: &str = "otter-wan";
/// How often the relay threads look at the stop flag.
const POLL: Duration = Duration::from_millis(50);
/// Largest packet a TUN device hands over (its MTU is the default 1,500).
const MAX_PACKET: usize = 65_536;

/// What the link does to each packet, each way.
#[derive(Debug, Clone, Copy)]
pub struct Impairment {
    /// One-way delay (the round trip is twice this).
    pub delay: Duration,
    /// Bytes per second each way.
    pub rate: u64,
    /// Longest a packet may wait for the rate limit before it is dropped
    /// (the bottleneck's queue, tail drop).
    pub queue: Duration,
    /// Fraction of packets dropped at random, each way (0.01 = 1 %).
    pub loss: f64,
}

impl Default for Impairment {
    /// A distant link: 100 ms round trip, 100 Mbit/s, a queue of one
    /// round trip, no loss.
    fn default() -> Self {
        Impairment {
            delay: Duration::from_millis(50),
            rate: 100_000_000 / 8,
            queue: Duration::from_millis(100),
            loss: 0.0,
        }
    }
}

/// Counters of one direction.
#[derive(Debug, Default)]
pub struct Counters {
    pub packets: AtomicU64,
    /// Dropped at random.
    pub lost: AtomicU64,
    /// Dropped because the queue was full.
    pub overflowed: AtomicU64,
}

/// The namespaces and the relay between them; dropping it stops the
/// relay, then deletes the namespaces (kill the processes inside first).
#[derive(Debug)]
pub struct WanLink {
    threads: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    /// Loss in millionths, shared by both directions.
    loss_ppm: Arc<AtomicU32>,
    /// Further loss of UDP packets only.
    udp_loss_ppm: Arc<AtomicU32>,
    /// Hub → agent, then agent → hub.
    pub counters: [Arc<Counters>; 2],
    // Last: dropped after the threads are joined.
    pub pair: NetPair,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// A TUN device in namespace `ns`, addressed `local` with `peer` at the
/// other end, up.
fn device(
    ns: &str,
    local: std::net::Ipv4Addr,
    peer: std::net::Ipv4Addr,
) -> Result<tun::Device, String> {
    let dev = in_netns(ns, || {
        let mut config = tun::Configuration::default();
        config.tun_name(DEVICE);
        tun::Device::new(&config).map_err(|e| format!("TUN device: {e}"))
    })??;
    ip(&[
        "-n",
        ns,
        "addr",
        "add",
        &local.to_string(),
        "peer",
        &format!("{peer}/32"),
        "dev",
        DEVICE,
    ])?;
    ip(&["-n", ns, "link", "set", DEVICE, "up"])?;
    Ok(dev)
}

impl WanLink {
    /// Two namespaces joined by a link with `impairment`. Err when this
    /// machine does not let us (no privilege, no `ip`, no `/dev/net/tun`).
    pub fn create(impairment: Impairment) -> Result<WanLink, String> {
        let pair = NetPair::namespaces()?;
        let hub = Arc::new(device(&pair.hub, HUB_IP, AGENT_IP)?);
        let agent = Arc::new(device(&pair.agent, AGENT_IP, HUB_IP)?);
        let stop = Arc::new(AtomicBool::new(false));
        let loss_ppm = Arc::new(AtomicU32::new(ppm(impairment.loss)));
        let udp_loss_ppm = Arc::new(AtomicU32::new(0));
        let counters = [Arc::default(), Arc::default()];
        let mut threads = Vec::new();
        for (from, to, counters) in [
            (hub.clone(), agent.clone(), &counters[0]),
            (agent, hub, &counters[1]),
        ] {
            let (tx, rx) = mpsc::channel();
            let dir = Direction {
                impairment,
                loss_ppm: loss_ppm.clone(),
                udp_loss_ppm: udp_loss_ppm.clone(),
                stop: stop.clone(),
                counters: Arc::clone(counters),
            };
            let deliver = dir.clone();
            threads.push(std::thread::spawn(move || dir.admit(&from, &tx)));
            threads.push(std::thread::spawn(move || deliver.deliver(&to, &rx)));
        }
        Ok(WanLink {
            threads,
            stop,
            loss_ppm,
            udp_loss_ppm,
            counters,
            pair,
        })
    }

    /// [`WanLink::create`], or `None` with a line saying why (a failure
    /// under `OTTER_REQUIRE_TOOLS=1`).
    pub fn create_or_skip(impairment: Impairment) -> Option<WanLink> {
        crate::netns::or_skip(WanLink::create(impairment))
    }

    /// Changes the random loss of both directions from now on.
    pub fn set_loss(&self, loss: f64) {
        self.loss_ppm.store(ppm(loss), Ordering::Relaxed);
    }

    /// Drops this fraction of UDP packets besides, each way, from now on:
    /// a path that polices UDP and lets TCP through.
    pub fn set_udp_loss(&self, loss: f64) {
        self.udp_loss_ppm.store(ppm(loss), Ordering::Relaxed);
    }
}

impl Drop for WanLink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn ppm(loss: f64) -> u32 {
    (loss.clamp(0.0, 1.0) * 1e6) as u32
}

/// One direction of the link.
#[derive(Debug, Clone)]
struct Direction {
    impairment: Impairment,
    loss_ppm: Arc<AtomicU32>,
    udp_loss_ppm: Arc<AtomicU32>,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
}

impl Direction {
    /// Reads packets from `from`; drops the unlucky ones and those that
    /// find the queue full; hands the rest on with the moment they are due.
    fn admit(&self, from: &tun::Device, tx: &mpsc::Sender<(Instant, Vec<u8>)>) {
        let mut buf = vec![0u8; MAX_PACKET];
        // When the bottleneck is free to send the next packet.
        let mut free_at = Instant::now();
        while !self.stop.load(Ordering::Relaxed) {
            let n = match from.recv_timeout(&mut buf, POLL) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => continue,
                Err(_) => return,
            };
            self.counters.packets.fetch_add(1, Ordering::Relaxed);
            let mut loss = self.loss_ppm.load(Ordering::Relaxed);
            // IPv4, protocol 17: UDP.
            if n > 9 && buf[0] >> 4 == 4 && buf[9] == 17 {
                loss = loss.saturating_add(self.udp_loss_ppm.load(Ordering::Relaxed));
            }
            if loss > 0 && rand::random::<u32>() % 1_000_000 < loss {
                self.counters.lost.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let now = Instant::now();
            let start = free_at.max(now);
            if start - now > self.impairment.queue {
                self.counters.overflowed.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let wire = Duration::from_secs_f64(n as f64 / self.impairment.rate as f64);
            free_at = start + wire;
            if tx
                .send((free_at + self.impairment.delay, buf[..n].to_vec()))
                .is_err()
            {
                return;
            }
        }
    }

    /// Writes each packet to `to` when it is due, in order.
    fn deliver(&self, to: &tun::Device, rx: &mpsc::Receiver<(Instant, Vec<u8>)>) {
        let mut pending: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
        while !self.stop.load(Ordering::Relaxed) {
            let wait = match pending.front() {
                Some((due, _)) => due.saturating_duration_since(Instant::now()).min(POLL),
                None => POLL,
            };
            match rx.recv_timeout(wait) {
                Ok(p) => pending.push_back(p),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
            let now = Instant::now();
            while pending.front().is_some_and(|(due, _)| *due <= now) {
                if let Some((_, packet)) = pending.pop_front() {
                    // A full device queue drops the packet, as a link would.
                    let _ = to.send(&packet);
                }
            }
        }
    }
}

// ------------------------------------------------------------------ scene

/// The cluster's name in a [`Scene`].
pub const CLUSTER: &str = "edge-0";
/// The pod the test server serves in a [`Scene`].
pub const POD: &str = "web";
/// The pod's port behind which a server sends without end
/// ([`crate::procs::source_server`]).
pub const SOURCE: u16 = 8081;
/// The pod's port behind which a server counts what it gets
/// ([`crate::procs::ack_sink`]).
pub const SINK: u16 = 8082;
const AGENT_HEALTH: &str = "127.0.0.1:9090";
const WAIT: Duration = Duration::from_secs(60);

/// A hub process in the hub's namespace of `link`, the Kubernetes API test
/// server and an agent on `transport` in the agent's, the tunnel up across
/// the link. Clients reach the hub at `https://<HUB_IP>:8443` from inside
/// the hub's namespace ([`in_netns`]).
#[derive(Debug)]
pub struct Scene {
    // Fields drop in order: the processes are killed, then their files go,
    // then the namespaces.
    _procs: Vec<crate::procs::Proc>,
    /// The hub's admin token.
    pub admin: String,
    /// The hub's CA (PEM).
    pub ca_pem: String,
    _dir: tempfile::TempDir,
    pub link: WanLink,
}

impl Scene {
    pub fn start(transport: &str, link: WanLink) -> Result<Scene, String> {
        Scene::start_on(&[transport], link)
    }

    /// The last `n` lines the agent logged.
    pub fn agent_tail(&self, n: usize) -> String {
        self._procs.last().map(|p| p.tail(n)).unwrap_or_default()
    }

    /// An agent's Prometheus sample `name`, read inside its namespace.
    pub fn agent_metric(&self, name: &str) -> Option<f64> {
        crate::netns::agent_metrics(&self.link.pair.agent, AGENT_HEALTH, self._dir.path())
            .and_then(|m| otter_agent::gauges::sample(&m, name))
    }

    /// Like [`Scene::start`], the hub serving each of `transports` and
    /// the agent trying them in that order.
    pub fn start_on(transports: &[&str], link: WanLink) -> Result<Scene, String> {
        use crate::{
            netns::{agent_args, agent_metrics, hub_args, prepare_hub, start_kube_sim},
            procs::{Proc, Role},
        };
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let d = dir.path();
        let data = d.join("hub");
        std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
        let admin = prepare_hub(&data, &d.join("token"), CLUSTER);
        let ca_file = data.join("ca.crt");
        let ca = ca_file.display().to_string();
        let api = format!("https://{HUB_IP}:8443");
        let (hub_ns, agent_ns) = (link.pair.hub.clone(), link.pair.agent.clone());
        let mut procs = Vec::new();
        let mut sim = start_kube_sim(d, &agent_ns)?;
        sim.send(&format!("source {SOURCE}"));
        sim.send(&format!("sink {SINK}"));
        procs.push(sim);
        let more: Vec<String> = transports[1..]
            .iter()
            .flat_map(|t| ["--tunnel-url".to_owned(), format!("{t}://{HUB_IP}:8444")])
            .collect();
        let more: Vec<&str> = more.iter().map(String::as_str).collect();
        let transport = transports.join(",");
        let transport = transport.as_str();
        procs.push(Proc::start(
            "hub",
            Role::Otter,
            &hub_args(&data, transports[0], &more),
            d,
            Some(&hub_ns),
        ));
        procs.push(Proc::start(
            "agent",
            Role::Agent,
            &agent_args(&api, &ca, d, transport, 10, AGENT_HEALTH, &[]),
            d,
            Some(&agent_ns),
        ));
        let started = Instant::now();
        loop {
            let up = agent_metrics(&agent_ns, AGENT_HEALTH, d)
                .and_then(|m| otter_agent::gauges::sample(&m, "otter_agent_tunnel_up"));
            if up == Some(1.0) {
                break;
            }
            if started.elapsed() > WAIT {
                return Err(format!(
                    "the {transport} tunnel did not come up across the link:\n{}",
                    procs
                        .iter()
                        .map(|p| p.tail(10))
                        .collect::<Vec<_>>()
                        .join("\n")
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(Scene {
            ca_pem: std::fs::read_to_string(&ca_file).map_err(|e| e.to_string())?,
            link,
            _dir: dir,
            admin,
            _procs: procs,
        })
    }
}
