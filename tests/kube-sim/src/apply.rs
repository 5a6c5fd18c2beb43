//! Server-side apply and `managedFields`: which manager owns which field, conflicts between
//! managers, and the merge of an applied configuration into the live object.
//!
//! Field sets use the `FieldsV1` shapes (`f:name`, `k:{"name":"c"}` for keyed list items,
//! `v:"x"` for set items, `.` for an item owned as a whole). Lists are keyed by the same
//! field-name table as strategic merge patch; other lists are atomic.

use std::collections::BTreeSet;

use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::patch::{list_merge_key, strategic_merge};

/// One step of a field path.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pe {
    /// A map field.
    F(String),
    /// A keyed list item, the key as compact JSON (`{"name":"c"}`).
    K(String),
    /// An item of a set list, the value as JSON.
    V(String),
}

pub type FieldPath = Vec<Pe>;
pub type FieldSet = BTreeSet<FieldPath>;

/// Metadata that identifies or is maintained by the server, never owned by a manager.
const SERVER_META: &[&str] = &[
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "managedFields",
    "selfLink",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
];

/// The set of leaf fields an object (or applied configuration) sets.
pub fn fields_of(obj: &Value) -> FieldSet {
    let mut out = FieldSet::new();
    if let Some(m) = obj.as_object() {
        for (k, v) in m {
            if k == "apiVersion" || k == "kind" {
                continue;
            }
            if k == "metadata" {
                if let Some(meta) = v.as_object() {
                    for (mk, mv) in meta {
                        if SERVER_META.contains(&mk.as_str()) {
                            continue;
                        }
                        walk(
                            &[Pe::F("metadata".into()), Pe::F(mk.clone())],
                            mk,
                            mv,
                            &mut out,
                        );
                    }
                }
                continue;
            }
            walk(&[Pe::F(k.clone())], k, v, &mut out);
        }
    }
    out
}

fn walk(path: &[Pe], field: &str, v: &Value, out: &mut FieldSet) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, child) in m {
                let mut p = path.to_vec();
                p.push(Pe::F(k.clone()));
                walk(&p, k, child, out);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            if let Some(key) =
                list_merge_key(field, items).filter(|k| items.iter().all(|i| i.get(*k).is_some()))
            {
                for item in items {
                    let mut p = path.to_vec();
                    let key_json =
                        json!({ key: item.get(key).cloned().unwrap_or(Value::Null) }).to_string();
                    p.push(Pe::K(key_json));
                    out.insert(p.clone());
                    if let Some(m) = item.as_object() {
                        for (k, child) in m {
                            let mut cp = p.clone();
                            cp.push(Pe::F(k.clone()));
                            walk(&cp, k, child, out);
                        }
                    }
                }
            } else if field == "finalizers" {
                for item in items {
                    let mut p = path.to_vec();
                    p.push(Pe::V(item.to_string()));
                    out.insert(p);
                }
            } else {
                out.insert(path.to_vec());
            }
        }
        _ => {
            out.insert(path.to_vec());
        }
    }
}

/// The value at a field path, if the object has it.
pub fn value_at<'a>(obj: &'a Value, path: &[Pe]) -> Option<&'a Value> {
    let mut cur = obj;
    for pe in path {
        cur = match pe {
            Pe::F(f) => cur.get(f)?,
            Pe::K(k) => {
                let key: Map<String, Value> = serde_json::from_str(k).ok()?;
                cur.as_array()?
                    .iter()
                    .find(|i| key.iter().all(|(kk, kv)| i.get(kk) == Some(kv)))?
            }
            Pe::V(v) => {
                let want: Value = serde_json::from_str(v).ok()?;
                cur.as_array()?.iter().find(|i| **i == want)?
            }
        };
    }
    Some(cur)
}

