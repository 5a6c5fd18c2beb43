#!/usr/bin/env bash
# `make demo HA=1`: three hub replicas sharing one store on a 3-member etcd,
# all on loopback. Two simulated clusters (Kubernetes API test servers, no
# real kubelet) join through different replicas; a call goes through each
# replica to each cluster; then the replica holding edge-1's tunnel is
# killed (SIGKILL) and its agent comes back through another replica, with no
# load balancer in front: the hub told it every replica's tunnel URLs.
# Keeps running until Ctrl-C, cleaning up everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh apt >/dev/null # etcd (Debian's etcd-server)
. scripts/demo-common.sh

free_port() {
    .venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

echo "== etcd: three members on loopback"
members=()
cluster_arg=""
for i in 0 1 2; do
    members+=("$(free_port) $(free_port)")
done
for i in 0 1 2; do
    read -r _ peer <<<"${members[$i]}"
    cluster_arg+="${cluster_arg:+,}m$i=http://127.0.0.1:$peer"
done
endpoints=""
for i in 0 1 2; do
    read -r client peer <<<"${members[$i]}"
    endpoints+="${endpoints:+,}127.0.0.1:$client"
    etcd --name "m$i" --data-dir "$demo/etcd-$i" \
        --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
        --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
        --initial-cluster "$cluster_arg" >"$demo/etcd-$i.log" 2>&1 &
    pids+=($!)
done
for i in 0 1 2; do
    read -r client _ <<<"${members[$i]}"
    for _ in $(seq 1 100); do
        curl -fsS "http://127.0.0.1:$client/health" 2>/dev/null | grep -q '"health":"true"' && break
        sleep 0.2
    done
done
echo "   etcd://$endpoints"

echo "== three hub replicas on it (the store sealed with one key)"
.venv/bin/python -c 'import secrets; print(secrets.token_hex(32))' >"$demo/store.key"
hub_pids=()
api=()
for i in 0 1 2; do
    "$bin/otter" hub --data-dir "$demo/hub-$i" --listen 127.0.0.1:0 --tunnel-listen 127.0.0.1:0 \
        --store "etcd://$endpoints" --store-key-file "$demo/store.key" \
        --replica-name "r$i" --peer-listen 127.0.0.1:0 >"$demo/hub-$i.log" 2>&1 &
    hub_pids+=($!)
    pids+=($!)
done
for i in 0 1 2; do
    wait_for "$demo/hub-$i.log" "hub API on" 30
    api+=("https://localhost:$(sed -n 's/.*hub API on https:\/\/[^:]*:\([0-9]*\).*/\1/p' "$demo/hub-$i.log" | head -1)")
    echo "   r$i: API ${api[$i]}"
done
# One replica won the race to mint the first admin token; all share the CA.
token_file=$(ls "$demo"/hub-*/admin-token | head -1)
export OTTER_CONFIG="$demo/otter.toml"
"$bin/otter" login --hub "${api[0]}" --token-file "$token_file" --ca-file "$demo/hub-0/ca.crt" >/dev/null
token=$(cat "$token_file")
via() { # replica, then the otter command line
    local r=$1
    shift
    "$bin/otter" "$@" --hub "${api[$r]}" --token "$token" --ca-file "$demo/hub-0/ca.crt"
}

# edge-1 joins through r0, edge-2 through r1; each agent is given every
# replica's API URL, its own first.
join() { # cluster, replica
    local cluster=$1 r=$2
    echo "== $cluster: a simulated cluster, joined through r$r"
    "$bin/kube-sim" --simulated-cluster-name "$cluster" --write-kubeconfig "$demo/$cluster.kubeconfig" \
        >"$demo/$cluster.sim" 2>"$demo/$cluster.sim.log" &
    pids+=($!)
    wait_for "$demo/$cluster.sim" "https://" 30
    mkdir -p "$demo/$cluster-join"
    apply_manifest "$(via "$r" agent-manifest --cluster "$cluster")" "$demo/hub-0/ca.crt" \
        "$demo/$cluster.kubeconfig" "$demo/$cluster-join"
    join_files "$demo/$cluster-join"
    local urls="${api[$r]}"
    for i in 0 1 2; do [ "$i" = "$r" ] || urls+=",${api[$i]}"; done
    KUBECONFIG="$demo/$cluster.kubeconfig" "$bin/otter-agent" --hub-url "$urls" --cluster "$cluster" \
        --agent-id "$cluster-agent" --hub-ca-file "$demo/$cluster-join/hub-ca.crt" \
        --join-token-file "$demo/$cluster-join/join-token" --state-dir "$demo/$cluster-state" \
        --keepalive-secs 1 >"$demo/$cluster-agent.log" 2>&1 &
    pids+=($!)
}
join edge-1 0
join edge-2 1

echo "== waiting for both tunnels"
for _ in $(seq 1 100); do
    [ "$(via 2 links -o json | grep -c '"connected"')" = 2 ] && break
    sleep 0.2
done
holder() { # cluster: the replica whose log shows its latest tunnel
    grep -l "tunnel up.*cluster=$1" "$demo"/hub-*.log 2>/dev/null |
        while read -r f; do echo "$(grep "tunnel up.*cluster=$1" "$f" | tail -1 | cut -c1-30) $f"; done |
        sort | tail -1 | sed 's/.*hub-\([0-9]\).log/r\1/'
}
echo "   edge-1's tunnel is on $(holder edge-1), edge-2's on $(holder edge-2)"

echo
echo "== a call through each replica to each cluster (forwarded to the holder when needed)"
for r in 0 1 2; do
    for cluster in edge-1 edge-2; do
        n=$(via "$r" get pods -A -c "$cluster" | tail -n +2 | wc -l)
        echo "   through r$r to $cluster: $n pods"
    done
done

echo
victim=$(holder edge-1)
echo "== kill -9 $victim, which holds edge-1's tunnel"
kill -9 "${hub_pids[${victim#r}]}"
started=$(date +%s%N)
survivor=0
[ "$victim" = r0 ] && survivor=1
for _ in $(seq 1 300); do
    if via "$survivor" get pods -A --cluster edge-1 >/dev/null 2>&1; then
        break
    fi
    sleep 0.1
done
took_ms=$((($(date +%s%N) - started) / 1000000))
echo "   edge-1 answers again through r$survivor $took_ms ms after the kill; its tunnel is now on $(holder edge-1)"
via "$survivor" links

cat <<EOF2

== the HA demo is running; try it yourself (Ctrl-C stops everything):
   export OTTER_CONFIG=$OTTER_CONFIG
   $bin/otter links --hub ${api[$survivor]}
   $bin/otter get pods -A --cluster edge-2 --hub ${api[2]}
   hub logs: $demo/hub-*.log   agent logs: $demo/edge-*-agent.log   etcd logs: $demo/etcd-*.log
EOF2
# `wait` (unlike a foreground sleep) returns at once on a signal the script
# traps, so a SIGINT or SIGTERM to this script alone stops the demo too.
while true; do sleep 3600 & pids+=("$!"); wait "$!"; done
