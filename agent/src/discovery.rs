//! What the cluster serves: resource types (discovery) and their OpenAPI v3
//! schemas, fetched with the agent's own client (every authenticated user
//! may read both) and cached.
//!
//! Discovery is refreshed after its TTL, when a caller names a resource the
//! cached copy does not know (at most once a second, so a typo cannot make
//! the agent hammer the apiserver), and right after a
//! CustomResourceDefinition changes through the agent.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use serde_json::{Map, Value};
use tokio::{sync::Mutex, time::Instant};
use tonic::Status;

use crate::status::from_kube;

/// One resource type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiEntry {
    pub group: String,
    pub version: String,
    /// Plural, as in the URL.
    pub resource: String,
    pub kind: String,
    pub namespaced: bool,
    pub verbs: Vec<String>,
    pub short_names: Vec<String>,
    /// Subresource names (`status`, `scale`, `log`, …).
    pub subresources: Vec<String>,
}

impl ApiEntry {
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `resource.group/version`, for messages.
    pub fn display(&self) -> String {
        display(&self.group, &self.version, &self.resource)
    }

    /// kube's description of the type.
    pub fn api_resource(&self) -> kube::core::ApiResource {
        kube::core::ApiResource {
            group: self.group.clone(),
            version: self.version.clone(),
            api_version: self.api_version(),
            kind: self.kind.clone(),
            plural: self.resource.clone(),
        }
    }

    /// Fails unless the type supports `verb`.
    pub fn require(&self, verb: &str) -> Result<(), Status> {
        if self.verbs.iter().any(|v| v == verb) {
            Ok(())
        } else {
            Err(Status::unimplemented(format!(
                "{} does not support the verb {verb:?} (it supports {})",
                self.display(),
                if self.verbs.is_empty() {
                    "none".to_owned()
                } else {
                    self.verbs.join(", ")
                }
            )))
        }
    }
}

fn display(group: &str, version: &str, resource: &str) -> String {
    if group.is_empty() {
        format!("{resource} (core/{version})")
    } else {
        format!("{resource} ({group}/{version})")
    }
}

/// Cached discovery and OpenAPI documents.
pub struct Catalog {
    client: kube::Client,
    ttl: Duration,
    schema_ttl: Duration,
    discovery: Mutex<Option<(Instant, Arc<Vec<ApiEntry>>)>>,
    /// Group-version path (`api/v1`, `apis/apps/v1`) → (fetched, document).
    documents: Mutex<HashMap<String, (Instant, Arc<Value>)>>,
}

impl std::fmt::Debug for Catalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Catalog")
            .field("ttl", &self.ttl)
            .field("schema_ttl", &self.schema_ttl)
            .finish_non_exhaustive()
    }
}

/// Shortest time between two refreshes caused by a lookup miss.
const MISS_REFRESH: Duration = Duration::from_secs(1);

/// Deepest `$ref` nesting resolved; deeper (and cyclic) references stay `$ref`s.
const MAX_REF_DEPTH: usize = 32;

impl Catalog {
    pub fn new(client: kube::Client, ttl: Duration, schema_ttl: Duration) -> Self {
        Self {
            client,
            ttl,
            schema_ttl,
            discovery: Mutex::new(None),
            documents: Mutex::new(HashMap::new()),
        }
    }

    /// Every resource type, fresh within the TTL.
    pub async fn entries(&self) -> Result<Arc<Vec<ApiEntry>>, Status> {
        self.entries_if(|fetched| fetched.elapsed() < self.ttl)
            .await
    }

    async fn entries_if(
        &self,
        fresh: impl Fn(Instant) -> bool,
    ) -> Result<Arc<Vec<ApiEntry>>, Status> {
        let mut guard = self.discovery.lock().await;
        if let Some((fetched, entries)) = guard.as_ref()
            && fresh(*fetched)
        {
            return Ok(entries.clone());
        }
        let entries = Arc::new(fetch_discovery(&self.client).await?);
        *guard = Some((Instant::now(), entries.clone()));
        Ok(entries)
    }