/// Removes the field at a path (a map entry or a list item).
fn remove_at(obj: &mut Value, path: &[Pe]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut cur = obj;
    for pe in parents {
        let next = match pe {
            Pe::F(f) => cur.get_mut(f),
            Pe::K(k) => {
                let key: Map<String, Value> = match serde_json::from_str(k) {
                    Ok(k) => k,
                    Err(_) => return,
                };
                cur.as_array_mut().and_then(|a| {
                    a.iter_mut()
                        .find(|i| key.iter().all(|(kk, kv)| i.get(kk) == Some(kv)))
                })
            }
            Pe::V(_) => None,
        };
        match next {
            Some(n) => cur = n,
            None => return,
        }
    }
    match last {
        Pe::F(f) => {
            if let Some(m) = cur.as_object_mut() {
                m.remove(f);
            }
        }
        Pe::K(k) => {
            if let (Ok(key), Some(a)) = (
                serde_json::from_str::<Map<String, Value>>(k),
                cur.as_array_mut(),
            ) {
                a.retain(|i| !key.iter().all(|(kk, kv)| i.get(kk) == Some(kv)));
            }
        }
        Pe::V(v) => {
            if let (Ok(want), Some(a)) = (serde_json::from_str::<Value>(v), cur.as_array_mut()) {
                a.retain(|i| *i != want);
            }
        }
    }
}

fn pe_key(pe: &Pe) -> String {
    match pe {
        Pe::F(f) => format!("f:{f}"),
        Pe::K(k) => format!("k:{k}"),
        Pe::V(v) => format!("v:{v}"),
    }
}

/// `FieldsV1` JSON for a field set.
pub fn to_fields_v1(set: &FieldSet) -> Value {
    let mut root = Value::Object(Map::new());
    for path in set {
        // A path that is owned and also has owned children gets the "." marker.
        let has_children = set
            .range(path.clone()..)
            .skip(1)
            .take_while(|o| o.starts_with(path))
            .next()
            .is_some();
        let mut keys: Vec<String> = path.iter().map(pe_key).collect();
        if has_children {
            keys.push(".".into());
        }
        let mut cur = &mut root;
        for k in keys {
            let Some(m) = cur.as_object_mut() else { break };
            cur = m.entry(k).or_insert_with(|| Value::Object(Map::new()));
        }
    }
    root
}

/// The field set of a `FieldsV1` JSON value.
pub fn from_fields_v1(v: &Value) -> FieldSet {
    let mut out = FieldSet::new();
    fn rec(path: &mut Vec<Pe>, v: &Value, out: &mut FieldSet) {
        let Some(m) = v.as_object() else { return };
        if (m.is_empty() || m.contains_key(".")) && !path.is_empty() {
            out.insert(path.clone());
        }
        for (k, child) in m {
            let pe = if let Some(f) = k.strip_prefix("f:") {
                Pe::F(f.into())
            } else if let Some(x) = k.strip_prefix("k:") {
                Pe::K(x.into())
            } else if let Some(x) = k.strip_prefix("v:") {
                Pe::V(x.into())
            } else {
                continue;
            };
            path.push(pe);
            rec(path, child, out);
            path.pop();
        }
    }
    rec(&mut Vec::new(), v, &mut out);
    out
}

/// `.spec.containers[name="c"].image`: how conflicts name a field.
pub fn path_string(path: &[Pe]) -> String {
    let mut s = String::new();
    for pe in path {
        match pe {
            Pe::F(f) => {
                s.push('.');
                s.push_str(f);
            }
            Pe::K(k) => {
                let inner: Map<String, Value> = serde_json::from_str(k).unwrap_or_default();
                let parts: Vec<String> = inner.iter().map(|(a, b)| format!("{a}={b}")).collect();
                s.push_str(&format!("[{}]", parts.join(",")));
            }
            Pe::V(v) => s.push_str(&format!("[={v}]")),
        }
    }
    s
}

/// One `managedFields` entry.
#[derive(Debug, Clone)]
pub struct ManagedEntry {
    pub manager: String,
    pub operation: String,
    pub api_version: String,
    pub time: String,
    pub subresource: Option<String>,
    pub fields: FieldSet,
}

pub fn read_managed(obj: &Value) -> Vec<ManagedEntry> {
    obj.pointer("/metadata/managedFields")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|e| ManagedEntry {
                    manager: e
                        .get("manager")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .into(),
                    operation: e
                        .get("operation")
                        .and_then(Value::as_str)
                        .unwrap_or("Update")
                        .into(),
                    api_version: e
                        .get("apiVersion")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .into(),
                    time: e
                        .get("time")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .into(),
                    subresource: e
                        .get("subresource")
                        .and_then(Value::as_str)
                        .map(String::from),
                    fields: e.get("fieldsV1").map(from_fields_v1).unwrap_or_default(),
                })
                .collect()
        })
        .unwrap_or_default()
}

