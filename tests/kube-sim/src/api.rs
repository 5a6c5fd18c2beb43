//! The resource handlers: list, get, create, update (PUT) and patch (all four kinds), plus
//! the request dispatch for every resource path. Deletion is in `delete.rs`, `/status`,
//! `/scale` and other subresources in `subresources.rs`, output shapes in `output.rs`,
//! watches in `watch.rs`; logs, exec and port-forward have their own modules.

use std::sync::Arc;

use base64::Engine;
use http::{Method, Request, Response};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::apply::{self, Writer};
use crate::delete::{delete, delete_collection};
use crate::error::{ApiError, FieldCause};
use crate::http::{Body, Ctx, ResReq, json_response, json_response_warn, read_body};
use crate::objects;
use crate::output::{partial_metadata, present, table, wants_metadata, wants_table};
use crate::patch;
use crate::rbac;
use crate::resources::{ResourceType, is_virtual};
use crate::schema;
use crate::store::{ObjKey, WriteError};
use crate::subresources::{
    evict, generic_subresource, patch_scale, patch_status, put_scale, review, to_scale,
    update_status,
};
use crate::util::{FieldSelector, LabelSelector, get_path, now_rfc3339, random_suffix, str_at};
use crate::{State, exec, logs, portforward, watch};

/// Which verb a request is, for authorisation.
fn verb_of(ctx: &Ctx, rr: &ResReq) -> &'static str {
    if matches!(rr.sub.as_deref(), Some("exec" | "attach" | "portforward")) {
        // The apiserver authorises streaming subresources as "create" whatever the method.
        return "create";
    }
    match (&ctx.method, rr.name.is_some()) {
        (&Method::GET, false) if ctx.query.flag("watch") => "watch",
        (&Method::GET, false) => "list",
        (&Method::GET, true) if ctx.query.flag("watch") => "watch",
        (&Method::GET, true) => "get",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, false) => "deletecollection",
        (&Method::DELETE, true) => "delete",
        _ => "unknown",
    }
}

pub(crate) async fn dispatch(
    state: Arc<State>,
    ctx: Ctx,
    rr: ResReq,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let verb = verb_of(&ctx, &rr);
    let resource = match &rr.sub {
        Some(s) => format!("{}/{s}", rr.rt.plural),
        None => rr.rt.plural.clone(),
    };
    if !rbac::allowed(
        &state.cfg,
        &ctx.who,
        verb,
        &resource,
        rr.namespace.as_deref(),
    ) && !rbac::bound_cluster_admin(&state.store, &ctx.who)
    {
        return Err(rbac::forbidden(
            &ctx.who,
            verb,
            &rr.rt.group,
            &resource,
            rr.name.as_deref(),
            rr.namespace.as_deref(),
        ));
    }
    if !rr.rt.verbs.iter().any(|v| v == verb) && rr.sub.is_none() {
        return Err(ApiError::method_not_supported(&resource));
    }
    let sub = rr.sub.clone();
    match (ctx.method.clone(), rr.name.is_some(), sub.as_deref()) {
        (Method::GET, _, _) if ctx.query.flag("watch") => watch::watch(state, &ctx, &rr),
        (Method::GET, false, None) => list(&state, &ctx, &rr),
        (Method::GET, true, None) => get(&state, &ctx, &rr),
        (Method::GET, true, Some("log")) => logs::handle(state, &ctx, &rr),
        (_, true, Some("exec" | "attach")) => exec::handle(state, ctx, rr, req),
        (_, true, Some("portforward")) => portforward::handle(state, ctx, rr, req),
        (Method::GET, true, Some("scale")) => {
            let obj = load(&state, &rr)?;
            Ok(json_response(200, &to_scale(&rr.rt, &obj)))
        }
        (Method::GET, true, Some(_)) => get(&state, &ctx, &rr),
        (Method::POST, false, None) => {
            let body = read_body(req.into_body()).await?;
            create(&state, &ctx, &rr, &body)
        }
        (Method::PUT, true, None) => {
            let body = read_body(req.into_body()).await?;
            update(&state, &ctx, &rr, &body)
        }
        (Method::PATCH, true, None | Some("status") | Some("scale")) => {
            let body = read_body(req.into_body()).await?;
            patch_handler(&state, &ctx, &rr, &body)
        }
        (Method::PUT, true, Some("status")) => {
            let body = read_body(req.into_body()).await?;
            update_status(&state, &ctx, &rr, &body)
        }
        (Method::PUT, true, Some("scale")) => {
            let body = read_body(req.into_body()).await?;
            put_scale(&state, &ctx, &rr, &body)
        }
        (Method::POST, true, Some("eviction")) => {
            let _ = read_body(req.into_body()).await?;
            evict(&state, &rr)
        }
        (Method::PUT | Method::POST | Method::PATCH, true, Some(s)) => {
            let s = s.to_string();
            let body = read_body(req.into_body()).await?;
            generic_subresource(&state, &ctx, &rr, &s, &body)
        }
        (Method::DELETE, true, None) => {
            let body = read_body(req.into_body()).await?;
            delete(&state, &ctx, &rr, &body)
        }
        (Method::DELETE, false, None) => {
            let body = read_body(req.into_body()).await?;
            delete_collection(&state, &ctx, &rr, &body)
        }
        _ => Err(ApiError::method_not_supported(&resource)),
    }
}

