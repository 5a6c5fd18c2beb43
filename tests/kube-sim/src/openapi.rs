//! OpenAPI documents: `/openapi/v3` (root and per group-version, OpenAPI 3.0) and a JSON
//! `/openapi/v2`. Built-in kinds get hand-written schemas covering their top-level fields
//! and the commonly used ones below (enough for `kubectl explain` and for kubectl to turn
//! on server-side field validation); custom resources get their CRD schema.

use serde_json::{Map, Value, json};

use crate::resources::{Registry, ResourceType};

fn s(desc: &str) -> Value {
    json!({ "type": "string", "description": desc })
}

fn obj(desc: &str, props: Value) -> Value {
    json!({ "type": "object", "description": desc, "properties": props })
}

fn int(desc: &str) -> Value {
    json!({ "type": "integer", "format": "int32", "description": desc })
}

fn string_map(desc: &str) -> Value {
    json!({ "type": "object", "description": desc, "additionalProperties": { "type": "string", "default": "" } })
}

const OBJECT_META: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta";
const LIST_META: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.ListMeta";

fn object_meta() -> Value {
    let mut m = obj(
        "ObjectMeta is metadata that all persisted resources must have, which includes all objects users must create.",
        json!({
            "name": s("Name must be unique within a namespace."),
            "generateName": s("GenerateName is an optional prefix, used by the server, to generate a unique name ONLY IF the Name field has not been provided."),
            "namespace": s("Namespace defines the space within which each name must be unique."),
            "labels": string_map("Map of string keys and values that can be used to organize and categorize (scope and select) objects."),
            "annotations": string_map("Annotations is an unstructured key value map stored with a resource that may be set by external tools to store and retrieve arbitrary metadata."),
            "uid": s("UID is the unique in time and space value for this object."),
            "resourceVersion": s("An opaque value that represents the internal version of this object."),
            "generation": json!({ "type": "integer", "format": "int64", "description": "A sequence number representing a specific generation of the desired state." }),
            "creationTimestamp": json!({ "type": "string", "format": "date-time", "description": "CreationTimestamp is a timestamp representing the server time when this object was created." }),
            "deletionTimestamp": json!({ "type": "string", "format": "date-time", "description": "DeletionTimestamp is RFC 3339 date and time at which this resource will be deleted." }),
            "deletionGracePeriodSeconds": json!({ "type": "integer", "format": "int64", "description": "Number of seconds allowed for this object to gracefully terminate before it will be removed from the system." }),
            "finalizers": json!({ "type": "array", "items": { "type": "string", "default": "" }, "description": "Must be empty before the object is deleted from the registry." }),
            "ownerReferences": json!({ "type": "array", "items": { "type": "object", "x-kubernetes-preserve-unknown-fields": true }, "description": "List of objects depended by this object." }),
            "managedFields": json!({ "type": "array", "items": { "type": "object", "x-kubernetes-preserve-unknown-fields": true }, "description": "ManagedFields maps workflow-id and version to the set of fields that are managed by that workflow." }),
            "selfLink": s("Deprecated: selfLink is a legacy read-only field that is no longer populated by the system."),
        }),
    );
    m["x-kubernetes-group-version-kind"] = json!([]);
    m
}

fn list_meta() -> Value {
    obj(
        "ListMeta describes metadata that synthetic resources must have, including lists and various status objects.",
        json!({ "resourceVersion": s("String that identifies the server's internal version of this object."), "continue": s("continue may be set if the user set a limit on the number of items returned."), "remainingItemCount": json!({ "type": "integer", "format": "int64" }) }),
    )
}

fn open(desc: &str) -> Value {
    json!({ "type": "object", "description": desc, "x-kubernetes-preserve-unknown-fields": true })
}

