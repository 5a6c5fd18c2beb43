#!/usr/bin/env bash
# `buf breaking` of the working tree's protos against the previous commit's.
#
#   scripts/buf-breaking.sh          against HEAD~1
#   scripts/buf-breaking.sh REF      against REF (a commit, branch or tag)
#
# The protos of REF are taken with `git archive`, which works in worktrees and
# needs no clone. When REF does not exist (first commit, shallow clone) or has
# no protos under proto/, there is nothing to compare: say so and succeed.
# Rules: the `breaking` section of buf.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:-HEAD~1}
buf=${BUF:-ts/node_modules/.bin/buf}

log() { printf 'buf-breaking: %s\n' "$*"; }

if ! git rev-parse --verify --quiet "$ref^{commit}" >/dev/null; then
    log "skipped: no commit $ref to compare with"
    exit 0
fi
if [ -z "$(git ls-tree -r --name-only "$ref" -- proto | grep '\.proto$' || true)" ]; then
    log "skipped: $ref has no .proto files under proto/"
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git archive "$ref" proto | tar -x -C "$tmp"
# Compare only the .proto files (the Rust crate around them is not buf's).
find "$tmp/proto" -type f ! -name '*.proto' -delete
"$buf" breaking proto --against "$tmp/proto"
log "no breaking changes against $ref ($(git rev-parse --short "$ref"))"