pub(crate) fn key(rr: &ResReq, name: &str) -> ObjKey {
    ObjKey::new(
        &rr.rt.group,
        &rr.rt.plural,
        rr.namespace.as_deref().unwrap_or_default(),
        name,
    )
}

pub(crate) fn load(state: &State, rr: &ResReq) -> Result<Value, ApiError> {
    let name = rr.name.as_deref().unwrap_or_default();
    state
        .store
        .get(&key(rr, name))
        .ok_or_else(|| ApiError::not_found(&rr.rt.group, &rr.rt.plural, name))
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ContinueToken {
    rv: u64,
    start: String,
}

pub(crate) fn list(state: &State, ctx: &Ctx, rr: &ResReq) -> Result<Response<Body>, ApiError> {
    let (items, rv) = list_filtered(state, ctx, rr)?;
    let limit = ctx
        .query
        .int("limit")?
        .filter(|l| *l > 0)
        .map(|l| l as usize);
    let mut start_after: Option<String> = None;
    let mut list_rv = rv;
    if let Some(tok) = ctx.query.get("continue").filter(|t| !t.is_empty()) {
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(tok)
            .ok()
            .and_then(|b| serde_json::from_slice::<ContinueToken>(&b).ok())
            .ok_or_else(|| ApiError::bad_request("invalid continue token"))?;
        if raw.rv < state.store.compacted_rv() {
            return Err(ApiError::gone(
                "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.",
            ));
        }
        list_rv = raw.rv;
        start_after = Some(raw.start);
    }
    let sort_key = |o: &Value| {
        format!(
            "{}/{}",
            str_at(o, "metadata.namespace").unwrap_or_default(),
            str_at(o, "metadata.name").unwrap_or_default()
        )
    };
    let mut rest: Vec<Value> = items
        .into_iter()
        .filter(|o| start_after.as_ref().is_none_or(|s| sort_key(o) > *s))
        .collect();
    let mut meta = json!({ "resourceVersion": list_rv.to_string() });
    if let Some(l) = limit
        && rest.len() > l
    {
        let remaining = rest.len() - l;
        rest.truncate(l);
        let last = rest.last().map(sort_key).unwrap_or_default();
        let tok = serde_json::to_vec(&ContinueToken {
            rv: list_rv,
            start: last,
        })
        .unwrap_or_default();
        meta["continue"] = json!(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(tok));
        meta["remainingItemCount"] = json!(remaining);
    }
    if wants_table(ctx) {
        return Ok(json_response(200, &table(&rr.rt, &rest, meta)));
    }
    if wants_metadata(ctx) {
        let items: Vec<Value> = rest.iter().map(partial_metadata).collect();
        return Ok(json_response(
            200,
            &json!({ "kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1", "metadata": meta, "items": items }),
        ));
    }
    let items: Vec<Value> = rest.iter().map(|o| present(&rr.rt, o)).collect();
    Ok(json_response(
        200,
        &json!({ "kind": rr.rt.list_kind(), "apiVersion": rr.rt.api_version(), "metadata": meta, "items": items }),
    ))
}

/// Objects matching the request's namespace and selectors, sorted by namespace/name.
pub(crate) fn list_filtered(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
) -> Result<(Vec<Value>, u64), ApiError> {
    let labels = LabelSelector::parse(ctx.query.get("labelSelector").unwrap_or_default())?;
    let fields = FieldSelector::parse(ctx.query.get("fieldSelector").unwrap_or_default())?;
    let (items, rv) = state
        .store
        .list(&rr.rt.group, &rr.rt.plural, rr.namespace.as_deref());
    let items = items
        .into_iter()
        .filter(|o| labels.matches_object(o) && fields.matches_object(o))
        .collect();
    Ok((items, rv))
}

pub(crate) fn get(state: &State, ctx: &Ctx, rr: &ResReq) -> Result<Response<Body>, ApiError> {
    let obj = load(state, rr)?;
    if wants_table(ctx) {
        let meta = json!({ "resourceVersion": str_at(&obj, "metadata.resourceVersion").unwrap_or_default() });
        return Ok(json_response(200, &table(&rr.rt, &[obj], meta)));
    }
    if wants_metadata(ctx) {
        return Ok(json_response(200, &partial_metadata(&obj)));
    }
    Ok(json_response(200, &present(&rr.rt, &obj)))
}

/// Parses a request body: JSON, or YAML for apply patches and YAML content types.
pub(crate) fn parse_body(ctx: &Ctx, body: &[u8]) -> Result<Value, ApiError> {
    let ct = ctx.header("content-type");
    if ct.contains("protobuf") {
        return crate::protobuf::decode(body);
    }
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        return Ok(v);
    }
    let text = std::str::from_utf8(body)
        .map_err(|_| ApiError::bad_request("the request body is not UTF-8"))?;
    serde_saphyr::from_str::<Value>(text)
        .map_err(|e| ApiError::bad_request(format!("error decoding the request body: {e}")))
}

