//! ResourceService on kube-rs: every call runs as the caller the hub
//! verified (see [`crate::kube`]), against any resource type the cluster
//! serves, built-in or custom.

use std::{pin::Pin, sync::Arc, time::Duration};

use futures::{Stream, StreamExt};
use kube::{
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchParams},
    core::WatchEvent as KubeEvent,
};
use otter_proto::resource::v1::{
    self as pb, Resource, resource_service_server::ResourceService, watch_event::Type,
};
use otter_tunnel::Caller;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use crate::{
    convert::{self, object_out, str_at},
    discovery::{ApiEntry, Catalog},
    kube::KubeAccess,
    status::{from_kube, from_kube_status},
};

/// Settings of the resource service.
#[derive(Debug, Clone)]
pub struct ResourceConfig {
    /// How long discovery is cached.
    pub discovery_ttl: Duration,
    /// How long OpenAPI documents are cached.
    pub schema_ttl: Duration,
    /// Each upstream watch asks the apiserver to end after this long
    /// (the agent then resumes it from the last resourceVersion). Below 295 s.
    pub upstream_watch_timeout: Duration,
}

impl Default for ResourceConfig {
    fn default() -> Self {
        Self {
            discovery_ttl: Duration::from_secs(5 * 60),
            schema_ttl: Duration::from_secs(10 * 60),
            upstream_watch_timeout: Duration::from_secs(290),
        }
    }
}

/// The service.
#[derive(Debug, Clone)]
pub struct Resources {
    kube: KubeAccess,
    catalog: Arc<Catalog>,
    config: ResourceConfig,
}

impl Resources {
    /// The answer to a create, apply or update: the object as written. A
    /// CRD change also refreshes discovery, so the new kind is found at once.
    async fn written(&self, entry: &ApiEntry, obj: Value) -> Result<Response<Resource>, Status> {
        if is_crd(entry) {
            self.catalog.invalidate().await;
        }
        Ok(Response::new(object_out(typed(obj, entry))))
    }

    /// Starts the CRD watch of the discovery cache: call inside a runtime.
    pub fn new(kube: KubeAccess, config: ResourceConfig) -> Self {
        let catalog = Arc::new(Catalog::new(
            kube.agent().clone(),
            config.discovery_ttl,
            config.schema_ttl,
        ));
        catalog.watch_crds();
        Self {
            kube,
            catalog,
            config,
        }
    }

    pub fn catalog(&self) -> Arc<Catalog> {
        self.catalog.clone()
    }
}

/// The caller the hub verified; never anything from metadata.
pub fn caller<T>(req: &Request<T>) -> Result<Caller, Status> {
    req.extensions()
        .get::<Caller>()
        .cloned()
        .filter(|c| !c.user.is_empty())
        .ok_or_else(|| Status::unauthenticated("the call carries no verified caller"))
}

/// A name that goes into a URL path: one segment, nothing that could step
/// out of it.
pub fn segment<'a>(v: &'a Option<String>, what: &str) -> Result<&'a str, Status> {
    let s = v.as_deref().unwrap_or("");
    if s.is_empty() {
        return Err(Status::invalid_argument(format!("{what} is required")));
    }
    check_segment(s, what)?;
    Ok(s)
}

/// Like [`segment`], for optional values ("" when absent).
pub fn opt_segment<'a>(v: &'a Option<String>, what: &str) -> Result<&'a str, Status> {
    let s = v.as_deref().unwrap_or("");
    if !s.is_empty() {
        check_segment(s, what)?;
    }
    Ok(s)
}

fn check_segment(s: &str, what: &str) -> Result<(), Status> {
    let bad = s.len() > 253
        || s == "."
        || s == ".."
        || s.chars().any(|c| {
            c.is_control() || c.is_whitespace() || matches!(c, '/' | '?' | '#' | '%' | '\\')
        });
    if bad {
        return Err(Status::invalid_argument(format!(
            "{what} {s:?} is not a valid name"
        )));
    }
    Ok(())
}

/// One type's URL (in one namespace, or across all) with the caller's
/// client. Every call sends kube's request for that URL and takes the
/// apiserver's JSON as it was sent: what goes on to the caller needs no
/// typed object in between.
pub struct Endpoint {
    client: kube::Client,
    url: kube::core::Request,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("url", &self.url.url_path)
            .finish_non_exhaustive()
    }
}

