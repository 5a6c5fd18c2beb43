//! `kube-sim`: runs the Kubernetes API test server until Ctrl-C, for demos and manual use.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::Parser;
use kube_sim::{KubeSim, SimConfig};

/// A Kubernetes API test server on loopback.
#[derive(Debug, Parser)]
#[command(name = "kube-sim", version)]
struct Args {
    /// Loopback address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// A user: NAME=TOKEN, optionally NAME=TOKEN:group1,group2. Repeatable. The first one
    /// given is an admin (group system:masters) unless it lists groups of its own.
    #[arg(long = "token", value_name = "NAME=TOKEN[:groups]")]
    tokens: Vec<String>,
    /// Write a kubeconfig for the first user here.
    #[arg(long, value_name = "PATH")]
    write_kubeconfig: Option<std::path::PathBuf>,
    /// Cluster (and context) name used in the kubeconfig.
    #[arg(long, default_value = "kube-sim")]
    simulated_cluster_name: String,
}

fn parse_token(s: &str) -> Option<(String, String, Vec<String>)> {
    let (name, rest) = s.split_once('=')?;
    let (token, groups) = match rest.split_once(':') {
        Some((t, g)) => (
            t,
            g.split(',')
                .filter(|g| !g.is_empty())
                .map(String::from)
                .collect(),
        ),
        None => (rest, Vec::new()),
    };
    (!name.is_empty() && !token.is_empty()).then(|| (name.to_string(), token.to_string(), groups))
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let mut cfg = SimConfig::default()
        .listen(args.listen)
        .cluster_name(&args.simulated_cluster_name)
        .demo_objects(true);
    cfg = cfg.allow("group:system:masters", &["*"], &["*"], &["*"]);
    let mut first_token = None;
    let tokens = if args.tokens.is_empty() {
        vec![format!("admin={}", kube_sim::ADMIN_TOKEN)]
    } else {
        args.tokens.clone()
    };
    for (i, t) in tokens.iter().enumerate() {
        let Some((name, token, mut groups)) = parse_token(t) else {
            eprintln!("kube-sim: bad --token {t:?}: want NAME=TOKEN[:group,...]");
            return ExitCode::from(64);
        };
        if i == 0 && groups.is_empty() {
            groups.push("system:masters".into());
        }
        let g: Vec<&str> = groups.iter().map(String::as_str).collect();
        cfg = cfg.user(&token, &name, &g);
        first_token.get_or_insert(token);
    }
    let sim = match KubeSim::start(cfg).await {
        Ok(s) => s,
        Err(e @ kube_sim::Error::Config(_)) => {
            eprintln!("kube-sim: {e}");
            return ExitCode::from(64);
        }
        Err(e) => {
            eprintln!("kube-sim: {e}");
            return ExitCode::from(1);
        }
    };
    if let (Some(path), Some(token)) = (&args.write_kubeconfig, &first_token)
        && let Err(e) = std::fs::write(path, sim.kubeconfig_yaml(token))
    {
        eprintln!("kube-sim: writing {}: {e}", path.display());
        return ExitCode::from(1);
    }
    println!("{}", sim.url());
    let _ = tokio::signal::ctrl_c().await;
    sim.shutdown().await;
    ExitCode::SUCCESS
}
