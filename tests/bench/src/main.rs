//! `make bench`: tunnel throughput, call latency, head-of-line isolation,
//! hub memory per agent, reconnect storm and footprint, each reported as a
//! ratio against a baseline measured in the same invocation.
//!
//! Every scenario appends its figures (one JSON object per line) to a
//! samples file; `report` turns that into the table and `results.json`.
//!
//! ```text
//! otter-bench throughput SAMPLES SECS RUNS [RATHOLE_BIN]
//! otter-bench calls      SAMPLES CALLS HOL_CALLS RUNS
//! otter-bench scale      SAMPLES N IDLE_SECS
//! otter-bench footprint  SAMPLES RUNS [AGENT_BIN]
//! otter-bench report     SAMPLES RESULTS_JSON
//! otter-bench skip       SAMPLES NAME MESSAGE
//! ```

mod calls;
mod common;
mod portforward;
mod replicas;
mod scale;
mod throughput;
mod wan;

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, bail};
use common::{Figure, Figures, median};

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> anyhow::Result<T> {
    args.get(i)
        .with_context(|| format!("missing {what}"))?
        .parse()
        .map_err(|_| anyhow::anyhow!("bad {what}: {:?}", args[i]))
}

fn tokio_rt() -> anyhow::Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    // BENCH_WORKERS=N: N runtime threads per process (hub children
    // included) instead of one per core, to see what hand-offs between
    // threads cost a call.
    if let Some(n) = std::env::var("BENCH_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        b.worker_threads(n);
    }
    Ok(b.enable_all().build()?)
}

fn main() -> anyhow::Result<()> {
    // The heap as the binaries keep it (the hub and agents run in here).
    otter_tunnel::heap::keep_freed_memory();
    // The hub, agent and test server of the `wan` scenario are this binary
    // started again in a network namespace (see otter_e2e::procs).
    if std::env::var_os(otter_e2e::procs::ROLE_ENV).is_some() {
        otter_e2e::procs::child_main();
    }
    // Warnings only unless asked (OTTER_LOG=info shows tunnels going up and
    // down, and why). A subscriber is always installed, as the binaries
    // install one: without it every span of the call path would go through
    // tracing's `log` fallback, a cost the product does not pay.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(otter_tunnel::logging::filter("warn"))
        .with_writer(std::io::stderr)
        .try_init();
    // Before any QUIC endpoint: this process makes one per simulated agent.
    let _offload_keys = common::hold_udp_offload_keys();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = args.first().map(String::as_str).unwrap_or("");
    let samples = || -> anyhow::Result<PathBuf> { arg(&args, 1, "samples file") };
    let figs = match cmd {
        "throughput" => {
            let secs: u64 = arg(&args, 2, "seconds")?;
            let runs = arg(&args, 3, "runs")?;
            let rathole = args.get(4).filter(|s| !s.is_empty()).map(PathBuf::from);
            throughput::run(Duration::from_secs(secs), runs, rathole)?
        }
        "calls" => {
            let (calls, hol, runs) = (
                arg(&args, 2, "calls")?,
                arg(&args, 3, "head-of-line calls")?,
                arg(&args, 4, "runs")?,
            );
            tokio_rt()?.block_on(calls::run(calls, hol, runs))?
        }
        "portforward" => {
            let (mib, runs) = (arg(&args, 2, "MiB")?, arg(&args, 3, "runs")?);
            tokio_rt()?.block_on(portforward::run(mib, runs))?
        }
        "scale" => {
            let (n, idle) = (arg(&args, 2, "agents")?, arg(&args, 3, "idle seconds")?);
            tokio_rt()?.block_on(scale::run(n, idle))?
        }
        "replicas" => {
            let (calls, agents, idle) = (
                arg(&args, 2, "calls")?,
                arg(&args, 3, "idle agents")?,
                arg::<u64>(&args, 4, "idle seconds")?,
            );
            tokio_rt()?.block_on(replicas::run(calls, agents, Duration::from_secs(idle)))?
        }
        "wan" => {
            let secs = arg(&args, 2, "seconds per transfer")?;
            let losses: Vec<f64> = arg::<String>(&args, 3, "loss percentages")?
                .split(',')
                .map(|p| p.parse::<f64>().map(|p| p / 100.0))
                .collect::<Result<_, _>>()?;
            wan::run(secs, &losses)?
        }
        "footprint" => {
            let runs = arg(&args, 2, "runs")?;
            let bin = args.get(3).filter(|s| !s.is_empty()).map(PathBuf::from);
            tokio_rt()?.block_on(scale::footprint(bin, runs))?
        }
        "skip" => {
            let mut f = Figures::default();
            f.push(Figure::skipped(
                arg::<String>(&args, 2, "name")?,
                arg::<String>(&args, 3, "message")?,
            ));
            f
        }
        "hub-child" => {
            let replica = match args.get(5) {
                Some(store) => Some(scale::ReplicaOf {
                    store: store.clone(),
                    key_file: arg(&args, 6, "store key file")?,
                    name: arg(&args, 7, "replica name")?,
                }),
                None => None,
            };
            return tokio_rt()?.block_on(scale::hub_child(
                arg(&args, 1, "dir")?,
                arg(&args, 2, "api port")?,
                arg(&args, 3, "tunnel port")?,
                arg(&args, 4, "clusters")?,
                replica,
            ));
        }
        "agent-child" => {
            return tokio_rt()?.block_on(scale::agent_child(
                arg(&args, 1, "api port")?,
                arg(&args, 2, "CA file")?,
                arg(&args, 3, "cluster")?,
                arg(&args, 4, "token")?,
            ));
        }
        "report" => return report(samples()?, arg(&args, 2, "results file")?),
        _ => bail!(
            "usage: otter-bench throughput|calls|portforward|wan|scale|footprint|replicas|report|skip ... (see the source)"
        ),
    };
    figs.append_to(&samples()?)
}

