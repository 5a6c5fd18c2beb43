//! What the controllers and admission of a real cluster would do to objects, reduced to
//! what clients observe: pods are scheduled and Running at once, workloads report their
//! replicas ready, services get a cluster IP, secrets fold `stringData` into `data`, and
//! CustomResourceDefinitions become Established and serve their resources.

use base64::Engine;
use serde_json::{Map, Value, json};

use crate::error::{ApiError, FieldCause};
use crate::resources::{ALL_VERBS, Column, ResourceType, ScalePaths, SubresourceType};
use crate::util::{get_path, new_uid, now_rfc3339, str_at};

/// Name of the one simulated node.
pub const NODE_NAME: &str = "sim-node";

fn required(field: &str) -> FieldCause {
    FieldCause {
        reason: "FieldValueRequired",
        message: "Required value".into(),
        field: field.into(),
    }
}

/// Checks built-in kinds for the fields the apiserver insists on.
pub fn validate_builtin(rt: &ResourceType, obj: &Value) -> Result<(), ApiError> {
    let name = str_at(obj, "metadata.name").unwrap_or_default();
    let mut causes = Vec::new();
    match rt.kind.as_str() {
        "Pod" => {
            let containers = get_path(obj, "spec.containers").and_then(Value::as_array);
            match containers {
                None => causes.push(required("spec.containers")),
                Some(cs) if cs.is_empty() => causes.push(required("spec.containers")),
                Some(cs) => {
                    for (i, c) in cs.iter().enumerate() {
                        if c.get("name")
                            .and_then(Value::as_str)
                            .is_none_or(str::is_empty)
                        {
                            causes.push(required(&format!("spec.containers[{i}].name")));
                        }
                        if c.get("image")
                            .and_then(Value::as_str)
                            .is_none_or(str::is_empty)
                        {
                            causes.push(required(&format!("spec.containers[{i}].image")));
                        }
                    }
                }
            }
        }
        "Deployment" | "StatefulSet" | "ReplicaSet" | "DaemonSet" => {
            if get_path(obj, "spec.selector").is_none() {
                causes.push(required("spec.selector"));
            }
            if get_path(obj, "spec.template.spec.containers")
                .and_then(Value::as_array)
                .is_none_or(Vec::is_empty)
            {
                causes.push(required("spec.template.spec.containers"));
            }
            if let Some(r) = get_path(obj, "spec.replicas").and_then(Value::as_i64)
                && r < 0
            {
                causes.push(FieldCause {
                    reason: "FieldValueInvalid",
                    message: format!("Invalid value: {r}: must be greater than or equal to 0"),
                    field: "spec.replicas".into(),
                });
            }
        }
        _ => {}
    }
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(&rt.group, &rt.kind, name, causes))
    }
}

fn pod_ip(uid: &str) -> String {
    let n = uid
        .bytes()
        .fold(0u32, |a, b| a.wrapping_mul(31).wrapping_add(b as u32));
    format!("10.244.{}.{}", (n >> 8) % 250, n % 250 + 2)
}

/// Fills in what the scheduler and kubelet would: node, IPs, Running status.
fn pod_running(obj: &mut Value) {
    let now = now_rfc3339();
    let uid = str_at(obj, "metadata.uid").unwrap_or_default().to_string();
    let spec = obj.get_mut("spec").and_then(Value::as_object_mut);
    let mut containers = Vec::new();
    if let Some(spec) = spec {
        spec.entry("nodeName").or_insert(json!(NODE_NAME));
        spec.entry("restartPolicy").or_insert(json!("Always"));
        spec.entry("dnsPolicy").or_insert(json!("ClusterFirst"));
        spec.entry("schedulerName")
            .or_insert(json!("default-scheduler"));
        spec.entry("terminationGracePeriodSeconds")
            .or_insert(json!(30));
        spec.entry("serviceAccountName").or_insert(json!("default"));
        if let Some(cs) = spec.get_mut("containers").and_then(Value::as_array_mut) {
            for c in cs.iter_mut() {
                if let Some(m) = c.as_object_mut() {
                    m.entry("imagePullPolicy").or_insert(json!("IfNotPresent"));
                    m.entry("terminationMessagePath")
                        .or_insert(json!("/dev/termination-log"));
                    m.entry("terminationMessagePolicy").or_insert(json!("File"));
                }
                containers.push((
                    c.get("name")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                    c.get("image")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                ));
            }
        }
    }
    let statuses: Vec<Value> = containers
        .iter()
        .map(|(name, image)| {
            json!({
                "name": name,
                "image": image,
                "imageID": format!("{image}@sha256:0000000000000000000000000000000000000000000000000000000000000000"),
                "containerID": format!("containerd://{}", uid.replace('-', "")),
                "ready": true,
                "started": true,
                "restartCount": 0,
                "state": { "running": { "startedAt": now } },
                "lastState": {}
            })
        })
        .collect();
    let cond = |t: &str| json!({ "type": t, "status": "True", "lastProbeTime": null, "lastTransitionTime": now });
    let ip = pod_ip(&uid);
    obj["status"] = json!({
        "phase": "Running",
        "conditions": [cond("PodReadyToStartContainers"), cond("Initialized"), cond("Ready"), cond("ContainersReady"), cond("PodScheduled")],
        "hostIP": "10.0.0.10",
        "hostIPs": [{ "ip": "10.0.0.10" }],
        "podIP": ip,
        "podIPs": [{ "ip": ip }],
        "startTime": now,
        "qosClass": "BestEffort",
        "containerStatuses": statuses,
    });
}

