//! Discovery documents: `/version`, legacy `/api`, `/apis`, per group-version resource
//! lists, and the aggregated `apidiscovery.k8s.io` v2 (and v2beta1) lists that kubectl 1.30+
//! and kube-rs `run_aggregated` ask for through the Accept header.

use serde_json::{Value, json};

use crate::resources::{Registry, ResourceType, version_priority};

/// The Kubernetes version the server claims to be.
pub const MAJOR: &str = "1";
pub const MINOR: &str = "33";
pub const GIT_VERSION: &str = "v1.33.0";

pub fn version() -> Value {
    json!({
        "major": MAJOR,
        "minor": MINOR,
        "gitVersion": GIT_VERSION,
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64"
    })
}

/// Which aggregated discovery version the Accept header asks for, if any.
pub fn aggregated_version(accept: &str) -> Option<&'static str> {
    // Accept lists alternatives in preference order; take the first aggregated one.
    for part in accept.split(',') {
        let p = part.replace(' ', "");
        if p.contains("g=apidiscovery.k8s.io") && p.contains("as=APIGroupDiscoveryList") {
            if p.contains("v=v2beta1") {
                return Some("v2beta1");
            }
            if p.contains("v=v2") {
                return Some("v2");
            }
        }
    }
    None
}

pub fn api_versions(server_addr: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{ "clientCIDR": "0.0.0.0/0", "serverAddress": server_addr }]
    })
}

fn group_entry(name: &str, versions: &[String]) -> Value {
    let vs: Vec<Value> = versions
        .iter()
        .map(|v| json!({ "groupVersion": format!("{name}/{v}"), "version": v }))
        .collect();
    json!({ "name": name, "versions": vs, "preferredVersion": vs.first().cloned().unwrap_or(Value::Null) })
}

pub fn api_group_list(reg: &Registry) -> Value {
    let groups: Vec<Value> = reg
        .groups()
        .into_iter()
        .filter(|(g, _)| !g.is_empty())
        .map(|(g, vs)| group_entry(&g, &vs))
        .collect();
    json!({ "kind": "APIGroupList", "apiVersion": "v1", "groups": groups })
}

pub fn api_group(reg: &Registry, group: &str) -> Option<Value> {
    let (g, vs) = reg.groups().into_iter().find(|(g, _)| g == group)?;
    let mut v = group_entry(&g, &vs);
    v["kind"] = json!("APIGroup");
    v["apiVersion"] = json!("v1");
    Some(v)
}

pub fn resource_list(reg: &Registry, group: &str, version: &str) -> Option<Value> {
    if !reg.has_group_version(group, version) {
        return None;
    }
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    let mut resources = Vec::new();
    for r in reg
        .all()
        .iter()
        .filter(|r| r.group == group && r.version == version)
    {
        let mut e = json!({
            "name": r.plural,
            "singularName": r.singular,
            "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": r.verbs,
        });
        if !r.short_names.is_empty() {
            e["shortNames"] = json!(r.short_names);
        }
        if !r.categories.is_empty() {
            e["categories"] = json!(r.categories);
        }
        resources.push(e);
        for s in &r.subresources {
            let mut e = json!({
                "name": format!("{}/{}", r.plural, s.name),
                "singularName": "",
                "namespaced": r.namespaced,
                "kind": s.kind,
                "verbs": s.verbs,
            });
            if s.group != r.group || s.version != r.version {
                e["group"] = json!(s.group);
                e["version"] = json!(s.version);
            }
            resources.push(e);
        }
    }
    Some(
        json!({ "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources }),
    )
}

fn aggregated_resource(r: &ResourceType) -> Value {
    let subs: Vec<Value> = r
        .subresources
        .iter()
        .map(|s| {
            json!({
                "subresource": s.name,
                "responseKind": { "group": s.group, "version": s.version, "kind": s.kind },
                "verbs": s.verbs,
            })
        })
        .collect();
    let mut e = json!({
        "resource": r.plural,
        "responseKind": { "group": r.group, "version": r.version, "kind": r.kind },
        "scope": if r.namespaced { "Namespaced" } else { "Cluster" },
        "singularResource": r.singular,
        "verbs": r.verbs,
    });
    if !r.short_names.is_empty() {
        e["shortNames"] = json!(r.short_names);
    }
    if !r.categories.is_empty() {
        e["categories"] = json!(r.categories);
    }
    if !subs.is_empty() {
        e["subresources"] = json!(subs);
    }
    e
}

/// `APIGroupDiscoveryList` for `/api` (core only) or `/apis` (every other group).
pub fn aggregated(reg: &Registry, core: bool, api_version: &str) -> Value {
    let all = reg.all();
    let mut items = Vec::new();
    for (g, versions) in reg.groups() {
        if g.is_empty() != core {
            continue;
        }
        let mut vs: Vec<Value> = Vec::new();
        let mut sorted = versions.clone();
        sorted.sort_by_key(|v| std::cmp::Reverse(version_priority(v)));
        for v in sorted {
            let resources: Vec<Value> = all
                .iter()
                .filter(|r| r.group == g && r.version == v)
                .map(aggregated_resource)
                .collect();
            vs.push(json!({ "version": v, "resources": resources, "freshness": "Current" }));
        }
        items.push(json!({ "metadata": { "name": g, "creationTimestamp": null }, "versions": vs }));
    }
    json!({
        "kind": "APIGroupDiscoveryList",
        "apiVersion": format!("apidiscovery.k8s.io/{api_version}"),
        "metadata": {},
        "items": items
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_negotiation() {
        let kubectl = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,application/json";
        assert_eq!(aggregated_version(kubectl), Some("v2"));
        assert_eq!(aggregated_version("application/json, */*"), None);
    }

    #[test]
    fn documents_list_subresources() {
        let reg = Registry::new();
        let core = resource_list(&reg, "", "v1").unwrap();
        let names: Vec<&str> = core["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        assert!(names.contains(&"pods/exec") && names.contains(&"pods/log"));
        let apps = resource_list(&reg, "apps", "v1").unwrap();
        let scale = apps["resources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == "deployments/scale")
            .unwrap();
        assert_eq!(scale["group"], "autoscaling");
        let agg = aggregated(&reg, false, "v2");
        assert!(
            agg["items"]
                .as_array()
                .unwrap()
                .iter()
                .any(|g| g["metadata"]["name"] == "apps")
        );
        assert!(
            api_group_list(&reg)["groups"]
                .as_array()
                .unwrap()
                .iter()
                .all(|g| g["name"] != "")
        );
    }
}
