//! Output shapes chosen by the Accept header: the object at the requested version, a
//! `PartialObjectMetadata`, or the `meta.k8s.io/v1` Table that kubectl prints.

use serde_json::{Map, Value, json};

use crate::http::Ctx;
use crate::resources::ResourceType;
use crate::util::{get_path, str_at};

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