/// What kube's request builder returns.
type Built = Result<http::Request<Vec<u8>>, kube::core::request::Error>;

/// The endpoint for one type, in `namespace` when the type is namespaced.
/// `need_namespace`: single-object calls on namespaced types need one.
pub fn api_for(
    client: kube::Client,
    entry: &ApiEntry,
    namespace: &str,
    need_namespace: bool,
) -> Result<Endpoint, Status> {
    let ar = entry.api_resource();
    let namespace = match (entry.namespaced, namespace.is_empty()) {
        (true, false) => Some(namespace),
        (true, true) if need_namespace => {
            return Err(Status::invalid_argument(format!(
                "namespace is required for {}",
                entry.display()
            )));
        }
        _ => None,
    };
    let url = <kube::api::DynamicObject as kube::Resource>::url_path(&ar, namespace);
    Ok(Endpoint {
        client,
        url: kube::core::Request::new(url),
    })
}

impl Endpoint {
    /// kube's request builder for this URL.
    pub fn request(&self) -> &kube::core::Request {
        &self.url
    }

    /// The caller's client.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// The apiserver's answer to `req`, as it sent it, or kube's error
    /// (for callers that treat some refusals as answers).
    async fn send_raw(&self, req: Built) -> Result<Result<Value, kube::Error>, Status> {
        let req = req.map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(self.client.request::<Value>(req).await)
    }

    /// The apiserver's answer to `req`, as it sent it.
    pub async fn send(&self, req: Built) -> Result<Value, Status> {
        self.send_raw(req).await?.map_err(from_kube)
    }

    /// One object, as the apiserver sent it.
    pub async fn get(&self, name: &str) -> Result<Value, Status> {
        self.send(self.url.get(name, &kube::api::GetParams::default()))
            .await
    }

    /// A watch from `rv`, its events' objects as the apiserver sent them.
    async fn watch(&self, wp: &WatchParams, rv: &str) -> Result<Upstream, kube::Error> {
        let req = self.url.watch(wp, rv).map_err(kube::Error::BuildRequest)?;
        Ok(self.client.request_events::<Value>(req).await?.boxed())
    }
}

