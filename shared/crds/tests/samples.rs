//! Each sample in `manifests/samples/` reads into its Rust type without losing a
//! field and validates against the generated schema; broken copies of the samples
//! (a wrong enum value, a missing required field, a pattern or bound violation)
//! are rejected by the same schema.

mod common;

use std::collections::HashMap;
use std::sync::OnceLock;

use otter_crds::{fleet, model, module, tenant, workload};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Value, json};

/// Sample file (under `manifests/samples/`) and kind of every sample.
const SAMPLES: [(&str, &str); 8] = [
    ("fleet_v1alpha1_cluster.yaml", "Cluster"),
    ("fleet_v1alpha1_machine.yaml", "Machine"),
    ("model_v1alpha1_modelartifact.yaml", "ModelArtifact"),
    ("model_v1alpha1_modelservice.yaml", "ModelService"),
    ("module_v1alpha1_module.yaml", "Module"),
    ("module_v1alpha1_moduletemplate.yaml", "ModuleTemplate"),
    ("tenant_v1alpha1_workspace.yaml", "Workspace"),
    ("workload_v1alpha1_application.yaml", "Application"),
];

fn sample(file: &str) -> Value {
    common::read_yaml(&format!("manifests/samples/{file}"))
}

/// A JSON-Schema validator per kind, built once.
fn validators() -> &'static HashMap<String, jsonschema::Validator> {
    static VALIDATORS: OnceLock<HashMap<String, jsonschema::Validator>> = OnceLock::new();
    VALIDATORS.get_or_init(|| {
        common::crds()
            .iter()
            .map(|crd| {
                let kind = crd["spec"]["names"]["kind"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                let validator =
                    jsonschema::draft4::new(common::schema(crd)).expect("schema compiles");
                (kind, validator)
            })
            .collect()
    })
}