pub fn write_managed(obj: &mut Value, entries: &[ManagedEntry]) {
    let list: Vec<Value> = entries
        .iter()
        .filter(|e| !e.fields.is_empty())
        .map(|e| {
            let mut v = json!({
                "manager": e.manager,
                "operation": e.operation,
                "apiVersion": e.api_version,
                "time": e.time,
                "fieldsType": "FieldsV1",
                "fieldsV1": to_fields_v1(&e.fields),
            });
            if let Some(s) = &e.subresource {
                v["subresource"] = json!(s);
            }
            v
        })
        .collect();
    if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        if list.is_empty() {
            m.remove("managedFields");
        } else {
            m.insert("managedFields".into(), Value::Array(list));
        }
    }
}

/// Who is writing, for managedFields bookkeeping.
#[derive(Debug, Clone)]
pub struct Writer<'a> {
    pub manager: &'a str,
    pub api_version: &'a str,
    pub subresource: Option<&'a str>,
    pub now: &'a str,
}

/// Records a non-apply write (create, update, patch): the writer takes ownership of every
/// field it changed, other managers lose those fields, and fields that disappeared are
/// dropped from every entry.
pub fn record_update(old: Option<&Value>, new: &mut Value, w: &Writer<'_>) {
    let mut entries = old.map(read_managed).unwrap_or_default();
    let new_fields = fields_of(new);
    let changed: FieldSet = new_fields
        .iter()
        .filter(|p| old.and_then(|o| value_at(o, p)) != value_at(new, p))
        .cloned()
        .collect();
    for e in entries.iter_mut() {
        e.fields
            .retain(|p| new_fields.contains(p) && !changed.contains(p));
    }
    if !changed.is_empty() {
        let sub = w.subresource.map(String::from);
        match entries
            .iter_mut()
            .find(|e| e.manager == w.manager && e.operation == "Update" && e.subresource == sub)
        {
            Some(e) => {
                e.fields.extend(changed);
                e.time = w.now.into();
                e.api_version = w.api_version.into();
            }
            None => entries.push(ManagedEntry {
                manager: w.manager.into(),
                operation: "Update".into(),
                api_version: w.api_version.into(),
                time: w.now.into(),
                subresource: sub,
                fields: changed,
            }),
        }
    }
    write_managed(new, &entries);
}

