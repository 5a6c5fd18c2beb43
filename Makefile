# Developer entry points. CARGO_TARGET_DIR and the like come from the environment.
CARGO ?= cargo

.PHONY: generate manifests test-crds

# The CRD types are plain Rust (derive macros); there is no separate code
# generation step for them.
generate:
	@echo "generate: nothing to do for the CRD types (they are derived at compile time)"

# Regenerates manifests/crds.yaml from the Rust types in shared/crds.
manifests:
	$(CARGO) run -q -p otter-crds --bin crdgen > manifests/crds.yaml.tmp
	mv manifests/crds.yaml.tmp manifests/crds.yaml

test-crds:
	$(CARGO) test -p otter-crds