fn check_type(rt: &ResourceType, obj: &Value) -> Result<(), ApiError> {
    if let Some(k) = obj.get("kind").and_then(Value::as_str)
        && k != rt.kind
    {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({}) does not match the expected API version ({})",
            str_at(obj, "apiVersion").unwrap_or_default(),
            rt.api_version()
        ))
        .with_details(json!({}))
        .with_kind_message(k, &rt.kind));
    }
    if let Some(av) = obj.get("apiVersion").and_then(Value::as_str) {
        let group = av.split_once('/').map(|(g, _)| g).unwrap_or("");
        if group != rt.group {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({av}) does not match the expected API version ({})",
                rt.api_version()
            )));
        }
    }
    Ok(())
}

trait KindMessage {
    fn with_kind_message(self, got: &str, want: &str) -> Self;
}

impl KindMessage for ApiError {
    fn with_kind_message(mut self, got: &str, want: &str) -> Self {
        self.message =
            format!("the kind in the data ({got}) does not match the expected kind ({want})");
        self
    }
}

/// Validation outcome: warnings to return with a successful write.
type Warnings = Vec<String>;

/// Validates an object before it is written: built-in rules, CRD schemas (with pruning and
/// `fieldValidation`), CRD definitions.
pub(crate) fn validate(
    ctx: &Ctx,
    rt: &ResourceType,
    obj: &mut Value,
) -> Result<Warnings, ApiError> {
    let name = str_at(obj, "metadata.name").unwrap_or_default().to_string();
    let mut warnings = Vec::new();
    let mode = ctx
        .query
        .get("fieldValidation")
        .unwrap_or("Warn")
        .to_string();
    if rt.builtin {
        objects::validate_builtin(rt, obj)?;
        if rt.kind == "CustomResourceDefinition" {
            objects::validate_crd(obj)?;
        }
        let unknown = crate::openapi::unknown_top_level(rt, obj);
        handle_unknown(rt, &mode, unknown, &mut warnings)?;
        return Ok(warnings);
    }
    if let Some(s) = &rt.schema {
        let out = schema::validate(s, obj);
        if !out.causes.is_empty() {
            return Err(ApiError::invalid(&rt.group, &rt.kind, &name, out.causes));
        }
        handle_unknown(rt, &mode, out.unknown, &mut warnings)?;
    }
    if let Some(meta) = obj.get("metadata")
        && !meta.is_object()
    {
        return Err(ApiError::invalid(
            &rt.group,
            &rt.kind,
            &name,
            vec![FieldCause {
                reason: "FieldValueInvalid",
                message: "Invalid value: must be an object".into(),
                field: "metadata".into(),
            }],
        ));
    }
    Ok(warnings)
}

