//! Agent manifests: the YAML that joins a member cluster, and the signed,
//! expiring URL that serves it to `kubectl apply -f <url>`.
//!
//! The URL token is `<payload>.<mac>`, both base64url: the payload names the
//! cluster, the admins to bind, the expiry and the CA fingerprint; the MAC is
//! HMAC-SHA256 under a key kept in the store (so URLs survive a restart). A
//! GET verifies it, mints a join token for the cluster (its only side
//! effect) and renders the YAML. Every value in the YAML goes through a YAML
//! serializer, so a name cannot inject structure.

use std::time::Duration;

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use ring::hmac;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::{Result, store::Store, unix_now};

/// Namespace the agent runs in by default.
pub const DEFAULT_NAMESPACE: &str = "otterscale-system";
/// Image of the agent by default (tag = this build's version).
pub const DEFAULT_IMAGE: &str = "otterscale/otter-agent";
/// Longest manifest URL token accepted.
pub const MAX_TOKEN_LEN: usize = 4096;
/// Most extra admin users in one manifest.
pub const MAX_EXTRA_USERS: usize = 32;

/// What goes into one agent manifest.
#[derive(Debug, Clone)]
pub struct ManifestSpec {
    pub cluster: String,
    /// The tenant the cluster joins: its admins group is made
    /// cluster-admin, its members group may read nodes and storage
    /// classes, and the agent impersonates only its groups.
    pub tenant: String,
    /// Further users made cluster-admin of the member cluster, as the hub
    /// names them to clusters ([`cluster_user_name`]).
    pub admins: Vec<String>,
    /// User name prefixes the agent may impersonate (hub users, and the
    /// identity provider's when the hub has one).
    pub user_prefixes: Vec<String>,
    pub rancher_project_id: String,
    pub join_token: String,
    pub hub_url: String,
    pub ca_pem: String,
    pub ca_fingerprint: String,
    /// How the agent verifies the hub's API (Register, renewals).
    pub api_trust: ApiTrust,
    pub namespace: String,
    pub image: String,
}

/// What the agent trusts for the hub's API. The tunnel is always pinned to
/// the hub CA.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ApiTrust {
    /// The API shows a certificate from the hub CA.
    #[default]
    HubCa,
    /// The API's certificate comes from this CA (PEM), besides the hub CA.
    Ca(String),
    /// The API's certificate comes from a public CA.
    PublicRoots,
}

/// The key of the agent's Secret holding [`ApiTrust::Ca`]'s PEM.
const API_CA_KEY: &str = "hub-api-ca.crt";

/// The agent's Secret in its namespace: the join token, then its identity.
pub const AGENT_SECRET: &str = "otter-agent";

/// The signed content of a manifest URL.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UrlClaims {
    #[serde(rename = "c")]
    pub cluster: String,
    /// The tenant the cluster joins. URLs of older hubs: `default`.
    #[serde(rename = "t", default = "default_tenant")]
    pub tenant: String,
    #[serde(rename = "a")]
    pub admins: Vec<String>,
    #[serde(rename = "r", default)]
    pub rancher_project_id: String,
    /// Unix seconds.
    #[serde(rename = "e")]
    pub expires: i64,
    /// CA fingerprint the URL was minted under.
    #[serde(rename = "f")]
    pub ca_fingerprint: String,
    /// When the URL was minted (unix seconds): the join tokens it hands out
    /// count as authorized then. URLs of older hubs read 0.
    #[serde(rename = "i", default)]
    pub issued: i64,
    /// Labels the link gets at enrollment.
    #[serde(
        rename = "l",
        default,
        skip_serializing_if = "std::collections::BTreeMap::is_empty"
    )]
    pub labels: std::collections::BTreeMap<String, String>,
}

/// How many times one manifest URL serves its YAML: `kubectl apply -f`
/// fetches it once, a retry or a look with curl a few more. Each fetch
/// mints a join token, so an unauthenticated GET cannot mint without end.
pub const MAX_URL_FETCHES: u32 = 3;

/// The fetches of one manifest URL so far, kept until it expires.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ManifestUrlRecord {
    pub fetches: u32,
    /// Unix seconds; the record is pruned after.
    pub expires: i64,
}

