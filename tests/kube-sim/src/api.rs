//! The resource handlers: list, get, create, update (PUT), patch (all four kinds), delete
//! and deletecollection, `/status`, `/scale`, eviction, generic subresources, and the
//! authentication/authorization review kinds. Watches are in `watch.rs`; logs, exec and
//! port-forward have their own modules.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use http::{Method, Request, Response};
use hyper::body::Incoming;
use serde_json::{Map, Value, json};

use crate::apply::{self, Writer};
use crate::error::{ApiError, FieldCause};
use crate::http::{Body, Ctx, ResReq, json_response, json_response_warn, read_body};
use crate::objects;
use crate::patch;
use crate::rbac;
use crate::resources::{ResourceType, is_virtual};
use crate::schema;
use crate::store::{ObjKey, WriteError};
use crate::util::{
    FieldSelector, LabelSelector, format_time, get_path, now_rfc3339, random_suffix, set_path,
    str_at,
};
use crate::{State, SubresourceCall, exec, logs, portforward, success_status, watch};

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
    ) {
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

fn load(state: &State, rr: &ResReq) -> Result<Value, ApiError> {
    let name = rr.name.as_deref().unwrap_or_default();
    state
        .store
        .get(&key(rr, name))
        .ok_or_else(|| ApiError::not_found(&rr.rt.group, &rr.rt.plural, name))
}

/// An object as served at the request's version.
pub(crate) fn present(rt: &ResourceType, obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.insert("apiVersion".into(), json!(rt.api_version()));
        m.insert("kind".into(), json!(rt.kind));
    }
    o
}

/// Does the Accept header ask for `PartialObjectMetadata`?
pub(crate) fn wants_metadata(ctx: &Ctx) -> bool {
    let a = ctx.header("accept");
    a.contains("as=PartialObjectMetadata") && !a.starts_with("application/json,")
}

pub(crate) fn wants_table(ctx: &Ctx) -> bool {
    ctx.header("accept")
        .split(',')
        .next()
        .is_some_and(|first| first.contains("as=Table"))
}

pub(crate) fn partial_metadata(obj: &Value) -> Value {
    json!({
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj.get("metadata").cloned().unwrap_or(json!({})),
    })
}

