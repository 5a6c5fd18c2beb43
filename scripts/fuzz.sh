#!/usr/bin/env bash
# Fuzzes every parser of untrusted bytes (the `fuzz/` folder of each crate
# that has one) for a bounded time per target, on nightly with libFuzzer.
#
#   FUZZ_SECONDS=30       time per target
#   FUZZ_TARGETS="a b"    only these targets (default: all)
#   FUZZ_SANITIZER=none   or address: our crates forbid unsafe code, so the
#                         sanitizer mostly doubles build and run time; panics,
#                         overflows (debug assertions are on), timeouts and
#                         memory blow-ups are what the fuzzers look for
#
# cargo-fuzz is installed once into a cache outside the checkout, and build
# output, the growing corpus and crash artifacts go there too; the repo keeps
# only the small seed corpus (`fuzz/seeds/<target>/`). A crash input belongs
# in `<crate>/tests/fuzz-regressions/<target>/`, which `cargo test` replays.
set -euo pipefail
cd "$(dirname "$0")/.."

FUZZ_SECONDS="${FUZZ_SECONDS:-30}"
FUZZ_SANITIZER="${FUZZ_SANITIZER:-none}"
CACHE="${OTTER_CACHE:-$HOME/.cache/otterscale-link}"
TOOLS="$CACHE/tools"
FUZZ_TARGET_DIR="${FUZZ_TARGET_DIR:-$CACHE/fuzz-target}"
FUZZ_WORK="${FUZZ_WORK:-$CACHE/fuzz-work}"
CRATES=(shared/tunnel shared/pki hub)
export PATH="$TOOLS/bin:$PATH"

if ! rustup toolchain list | grep -q '^nightly'; then
    rustup toolchain install nightly --profile minimal
fi
if ! command -v cargo-fuzz >/dev/null; then
    echo "installing cargo-fuzz into $TOOLS"
    cargo install cargo-fuzz --locked --root "$TOOLS"
fi

failed=()
summary=()
for crate in "${CRATES[@]}"; do
    name="${crate//\//-}"
    for target in $(cd "$crate" && cargo +nightly fuzz list); do
        if [[ -n "${FUZZ_TARGETS:-}" && " $FUZZ_TARGETS " != *" $target "* ]]; then
            continue
        fi
        corpus="$FUZZ_WORK/$name/corpus/$target"
        artifacts="$FUZZ_WORK/$name/artifacts/$target"
        log="$FUZZ_WORK/$name/$target.log"
        mkdir -p "$corpus" "$artifacts"
        echo "== $crate: $target for ${FUZZ_SECONDS}s"
        # New inputs go to the first corpus folder (outside the repo); the
        # seeds are only read.
        if (cd "$crate" && cargo +nightly fuzz run --target-dir "$FUZZ_TARGET_DIR" \
            -s "$FUZZ_SANITIZER" --debug-assertions "$target" \
            "$corpus" "fuzz/seeds/$target" -- \
            -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 \
            -artifact_prefix="$artifacts/" -print_final_stats=1) >"$log" 2>&1; then
            runs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')"
            summary+=("$crate $target: ok, $runs runs in ${FUZZ_SECONDS}s")
        else
            tail -n 40 "$log"
            summary+=("$crate $target: FAILED (log $log, inputs in $artifacts)")
            failed+=("$target")
        fi
    done
done

echo
printf '%s\n' "${summary[@]}"
if ((${#failed[@]})); then
    echo "fuzzing found problems in: ${failed[*]}; add each input to <crate>/tests/fuzz-regressions/<target>/"
    exit 1
fi
