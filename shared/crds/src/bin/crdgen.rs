//! Prints every OtterScale CRD as one YAML stream; `make manifests` stores it in
//! `manifests/crds.yaml`.

use std::io::Write;

fn main() -> std::io::Result<()> {
    std::io::stdout().write_all(otter_crds::crds_yaml().as_bytes())
}
