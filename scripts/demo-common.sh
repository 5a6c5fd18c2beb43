# Shared by scripts/demo.sh and scripts/demo-ha.sh (sourced from the
# checkout's root): the build, a scratch folder cleaned up on exit with
# every process the demo started, and small helpers.
root=$(pwd)
: "${CARGO_TARGET_DIR:=$HOME/.cache/otterscale-link/target}"
export CARGO_TARGET_DIR

scripts/setup.sh build >/dev/null
scripts/setup.sh python >/dev/null
# OTTER_DEMO_PROFILE=debug skips the (slower) release build when iterating.
profile=${OTTER_DEMO_PROFILE:-release}
echo "== building $profile binaries (first time: several minutes; cargo shows its progress)"
if [ "$profile" = release ]; then
    cargo build --release -p otter-hub -p otter-agent -p kube-sim
else
    cargo build -p otter-hub -p otter-agent -p kube-sim
fi
bin=$CARGO_TARGET_DIR/$profile

demo=$(mktemp -d "${TMPDIR:-/tmp}/otter-demo.XXXXXX")
pids=()
cleanup() {
    trap - EXIT INT TERM
    echo
    echo "== stopping the demo"
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$demo"
}
# Ctrl-C or a SIGTERM stops everything at once and ends the script (a
# trap alone would let the script go on after cleaning up).
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM

wait_for() { # file pattern seconds
    for _ in $(seq 1 $(($3 * 10))); do
        grep -q "$2" "$1" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "timed out waiting for '$2' in $1:" >&2
    cat "$1" >&2
    return 1
}


# The agent gets exactly what the manifest's Secret holds: the join token
# and the hub CA, from <dir>/secret.json into <dir>/join-token and
# <dir>/hub-ca.crt.
join_files() {
    .venv/bin/python - "$1" <<'PY'
import base64, json, os, sys
d = sys.argv[1]
s = json.load(open(os.path.join(d, "secret.json")))
data = s.get("stringData") or {k: base64.b64decode(v).decode() for k, v in s.get("data", {}).items()}
open(os.path.join(d, "join-token"), "w").write(data["join-token"])
open(os.path.join(d, "hub-ca.crt"), "w").write(data["hub-ca.crt"])
PY
}

# The Secret of the agent manifest at <url> (trusting <ca>) into
# <dir>/secret.json, without kubectl.
manifest_secret() {
    curl -fsS --cacert "$2" "$1" >"$3/manifest.yaml"
    .venv/bin/python - "$3/manifest.yaml" "$3/secret.json" <<'PY'
import json, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d.get("kind") == "Secret"]
json.dump(docs[0], open(sys.argv[2], "w"))
PY
}

# Applies the agent manifest at <url> (trusting <ca>) to the cluster of
# <kubeconfig>, as `kubectl apply -f <url>` does: with kubectl 1.33 when
# the machine has it, else with the Python Kubernetes client. Leaves the
# manifest's Secret in <dir>/secret.json.
kubectl_133=$(dpkg -L kubectl 2>/dev/null | grep 'kubectl.1.33$' | head -1 || true)
apply_manifest() { # url ca kubeconfig dir
    curl -fsS --cacert "$2" "$1" >"$4/manifest.yaml"
    if [ -n "$kubectl_133" ]; then
        "$kubectl_133" --kubeconfig "$3" apply -f "$4/manifest.yaml" >/dev/null
    else
        .venv/bin/python - "$4/manifest.yaml" "$3" <<'PY'
import sys, yaml
from kubernetes import client, config, utils
config.load_kube_config(sys.argv[2])
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
utils.create_from_yaml(client.ApiClient(), yaml_objects=docs)
PY
    fi
    .venv/bin/python - "$4/manifest.yaml" "$4/secret.json" <<'PY'
import json, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d.get("kind") == "Secret"]
json.dump(docs[0], open(sys.argv[2], "w"))
PY
}
