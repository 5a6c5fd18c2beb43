//! Shared by the OpenAPI tests: sample messages in the proto3 JSON mapping
//! (as prost-reflect's serializer writes it) and schema validation against
//! the document's components.

#![allow(dead_code)]

use std::{collections::HashMap, path::Path};

use prost_reflect::{
    DynamicMessage, EnumDescriptor, Kind, MapKey, MessageDescriptor, SerializeOptions, Value,
};
use serde_json::{Value as Json, json};

pub fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .and_then(Path::parent)
        .expect("workspace root")
}

pub fn skip_or_fail(why: &str, setup: &str) {
    if std::env::var("OTTER_REQUIRE_TOOLS").is_ok_and(|v| v == "1") {
        panic!("{why}");
    }
    eprintln!("skipped: {why} (run `{setup}`)");
}

/// A validator for `#/components/schemas/<name>` of `document`.
pub fn validator(document: &Json, name: &str) -> jsonschema::Validator {
    let root = json!({
        "$ref": format!("#/components/schemas/{name}"),
        "components": { "schemas": document["components"]["schemas"] },
    });
    jsonschema::draft202012::new(&root).unwrap_or_else(|e| panic!("schema {name} compiles: {e}"))
}

/// Asserts that `instance` is valid against schema `name`, listing why not.
pub fn assert_valid(document: &Json, name: &str, instance: &Json) {
    let v = validator(document, name);
    let errors: Vec<String> = v
        .iter_errors(instance)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{name} rejects {instance}:\n{}",
        errors.join("\n")
    );
}

pub fn assert_invalid(document: &Json, name: &str, instance: &Json) {
    assert!(
        !validator(document, name).is_valid(instance),
        "{name} accepts {instance}, which it must not"
    );
}

/// The proto3 JSON of `msg`, written by prost-reflect (lowerCamelCase names,
/// 64-bit integers as strings, enums by name, well-known types mapped).
pub fn to_proto_json(msg: &DynamicMessage) -> Json {
    msg.serialize_with_options(serde_json::value::Serializer, &SerializeOptions::new())
        .expect("message serialises to JSON")
}

/// JSON samples for the well-known types with a special JSON form, read in
/// through prost-reflect so the value is what a real message would hold.
fn well_known_sample(name: &str) -> Option<Json> {
    Some(match name {
        "google.protobuf.Timestamp" => json!("2026-01-02T03:04:05.123456789Z"),
        "google.protobuf.Duration" => json!("-1.500s"),
        "google.protobuf.FieldMask" => json!("metadata.name,spec.replicas"),
        "google.protobuf.Struct" => json!({
            "apiVersion": "v1", "replicas": 3, "ready": true, "gone": null,
            "ports": [80, "https", {"name": "x"}], "metadata": {"labels": {}},
        }),
        "google.protobuf.Value" => json!([1.5, {"a": null}, "s"]),
        "google.protobuf.ListValue" => json!([1, "x", null, [], {}]),
        "google.protobuf.Any" => json!({
            "@type": "type.example.com/google.protobuf.Duration", "value": "1s",
        }),
        // Finite: prost-reflect writes a non-finite wrapper as `null`, not as
        // "NaN" (plain double fields are written right; see `sample`).
        "google.protobuf.DoubleValue" => json!(2.5),
        "google.protobuf.FloatValue" => json!(-0.5),
        "google.protobuf.Int64Value" => json!("-9223372036854775808"),
        "google.protobuf.UInt64Value" => json!("18446744073709551615"),
        "google.protobuf.Int32Value" => json!(-2147483648),
        "google.protobuf.UInt32Value" => json!(4294967295u32),
        "google.protobuf.BoolValue" => json!(true),
        "google.protobuf.StringValue" => json!("wrapped"),
        "google.protobuf.BytesValue" => json!("AAH+/w=="),
        _ => return None,
    })
}

/// A message with every field set (every member of a list twice, one map
/// entry, the first member of each real oneof), nested messages down to
/// `depth` levels.
pub fn sample(desc: &MessageDescriptor, depth: usize) -> DynamicMessage {
    if let Some(json) = well_known_sample(desc.full_name()) {
        return DynamicMessage::deserialize(desc.clone(), json)
            .unwrap_or_else(|e| panic!("sample {}: {e}", desc.full_name()));
    }
    let mut msg = DynamicMessage::new(desc.clone());
    for field in desc.fields() {
        if let Some(oneof) = field.containing_oneof()
            && !oneof.is_synthetic()
            && oneof.fields().next().is_some_and(|first| first != field)
        {
            continue;
        }
        let value = if field.is_map() {
            let Kind::Message(entry) = field.kind() else {
                unreachable!("map fields have entry messages")
            };
            let key = map_key(&entry.map_entry_key_field().kind());
            single(&entry.map_entry_value_field().kind(), depth)
                .map(|v| Value::Map(HashMap::from([(key, v)])))
        } else if field.is_list() {
            single(&field.kind(), depth).map(|v| {
                let second = match &v {
                    Value::F64(_) => Value::F64(f64::NAN),
                    Value::F32(_) => Value::F32(f32::INFINITY),
                    other => other.clone(),
                };
                Value::List(vec![v, second])
            })
        } else {
            single(&field.kind(), depth)
        };
        if let Some(value) = value {
            msg.set_field(&field, value);
        }
    }
    msg
}

fn map_key(kind: &Kind) -> MapKey {
    match kind {
        Kind::String => MapKey::String("key".into()),
        Kind::Bool => MapKey::Bool(true),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => MapKey::I32(-5),
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => MapKey::I64(-5),
        Kind::Uint32 | Kind::Fixed32 => MapKey::U32(5),
        Kind::Uint64 | Kind::Fixed64 => MapKey::U64(5),
        other => panic!("{other:?} cannot be a map key"),
    }
}

fn last_enum_value(e: &EnumDescriptor) -> Value {
    Value::EnumNumber(e.values().last().expect("enums have values").number())
}

fn single(kind: &Kind, depth: usize) -> Option<Value> {
    Some(match kind {
        Kind::Double => Value::F64(1.5),
        Kind::Float => Value::F32(-0.25),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Value::I32(i32::MIN),
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Value::I64(i64::MIN),
        Kind::Uint32 | Kind::Fixed32 => Value::U32(u32::MAX),
        Kind::Uint64 | Kind::Fixed64 => Value::U64(u64::MAX),
        Kind::Bool => Value::Bool(true),
        Kind::String => Value::String("sample \u{2713}".into()),
        Kind::Bytes => Value::Bytes(b"\x00\xfe\xffotter".to_vec().into()),
        Kind::Enum(e) => last_enum_value(e),
        Kind::Message(m) => {
            if depth == 0 {
                return None;
            }
            Value::Message(sample(m, depth - 1))
        }
    })
}