/// Counts a fetch of the manifest URL `token` (already verified as
/// `claims`); `Err(UrlError::Exhausted)` once it served its fetches.
pub fn count_fetch(
    store: &dyn crate::store::Store,
    token: &str,
    claims: &UrlClaims,
) -> crate::Result<Result<(), UrlError>> {
    use crate::store::tree;
    let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let key = hex::encode(&digest.as_ref()[..16]);
    // Concurrent fetches race on the count; each retry sees a newer one.
    loop {
        let old = store.get_raw(tree::MANIFEST_URLS, &key)?;
        let fetches = match &old {
            Some(raw) => {
                crate::store::decode::<ManifestUrlRecord>(tree::MANIFEST_URLS, &key, raw)?.fetches
            }
            None => 0,
        };
        if fetches >= MAX_URL_FETCHES {
            return Ok(Err(UrlError::Exhausted(fetches)));
        }
        let new = crate::store::encode(
            tree::MANIFEST_URLS,
            &key,
            &ManifestUrlRecord {
                fetches: fetches + 1,
                expires: claims.expires,
            },
        )?;
        if store.compare_and_swap_raw(tree::MANIFEST_URLS, &key, old.as_deref(), Some(&new))? {
            store.flush()?;
            return Ok(Ok(()));
        }
    }
}

/// Why a manifest URL was refused (answered 401 with this text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    #[error("this manifest link is malformed; ask for a new one with `otter agent-manifest`")]
    Malformed,
    #[error(
        "this manifest link's signature is not valid; ask for a new one with `otter agent-manifest`"
    )]
    BadSignature,
    #[error("this manifest link has expired; ask for a new one with `otter agent-manifest`")]
    Expired,
    #[error(
        "this manifest link was made for another hub CA; ask for a new one with `otter agent-manifest`"
    )]
    OtherCa,
    #[error(
        "this manifest link has been fetched {0} times, the most one serves; ask for a new one with `otter agent-manifest`"
    )]
    Exhausted(u32),
}

/// The HMAC key of manifest URLs, created once and kept in the store.
pub fn url_key(store: &dyn Store) -> Result<hmac::Key> {
    let secret = crate::store::secret(store, "manifest-url-key")?;
    Ok(hmac::Key::new(hmac::HMAC_SHA256, &secret))
}

/// Signs claims into a URL token.
pub fn sign(key: &hmac::Key, claims: &UrlClaims) -> String {
    let payload = URL_SAFE_NO_PAD.encode(serde_json::to_vec(claims).expect("claims serialize"));
    let mac = URL_SAFE_NO_PAD.encode(hmac::sign(key, payload.as_bytes()).as_ref());
    format!("{payload}.{mac}")
}

/// Verifies a URL token (signature in constant time, then expiry and CA).
pub fn verify(key: &hmac::Key, token: &str, ca_fingerprint: &str) -> Result<UrlClaims, UrlError> {
    if token.len() > MAX_TOKEN_LEN {
        return Err(UrlError::Malformed);
    }
    let (payload, mac) = token.split_once('.').ok_or(UrlError::Malformed)?;
    let mac = URL_SAFE_NO_PAD
        .decode(mac)
        .map_err(|_| UrlError::Malformed)?;
    hmac::verify(key, payload.as_bytes(), &mac).map_err(|_| UrlError::BadSignature)?;
    let raw = URL_SAFE_NO_PAD
        .decode(payload)
        .map_err(|_| UrlError::Malformed)?;
    let claims: UrlClaims = serde_json::from_slice(&raw).map_err(|_| UrlError::Malformed)?;
    if unix_now() >= claims.expires {
        return Err(UrlError::Expired);
    }
    if claims.ca_fingerprint != ca_fingerprint {
        return Err(UrlError::OtherCa);
    }
    Ok(claims)
}

fn default_tenant() -> String {
    crate::tenancy::DEFAULT_TENANT.to_owned()
}

/// Claims for a URL valid for `ttl`.
pub fn claims(
    cluster: &str,
    tenant: &str,
    admins: &[String],
    rancher_project_id: &str,
    ttl: Duration,
    ca_fingerprint: &str,
) -> UrlClaims {
    UrlClaims {
        cluster: cluster.to_owned(),
        tenant: tenant.to_owned(),
        admins: admins.to_vec(),
        rancher_project_id: rancher_project_id.to_owned(),
        expires: unix_now() + ttl.as_secs() as i64,
        ca_fingerprint: ca_fingerprint.to_owned(),
        issued: unix_now(),
        labels: Default::default(),
    }
}

