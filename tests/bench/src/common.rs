//! Shared pieces: figures and where they go, percentiles, and resource
//! usage read from /proc.

use std::{io::Write, path::Path, time::Duration};

use serde::{Deserialize, Serialize};

/// One measured figure: the samples of every run, or why it was skipped.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Figure {
    pub name: String,
    pub unit: String,
    #[serde(default)]
    pub samples: Vec<f64>,
    /// Name of the figure this one is compared with (ratio = median / its median).
    #[serde(default)]
    pub baseline: Option<String>,
    #[serde(default)]
    pub note: Option<String>,
    #[serde(default)]
    pub skipped: Option<String>,
}

impl Figure {
    pub fn new(name: impl Into<String>, unit: &str, baseline: Option<&str>) -> Self {
        Self {
            name: name.into(),
            unit: unit.to_owned(),
            samples: Vec::new(),
            baseline: baseline.map(str::to_owned),
            note: None,
            skipped: None,
        }
    }

    pub fn skipped(name: impl Into<String>, why: impl Into<String>) -> Self {
        let mut f = Self::new(name, "", None);
        f.skipped = Some(why.into());
        f
    }
}

/// Collects figures by name, keeping the order they first appeared in.
#[derive(Debug, Default)]
pub struct Figures(pub Vec<Figure>);

impl Figures {
    /// Adds one sample to `name`, creating the figure on first use.
    pub fn add(&mut self, name: &str, unit: &str, baseline: Option<&str>, value: f64) {
        if let Some(f) = self.0.iter_mut().find(|f| f.name == name) {
            f.samples.push(value);
        } else {
            let mut f = Figure::new(name, unit, baseline);
            f.samples.push(value);
            self.0.push(f);
        }
    }

    pub fn note(&mut self, name: &str, note: &str) {
        if let Some(f) = self.0.iter_mut().find(|f| f.name == name) {
            f.note = Some(note.to_owned());
        }
    }

    pub fn push(&mut self, f: Figure) {
        self.0.push(f);
    }

    /// Appends every figure as one JSON line to `path`.
    pub fn append_to(&self, path: &Path) -> anyhow::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        for f in &self.0 {
            writeln!(file, "{}", serde_json::to_string(f)?)?;
        }
        Ok(())
    }
}

/// Median of `v` (sorted copy); 0 for no samples.
pub fn median(v: &[f64]) -> f64 {
    percentile_of(v, 50.0)
}

/// Percentile by nearest rank over a copy of `v`.
pub fn percentile_of(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    percentile_sorted(&s, p)
}

pub fn percentile_sorted(s: &[f64], p: f64) -> f64 {
    if s.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// Bound of one measured call.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Two calls alternating, `warmup` pairs and then `n` measured: the two
/// halves of each pair are taken at the same moment of a noisy machine,
/// and every other pair runs them in the other order, so neither half
/// always finds the caches the other one warmed.
pub async fn alternating<A, FA, B, FB>(
    warmup: usize,
    n: usize,
    mut a: A,
    mut b: B,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)>
where
    A: FnMut() -> FA,
    FA: std::future::Future<Output = anyhow::Result<()>>,
    B: FnMut() -> FB,
    FB: std::future::Future<Output = anyhow::Result<()>>,
{
    let (mut at, mut bt) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..warmup + n {
        let (mut ta, mut tb) = (Duration::ZERO, Duration::ZERO);
        for first in [i % 2 == 0, i % 2 == 1] {
            let t = std::time::Instant::now();
            if first {
                tokio::time::timeout(CALL_TIMEOUT, a()).await??;
                ta = t.elapsed();
            } else {
                tokio::time::timeout(CALL_TIMEOUT, b()).await??;
                tb = t.elapsed();
            }
        }
        if i >= warmup {
            at.push(ta);
            bt.push(tb);
        }
    }
    Ok((at, bt))
}

/// Latency percentiles (µs) of one series of calls.
#[derive(Debug, Clone, Copy)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Latency {
    pub fn of(durations: &[Duration]) -> Self {
        Self::of_micros(durations.iter().map(|d| d.as_secs_f64() * 1e6).collect())
    }

    /// What each call of `b` took over the call of `a` made beside it
    /// (pairs taken at the same moment, so the machine's drift between
    /// series does not enter the figure).
    pub fn added(a: &[Duration], b: &[Duration]) -> Self {
        let us = |d: &Duration| d.as_secs_f64() * 1e6;
        Self::of_micros(a.iter().zip(b).map(|(a, b)| us(b) - us(a)).collect())
    }

    fn of_micros(mut us: Vec<f64>) -> Self {
        us.sort_by(f64::total_cmp);
        Self {
            p50: percentile_sorted(&us, 50.0),
            p90: percentile_sorted(&us, 90.0),
            p99: percentile_sorted(&us, 99.0),
            max: us.last().copied().unwrap_or(0.0),
        }
    }
}