/// Validation errors of `instance` against the schema of `kind` (empty when valid).
fn schema_errors(kind: &str, instance: &Value) -> Vec<String> {
    validators()[kind]
        .iter_errors(instance)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// Reads `value` into `K` and writes it back; the result must equal the input, so
/// no field of the sample is unknown to the Rust type.
fn round_trip<K: DeserializeOwned + Serialize>(value: &Value) -> Value {
    let typed: K = serde_json::from_value(value.clone()).expect("sample reads into its Rust type");
    serde_json::to_value(typed).expect("Rust type writes back")
}

#[test]
fn samples_read_into_rust_types_without_loss() {
    for (file, kind) in SAMPLES {
        let value = sample(file);
        assert_eq!(value["kind"], kind, "{file}");
        let back = match kind {
            "Cluster" => round_trip::<fleet::Cluster>(&value),
            "Machine" => round_trip::<fleet::Machine>(&value),
            "ModelArtifact" => round_trip::<model::ModelArtifact>(&value),
            "ModelService" => round_trip::<model::ModelService>(&value),
            "Module" => round_trip::<module::Module>(&value),
            "ModuleTemplate" => round_trip::<module::ModuleTemplate>(&value),
            "Workspace" => round_trip::<tenant::Workspace>(&value),
            "Application" => round_trip::<workload::Application>(&value),
            other => panic!("no Rust type for {other}"),
        };
        assert_eq!(
            back, value,
            "{file} changes when read into its Rust type and written back"
        );
    }
}

#[test]
fn samples_validate_against_their_schema() {
    for (file, kind) in SAMPLES {
        let errors = schema_errors(kind, &sample(file));
        assert!(
            errors.is_empty(),
            "{file} does not validate:\n{}",
            errors.join("\n")
        );
    }
}

#[test]
fn every_kind_has_a_sample() {
    let mut kinds: Vec<String> = common::crds()
        .iter()
        .map(|crd| {
            crd["spec"]["names"]["kind"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    kinds.sort();
    let mut sampled: Vec<String> = SAMPLES.iter().map(|(_, kind)| (*kind).to_owned()).collect();
    sampled.sort();
    assert_eq!(kinds, sampled);
}

/// How a sample is broken.
enum Break {
    /// Replace the value at a JSON pointer.
    Set(&'static str, Value),
    /// Remove the field at a JSON pointer.
    Remove(&'static str),
}

fn broken(file: &str, change: &Break) -> Value {
    let mut value = sample(file);
    match change {
        Break::Set(pointer, new) => {
            *value
                .pointer_mut(pointer)
                .unwrap_or_else(|| panic!("{file}: no {pointer}")) = new.clone();
        }
        Break::Remove(pointer) => {
            let (parent, field) = pointer.rsplit_once('/').expect("pointer has a parent");
            let removed = value
                .pointer_mut(parent)
                .and_then(Value::as_object_mut)
                .and_then(|obj| obj.remove(field));
            assert!(removed.is_some(), "{file}: no {pointer} to remove");
        }
    }
    value
}

#[test]
fn broken_samples_are_rejected() {
    use Break::{Remove, Set};
    let long = "a".repeat(254);
    let cases: Vec<(&str, &str, &str, Break)> = vec![
        // (sample, kind, what is wrong, change)
        (
            "fleet_v1alpha1_cluster.yaml",
            "Cluster",
            "enum",
            Set("/spec/talosImage/checksumType", json!("sha1")),
        ),
        (
            "fleet_v1alpha1_cluster.yaml",
            "Cluster",
            "required",
            Remove("/spec/talosVersion"),
        ),
        (
            "fleet_v1alpha1_cluster.yaml",
            "Cluster",
            "pattern",
            Set("/spec/kubernetesVersion", json!("1.32")),
        ),
        (
            "fleet_v1alpha1_cluster.yaml",
            "Cluster",
            "maximum",
            Set("/spec/controlPlaneEndpoint/port", json!(70000)),
        ),
        (
            "fleet_v1alpha1_cluster.yaml",
            "Cluster",
            "maxItems",
            Set(
                "/spec/clusterNetwork/podSubnets",
                json!([
                    "10.0.0.0/16",
                    "10.1.0.0/16",
                    "10.2.0.0/16",
                    "10.3.0.0/16",
                    "10.4.0.0/16"
                ]),
            ),
        ),
        (
            "fleet_v1alpha1_cluster.yaml",
            "Cluster",
            "enum",
            Set(
                "/spec/controlPlaneConfig/configPatches/0/op",
                json!("merge"),
            ),
        ),
        (
            "fleet_v1alpha1_machine.yaml",
            "Machine",
            "enum",
            Set("/spec/role", json!("master")),
        ),
        (
            "fleet_v1alpha1_machine.yaml",
            "Machine",
            "required",
            Remove("/spec/bareMetalHostRef/namespace"),
        ),
        (
            "fleet_v1alpha1_machine.yaml",
            "Machine",
            "minLength",
            Set("/spec/clusterRef", json!("")),
        ),
        (
            "model_v1alpha1_modelartifact.yaml",
            "ModelArtifact",
            "enum",
            Set("/spec/format", json!("Docker")),
        ),
        (
            "model_v1alpha1_modelartifact.yaml",
            "ModelArtifact",
            "required",
            Remove("/spec/storage/size"),
        ),
        (
            "model_v1alpha1_modelartifact.yaml",
            "ModelArtifact",
            "pattern",
            Set("/spec/target/registry", json!("registry.example.com/org")),
        ),
        (
            "model_v1alpha1_modelartifact.yaml",
            "ModelArtifact",
            "pattern",
            Set(
                "/spec/source/huggingFace/model",
                json!("org/model; rm -rf /"),
            ),
        ),
        (
            "model_v1alpha1_modelartifact.yaml",
            "ModelArtifact",
            "pattern",
            Set("/spec/storage/size", json!("ten gigs")),
        ),
        (
            "model_v1alpha1_modelservice.yaml",
            "ModelService",
            "enum",
            Set("/spec/accelerator/type", json!("tpu")),
        ),
        (
            "model_v1alpha1_modelservice.yaml",
            "ModelService",
            "pattern",
            Set("/spec/decode/resources/requests/memory", json!("64 GB")),
        ),
        (
            "model_v1alpha1_modelservice.yaml",
            "ModelService",
            "enum",
            Set(
                "/spec/inferencePool/endpointPicker/failureMode",
                json!("FailSoft"),
            ),
        ),
        (
            "model_v1alpha1_modelservice.yaml",
            "ModelService",
            "required",
            Remove("/spec/model/image"),
        ),
        (
            "model_v1alpha1_modelservice.yaml",
            "ModelService",
            "minimum",
            Set("/spec/engine/port", json!(0)),
        ),
        (
            "model_v1alpha1_modelservice.yaml",
            "ModelService",
            "minimum",
            Set("/spec/decode/replicas", json!(-1)),
        ),
        (
            "module_v1alpha1_module.yaml",
            "Module",
            "pattern",
            Set("/spec/namespace", json!("Ingress_NS")),
        ),
        (
            "module_v1alpha1_module.yaml",
            "Module",
            "required",
            Remove("/spec/templateRef"),
        ),
        (
            "module_v1alpha1_module.yaml",
            "Module",
            "maxLength",
            Set("/spec/templateRef", json!(long)),
        ),
        (
            "module_v1alpha1_module.yaml",
            "Module",
            "type",
            Set("/spec/values", json!("not an object")),
        ),
        (
            "module_v1alpha1_moduletemplate.yaml",
            "ModuleTemplate",
            "required",
            Remove("/spec/namespace"),
        ),
        (
            "module_v1alpha1_moduletemplate.yaml",
            "ModuleTemplate",
            "pattern",
            Set("/spec/namespace", json!("-ingress")),
        ),
        (
            "tenant_v1alpha1_workspace.yaml",
            "Workspace",
            "enum",
            Set("/spec/members/0/role", json!("owner")),
        ),
        (
            "tenant_v1alpha1_workspace.yaml",
            "Workspace",
            "required",
            Remove("/spec/members"),
        ),
        (
            "tenant_v1alpha1_workspace.yaml",
            "Workspace",
            "required",
            Remove("/spec/members/0/subject"),
        ),
        (
            "tenant_v1alpha1_workspace.yaml",
            "Workspace",
            "minItems",
            Set("/spec/members", json!([])),
        ),
        (
            "tenant_v1alpha1_workspace.yaml",
            "Workspace",
            "pattern",
            Set(
                "/spec/networkIsolation/allowedNamespaces/0",
                json!("Not_A_Namespace"),
            ),
        ),
        (
            "tenant_v1alpha1_workspace.yaml",
            "Workspace",
            "pattern",
            Set("/spec/namespace", json!("Team-A")),
        ),
        (
            "tenant_v1alpha1_workspace.yaml",
            "Workspace",
            "pattern",
            Set("/spec/resourceQuota/hard/requests.cpu", json!("lots")),
        ),
        (
            "workload_v1alpha1_application.yaml",
            "Application",
            "required",
            Remove("/spec/deployment"),
        ),
        (
            "workload_v1alpha1_application.yaml",
            "Application",
            "required",
            Remove("/spec/deployment/template/spec/containers"),
        ),
        (
            "workload_v1alpha1_application.yaml",
            "Application",
            "type",
            Set("/spec/deployment/replicas", json!("two")),
        ),
    ];
    let mut accepted = Vec::new();
    for (file, kind, what, change) in &cases {
        let instance = broken(file, change);
        if schema_errors(kind, &instance).is_empty() {
            let target = match change {
                Break::Set(p, v) => format!("{p} = {v}"),
                Break::Remove(p) => format!("without {p}"),
            };
            accepted.push(format!("{file}: {what} violation accepted ({target})"));
        }
    }
    assert!(
        accepted.is_empty(),
        "the schema let broken samples through:\n{}",
        accepted.join("\n")
    );
    for what in ["enum", "required", "pattern"] {
        assert!(
            cases.iter().any(|(_, _, w, _)| *w == what),
            "no {what} case"
        );
    }
}