fn container() -> Value {
    obj(
        "A single application container that you want to run within a pod.",
        json!({
            "name": s("Name of the container specified as a DNS_LABEL."),
            "image": s("Container image name."),
            "command": json!({ "type": "array", "items": { "type": "string" }, "description": "Entrypoint array." }),
            "args": json!({ "type": "array", "items": { "type": "string" }, "description": "Arguments to the entrypoint." }),
            "env": json!({ "type": "array", "items": open("EnvVar represents an environment variable present in a Container."), "description": "List of environment variables to set in the container.", "x-kubernetes-patch-merge-key": "name", "x-kubernetes-patch-strategy": "merge" }),
            "ports": json!({ "type": "array", "items": open("ContainerPort represents a network port in a single container."), "description": "List of ports to expose from the container.", "x-kubernetes-patch-merge-key": "containerPort", "x-kubernetes-patch-strategy": "merge" }),
            "imagePullPolicy": s("Image pull policy. One of Always, Never, IfNotPresent."),
            "resources": open("Compute Resources required by this container."),
            "securityContext": open("SecurityContext defines the security options the container should be run with."),
            "volumeMounts": json!({ "type": "array", "items": open("VolumeMount describes a mounting of a Volume within a container."), "description": "Pod volumes to mount into the container's filesystem." }),
            "livenessProbe": open("Periodic probe of container liveness."),
            "readinessProbe": open("Periodic probe of container service readiness."),
            "startupProbe": open("StartupProbe indicates that the Pod has successfully initialized."),
            "workingDir": s("Container's working directory."),
            "terminationMessagePath": s("Path at which the file to which the container's termination message will be written is mounted."),
            "terminationMessagePolicy": s("Indicate how the termination message should be populated."),
            "stdin": json!({ "type": "boolean", "description": "Whether this container should allocate a buffer for stdin in the container runtime." }),
            "tty": json!({ "type": "boolean", "description": "Whether this container should allocate a TTY for itself." }),
        }),
    )
}

fn pod_spec() -> Value {
    let mut spec = obj(
        "PodSpec is a description of a pod.",
        json!({
            "containers": json!({ "type": "array", "items": container(), "description": "List of containers belonging to the pod.", "x-kubernetes-patch-merge-key": "name", "x-kubernetes-patch-strategy": "merge" }),
            "initContainers": json!({ "type": "array", "items": container(), "description": "List of initialization containers belonging to the pod." }),
            "ephemeralContainers": json!({ "type": "array", "items": open("An EphemeralContainer is a temporary container."), "description": "List of ephemeral containers run in this pod." }),
            "volumes": json!({ "type": "array", "items": open("Volume represents a named volume in a pod."), "description": "List of volumes that can be mounted by containers belonging to the pod." }),
            "nodeName": s("NodeName indicates in which node this pod is scheduled."),
            "nodeSelector": string_map("NodeSelector is a selector which must be true for the pod to fit on a node."),
            "serviceAccountName": s("ServiceAccountName is the name of the ServiceAccount to use to run this pod."),
            "serviceAccount": s("DeprecatedServiceAccount is a deprecated alias for ServiceAccountName."),
            "restartPolicy": s("Restart policy for all containers within the pod. One of Always, OnFailure, Never."),
            "terminationGracePeriodSeconds": json!({ "type": "integer", "format": "int64", "description": "Optional duration in seconds the pod needs to terminate gracefully." }),
            "dnsPolicy": s("Set DNS policy for the pod."),
            "schedulerName": s("If specified, the pod will be dispatched by specified scheduler."),
            "securityContext": open("SecurityContext holds pod-level security attributes and common container settings."),
            "affinity": open("If specified, the pod's scheduling constraints"),
            "tolerations": json!({ "type": "array", "items": open("The pod this Toleration is attached to tolerates any taint that matches."), "description": "If specified, the pod's tolerations." }),
            "hostNetwork": json!({ "type": "boolean", "description": "Host networking requested for this pod." }),
            "imagePullSecrets": json!({ "type": "array", "items": open("LocalObjectReference"), "description": "ImagePullSecrets is an optional list of references to secrets." }),
            "priorityClassName": s("If specified, indicates the pod's priority."),
            "automountServiceAccountToken": json!({ "type": "boolean", "description": "AutomountServiceAccountToken indicates whether a service account token should be automatically mounted." }),
            "enableServiceLinks": json!({ "type": "boolean", "description": "EnableServiceLinks indicates whether information about services should be injected into pod's environment variables." }),
            "hostname": s("Specifies the hostname of the Pod."),
            "subdomain": s("If specified, the fully qualified Pod hostname will be \"<hostname>.<subdomain>.<pod namespace>.svc.<cluster domain>\"."),
            "topologySpreadConstraints": json!({ "type": "array", "items": open("TopologySpreadConstraint"), "description": "TopologySpreadConstraints describes how a group of pods ought to spread across topology domains." }),
            "preemptionPolicy": s("PreemptionPolicy is the Policy for preempting pods with lower priority."),
            "priority": int("The priority value."),
            "runtimeClassName": s("RuntimeClassName refers to a RuntimeClass object."),
            "shareProcessNamespace": json!({ "type": "boolean", "description": "Share a single process namespace between all of the containers in a pod." }),
            "activeDeadlineSeconds": json!({ "type": "integer", "format": "int64", "description": "Optional duration in seconds the pod may be active on the node." }),
        }),
    );
    spec["required"] = json!(["containers"]);
    spec
}

