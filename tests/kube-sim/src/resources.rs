//! The resource types the server knows: the built-in kinds and those that
//! CustomResourceDefinitions add while it runs. Discovery, OpenAPI and routing all read
//! this one table.

use std::sync::RwLock;

use serde_json::Value;

/// Standard verbs of a fully served resource.
pub const ALL_VERBS: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

/// A named subresource of a resource (`status`, `scale`, `log`, ...).
#[derive(Debug, Clone)]
pub struct SubresourceType {
    pub name: String,
    /// Group/version/kind of what the subresource returns.
    pub group: String,
    pub version: String,
    pub kind: String,
    pub verbs: Vec<String>,
}

/// How a resource's `scale` subresource maps onto the object (CRDs choose the paths).
#[derive(Debug, Clone)]
pub struct ScalePaths {
    pub spec_replicas: String,
    pub status_replicas: String,
    pub label_selector: Option<String>,
}

/// A Table column: a title, the JSON path of its value, and its priority (0: always shown,
/// 1: only with `-o wide`).
#[derive(Debug, Clone)]
pub struct Column {
    pub name: String,
    pub path: String,
    pub priority: u8,
}

fn col(name: &str, path: &str, priority: u8) -> Column {
    Column {
        name: name.into(),
        path: path.into(),
        priority,
    }
}

/// One served resource at one group/version.
#[derive(Debug, Clone)]
pub struct ResourceType {
    pub group: String,
    pub version: String,
    pub plural: String,
    pub singular: String,
    pub kind: String,
    pub namespaced: bool,
    pub verbs: Vec<String>,
    pub short_names: Vec<String>,
    pub categories: Vec<String>,
    pub subresources: Vec<SubresourceType>,
    /// Built-in kinds get strategic merge patch; custom resources get 415 for it.
    pub builtin: bool,
    /// For custom resources: the version's `openAPIV3Schema`.
    pub schema: Option<Value>,
    pub scale: Option<ScalePaths>,
    /// Printer columns for Table output, beyond NAME (and AGE for built-ins).
    pub columns: Vec<Column>,
}

impl ResourceType {
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }

    pub fn has_sub(&self, name: &str) -> bool {
        self.subresources.iter().any(|s| s.name == name)
    }

    pub fn has_status(&self) -> bool {
        self.has_sub("status")
    }
}

fn sub(name: &str, group: &str, version: &str, kind: &str, verbs: &[&str]) -> SubresourceType {
    SubresourceType {
        name: name.into(),
        group: group.into(),
        version: version.into(),
        kind: kind.into(),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
    }
}

struct Spec<'a> {
    group: &'a str,
    version: &'a str,
    plural: &'a str,
    kind: &'a str,
    namespaced: bool,
    short: &'a [&'a str],
    subs: &'a [&'a str],
    verbs: &'a [&'a str],
}

fn builtin(s: Spec<'_>) -> ResourceType {
    let mut subresources = Vec::new();
    for name in s.subs {
        let st = match *name {
            "status" => sub(
                "status",
                s.group,
                s.version,
                s.kind,
                &["get", "patch", "update"],
            ),
            "scale" => sub(
                "scale",
                "autoscaling",
                "v1",
                "Scale",
                &["get", "patch", "update"],
            ),
            "log" => sub("log", "", "v1", "Pod", &["get"]),
            "exec" => sub("exec", "", "v1", "PodExecOptions", &["create", "get"]),
            "attach" => sub("attach", "", "v1", "PodAttachOptions", &["create", "get"]),
            "portforward" => sub(
                "portforward",
                "",
                "v1",
                "PodPortForwardOptions",
                &["create", "get"],
            ),
            "eviction" => sub("eviction", "policy", "v1", "Eviction", &["create"]),
            "binding" => sub("binding", "", "v1", "Binding", &["create"]),
            "ephemeralcontainers" => sub(
                "ephemeralcontainers",
                "",
                "v1",
                "Pod",
                &["get", "patch", "update"],
            ),
            "finalize" => sub("finalize", "", "v1", "Namespace", &["update"]),
            "token" => sub(
                "token",
                "authentication.k8s.io",
                "v1",
                "TokenRequest",
                &["create"],
            ),
            "proxy" => sub(
                "proxy",
                "",
                "v1",
                "ServiceProxyOptions",
                &["create", "delete", "get", "patch", "update"],
            ),
            other => sub(
                other,
                s.group,
                s.version,
                s.kind,
                &["get", "patch", "update"],
            ),
        };
        subresources.push(st);
    }
    let scale = s.subs.contains(&"scale").then(|| ScalePaths {
        spec_replicas: ".spec.replicas".into(),
        status_replicas: ".status.replicas".into(),
        label_selector: Some(".status.selector".into()),
    });
    let columns: Vec<Column> = match s.kind {
        "Pod" => vec![
            col("Ready", ".status.ready", 0),
            col("Status", ".status.phase", 0),
            col("Restarts", ".status.restarts", 0),
            col("IP", ".status.podIP", 1),
            col("Node", ".spec.nodeName", 1),
        ],
        "Deployment" => vec![
            col("Ready", ".status.ready", 0),
            col("Up-to-date", ".status.updatedReplicas", 0),
            col("Available", ".status.availableReplicas", 0),
            col("Containers", ".spec.template.spec.containers#names", 1),
            col("Images", ".spec.template.spec.containers#images", 1),
            col("Selector", ".status.selector", 1),
        ],
        "Service" => vec![
            col("Type", ".spec.type", 0),
            col("Cluster-IP", ".spec.clusterIP", 0),
            col("Ports", ".spec.ports#ports", 0),
        ],
        "Node" => vec![
            col("Status", ".status.ready", 0),
            col("Version", ".status.nodeInfo.kubeletVersion", 0),
        ],
        "ConfigMap" => vec![col("Data", ".data#count", 0)],
        "Secret" => vec![col("Type", ".type", 0), col("Data", ".data#count", 0)],
        "Namespace" => vec![col("Status", ".status.phase", 0)],
        _ => Vec::new(),
    };
    ResourceType {
        group: s.group.into(),
        version: s.version.into(),
        plural: s.plural.into(),
        singular: s.kind.to_lowercase(),
        kind: s.kind.into(),
        namespaced: s.namespaced,
        verbs: s.verbs.iter().map(|v| v.to_string()).collect(),
        short_names: s.short.iter().map(|v| v.to_string()).collect(),
        categories: if matches!(
            s.kind,
            "Pod" | "Service" | "Deployment" | "StatefulSet" | "ReplicaSet" | "DaemonSet"
        ) {
            vec!["all".into()]
        } else {
            Vec::new()
        },
        subresources,
        builtin: true,
        schema: None,
        scale,
        columns,
    }
}