    /// Watches CustomResourceDefinitions with the agent's client and forgets
    /// the cached discovery whenever one changes, so new types show up at
    /// once. Without permission to watch them, discovery relies on its TTL
    /// and on refreshing when a lookup misses. The task ends with the catalog.
    pub fn watch_crds(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let ar = kube::core::ApiResource {
            group: "apiextensions.k8s.io".into(),
            version: "v1".into(),
            api_version: "apiextensions.k8s.io/v1".into(),
            kind: "CustomResourceDefinition".into(),
            plural: "customresourcedefinitions".into(),
        };
        let api: kube::Api<kube::api::DynamicObject> =
            kube::Api::all_with(self.client.clone(), &ar);
        tokio::spawn(async move {
            use futures::StreamExt;
            use kube::runtime::{WatchStreamExt, watcher};
            // kube's watcher lists, then watches from there, lists again
            // when the version is gone (410), and backs off on errors.
            let events = watcher(api, watcher::Config::default().timeout(290)).default_backoff();
            let mut events = std::pin::pin!(events);
            while let Some(event) = events.next().await {
                let Some(catalog) = weak.upgrade() else {
                    return;
                };
                match event {
                    // A change, or a fresh list that may hide changes missed.
                    Ok(
                        watcher::Event::Apply(_)
                        | watcher::Event::Delete(_)
                        | watcher::Event::InitDone,
                    ) => {
                        catalog.invalidate().await;
                    }
                    Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
                    Err(
                        watcher::Error::InitialListFailed(kube::Error::Api(s))
                        | watcher::Error::WatchStartFailed(kube::Error::Api(s)),
                    ) if matches!(s.code, 401 | 403 | 404) => {
                        tracing::info!(message = %s.message, "cannot watch CRDs; discovery refreshes on its TTL");
                        return;
                    }
                    Err(e) => tracing::debug!(error = %e, "CRD watch failed; retrying"),
                }
            }
        });
    }

    /// Forgets the cached discovery (a CRD changed).
    pub async fn invalidate(&self) {
        *self.discovery.lock().await = None;
    }

    /// [`Catalog::resolve`] for the names as a request carries them:
    /// version and resource required, each a valid path segment.
    pub async fn resolve_named(
        &self,
        group: &Option<String>,
        version: &Option<String>,
        resource: &Option<String>,
    ) -> Result<ApiEntry, Status> {
        use crate::resource::{opt_segment, segment};
        let g = opt_segment(group, "group")?;
        let v = segment(version, "version")?;
        let r = segment(resource, "resource")?;
        self.resolve(g, v, r).await
    }

    /// The type `resource` of `group`/`version`; NotFound with the name when
    /// the cluster does not serve it.
    pub async fn resolve(
        &self,
        group: &str,
        version: &str,
        resource: &str,
    ) -> Result<ApiEntry, Status> {
        if version.is_empty() {
            return Err(Status::invalid_argument("version is required"));
        }
        if resource.is_empty() {
            return Err(Status::invalid_argument("resource is required"));
        }
        let find = |entries: &[ApiEntry]| {
            entries
                .iter()
                .find(|e| e.group == group && e.version == version && e.resource == resource)
                .cloned()
        };
        if let Some(e) = find(&self.entries().await?) {
            return Ok(e);
        }
        let entries = self
            .entries_if(|fetched| fetched.elapsed() < MISS_REFRESH)
            .await?;
        if let Some(e) = find(&entries) {
            return Ok(e);
        }
        let gv_known = entries
            .iter()
            .any(|e| e.group == group && e.version == version);
        Err(Status::not_found(if gv_known {
            format!(
                "the cluster serves no resource {}",
                display(group, version, resource)
            )
        } else if group.is_empty() {
            format!(
                "the cluster serves no API version {version:?} in the core group (resource {resource:?})"
            )
        } else {
            format!(
                "the cluster serves no API group-version {group}/{version} (resource {resource:?})"
            )
        }))
    }