fn template() -> Value {
    obj(
        "PodTemplateSpec describes the data a pod should have when created from a template",
        json!({ "metadata": json!({ "$ref": format!("#/components/schemas/{OBJECT_META}"), "description": "Standard object's metadata." }), "spec": pod_spec() }),
    )
}

fn label_selector() -> Value {
    obj(
        "A label selector is a label query over a set of resources.",
        json!({ "matchLabels": string_map("matchLabels is a map of {key,value} pairs."), "matchExpressions": json!({ "type": "array", "items": open("A label selector requirement"), "description": "matchExpressions is a list of label selector requirements." }) }),
    )
}

fn workload_spec(kind: &str) -> Value {
    let mut props = json!({
        "replicas": int("Number of desired pods. Defaults to 1."),
        "selector": label_selector(),
        "template": template(),
        "minReadySeconds": int("Minimum number of seconds for which a newly created pod should be ready without any of its container crashing."),
        "revisionHistoryLimit": int("The number of old history to retain to allow rollback."),
    });
    match kind {
        "Deployment" => {
            props["strategy"] =
                open("The deployment strategy to use to replace existing pods with new ones.");
            props["paused"] = json!({ "type": "boolean", "description": "Indicates that the deployment is paused." });
            props["progressDeadlineSeconds"] = int(
                "The maximum time in seconds for a deployment to make progress before it is considered to be failed.",
            );
        }
        "StatefulSet" => {
            props["serviceName"] =
                s("serviceName is the name of the service that governs this StatefulSet.");
            props["podManagementPolicy"] =
                s("podManagementPolicy controls how pods are created during initial scale up.");
            props["updateStrategy"] =
                open("updateStrategy indicates the StatefulSetUpdateStrategy.");
            props["volumeClaimTemplates"] = json!({ "type": "array", "items": open("PersistentVolumeClaim"), "description": "volumeClaimTemplates is a list of claims that pods are allowed to reference." });
            props["persistentVolumeClaimRetentionPolicy"] = open(
                "persistentVolumeClaimRetentionPolicy describes the lifecycle of persistent volume claims.",
            );
            props["ordinals"] =
                open("ordinals controls the numbering of replica indices in a StatefulSet.");
        }
        "DaemonSet" => {
            props["updateStrategy"] =
                open("An update strategy to replace existing DaemonSet pods with new pods.");
            if let Some(m) = props.as_object_mut() {
                m.remove("replicas");
            }
        }
        _ => {}
    }
    let mut spec = obj(
        &format!("{kind}Spec is the specification of the desired behavior of the {kind}."),
        props,
    );
    spec["required"] = json!(["selector", "template"]);
    spec
}