/// A manifest as the body of a create or replace.
fn body(obj: &Value) -> Result<Vec<u8>, Status> {
    serde_json::to_vec(obj).map_err(|e| Status::internal(format!("encoding an object: {e}")))
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<Value, Status> {
    serde_json::to_value(v).map_err(|e| Status::internal(format!("encoding an object: {e}")))
}

/// An object from the apiserver with apiVersion and kind filled in (list
/// items may lack them).
fn typed(mut v: Value, entry: &ApiEntry) -> Value {
    if let Some(m) = v.as_object_mut() {
        m.entry("apiVersion")
            .or_insert_with(|| Value::String(entry.api_version()));
        m.entry("kind")
            .or_insert_with(|| Value::String(entry.kind.clone()));
    }
    v
}

fn is_crd(entry: &ApiEntry) -> bool {
    entry.group == "apiextensions.k8s.io" && entry.resource == "customresourcedefinitions"
}

/// Checks a manifest against the type it is sent to and fills in what it
/// leaves out; returns the namespace to use.
fn prepare_manifest(obj: &mut Value, entry: &ApiEntry, namespace: &str) -> Result<String, Status> {
    let api_version = entry.api_version();
    match str_at(obj, "apiVersion") {
        Some(v) if v != api_version => {
            return Err(Status::invalid_argument(format!(
                "manifest apiVersion {v:?} does not match the request's {api_version:?}"
            )));
        }
        Some(_) => {}
        None => obj["apiVersion"] = json!(api_version),
    }
    match str_at(obj, "kind") {
        Some(k) if !entry.kind.is_empty() && k != entry.kind => {
            return Err(Status::invalid_argument(format!(
                "manifest kind {k:?} does not match {} (kind {:?})",
                entry.display(),
                entry.kind
            )));
        }
        Some(_) => {}
        None => obj["kind"] = json!(entry.kind),
    }
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    if !entry.namespaced {
        return Ok(String::new());
    }
    let in_manifest = str_at(obj, "metadata.namespace").unwrap_or("").to_owned();
    let ns = match (namespace, in_manifest.as_str()) {
        ("", "") => {
            return Err(Status::invalid_argument(format!(
                "namespace is required for {} (in the request or in metadata.namespace)",
                entry.display()
            )));
        }
        (r, m) if !r.is_empty() && !m.is_empty() && r != m => {
            return Err(Status::invalid_argument(format!(
                "the manifest's namespace {m:?} does not match the request's {r:?}"
            )));
        }
        ("", m) => m.to_owned(),
        (r, _) => r.to_owned(),
    };
    check_segment(&ns, "namespace")?;
    obj["metadata"]["namespace"] = json!(ns);
    Ok(ns)
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::WatchEvent, Status>> + Send>>;

#[tonic::async_trait]
impl ResourceService for Resources {
    async fn discovery(
        &self,
        request: Request<pb::DiscoveryRequest>,
    ) -> Result<Response<pb::DiscoveryResponse>, Status> {
        caller(&request)?;
        let entries = self.catalog.entries().await?;
        Ok(Response::new(pb::DiscoveryResponse {
            api_resources: entries
                .iter()
                .map(|e| pb::ApiResource {
                    group: Some(e.group.clone()),
                    version: Some(e.version.clone()),
                    resource: Some(e.resource.clone()),
                    kind: Some(e.kind.clone()),
                    namespaced: Some(e.namespaced),
                    verbs: e.verbs.clone(),
                    short_names: e.short_names.clone(),
                })
                .collect(),
        }))
    }

    async fn schema(
        &self,
        request: Request<pb::SchemaRequest>,
    ) -> Result<Response<pb::SchemaResponse>, Status> {
        caller(&request)?;
        let r = request.into_inner();
        let schema = self
            .catalog
            .schema(
                r.group.as_deref().unwrap_or(""),
                r.version.as_deref().unwrap_or(""),
                r.kind.as_deref().unwrap_or(""),
            )
            .await?;
        Ok(Response::new(pb::SchemaResponse {
            schema: Some(convert::to_struct(schema)),
        }))
    }

    async fn list(
        &self,
        request: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        let (client, r, entry) = self.begin(request, "list").await?;
        let ns = opt_segment(&r.namespace, "namespace")?;
        let api = api_for(client, &entry, ns, false)?;
        let limit = match r.limit {
            None | Some(0) => None,
            Some(n) if n < 0 => return Err(Status::invalid_argument("limit must be ≥ 0")),
            Some(n) => Some(u32::try_from(n).unwrap_or(u32::MAX)),
        };
        let lp = ListParams {
            label_selector: r.label_selector.filter(|s| !s.is_empty()),
            field_selector: r.field_selector.filter(|s| !s.is_empty()),
            limit,
            continue_token: r.r#continue.filter(|s| !s.is_empty()),
            ..Default::default()
        };
        let mut list = api.send(api.request().list(&lp)).await?;
        let items = match list.get_mut("items").map(Value::take) {
            Some(Value::Array(items)) => items
                .into_iter()
                .map(|o| object_out(typed(o, &entry)))
                .collect(),
            _ => Vec::new(),
        };
        let meta = |k: &str| list.get("metadata").and_then(|m| m.get(k));
        Ok(Response::new(pb::ListResponse {
            resource_version: meta("resourceVersion")
                .and_then(Value::as_str)
                .map(str::to_owned),
            r#continue: Some(
                meta("continue")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
            ),
            remaining_item_count: meta("remainingItemCount").and_then(Value::as_i64),
            items,
        }))
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> Result<Response<Resource>, Status> {
        let (client, r, entry) = self.begin(request, "get").await?;
        let name = segment(&r.name, "name")?;
        let api = api_for(
            client,
            &entry,
            opt_segment(&r.namespace, "namespace")?,
            true,
        )?;
        let obj = api.get(name).await?;
        Ok(Response::new(object_out(typed(obj, &entry))))
    }

    async fn describe(
        &self,
        request: Request<pb::DescribeRequest>,
    ) -> Result<Response<pb::DescribeResponse>, Status> {
        let (client, r, entry) = self.begin(request, "get").await?;
        let name = segment(&r.name, "name")?;
        let ns = opt_segment(&r.namespace, "namespace")?;
        let api = api_for(client.clone(), &entry, ns, true)?;
        let obj = typed(api.get(name).await?, &entry);
        let uid = str_at(&obj, "metadata.uid").unwrap_or("").to_owned();
        let events = if uid.is_empty() {
            Vec::new()
        } else {
            self.events_of(client, &uid, if entry.namespaced { ns } else { "" })
                .await?
        };
        Ok(Response::new(pb::DescribeResponse {
            resource: Some(object_out(obj)),
            events,
        }))
    }

    async fn create(
        &self,
        request: Request<pb::CreateRequest>,
    ) -> Result<Response<Resource>, Status> {
        let (client, r, entry) = self.begin(request, "create").await?;
        let mut obj = convert::manifest(r.manifest.as_deref().unwrap_or_default())?;
        let ns = prepare_manifest(&mut obj, &entry, opt_segment(&r.namespace, "namespace")?)?;
        let api = api_for(client, &entry, &ns, true)?;
        let created = api
            .send(api.request().create(&PostParams::default(), body(&obj)?))
            .await?;
        self.written(&entry, created).await
    }

    async fn apply(
        &self,
        request: Request<pb::ApplyRequest>,
    ) -> Result<Response<Resource>, Status> {
        let (client, r, entry) = self.begin(request, "patch").await?;
        let manager = r
            .field_manager
            .as_deref()
            .filter(|m| !m.is_empty())
            .ok_or_else(|| {
                Status::invalid_argument("field_manager is required for server-side apply")
            })?;
        if manager.len() > 128 {
            return Err(Status::invalid_argument(
                "field_manager is longer than 128 characters",
            ));
        }
        let mut obj = convert::manifest(r.manifest.as_deref().unwrap_or_default())?;
        let ns = prepare_manifest(&mut obj, &entry, opt_segment(&r.namespace, "namespace")?)?;
        let name = name_for(&mut obj, &r.name)?;
        let api = api_for(client, &entry, &ns, true)?;
        let pp = PatchParams {
            field_manager: Some(manager.to_owned()),
            force: r.force.unwrap_or(false),
            ..Default::default()
        };
        let applied = api
            .send(api.request().patch(&name, &pp, &Patch::Apply(&obj)))
            .await?;
        self.written(&entry, applied).await
    }

    async fn update(
        &self,
        request: Request<pb::UpdateRequest>,
    ) -> Result<Response<Resource>, Status> {
        let (client, r, entry) = self.begin(request, "update").await?;
        let wanted = segment(&r.name, "name")?.to_owned();
        let mut obj = convert::manifest(r.manifest.as_deref().unwrap_or_default())?;
        let ns = prepare_manifest(&mut obj, &entry, opt_segment(&r.namespace, "namespace")?)?;
        match str_at(&obj, "metadata.name") {
            Some(n) if n != wanted => {
                return Err(Status::invalid_argument(format!(
                    "metadata.name {n:?} of the manifest does not match the request's name {wanted:?}"
                )));
            }
            Some(_) => {}
            None => obj["metadata"]["name"] = json!(wanted),
        }
        let api = api_for(client, &entry, &ns, true)?;
        let pp = PostParams {
            field_manager: r.field_manager.filter(|m| !m.is_empty()),
            ..Default::default()
        };
        let updated = api
            .send(api.request().replace(&wanted, &pp, body(&obj)?))
            .await?;
        self.written(&entry, updated).await
    }

    async fn delete(&self, request: Request<pb::DeleteRequest>) -> Result<Response<()>, Status> {
        let (client, r, entry) = self.begin(request, "delete").await?;
        let name = segment(&r.name, "name")?;
        let api = api_for(
            client,
            &entry,
            opt_segment(&r.namespace, "namespace")?,
            true,
        )?;
        let grace = match r.grace_period_seconds {
            None => None,
            Some(g) if g < 0 => {
                return Err(Status::invalid_argument("grace_period_seconds must be ≥ 0"));
            }
            Some(g) => Some(u32::try_from(g).unwrap_or(u32::MAX)),
        };
        let dp = DeleteParams {
            grace_period_seconds: grace,
            ..Default::default()
        };
        api.send(api.request().delete(name, &dp)).await?;
        if is_crd(&entry) {
            self.catalog.invalidate().await;
        }
        Ok(Response::new(()))
    }

    type WatchStream = EventStream;

    async fn watch(
        &self,
        request: Request<pb::WatchRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let (client, r, entry) = self.begin(request, "watch").await?;
        let api = api_for(
            client,
            &entry,
            opt_segment(&r.namespace, "namespace")?,
            false,
        )?;
        let timeout = self.config.upstream_watch_timeout.as_secs().clamp(1, 294) as u32;
        let wp = WatchParams {
            label_selector: r.label_selector.filter(|s| !s.is_empty()),
            field_selector: r.field_selector.filter(|s| !s.is_empty()),
            timeout: Some(timeout),
            bookmarks: true,
            ..Default::default()
        };
        let rv = r.resource_version.filter(|s| !s.is_empty());
        // The first upstream watch is opened before answering, so that a
        // refusal (403, 404, 410) is the call's status.
        let first = match api.watch(&wp, rv.as_deref().unwrap_or("")).await {
            Ok(s) => s,
            Err(kube::Error::Api(s)) if s.code == 410 => {
                let ev = error_event(&s)?;
                return Ok(Response::new(futures::stream::iter([Ok(ev)]).boxed()));
            }
            Err(e) => return Err(from_kube(e)),
        };
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(watch_loop(api, wp, rv, first, entry, tx));
        Ok(Response::new(receiver_stream(rx)))
    }
}

/// A request that names a resource (group, version, resource).
trait NamesResource {
    fn names(&self) -> (&Option<String>, &Option<String>, &Option<String>);
}

macro_rules! names_resource {
    ($($t:ty),*) => {$(
        impl NamesResource for $t {
            fn names(&self) -> (&Option<String>, &Option<String>, &Option<String>) {
                (&self.group, &self.version, &self.resource)
            }
        }
    )*};
}

names_resource!(
    pb::ListRequest,
    pb::GetRequest,
    pb::DescribeRequest,
    pb::CreateRequest,
    pb::ApplyRequest,
    pb::UpdateRequest,
    pb::DeleteRequest,
    pb::WatchRequest
);

impl Resources {
    /// What every handler starts with: a client acting as the caller, the
    /// request, and the resource it names, allowed `verb`.
    async fn begin<R: NamesResource>(
        &self,
        request: Request<R>,
        verb: &str,
    ) -> Result<(kube::Client, R, ApiEntry), Status> {
        let client = self.kube.for_caller(&caller(&request)?)?;
        let r = request.into_inner();
        let (group, version, resource) = r.names();
        let entry = self.catalog.resolve_named(group, version, resource).await?;
        entry.require(verb)?;
        Ok((client, r, entry))
    }

    /// Events whose involvedObject.uid is `uid`, in `namespace` ("" = all).
    async fn events_of(
        &self,
        client: kube::Client,
        uid: &str,
        namespace: &str,
    ) -> Result<Vec<Resource>, Status> {
        let url = if namespace.is_empty() {
            "/api/v1/events".to_owned()
        } else {
            format!("/api/v1/namespaces/{namespace}/events")
        };
        let api = Endpoint {
            client,
            url: kube::core::Request::new(url),
        };
        let lp = ListParams::default()
            .fields(&format!("involvedObject.uid={uid}"))
            .limit(500);
        let mut list = match api.send_raw(api.request().list(&lp)).await? {
            Ok(l) => l,
            // Someone who may read the object but not events still gets the object.
            Err(kube::Error::Api(s)) if s.code == 403 => return Ok(Vec::new()),
            Err(e) => return Err(from_kube(e)),
        };
        let items = match list.get_mut("items").map(Value::take) {
            Some(Value::Array(items)) => items,
            _ => Vec::new(),
        };
        Ok(items
            .into_iter()
            .filter(|e| str_at(e, "involvedObject.uid") == Some(uid))
            .map(|mut e| {
                if let Some(m) = e.as_object_mut() {
                    m.entry("apiVersion").or_insert_with(|| json!("v1"));
                    m.entry("kind").or_insert_with(|| json!("Event"));
                }
                object_out(e)
            })
            .collect())
    }
}

/// The name for apply: the request's, the manifest's, or both when equal.
fn name_for(obj: &mut Value, requested: &Option<String>) -> Result<String, Status> {
    let in_manifest = str_at(obj, "metadata.name").unwrap_or("").to_owned();
    let req = opt_segment(requested, "name")?;
    let name = match (req, in_manifest.as_str()) {
        ("", "") => {
            return Err(Status::invalid_argument(
                "name is required (in the request or in metadata.name)",
            ));
        }
        (r, m) if !r.is_empty() && !m.is_empty() && r != m => {
            return Err(Status::invalid_argument(format!(
                "metadata.name {m:?} of the manifest does not match the request's name {r:?}"
            )));
        }
        ("", m) => m.to_owned(),
        (r, _) => r.to_owned(),
    };
    check_segment(&name, "name")?;
    obj["metadata"]["name"] = json!(name);
    Ok(name)
}

/// A stream over an mpsc receiver.
pub fn receiver_stream<T: Send + 'static>(
    mut rx: mpsc::Receiver<Result<T, Status>>,
) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
}