fn handle_unknown(
    rt: &ResourceType,
    mode: &str,
    unknown: Vec<String>,
    warnings: &mut Warnings,
) -> Result<(), ApiError> {
    if unknown.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = unknown
        .iter()
        .map(|u| format!("unknown field \"{u}\""))
        .collect();
    match mode {
        "Strict" => Err(ApiError::bad_request(format!(
            "{} in version \"{}\" cannot be handled as a {}: strict decoding error: {}",
            rt.kind,
            rt.version,
            rt.kind,
            list.join(", ")
        ))),
        "Ignore" => Ok(()),
        _ => {
            warnings.extend(list);
            Ok(())
        }
    }
}

fn namespace_exists(state: &State, ns: &str) -> Result<(), ApiError> {
    if state
        .store
        .get(&ObjKey::new("", "namespaces", "", ns))
        .is_none()
    {
        return Err(ApiError::not_found("", "namespaces", ns));
    }
    Ok(())
}

/// Prepares a new object for storage: identity, namespace, server fields, defaults.
fn prepare_new(
    state: &State,
    rt: &ResourceType,
    namespace: Option<&str>,
    obj: &mut Value,
) -> Result<(), ApiError> {
    if !obj.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    check_type(rt, obj)?;
    obj["apiVersion"] = json!(rt.api_version());
    obj["kind"] = json!(rt.kind);
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    if rt.namespaced {
        let ns = namespace
            .ok_or_else(|| ApiError::bad_request("the namespace of the object is required"))?;
        if let Some(body_ns) = str_at(obj, "metadata.namespace")
            && !body_ns.is_empty()
            && body_ns != ns
        {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        obj["metadata"]["namespace"] = json!(ns);
        namespace_exists(state, ns)?;
    } else if let Some(m) = obj["metadata"].as_object_mut() {
        m.remove("namespace");
    }
    let name = str_at(obj, "metadata.name").unwrap_or_default().to_string();
    if name.is_empty() {
        match str_at(obj, "metadata.generateName").filter(|g| !g.is_empty()) {
            Some(g) => obj["metadata"]["name"] = json!(format!("{g}{}", random_suffix())),
            None => {
                return Err(ApiError::invalid(
                    &rt.group,
                    &rt.kind,
                    "",
                    vec![FieldCause {
                        reason: "FieldValueRequired",
                        message: "Required value: name or generateName is required".into(),
                        field: "metadata.name".into(),
                    }],
                ));
            }
        }
    }
    if let Some(m) = obj["metadata"].as_object_mut() {
        m.remove("resourceVersion");
        m.remove("managedFields");
    }
    objects::stamp_new(obj);
    if !objects::uses_generation(rt)
        && let Some(m) = obj["metadata"].as_object_mut()
    {
        m.remove("generation");
    }
    validate_name(rt, obj)
}

/// Names must be DNS subdomains (namespaces: DNS labels), as the apiserver
/// insists; RBAC objects only need to be valid path segments, which is why
/// names like `system:controller:foo` exist.
fn validate_name(rt: &ResourceType, obj: &Value) -> Result<(), ApiError> {
    let name = str_at(obj, "metadata.name").unwrap_or_default();
    if rt.builtin && rt.group == "rbac.authorization.k8s.io" {
        if !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '%']) {
            return Ok(());
        }
        return Err(ApiError::invalid(
            &rt.group,
            &rt.kind,
            name,
            vec![FieldCause {
                reason: "FieldValueInvalid",
                message: format!(
                    "Invalid value: \"{name}\": may not contain '/' or '%' and may not be '.' or '..'"
                ),
                field: "metadata.name".into(),
            }],
        ));
    }
    let label = rt.builtin && matches!(rt.kind.as_str(), "Namespace" | "Service");
    let max = if label { 63 } else { 253 };
    let ok_chars = name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || (c == '.' && !label));
    let ends_ok = name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok_chars && ends_ok && name.len() <= max {
        return Ok(());
    }
    let message = if label {
        format!(
            "Invalid value: \"{name}\": a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
        )
    } else {
        format!(
            "Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
        )
    };
    Err(ApiError::invalid(
        &rt.group,
        &rt.kind,
        name,
        vec![FieldCause {
            reason: "FieldValueInvalid",
            message,
            field: "metadata.name".into(),
        }],
    ))
}

