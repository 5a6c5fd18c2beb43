//! Output shapes chosen by the Accept header: the object at the requested version, a
//! `PartialObjectMetadata`, or the `meta.k8s.io/v1` Table that kubectl prints.

use serde_json::{Map, Value, json};

use crate::http::Ctx;
use crate::resources::{Column, ResourceType};
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
        ("Node", ".status.ready") => {
            let ready = get_path(obj, "status.conditions")
                .and_then(Value::as_array)
                .is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                });
            json!(if ready { "Ready" } else { "NotReady" })
        }
        (_, ".metadata.creationTimestamp") => json!(age(obj)),
        (_, p) if p.ends_with("#names") || p.ends_with("#images") => {
            let (base, what) = p.split_once('#').unwrap_or((p, ""));
            let field = if what == "names" { "name" } else { "image" };
            let items = get_path(obj, base)
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            json!(
                items
                    .iter()
                    .filter_map(|c| c.get(field).and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join(",")
            )
        }
        (_, p) if p.ends_with("#ports") => {
            let ports = get_path(obj, p.trim_end_matches("#ports"))
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let text: Vec<String> = ports
                .iter()
                .map(|p| {
                    format!(
                        "{}/{}",
                        p.get("port").map(|v| v.to_string()).unwrap_or_default(),
                        p.get("protocol").and_then(Value::as_str).unwrap_or("TCP")
                    )
                })
                .collect();
            json!(if text.is_empty() {
                "<none>".to_string()
            } else {
                text.join(",")
            })
        }
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

/// A `meta.k8s.io/v1` Table of the objects (what kubectl prints): NAME, the kind's columns,
/// AGE (built-ins, and custom resources without columns of their own), then the `-o wide`
/// columns.
pub(crate) fn table(rt: &ResourceType, objs: &[Value], meta: Value) -> Value {
    let with_age = rt.builtin || rt.columns.is_empty();
    let mut order: Vec<Option<&Column>> = rt
        .columns
        .iter()
        .filter(|c| c.priority == 0)
        .map(Some)
        .collect();
    if with_age {
        order.push(None);
    }
    order.extend(rt.columns.iter().filter(|c| c.priority > 0).map(Some));
    let mut cols = vec![
        json!({"name": "Name", "type": "string", "format": "name", "description": "Name must be unique within a namespace.", "priority": 0}),
    ];
    for c in &order {
        cols.push(match c {
            Some(c) => json!({"name": c.name, "type": "string", "format": "", "description": c.name, "priority": c.priority}),
            None => json!({"name": "Age", "type": "string", "format": "", "description": "CreationTimestamp is a timestamp representing the server time when this object was created.", "priority": 0}),
        });
    }
    let rows: Vec<Value> = objs
        .iter()
        .map(|o| {
            let mut cells = vec![json!(str_at(o, "metadata.name").unwrap_or_default())];
            for c in &order {
                cells.push(match c {
                    Some(c) => cell(rt, o, &c.path),
                    None => json!(age(o)),
                });
            }
            json!({ "cells": cells, "object": partial_metadata(o) })
        })
        .collect();
    json!({ "kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta, "columnDefinitions": cols, "rows": rows })
}
