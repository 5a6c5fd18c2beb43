# OtterScale Link — build, test and run.
#
# Quick start on a fresh machine: `make demo` (run it) and `make test` (check it).
# Both install what they need through scripts/setup.sh, idempotently.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c

# Build output lives outside the checkout so clean clones (CI) reuse it.
CARGO_TARGET_DIR ?= $(HOME)/.cache/otterscale-link/target
export CARGO_TARGET_DIR
CARGO ?= cargo

.PHONY: all setup proto manifests generate lint build test demo bench fuzz clean

all: proto manifests lint test

## setup: apt packages, Python venv, Debian kubectl 1.20 (idempotent)
setup:
	scripts/setup.sh

## proto: regenerate proto/src/gen (Rust code + descriptor set) from proto/*.proto
proto:
	OTTER_PROTO_REGEN=1 $(CARGO) test -q -p otter-proto --test bootstrap

## manifests: regenerate manifests/crds.yaml from the CRD types in shared/crds
manifests:
	$(CARGO) run -q -p otter-crds --bin crdgen > manifests/crds.yaml.tmp
	mv manifests/crds.yaml.tmp manifests/crds.yaml

## generate: every code generator of the repo (the CRD types are derived at
## compile time and need none; the protos do)
generate: proto

## lint: formatting and clippy, warnings are errors
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy -q --workspace --all-targets -- -D warnings

## build: debug build of every crate and binary
build:
	$(CARGO) build --workspace --all-targets

## test: the whole suite; real third-party clients are required, not skipped
test: setup
	OTTER_REQUIRE_TOOLS=1 $(CARGO) test --workspace --no-fail-fast

## demo: hub + two simulated clusters with their agents on loopback
demo:
	@echo "not yet available: the demo (needs the agent services and the CLI)"; exit 1

## bench: throughput, latency, memory (results in target/bench/results.json)
bench:
	@echo "not yet available: benchmarks (need the tunnel transports)"; exit 1

clean:
	$(CARGO) clean