/// Workload status as if every replica were up to date and ready.
fn workload_status(obj: &mut Value) {
    let replicas = get_path(obj, "spec.replicas")
        .and_then(Value::as_i64)
        .unwrap_or(1);
    if let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) {
        spec.entry("replicas").or_insert(json!(replicas));
    }
    let generation = get_path(obj, "metadata.generation")
        .cloned()
        .unwrap_or(json!(1));
    let selector = get_path(obj, "spec.selector.matchLabels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default();
    let now = now_rfc3339();
    let mut status = json!({
        "observedGeneration": generation,
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": replicas,
        "availableReplicas": replicas,
        "selector": selector,
    });
    if obj.get("kind").and_then(Value::as_str) == Some("Deployment") {
        status["conditions"] = json!([
            { "type": "Available", "status": "True", "reason": "MinimumReplicasAvailable", "message": "Deployment has minimum availability.", "lastUpdateTime": now, "lastTransitionTime": now },
            { "type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable", "message": "ReplicaSet has successfully progressed.", "lastUpdateTime": now, "lastTransitionTime": now }
        ]);
    }
    if obj.get("kind").and_then(Value::as_str) == Some("StatefulSet") {
        status["currentReplicas"] = json!(replicas);
        status["currentRevision"] = json!("rev-1");
        status["updateRevision"] = json!("rev-1");
    }
    obj["status"] = status;
}

/// Kind-specific defaults on create.
pub fn on_create(rt: &ResourceType, obj: &mut Value) {
    if !rt.builtin {
        return;
    }
    match rt.kind.as_str() {
        "Pod" => pod_running(obj),
        "Deployment" | "StatefulSet" | "ReplicaSet" | "DaemonSet" => workload_status(obj),
        "Namespace" => {
            let name = str_at(obj, "metadata.name").unwrap_or_default().to_string();
            if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                let labels = meta.entry("labels").or_insert_with(|| json!({}));
                if let Some(l) = labels.as_object_mut() {
                    l.insert("kubernetes.io/metadata.name".into(), json!(name));
                }
            }
            obj["spec"] = json!({ "finalizers": ["kubernetes"] });
            obj["status"] = json!({ "phase": "Active" });
        }
        "Service" => {
            let uid = str_at(obj, "metadata.uid").unwrap_or_default().to_string();
            let n = uid
                .bytes()
                .fold(7u32, |a, b| a.wrapping_mul(33).wrapping_add(b as u32));
            if let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) {
                spec.entry("type").or_insert(json!("ClusterIP"));
                let ip = format!("10.96.{}.{}", (n >> 8) % 250, n % 250 + 2);
                spec.entry("clusterIP").or_insert(json!(ip.clone()));
                spec.entry("clusterIPs").or_insert(json!([ip]));
                spec.entry("sessionAffinity").or_insert(json!("None"));
                if let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) {
                    for p in ports {
                        if let Some(m) = p.as_object_mut() {
                            m.entry("protocol").or_insert(json!("TCP"));
                            let port = m.get("port").cloned().unwrap_or(Value::Null);
                            m.entry("targetPort").or_insert(port);
                        }
                    }
                }
            }
            obj["status"] = json!({ "loadBalancer": {} });
        }
        "Node" => {
            let now = now_rfc3339();
            obj["status"] = json!({
                "conditions": [{ "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status", "lastHeartbeatTime": now, "lastTransitionTime": now }],
                "addresses": [{ "type": "InternalIP", "address": "10.0.0.10" }, { "type": "Hostname", "address": NODE_NAME }],
                "nodeInfo": { "kubeletVersion": crate::discovery::GIT_VERSION, "architecture": "amd64", "operatingSystem": "linux", "containerRuntimeVersion": "containerd://2.0.0", "osImage": "kube-sim", "kernelVersion": "6.0.0", "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": "" },
                "capacity": { "cpu": "2", "memory": "4Gi", "pods": "110" },
                "allocatable": { "cpu": "2", "memory": "4Gi", "pods": "110" }
            });
        }
        "CustomResourceDefinition" => crd_status(obj),
        _ => {}
    }
    normalize_secret(rt, obj);
}