/// The built-in kinds.
pub fn builtins() -> Vec<ResourceType> {
    const CREATE: &[&str] = &["create"];
    let specs = [
        Spec {
            group: "",
            version: "v1",
            plural: "namespaces",
            kind: "Namespace",
            namespaced: false,
            short: &["ns"],
            subs: &["status", "finalize"],
            verbs: &[
                "create", "delete", "get", "list", "patch", "update", "watch",
            ],
        },
        Spec {
            group: "",
            version: "v1",
            plural: "pods",
            kind: "Pod",
            namespaced: true,
            short: &["po"],
            subs: &[
                "status",
                "log",
                "exec",
                "attach",
                "portforward",
                "eviction",
                "binding",
                "ephemeralcontainers",
            ],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "",
            version: "v1",
            plural: "services",
            kind: "Service",
            namespaced: true,
            short: &["svc"],
            subs: &["status", "proxy"],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "",
            version: "v1",
            plural: "configmaps",
            kind: "ConfigMap",
            namespaced: true,
            short: &["cm"],
            subs: &[],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "",
            version: "v1",
            plural: "secrets",
            kind: "Secret",
            namespaced: true,
            short: &[],
            subs: &[],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "",
            version: "v1",
            plural: "events",
            kind: "Event",
            namespaced: true,
            short: &["ev"],
            subs: &[],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "",
            version: "v1",
            plural: "nodes",
            kind: "Node",
            namespaced: false,
            short: &["no"],
            subs: &["status"],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "",
            version: "v1",
            plural: "serviceaccounts",
            kind: "ServiceAccount",
            namespaced: true,
            short: &["sa"],
            subs: &["token"],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "",
            version: "v1",
            plural: "endpoints",
            kind: "Endpoints",
            namespaced: true,
            short: &["ep"],
            subs: &[],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "",
            version: "v1",
            plural: "persistentvolumeclaims",
            kind: "PersistentVolumeClaim",
            namespaced: true,
            short: &["pvc"],
            subs: &["status"],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "apps",
            version: "v1",
            plural: "deployments",
            kind: "Deployment",
            namespaced: true,
            short: &["deploy"],
            subs: &["status", "scale"],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "apps",
            version: "v1",
            plural: "statefulsets",
            kind: "StatefulSet",
            namespaced: true,
            short: &["sts"],
            subs: &["status", "scale"],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "apps",
            version: "v1",
            plural: "replicasets",
            kind: "ReplicaSet",
            namespaced: true,
            short: &["rs"],
            subs: &["status", "scale"],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "apps",
            version: "v1",
            plural: "daemonsets",
            kind: "DaemonSet",
            namespaced: true,
            short: &["ds"],
            subs: &["status"],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "batch",
            version: "v1",
            plural: "jobs",
            kind: "Job",
            namespaced: true,
            short: &[],
            subs: &["status"],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "coordination.k8s.io",
            version: "v1",
            plural: "leases",
            kind: "Lease",
            namespaced: true,
            short: &[],
            subs: &[],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "rbac.authorization.k8s.io",
            version: "v1",
            plural: "roles",
            kind: "Role",
            namespaced: true,
            short: &[],
            subs: &[],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "rbac.authorization.k8s.io",
            version: "v1",
            plural: "rolebindings",
            kind: "RoleBinding",
            namespaced: true,
            short: &[],
            subs: &[],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "rbac.authorization.k8s.io",
            version: "v1",
            plural: "clusterroles",
            kind: "ClusterRole",
            namespaced: false,
            short: &[],
            subs: &[],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "rbac.authorization.k8s.io",
            version: "v1",
            plural: "clusterrolebindings",
            kind: "ClusterRoleBinding",
            namespaced: false,
            short: &[],
            subs: &[],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "apiextensions.k8s.io",
            version: "v1",
            plural: "customresourcedefinitions",
            kind: "CustomResourceDefinition",
            namespaced: false,
            short: &["crd", "crds"],
            subs: &["status"],
            verbs: ALL_VERBS,
        },
        Spec {
            group: "authentication.k8s.io",
            version: "v1",
            plural: "selfsubjectreviews",
            kind: "SelfSubjectReview",
            namespaced: false,
            short: &[],
            subs: &[],
            verbs: CREATE,
        },
        Spec {
            group: "authorization.k8s.io",
            version: "v1",
            plural: "selfsubjectaccessreviews",
            kind: "SelfSubjectAccessReview",
            namespaced: false,
            short: &[],
            subs: &[],
            verbs: CREATE,
        },
        Spec {
            group: "authorization.k8s.io",
            version: "v1",
            plural: "selfsubjectrulesreviews",
            kind: "SelfSubjectRulesReview",
            namespaced: false,
            short: &[],
            subs: &[],
            verbs: CREATE,
        },
    ];
    specs.into_iter().map(builtin).collect()
}