/// The top-level (non-metadata) fields of a built-in kind with their schemas.
fn builtin_fields(kind: &str) -> Vec<(&'static str, Value)> {
    let status = |k: &str| {
        open(&format!(
            "Most recently observed status of the {k}. Populated by the system. Read-only."
        ))
    };
    match kind {
        "Pod" => vec![("spec", pod_spec()), ("status", status("pod"))],
        "Deployment" | "StatefulSet" | "ReplicaSet" | "DaemonSet" => {
            vec![("spec", workload_spec(kind)), ("status", status(kind))]
        }
        "ConfigMap" => vec![
            ("data", string_map("Data contains the configuration data.")),
            (
                "binaryData",
                json!({ "type": "object", "description": "BinaryData contains the binary data.", "additionalProperties": { "type": "string", "format": "byte" } }),
            ),
            (
                "immutable",
                json!({ "type": "boolean", "description": "Immutable, if set to true, ensures that data stored in the ConfigMap cannot be updated." }),
            ),
        ],
        "Secret" => vec![
            (
                "data",
                json!({ "type": "object", "description": "Data contains the secret data.", "additionalProperties": { "type": "string", "format": "byte" } }),
            ),
            (
                "stringData",
                string_map("stringData allows specifying non-binary secret data in string form."),
            ),
            (
                "type",
                s("Used to facilitate programmatic handling of secret data."),
            ),
            (
                "immutable",
                json!({ "type": "boolean", "description": "Immutable, if set to true, ensures that data stored in the Secret cannot be updated." }),
            ),
        ],
        "Service" => vec![
            (
                "spec",
                obj(
                    "ServiceSpec describes the attributes that a user creates on a service.",
                    json!({
                        "ports": json!({ "type": "array", "items": open("ServicePort contains information on service's port."), "description": "The list of ports that are exposed by this service.", "x-kubernetes-patch-merge-key": "port", "x-kubernetes-patch-strategy": "merge" }),
                        "selector": string_map("Route service traffic to pods with label keys and values matching this selector."),
                        "type": s("type determines how the Service is exposed."),
                        "clusterIP": s("clusterIP is the IP address of the service."),
                        "clusterIPs": json!({ "type": "array", "items": { "type": "string" }, "description": "ClusterIPs is a list of IP addresses assigned to this service." }),
                        "sessionAffinity": s("Supports \"ClientIP\" and \"None\"."),
                        "externalName": s("externalName is the external reference."),
                        "ipFamilies": json!({ "type": "array", "items": { "type": "string" }, "description": "IPFamilies is a list of IP families." }),
                        "ipFamilyPolicy": s("IPFamilyPolicy represents the dual-stack-ness requested or required by this Service."),
                        "internalTrafficPolicy": s("InternalTrafficPolicy describes how nodes distribute service traffic they receive on the ClusterIP."),
                        "externalTrafficPolicy": s("externalTrafficPolicy describes how nodes distribute service traffic they receive on one of the Service's externally-facing addresses."),
                        "loadBalancerIP": s("Only applies to Service Type: LoadBalancer."),
                        "publishNotReadyAddresses": json!({ "type": "boolean", "description": "publishNotReadyAddresses indicates that any agent which deals with endpoints for this Service should disregard any indications of ready/not-ready." }),
                    }),
                ),
            ),
            ("status", status("service")),
        ],
        "Namespace" => vec![
            ("spec", open("Spec defines the behavior of the Namespace.")),
            ("status", status("namespace")),
        ],
        "Node" => vec![
            ("spec", open("Spec defines the behavior of a node.")),
            ("status", status("node")),
        ],
        "Event" => vec![
            (
                "involvedObject",
                open("The object that this event is about."),
            ),
            (
                "reason",
                s(
                    "This should be a short, machine understandable string that gives the reason for the transition into the object's current status.",
                ),
            ),
            (
                "message",
                s("A human-readable description of the status of this operation."),
            ),
            (
                "type",
                s("Type of this event (Normal, Warning), new types could be added in the future"),
            ),
            ("count", int("The number of times this event has occurred.")),
            ("source", open("The component reporting this event.")),
            (
                "firstTimestamp",
                json!({ "type": "string", "format": "date-time", "description": "The time at which the event was first recorded." }),
            ),
            (
                "lastTimestamp",
                json!({ "type": "string", "format": "date-time", "description": "The time at which the most recent occurrence of this event was recorded." }),
            ),
            (
                "eventTime",
                json!({ "type": "string", "format": "date-time", "description": "Time when this Event was first observed." }),
            ),
            (
                "action",
                s("What action was taken/failed regarding to the Regarding object."),
            ),
            (
                "reportingComponent",
                s("Name of the controller that emitted this Event."),
            ),
            ("reportingInstance", s("ID of the controller instance.")),
            (
                "related",
                open("Optional secondary object for more complex actions."),
            ),
            (
                "series",
                open(
                    "Data about the Event series this event represents or nil if it's a singleton Event.",
                ),
            ),
        ],
        "ServiceAccount" => vec![
            (
                "secrets",
                json!({ "type": "array", "items": open("ObjectReference"), "description": "Secrets is a list of the secrets in the same namespace that pods running using this ServiceAccount are allowed to use." }),
            ),
            (
                "imagePullSecrets",
                json!({ "type": "array", "items": open("LocalObjectReference"), "description": "ImagePullSecrets is a list of references to secrets in the same namespace to use for pulling any images." }),
            ),
            (
                "automountServiceAccountToken",
                json!({ "type": "boolean", "description": "AutomountServiceAccountToken indicates whether pods running as this service account should have an API token automatically mounted." }),
            ),
        ],
        "Endpoints" => vec![(
            "subsets",
            json!({ "type": "array", "items": open("EndpointSubset"), "description": "The set of all endpoints is the union of all subsets." }),
        )],
        "Role" | "ClusterRole" => vec![
            (
                "rules",
                json!({ "type": "array", "items": open("PolicyRule holds information that describes a policy rule."), "description": "Rules holds all the PolicyRules for this Role" }),
            ),
            (
                "aggregationRule",
                open(
                    "AggregationRule is an optional field that describes how to build the Rules for this ClusterRole.",
                ),
            ),
        ],
        "RoleBinding" | "ClusterRoleBinding" => vec![
            (
                "subjects",
                json!({ "type": "array", "items": open("Subject contains a reference to the object or user identities a role binding applies to."), "description": "Subjects holds references to the objects the role applies to." }),
            ),
            (
                "roleRef",
                open(
                    "RoleRef can reference a Role in the current namespace or a ClusterRole in the global namespace.",
                ),
            ),
        ],
        _ => vec![
            ("spec", open(&format!("Spec of the {kind}."))),
            ("status", status(kind)),
        ],
    }
}

