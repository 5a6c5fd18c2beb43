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
    /// Serve a TCP echo on a pod's port, for port-forward demos: NAMESPACE/POD:PORT. Repeatable.
    #[arg(long = "echo", value_name = "NAMESPACE/POD:PORT")]
    echoes: Vec<String>,
}

/// A loopback TCP echo server; returns its address.
async fn echo_server() -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = tcp.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    Ok(addr)
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
    for e in &args.echoes {
        let parsed = e.split_once('/').and_then(|(ns, rest)| {
            let (pod, port) = rest.split_once(':')?;
            Some((ns, pod, port.parse::<u16>().ok()?))
        });
        let Some((ns, pod, port)) = parsed else {
            eprintln!("kube-sim: bad --echo {e:?}: want NAMESPACE/POD:PORT");
            return ExitCode::from(64);
        };
        match echo_server().await {
            Ok(addr) => sim.add_pod_port(ns, pod, port, addr),
            Err(err) => {
                eprintln!("kube-sim: echo server: {err}");
                return ExitCode::from(1);
            }
        }
    }
    println!("{}", sim.url());
    let _ = tokio::signal::ctrl_c().await;
    sim.shutdown().await;
    ExitCode::SUCCESS
}
