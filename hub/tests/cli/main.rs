//! The `otter` binary end to end, as one test binary (here, in the hub's
//! own package, so cargo builds the binary for it): the CLI against a hub,
//! against a cluster path, and plain kubectl through the hub.

mod binary;
mod cli_cluster;
mod cli_fleet;
mod kubectl_proxy;
mod reach;

/// The `otter` binary cargo built for these tests.
fn otter() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_otter"))
}