/// Stores a prepared object and runs what follows a create (CRD registration).
fn store_new(
    state: &State,
    rt: &ResourceType,
    obj: Value,
    dry_run: bool,
) -> Result<Value, ApiError> {
    let name = str_at(&obj, "metadata.name")
        .unwrap_or_default()
        .to_string();
    let ns = str_at(&obj, "metadata.namespace")
        .unwrap_or_default()
        .to_string();
    let k = ObjKey::new(&rt.group, &rt.plural, &ns, &name);
    if dry_run {
        if state.store.get(&k).is_some() {
            return Err(ApiError::already_exists(&rt.group, &rt.plural, &name));
        }
        return Ok(obj);
    }
    let stored = state
        .store
        .create(&k, obj)
        .map_err(|e| write_error(rt, &name, e))?;
    after_write(state, rt, &stored);
    if rt.builtin && rt.kind == "Pod" {
        seed_pod_logs(state, &stored);
    }
    Ok(stored)
}

fn after_write(state: &State, rt: &ResourceType, obj: &Value) {
    if rt.builtin && rt.kind == "CustomResourceDefinition" {
        let (group, plural, types) = objects::crd_resource_types(obj);
        state.registry.set_custom(&group, &plural, types);
    }
}

pub(crate) fn create(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let mut obj = parse_body(ctx, body)?;
    if is_virtual(&rr.rt) {
        return review(state, ctx, &rr.rt, obj);
    }
    prepare_new(state, &rr.rt, rr.namespace.as_deref(), &mut obj)?;
    let warnings = validate(ctx, &rr.rt, &mut obj)?;
    objects::on_create(&rr.rt, &mut obj);
    let manager = ctx.field_manager();
    let now = now_rfc3339();
    let api_version = rr.rt.api_version();
    apply::record_update(
        None,
        &mut obj,
        &Writer {
            manager: &manager,
            api_version: &api_version,
            subresource: None,
            now: &now,
        },
    );
    let stored = store_new(state, &rr.rt, obj, ctx.dry_run())?;
    Ok(json_response_warn(
        201,
        &present(&rr.rt, &stored),
        &warnings,
    ))
}

/// Creates an object as the admin would, outside any request (fixtures, seeding).
pub(crate) fn create_direct(state: &State, mut obj: Value) -> Result<Value, ApiError> {
    let av = str_at(&obj, "apiVersion").unwrap_or_default().to_string();
    let kind = str_at(&obj, "kind").unwrap_or_default().to_string();
    let (group, version) = av.split_once('/').unwrap_or(("", av.as_str()));
    let rt = state
        .registry
        .all()
        .into_iter()
        .find(|r| r.group == group && r.version == version && r.kind == kind)
        .ok_or_else(|| ApiError::bad_request(format!("no kind {kind} in {av}")))?;
    let ns = str_at(&obj, "metadata.namespace")
        .map(String::from)
        .or_else(|| rt.namespaced.then(|| "default".to_string()));
    prepare_new(state, &rt, ns.as_deref(), &mut obj)?;
    if let Some(s) = &rt.schema {
        let out = schema::validate(s, &mut obj);
        if !out.causes.is_empty() {
            return Err(ApiError::invalid(
                &rt.group,
                &rt.kind,
                str_at(&obj, "metadata.name").unwrap_or_default(),
                out.causes,
            ));
        }
    } else {
        objects::validate_builtin(&rt, &obj)?;
    }
    objects::on_create(&rt, &mut obj);
    let now = now_rfc3339();
    let api_version = rt.api_version();
    apply::record_update(
        None,
        &mut obj,
        &Writer {
            manager: "kube-sim",
            api_version: &api_version,
            subresource: None,
            now: &now,
        },
    );
    store_new(state, &rt, obj, false)
}

