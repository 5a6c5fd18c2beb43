//! PATCH bodies: JSON patch (RFC 6902), JSON merge patch (RFC 7386) and the strategic
//! merge patch of built-in kinds (lists merged by key, `$patch` directives).
//! Server-side apply lives in `apply.rs`.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// Applies a JSON merge patch in place.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = Value::Object(Map::new());
            }
            if let Some(t) = target.as_object_mut() {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn decode_pointer(path: &str) -> Result<Vec<String>, ApiError> {
    if path.is_empty() {
        return Ok(Vec::new());
    }
    let rest = path.strip_prefix('/').ok_or_else(|| {
        ApiError::bad_request(format!("json patch path {path:?} must start with '/'"))
    })?;
    Ok(rest
        .split('/')
        .map(|p| p.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn parent_mut<'a>(doc: &'a mut Value, parts: &[String]) -> Result<&'a mut Value, ApiError> {
    let mut cur = doc;
    for p in parts {
        cur = match cur {
            Value::Object(m) => m.get_mut(p),
            Value::Array(a) => p.parse::<usize>().ok().and_then(move |i| a.get_mut(i)),
            _ => None,
        }
        .ok_or_else(|| ApiError::new(422, "Invalid", format!("the server rejected our request due to an error in our request: doc is missing path: /{}", parts.join("/"))))?;
    }
    Ok(cur)
}

fn missing(path: &str) -> ApiError {
    ApiError::new(
        422,
        "Invalid",
        format!(
            "the server rejected our request due to an error in our request: doc is missing path: \"{path}\": missing value"
        ),
    )
}

fn remove_at(doc: &mut Value, path: &str) -> Result<Value, ApiError> {
    let parts = decode_pointer(path)?;
    let (last, parents) = parts.split_last().ok_or_else(|| missing(path))?;
    match parent_mut(doc, parents)? {
        Value::Object(m) => m.remove(last).ok_or_else(|| missing(path)),
        Value::Array(a) => {
            let i: usize = last.parse().map_err(|_| missing(path))?;
            if i < a.len() {
                Ok(a.remove(i))
            } else {
                Err(missing(path))
            }
        }
        _ => Err(missing(path)),
    }
}

fn add_at(doc: &mut Value, path: &str, value: Value, replace: bool) -> Result<(), ApiError> {
    let parts = decode_pointer(path)?;
    let Some((last, parents)) = parts.split_last() else {
        *doc = value;
        return Ok(());
    };
    match parent_mut(doc, parents)? {
        Value::Object(m) => {
            if replace && !m.contains_key(last) {
                return Err(missing(path));
            }
            m.insert(last.clone(), value);
            Ok(())
        }
        Value::Array(a) => {
            if last == "-" && !replace {
                a.push(value);
                return Ok(());
            }
            let i: usize = last.parse().map_err(|_| missing(path))?;
            if replace {
                let slot = a.get_mut(i).ok_or_else(|| missing(path))?;
                *slot = value;
            } else if i <= a.len() {
                a.insert(i, value);
            } else {
                return Err(missing(path));
            }
            Ok(())
        }
        _ => Err(missing(path)),
    }
}

fn get_at<'a>(doc: &'a Value, path: &str) -> Result<&'a Value, ApiError> {
    let ptr = path.to_string();
    doc.pointer(&ptr).ok_or_else(|| missing(path))
}

/// Applies an RFC 6902 JSON patch; the document is unchanged on error.
pub fn json_patch(doc: &mut Value, patch: &Value) -> Result<(), ApiError> {
    let ops = patch
        .as_array()
        .ok_or_else(|| ApiError::bad_request("json patch must be a JSON array of operations"))?;
    let mut work = doc.clone();
    for op in ops {
        let name = op.get("op").and_then(Value::as_str).unwrap_or_default();
        let path = op
            .get("path")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad_request("json patch operation without a path"))?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| ApiError::bad_request(format!("json patch {name} without a value")))
        };
        let from = || {
            op.get("from")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad_request(format!("json patch {name} without from")))
        };
        match name {
            "add" => add_at(&mut work, path, value()?, false)?,
            "replace" => add_at(&mut work, path, value()?, true)?,
            "remove" => {
                remove_at(&mut work, path)?;
            }
            "move" => {
                let v = remove_at(&mut work, from()?)?;
                add_at(&mut work, path, v, false)?;
            }
            "copy" => {
                let v = get_at(&work, from()?)?.clone();
                add_at(&mut work, path, v, false)?;
            }
            "test" => {
                if *get_at(&work, path)? != value()? {
                    return Err(ApiError::new(
                        422,
                        "Invalid",
                        format!(
                            "the server rejected our request due to an error in our request: testing value {path} failed"
                        ),
                    ));
                }
            }
            other => {
                return Err(ApiError::bad_request(format!(
                    "unexpected json patch operation {other:?}"
                )));
            }
        }
    }
    *doc = work;
    Ok(())
}

/// The merge key of a built-in list field, chosen by field name (and, for `ports`, by what
/// the items hold: container ports vs service ports). `None`: the list is atomic.
pub fn list_merge_key(field: &str, items: &[Value]) -> Option<&'static str> {
    Some(match field {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "env"
        | "imagePullSecrets" => "name",
        "volumeMounts" => "mountPath",
        "volumeDevices" => "devicePath",
        "conditions" => "type",
        "hostAliases" => "ip",
        "ownerReferences" => "uid",
        "topologySpreadConstraints" => "topologyKey",
        "ports" => {
            if items.iter().any(|i| i.get("containerPort").is_some()) {
                "containerPort"
            } else {
                "port"
            }
        }
        _ => return None,
    })
}