/// Kind-specific reactions to an update (status follows spec).
pub fn on_update(rt: &ResourceType, obj: &mut Value) {
    if !rt.builtin {
        return;
    }
    match rt.kind.as_str() {
        "Deployment" | "StatefulSet" | "ReplicaSet" | "DaemonSet" => workload_status(obj),
        "CustomResourceDefinition" => crd_status(obj),
        _ => {}
    }
    normalize_secret(rt, obj);
}

fn normalize_secret(rt: &ResourceType, obj: &mut Value) {
    if rt.kind != "Secret" {
        return;
    }
    let Some(m) = obj.as_object_mut() else { return };
    m.entry("type").or_insert(json!("Opaque"));
    if let Some(Value::Object(sd)) = m.remove("stringData") {
        let data = m.entry("data").or_insert_with(|| json!({}));
        if let Some(d) = data.as_object_mut() {
            for (k, v) in sd {
                let s = v.as_str().unwrap_or_default();
                d.insert(
                    k,
                    json!(base64::engine::general_purpose::STANDARD.encode(s)),
                );
            }
        }
    }
}

fn crd_status(obj: &mut Value) {
    let now = now_rfc3339();
    let names = get_path(obj, "spec.names").cloned().unwrap_or(json!({}));
    let stored: Vec<Value> = get_path(obj, "spec.versions")
        .and_then(Value::as_array)
        .map(|vs| {
            vs.iter()
                .filter(|v| v.get("storage") == Some(&json!(true)))
                .filter_map(|v| v.get("name").cloned())
                .collect()
        })
        .unwrap_or_default();
    obj["status"] = json!({
        "acceptedNames": names,
        "conditions": [
            { "type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found", "lastTransitionTime": now },
            { "type": "Established", "status": "True", "reason": "InitialNamesAccepted", "message": "the initial names have been accepted", "lastTransitionTime": now }
        ],
        "storedVersions": stored,
    });
}

/// Checks a CRD's names and versions enough to serve it.
pub fn validate_crd(obj: &Value) -> Result<(), ApiError> {
    let name = str_at(obj, "metadata.name").unwrap_or_default();
    let mut causes = Vec::new();
    let group = str_at(obj, "spec.group").unwrap_or_default();
    let plural = str_at(obj, "spec.names.plural").unwrap_or_default();
    for (f, v) in [
        ("spec.group", group),
        ("spec.names.plural", plural),
        (
            "spec.names.kind",
            str_at(obj, "spec.names.kind").unwrap_or_default(),
        ),
    ] {
        if v.is_empty() {
            causes.push(required(f));
        }
    }
    if !group.is_empty() && !plural.is_empty() && name != format!("{plural}.{group}") {
        causes.push(FieldCause {
            reason: "FieldValueInvalid",
            message: format!(
                "Invalid value: \"{name}\": must be spec.names.plural+\".\"+spec.group"
            ),
            field: "metadata.name".into(),
        });
    }
    let versions = get_path(obj, "spec.versions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if versions.is_empty() {
        causes.push(required("spec.versions"));
    } else if versions
        .iter()
        .filter(|v| v.get("storage") == Some(&json!(true)))
        .count()
        != 1
    {
        causes.push(FieldCause {
            reason: "FieldValueInvalid",
            message: "Invalid value: must have exactly one version marked as storage version"
                .into(),
            field: "spec.versions".into(),
        });
    }
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "apiextensions.k8s.io",
            "CustomResourceDefinition",
            name,
            causes,
        ))
    }
}