// ------------------------------------------------------------------ /proc

/// Clock ticks per second of /proc CPU times (USER_HZ, 100 on Linux).
const TICKS: f64 = 100.0;

/// A field of /proc/PID/status in KiB (VmRSS, VmHWM).
pub fn status_kib(pid: &str, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

pub fn rss_kib(pid: &str) -> Option<u64> {
    status_kib(pid, "VmRSS:")
}

/// UDP sockets with receive offload on, one per address family, held for
/// the process's life.
///
/// Every QUIC endpoint quinn makes first probes the kernel with two
/// throwaway IPv6 sockets, one of them with UDP receive offload on. The
/// kernel counts the sockets that have it on with a static key, and
/// patches its own code (stopping every CPU) each time that count leaves
/// or reaches zero. An agent makes one endpoint in its life, on its own
/// machine; this process makes one per simulated agent, so each probe
/// paid two patches: a quarter of the simulated agents' CPU in a first
/// connect of 10,000, and interrupts on the hub's cores. With these sockets
/// open the count never reaches zero and a probe costs what it costs an
/// agent.
pub fn hold_udp_offload_keys() -> Vec<std::net::UdpSocket> {
    ["[::1]:0", "127.0.0.1:0"]
        .into_iter()
        .filter_map(|addr| std::net::UdpSocket::bind(addr).ok())
        .filter(|socket| quinn::udp::UdpSocketState::new(socket.into()).is_ok())
        .collect()
}

/// (command name, user + system CPU seconds) of a /proc stat file.
fn parse_stat(text: &str) -> Option<(String, f64)> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text[open + 1..close].to_owned();
    // Fields after the name: state is field 3; utime and stime are 14 and 15.
    let rest: Vec<&str> = text[close + 2..].split_whitespace().collect();
    let utime: f64 = rest.get(11)?.parse().ok()?;
    let stime: f64 = rest.get(12)?.parse().ok()?;
    Some((comm, (utime + stime) / TICKS))
}

/// Packets this machine has sent so far: UDP datagrams (a segmentation
/// offload send counts once) and TCP segments, from `/proc/net/snmp`.
pub fn packets_sent() -> Option<(u64, u64)> {
    let snmp = std::fs::read_to_string("/proc/net/snmp").ok()?;
    let field = |proto: &str, name: &str| -> Option<u64> {
        let mut lines = snmp.lines().filter(|l| l.starts_with(proto));
        let (names, values) = (lines.next()?, lines.next()?);
        let i = names.split_whitespace().position(|n| n == name)?;
        values.split_whitespace().nth(i)?.parse().ok()
    };
    Some((field("Udp:", "OutDatagrams")?, field("Tcp:", "OutSegs")?))
}

/// CPU seconds used by process `pid` so far.
pub fn cpu_secs(pid: &str) -> Option<f64> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?).map(|(_, s)| s)
}

/// How often this process's threads have gone to sleep so far (voluntary
/// context switches, summed over threads): each is a runtime worker with
/// nothing left to run, parked until a socket or another thread wakes it,
/// so per call it counts the hand-offs that cost a wake-up.
pub fn thread_sleeps() -> Option<u64> {
    let dir = std::fs::read_dir("/proc/self/task").ok()?;
    let mut total = 0;
    for task in dir.flatten() {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue; // a thread that ended meanwhile
        };
        total += voluntary_switches(&status)?;
    }
    Some(total)
}

fn voluntary_switches(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
        .trim()
        .parse()
        .ok()
}

/// CPU seconds used so far by this process's threads whose name starts
/// with `prefix` (runtimes are named per role so roles can be told apart).
pub fn thread_cpu_secs(prefix: &str) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|t| parse_stat(&t))
        .filter(|(comm, _)| comm.starts_with(prefix))
        .map(|(_, s)| s)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_line_with_spaces_in_the_name() {
        let line = "42 (a b) S 1 2 3 4 5 6 7 8 9 10 150 50 0 0";
        let (comm, secs) = parse_stat(line).unwrap();
        assert_eq!(comm, "a b");
        assert!((secs - 2.0).abs() < 1e-9);
    }

    #[test]
    fn voluntary_switches_of_a_status_file() {
        let status = "Name:\tw\nvoluntary_ctxt_switches:\t1234\nnonvoluntary_ctxt_switches:\t7\n";
        assert_eq!(voluntary_switches(status), Some(1234));
        assert_eq!(voluntary_switches("Name:\tw\n"), None);
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile_of(&v, 50.0), 50.0);
        assert_eq!(percentile_of(&v, 99.0), 99.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    }
}