/// The full schema of a kind as served at a group-version.
fn kind_schema(rt: &ResourceType) -> Value {
    let gvk = json!([{ "group": rt.group, "version": rt.version, "kind": rt.kind }]);
    let mut schema = match (&rt.schema, rt.builtin) {
        (Some(s), false) => s.clone(),
        (None, false) => json!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true }),
        _ => {
            let mut props = Map::new();
            for (k, v) in builtin_fields(&rt.kind) {
                props.insert(k.into(), v);
            }
            json!({ "type": "object", "description": format!("{} is a Kubernetes {} object.", rt.kind, rt.kind), "properties": props })
        }
    };
    if schema.get("properties").is_none() {
        schema["properties"] = json!({});
    }
    let props = schema["properties"].as_object_mut().map(|p| {
        p.insert("apiVersion".into(), s("APIVersion defines the versioned schema of this representation of an object."));
        p.insert("kind".into(), s("Kind is a string value representing the REST resource this object represents."));
        p.insert("metadata".into(), json!({ "allOf": [{ "$ref": format!("#/components/schemas/{OBJECT_META}") }], "default": {}, "description": "Standard object's metadata." }));
    });
    let _ = props;
    schema["type"] = json!("object");
    schema["x-kubernetes-group-version-kind"] = gvk;
    schema
}

fn schema_name(rt: &ResourceType) -> String {
    let group = if rt.group.is_empty() {
        "core".to_string()
    } else {
        rt.group.clone()
    };
    // Built-ins use the Go package path names kubectl knows; custom kinds the reversed group.
    if rt.builtin {
        let pkg = match rt.group.as_str() {
            "" => "io.k8s.api.core".to_string(),
            "apiextensions.k8s.io" => {
                "io.k8s.apiextensions-apiserver.pkg.apis.apiextensions".to_string()
            }
            g => format!("io.k8s.api.{}", g.split('.').next().unwrap_or(g)),
        };
        format!("{pkg}.{}.{}", rt.version, rt.kind)
    } else {
        let rev: Vec<&str> = group.split('.').rev().collect();
        format!("{}.{}.{}", rev.join("."), rt.version, rt.kind)
    }
}