/// A Kubernetes object name for a user's binding: readable part plus a hash
/// of the exact name, so two users never share (and overwrite) a binding.
pub fn admin_binding_name(user: &str) -> String {
    let readable: String = user
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect::<String>()
        .split('-')
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("-");
    // 17 + 35 + 1 + 10 = 63: a DNS label, though binding names may be longer.
    let readable: String = readable
        .chars()
        .take(35)
        .collect::<String>()
        .trim_end_matches('-')
        .to_owned();
    let digest = ring::digest::digest(&ring::digest::SHA256, user.as_bytes());
    let hash = hex::encode(&digest.as_ref()[..5]);
    if readable.is_empty() {
        format!("otterscale-admin-{hash}")
    } else {
        format!("otterscale-admin-{readable}-{hash}")
    }
}

/// The name a cluster knows a hub user by: `otter:<name>`; a name that
/// already carries a prefix (an identity provider's `oidc:…`) as it is.
pub fn cluster_user_name(user: &str) -> String {
    if user.contains(':') {
        user.to_owned()
    } else {
        format!("otter:{user}")
    }
}

/// Checks what goes into a manifest that the caller supplied.
pub fn validate_users(users: &[String]) -> crate::Result<()> {
    let invalid = |why: String| Err(crate::HubError::Invalid(why));
    if users.len() > MAX_EXTRA_USERS {
        return invalid(format!("at most {MAX_EXTRA_USERS} extra users"));
    }
    for u in users {
        if u.starts_with("system:") {
            return invalid("a manifest binds no system: user".to_owned());
        }
        if u.is_empty() || u.len() > 253 || u.chars().any(char::is_control) {
            // Only the start of the name goes back: the answer carries it in
            // a header, and an echo of a huge name would be refused as too
            // large by the caller's HTTP/2 stack instead of explained.
            let start: String = u.chars().take(64).collect();
            let more = if u.chars().count() > 64 { "…" } else { "" };
            return invalid(format!(
                "user name {start:?}{more} must be 1 to 253 printable characters"
            ));
        }
    }
    Ok(())
}

/// Renders the multi-document YAML.
/// The agent Secret's first content: the join token and the CAs to trust.
fn secret_data(spec: &ManifestSpec) -> serde_json::Value {
    let mut data = json!({ "join-token": spec.join_token, "hub-ca.crt": spec.ca_pem });
    if let ApiTrust::Ca(pem) = &spec.api_trust {
        data[API_CA_KEY] = json!(pem);
    }
    data
}

/// The Secret's keys mounted as files: the CAs.
fn mounted_keys(spec: &ManifestSpec) -> serde_json::Value {
    let mut keys = vec![json!({ "key": "hub-ca.crt", "path": "hub-ca.crt" })];
    if let ApiTrust::Ca(_) = spec.api_trust {
        keys.push(json!({ "key": API_CA_KEY, "path": API_CA_KEY }));
    }
    json!(keys)
}

