//! The end-to-end suite as one test binary: hub, agents and clients
//! together on loopback, one module per area. One binary links the
//! dependency tree once instead of once per file, which was most of
//! `make test`'s build time on two cores.
//!
//! Kept apart, as binaries of their own, are the tests that measure or
//! strain this very process (its RSS, tasks and descriptors, its umask,
//! its open-file limit): `leaks.rs`, `leaks_runtime.rs`, `store_perms.rs`,
//! `hostile_ports.rs`.

mod agent_manifest;
mod agent_resource;
mod agent_runtime;
mod ca_rotation;
mod cli_help;
mod clock_skew;
mod crash;
mod crds;
mod dead_callers;
mod doctor;
mod egress_netns;
mod egress_proxy;
mod etcd_quorum;
mod fleet_fanout;
mod hostile_api;
mod hostile_enrollment;
mod hostile_frames;
mod hostile_identity;
mod hostile_json;
mod hostile_lookups;
mod hostile_readers;
mod hostile_tunnel;
mod hub_api;
mod hub_resume;
mod link_core;
mod link_faults;
mod net_cut;
mod oidc;
mod paced_reconnects;
mod rancher;
mod real_clients;
mod replicas;
mod schemathesis;
mod show_chart;
mod slow_consumer;
mod tenancy;
mod tenancy_processes;
mod wan_link;
mod watch_resume;

/// The entry point through which the tests that need separate processes
/// (a hub or an agent to kill, a network namespace) re-run this binary as
/// that process: `otter_e2e::procs::Proc` starts it with `child_process
/// --exact --ignored`.
#[test]
#[ignore = "entry point of the processes the tests start"]
fn child_process() {
    otter_e2e::procs::child_main();
}