fn error_event(s: &kube::core::Status) -> Result<pb::WatchEvent, Status> {
    let mut v = to_json(s)?;
    if let Some(m) = v.as_object_mut() {
        m.entry("kind").or_insert_with(|| json!("Status"));
        m.entry("apiVersion").or_insert_with(|| json!("v1"));
    }
    Ok(pb::WatchEvent {
        r#type: Some(Type::Error as i32),
        resource: Some(object_out(v)),
        resource_version: None,
    })
}

/// An upstream watch; its objects are the JSON the apiserver sent.
type Upstream = Pin<Box<dyn Stream<Item = Result<KubeEvent<Value>, kube::Error>> + Send>>;

/// Passes events on for as long as the caller listens; when the apiserver
/// ends the watch (its timeout, a dropped connection) it is opened again
/// from the last resourceVersion seen, so nothing is lost or repeated. Only
/// 410 (that version is gone) ends the stream, with an ERROR event.
async fn watch_loop(
    api: Endpoint,
    wp: WatchParams,
    mut rv: Option<String>,
    mut upstream: Upstream,
    entry: ApiEntry,
    tx: mpsc::Sender<Result<pb::WatchEvent, Status>>,
) {
    loop {
        let next = tokio::select! {
            _ = tx.closed() => return,
            n = upstream.next() => n,
        };
        let event = match next {
            Some(Ok(KubeEvent::Added(o))) => object_event(Type::Added, o, &entry, &mut rv),
            Some(Ok(KubeEvent::Modified(o))) => object_event(Type::Modified, o, &entry, &mut rv),
            Some(Ok(KubeEvent::Deleted(o))) => object_event(Type::Deleted, o, &entry, &mut rv),
            Some(Ok(KubeEvent::Bookmark(b))) => {
                rv = Some(b.metadata.resource_version.clone());
                Ok(pb::WatchEvent {
                    r#type: Some(Type::Bookmark as i32),
                    resource: Some(object_out(json!({
                        "apiVersion": entry.api_version(),
                        "kind": entry.kind,
                        "metadata": {"resourceVersion": b.metadata.resource_version},
                    }))),
                    resource_version: Some(b.metadata.resource_version),
                })
            }
            Some(Ok(KubeEvent::Error(s))) if s.code == 410 => {
                let _ = tx.send(error_event(&s)).await;
                return;
            }
            Some(Ok(KubeEvent::Error(s))) => {
                tracing::debug!(message = %s.message, "upstream watch error event; resuming");
                match reopen(&api, &wp, &rv, &tx).await {
                    Some(s) => upstream = s,
                    None => return,
                }
                continue;
            }
            Some(Err(e)) => {
                tracing::debug!(error = %e, "upstream watch broke; resuming");
                match reopen(&api, &wp, &rv, &tx).await {
                    Some(s) => upstream = s,
                    None => return,
                }
                continue;
            }
            None => {
                match reopen(&api, &wp, &rv, &tx).await {
                    Some(s) => upstream = s,
                    None => return,
                }
                continue;
            }
        };
        if tx.send(event).await.is_err() {
            return;
        }
    }
}

