//! `google.protobuf.Struct` ↔ JSON: objects travel as `Struct`, and every
//! crate (the agent turning the apiserver's JSON into replies, the CLI
//! printing them, the bench) converts through here.
//!
//! `Struct` numbers are doubles. Whole numbers within ±2^53 (where a
//! double is exact) come back as JSON integers, because Kubernetes fields
//! are int32 and int64 and kubectl users expect `replicas: 3`, not `3.0`.

use prost_types::{ListValue, Struct, Value, value::Kind};
use serde_json::{Map, Value as Json};

/// Largest magnitude a double holds exactly as an integer.
const EXACT_INTEGER: f64 = 9_007_199_254_740_992.0;

/// A JSON object as a `Struct` (anything else: an empty one).
pub fn to_struct(json: Json) -> Struct {
    match json {
        Json::Object(m) => map_to_struct(m),
        _ => Struct::default(),
    }
}

fn map_to_struct(m: Map<String, Json>) -> Struct {
    Struct {
        fields: m.into_iter().map(|(k, v)| (k, to_value(v))).collect(),
    }
}

fn to_value(json: Json) -> Value {
    let kind = match json {
        Json::Null => Kind::NullValue(0),
        Json::Bool(b) => Kind::BoolValue(b),
        Json::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Json::String(s) => Kind::StringValue(s),
        Json::Array(a) => Kind::ListValue(ListValue {
            values: a.into_iter().map(to_value).collect(),
        }),
        Json::Object(m) => Kind::StructValue(map_to_struct(m)),
    };
    Value { kind: Some(kind) }
}

/// A `Struct` as a JSON object.
pub fn from_struct(s: Struct) -> Json {
    Json::Object(
        s.fields
            .into_iter()
            .map(|(k, v)| (k, from_value(v)))
            .collect(),
    )
}

/// [`from_struct`] of a borrowed `Struct`.
pub fn struct_to_json(s: &Struct) -> Json {
    from_struct(s.clone())
}

fn from_value(v: Value) -> Json {
    match v.kind {
        None | Some(Kind::NullValue(_)) => Json::Null,
        Some(Kind::BoolValue(b)) => Json::Bool(b),
        Some(Kind::NumberValue(n)) => {
            if n.fract() == 0.0 && n.abs() <= EXACT_INTEGER {
                Json::from(n as i64)
            } else {
                serde_json::Number::from_f64(n).map_or(Json::Null, Json::Number)
            }
        }
        Some(Kind::StringValue(s)) => Json::String(s),
        Some(Kind::ListValue(l)) => Json::Array(l.values.into_iter().map(from_value).collect()),
        Some(Kind::StructValue(s)) => from_struct(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_keeps_integers_integral() {
        let json = serde_json::json!({
            "replicas": 3, "ratio": 0.5, "big": 9_007_199_254_740_992_i64,
            "name": "web", "ready": true, "gone": null,
            "ports": [80, "https"], "spec": {"nested": {"x": -1}}
        });
        assert_eq!(from_struct(to_struct(json.clone())), json);
        assert_eq!(struct_to_json(&to_struct(json.clone())), json);
        // Beyond 2^53 a double is no longer exact: it stays a float.
        let s = to_struct(serde_json::json!({"n": 1e300}));
        assert!(from_struct(s)["n"].is_f64());
        assert_eq!(to_struct(serde_json::json!([1])), Struct::default());
    }
}