fn seed_pod_logs(state: &State, pod: &Value) {
    let ns = str_at(pod, "metadata.namespace").unwrap_or_default();
    let name = str_at(pod, "metadata.name").unwrap_or_default();
    for c in get_path(pod, "spec.containers")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
    {
        let cname = c.get("name").and_then(Value::as_str).unwrap_or_default();
        state
            .logs
            .append(ns, name, cname, &format!("container {cname} started"));
    }
}

/// How an update is being made, for managedFields.
enum WriteKind<'a> {
    Update {
        manager: &'a str,
    },
    /// managedFields were already computed by server-side apply.
    Applied,
}

/// Writes `new` over `old` on the main resource: identity and status preserved, generation
/// bumped on spec changes, validation, managedFields, finalizer-driven deletion.
fn commit_update(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
    old: &Value,
    mut new: Value,
    how: WriteKind<'_>,
    expect_rv: Option<u64>,
) -> Result<(Value, Warnings), ApiError> {
    let rt = &rr.rt;
    let name = str_at(old, "metadata.name").unwrap_or_default().to_string();
    if !new.is_object() {
        return Err(ApiError::bad_request("the object must be a JSON object"));
    }
    check_type(rt, &new)?;
    new["apiVersion"] = json!(rt.api_version());
    new["kind"] = json!(rt.kind);
    if !new.get("metadata").is_some_and(Value::is_object) {
        new["metadata"] = json!({});
    }
    for f in [
        "uid",
        "creationTimestamp",
        "name",
        "namespace",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
    ] {
        match old.pointer(&format!("/metadata/{f}")) {
            Some(v) => new["metadata"][f] = v.clone(),
            None => {
                if let Some(m) = new["metadata"].as_object_mut() {
                    m.remove(f);
                }
            }
        }
    }
    if rt.has_status() || rt.builtin {
        // The main resource never changes status when a status subresource exists.
        match old.get("status") {
            Some(s) if rt.has_status() => new["status"] = s.clone(),
            _ => {}
        }
    }
    let warnings = validate(ctx, rt, &mut new)?;
    if objects::spec_changed(old, &new) && get_path(old, "metadata.generation").is_some() {
        let g = get_path(old, "metadata.generation")
            .and_then(Value::as_i64)
            .unwrap_or(1);
        new["metadata"]["generation"] = json!(g + 1);
    }
    objects::on_update(rt, &mut new);
    if let WriteKind::Update { manager } = how {
        let now = now_rfc3339();
        let api_version = rt.api_version();
        apply::record_update(
            Some(old),
            &mut new,
            &Writer {
                manager,
                api_version: &api_version,
                subresource: None,
                now: &now,
            },
        );
    }
    if ctx.dry_run() {
        return Ok((new, warnings));
    }
    let k = key(rr, &name);
    // An object being deleted goes away once its last finalizer is removed.
    if get_path(&new, "metadata.deletionTimestamp").is_some()
        && get_path(&new, "metadata.finalizers")
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty)
    {
        let gone = state
            .store
            .delete(&k, expect_rv)
            .map_err(|e| write_error(rt, &name, e))?;
        return Ok((gone, warnings));
    }
    let stored = state
        .store
        .update(&k, new, expect_rv)
        .map_err(|e| write_error(rt, &name, e))?;
    after_write(state, rt, &stored);
    Ok((stored, warnings))
}