/// The resource types a CRD serves (one per served version).
pub fn crd_resource_types(crd: &Value) -> (String, String, Vec<ResourceType>) {
    let group = str_at(crd, "spec.group").unwrap_or_default().to_string();
    let names = get_path(crd, "spec.names").cloned().unwrap_or(json!({}));
    let plural = names
        .get("plural")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let kind = names
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let singular = names
        .get("singular")
        .and_then(Value::as_str)
        .map(String::from)
        .unwrap_or_else(|| kind.to_lowercase());
    let strs = |v: Option<&Value>| -> Vec<String> {
        v.and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    let short_names = strs(names.get("shortNames"));
    let categories = strs(names.get("categories"));
    let namespaced = str_at(crd, "spec.scope") != Some("Cluster");
    let mut out = Vec::new();
    for v in get_path(crd, "spec.versions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
    {
        if v.get("served") == Some(&json!(false)) {
            continue;
        }
        let version = v
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let mut subresources = Vec::new();
        let mut scale = None;
        if v.pointer("/subresources/status").is_some() {
            subresources.push(SubresourceType {
                name: "status".into(),
                group: group.clone(),
                version: version.clone(),
                kind: kind.clone(),
                verbs: vec!["get".into(), "patch".into(), "update".into()],
            });
        }
        if let Some(s) = v.pointer("/subresources/scale") {
            subresources.push(SubresourceType {
                name: "scale".into(),
                group: "autoscaling".into(),
                version: "v1".into(),
                kind: "Scale".into(),
                verbs: vec!["get".into(), "patch".into(), "update".into()],
            });
            scale = Some(ScalePaths {
                spec_replicas: s
                    .get("specReplicasPath")
                    .and_then(Value::as_str)
                    .unwrap_or(".spec.replicas")
                    .into(),
                status_replicas: s
                    .get("statusReplicasPath")
                    .and_then(Value::as_str)
                    .unwrap_or(".status.replicas")
                    .into(),
                label_selector: s
                    .get("labelSelectorPath")
                    .and_then(Value::as_str)
                    .map(String::from),
            });
        }
        let columns = v
            .get("additionalPrinterColumns")
            .and_then(Value::as_array)
            .map(|cols| {
                cols.iter()
                    .filter_map(|c| {
                        Some(Column {
                            name: c.get("name")?.as_str()?.to_string(),
                            path: c.get("jsonPath")?.as_str()?.to_string(),
                            priority: c
                                .get("priority")
                                .and_then(Value::as_u64)
                                .unwrap_or(0)
                                .min(9) as u8,
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.push(ResourceType {
            group: group.clone(),
            version,
            plural: plural.clone(),
            singular: singular.clone(),
            kind: kind.clone(),
            namespaced,
            verbs: ALL_VERBS.iter().map(|s| s.to_string()).collect(),
            short_names: short_names.clone(),
            categories: categories.clone(),
            subresources,
            builtin: false,
            schema: v.pointer("/schema/openAPIV3Schema").cloned(),
            scale,
            columns,
        });
    }
    (group, plural, out)
}

/// Fresh server-set metadata for a new object.
pub fn stamp_new(obj: &mut Value) {
    let now = now_rfc3339();
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("uid".into(), json!(new_uid()));
        meta.insert("creationTimestamp".into(), json!(now));
        meta.insert("generation".into(), json!(1));
        meta.remove("deletionTimestamp");
        meta.remove("deletionGracePeriodSeconds");
        meta.remove("selfLink");
    }
}

/// Does anything besides metadata and status differ (so `generation` goes up)?
pub fn spec_changed(old: &Value, new: &Value) -> bool {
    let strip = |v: &Value| -> Map<String, Value> {
        let mut m = v.as_object().cloned().unwrap_or_default();
        m.remove("metadata");
        m.remove("status");
        m
    };
    strip(old) != strip(new)
}

/// Kinds whose strategy maintains `metadata.generation` (custom resources always do).
pub fn uses_generation(rt: &ResourceType) -> bool {
    !rt.builtin
        || matches!(
            rt.kind.as_str(),
            "Deployment"
                | "StatefulSet"
                | "ReplicaSet"
                | "DaemonSet"
                | "Job"
                | "CustomResourceDefinition"
        )
}