fn age(obj: &Value) -> String {
    let Some(t) = str_at(obj, "metadata.creationTimestamp").and_then(crate::util::parse_time)
    else {
        return "<unknown>".into();
    };
    let secs = (time::OffsetDateTime::now_utc() - t).whole_seconds().max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 3600 * 3 => format!("{}m", s / 60),
        s if s < 86400 * 2 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

fn cell(rt: &ResourceType, obj: &Value, path: &str) -> Value {
    match (rt.kind.as_str(), path) {
        ("Pod", ".status.ready") => {
            let cs = get_path(obj, "status.containerStatuses")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let ready = cs
                .iter()
                .filter(|c| c.get("ready") == Some(&json!(true)))
                .count();
            json!(format!(
                "{ready}/{}",
                get_path(obj, "spec.containers")
                    .and_then(Value::as_array)
                    .map_or(0, Vec::len)
            ))
        }
        ("Pod", ".status.phase") => {
            if get_path(obj, "metadata.deletionTimestamp").is_some() {
                json!("Terminating")
            } else {
                get_path(obj, "status.phase")
                    .cloned()
                    .unwrap_or(json!("Pending"))
            }
        }
        ("Pod", ".status.restarts") => json!(0),
        ("Deployment", ".status.ready") => json!(format!(
            "{}/{}",
            get_path(obj, "status.readyReplicas")
                .and_then(Value::as_i64)
                .unwrap_or(0),
            get_path(obj, "spec.replicas")
                .and_then(Value::as_i64)
                .unwrap_or(0)
        )),
        (_, p) if p.ends_with("#count") => {
            json!(
                get_path(obj, p.trim_end_matches("#count"))
                    .and_then(Value::as_object)
                    .map_or(0, Map::len)
            )
        }
        (_, p) => match get_path(obj, p) {
            Some(Value::String(s)) => json!(s),
            Some(Value::Number(n)) => json!(n),
            Some(Value::Bool(b)) => json!(b.to_string()),
            Some(other) => json!(other.to_string()),
            None => json!("<none>"),
        },
    }
}

/// A `meta.k8s.io/v1` Table of the objects (what kubectl prints).
pub(crate) fn table(rt: &ResourceType, objs: &[Value], meta: Value) -> Value {
    let mut cols = vec![
        json!({"name": "Name", "type": "string", "format": "name", "description": "Name must be unique within a namespace.", "priority": 0}),
    ];
    for (name, _) in &rt.columns {
        cols.push(json!({"name": name, "type": "string", "format": "", "description": name, "priority": 0}));
    }
    cols.push(json!({"name": "Age", "type": "string", "format": "", "description": "CreationTimestamp is a timestamp representing the server time when this object was created.", "priority": 0}));
    let rows: Vec<Value> = objs
        .iter()
        .map(|o| {
            let mut cells = vec![json!(str_at(o, "metadata.name").unwrap_or_default())];
            for (_, path) in &rt.columns {
                cells.push(cell(rt, o, path));
            }
            cells.push(json!(age(o)));
            json!({ "cells": cells, "object": partial_metadata(o) })
        })
        .collect();
    json!({ "kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta, "columnDefinitions": cols, "rows": rows })
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ContinueToken {
    rv: u64,
    start: String,
}

fn list(state: &State, ctx: &Ctx, rr: &ResReq) -> Result<Response<Body>, ApiError> {
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
    if let Some(l) = limit {
        if rest.len() > l {
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

fn get(state: &State, ctx: &Ctx, rr: &ResReq) -> Result<Response<Body>, ApiError> {
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
fn parse_body(ctx: &Ctx, body: &[u8]) -> Result<Value, ApiError> {
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
    if let Some(k) = obj.get("kind").and_then(Value::as_str) {
        if k != rt.kind {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({}) does not match the expected API version ({})",
                str_at(obj, "apiVersion").unwrap_or_default(),
                rt.api_version()
            ))
            .with_details(json!({}))
            .with_kind_message(k, &rt.kind));
        }
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
fn validate(ctx: &Ctx, rt: &ResourceType, obj: &mut Value) -> Result<Warnings, ApiError> {
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
    if let Some(meta) = obj.get("metadata") {
        if !meta.is_object() {
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
        if let Some(body_ns) = str_at(obj, "metadata.namespace") {
            if !body_ns.is_empty() && body_ns != ns {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
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
    if !objects::uses_generation(rt) {
        if let Some(m) = obj["metadata"].as_object_mut() {
            m.remove("generation");
        }
    }
    validate_name(rt, obj)
}

/// Names must be DNS subdomains (namespaces: DNS labels), as the apiserver insists.
fn validate_name(rt: &ResourceType, obj: &Value) -> Result<(), ApiError> {
    let name = str_at(obj, "metadata.name").unwrap_or_default();
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
        .map_err(|_| ApiError::already_exists(&rt.group, &rt.plural, &name))?;
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

fn create(state: &State, ctx: &Ctx, rr: &ResReq, body: &[u8]) -> Result<Response<Body>, ApiError> {
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

fn write_error(rt: &ResourceType, name: &str, e: WriteError) -> ApiError {
    match e {
        WriteError::NotFound => ApiError::not_found(&rt.group, &rt.plural, name),
        WriteError::AlreadyExists => ApiError::already_exists(&rt.group, &rt.plural, name),
        WriteError::Conflict => ApiError::conflict(&rt.group, &rt.plural, name),
    }
}

fn body_rv(obj: &Value) -> Result<Option<u64>, ApiError> {
    match str_at(obj, "metadata.resourceVersion") {
        None | Some("") => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {s:?}"))),
    }
}

fn check_name(rr: &ResReq, obj: &Value) -> Result<(), ApiError> {
    let url_name = rr.name.as_deref().unwrap_or_default();
    if let Some(n) = str_at(obj, "metadata.name") {
        if n != url_name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({n}) does not match the name on the URL ({url_name})"
            )));
        }
    }
    Ok(())
}

fn update(state: &State, ctx: &Ctx, rr: &ResReq, body: &[u8]) -> Result<Response<Body>, ApiError> {
    let new = parse_body(ctx, body)?;
    check_name(rr, &new)?;
    let old = load(state, rr)?;
    let expect = body_rv(&new)?;
    if let Some(want) = expect {
        if str_at(&old, "metadata.resourceVersion") != Some(want.to_string().as_str()) {
            return Err(ApiError::conflict(
                &rr.rt.group,
                &rr.rt.plural,
                rr.name.as_deref().unwrap_or_default(),
            ));
        }
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

fn update_status(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let new = parse_body(ctx, body)?;
    check_name(rr, &new)?;
    let old = load(state, rr)?;
    let expect = body_rv(&new)?;
    let status = new.get("status").cloned().unwrap_or(Value::Null);
    let stored = write_status(state, ctx, rr, &old, status, expect)?;
    Ok(json_response(200, &present(&rr.rt, &stored)))
}

fn write_status(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
    old: &Value,
    status: Value,
    expect: Option<u64>,
) -> Result<Value, ApiError> {
    let name = rr.name.as_deref().unwrap_or_default();
    let mut new = old.clone();
    if status.is_null() {
        if let Some(m) = new.as_object_mut() {
            m.remove("status");
        }
    } else {
        new["status"] = status;
    }
    let manager = ctx.field_manager();
    let now = now_rfc3339();
    let api_version = rr.rt.api_version();
    apply::record_update(
        Some(old),
        &mut new,
        &Writer {
            manager: &manager,
            api_version: &api_version,
            subresource: Some("status"),
            now: &now,
        },
    );
    if ctx.dry_run() {
        return Ok(new);
    }
    state
        .store
        .update(&key(rr, name), new, expect.or(body_rv(old)?))
        .map_err(|e| write_error(&rr.rt, name, e))
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

fn apply_patch(rt: &ResourceType, ct: &str, target: &mut Value, p: &Value) -> Result<(), ApiError> {
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
        if rr.rt.has_status() {
            if let Some(m) = applied.as_object_mut() {
                m.remove("status");
            }
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

fn patch_status(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
    current: Option<Value>,
    ct: &str,
    p: &Value,
) -> Result<Response<Body>, ApiError> {
    let name = rr.name.clone().unwrap_or_default();
    let old = current.ok_or_else(|| ApiError::not_found(&rr.rt.group, &rr.rt.plural, &name))?;
    let mut new = old.clone();
    if ct == "application/apply-patch+yaml" {
        let manager = ctx
            .query
            .get("fieldManager")
            .unwrap_or_default()
            .to_string();
        let api_version = rr.rt.api_version();
        let now = now_rfc3339();
        let w = Writer {
            manager: &manager,
            api_version: &api_version,
            subresource: Some("status"),
            now: &now,
        };
        let only_status = json!({ "status": p.get("status").cloned().unwrap_or(json!({})) });
        new = apply::apply(&old, &only_status, ctx.query.flag("force"), &w)?;
        let stored = state
            .store
            .update(&key(rr, &name), new, body_rv(&old)?)
            .map_err(|e| write_error(&rr.rt, &name, e))?;
        return Ok(json_response(200, &present(&rr.rt, &stored)));
    }
    apply_patch(&rr.rt, ct, &mut new, p)?;
    let status = new.get("status").cloned().unwrap_or(Value::Null);
    let stored = write_status(state, ctx, rr, &old, status, body_rv(&old)?)?;
    Ok(json_response(200, &present(&rr.rt, &stored)))
}

/// The `autoscaling/v1` Scale view of an object.
pub(crate) fn to_scale(rt: &ResourceType, obj: &Value) -> Value {
    let paths = rt.scale.clone().unwrap_or(crate::resources::ScalePaths {
        spec_replicas: ".spec.replicas".into(),
        status_replicas: ".status.replicas".into(),
        label_selector: None,
    });
    let spec = get_path(obj, &paths.spec_replicas)
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let status = get_path(obj, &paths.status_replicas)
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let mut scale = json!({
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": get_path(obj, "metadata.name"),
            "namespace": get_path(obj, "metadata.namespace"),
            "uid": get_path(obj, "metadata.uid"),
            "resourceVersion": get_path(obj, "metadata.resourceVersion"),
            "creationTimestamp": get_path(obj, "metadata.creationTimestamp"),
        },
        "spec": { "replicas": spec },
        "status": { "replicas": status },
    });
    if let Some(sel) = paths
        .label_selector
        .as_deref()
        .and_then(|p| get_path(obj, p))
        .and_then(Value::as_str)
    {
        scale["status"]["selector"] = json!(sel);
    }
    scale
}

fn set_replicas(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
    old: &Value,
    replicas: i64,
    expect: Option<u64>,
) -> Result<Value, ApiError> {
    let name = rr.name.clone().unwrap_or_default();
    if replicas < 0 {
        return Err(ApiError::invalid(
            "autoscaling",
            "Scale",
            &name,
            vec![FieldCause {
                reason: "FieldValueInvalid",
                message: format!("Invalid value: {replicas}: must be greater than or equal to 0"),
                field: "spec.replicas".into(),
            }],
        ));
    }
    let path = rr
        .rt
        .scale
        .as_ref()
        .map(|s| s.spec_replicas.clone())
        .unwrap_or_else(|| ".spec.replicas".into());
    let mut new = old.clone();
    set_path(&mut new, &path, json!(replicas));
    if objects::spec_changed(old, &new) && get_path(old, "metadata.generation").is_some() {
        let g = get_path(old, "metadata.generation")
            .and_then(Value::as_i64)
            .unwrap_or(1);
        new["metadata"]["generation"] = json!(g + 1);
    }
    objects::on_update(&rr.rt, &mut new);
    let manager = ctx.field_manager();
    let now = now_rfc3339();
    let api_version = rr.rt.api_version();
    apply::record_update(
        Some(old),
        &mut new,
        &Writer {
            manager: &manager,
            api_version: &api_version,
            subresource: Some("scale"),
            now: &now,
        },
    );
    if ctx.dry_run() {
        return Ok(new);
    }
    state
        .store
        .update(&key(rr, &name), new, expect)
        .map_err(|e| write_error(&rr.rt, &name, e))
}

fn put_scale(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let scale = parse_body(ctx, body)?;
    let old = load(state, rr)?;
    let replicas = get_path(&scale, "spec.replicas")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let expect = body_rv(&scale)?;
    if let Some(want) = expect {
        if body_rv(&old)? != Some(want) {
            return Err(ApiError::conflict(
                &rr.rt.group,
                &rr.rt.plural,
                rr.name.as_deref().unwrap_or_default(),
            ));
        }
    }
    let stored = set_replicas(state, ctx, rr, &old, replicas, body_rv(&old)?)?;
    Ok(json_response(200, &to_scale(&rr.rt, &stored)))
}

fn patch_scale(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
    current: Option<Value>,
    ct: &str,
    p: &Value,
) -> Result<Response<Body>, ApiError> {
    let name = rr.name.clone().unwrap_or_default();
    let old = current.ok_or_else(|| ApiError::not_found(&rr.rt.group, &rr.rt.plural, &name))?;
    let mut scale = to_scale(&rr.rt, &old);
    match ct {
        "application/apply-patch+yaml" | "application/merge-patch+json" => {
            patch::merge_patch(&mut scale, p)
        }
        "application/strategic-merge-patch+json" => patch::strategic_merge(&mut scale, p)?,
        _ => patch::json_patch(&mut scale, p)?,
    }
    let replicas = get_path(&scale, "spec.replicas")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let stored = set_replicas(state, ctx, rr, &old, replicas, body_rv(&old)?)?;
    Ok(json_response(200, &to_scale(&rr.rt, &stored)))
}

/// DeleteOptions from the body, with query parameters taking precedence.
#[derive(Debug, Default)]
struct DeleteOpts {
    grace: Option<i64>,
    precondition_rv: Option<u64>,
    precondition_uid: Option<String>,
}

fn delete_opts(ctx: &Ctx, body: &[u8]) -> Result<DeleteOpts, ApiError> {
    let mut o = DeleteOpts::default();
    if !body.iter().all(u8::is_ascii_whitespace) {
        let v: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("invalid DeleteOptions: {e}")))?;
        o.grace = v.get("gracePeriodSeconds").and_then(Value::as_i64);
        o.precondition_rv = v
            .pointer("/preconditions/resourceVersion")
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok());
        o.precondition_uid = v
            .pointer("/preconditions/uid")
            .and_then(Value::as_str)
            .map(String::from);
    }
    if let Some(g) = ctx.query.int("gracePeriodSeconds")? {
        o.grace = Some(g);
    }
    Ok(o)
}

fn delete(
    state: &Arc<State>,
    ctx: &Ctx,
    rr: &ResReq,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let opts = delete_opts(ctx, body)?;
    let name = rr.name.clone().unwrap_or_default();
    let old = load(state, rr)?;
    if let Some(uid) = &opts.precondition_uid {
        if str_at(&old, "metadata.uid") != Some(uid.as_str()) {
            return Err(ApiError::new(
                409,
                "Conflict",
                format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    str_at(&old, "metadata.uid").unwrap_or_default()
                ),
            ));
        }
    }
    if let Some(rv) = opts.precondition_rv {
        if body_rv(&old)? != Some(rv) {
            return Err(ApiError::conflict(&rr.rt.group, &rr.rt.plural, &name));
        }
    }
    let (code, reply) = delete_object(state, rr, &name, old, opts.grace, ctx.dry_run())?;
    Ok(json_response(code, &reply))
}

/// Deletes one object the way its kind is deleted; returns the HTTP code and the reply.
fn delete_object(
    state: &Arc<State>,
    rr: &ResReq,
    name: &str,
    old: Value,
    grace: Option<i64>,
    dry_run: bool,
) -> Result<(u16, Value), ApiError> {
    let rt = &rr.rt;
    let k = key(rr, name);
    let now = time::OffsetDateTime::now_utc()
        .replace_nanosecond(0)
        .unwrap_or_else(|_| time::OffsetDateTime::now_utc());
    let has_finalizers = get_path(&old, "metadata.finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty());
    if has_finalizers {
        let mut new = old.clone();
        if get_path(&new, "metadata.deletionTimestamp").is_none() {
            new["metadata"]["deletionTimestamp"] = json!(format_time(now));
            new["metadata"]["deletionGracePeriodSeconds"] = json!(grace.unwrap_or(0));
        }
        if dry_run {
            return Ok((200, present(rt, &new)));
        }
        let stored = state
            .store
            .update(&k, new, None)
            .map_err(|e| write_error(rt, name, e))?;
        return Ok((200, present(rt, &stored)));
    }
    if rt.builtin && rt.kind == "Pod" {
        let grace = grace
            .or_else(|| {
                get_path(&old, "spec.terminationGracePeriodSeconds").and_then(Value::as_i64)
            })
            .unwrap_or(30);
        if dry_run {
            return Ok((200, present(rt, &old)));
        }
        if grace > 0 {
            if get_path(&old, "metadata.deletionTimestamp").is_some() {
                return Ok((200, present(rt, &old)));
            }
            let mut new = old.clone();
            new["metadata"]["deletionTimestamp"] =
                json!(format_time(now + time::Duration::seconds(grace)));
            new["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
            let stored = state
                .store
                .update(&k, new, None)
                .map_err(|e| write_error(rt, name, e))?;
            // The kubelet would stop the containers; ours stop after a short delay.
            let delay = state
                .cfg
                .pod_termination_delay
                .min(Duration::from_secs(grace as u64));
            let st = state.clone();
            let uid = str_at(&stored, "metadata.uid")
                .unwrap_or_default()
                .to_string();
            let k2 = k.clone();
            state.spawn(async move {
                tokio::select! {
                    _ = st.cancel.cancelled() => {}
                    _ = tokio::time::sleep(delay) => {
                        if st.store.get(&k2).is_some_and(|o| str_at(&o, "metadata.uid") == Some(uid.as_str())) {
                            let _ = st.store.delete(&k2, None);
                            st.logs.forget_pod(&k2.namespace, &k2.name);
                        }
                    }
                }
            });
            return Ok((200, present(rt, &stored)));
        }
        let gone = state
            .store
            .delete(&k, None)
            .map_err(|e| write_error(rt, name, e))?;
        state.logs.forget_pod(&k.namespace, name);
        return Ok((200, present(rt, &gone)));
    }
    if dry_run {
        return Ok((
            200,
            success_status(
                name,
                &rt.group,
                &rt.plural,
                str_at(&old, "metadata.uid").unwrap_or_default(),
            ),
        ));
    }
    if rt.builtin && rt.kind == "Namespace" {
        for k in state.store.keys_in_namespace(name) {
            let _ = state.store.delete(&k, None);
        }
        let mut gone = state
            .store
            .delete(&k, None)
            .map_err(|e| write_error(rt, name, e))?;
        gone["status"] = json!({ "phase": "Terminating" });
        return Ok((200, present(rt, &gone)));
    }
    if rt.builtin && rt.kind == "CustomResourceDefinition" {
        let (group, plural, _) = objects::crd_resource_types(&old);
        let (items, _) = state.store.list(&group, &plural, None);
        for i in items {
            let ik = ObjKey::new(
                &group,
                &plural,
                str_at(&i, "metadata.namespace").unwrap_or_default(),
                str_at(&i, "metadata.name").unwrap_or_default(),
            );
            let _ = state.store.delete(&ik, None);
        }
        state.registry.set_custom(&group, &plural, Vec::new());
    }
    let gone = state
        .store
        .delete(&k, None)
        .map_err(|e| write_error(rt, name, e))?;
    Ok((
        200,
        success_status(
            name,
            &rt.group,
            &rt.plural,
            str_at(&gone, "metadata.uid").unwrap_or_default(),
        ),
    ))
}

fn delete_collection(
    state: &Arc<State>,
    ctx: &Ctx,
    rr: &ResReq,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let opts = delete_opts(ctx, body)?;
    let (items, rv) = list_filtered(state, ctx, rr)?;
    let mut deleted = Vec::new();
    for obj in items {
        let name = str_at(&obj, "metadata.name")
            .unwrap_or_default()
            .to_string();
        let mut one = rr.clone();
        one.namespace = str_at(&obj, "metadata.namespace")
            .map(String::from)
            .filter(|s| !s.is_empty());
        one.name = Some(name.clone());
        if delete_object(state, &one, &name, obj.clone(), opts.grace, ctx.dry_run()).is_ok() {
            deleted.push(present(&rr.rt, &obj));
        }
    }
    Ok(json_response(
        200,
        &json!({ "kind": rr.rt.list_kind(), "apiVersion": rr.rt.api_version(), "metadata": { "resourceVersion": rv.to_string() }, "items": deleted }),
    ))
}

fn evict(state: &Arc<State>, rr: &ResReq) -> Result<Response<Body>, ApiError> {
    let name = rr.name.clone().unwrap_or_default();
    let old = load(state, rr)?;
    delete_object(state, rr, &name, old, None, false)?;
    Ok(json_response(
        201,
        &json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201 }),
    ))
}

/// Any other named subresource: the call is recorded and answered with what was sent.
fn generic_subresource(
    state: &State,
    ctx: &Ctx,
    rr: &ResReq,
    sub: &str,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let old = load(state, rr)?;
    let v = if body.is_empty() {
        json!({})
    } else {
        parse_body(ctx, body)?
    };
    if let Ok(mut calls) = state.subresource_calls.lock() {
        calls.push(SubresourceCall {
            method: ctx.method.to_string(),
            path: ctx.path.clone(),
            body: v.clone(),
        });
    }
    let mut reply = v;
    if !reply.is_object() {
        reply = json!({ "value": reply });
    }
    let st = rr.rt.subresources.iter().find(|s| s.name == sub);
    if let Some(st) = st {
        if reply.get("kind").is_none() {
            reply["kind"] = json!(st.kind);
        }
        if reply.get("apiVersion").is_none() {
            let av = if st.group.is_empty() {
                st.version.clone()
            } else {
                format!("{}/{}", st.group, st.version)
            };
            reply["apiVersion"] = json!(av);
        }
    }
    if !reply.get("metadata").is_some_and(Value::is_object) {
        reply["metadata"] = json!({});
    }
    if reply["metadata"].get("name").is_none() {
        reply["metadata"]["name"] = json!(rr.name);
    }
    if let Some(ns) = &rr.namespace {
        reply["metadata"]["namespace"] = json!(ns);
    }
    if sub == "token" {
        let token = format!("kube-sim-token-{}", crate::util::new_uid());
        let exp = format_time(time::OffsetDateTime::now_utc() + time::Duration::hours(1));
        reply["status"] = json!({ "token": token, "expirationTimestamp": exp });
    }
    let _ = old;
    let code = if ctx.method == Method::POST { 201 } else { 200 };
    Ok(json_response(code, &reply))
}

/// SelfSubjectReview, SelfSubjectAccessReview, SelfSubjectRulesReview.
fn review(
    state: &State,
    ctx: &Ctx,
    rt: &ResourceType,
    mut obj: Value,
) -> Result<Response<Body>, ApiError> {
    obj["apiVersion"] = json!(rt.api_version());
    obj["kind"] = json!(rt.kind);
    obj["metadata"] = json!({ "creationTimestamp": null });
    match rt.kind.as_str() {
        "SelfSubjectReview" => {
            obj["status"] = json!({ "userInfo": ctx.who.user_info() });
        }
        "SelfSubjectAccessReview" => {
            let ra = obj
                .pointer("/spec/resourceAttributes")
                .cloned()
                .unwrap_or(json!({}));
            let verb = ra.get("verb").and_then(Value::as_str).unwrap_or_default();
            let mut resource = ra
                .get("resource")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            if let Some(s) = ra
                .get("subresource")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
            {
                resource = format!("{resource}/{s}");
            }
            let ns = ra
                .get("namespace")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty());
            let allowed = rbac::allowed(&state.cfg, &ctx.who, verb, &resource, ns);
            obj["status"] = json!({ "allowed": allowed, "reason": if allowed { "allowed by kube-sim rules" } else { "" } });
        }
        "SelfSubjectRulesReview" => {
            let ns = obj
                .pointer("/spec/namespace")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let rules: Vec<Value> = state
                .cfg
                .rules
                .iter()
                .filter(|r| match &r.subject {
                    crate::Subject::User(u) => *u == ctx.who.user,
                    crate::Subject::Group(g) => ctx.who.groups.contains(g),
                })
                .filter(|r| {
                    r.namespaces.is_empty() || r.namespaces.iter().any(|n| n == "*" || *n == ns)
                })
                .map(|r| json!({ "verbs": r.verbs, "apiGroups": ["*"], "resources": r.resources }))
                .collect();
            obj["status"] =
                json!({ "resourceRules": rules, "nonResourceRules": [], "incomplete": false });
        }
        _ => return Err(ApiError::method_not_supported(&rt.plural)),
    }
    Ok(json_response(201, &obj))
}

/// Creates what every cluster has, the configured pods, and the demo workload if asked.
pub(crate) fn seed(state: &State) -> Result<(), crate::Error> {
    let fail = |e: ApiError| crate::Error::Config(format!("seeding failed: {e}"));
    for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
        create_direct(
            state,
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
        )
        .map_err(fail)?;
    }
    create_direct(state, json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": objects::NODE_NAME, "labels": {"kubernetes.io/hostname": objects::NODE_NAME, "kubernetes.io/os": "linux"}}})).map_err(fail)?;
    create_direct(state, json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "kubernetes", "namespace": "default", "labels": {"component": "apiserver", "provider": "kubernetes"}}, "spec": {"ports": [{"name": "https", "port": 443, "targetPort": 6443}]}})).map_err(fail)?;
    for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
        create_direct(state, json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}})).map_err(fail)?;
    }
    let mut pods = state.cfg.pods.clone();
    if state.cfg.demo_objects {
        pods.push(crate::PodSeed {
            namespace: "default".into(),
            name: "web-0".into(),
            containers: vec!["web".into()],
            labels: vec![("app".into(), "web".into())],
        });
        pods.push(crate::PodSeed {
            namespace: "default".into(),
            name: "tools".into(),
            containers: vec!["shell".into(), "sidecar".into()],
            labels: vec![],
        });
        pods.push(crate::PodSeed {
            namespace: "kube-system".into(),
            name: "coredns-sim".into(),
            containers: vec!["coredns".into()],
            labels: vec![("k8s-app".into(), "kube-dns".into())],
        });
    }
    for p in pods {
        if state
            .store
            .get(&ObjKey::new("", "namespaces", "", &p.namespace))
            .is_none()
        {
            create_direct(
                state,
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": p.namespace}}),
            )
            .map_err(fail)?;
        }
        let containers: Vec<Value> = p
            .containers
            .iter()
            .map(|c| json!({"name": c, "image": format!("registry.invalid/{c}:latest")}))
            .collect();
        let labels: Map<String, Value> = p
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        create_direct(state, json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": p.name, "namespace": p.namespace, "labels": labels}, "spec": {"containers": containers}})).map_err(fail)?;
    }
    if state.cfg.demo_objects {
        create_direct(state, json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": "default", "labels": {"app": "web"}},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                     "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "web", "image": "registry.invalid/web:latest"}]}}}
        })).map_err(fail)?;
        create_direct(state, json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "web-config", "namespace": "default"}, "data": {"greeting": "hello"}})).map_err(fail)?;
    }
    Ok(())
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
