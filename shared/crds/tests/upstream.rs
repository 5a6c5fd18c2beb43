//! Structural comparison with the upstream OtterScale CRDs.
//!
//! `tests/upstream/<crd name>.txt` holds facts read off the upstream generated CRD
//! (and the Go markers that produce it): names, scope, subresources, printer
//! columns, and for every schema node its property path, type, required fields,
//! enum values, defaults, patterns, bounds, list types and CEL rules. Not the
//! upstream YAML itself. This test extracts the same facts from our generated CRD
//! and requires the two sets to be equal, except for the differences listed in
//! [`KNOWN_DIFFERENCES`], each with the reason it is there.
//!
//! Paths: `spec.members[].role` is the `role` field of an item of `spec.members`;
//! `{}` stands for the values of a map. A `cut <path>` line marks the root of an
//! embedded Kubernetes core type: below it the schema is Kubernetes' own (from
//! k8s-openapi here, from the upstream's k8s.io/api version there), so the
//! comparison stops at the root.

mod common;

use std::collections::BTreeSet;

use serde_json::Value;

/// Whether a difference is a fact only we have, or one only upstream has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    OnlyOurs,
    OnlyUpstream,
}

/// Why the core-type lists of a Workspace have no explicit list type.
const ATOMIC_BY_DEFAULT: &str = "k8s-openapi's schemas carry no list types; a CRD list without one is atomic, so merging is the same";

/// Differences from upstream that are on purpose: (CRD, side, fact, why).
const KNOWN_DIFFERENCES: &[(&str, Side, &str, &str)] = &[
    (
        "workspaces.tenant.otterscale.io",
        Side::OnlyUpstream,
        "listtype spec.limitRange.limits atomic",
        ATOMIC_BY_DEFAULT,
    ),
    (
        "workspaces.tenant.otterscale.io",
        Side::OnlyUpstream,
        "listtype spec.resourceQuota.scopeSelector.matchExpressions atomic",
        ATOMIC_BY_DEFAULT,
    ),
    (
        "workspaces.tenant.otterscale.io",
        Side::OnlyUpstream,
        "listtype spec.resourceQuota.scopeSelector.matchExpressions[].values atomic",
        ATOMIC_BY_DEFAULT,
    ),
    (
        "workspaces.tenant.otterscale.io",
        Side::OnlyUpstream,
        "listtype spec.resourceQuota.scopes atomic",
        ATOMIC_BY_DEFAULT,
    ),
];

/// Facts of one CRD; schema nodes at a path in `cuts` are reduced to their type.
fn facts(crd: &Value, cuts: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let spec = &crd["spec"];
    out.insert(format!(
        "scope {}",
        spec["scope"].as_str().unwrap_or_default()
    ));
    out.insert(format!(
        "listkind {}",
        spec["names"]["listKind"].as_str().unwrap_or_default()
    ));
    for category in spec["names"]["categories"].as_array().into_iter().flatten() {
        out.insert(format!(
            "category {}",
            category.as_str().unwrap_or_default()
        ));
    }
    for short in spec["names"]["shortNames"].as_array().into_iter().flatten() {
        out.insert(format!("shortname {}", short.as_str().unwrap_or_default()));
    }
    let version = &spec["versions"][0];
    if version["subresources"]["status"].is_object() {
        out.insert("subresource status".to_owned());
    }
    for column in version["additionalPrinterColumns"]
        .as_array()
        .into_iter()
        .flatten()
    {
        out.insert(format!(
            "column {}|{}|{}|{}",
            column["name"].as_str().unwrap_or_default(),
            column["type"].as_str().unwrap_or_default(),
            column["jsonPath"].as_str().unwrap_or_default(),
            column["priority"].as_i64().unwrap_or(0),
        ));
    }
    node_facts(&version["schema"]["openAPIV3Schema"], "", cuts, &mut out);
    out
}