/// Server-side apply of `applied` onto `live` (an empty object when creating). Returns the
/// merged object with managedFields updated, or a 409 naming each conflicting field.
pub fn apply(
    live: &Value,
    applied: &Value,
    force: bool,
    w: &Writer<'_>,
) -> Result<Value, ApiError> {
    let mut entries = read_managed(live);
    let applied_fields = fields_of(applied);
    let sub = w.subresource.map(String::from);

    let mut conflicts: Vec<(String, String, FieldPath)> = Vec::new();
    for e in entries.iter() {
        if e.manager == w.manager && e.operation == "Apply" {
            continue;
        }
        for p in e.fields.intersection(&applied_fields) {
            if matches!(p.last(), Some(Pe::K(_) | Pe::V(_))) {
                continue;
            }
            if value_at(live, p).is_some() && value_at(live, p) != value_at(applied, p) {
                conflicts.push((e.manager.clone(), e.operation.clone(), p.clone()));
            }
        }
    }
    if !conflicts.is_empty() && !force {
        let causes: Vec<Value> = conflicts
            .iter()
            .map(|(m, _, p)| json!({"reason": "FieldManagerConflict", "message": format!("conflict with \"{m}\""), "field": path_string(p)}))
            .collect();
        let lines: Vec<String> = conflicts
            .iter()
            .map(|(m, op, p)| {
                if op == "Update" {
                    format!(
                        "conflict with \"{m}\" using {}: {}",
                        w.api_version,
                        path_string(p)
                    )
                } else {
                    format!("conflict with \"{m}\": {}", path_string(p))
                }
            })
            .collect();
        let message = if lines.len() == 1 {
            format!("Apply failed with 1 conflict: {}", lines[0])
        } else {
            format!(
                "Apply failed with {} conflicts: {}",
                lines.len(),
                lines.join("\n")
            )
        };
        return Err(
            ApiError::new(409, "Conflict", message).with_details(json!({ "causes": causes }))
        );
    }
    // Forced: the conflicting fields change hands.
    for (m, op, p) in &conflicts {
        if let Some(e) = entries
            .iter_mut()
            .find(|e| &e.manager == m && &e.operation == op)
        {
            e.fields.remove(p);
        }
    }

    let previous: FieldSet = entries
        .iter()
        .find(|e| e.manager == w.manager && e.operation == "Apply" && e.subresource == sub)
        .map(|e| e.fields.clone())
        .unwrap_or_default();

    let mut merged = live.clone();
    let mut body = applied.clone();
    if let Some(m) = body.as_object_mut()
        && let Some(meta) = m.get_mut("metadata").and_then(Value::as_object_mut)
    {
        meta.remove("managedFields");
        meta.remove("resourceVersion");
    }
    strategic_merge(&mut merged, &body)?;

    // Fields this manager applied before, left out now and owned by nobody else, go away.
    let mut removed: Vec<&FieldPath> = previous
        .iter()
        .filter(|p| !applied_fields.contains(*p))
        .filter(|p| {
            !entries.iter().any(|e| {
                !(e.manager == w.manager && e.operation == "Apply") && e.fields.contains(*p)
            })
        })
        .collect();
    removed.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in removed {
        remove_at(&mut merged, p);
    }

    entries.retain(|e| !(e.manager == w.manager && e.operation == "Apply" && e.subresource == sub));
    // Fields that no longer exist leave every entry.
    let now_fields = fields_of(&merged);
    for e in entries.iter_mut() {
        e.fields.retain(|p| now_fields.contains(p));
    }
    entries.push(ManagedEntry {
        manager: w.manager.into(),
        operation: "Apply".into(),
        api_version: w.api_version.into(),
        time: w.now.into(),
        subresource: sub,
        fields: applied_fields,
    });
    write_managed(&mut merged, &entries);
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(m: &str) -> Writer<'_> {
        Writer {
            manager: m,
            api_version: "v1",
            subresource: None,
            now: "2026-01-01T00:00:00Z",
        }
    }

    #[test]
    fn fields_v1_round_trip() {
        let obj = json!({"metadata": {"name": "x", "labels": {"a": "1"}}, "spec": {"containers": [{"name": "c", "image": "i"}], "finalizers": ["f"]}});
        let set = fields_of(&obj);
        let v1 = to_fields_v1(&set);
        assert_eq!(
            v1["f:spec"]["f:containers"]["k:{\"name\":\"c\"}"]["f:image"],
            json!({})
        );
        assert_eq!(
            v1["f:spec"]["f:containers"]["k:{\"name\":\"c\"}"]["."],
            json!({})
        );
        assert!(v1["f:metadata"].get("f:name").is_none());
        assert_eq!(from_fields_v1(&v1), set);
    }

    #[test]
    fn conflicts_force_and_removal() {
        let live = json!({"metadata": {"name": "cm"}});
        let a = apply(
            &live,
            &json!({"metadata": {"name": "cm"}, "data": {"k": "1", "only-a": "x"}}),
            false,
            &w("a"),
        )
        .unwrap();
        let err = apply(
            &a,
            &json!({"metadata": {"name": "cm"}, "data": {"k": "2"}}),
            false,
            &w("b"),
        )
        .unwrap_err();
        assert_eq!(err.code, 409);
        assert_eq!(
            err.details.as_ref().unwrap()["causes"][0]["field"],
            json!(".data.k")
        );
        assert!(
            err.message.contains("conflict with \"a\""),
            "{}",
            err.message
        );
        // Same value: shared ownership, no conflict.
        assert!(
            apply(
                &a,
                &json!({"metadata": {"name": "cm"}, "data": {"k": "1"}}),
                false,
                &w("b")
            )
            .is_ok()
        );
        let b = apply(
            &a,
            &json!({"metadata": {"name": "cm"}, "data": {"k": "2"}}),
            true,
            &w("b"),
        )
        .unwrap();
        assert_eq!(b["data"]["k"], json!("2"));
        // a re-applies without only-a: it is removed, k now belongs to b.
        let a2 = apply(
            &b,
            &json!({"metadata": {"name": "cm"}, "data": {}}),
            false,
            &w("a"),
        )
        .unwrap();
        assert_eq!(a2["data"], json!({"k": "2"}));
    }

    #[test]
    fn updates_take_ownership() {
        let old = apply(
            &json!({}),
            &json!({"metadata": {"name": "cm"}, "data": {"k": "1"}}),
            false,
            &w("a"),
        )
        .unwrap();
        let mut new = old.clone();
        new["data"]["k"] = json!("2");
        record_update(Some(&old), &mut new, &w("kubectl-edit"));
        let entries = read_managed(&new);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].manager, "kubectl-edit");
    }
}
