//! The CEL rules (`x-kubernetes-validations`) of the generated CRDs, evaluated
//! client-side with kube's CEL library: every rule compiles and stays within the
//! apiserver's cost budget, the samples pass, and objects (or updates) that break a
//! rule are rejected with its message.

mod common;

use kube::core::cel::{self as kcel, ScopeContext, WarningKind};

use serde_json::{Value, json};

fn sample(file: &str) -> Value {
    common::read_yaml(&format!("manifests/samples/{file}"))
}

fn schema_of(kind: &str) -> Value {
    common::schema(&common::crd(kind)).clone()
}

/// Messages of the CEL rules `object` (as an update of `old`, if given) breaks.
fn broken_rules(kind: &str, object: &Value, old: Option<&Value>) -> Vec<String> {
    match kcel::Validator::new().validate(&schema_of(kind), object, old) {
        Ok(()) => Vec::new(),
        Err(errors) => errors.iter().map(ToString::to_string).collect(),
    }
}

/// Applies `(pointer, value)` changes to a copy of a sample; `Value::Null` removes the field.
fn changed(file: &str, changes: &[(&str, Value)]) -> Value {
    let mut value = sample(file);
    for (pointer, new) in changes {
        if new.is_null() {
            let (parent, field) = pointer.rsplit_once('/').expect("pointer has a parent");
            value
                .pointer_mut(parent)
                .and_then(Value::as_object_mut)
                .map(|o| o.remove(field));
        } else if let Some(slot) = value.pointer_mut(pointer) {
            *slot = new.clone();
        } else {
            let (parent, field) = pointer.rsplit_once('/').expect("pointer has a parent");
            value
                .pointer_mut(parent)
                .and_then(Value::as_object_mut)
                .unwrap_or_else(|| panic!("{file}: no {parent}"))
                .insert(field.to_owned(), new.clone());
        }
    }
    value
}

/// Every node with CEL rules, as (path, node).
fn rule_nodes<'a>(node: &'a Value, path: &str, out: &mut Vec<(String, &'a Value)>) {
    if node.get("x-kubernetes-validations").is_some() {
        out.push((path.to_owned(), node));
    }
    if let Some(props) = node["properties"].as_object() {
        for (name, child) in props {
            rule_nodes(child, &format!("{path}.{name}"), out);
        }
    }
    if node["items"].is_object() {
        rule_nodes(&node["items"], &format!("{path}[]"), out);
    }
}