/// `/openapi/v3`: one entry per served group-version.
pub fn v3_root(reg: &Registry) -> Value {
    let mut paths = Map::new();
    for (g, versions) in reg.groups() {
        for v in versions {
            let p = if g.is_empty() {
                format!("api/{v}")
            } else {
                format!("apis/{g}/{v}")
            };
            let hash = format!(
                "{:016X}",
                fxhash(&format!(
                    "{p}{}",
                    reg.all()
                        .iter()
                        .filter(|r| r.group == g && r.version == v)
                        .count()
                ))
            );
            paths.insert(
                p.clone(),
                json!({ "serverRelativeURL": format!("/openapi/v3/{p}?hash={hash}") }),
            );
        }
    }
    json!({ "paths": paths })
}

fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

fn param(name: &str, desc: &str) -> Value {
    json!({ "name": name, "in": "query", "description": desc, "schema": { "type": "string", "uniqueItems": true } })
}

/// One group-version document, e.g. `api/v1` or `apis/apps/v1`.
pub fn v3_document(reg: &Registry, gv: &str) -> Option<Value> {
    let (group, version) = match gv.split('/').collect::<Vec<_>>().as_slice() {
        ["api", v] => (String::new(), v.to_string()),
        ["apis", g, v] => (g.to_string(), v.to_string()),
        _ => return None,
    };
    let types: Vec<ResourceType> = reg
        .all()
        .into_iter()
        .filter(|r| r.group == group && r.version == version)
        .collect();
    if types.is_empty() {
        return None;
    }
    let mut schemas = Map::new();
    schemas.insert(OBJECT_META.into(), object_meta());
    schemas.insert(LIST_META.into(), list_meta());
    let mut paths = Map::new();
    let prefix = if group.is_empty() {
        format!("/api/{version}")
    } else {
        format!("/apis/{group}/{version}")
    };
    let write_params = vec![
        param(
            "dryRun",
            "When present, indicates that modifications should not be persisted.",
        ),
        param(
            "fieldManager",
            "fieldManager is a name associated with the actor or entity that is making these changes.",
        ),
        param(
            "fieldValidation",
            "fieldValidation instructs the server on how to handle objects in the request (POST/PUT/PATCH) containing unknown or duplicate fields. Valid values are: Ignore, Warn, Strict.",
        ),
    ];
    for rt in &types {
        if crate::resources::is_virtual(rt) {
            continue;
        }
        let name = schema_name(rt);
        schemas.insert(name.clone(), kind_schema(rt));
        let list_name = format!("{name}List");
        schemas.insert(
            list_name.clone(),
            json!({
                "type": "object",
                "description": format!("{}List is a list of {}.", rt.kind, rt.kind),
                "required": ["items"],
                "properties": {
                    "apiVersion": s("APIVersion defines the versioned schema of this representation of an object."),
                    "kind": s("Kind is a string value representing the REST resource this object represents."),
                    "metadata": { "allOf": [{ "$ref": format!("#/components/schemas/{LIST_META}") }], "default": {} },
                    "items": { "type": "array", "items": { "allOf": [{ "$ref": format!("#/components/schemas/{name}") }], "default": {} } }
                },
                "x-kubernetes-group-version-kind": [{ "group": rt.group, "version": rt.version, "kind": rt.list_kind() }]
            }),
        );
        let gvk = json!({ "group": rt.group, "version": rt.version, "kind": rt.kind });
        let reference = json!({ "$ref": format!("#/components/schemas/{name}") });
        let body = json!({ "content": { "*/*": { "schema": reference } }, "required": true });
        let ok = json!({ "200": { "description": "OK", "content": { "application/json": { "schema": reference } } } });
        let coll = if rt.namespaced {
            format!("{prefix}/namespaces/{{namespace}}/{}", rt.plural)
        } else {
            format!("{prefix}/{}", rt.plural)
        };
        let item = format!("{coll}/{{name}}");
        paths.insert(
            coll.clone(),
            json!({
                "get": { "description": format!("list or watch objects of kind {}", rt.kind), "operationId": format!("list{}", rt.kind), "responses": { "200": { "description": "OK", "content": { "application/json": { "schema": { "$ref": format!("#/components/schemas/{list_name}") } } } } }, "x-kubernetes-action": "list", "x-kubernetes-group-version-kind": gvk },
                "post": { "description": format!("create a {}", rt.kind), "operationId": format!("create{}", rt.kind), "requestBody": body, "responses": ok, "parameters": write_params, "x-kubernetes-action": "post", "x-kubernetes-group-version-kind": gvk }
            }),
        );
        let mut patch_params = write_params.clone();
        patch_params.push(param(
            "force",
            "Force is going to \"force\" Apply requests.",
        ));
        paths.insert(
            item,
            json!({
                "get": { "description": format!("read the specified {}", rt.kind), "operationId": format!("read{}", rt.kind), "responses": ok, "x-kubernetes-action": "get", "x-kubernetes-group-version-kind": gvk },
                "put": { "description": format!("replace the specified {}", rt.kind), "operationId": format!("replace{}", rt.kind), "requestBody": body, "responses": ok, "parameters": write_params, "x-kubernetes-action": "put", "x-kubernetes-group-version-kind": gvk },
                "patch": {
                    "description": format!("partially update the specified {}", rt.kind),
                    "operationId": format!("patch{}", rt.kind),
                    "requestBody": { "content": {
                        "application/apply-patch+yaml": { "schema": { "type": "object" } },
                        "application/json-patch+json": { "schema": { "type": "object" } },
                        "application/merge-patch+json": { "schema": { "type": "object" } },
                        "application/strategic-merge-patch+json": { "schema": { "type": "object" } }
                    }, "required": true },
                    "responses": ok,
                    "parameters": patch_params,
                    "x-kubernetes-action": "patch",
                    "x-kubernetes-group-version-kind": gvk
                },
                "delete": { "description": format!("delete a {}", rt.kind), "operationId": format!("delete{}", rt.kind), "responses": { "200": { "description": "OK" } }, "x-kubernetes-action": "delete", "x-kubernetes-group-version-kind": gvk },
                "parameters": [
                    { "name": "name", "in": "path", "required": true, "schema": { "type": "string" } }
                ]
            }),
        );
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": { "title": "Kubernetes", "version": crate::discovery::GIT_VERSION },
        "paths": paths,
        "components": { "schemas": schemas }
    }))
}