pub(crate) fn write_error(rt: &ResourceType, name: &str, e: WriteError) -> ApiError {
    match e {
        WriteError::NotFound => ApiError::not_found(&rt.group, &rt.plural, name),
        WriteError::AlreadyExists => ApiError::already_exists(&rt.group, &rt.plural, name),
        WriteError::Conflict => ApiError::conflict(&rt.group, &rt.plural, name),
        WriteError::Full => ApiError::internal("etcdserver: mvcc: database space exceeded"),
    }
}

pub(crate) fn body_rv(obj: &Value) -> Result<Option<u64>, ApiError> {
    match str_at(obj, "metadata.resourceVersion") {
        None | Some("") => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {s:?}"))),
    }
}

pub(crate) fn check_name(rr: &ResReq, obj: &Value) -> Result<(), ApiError> {
    let url_name = rr.name.as_deref().unwrap_or_default();
    if let Some(n) = str_at(obj, "metadata.name")
        && n != url_name
    {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({n}) does not match the name on the URL ({url_name})"
        )));
    }
    Ok(())
}

pub(crate) fn update(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let new = parse_body(ctx, body)?;
    check_name(rr, &new)?;
    let old = load(state, rr)?;
    let expect = body_rv(&new)?;
    if let Some(want) = expect
        && str_at(&old, "metadata.resourceVersion") != Some(want.to_string().as_str())
    {
        return Err(ApiError::conflict(
            &rr.rt.group,
            &rr.rt.plural,
            rr.name.as_deref().unwrap_or_default(),
        ));
    }
    let manager = ctx.field_manager();
    let (stored, warnings) = commit_update(
        state,
        ctx,
        rr,
        &old,
        new,
        WriteKind::Update { manager: &manager },
        expect.or(body_rv(&old)?),
    )?;
    Ok(json_response_warn(
        200,
        &present(&rr.rt, &stored),
        &warnings,
    ))
}

fn patch_handler(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let ct = ctx
        .header("content-type")
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_string();
    let name = rr.name.clone().unwrap_or_default();
    let is_apply = ct == "application/apply-patch+yaml" || ct == "application/apply-patch+cbor";
    match ct.as_str() {
        "application/json-patch+json"
        | "application/merge-patch+json"
        | "application/apply-patch+yaml" => {}
        "application/strategic-merge-patch+json" if rr.rt.builtin => {}
        "application/strategic-merge-patch+json" => {
            return Err(ApiError::unsupported_media_type(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
            ));
        }
        other => {
            return Err(ApiError::unsupported_media_type(format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (got {other:?})"
            )));
        }
    }
    let patch_doc = parse_body(ctx, body)?;
    if is_apply && ctx.query.get("fieldManager").is_none_or(str::is_empty) {
        return Err(ApiError::bad_request(
            "PATCH requests with the application/apply-patch+yaml content type require fieldManager to be set",
        ));
    }
    // Optimistic concurrency: retry when the object changed between read and write.
    for _ in 0..5 {
        let current = state.store.get(&key(rr, &name));
        let result = match rr.sub.as_deref() {
            Some("scale") => patch_scale(state, ctx, rr, current, &ct, &patch_doc),
            Some("status") => patch_status(state, ctx, rr, current, &ct, &patch_doc),
            _ => patch_main(state, ctx, rr, current, &ct, &patch_doc),
        };
        match result {
            Err(e)
                if e.code == 409
                    && e.reason == "Conflict"
                    && e.details.as_ref().and_then(|d| d.get("causes")).is_none()
                    && !patch_sets_rv(&patch_doc) =>
            {
                continue;
            }
            other => return other,
        }
    }
    Err(ApiError::conflict(&rr.rt.group, &rr.rt.plural, &name))
}

fn patch_sets_rv(p: &Value) -> bool {
    p.pointer("/metadata/resourceVersion").is_some()
}

pub(crate) fn apply_patch(
    rt: &ResourceType,
    ct: &str,
    target: &mut Value,
    p: &Value,
) -> Result<(), ApiError> {
    match ct {
        "application/json-patch+json" => patch::json_patch(target, p),
        "application/merge-patch+json" => {
            patch::merge_patch(target, p);
            Ok(())
        }
        "application/strategic-merge-patch+json" if rt.builtin => patch::strategic_merge(target, p),
        _ => Err(ApiError::unsupported_media_type("unsupported patch type")),
    }
}