#[test]
fn every_rule_compiles_in_scope_and_within_budget() {
    let mut problems = Vec::new();
    let mut rules = 0;
    for crd in common::crds() {
        let name = crd["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let mut nodes = Vec::new();
        rule_nodes(common::schema(&crd), "", &mut nodes);
        for (path, node) in nodes {
            let compiled = kcel::compile_schema(node);
            for error in compiled.compilation_errors() {
                problems.push(format!("{name} {path}: does not compile: {error:?}"));
            }
            for rule in node["x-kubernetes-validations"]
                .as_array()
                .into_iter()
                .flatten()
            {
                rules += 1;
                let rule = rule["rule"].as_str().unwrap_or_default();
                for warning in kcel::analyze_rule(rule, &compiled, ScopeContext::CrdValidation) {
                    // The scope analysis takes comprehension variables (`x` in
                    // `self.all(x, ...)`) for unknown globals, so only cost is checked.
                    if warning.kind == WarningKind::CostExceeded {
                        problems.push(format!("{name} {path}: `{rule}`: {}", warning.message));
                    }
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "CEL problems:\n{}",
        problems.join("\n")
    );
    assert_eq!(rules, 14, "number of CEL rules across all CRDs");
}

#[test]
fn samples_pass_their_rules() {
    for (file, kind) in [
        ("fleet_v1alpha1_cluster.yaml", "Cluster"),
        ("fleet_v1alpha1_machine.yaml", "Machine"),
        ("model_v1alpha1_modelartifact.yaml", "ModelArtifact"),
        ("module_v1alpha1_module.yaml", "Module"),
        ("module_v1alpha1_moduletemplate.yaml", "ModuleTemplate"),
        ("tenant_v1alpha1_workspace.yaml", "Workspace"),
    ] {
        let value = sample(file);
        assert_eq!(
            broken_rules(kind, &value, None),
            Vec::<String>::new(),
            "{file} on create"
        );
        assert_eq!(
            broken_rules(kind, &value, Some(&value)),
            Vec::<String>::new(),
            "{file} on no-op update"
        );
    }
}

/// A broken object: sample, kind, changes to it, message of the rule it breaks.
type Case = (
    &'static str,
    &'static str,
    Vec<(&'static str, Value)>,
    &'static str,
);

#[test]
fn objects_breaking_a_rule_are_rejected() {
    let cases: Vec<Case> = vec![
        (
            "fleet_v1alpha1_cluster.yaml",
            "Cluster",
            vec![("/spec/clusterNetwork/podSubnets", json!(["10.244.0.0"]))],
            "each entry must be a valid CIDR notation",
        ),
        (
            "fleet_v1alpha1_cluster.yaml",
            "Cluster",
            vec![(
                "/spec/clusterNetwork/serviceSubnets",
                json!(["10.96.0.0/12", "not-a-cidr"]),
            )],
            "each entry must be a valid CIDR notation",
        ),
        (
            "fleet_v1alpha1_machine.yaml",
            "Machine",
            vec![("/spec/role", json!("worker"))],
            "worker nodes cannot be bootstrap nodes",
        ),
        (
            "model_v1alpha1_modelartifact.yaml",
            "ModelArtifact",
            vec![("/spec/source", json!({}))],
            "exactly one source must be specified",
        ),
        (
            "module_v1alpha1_moduletemplate.yaml",
            "ModuleTemplate",
            vec![("/spec/kustomization", json!({"path": "./deploy"}))],
            "exactly one of helmRelease or kustomization must be set",
        ),
        (
            "module_v1alpha1_moduletemplate.yaml",
            "ModuleTemplate",
            vec![("/spec/helmRelease", Value::Null)],
            "exactly one of helmRelease or kustomization must be set",
        ),
        (
            "tenant_v1alpha1_workspace.yaml",
            "Workspace",
            vec![("/spec/members/0/role", json!("edit"))],
            "at least one workspace member must have role 'admin'",
        ),
        (
            "tenant_v1alpha1_workspace.yaml",
            "Workspace",
            vec![("/spec/networkIsolation/enabled", json!(false))],
            "allowedNamespaces can only be set when network isolation is enabled",
        ),
        (
            "tenant_v1alpha1_workspace.yaml",
            "Workspace",
            vec![("/spec/namespace", json!("kube-system"))],
            "namespace is reserved and cannot be used for a workspace",
        ),
    ];
    for (file, kind, changes, message) in cases {
        let object = changed(file, &changes);
        let errors = broken_rules(kind, &object, None);
        assert!(
            errors.iter().any(|e| e.contains(message)),
            "{file} with {changes:?} should break `{message}`, got {errors:?}"
        );
    }
}

#[test]
fn immutable_fields_cannot_change() {
    // (sample, kind, change, expected message)
    let cases: Vec<(&str, &str, (&str, Value), &str)> = vec![
        (
            "fleet_v1alpha1_machine.yaml",
            "Machine",
            ("/spec/clusterRef", json!("edge-2")),
            "clusterRef is immutable",
        ),
        (
            "fleet_v1alpha1_machine.yaml",
            "Machine",
            ("/spec/role", json!("worker")),
            "role is immutable",
        ),
        (
            "fleet_v1alpha1_machine.yaml",
            "Machine",
            ("/spec/bareMetalHostRef/name", json!("rack1-node1")),
            "bareMetalHostRef is immutable",
        ),
        (
            "module_v1alpha1_module.yaml",
            "Module",
            ("/spec/templateRef", json!("other")),
            "templateRef is immutable",
        ),
        (
            "tenant_v1alpha1_workspace.yaml",
            "Workspace",
            ("/spec/namespace", json!("team-b")),
            "namespace is immutable",
        ),
        (
            "tenant_v1alpha1_workspace.yaml",
            "Workspace",
            ("/spec/rancherProjectID", json!("c-abc12:p-xyz34")),
            "rancherProjectID is immutable",
        ),
    ];
    for (file, kind, change, message) in cases {
        let mut old = sample(file);
        if change.0 == "/spec/rancherProjectID" {
            old["spec"]["rancherProjectID"] = json!("c-abc12:p-old00");
        }
        let new = {
            let mut new = old.clone();
            *new.pointer_mut(change.0)
                .unwrap_or_else(|| panic!("{file}: no {}", change.0)) = change.1.clone();
            new
        };
        let errors = broken_rules(kind, &new, Some(&old));
        assert!(
            errors.iter().any(|e| e.contains(message)),
            "{file}: changing {} should break `{message}`, got {errors:?}",
            change.0
        );
    }
}

#[test]
fn a_worker_machine_states_bootstrap_false() {
    // Upstream's rule reads `self.bootstrap` without `has()`, so on a worker that
    // leaves the field out the rule fails to evaluate and the object is rejected.
    // The rule is kept exactly as upstream has it; this pins that behaviour.
    let without = changed(
        "fleet_v1alpha1_machine.yaml",
        &[
            ("/spec/role", json!("worker")),
            ("/spec/bootstrap", Value::Null),
        ],
    );
    let errors = broken_rules("Machine", &without, None);
    assert!(
        errors.iter().any(|e| e.contains("bootstrap")),
        "got {errors:?}"
    );
    let with_false = changed(
        "fleet_v1alpha1_machine.yaml",
        &[
            ("/spec/role", json!("worker")),
            ("/spec/bootstrap", json!(false)),
        ],
    );
    assert_eq!(
        broken_rules("Machine", &with_false, None),
        Vec::<String>::new()
    );
}
