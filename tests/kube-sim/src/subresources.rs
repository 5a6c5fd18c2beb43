//! Subresources: `/status` (only status changes), `/scale` (an `autoscaling/v1` view of
//! the replicas), eviction, any other listed subresource through a generic handler that
//! records its calls, and the self-review kinds that are answered, never stored.

use std::sync::Arc;

use http::{Method, Response};
use serde_json::{Value, json};

use crate::api::{apply_patch, body_rv, check_name, key, load, parse_body, write_error};
use crate::apply::{self, Writer};
use crate::delete::delete_object;
use crate::error::{ApiError, FieldCause};
use crate::http::{Body, Ctx, ResReq, json_response};
use crate::objects;
use crate::output::present;
use crate::patch;
use crate::rbac;
use crate::resources::ResourceType;
use crate::util::{format_time, get_path, now_rfc3339, set_path};
use crate::{State, SubresourceCall};

pub(crate) fn update_status(
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

pub(crate) fn patch_status(
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

pub(crate) fn put_scale(
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
    if let Some(want) = expect
        && body_rv(&old)? != Some(want)
    {
        return Err(ApiError::conflict(
            &rr.rt.group,
            &rr.rt.plural,
            rr.name.as_deref().unwrap_or_default(),
        ));
    }
    let stored = set_replicas(state, ctx, rr, &old, replicas, body_rv(&old)?)?;
    Ok(json_response(200, &to_scale(&rr.rt, &stored)))
}

pub(crate) fn patch_scale(
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

pub(crate) fn evict(state: &Arc<State>, rr: &ResReq) -> Result<Response<Body>, ApiError> {
    let name = rr.name.clone().unwrap_or_default();
    let old = load(state, rr)?;
    delete_object(state, rr, &name, old, None, false)?;
    Ok(json_response(
        201,
        &json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201 }),
    ))
}

/// Any other named subresource: the call is recorded and answered with what was sent.
pub(crate) fn generic_subresource(
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
        if calls.len() >= crate::MAX_RECORDED {
            calls.remove(0);
        }
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
pub(crate) fn review(
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
            let allowed = rbac::allowed(&state.cfg, &ctx.who, verb, &resource, ns)
                || rbac::bound_cluster_admin(&state.store, &ctx.who);
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
