//! Helpers shared by the integration tests of this crate.

#![allow(dead_code)] // each test binary uses a different subset

use std::path::PathBuf;

use serde_json::Value;

/// Root of the repository (two levels above this crate).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every generated CRD as JSON.
pub fn crds() -> Vec<Value> {
    otter_crds::all_crds()
        .into_iter()
        .map(|crd| serde_json::to_value(crd).expect("CRD to JSON"))
        .collect()
}

/// The generated CRD of `kind`.
pub fn crd(kind: &str) -> Value {
    crds()
        .into_iter()
        .find(|crd| crd["spec"]["names"]["kind"] == kind)
        .unwrap_or_else(|| panic!("no CRD for kind {kind}"))
}

/// The `openAPIV3Schema` of the only version of a CRD.
pub fn schema(crd: &Value) -> &Value {
    &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
}

/// Reads a YAML file under the repository root into JSON.
pub fn read_yaml(relative: &str) -> Value {
    let path = repo_root().join(relative);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}