/// Lists of scalars that merge as sets instead of being replaced.
fn is_set_list(field: &str) -> bool {
    field == "finalizers"
}

/// Applies a strategic merge patch of a built-in kind in place.
pub fn strategic_merge(target: &mut Value, patch: &Value) -> Result<(), ApiError> {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return Ok(());
    };
    if p.get("$patch").and_then(Value::as_str) == Some("replace") {
        let mut clean = p.clone();
        clean.remove("$patch");
        *target = Value::Object(clean);
        return Ok(());
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Some(t) = target.as_object_mut() else {
        return Ok(());
    };
    for (k, v) in p {
        if k == "$patch" || k == "$retainKeys" || k.starts_with("$setElementOrder/") {
            continue;
        }
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(have)), Some(del)) = (t.get_mut(field), v.as_array()) {
                have.retain(|x| !del.contains(x));
            }
            continue;
        }
        if v.is_null() {
            t.remove(k);
            continue;
        }
        match v {
            Value::Array(items) => {
                let existing = t
                    .get(k)
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                let merged = if let Some(key) = list_merge_key(k, items) {
                    merge_keyed_list(existing, items, key)?
                } else if is_set_list(k) {
                    let mut out = existing;
                    for i in items {
                        if !out.contains(i) {
                            out.push(i.clone());
                        }
                    }
                    out
                } else {
                    items.clone()
                };
                t.insert(k.clone(), Value::Array(merged));
            }
            Value::Object(_) => {
                let slot = t.entry(k.clone()).or_insert(Value::Null);
                strategic_merge(slot, v)?;
            }
            other => {
                t.insert(k.clone(), other.clone());
            }
        }
    }
    Ok(())
}

fn merge_keyed_list(
    mut existing: Vec<Value>,
    items: &[Value],
    key: &str,
) -> Result<Vec<Value>, ApiError> {
    for item in items {
        let Some(kv) = item.get(key) else {
            return Err(ApiError::bad_request(format!(
                "map: {item} does not contain declared merge key: {key}"
            )));
        };
        let pos = existing.iter().position(|e| e.get(key) == Some(kv));
        let directive = item.get("$patch").and_then(Value::as_str);
        match (pos, directive) {
            (Some(i), Some("delete")) => {
                existing.remove(i);
            }
            (None, Some("delete")) => {}
            (Some(i), Some("replace")) => {
                let mut clean = item.clone();
                if let Some(m) = clean.as_object_mut() {
                    m.remove("$patch");
                }
                existing[i] = clean;
            }
            (Some(i), _) => strategic_merge(&mut existing[i], item)?,
            (None, _) => {
                let mut fresh = Value::Object(Map::new());
                strategic_merge(&mut fresh, item)?;
                existing.push(fresh);
            }
        }
    }
    Ok(existing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_rfc7386() {
        let mut d = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        merge_patch(&mut d, &json!({"a": "z", "c": {"f": null}}));
        assert_eq!(d, json!({"a": "z", "c": {"d": "e"}}));
    }

    #[test]
    fn json_patch_ops() {
        let mut d = json!({"metadata": {"labels": {"a": "1"}}, "list": [1, 2]});
        let p = json!([
            {"op": "add", "path": "/metadata/labels/b~1c", "value": "2"},
            {"op": "replace", "path": "/metadata/labels/a", "value": "9"},
            {"op": "add", "path": "/list/-", "value": 3},
            {"op": "remove", "path": "/list/0"},
            {"op": "test", "path": "/list/0", "value": 2},
            {"op": "copy", "from": "/list", "path": "/copy"},
            {"op": "move", "from": "/copy", "path": "/moved"}
        ]);
        json_patch(&mut d, &p).unwrap();
        assert_eq!(
            d,
            json!({"metadata": {"labels": {"a": "9", "b/c": "2"}}, "list": [2, 3], "moved": [2, 3]})
        );
        let before = d.clone();
        assert!(
            json_patch(
                &mut d,
                &json!([{"op": "replace", "path": "/nope", "value": 1}])
            )
            .is_err()
        );
        assert!(
            json_patch(
                &mut d,
                &json!([{"op": "test", "path": "/list/0", "value": 7}])
            )
            .is_err()
        );
        assert_eq!(d, before);
    }

    #[test]
    fn strategic_merges_containers_by_name() {
        let mut d = json!({"spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}], "finalizers": ["f1"]}});
        let p = json!({"spec": {"containers": [{"name": "b", "image": "z"}, {"name": "c", "image": "w"}, {"name": "a", "$patch": "delete"}], "finalizers": ["f2"]}});
        strategic_merge(&mut d, &p).unwrap();
        assert_eq!(
            d["spec"]["containers"],
            json!([{"name": "b", "image": "z"}, {"name": "c", "image": "w"}])
        );
        assert_eq!(d["spec"]["finalizers"], json!(["f1", "f2"]));
        let mut m = json!({"metadata": {"annotations": {"x": "1"}}});
        strategic_merge(
            &mut m,
            &json!({"metadata": {"annotations": {"$patch": "replace", "y": "2"}}}),
        )
        .unwrap();
        assert_eq!(m, json!({"metadata": {"annotations": {"y": "2"}}}));
    }
}