pub fn render(spec: &ManifestSpec) -> String {
    let ns = spec.namespace.as_str();
    let members_group = format!("otter:{}:members", spec.tenant);
    let admins_group = format!("otter:{}:admins", spec.tenant);
    let labels = json!({ "app.kubernetes.io/name": "otter-agent", "app.kubernetes.io/part-of": "otterscale" });
    let mut docs: Vec<Value> = vec![
        json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": { "name": ns, "labels": {
                "app.kubernetes.io/part-of": "otterscale",
                // Talos enforces Pod Security; the agent passes `restricted`.
                "pod-security.kubernetes.io/enforce": "restricted",
            }},
        }),
        json!({
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": { "name": "otter-agent", "namespace": ns, "labels": labels },
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": { "name": "otterscale:agent", "labels": labels },
            // The agent acts only as its callers (users and groups; never
            // a uid or extras): impersonation is all it needs.
            "rules": [
                { "apiGroups": [""], "resources": ["users", "groups"], "verbs": ["impersonate"] },
            ],
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": { "name": "otterscale:agent", "labels": labels },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "otterscale:agent" },
            "subjects": [{ "kind": "ServiceAccount", "name": "otter-agent", "namespace": ns }],
        }),
        // What every member of the tenant may read; nothing is granted to
        // `system:authenticated`, which every caller of every tenant has.
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": { "name": "otterscale:members-read", "labels": labels },
            "rules": [
                { "apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"] },
                { "apiGroups": ["storage.k8s.io"], "resources": ["storageclasses"], "verbs": ["get", "list", "watch"] },
            ],
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": { "name": "otterscale:members-read", "labels": labels },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "otterscale:members-read" },
            "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": members_group }],
        }),
        // The tenant's admins at the hub are the cluster's admins.
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": { "name": "otterscale:tenant-admins", "labels": labels },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin" },
            "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": admins_group }],
        }),
    ];
    for user in &spec.admins {
        docs.push(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": { "name": admin_binding_name(user), "labels": labels,
                          "annotations": { "otterscale.io/user": user } },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin" },
            "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user }],
        }));
    }
    // The agent's own Secret: the join token until it enrolled, then its
    // identity (key, certificate, the hub's CAs), which outlives any pod.
    docs.push(json!({
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": { "name": AGENT_SECRET, "namespace": ns, "labels": labels },
        "stringData": secret_data(spec),
    }));
    // What the agent may do as itself: read and patch that one Secret.
    docs.push(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": { "name": "otterscale:agent-identity", "namespace": ns, "labels": labels },
        "rules": [
            { "apiGroups": [""], "resources": ["secrets"], "resourceNames": [AGENT_SECRET], "verbs": ["get", "patch", "update"] },
        ],
    }));
    docs.push(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": { "name": "otterscale:agent-identity", "namespace": ns, "labels": labels },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "otterscale:agent-identity" },
        "subjects": [{ "kind": "ServiceAccount", "name": "otter-agent", "namespace": ns }],
    }));
    let mut env = json!([
        { "name": "OTTER_HUB_URL", "value": spec.hub_url },
        { "name": "OTTER_CLUSTER", "value": spec.cluster },
        { "name": "OTTER_RANCHER_PROJECT_ID", "value": spec.rancher_project_id },
        { "name": "OTTER_HUB_CA_FINGERPRINT", "value": spec.ca_fingerprint },
        { "name": "OTTER_HUB_CA_FILE", "value": "/etc/otter/join/hub-ca.crt" },
        { "name": "OTTER_STATE_SECRET", "value": AGENT_SECRET },
        { "name": "OTTER_HEALTH_LISTEN", "value": "0.0.0.0:8080" },
        // The ceiling: whom the agent agrees to impersonate. The customer
        // owns it (it is in what they applied); the hub cannot widen it.
        { "name": "OTTER_ALLOW_USER_PREFIXES", "value": spec.user_prefixes.join(",") },
        { "name": "OTTER_ALLOW_GROUP_PREFIXES", "value": format!("otter:{}:", spec.tenant) },
        { "name": "POD_NAME", "valueFrom": { "fieldRef": { "fieldPath": "metadata.name" } } },
        { "name": "POD_NAMESPACE", "valueFrom": { "fieldRef": { "fieldPath": "metadata.namespace" } } },
    ]);
    // How the agent verifies the API, when not by the hub CA.
    let api_trust = match &spec.api_trust {
        ApiTrust::HubCa => None,
        ApiTrust::Ca(_) => Some(
            json!({ "name": "OTTER_HUB_API_CA_FILE", "value": format!("/etc/otter/join/{API_CA_KEY}") }),
        ),
        ApiTrust::PublicRoots => {
            Some(json!({ "name": "OTTER_HUB_API_PUBLIC_ROOTS", "value": "true" }))
        }
    };
    if let (Some(entry), Some(list)) = (api_trust, env.as_array_mut()) {
        list.push(entry);
    }
    let probe = |path: &str, delay: u32| {
        json!({
            "httpGet": { "path": path, "port": 8080 }, "initialDelaySeconds": delay, "periodSeconds": 10, "timeoutSeconds": 2,
        })
    };
    docs.push(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": { "name": "otter-agent", "namespace": ns, "labels": labels },
        "spec": {
            "replicas": 1,
            // One agent at a time per cluster: the newest registration wins at the hub.
            "strategy": { "type": "Recreate" },
            "selector": { "matchLabels": { "app.kubernetes.io/name": "otter-agent" } },
            "template": {
                "metadata": { "labels": labels },
                "spec": {
                    "serviceAccountName": "otter-agent",
                    "automountServiceAccountToken": true,
                    "securityContext": {
                        "runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
                        "seccompProfile": { "type": "RuntimeDefault" },
                    },
                    "containers": [{
                        "name": "agent",
                        "image": spec.image,
                        "imagePullPolicy": "IfNotPresent",
                        "env": env,
                        "ports": [{ "name": "health", "containerPort": 8080 }],
                        "livenessProbe": probe("/healthz", 5),
                        "readinessProbe": probe("/readyz", 2),
                        "resources": {
                            "requests": { "cpu": "50m", "memory": "32Mi" },
                            "limits": { "cpu": "1", "memory": "256Mi" },
                        },
                        "securityContext": {
                            "allowPrivilegeEscalation": false,
                            "readOnlyRootFilesystem": true,
                            "runAsNonRoot": true,
                            "capabilities": { "drop": ["ALL"] },
                            "seccompProfile": { "type": "RuntimeDefault" },
                        },
                        // Only the hub CA the manifest pinned; the token
                        // and the identity are read through the API.
                        "volumeMounts": [
                            { "name": "join", "mountPath": "/etc/otter/join", "readOnly": true },
                        ],
                    }],
                    "volumes": [
                        { "name": "join", "secret": { "secretName": AGENT_SECRET, "defaultMode": 0o400,
                                                      "items": mounted_keys(spec) } },
                    ],
                },
            },
        },
    }));
    docs.iter()
        .map(|d| serde_saphyr::to_string(d).expect("JSON values always serialize to YAML"))
        .collect::<Vec<_>>()
        .join("---\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SledStore;

    fn spec(cluster: &str, admins: &[&str]) -> ManifestSpec {
        ManifestSpec {
            cluster: cluster.into(),
            tenant: "acme".into(),
            admins: admins.iter().map(|s| s.to_string()).collect(),
            user_prefixes: vec!["otter:".into(), "oidc:".into()],
            rancher_project_id: String::new(),
            join_token: "otj_0123456789abcdef_secret".into(),
            hub_url: "https://hub.example:8443".into(),
            ca_pem: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".into(),
            api_trust: ApiTrust::HubCa,
            ca_fingerprint: "ab".repeat(32),
            namespace: DEFAULT_NAMESPACE.into(),
            image: format!("{DEFAULT_IMAGE}:v0.1.0"),
        }
    }

    /// The rendered YAML of a fixed spec is checked in, so a change to the
    /// manifest shows in review. `OTTER_MANIFEST_REGEN=1` rewrites it.
    #[test]
    fn golden_manifest() {
        let yaml = render(&spec("edge-1", &["otter:alice@example.com", "oidc:bob"]));
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../manifests/agent-example.yaml");
        if std::env::var_os("OTTER_MANIFEST_REGEN").is_some() {
            std::fs::write(&path, &yaml).unwrap();
        }
        let golden = std::fs::read_to_string(&path).expect("manifests/agent-example.yaml");
        assert_eq!(
            yaml, golden,
            "agent manifest changed; review it and run with OTTER_MANIFEST_REGEN=1"
        );
    }

    /// How the agent verifies the API: the hub CA's certificate needs
    /// nothing more; another CA's travels in the Secret and is mounted; a
    /// public one is a flag.
    #[test]
    fn the_api_trust_reaches_the_agent() {
        let parsed = |trust: ApiTrust| -> Vec<Value> {
            let mut s = spec("edge-1", &[]);
            s.api_trust = trust;
            render(&s)
                .split("\n---\n")
                .map(|d| serde_saphyr::from_str(d).expect("each document parses"))
                .collect()
        };
        let find = |docs: &[Value], kind: &str| -> Value {
            docs.iter()
                .find(|d| d["kind"] == kind)
                .cloned()
                .expect(kind)
        };
        let env_of = |docs: &[Value]| {
            find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"].to_string()
        };
        let hub = parsed(ApiTrust::HubCa);
        assert!(!env_of(&hub).contains("OTTER_HUB_API"));
        let pem = "-----BEGIN CERTIFICATE-----\nMIIC\n-----END CERTIFICATE-----\n";
        let ca = parsed(ApiTrust::Ca(pem.into()));
        assert_eq!(find(&ca, "Secret")["stringData"][API_CA_KEY], pem);
        assert!(env_of(&ca).contains("/etc/otter/join/hub-api-ca.crt"));
        let volumes = find(&ca, "Deployment")["spec"]["template"]["spec"]["volumes"].to_string();
        assert!(volumes.contains(API_CA_KEY), "{volumes}");
        let public = parsed(ApiTrust::PublicRoots);
        assert!(env_of(&public).contains("OTTER_HUB_API_PUBLIC_ROOTS"));
        assert!(
            find(&public, "Secret")["stringData"]
                .get(API_CA_KEY)
                .is_none()
        );
    }

    #[test]
    fn names_cannot_inject_yaml() {
        let evil = "x\n---\napiVersion: v1\nkind: Secret\nmetadata: {name: pwned}";
        let yaml = render(&spec("edge-1", &[evil, "bob: [1]"]));
        let docs: Vec<Value> = yaml
            .split("\n---\n")
            .map(|d| serde_saphyr::from_str(d).expect("each document parses"))
            .collect();
        assert_eq!(docs.len(), 13, "no document was injected");
        let subjects: Vec<&str> = docs
            .iter()
            .filter(|d| d["roleRef"]["name"] == "cluster-admin")
            .map(|d| d["subjects"][0]["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            subjects,
            vec!["otter:acme:admins", evil, "bob: [1]"],
            "names arrive verbatim as data"
        );
        // One binding per user, never shared.
        assert_ne!(admin_binding_name("a.b"), admin_binding_name("a-b"));
        assert!(admin_binding_name(&"z".repeat(300)).len() <= 63);
    }

    #[test]
    fn deployment_passes_the_restricted_pod_security_profile() {
        let yaml = render(&spec("edge-1", &["alice"]));
        let deployment: Value = yaml
            .split("\n---\n")
            .map(|d| serde_saphyr::from_str::<Value>(d).unwrap())
            .find(|d| d["kind"] == "Deployment")
            .unwrap();
        let pod = &deployment["spec"]["template"]["spec"];
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        assert_eq!(
            pod["securityContext"]["seccompProfile"]["type"],
            "RuntimeDefault"
        );
        for c in pod["containers"].as_array().unwrap() {
            let sc = &c["securityContext"];
            assert_eq!(sc["allowPrivilegeEscalation"], false);
            assert_eq!(sc["readOnlyRootFilesystem"], true);
            assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
            assert!(c["resources"]["limits"]["memory"].is_string());
            assert!(c["livenessProbe"].is_object() && c["readinessProbe"].is_object());
            assert!(sc.get("privileged").is_none_or(|p| p == false));
        }
        assert!(pod.get("hostNetwork").is_none() && pod.get("hostPID").is_none());
    }

    #[test]
    fn url_tokens_verify_and_refuse_tampering_expiry_and_other_cas() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let key = url_key(&store).unwrap();
        let c = claims(
            "edge-1",
            "default",
            &["alice".into()],
            "",
            Duration::from_secs(60),
            "fp",
        );
        let token = sign(&key, &c);
        assert_eq!(
            verify(&url_key(&store).unwrap(), &token, "fp").unwrap(),
            c,
            "key survives in the store"
        );
        let mut tampered = token.clone().into_bytes();
        tampered[3] ^= 1;
        assert!(verify(&key, std::str::from_utf8(&tampered).unwrap(), "fp").is_err());
        assert_eq!(verify(&key, &token, "other"), Err(UrlError::OtherCa));
        let expired = sign(
            &key,
            &claims("edge-1", "default", &[], "", Duration::ZERO, "fp"),
        );
        assert_eq!(verify(&key, &expired, "fp"), Err(UrlError::Expired));
        assert_eq!(verify(&key, "garbage", "fp"), Err(UrlError::Malformed));
        let other_key = hmac::Key::new(hmac::HMAC_SHA256, b"another key");
        assert_eq!(
            verify(&other_key, &token, "fp"),
            Err(UrlError::BadSignature)
        );
    }
}

