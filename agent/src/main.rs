//! `otter-agent`: runs in a member cluster and dials out to the hub.

use clap::Parser;

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("OTTER_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: log collectors (`kubectl logs`, files)
        // would keep the escape codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = otter_agent::cli::Cli::parse();
    std::process::exit(otter_agent::cli::run(cli).await);
}
