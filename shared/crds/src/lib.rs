//! Rust types for the OtterScale custom resources, and the CustomResourceDefinitions
//! generated from them.
//!
//! Each kind is a `#[derive(CustomResource)]` spec struct; its schema attributes carry
//! the validation of the upstream OtterScale API (enums, defaults, patterns, bounds,
//! list types and CEL rules), so [`all_crds`] yields CRDs the apiserver enforces the
//! same way. `manifests/crds.yaml` at the repository root is [`crds_yaml`] checked in.
//!
//! # Layout
//! - [`fleet`]: `fleet.otterscale.io` — `Cluster`, `Machine` (Talos on bare metal).
//! - [`model`]: `model.otterscale.io` — `ModelArtifact`, `ModelService`.
//! - [`module`]: `module.otterscale.io` — `Module`, `ModuleTemplate`.
//! - [`tenant`]: `tenant.otterscale.io` — `Workspace`.
//! - [`workload`]: `workload.otterscale.io` — `Application`.
//! - [`common`]: types shared by several groups; `schema`: hand-written schema fragments.
//! - `bin/crdgen.rs`: prints [`crds_yaml`]; `make manifests` runs it.
//!
//! # Regenerating and installing
//! `make manifests` rewrites `manifests/crds.yaml`; a test fails while the checked-in
//! file differs from what the types generate. Install with
//! `kubectl apply --server-side -f manifests/crds.yaml` (server-side because the
//! embedded core types make some CRDs too large for the last-applied annotation).

// Every `printcolumn(...)` of a `#[kube(...)]` attribute repeats the keys `name`,
// `type_` and `json_path`; clippy reads those as duplicated attributes.
#![allow(clippy::duplicated_attributes)]

pub mod common;
pub mod fleet;
pub mod model;
pub mod module;
mod schema;
pub mod tenant;
pub mod workload;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use serde_json::{Map, Value, json};

/// Every CRD of the OtterScale API groups, sorted by name (`<plural>.<group>`).
///
/// These are the derived CRDs after a small normalisation (see `normalize` in the
/// source and the crate README) that makes them compare field by field with the
/// upstream ones; prefer this over calling `crd()` on a single kind.
///
/// # Panics
/// Never in practice: the CRDs are plain data that always convert to and from JSON.
pub fn all_crds() -> Vec<CustomResourceDefinition> {
    crd_values()
        .into_iter()
        .map(|value| serde_json::from_value(value).expect("a normalised CRD is still a CRD"))
        .collect()
}

/// All CRDs as one multi-document YAML stream, in the order of [`all_crds`].
///
/// # Panics
/// Never in practice: a CRD is plain data that always serialises.
pub fn crds_yaml() -> String {
    let mut out = String::new();
    for crd in crd_values() {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd).expect("a CRD always serialises to YAML"));
    }
    out
}

/// The CRDs as JSON values, normalised, sorted by name, object keys in sorted order.
fn crd_values() -> Vec<Value> {
    let mut crds = vec![
        fleet::Cluster::crd(),
        fleet::Machine::crd(),
        model::ModelArtifact::crd(),
        model::ModelService::crd(),
        module::Module::crd(),
        module::ModuleTemplate::crd(),
        tenant::Workspace::crd(),
        workload::Application::crd(),
    ];
    crds.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    crds.into_iter()
        .map(|crd| sort_keys(normalize(crd)))
        .collect()
}

/// Rebuilds every object with its keys in sorted order, so the YAML is the same
/// whether or not serde_json's `preserve_order` feature is on in the build.
fn sort_keys(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, sort_keys(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.into_iter().map(sort_keys).collect()),
        other => other,
    }
}

/// Brings a derived CRD in line with what the upstream generator emits, so the two
/// can be compared field by field:
///
/// - `names.listKind` is spelled out (the apiserver would default it the same way);
/// - the root schema lists `apiVersion`, `kind` and `metadata`, which gives
///   `kubectl explain` a description for them;
/// - `nullable: true` (and the `null` it adds to enums) is dropped: optional fields
///   are left out when empty, never sent as null, exactly as upstream;
/// - whole-number bounds are written as integers (`65535`, not `65535.0`);
/// - int-or-string nodes say so with `anyOf: [integer, string]`, and resource
///   quantities of the embedded core types (recognised by the description
///   k8s-openapi gives them) get the quantity `pattern` the apiserver checks for
///   core objects, so a CR is held to the same format;
/// - the root `title` (the Rust type name) is dropped.
fn normalize(crd: CustomResourceDefinition) -> Value {
    let mut value = serde_json::to_value(crd).expect("a CRD always serialises to JSON");
    let kind = value["spec"]["names"]["kind"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    value["spec"]["names"]["listKind"] = Value::String(format!("{kind}List"));
    if let Some(versions) = value["spec"]["versions"].as_array_mut() {
        for version in versions {
            let root = &mut version["schema"]["openAPIV3Schema"];
            normalize_schema(root);
            if let Some(root) = root.as_object_mut() {
                root.remove("title");
                if let Some(Value::Object(props)) = root.get_mut("properties") {
                    props.insert("apiVersion".into(), json!({
                        "description": "Versioned schema of this object (group/version); lets the server convert known schemas and reject unknown ones.",
                        "type": "string",
                    }));
                    props.insert("kind".into(), json!({
                        "description": "REST resource this object represents, in CamelCase; cannot be updated.",
                        "type": "string",
                    }));
                    props.insert("metadata".into(), json!({ "type": "object" }));
                }
            }
        }
    }
    value
}

/// Applies the per-node rules of [`normalize`] to one schema node and everything below it.
fn normalize_schema(node: &mut Value) {
    let Some(obj) = node.as_object_mut() else {
        return;
    };
    obj.remove("nullable");
    if obj.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
        obj.insert(
            "anyOf".into(),
            json!([{ "type": "integer" }, { "type": "string" }]),
        );
        let is_quantity = obj
            .get("description")
            .and_then(Value::as_str)
            .is_some_and(|d| d.starts_with("Quantity is a fixed-point representation"));
        if is_quantity {
            obj.remove("description");
            obj.entry("pattern")
                .or_insert_with(|| Value::String(schema::QUANTITY_PATTERN.to_owned()));
        }
    }
    if let Some(Value::Array(values)) = obj.get_mut("enum") {
        values.retain(|v| !v.is_null());
    }
    for key in ["minimum", "maximum"] {
        integral_number(obj, key);
    }
    for key in ["properties", "patternProperties"] {
        if let Some(Value::Object(props)) = obj.get_mut(key) {
            props.values_mut().for_each(normalize_schema);
        }
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(child) = obj.get_mut(key) {
            normalize_schema(child);
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(Value::Array(children)) = obj.get_mut(key) {
            children.iter_mut().for_each(normalize_schema);
        }
    }
}

/// Rewrites a whole-number float under `key` as an integer.
fn integral_number(obj: &mut Map<String, Value>, key: &str) {
    if let Some(Value::Number(n)) = obj.get(key)
        && n.is_f64()
        && let Some(f) = n.as_f64()
        && f.fract() == 0.0
        && f.abs() < 9.0e15
    {
        #[allow(clippy::cast_possible_truncation)]
        let i = f as i64;
        obj.insert(key.to_owned(), Value::from(i));
    }
}