#[cfg(test)]
mod hub_manifest_tests {
    use serde_json::Value;

    fn args_have(container: &Value, arg: &str) -> bool {
        container["args"]
            .as_array()
            .is_some_and(|a| a.iter().any(|v| v == arg))
    }

    /// The documents of `manifests/<name>`, parsed.
    fn documents(name: &str) -> Vec<Value> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../manifests")
            .join(name);
        let text = std::fs::read_to_string(path).unwrap();
        text.split("\n---\n")
            .map(|d| serde_saphyr::from_str(d).expect("document parses"))
            .collect()
    }

    /// The hub's own manifest parses and passes the restricted profile too.
    #[test]
    fn hub_manifest_is_restricted_and_complete() {
        let docs = documents("hub.yaml");
        let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "Namespace",
                "PersistentVolumeClaim",
                "Deployment",
                "Service"
            ]
        );
        let pod = &docs[2]["spec"]["template"]["spec"];
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        let c = &pod["containers"][0];
        assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
        assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
        assert_eq!(c["securityContext"]["capabilities"]["drop"][0], "ALL");
        // Every flag the manifest passes is one `otter hub` knows.
        let args: Vec<String> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect();
        let mut argv = vec!["otter".to_owned()];
        argv.extend(args);
        <crate::cli::Cli as clap::Parser>::try_parse_from(argv).expect("the manifest's args parse");
        // The probes use the ops port's endpoints.
        assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/livez");
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
        assert_eq!(c["startupProbe"]["grpc"]["port"], 9090);
        assert!(args_have(c, "--health-listen=0.0.0.0:9090"));
        // The audit log lives on the hub's volume.
        assert!(args_have(c, "--audit-log=/var/lib/otter/audit.log"));
    }

    /// The HA variant: three replicas on etcd, rolled one at a time, a
    /// budget keeping two, readiness gated on the store, one load balancer
    /// for the API and both protocols of the tunnel port, and flags `otter
    /// hub` takes once Kubernetes has put the pod's name and address in.
    #[test]
    fn hub_ha_manifest_runs_replicas_on_etcd() {
        let docs = documents("hub-ha.yaml");
        let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            ["Namespace", "Deployment", "PodDisruptionBudget", "Service"]
        );
        let deploy = &docs[1]["spec"];
        assert_eq!(deploy["replicas"], 3);
        assert_eq!(deploy["strategy"]["type"], "RollingUpdate");
        assert_eq!(deploy["strategy"]["rollingUpdate"]["maxUnavailable"], 1);
        let labels = &deploy["template"]["metadata"]["labels"];
        let pdb = &docs[2]["spec"];
        assert_eq!(pdb["minAvailable"], 2);
        assert_eq!(&pdb["selector"]["matchLabels"], labels);
        assert_eq!(&docs[3]["spec"]["selector"], labels);
        let pod = &deploy["template"]["spec"];
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        let c = &pod["containers"][0];
        assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
        // The pod's name and address as Kubernetes substitutes them.
        let env: Vec<&str> = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert_eq!(env, ["POD_NAME", "POD_IP"]);
        let args: Vec<String> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                a.as_str()
                    .unwrap()
                    .replace("$(POD_NAME)", "otter-hub-5d9c7-x2x4q")
                    .replace("$(POD_IP)", "10.42.0.7")
            })
            .collect();
        let mut argv = vec!["otter".to_owned()];
        argv.extend(args);
        let cli = <crate::cli::Cli as clap::Parser>::try_parse_from(argv)
            .expect("the manifest's args parse");
        let crate::cli::Command::Hub(hub) = cli.command else {
            panic!("not `otter hub`");
        };
        let config = hub.into_config().expect("a hub configuration");
        let store = config.store.as_ref().expect("a store on etcd");
        assert_eq!(store.endpoints.len(), 3);
        assert!(config.store_key_file.is_some(), "sealed");
        assert_eq!(config.replica, "otter-hub-5d9c7-x2x4q");
        assert_eq!(
            config.peer_url.as_ref().map(url::Url::as_str),
            Some("https://10.42.0.7:8445/")
        );
        // The store key comes from a Secret the pod's group may read.
        let key_volume = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "store-key")
            .unwrap();
        assert_eq!(key_volume["secret"]["secretName"], "otter-hub-store");
        // One load balancer: the API, and the tunnel port over TCP and UDP.
        let ports: Vec<(String, i64, String)> = docs[3]["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["name"].as_str().unwrap().to_owned(),
                    p["port"].as_i64().unwrap(),
                    p["protocol"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        assert!(ports.contains(&("tunnel-tcp".into(), 8444, "TCP".into())));
        assert!(ports.contains(&("tunnel-udp".into(), 8444, "UDP".into())));
        assert_eq!(docs[3]["spec"]["type"], "LoadBalancer");
    }
}
