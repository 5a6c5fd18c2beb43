//! `otter-agent`: runs in a member cluster and dials out to the hub.

use clap::Parser;

#[tokio::main]
async fn main() {
    let cli = otter_agent::cli::Cli::parse();
    otter_tunnel::heap::keep_freed_memory();
    otter_tunnel::logging::init(cli.log_format);
    std::process::exit(otter_agent::cli::run(cli).await);
}