fn object_event(
    kind: Type,
    o: Value,
    entry: &ApiEntry,
    rv: &mut Option<String>,
) -> Result<pb::WatchEvent, Status> {
    let version = str_at(&o, "metadata.resourceVersion").map(str::to_owned);
    if let Some(v) = &version {
        *rv = Some(v.clone());
    }
    Ok(pb::WatchEvent {
        r#type: Some(kind as i32),
        resource: Some(object_out(typed(o, entry))),
        resource_version: version,
    })
}

/// Opens the watch again from `rv`, retrying transport failures with
/// backoff for as long as the caller is there. None: the stream is over
/// (caller gone, or the end was sent).
async fn reopen(
    api: &Endpoint,
    wp: &WatchParams,
    rv: &Option<String>,
    tx: &mpsc::Sender<Result<pb::WatchEvent, Status>>,
) -> Option<Upstream> {
    let mut delay = Duration::from_millis(50);
    loop {
        let attempt = tokio::select! {
            _ = tx.closed() => return None,
            a = api.watch(wp, rv.as_deref().unwrap_or("")) => a,
        };
        match attempt {
            Ok(s) => return Some(s),
            Err(kube::Error::Api(s)) if s.code == 410 => {
                let _ = tx.send(error_event(&s)).await;
                return None;
            }
            Err(kube::Error::Api(s)) if (400..500).contains(&s.code) && s.code != 429 => {
                let _ = tx.send(Err(from_kube_status(&s))).await;
                return None;
            }
            Err(e) => {
                tracing::debug!(error = %e, "reopening the upstream watch failed; retrying");
            }
        }
        tokio::select! {
            _ = tx.closed() => return None,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(namespaced: bool) -> ApiEntry {
        ApiEntry {
            group: "apps".into(),
            version: "v1".into(),
            resource: "deployments".into(),
            kind: "Deployment".into(),
            namespaced,
            verbs: vec![],
            short_names: vec![],
            subresources: vec![],
        }
    }

    #[test]
    fn manifests_are_checked_against_the_request() {
        let mut m = json!({"metadata": {"name": "d"}});
        assert_eq!(
            prepare_manifest(&mut m, &entry(true), "ns1").unwrap(),
            "ns1"
        );
        assert_eq!(m["apiVersion"], "apps/v1");
        assert_eq!(m["kind"], "Deployment");
        assert_eq!(m["metadata"]["namespace"], "ns1");

        let mut m = json!({"metadata": {"name": "d", "namespace": "from-manifest"}});
        assert_eq!(
            prepare_manifest(&mut m, &entry(true), "").unwrap(),
            "from-manifest"
        );
        let mut m = json!({"metadata": {"namespace": "a"}});
        let e = prepare_manifest(&mut m, &entry(true), "b").unwrap_err();
        assert!(e.message().contains("\"a\""), "{e:?}");
        let mut m = json!({"metadata": {}});
        assert!(prepare_manifest(&mut m, &entry(true), "").is_err());
        let mut m = json!({"kind": "StatefulSet"});
        assert!(prepare_manifest(&mut m, &entry(true), "x").is_err());
        let mut m = json!({"apiVersion": "apps/v2"});
        assert!(prepare_manifest(&mut m, &entry(true), "x").is_err());
        let mut m = json!({"metadata": {"name": "n"}});
        assert_eq!(
            prepare_manifest(&mut m, &entry(false), "ignored").unwrap(),
            ""
        );
        let mut m = json!({"metadata": {"namespace": "../x"}});
        assert!(prepare_manifest(&mut m, &entry(true), "").is_err());
    }

    #[test]
    fn names_stay_in_their_path_segment() {
        for bad in ["a/b", "..", ".", "a?b", "a#b", "a%2f", "a b", "a\nb"] {
            assert!(segment(&Some(bad.into()), "name").is_err(), "{bad:?}");
        }
        assert!(segment(&None, "name").is_err());
        assert_eq!(segment(&Some("web-1.x".into()), "name").unwrap(), "web-1.x");
        assert_eq!(opt_segment(&None, "namespace").unwrap(), "");
    }

    #[test]
    fn apply_names_must_agree() {
        let mut m = json!({"metadata": {"name": "a"}});
        assert_eq!(name_for(&mut m, &None).unwrap(), "a");
        assert!(name_for(&mut m, &Some("b".into())).is_err());
        let mut m = json!({"metadata": {}});
        assert_eq!(name_for(&mut m, &Some("c".into())).unwrap(), "c");
        assert_eq!(m["metadata"]["name"], "c");
        assert!(name_for(&mut json!({"metadata": {}}), &None).is_err());
    }
}
