//! DELETE and deletecollection: options from the query or a `DeleteOptions` body,
//! preconditions, finalizers, pods that terminate gracefully, namespaces and CRDs that take
//! their contents with them.

use std::sync::Arc;
use std::time::Duration;

use http::Response;
use serde_json::{Value, json};

use crate::api::{body_rv, key, list_filtered, load, write_error};
use crate::error::ApiError;
use crate::http::{Body, Ctx, ResReq, json_response};
use crate::objects;
use crate::output::present;
use crate::store::ObjKey;
use crate::util::{format_time, get_path, str_at};
use crate::{State, success_status};

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

pub(crate) fn delete(
    state: &Arc<State>,
    ctx: &Ctx,
    rr: &ResReq,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let opts = delete_opts(ctx, body)?;
    let name = rr.name.clone().unwrap_or_default();
    let old = load(state, rr)?;
    if let Some(uid) = &opts.precondition_uid
        && str_at(&old, "metadata.uid") != Some(uid.as_str())
    {
        return Err(ApiError::new(
            409,
            "Conflict",
            format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                str_at(&old, "metadata.uid").unwrap_or_default()
            ),
        ));
    }
    if let Some(rv) = opts.precondition_rv
        && body_rv(&old)? != Some(rv)
    {
        return Err(ApiError::conflict(&rr.rt.group, &rr.rt.plural, &name));
    }
    let (code, reply) = delete_object(state, rr, &name, old, opts.grace, ctx.dry_run())?;
    Ok(json_response(code, &reply))
}

/// Deletes one object the way its kind is deleted; returns the HTTP code and the reply.
pub(crate) fn delete_object(
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
            new["metadata"]["deletionTimestamp"] = json!(format_time(
                now.checked_add(time::Duration::seconds(grace))
                    .unwrap_or(now)
            ));
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

pub(crate) fn delete_collection(
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
