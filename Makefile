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
# npm packages of ts/ (installed by `scripts/setup.sh npm`): buf, protoc-gen-es, tsc
BUF := ts/node_modules/.bin/buf

.PHONY: all setup toolchain checkout proto manifests generate lint build release install test demo bench fuzz clean

all: proto manifests lint test

## setup: apt packages, Python venv, Debian kubectl 1.20, npm packages of ts/ (idempotent)
setup:
	scripts/setup.sh

## proto: regenerate every output of proto/*.proto: the Rust code and descriptor
## set (proto/src/gen), the TypeScript package's sources (ts/src/gen, by
## protoc-gen-es through buf) and openapi/openapi.yaml (Connect endpoints)
proto:
	OTTER_PROTO_REGEN=1 $(CARGO) test -q -p otter-proto --test outputs bootstrap::
	scripts/setup.sh npm
	$(BUF) generate --template ts/buf.gen.yaml
	mkdir -p openapi
	$(CARGO) run -q -p otter-openapi > openapi/openapi.yaml.tmp
	mv openapi/openapi.yaml.tmp openapi/openapi.yaml

## manifests: regenerate manifests/crds.yaml from the CRD types in shared/crds
manifests:
	$(CARGO) run -q -p otter-crds --bin crdgen > manifests/crds.yaml.tmp
	mv manifests/crds.yaml.tmp manifests/crds.yaml

## generate: every code generator of the repo (the CRD types are derived at
## compile time and need none; the protos do)
generate: proto

## lint: formatting and clippy, warnings are errors; buf lint over proto/ (rules
## in buf.yaml) and buf breaking against the previous commit's protos
lint: toolchain
	$(CARGO) fmt --all --check
	$(CARGO) clippy -q --workspace --all-targets -- -D warnings
	scripts/setup.sh npm
	$(BUF) lint
	scripts/buf-breaking.sh

## build: debug build of every crate and binary
build: toolchain
	$(CARGO) build --workspace --all-targets

## release: stripped release binaries (otter, otter-agent) and SHA256SUMS in
## dist/otterscale-link-v<version>-<os>-<arch>/
release:
	scripts/release.sh

## install: otter and otter-agent into $(PREFIX)/bin (default ~/.cargo/bin)
PREFIX ?= $(HOME)/.cargo
install: toolchain
	$(CARGO) install --locked --path hub --root $(PREFIX)
	$(CARGO) install --locked --path agent --root $(PREFIX)

## toolchain: what building needs besides Rust (protoc, for etcd's API)
toolchain:
	scripts/setup.sh build

# Our crates. Tests find their files through the folder of the checkout they
# were compiled in, and cargo reuses a build directory's artifacts across
# checkouts in other folders (it judges freshness by file times, so a build
# from another checkout's older commit passes for this one's); so when the
# checkout moved, ours are rebuilt in every profile the tests and the bench
# use (the dependencies stay cached).
WORKSPACE_CRATES := otter-proto otter-openapi otter-pki otter-tunnel otter-crds otter-hub otter-agent kube-sim otter-e2e otter-bench

checkout:
	@if [ "$$(cat $(CARGO_TARGET_DIR)/.checkout 2>/dev/null)" != "$(CURDIR)" ]; then \
		echo "build directory last used by another checkout: rebuilding this workspace's crates"; \
		for profile in dev release profiling; do \
			$(CARGO) clean -q --profile $$profile $(addprefix -p ,$(WORKSPACE_CRATES)) || true; \
		done; \
		mkdir -p $(CARGO_TARGET_DIR); echo "$(CURDIR)" > $(CARGO_TARGET_DIR)/.checkout; \
	fi

## test: the whole suite; real third-party clients are required, not skipped
test: setup checkout
	OTTER_REQUIRE_TOOLS=1 $(CARGO) test --workspace --no-fail-fast

## demo: hub + two simulated clusters with their agents on loopback;
## HA=1: three hub replicas on a 3-member etcd, one of them killed
demo:
	@if [ "$(HA)" = 1 ]; then scripts/demo-ha.sh; else scripts/demo.sh; fi

## bench: throughput, latency, head-of-line isolation, scale, reconnect storm,
## footprint (table on stdout, target/bench/results.json); QUICK=1 short, FULL=1
## with 10,000 agents
bench: checkout
	QUICK="$(QUICK)" FULL="$(FULL)" scripts/bench.sh

## fuzz: every fuzz target (shared/tunnel, shared/pki, hub) for FUZZ_SECONDS
## each (default 30), on nightly; installs cargo-fuzz into ~/.cache once
fuzz:
	FUZZ_SECONDS="$(FUZZ_SECONDS)" scripts/fuzz.sh

clean:
	$(CARGO) clean