    /// The JSON schema of `kind` in `group`/`version`, `$ref`s resolved.
    pub async fn schema(&self, group: &str, version: &str, kind: &str) -> Result<Value, Status> {
        if version.is_empty() || kind.is_empty() {
            return Err(Status::invalid_argument("version and kind are required"));
        }
        let path = if group.is_empty() {
            format!("api/{version}")
        } else {
            format!("apis/{group}/{version}")
        };
        let doc = self.document(&path).await?;
        let schemas = doc
            .pointer("/components/schemas")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                Status::internal(format!("the OpenAPI document of {path} has no schemas"))
            })?;
        let (name, schema) = schemas
            .iter()
            .find(|(_, s)| matches_gvk(s, group, version, kind))
            .ok_or_else(|| {
                Status::not_found(format!(
                    "kind {kind:?} not found in the OpenAPI schema of {}",
                    if group.is_empty() {
                        version.to_owned()
                    } else {
                        format!("{group}/{version}")
                    }
                ))
            })?;
        let mut stack = HashSet::from([name.clone()]);
        Ok(resolve_refs(schema, schemas, &mut stack, 0))
    }

    async fn document(&self, gv_path: &str) -> Result<Arc<Value>, Status> {
        {
            let docs = self.documents.lock().await;
            if let Some((fetched, doc)) = docs.get(gv_path)
                && fetched.elapsed() < self.schema_ttl
            {
                return Ok(doc.clone());
            }
        }
        let root: Value = self
            .client
            .request(get("/openapi/v3")?)
            .await
            .map_err(from_kube)?;
        let url = root
            .pointer(&format!(
                "/paths/{}",
                gv_path.replace('~', "~0").replace('/', "~1")
            ))
            .and_then(|p| p.get("serverRelativeURL"))
            .and_then(Value::as_str)
            .ok_or_else(|| {
                Status::not_found(format!(
                    "the cluster publishes no OpenAPI v3 document for {gv_path}"
                ))
            })?
            .to_owned();
        let doc: Value = self.client.request(get(&url)?).await.map_err(from_kube)?;
        let doc = Arc::new(doc);
        let mut docs = self.documents.lock().await;
        // Bounded: one entry per group-version the cluster serves, and stale
        // ones go when the map grows.
        if docs.len() >= 512 {
            let ttl = self.schema_ttl;
            docs.retain(|_, (t, _)| t.elapsed() < ttl);
        }
        docs.insert(gv_path.to_owned(), (Instant::now(), doc.clone()));
        Ok(doc)
    }
}

fn get(uri: &str) -> Result<http::Request<Vec<u8>>, Status> {
    http::Request::get(uri)
        .header(http::header::ACCEPT, "application/json")
        .body(Vec::new())
        .map_err(|e| Status::internal(format!("request {uri}: {e}")))
}

fn matches_gvk(schema: &Value, group: &str, version: &str, kind: &str) -> bool {
    schema
        .get("x-kubernetes-group-version-kind")
        .and_then(Value::as_array)
        .is_some_and(|list| {
            list.iter().any(|g| {
                g.get("group").and_then(Value::as_str).unwrap_or("") == group
                    && g.get("version").and_then(Value::as_str) == Some(version)
                    && g.get("kind").and_then(Value::as_str) == Some(kind)
            })
        })
}

