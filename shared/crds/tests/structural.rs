//! Every generated schema is a structural schema, as the apiserver requires of
//! `apiextensions.k8s.io/v1` CRDs, and its Kubernetes extensions are well formed.

mod common;

use serde_json::Value;

/// Checks one schema node and everything below it; `path` names the node in errors.
fn check(node: &Value, path: &str, errors: &mut Vec<String>) {
    let Some(obj) = node.as_object() else {
        errors.push(format!("{path}: schema is not an object"));
        return;
    };
    let int_or_string = obj.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true));
    let preserve = obj.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    let ty = obj.get("type").and_then(Value::as_str);

    for banned in [
        "$ref",
        "definitions",
        "$defs",
        "$schema",
        "allOf",
        "oneOf",
        "not",
        "nullable",
    ] {
        if obj.contains_key(banned) {
            errors.push(format!("{path}: `{banned}` is not allowed here"));
        }
    }
    if obj.get("uniqueItems") == Some(&Value::Bool(true)) {
        errors.push(format!(
            "{path}: uniqueItems: true is rejected by the apiserver"
        ));
    }
    if int_or_string {
        if ty.is_some() {
            errors.push(format!("{path}: int-or-string must not also set `type`"));
        }
        if let Some(any_of) = obj.get("anyOf") {
            let only_types = any_of.as_array().is_some_and(|alts| {
                alts.iter().all(|alt| {
                    alt.as_object()
                        .is_some_and(|a| a.keys().all(|k| k == "type"))
                })
            });
            if !only_types {
                errors.push(format!(
                    "{path}: anyOf of an int-or-string may only list types"
                ));
            }
        }
    } else {
        if obj.contains_key("anyOf") {
            errors.push(format!("{path}: anyOf is only allowed for int-or-string"));
        }
        match ty {
            Some("object" | "array" | "string" | "integer" | "number" | "boolean") => {}
            Some(other) => errors.push(format!("{path}: unknown type `{other}`")),
            None if preserve => {}
            None => errors.push(format!("{path}: every node needs a `type`")),
        }
    }
    if obj.contains_key("properties") && obj.contains_key("additionalProperties") {
        errors.push(format!(
            "{path}: properties and additionalProperties are exclusive"
        ));
    }
    if obj.get("additionalProperties") == Some(&Value::Bool(false)) {
        errors.push(format!(
            "{path}: additionalProperties: false is not allowed"
        ));
    }
    if ty != Some("object")
        && (obj.contains_key("properties") || obj.contains_key("additionalProperties"))
    {
        errors.push(format!(
            "{path}: properties on a node that is not an object"
        ));
    }
    if ty == Some("array") && !obj.get("items").is_some_and(Value::is_object) {
        errors.push(format!("{path}: an array needs a single `items` schema"));
    }
    if let Some(required) = obj.get("required") {
        let props = obj.get("properties").and_then(Value::as_object);
        for name in required.as_array().into_iter().flatten() {
            let name = name.as_str().unwrap_or_default();
            if !props.is_some_and(|p| p.contains_key(name)) {
                errors.push(format!("{path}: required `{name}` is not a property"));
            }
        }
    }
    check_list_type(obj, path, errors);
    if let Some(rules) = obj.get("x-kubernetes-validations") {
        for rule in rules.as_array().into_iter().flatten() {
            if rule["rule"].as_str().is_none_or(str::is_empty) {
                errors.push(format!("{path}: a validation without a rule"));
            }
        }
    }
    if let (Some(default), Some(ty)) = (obj.get("default"), ty) {
        let fits = match ty {
            "string" => default.is_string(),
            "integer" => default.is_i64() || default.is_u64(),
            "number" => default.is_number(),
            "boolean" => default.is_boolean(),
            "object" => default.is_object(),
            "array" => default.is_array(),
            _ => false,
        };
        if !fits {
            errors.push(format!("{path}: default {default} is not a {ty}"));
        }
        if let Some(values) = obj.get("enum").and_then(Value::as_array)
            && !values.contains(default)
        {
            errors.push(format!(
                "{path}: default {default} is not one of the enum values"
            ));
        }
    }

    if let Some(props) = obj.get("properties").and_then(Value::as_object) {
        for (name, child) in props {
            check(child, &format!("{path}.{name}"), errors);
        }
    }
    if let Some(items) = obj.get("items") {
        check(items, &format!("{path}[]"), errors);
    }
    if let Some(extra) = obj.get("additionalProperties").filter(|v| v.is_object()) {
        check(extra, &format!("{path}{{}}"), errors);
    }
}

