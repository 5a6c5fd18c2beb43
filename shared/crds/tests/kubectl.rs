//! kubectl 1.33, a client we did not write, reads `manifests/crds.yaml` and the
//! samples offline (`annotate --local`) into exactly the objects we generated.
//!
//! kubectl is taken from `OTTER_KUBECTL`, else from the Debian `kubectl` package's
//! versioned 1.33 binary; without either the test says so and passes, unless
//! `OTTER_REQUIRE_TOOLS=1` (set by `make test`), which makes it fail.

mod common;

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn find_kubectl() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("OTTER_KUBECTL") {
        return Some(PathBuf::from(path));
    }
    let listing = Command::new("dpkg").args(["-L", "kubectl"]).output().ok()?;
    String::from_utf8_lossy(&listing.stdout)
        .lines()
        .find(|line| line.ends_with("kubectl.1.33"))
        .map(PathBuf::from)
        .filter(|path| path.exists())
}

/// kubectl 1.33, or `None` after printing why the test is skipped; panics
/// instead under `OTTER_REQUIRE_TOOLS=1` (as `make test` runs), as
/// `otter_e2e::tool_missing` does (this crate does not depend on otter-e2e).
fn kubectl() -> Option<PathBuf> {
    let found = find_kubectl();
    if found.is_some() {
        return found;
    }
    let how = "install the `kubectl` apt package that ships the versioned \
               `kubectl.1.33` binary (`dpkg -L kubectl` lists it), or set \
               OTTER_KUBECTL to a kubectl 1.33";
    if std::env::var("OTTER_REQUIRE_TOOLS").is_ok_and(|v| v == "1") {
        panic!("required tool missing: kubectl 1.33 (OTTER_REQUIRE_TOOLS=1); {how}");
    }
    eprintln!("skipped: kubectl 1.33 is not on this machine; {how}");
    None
}

/// Objects kubectl decodes from `file`, with the marker annotation taken off again.
fn read_with_kubectl(kubectl: &PathBuf, file: &str) -> Vec<Value> {
    let output = Command::new(kubectl)
        .args(["annotate", "--local", "-o", "json", "otter-check=1", "-f"])
        .arg(common::repo_root().join(file))
        .output()
        .expect("run kubectl");
    assert!(
        output.status.success(),
        "kubectl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::Deserializer::from_slice(&output.stdout)
        .into_iter::<Value>()
        .map(|doc| {
            let mut doc = doc.expect("kubectl prints JSON");
            let meta = doc["metadata"].as_object_mut().expect("metadata");
            if let Some(Value::Object(annotations)) = meta.get_mut("annotations") {
                annotations.remove("otter-check");
                if annotations.is_empty() {
                    meta.remove("annotations");
                }
            }
            doc
        })
        .collect()
}

/// Whole-number floats as integers, so `1.0` and `1` compare equal.
fn numbers_as_integers(value: Value) -> Value {
    match value {
        Value::Number(n) if n.is_f64() => match n.as_f64() {
            #[allow(clippy::cast_possible_truncation)]
            Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Value::from(f as i64),
            _ => Value::Number(n),
        },
        Value::Array(items) => Value::Array(items.into_iter().map(numbers_as_integers).collect()),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k, numbers_as_integers(v)))
                .collect(),
        ),
        other => other,
    }
}

#[test]
fn kubectl_reads_the_crds_as_generated() {
    let Some(kubectl) = kubectl() else {
        return;
    };
    let read = read_with_kubectl(&kubectl, "manifests/crds.yaml");
    let ours: Vec<Value> = common::crds()
        .into_iter()
        .map(numbers_as_integers)
        .collect();
    let read: Vec<Value> = read.into_iter().map(numbers_as_integers).collect();
    assert_eq!(read.len(), ours.len());
    for (theirs, ours) in read.iter().zip(&ours) {
        assert!(
            theirs == ours,
            "kubectl reads {} differently",
            ours["metadata"]["name"]
        );
    }
}

#[test]
fn kubectl_reads_every_sample() {
    let Some(kubectl) = kubectl() else {
        return;
    };
    let mut kinds: Vec<String> = read_with_kubectl(&kubectl, "manifests/samples")
        .iter()
        .map(|doc| doc["kind"].as_str().unwrap_or_default().to_owned())
        .collect();
    kinds.sort();
    let mut expected: Vec<String> = common::crds()
        .iter()
        .map(|crd| {
            crd["spec"]["names"]["kind"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    expected.sort();
    assert_eq!(kinds, expected);
}