/// Replaces every `{"$ref": "#/components/schemas/X"}` with X, resolved in
/// turn; a reference back into the path being resolved (a recursive type)
/// and references nested deeper than [`MAX_REF_DEPTH`] are left as they are.
fn resolve_refs(
    v: &Value,
    schemas: &Map<String, Value>,
    stack: &mut HashSet<String>,
    depth: usize,
) -> Value {
    match v {
        Value::Object(m) => {
            if let Some(target) = m
                .get("$ref")
                .and_then(Value::as_str)
                .and_then(|r| r.strip_prefix("#/components/schemas/"))
                && let Some(schema) = schemas.get(target)
                && depth < MAX_REF_DEPTH
                && !stack.contains(target)
            {
                stack.insert(target.to_owned());
                let mut resolved = resolve_refs(schema, schemas, stack, depth + 1);
                stack.remove(target);
                // Keep siblings of the $ref (description, default).
                if let Value::Object(r) = &mut resolved {
                    for (k, sib) in m {
                        if k != "$ref" {
                            r.insert(k.clone(), resolve_refs(sib, schemas, stack, depth));
                        }
                    }
                }
                return resolved;
            }
            Value::Object(
                m.iter()
                    .map(|(k, x)| (k.clone(), resolve_refs(x, schemas, stack, depth)))
                    .collect(),
            )
        }
        Value::Array(a) => Value::Array(
            a.iter()
                .map(|x| resolve_refs(x, schemas, stack, depth))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Aggregated discovery (one request for the core group, one for the rest),
/// falling back on the per-group-version documents of older apiservers.
async fn fetch_discovery(client: &kube::Client) -> Result<Vec<ApiEntry>, Status> {
    match fetch_aggregated(client).await {
        Ok(e) if !e.is_empty() => Ok(e),
        _ => fetch_legacy(client).await,
    }
}

async fn fetch_aggregated(client: &kube::Client) -> Result<Vec<ApiEntry>, kube::Error> {
    let mut out = Vec::new();
    let core = client.list_core_api_versions_aggregated().await?;
    let groups = client.list_api_groups_aggregated().await?;
    for g in core.items.iter().chain(groups.items.iter()) {
        let group = g
            .metadata
            .as_ref()
            .and_then(|m| m.name.clone())
            .unwrap_or_default();
        for v in &g.versions {
            let version = v.version.clone().unwrap_or_default();
            for r in &v.resources {
                let resource = r.resource.clone().unwrap_or_default();
                if resource.is_empty() || version.is_empty() {
                    continue;
                }
                out.push(ApiEntry {
                    group: group.clone(),
                    version: version.clone(),
                    kind: r
                        .response_kind
                        .as_ref()
                        .and_then(|k| k.kind.clone())
                        .unwrap_or_default(),
                    namespaced: r.scope.as_deref() == Some("Namespaced"),
                    verbs: r.verbs.clone(),
                    short_names: r.short_names.clone(),
                    subresources: r
                        .subresources
                        .iter()
                        .filter_map(|s| s.subresource.clone())
                        .collect(),
                    resource,
                });
            }
        }
    }
    Ok(out)
}

async fn fetch_legacy(client: &kube::Client) -> Result<Vec<ApiEntry>, Status> {
    let mut lists = Vec::new();
    let core = client.list_core_api_versions().await.map_err(from_kube)?;
    for v in core.versions {
        lists.push((
            String::new(),
            v.clone(),
            client
                .list_core_api_resources(&v)
                .await
                .map_err(from_kube)?,
        ));
    }
    let groups = client.list_api_groups().await.map_err(from_kube)?;
    for g in groups.groups {
        for v in g.versions {
            // A group-version whose aggregated server is down is skipped,
            // as kubectl does, rather than failing discovery as a whole.
            if let Ok(list) = client.list_api_group_resources(&v.group_version).await {
                lists.push((g.name.clone(), v.version.clone(), list));
            }
        }
    }
    let mut out = Vec::new();
    for (group, version, list) in lists {
        let subs: Vec<(String, String)> = list
            .resources
            .iter()
            .filter_map(|r| r.name.split_once('/'))
            .map(|(a, b)| (a.to_owned(), b.to_owned()))
            .collect();
        for r in list.resources.iter().filter(|r| !r.name.contains('/')) {
            out.push(ApiEntry {
                group: group.clone(),
                version: version.clone(),
                resource: r.name.clone(),
                kind: r.kind.clone(),
                namespaced: r.namespaced,
                verbs: r.verbs.clone(),
                short_names: r.short_names.clone().unwrap_or_default(),
                subresources: subs
                    .iter()
                    .filter(|(p, _)| *p == r.name)
                    .map(|(_, s)| s.clone())
                    .collect(),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn refs_resolve_and_cycles_stop() {
        let schemas = json!({
            "A": {"type": "object", "properties": {
                "b": {"allOf": [{"$ref": "#/components/schemas/B"}], "description": "the b"},
                "self": {"$ref": "#/components/schemas/A"}}},
            "B": {"type": "string"}
        });
        let schemas = schemas.as_object().unwrap();
        let mut stack = HashSet::from(["A".to_owned()]);
        let out = resolve_refs(&schemas["A"], schemas, &mut stack, 0);
        assert_eq!(
            out["properties"]["b"]["allOf"][0],
            json!({"type": "string"})
        );
        assert_eq!(out["properties"]["b"]["description"], "the b");
        assert_eq!(
            out["properties"]["self"],
            json!({"$ref": "#/components/schemas/A"})
        );
    }

    #[test]
    fn verbs_are_checked() {
        let e = ApiEntry {
            group: "".into(),
            version: "v1".into(),
            resource: "bindings".into(),
            kind: "Binding".into(),
            namespaced: true,
            verbs: vec!["create".into()],
            short_names: vec![],
            subresources: vec![],
        };
        let err = e.require("list").unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unimplemented);
        assert!(
            err.message().contains("bindings (core/v1)"),
            "{}",
            err.message()
        );
        e.require("create").unwrap();
    }
}