fn patch_main(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
    current: Option<Value>,
    ct: &str,
    p: &Value,
) -> Result<Response<Body>, ApiError> {
    let name = rr.name.clone().unwrap_or_default();
    let api_version = rr.rt.api_version();
    let now = now_rfc3339();
    if ct == "application/apply-patch+yaml" {
        check_name(rr, p)?;
        check_type(&rr.rt, p)?;
        let manager = ctx
            .query
            .get("fieldManager")
            .unwrap_or_default()
            .to_string();
        let force = ctx.query.flag("force");
        let w = Writer {
            manager: &manager,
            api_version: &api_version,
            subresource: None,
            now: &now,
        };
        let mut applied = p.clone();
        if rr.rt.has_status()
            && let Some(m) = applied.as_object_mut()
        {
            m.remove("status");
        }
        return match current {
            None => {
                // Apply creates a missing object.
                let mut base = json!({ "metadata": { "name": name } });
                prepare_new(state, &rr.rt, rr.namespace.as_deref(), &mut base)?;
                let mut obj = apply::apply(&base, &applied, force, &w)?;
                obj["metadata"]["name"] = json!(name);
                if let Some(ns) = &rr.namespace {
                    obj["metadata"]["namespace"] = json!(ns);
                }
                let warnings = validate(ctx, &rr.rt, &mut obj)?;
                objects::on_create(&rr.rt, &mut obj);
                let stored = store_new(state, &rr.rt, obj, ctx.dry_run())?;
                Ok(json_response_warn(
                    201,
                    &present(&rr.rt, &stored),
                    &warnings,
                ))
            }
            Some(old) => {
                let merged = apply::apply(&old, &applied, force, &w)?;
                let expect = body_rv(p)?.or(body_rv(&old)?);
                let (stored, warnings) =
                    commit_update(state, ctx, rr, &old, merged, WriteKind::Applied, expect)?;
                Ok(json_response_warn(
                    200,
                    &present(&rr.rt, &stored),
                    &warnings,
                ))
            }
        };
    }
    let old = current.ok_or_else(|| ApiError::not_found(&rr.rt.group, &rr.rt.plural, &name))?;
    let mut new = old.clone();
    apply_patch(&rr.rt, ct, &mut new, p)?;
    let expect = match body_rv(&new)? {
        Some(rv) if Some(rv) != body_rv(&old)? => {
            return Err(ApiError::conflict(&rr.rt.group, &rr.rt.plural, &name));
        }
        _ => body_rv(&old)?,
    };
    let manager = ctx.field_manager();
    let (stored, warnings) = commit_update(
        state,
        ctx,
        rr,
        &old,
        new,
        WriteKind::Update { manager: &manager },
        expect,
    )?;
    Ok(json_response_warn(
        200,
        &present(&rr.rt, &stored),
        &warnings,
    ))
}

/// Name of a pod's single container, or the requested one; 400 like the kubelet otherwise.
pub(crate) fn pick_container(pod: &Value, requested: Option<&str>) -> Result<String, ApiError> {
    let name = str_at(pod, "metadata.name").unwrap_or_default();
    let names: Vec<String> = get_path(pod, "spec.containers")
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .filter_map(|c| c.get("name").and_then(Value::as_str).map(String::from))
                .collect()
        })
        .unwrap_or_default();
    match requested.filter(|r| !r.is_empty()) {
        Some(r) if names.iter().any(|n| n == r) => Ok(r.to_string()),
        Some(r) => Err(ApiError::bad_request(format!(
            "container {r} is not valid for pod {name}"
        ))),
        None if names.len() == 1 => Ok(names[0].clone()),
        None => Err(ApiError::bad_request(format!(
            "a container name must be specified for pod {name}, choose one of: [{}]",
            names.join(" ")
        ))),
    }
}

/// The object of a pod subresource request, 404 if missing.
pub(crate) fn load_pod(state: &State, rr: &ResReq) -> Result<Value, ApiError> {
    load(state, rr)
}