/// Kinds that are only ever created and answered, never stored.
pub fn is_virtual(rt: &ResourceType) -> bool {
    rt.verbs == ["create"]
}

/// The table of served resources; CRDs add and remove entries at run time.
#[derive(Debug)]
pub struct Registry {
    types: RwLock<Vec<ResourceType>>,
}

impl Registry {
    pub fn new() -> Self {
        Self {
            types: RwLock::new(builtins()),
        }
    }

    pub fn all(&self) -> Vec<ResourceType> {
        self.types.read().map(|t| t.clone()).unwrap_or_default()
    }

    /// Looks a resource up by group, version and plural.
    pub fn find(&self, group: &str, version: &str, plural: &str) -> Option<ResourceType> {
        let t = self.types.read().ok()?;
        t.iter()
            .find(|r| r.group == group && r.version == version && r.plural == plural)
            .cloned()
    }

    /// Is this group/version served at all?
    pub fn has_group_version(&self, group: &str, version: &str) -> bool {
        self.types
            .read()
            .map(|t| t.iter().any(|r| r.group == group && r.version == version))
            .unwrap_or(false)
    }

    /// Replaces every custom resource of `group`/`plural` by `new` (CRD created or changed).
    pub fn set_custom(&self, group: &str, plural: &str, new: Vec<ResourceType>) {
        if let Ok(mut t) = self.types.write() {
            t.retain(|r| r.builtin || !(r.group == group && r.plural == plural));
            t.extend(new);
        }
    }

    /// Groups in order of first appearance, each with its versions.
    pub fn groups(&self) -> Vec<(String, Vec<String>)> {
        let mut out: Vec<(String, Vec<String>)> = Vec::new();
        for r in self.all() {
            match out.iter_mut().find(|(g, _)| *g == r.group) {
                Some((_, vs)) => {
                    if !vs.contains(&r.version) {
                        vs.push(r.version.clone());
                    }
                }
                None => out.push((r.group.clone(), vec![r.version.clone()])),
            }
        }
        for (_, vs) in out.iter_mut() {
            vs.sort_by_key(|v| std::cmp::Reverse(version_priority(v)));
        }
        out
    }
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

/// Kubernetes version ordering: GA > beta > alpha, higher numbers first.
pub fn version_priority(v: &str) -> (u8, u32, u32) {
    let rest = match v.strip_prefix('v') {
        Some(r) => r,
        None => return (0, 0, 0),
    };
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    let major: u32 = digits.parse().unwrap_or(0);
    let tail = &rest[digits.len()..];
    if tail.is_empty() {
        (3, major, 0)
    } else if let Some(n) = tail.strip_prefix("beta") {
        (2, major, n.parse().unwrap_or(0))
    } else if let Some(n) = tail.strip_prefix("alpha") {
        (1, major, n.parse().unwrap_or(0))
    } else {
        (0, major, 0)
    }
}