fn check_list_type(obj: &serde_json::Map<String, Value>, path: &str, errors: &mut Vec<String>) {
    let Some(list_type) = obj.get("x-kubernetes-list-type").and_then(Value::as_str) else {
        if obj.contains_key("x-kubernetes-list-map-keys") {
            errors.push(format!("{path}: list-map-keys without list-type map"));
        }
        return;
    };
    let items = &obj.get("items").cloned().unwrap_or(Value::Null);
    match list_type {
        "atomic" => {}
        "set" => {
            if !matches!(
                items["type"].as_str(),
                Some("string" | "integer" | "number" | "boolean")
            ) {
                errors.push(format!("{path}: a set must hold scalars"));
            }
        }
        "map" => {
            if items["type"] != "object" {
                errors.push(format!("{path}: a list-map must hold objects"));
            }
            let keys = obj
                .get("x-kubernetes-list-map-keys")
                .and_then(Value::as_array);
            if keys.is_none_or(Vec::is_empty) {
                errors.push(format!("{path}: a list-map needs list-map-keys"));
            }
            for key in keys.into_iter().flatten() {
                let key = key.as_str().unwrap_or_default();
                let required = items["required"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|k| k == key));
                let defaulted = items["properties"][key].get("default").is_some();
                if items["properties"].get(key).is_none() {
                    errors.push(format!(
                        "{path}: list-map key `{key}` is not an item property"
                    ));
                } else if !required && !defaulted {
                    errors.push(format!(
                        "{path}: list-map key `{key}` must be required or defaulted"
                    ));
                }
            }
        }
        other => errors.push(format!("{path}: unknown list-type `{other}`")),
    }
}

#[test]
fn every_schema_is_structural() {
    let mut errors = Vec::new();
    for crd in common::crds() {
        let kind = crd["spec"]["names"]["kind"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let root = common::schema(&crd);
        check(root, &kind, &mut errors);
        if root["type"] != "object" {
            errors.push(format!("{kind}: the root must be an object"));
        }
        let metadata = &root["properties"]["metadata"];
        if metadata
            .as_object()
            .is_none_or(|m| m.keys().any(|k| k != "type"))
        {
            errors.push(format!("{kind}: metadata may only be `type: object`"));
        }
    }
    assert!(errors.is_empty(), "schema problems:\n{}", errors.join("\n"));
}

#[test]
fn the_checker_catches_broken_schemas() {
    let cases = [
        (
            serde_json::json!({"type": "object", "properties": {"a": {}}}),
            "needs a `type`",
        ),
        (
            serde_json::json!({"type": "object", "properties": {"a": {"type": "string"}},
                               "additionalProperties": {"type": "string"}}),
            "exclusive",
        ),
        (
            serde_json::json!({"type": "string", "nullable": true}),
            "`nullable`",
        ),
        (
            serde_json::json!({"type": "array", "items": {"type": "object"}, "x-kubernetes-list-type": "map"}),
            "list-map-keys",
        ),
        (
            serde_json::json!({"type": "string", "enum": ["a"], "default": "b"}),
            "enum values",
        ),
    ];
    for (schema, expected) in cases {
        let mut errors = Vec::new();
        check(&schema, "t", &mut errors);
        assert!(
            errors.iter().any(|e| e.contains(expected)),
            "{schema} should fail with `{expected}`, got {errors:?}"
        );
    }
}

#[test]
fn printer_columns_point_at_schema_fields() {
    for crd in common::crds() {
        let root = common::schema(&crd);
        for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let json_path = column["jsonPath"].as_str().unwrap_or_default();
            if json_path == ".metadata.creationTimestamp" {
                continue;
            }
            // `conditions[?(@.type=="Ready")]` selects an item of the conditions list.
            let mut plain = json_path.to_owned();
            while let Some(start) = plain.find("[?(") {
                let end = plain[start..]
                    .find(")]")
                    .map_or(plain.len(), |e| start + e + 2);
                plain.replace_range(start..end, "[]");
            }
            let mut node = root;
            for segment in plain.trim_start_matches('.').split('.') {
                match segment.strip_suffix("[]") {
                    Some(name) => node = &node["properties"][name]["items"],
                    None => node = &node["properties"][segment],
                }
            }
            assert!(
                node.get("type").is_some(),
                "{}: column {} points at {json_path}, which is not in the schema",
                crd["metadata"]["name"],
                column["name"]
            );
        }
    }
}