fn join(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

fn node_facts(node: &Value, path: &str, cuts: &BTreeSet<String>, out: &mut BTreeSet<String>) {
    let at = if path.is_empty() { "<root>" } else { path };
    if let Some(ty) = node["type"].as_str() {
        out.insert(format!("type {at} {ty}"));
    }
    if cuts.contains(path) {
        return;
    }
    if let Some(values) = node["enum"].as_array() {
        let values: Vec<String> = values
            .iter()
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
            .collect();
        out.insert(format!("enum {at} {}", values.join("|")));
    }
    if let Some(default) = node.get("default") {
        out.insert(format!("default {at} {default}"));
    }
    if let Some(pattern) = node["pattern"].as_str() {
        out.insert(format!("pattern {at} {pattern}"));
    }
    for bound in [
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
    ] {
        if let Some(n) = node.get(bound).and_then(Value::as_f64) {
            out.insert(format!("bound {at} {bound}={n}"));
        }
    }
    if let Some(list_type) = node["x-kubernetes-list-type"].as_str() {
        out.insert(format!("listtype {at} {list_type}"));
    }
    if let Some(keys) = node["x-kubernetes-list-map-keys"].as_array() {
        let keys: Vec<&str> = keys.iter().filter_map(Value::as_str).collect();
        out.insert(format!("listkeys {at} {}", keys.join(",")));
    }
    if node["x-kubernetes-preserve-unknown-fields"] == true {
        out.insert(format!("preserve {at}"));
    }
    if node["x-kubernetes-int-or-string"] == true {
        out.insert(format!("int-or-string {at}"));
    }
    for rule in node["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
    {
        out.insert(format!(
            "cel {at} {} => {}",
            rule["rule"].as_str().unwrap_or_default(),
            rule["message"].as_str().unwrap_or_default()
        ));
    }
    for name in node["required"].as_array().into_iter().flatten() {
        out.insert(format!(
            "required {}",
            join(path, name.as_str().unwrap_or_default())
        ));
    }
    if let Some(props) = node["properties"].as_object() {
        for (name, child) in props {
            let child_path = join(path, name);
            out.insert(format!("property {child_path}"));
            node_facts(child, &child_path, cuts, out);
        }
    }
    if node["items"].is_object() {
        node_facts(&node["items"], &format!("{path}[]"), cuts, out);
    }
    if node["additionalProperties"].is_object() {
        node_facts(
            &node["additionalProperties"],
            &format!("{path}{{}}"),
            cuts,
            out,
        );
    }
}

/// Reads an upstream summary: its facts and its cut paths.
fn upstream(name: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let path = common::repo_root().join(format!("shared/crds/tests/upstream/{name}.txt"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut facts = BTreeSet::new();
    let mut cuts = BTreeSet::new();
    for line in text.lines().map(str::trim_end) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match line.strip_prefix("cut ") {
            Some(cut) => {
                cuts.insert(cut.to_owned());
            }
            None => {
                facts.insert(line.to_owned());
            }
        }
    }
    (facts, cuts)
}

#[test]
fn generated_crds_match_upstream_structure() {
    let mut report = Vec::new();
    let mut used = vec![false; KNOWN_DIFFERENCES.len()];
    for crd in common::crds() {
        let name = crd["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let (theirs, cuts) = upstream(&name);
        let ours = facts(&crd, &cuts);
        let sides = [
            (Side::OnlyOurs, ours.difference(&theirs)),
            (Side::OnlyUpstream, theirs.difference(&ours)),
        ];
        for (side, diff) in sides {
            for fact in diff {
                let known = KNOWN_DIFFERENCES
                    .iter()
                    .position(|(crd_name, s, f, _)| *crd_name == name && *s == side && f == fact);
                match known {
                    Some(i) => used[i] = true,
                    None => report.push(format!("{name}: {side:?}: {fact}")),
                }
            }
        }
    }
    for (i, (crd_name, side, fact, _)) in KNOWN_DIFFERENCES.iter().enumerate() {
        if !used[i] {
            report.push(format!(
                "{crd_name}: listed difference no longer occurs: {side:?}: {fact}"
            ));
        }
    }
    assert!(
        report.is_empty(),
        "differences from upstream:\n{}",
        report.join("\n")
    );
}

#[test]
fn every_known_difference_says_why() {
    for (crd, _, fact, why) in KNOWN_DIFFERENCES {
        assert!(why.len() > 20, "{crd}: `{fact}` needs a real justification");
    }
}

#[test]
fn the_extractor_sees_what_it_compares() {
    let crd = common::crd("Machine");
    let facts = facts(&crd, &BTreeSet::new());
    for expected in [
        "scope Cluster",
        "required spec.clusterRef",
        "enum spec.role controlplane|worker",
        "listkeys status.conditions type",
        "cel spec.role self == oldSelf => role is immutable",
        "property status.addresses[].address",
    ] {
        assert!(facts.contains(expected), "missing `{expected}`");
    }
}