/// Merges the samples file into one object per figure, prints the table
/// and writes `results`.
fn report(samples: PathBuf, results: PathBuf) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&samples).unwrap_or_default();
    let mut merged = Figures::default();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Figure = serde_json::from_str(line)?;
        match merged.0.iter_mut().find(|m| m.name == f.name) {
            Some(m) => {
                m.samples.extend(f.samples);
                if m.note.is_none() {
                    m.note = f.note;
                }
            }
            None => merged.push(f),
        }
    }
    let medians: std::collections::HashMap<String, f64> = merged
        .0
        .iter()
        .filter(|f| !f.samples.is_empty())
        .map(|f| (f.name.clone(), median(&f.samples)))
        .collect();
    let mut out = Vec::new();
    println!(
        "{:<40} {:>12} {:>10} {:>10} {:>10} {:>4}  {:<28} {:>7}",
        "figure", "unit", "median", "min", "max", "runs", "baseline", "ratio"
    );
    for f in &merged.0 {
        if let Some(why) = &f.skipped {
            println!("{:<40} skipped: {why}", f.name);
            out.push(serde_json::json!({"name": f.name, "skipped": why}));
            continue;
        }
        let med = median(&f.samples);
        let min = f.samples.iter().copied().fold(f64::INFINITY, f64::min);
        let max = f.samples.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let ratio = f
            .baseline
            .as_ref()
            .and_then(|b| medians.get(b))
            .filter(|b| **b != 0.0)
            .map(|b| med / b);
        println!(
            "{:<40} {:>12} {:>10.3} {:>10.3} {:>10.3} {:>4}  {:<28} {:>7}",
            f.name,
            f.unit,
            med,
            min,
            max,
            f.samples.len(),
            f.baseline.as_deref().unwrap_or("-"),
            ratio
                .map(|r| format!("{r:.2}"))
                .unwrap_or_else(|| "-".into()),
        );
        out.push(serde_json::json!({
            "name": f.name,
            "unit": f.unit,
            "median": med,
            "min": min,
            "max": max,
            "runs": f.samples.len(),
            "baseline": f.baseline,
            "ratio": ratio,
            "note": f.note,
        }));
    }
    for f in merged
        .0
        .iter()
        .filter(|f| f.note.is_some() && f.skipped.is_none())
    {
        println!("  note {}: {}", f.name, f.note.as_deref().unwrap_or(""));
    }
    if let Some(dir) = results.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&results, serde_json::to_string_pretty(&out)?)?;
    println!("results: {}", results.display());
    Ok(())
}
