//! `otter`: the hub (`otter hub`) and the command line for it.

use clap::Parser;

#[tokio::main]
async fn main() {
    let cli = otter_hub::cli::Cli::parse();
    otter_tunnel::heap::keep_freed_memory();
    otter_tunnel::logging::init(cli.log_format);
    std::process::exit(otter_hub::cli::run(cli).await);
}
