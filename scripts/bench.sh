#!/usr/bin/env bash
# `make bench`: tunnel throughput, call latency, head-of-line isolation, hub
# memory per agent, reconnect storm, footprint and replicas on etcd, side by side with direct
# loopback and with rathole. Everything runs on 127.0.0.1 and every scenario
# is bounded in time. Figures are reported with median, min and max over
# several runs and as ratios to a baseline measured in the same run; nothing
# is asserted.
#
#   QUICK=1  short runs, 200 simulated agents (for development, about 3 min)
#   FULL=1   10,000 simulated agents (also 10,000 idle agents on the replicas)
#
# The wan scenario puts hub and agent in network namespaces of their own
# joined by an emulated distant link (100 ms round trip, 0/1/5 % loss).
#
# Output: a table on stdout and target/bench/results.json.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CARGO_TARGET_DIR:=$HOME/.cache/otterscale-link/target}"
export CARGO_TARGET_DIR
QUICK=${QUICK:-}
FULL=${FULL:-}

if [ -n "$QUICK" ]; then
    tp_secs=3 tp_runs=2 calls=2000 hol_calls=500 call_runs=2 agents=200 idle=5 fp_runs=2 pf_mib=32 pf_runs=2 replica_agents=100 wan_secs=3
else
    tp_secs=10 tp_runs=3 calls=10000 hol_calls=2000 call_runs=3 agents=1000 idle=10 fp_runs=3 pf_mib=128 pf_runs=3 replica_agents=1000 wan_secs=8
fi
replica_limit=600
if [ -n "$FULL" ]; then
    agents=10000 replica_agents=10000 replica_limit=1500
fi

# Many tunnels need many file descriptors.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

echo "== building release binaries"
scripts/setup.sh build >/dev/null
cargo build -q --release -p otter-bench -p otter-agent
bench="$CARGO_TARGET_DIR/release/otter-bench"
agent_bin="$CARGO_TARGET_DIR/release/otter-agent"

# rathole, for comparison: installed once into a cache outside the repo.
# (`--locked` does not build with the current compiler.)
tools="$HOME/.cache/otterscale-link/tools"
rathole="$tools/bin/rathole"
if [ ! -x "$rathole" ]; then
    echo "== installing rathole into $tools (first time: a few minutes)"
    mkdir -p "$tools"
    if ! timeout 1200 cargo install -q rathole --root "$tools"; then
        echo "rathole: install failed; the rathole rows are skipped"
    fi
fi
[ -x "$rathole" ] || rathole=""
if [ -n "$rathole" ] && ! command -v openssl >/dev/null; then
    echo "rathole TLS needs the openssl CLI for its PKCS#12 identity; that row is skipped"
fi

out=target/bench
samples="$out/samples.jsonl"
mkdir -p "$out"
rm -f "$samples" "$out/results.json"

# Runs one scenario, bounded; a failure is reported and the rest go on.
scenario() {
    local limit=$1 name=$2
    shift 2
    echo "== $name"
    if ! timeout "$limit" "$bench" "$@"; then
        echo "$name: failed or timed out (see above); its figures are missing"
        "$bench" skip "$samples" "$name" "failed or timed out in this run"
    fi
}

scenario 600 throughput throughput "$samples" "$tp_secs" "$tp_runs" "$rathole"
# Three runs of 10,000 Gets per path take 5-7 minutes on a slow day.
scenario 900 calls calls "$samples" "$calls" "$hol_calls" "$call_runs"
scenario 600 portforward portforward "$samples" "$pf_mib" "$pf_runs"
# Needs root (network namespaces, TUN devices); says so and is skipped without.
scenario 900 wan wan "$samples" "$wan_secs" 0,1,5
scenario 900 scale scale "$samples" "$agents" "$idle"
scenario 120 footprint footprint "$samples" "$fp_runs" "$agent_bin"
scenario "$replica_limit" replicas replicas "$samples" "$calls" "$replica_agents" "$idle"

echo
echo "== results ($(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
"$bench" report "$samples" "$out/results.json"
