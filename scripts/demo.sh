#!/usr/bin/env bash
# `make demo`: the main job on the embedded default, on loopback.
#
# Starts a hub (sled data dir), two Kubernetes API test servers standing in
# for member clusters edge-1 and edge-2 (SIMULATED: no real kubelet behind
# them), and joins one agent to each the real way: manifest URL -> join token
# -> Register -> tunnel. Then shows links, pods, an exec and a port-forward
# round trip, a second tenant that sees none of it, and keeps running until
# Ctrl-C, cleaning up everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/demo-common.sh

echo "== starting the hub (data in $demo/hub)"
"$bin/otter" hub --data-dir "$demo/hub" --listen 127.0.0.1:0 --tunnel-listen 127.0.0.1:0 >"$demo/hub.log" 2>&1 &
pids+=($!)
wait_for "$demo/hub.log" "hub API on" 30
api_port=$(sed -n 's/.*hub API on https:\/\/[^:]*:\([0-9]*\).*/\1/p' "$demo/hub.log" | head -1)
hub_url="https://localhost:$api_port"
export OTTER_CONFIG="$demo/otter.toml"
"$bin/otter" login --hub "$hub_url" --token-file "$demo/hub/admin-token" --ca-file "$demo/hub/ca.crt"

kubectl_133=$(dpkg -L kubectl 2>/dev/null | grep 'kubectl.1.33$' | head -1 || true)
for cluster in edge-1 edge-2; do
    echo "== $cluster: Kubernetes API test server (simulated cluster)"
    "$bin/kube-sim" --simulated-cluster-name "$cluster" --write-kubeconfig "$demo/$cluster.kubeconfig" \
        --echo default/web-0:80 >"$demo/$cluster.sim" 2>"$demo/$cluster.sim.log" &
    pids+=($!)
    wait_for "$demo/$cluster.sim" "https://" 30
    url=$("$bin/otter" agent-manifest --cluster "$cluster")
    echo "   manifest URL: ${url:0:60}..."
    mkdir -p "$demo/$cluster-join"
    if [ -n "$kubectl_133" ]; then
        echo "   kubectl apply -f <manifest URL>"
        SSL_CERT_FILE="$demo/hub/ca.crt" "$kubectl_133" --kubeconfig "$demo/$cluster.kubeconfig" apply -f "$url" | sed 's/^/   /'
        "$kubectl_133" --kubeconfig "$demo/$cluster.kubeconfig" -n otterscale-system get secret otter-agent -o json >"$demo/$cluster-join/secret.json"
    else
        echo "   (kubectl 1.33 not found: reading the manifest's Secret directly)"
        manifest_secret "$url" "$demo/hub/ca.crt" "$demo/$cluster-join"
    fi
    join_files "$demo/$cluster-join"
    echo "   starting the agent for $cluster"
    KUBECONFIG="$demo/$cluster.kubeconfig" "$bin/otter-agent" --hub-url "$hub_url" --cluster "$cluster" \
        --agent-id "$cluster-agent" --hub-ca-file "$demo/$cluster-join/hub-ca.crt" \
        --join-token-file "$demo/$cluster-join/join-token" --state-dir "$demo/$cluster-state" \
        >"$demo/$cluster-agent.log" 2>&1 &
    pids+=($!)
done

echo "== waiting for both tunnels"
for _ in $(seq 1 100); do
    [ "$("$bin/otter" links -o json | grep -c '"connected"')" = 2 ] && break
    sleep 0.2
done

run() { echo; echo "\$ $*"; "$@"; }
run "$bin/otter" links
run "$bin/otter" get pods -A --cluster edge-1
run "$bin/otter" get pods -A --cluster edge-2
run "$bin/otter" exec tools --cluster edge-1 -- sh -c 'echo "hello from $(hostname) via edge-1"'

echo
echo "\$ otter port-forward web-0 18080:80 --cluster edge-1   (and a round trip through it)"
"$bin/otter" port-forward web-0 18080:80 --cluster edge-1 >"$demo/pf.log" 2>&1 &
pids+=($!)
wait_for "$demo/pf.log" "Forwarding from" 10
exec 3<>/dev/tcp/127.0.0.1/18080
printf 'ping through the tunnel\n' >&3
IFS= read -r -t 10 reply <&3 || reply="(no reply)"
exec 3>&-
echo "sent 'ping through the tunnel', got back '$reply'"

echo
echo "== tenants: edge-1 and edge-2 belong to tenant 'default'; a second customer sees none of it"
run "$bin/otter" tenant create globex
echo
echo "\$ otter token create gil --tenant globex --role admin   (the operator names globex's first admin)"
gil=$("$bin/otter" token create gil --tenant globex --role admin)
run "$bin/otter" tenant list
echo
echo "\$ otter links --token <gil's token>"
"$bin/otter" links --token "$gil"
echo
echo "\$ otter get pods -A --cluster edge-1 --token <gil's token>   (answered as for a cluster that does not exist)"
"$bin/otter" get pods -A --cluster edge-1 --token "$gil" || true

if [ -n "$kubectl_133" ]; then
    echo
    echo "\$ otter kubeconfig --all && kubectl --context otter-edge-2 get deploy,pods   (kubectl through the hub)"
    "$bin/otter" kubeconfig --all --kubeconfig "$demo/kubeconfig" >/dev/null
    "$kubectl_133" --kubeconfig "$demo/kubeconfig" --context otter-edge-2 get deploy,pods
    echo
    echo "\$ kubectl --context otter-edge-1 exec tools -- sh -c 'echo ...'   (exec relayed by the hub)"
    "$kubectl_133" --kubeconfig "$demo/kubeconfig" --context otter-edge-1 exec tools -- \
        sh -c 'echo "hello from kubectl exec, through the hub to $(hostname)"'
fi

cat <<EOF2

== the demo is running; try it yourself (Ctrl-C stops everything):
   export OTTER_CONFIG=$OTTER_CONFIG
   $bin/otter links -o wide
   $bin/otter get deploy --cluster edge-2
   $bin/otter logs web-0 --cluster edge-1 -f
   $bin/otter exec -it tools --cluster edge-1 -- sh
   $bin/otter kubeconfig --all --kubeconfig $demo/kubeconfig && kubectl --kubeconfig $demo/kubeconfig --context otter-edge-1 get pods
   hub log: $demo/hub.log   agent logs: $demo/edge-*-agent.log
EOF2
# `wait` (unlike a foreground sleep) returns at once on a signal the script
# traps, so a SIGINT or SIGTERM to this script alone stops the demo too.
while true; do sleep 3600 & pids+=("$!"); wait "$!"; done
