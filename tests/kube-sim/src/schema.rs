//! Validation of custom resources against their CRD's `openAPIV3Schema`: types, required,
//! enum, pattern, numeric bounds, string lengths, item counts, defaults, and pruning of
//! unknown fields (or reporting them, for `fieldValidation=Strict|Warn`).
//! `x-kubernetes-validations` (CEL) rules are not evaluated.

use serde_json::{Map, Value, json};

use crate::error::FieldCause;

/// What validating one object found.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Field errors (422 Invalid).
    pub causes: Vec<FieldCause>,
    /// Paths of unknown fields that were pruned, e.g. `spec.extra`.
    pub unknown: Vec<String>,
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

fn show(v: &Value) -> String {
    match v {
        Value::String(s) => format!("\"{s}\""),
        other => other.to_string(),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn invalid(out: &mut Outcome, path: &str, v: &Value, detail: String) {
    out.causes.push(FieldCause {
        reason: "FieldValueInvalid",
        message: format!("Invalid value: {}: {detail}", show(v)),
        field: path.into(),
    });
}

/// Validates and prunes `obj` (a whole custom resource) in place.
pub fn validate(schema: &Value, obj: &mut Value) -> Outcome {
    let mut out = Outcome::default();
    let Some(m) = obj.as_object_mut() else {
        return out;
    };
    let props = schema
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let preserve = schema.get("x-kubernetes-preserve-unknown-fields") == Some(&json!(true));
    let keys: Vec<String> = m.keys().cloned().collect();
    for k in keys {
        if matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
            continue;
        }
        match props.get(&k) {
            Some(s) => {
                if let Some(v) = m.get_mut(&k) {
                    if v.is_null() && s.get("nullable") != Some(&json!(true)) {
                        m.remove(&k);
                        continue;
                    }
                    node(s, v, &k, &mut out);
                }
            }
            None if preserve => {}
            None => {
                m.remove(&k);
                out.unknown.push(k);
            }
        }
    }
    apply_defaults_and_required(schema, m, "", &mut out);
    out
}

fn apply_defaults_and_required(
    schema: &Value,
    m: &mut Map<String, Value>,
    path: &str,
    out: &mut Outcome,
) {
    if let Some(props) = schema.get("properties").and_then(Value::as_object) {
        for (k, s) in props {
            if !m.contains_key(k)
                && let Some(d) = s.get("default")
            {
                m.insert(k.clone(), d.clone());
            }
        }
    }
    if let Some(req) = schema.get("required").and_then(Value::as_array) {
        for r in req.iter().filter_map(Value::as_str) {
            if !m.contains_key(r) {
                out.causes.push(FieldCause {
                    reason: "FieldValueRequired",
                    message: "Required value".into(),
                    field: join(path, r),
                });
            }
        }
    }
}

fn node(schema: &Value, v: &mut Value, path: &str, out: &mut Outcome) {
    if schema.get("x-kubernetes-int-or-string") == Some(&json!(true)) {
        if !(v.is_string() || v.is_i64() || v.is_u64()) {
            invalid(
                out,
                path,
                v,
                format!(
                    "{path} in body must be of type int-or-string: \"{}\"",
                    type_name(v)
                ),
            );
        }
        return;
    }
    if let Some(t) = schema.get("type").and_then(Value::as_str) {
        let have = type_name(v);
        let ok = have == t || (t == "number" && have == "integer");
        if !ok {
            out.causes.push(FieldCause {
                reason: "FieldValueTypeInvalid",
                message: format!(
                    "Invalid value: \"{have}\": {path} in body must be of type {t}: \"{have}\""
                ),
                field: path.into(),
            });
            return;
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(v)
    {
        let list: Vec<String> = allowed.iter().map(show).collect();
        out.causes.push(FieldCause {
            reason: "FieldValueNotSupported",
            message: format!(
                "Unsupported value: {}: supported values: {}",
                show(v),
                list.join(", ")
            ),
            field: path.into(),
        });
    }
    if v.is_string() || v.is_number() {
        scalar(schema, v, path, out);
        return;
    }
    match v {
        Value::Array(items) => {
            let n = items.len() as u64;
            if let Some(max) = schema.get("maxItems").and_then(Value::as_u64)
                && n > max
            {
                out.causes.push(FieldCause {
                    reason: "FieldValueTooMany",
                    message: format!("Too many: {n}: must have at most {max} items"),
                    field: path.into(),
                });
            }
            if let Some(min) = schema.get("minItems").and_then(Value::as_u64)
                && n < min
            {
                out.causes.push(FieldCause {
                    reason: "FieldValueInvalid",
                    message: format!(
                        "Invalid value: {n}: {path} in body should have at least {min} items"
                    ),
                    field: path.into(),
                });
            }
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter_mut().enumerate() {
                    node(item_schema, item, &format!("{path}[{i}]"), out);
                }
            }
        }
        Value::Object(m) => {
            let preserve = schema.get("x-kubernetes-preserve-unknown-fields") == Some(&json!(true));
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties");
            if schema.get("x-kubernetes-embedded-resource") == Some(&json!(true)) {
                return;
            }
            let keys: Vec<String> = m.keys().cloned().collect();
            for k in keys {
                let child_path = join(path, &k);
                let sub = props.and_then(|p| p.get(&k)).or(match additional {
                    Some(Value::Object(_)) => additional,
                    _ => None,
                });
                match sub {
                    Some(s) => {
                        if m.get(&k).is_some_and(Value::is_null)
                            && s.get("nullable") != Some(&json!(true))
                        {
                            m.remove(&k);
                            continue;
                        }
                        if let Some(cv) = m.get_mut(&k) {
                            node(s, cv, &child_path, out);
                        }
                    }
                    None if preserve || additional == Some(&json!(true)) => {}
                    None => {
                        m.remove(&k);
                        out.unknown.push(child_path);
                    }
                }
            }
            apply_defaults_and_required(schema, m, path, out);
        }
        _ => {}
    }
}

fn scalar(schema: &Value, v: &Value, path: &str, out: &mut Outcome) {
    match v {
        Value::String(s) => {
            let len = s.chars().count() as u64;
            if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
                && len > max
            {
                out.causes.push(FieldCause {
                    reason: "FieldValueTooLong",
                    message: format!("Too long: may not be more than {max} bytes"),
                    field: path.into(),
                });
            }
            if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
                && len < min
            {
                invalid(
                    out,
                    path,
                    v,
                    format!("{path} in body should be at least {min} chars long"),
                );
            }
            if let Some(p) = schema.get("pattern").and_then(Value::as_str) {
                match regex::Regex::new(p) {
                    Ok(re) if !re.is_match(s) => {
                        invalid(out, path, v, format!("{path} in body should match '{p}'"));
                    }
                    _ => {}
                }
            }
        }
        Value::Number(n) => {
            let x = n.as_f64().unwrap_or(0.0);
            let excl_min = schema.get("exclusiveMinimum") == Some(&json!(true));
            let excl_max = schema.get("exclusiveMaximum") == Some(&json!(true));
            if let Some(min) = schema.get("minimum").and_then(Value::as_f64)
                && (x < min || (excl_min && x == min))
            {
                let rel = if excl_min {
                    "greater than"
                } else {
                    "greater than or equal to"
                };
                invalid(
                    out,
                    path,
                    v,
                    format!("{path} in body should be {rel} {}", num(min)),
                );
            }
            if let Some(max) = schema.get("maximum").and_then(Value::as_f64)
                && (x > max || (excl_max && x == max))
            {
                let rel = if excl_max {
                    "less than"
                } else {
                    "less than or equal to"
                };
                invalid(
                    out,
                    path,
                    v,
                    format!("{path} in body should be {rel} {}", num(max)),
                );
            }
        }
        _ => {}
    }
}

fn num(x: f64) -> String {
    if x.fract() == 0.0 {
        format!("{}", x as i64)
    } else {
        format!("{x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> Value {
        json!({
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "required": ["size"],
                    "properties": {
                        "size": { "type": "integer", "minimum": 1, "maximum": 10 },
                        "mode": { "type": "string", "enum": ["a", "b"], "default": "a" },
                        "name": { "type": "string", "pattern": "^[a-z]+$", "maxLength": 5, "minLength": 2 },
                        "tags": { "type": "array", "maxItems": 2, "items": { "type": "string" } },
                        "free": { "type": "object", "x-kubernetes-preserve-unknown-fields": true }
                    }
                }
            }
        })
    }

    #[test]
    fn accepts_defaults_and_prunes() {
        let mut o = json!({"apiVersion": "x/v1", "kind": "K", "metadata": {"name": "n"}, "spec": {"size": 3, "extra": 1, "free": {"any": {"thing": 1}}}, "top": 1});
        let out = validate(&schema(), &mut o);
        assert!(out.causes.is_empty(), "{:?}", out.causes);
        assert_eq!(
            out.unknown,
            vec!["spec.extra".to_string(), "top".to_string()]
        );
        assert_eq!(o["spec"]["mode"], "a");
        assert_eq!(o["spec"]["free"]["any"]["thing"], 1);
        assert!(o.get("top").is_none());
    }

    #[test]
    fn reports_each_violation() {
        let mut o =
            json!({"spec": {"size": 11, "mode": "x", "name": "ABCDEFG", "tags": ["a", "b", "c"]}});
        let out = validate(&schema(), &mut o);
        let msgs: Vec<String> = out
            .causes
            .iter()
            .map(|c| format!("{}: {}", c.field, c.message))
            .collect();
        assert!(
            msgs.contains(
                &"spec.mode: Unsupported value: \"x\": supported values: \"a\", \"b\"".to_string()
            ),
            "{msgs:?}"
        );
        assert!(msgs.contains(&"spec.size: Invalid value: 11: spec.size in body should be less than or equal to 10".to_string()), "{msgs:?}");
        assert!(
            msgs.iter().any(|m| m.starts_with(
                "spec.name: Invalid value: \"ABCDEFG\": spec.name in body should match"
            )),
            "{msgs:?}"
        );
        assert!(
            msgs.iter().any(|m| m.starts_with("spec.name: Too long")),
            "{msgs:?}"
        );
        assert!(
            msgs.iter().any(|m| m.starts_with("spec.tags: Too many: 3")),
            "{msgs:?}"
        );
        let mut missing = json!({"spec": {"size": "big"}});
        let out = validate(&schema(), &mut missing);
        assert_eq!(out.causes[0].reason, "FieldValueTypeInvalid");
        let mut none = json!({"spec": {}});
        assert_eq!(validate(&schema(), &mut none).causes[0].field, "spec.size");
    }
}
