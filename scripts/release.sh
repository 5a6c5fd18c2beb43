#!/usr/bin/env bash
# `make release`: the hub (`otter`) and the agent (`otter-agent`), built in
# release mode, stripped, into one folder with a SHA256SUMS file:
#   dist/otterscale-link-v<version>-<os>-<arch>/
# The version is the workspace's (Cargo.toml), which the binaries report
# (`otter version`, `otter-agent --version`) and the default agent image's
# tag matches (`otter hub --agent-image`). The Dockerfiles in
# manifests/docker copy the binaries from this folder.
#
#   OTTER_RELEASE_BINS=DIR  package the binaries already in DIR (no build)
#   OTTER_RELEASE_DIR=DIR   where the folder goes (default: dist)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CARGO_TARGET_DIR:=$HOME/.cache/otterscale-link/target}"
export CARGO_TARGET_DIR

bins=${OTTER_RELEASE_BINS:-}
if [ -z "$bins" ]; then
    scripts/setup.sh build >/dev/null
    cargo build --release --locked -p otter-hub -p otter-agent
    bins=$CARGO_TARGET_DIR/release
fi
version=$("$bins/otter" version --short)
agent_version=$("$bins/otter-agent" --version | awk '{print $2}')
if [ "v$agent_version" != "$version" ]; then
    echo "release: otter says $version, otter-agent says v$agent_version" >&2
    exit 1
fi
name="otterscale-link-$version-$(uname -s | tr '[:upper:]' '[:lower:]')-$(uname -m)"
out=${OTTER_RELEASE_DIR:-dist}/$name
rm -rf "$out"
mkdir -p "$out"
for b in otter otter-agent; do
    cp "$bins/$b" "$out/$b"
    strip "$out/$b" 2>/dev/null || objcopy --strip-all "$out/$b"
done
(cd "$out" && sha256sum otter otter-agent > SHA256SUMS)
echo "$out"