/// A JSON Swagger 2.0 document with the same definitions (`/openapi/v2` as JSON).
pub fn v2(reg: &Registry) -> Value {
    let mut defs = Map::new();
    defs.insert(OBJECT_META.into(), object_meta());
    for rt in reg.all() {
        if crate::resources::is_virtual(&rt) {
            continue;
        }
        let schema = kind_schema(&rt)
            .to_string()
            .replace("#/components/schemas/", "#/definitions/");
        if let Ok(v) = serde_json::from_str(&schema) {
            defs.insert(schema_name(&rt), v);
        }
    }
    json!({ "swagger": "2.0", "info": { "title": "Kubernetes", "version": crate::discovery::GIT_VERSION }, "paths": {}, "definitions": defs })
}

/// Top-level fields of a built-in object that its schema does not declare (Strict/Warn).
pub fn unknown_top_level(rt: &ResourceType, obj: &Value) -> Vec<String> {
    let known: Vec<&str> = builtin_fields(&rt.kind).iter().map(|(k, _)| *k).collect();
    let meta_known = object_meta();
    let mut out = Vec::new();
    if let Some(m) = obj.as_object() {
        for k in m.keys() {
            if !matches!(k.as_str(), "apiVersion" | "kind" | "metadata")
                && !known.contains(&k.as_str())
            {
                out.push(k.clone());
            }
        }
        if let Some(meta) = m.get("metadata").and_then(Value::as_object) {
            for k in meta.keys() {
                if meta_known["properties"].get(k).is_none() {
                    out.push(format!("metadata.{k}"));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_carry_gvk_and_field_validation() {
        let reg = Registry::new();
        let root = v3_root(&reg);
        assert!(
            root["paths"]["api/v1"]["serverRelativeURL"]
                .as_str()
                .unwrap()
                .starts_with("/openapi/v3/api/v1?hash=")
        );
        let doc = v3_document(&reg, "apis/apps/v1").unwrap();
        let dep = &doc["components"]["schemas"]["io.k8s.api.apps.v1.Deployment"];
        assert_eq!(
            dep["x-kubernetes-group-version-kind"][0]["kind"],
            "Deployment"
        );
        let patch =
            &doc["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]["patch"];
        assert!(
            patch["parameters"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == "fieldValidation")
        );
        assert!(v3_document(&reg, "apis/nope/v1").is_none());
    }
}
