#!/usr/bin/env bash
# Installs everything `make test` and `make demo` need on a fresh machine.
# Idempotent: a second run only checks. Safe to run as root (CI) or as a user
# with sudo for the apt step.
#
#   scripts/setup.sh            everything
#   scripts/setup.sh build      only what building needs (protoc)
#   scripts/setup.sh python     only the Python venv
#   scripts/setup.sh npm        only the npm packages of ts/
#
# What it provides:
#   .venv/                  Python venv with the pinned packages of scripts/requirements.txt
#   .tools/kubectl-1.20     Debian's kubectl 1.20 (extracted, not installed: it clashes
#                           with the image's kubectl package)
#   apt packages            listed in APT_PACKAGES below
#   ts/node_modules/        npm packages of ts/package-lock.json (`npm ci`): the
#                           TypeScript compiler, protoc-gen-es, the buf CLI
#                           (its binary ships in the npm package), connect
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
want=${1:-all}

# protobuf-compiler: etcd-client's build compiles etcd's API with protoc.
BUILD_PACKAGES=(protobuf-compiler)
APT_PACKAGES=("${BUILD_PACKAGES[@]}" tinyproxy stunnel4 iproute2 python3-venv curl docker-registry etcd-server faketime)

log() { printf 'setup: %s\n' "$*"; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

apt_missing() {
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    echo "${missing[@]:-}"
}

setup_apt() {
    local missing
    missing=$(apt_missing "${@:-${APT_PACKAGES[@]}}")
    if [ -n "$missing" ]; then
        log "installing apt packages: $missing"
        as_root apt-get update -qq
        # shellcheck disable=SC2086
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
        # tinyproxy's package starts a system service; tests start their own.
        as_root systemctl disable --now tinyproxy etcd >/dev/null 2>&1 || true
    fi
}

setup_kubectl_120() {
    local dest="$root/.tools/kubectl-1.20"
    if [ -x "$dest/usr/bin/kubectl" ]; then return; fi
    log "extracting Debian kubectl 1.20 into .tools/kubectl-1.20"
    local tmp
    tmp=$(mktemp -d)
    ( cd "$tmp" && apt-get download kubernetes-client >/dev/null 2>&1 ) || {
        as_root apt-get update -qq
        ( cd "$tmp" && apt-get download kubernetes-client >/dev/null )
    }
    mkdir -p "$dest"
    dpkg-deb -x "$tmp"/kubernetes-client_*.deb "$dest"
    rm -rf "$tmp"
}

setup_python() {
    local venv="$root/.venv"
    local stamp="$venv/.requirements.sha256"
    local sum
    sum=$(sha256sum scripts/requirements.txt | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sum" ]; then return; fi
    log "creating Python venv .venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check -r scripts/requirements.txt
    echo "$sum" >"$stamp"
}

setup_npm() {
    local dir="$root/ts"
    local stamp="$dir/node_modules/.package-lock.sha256"
    local sum
    sum=$(sha256sum "$dir/package-lock.json" | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sum" ]; then return; fi
    if ! command -v npm >/dev/null; then
        log "installing Node.js and npm (apt)"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
    fi
    log "installing npm packages of ts/ (npm ci)"
    ( cd "$dir" && npm ci --no-audit --no-fund --loglevel=error )
    echo "$sum" >"$stamp"
}

case "$want" in
    all) setup_apt; setup_kubectl_120; setup_python; setup_npm ;;
    apt) setup_apt ;;
    build) setup_apt "${BUILD_PACKAGES[@]}" ;;
    kubectl) setup_kubectl_120 ;;
    python) setup_python ;;
    npm) setup_npm ;;
    *) echo "usage: $0 [all|apt|build|kubectl|python|npm]" >&2; exit 2 ;;
esac
