//! The generator's proto3 JSON mapping on a proto that uses every field kind,
//! maps with each key kind, a real oneof, custom JSON names and every
//! well-known type with a special JSON form: what prost-reflect's JSON
//! encoder writes must validate, and what no encoder writes must not.

mod common;

use std::fs;

use common::{assert_invalid, assert_valid, sample, to_proto_json};
use prost::Message;
use prost_reflect::DescriptorPool;
use serde_json::{Value as Json, json};

const SAMPLE_PROTO: &str = r#"
syntax = "proto3";

package sample.v1;

import "google/protobuf/any.proto";
import "google/protobuf/duration.proto";
import "google/protobuf/empty.proto";
import "google/protobuf/field_mask.proto";
import "google/protobuf/struct.proto";
import "google/protobuf/timestamp.proto";
import "google/protobuf/wrappers.proto";

// Sample service.
service SampleService {
  // Reads.
  rpc Read(Everything) returns (Everything) {
    option idempotency_level = NO_SIDE_EFFECTS;
  }
  rpc Write(Everything) returns (google.protobuf.Empty);
  rpc Follow(Everything) returns (stream Everything);
  rpc Upload(stream Everything) returns (Everything);
}

// Every field kind.
message Everything {
  enum Mood {
    MOOD_UNSPECIFIED = 0;
    // Fine.
    MOOD_GOOD = 1;
  }
  double d = 1;
  float f = 2;
  int32 i32 = 3;
  int64 i64 = 4;
  uint32 u32 = 5;
  uint64 u64 = 6;
  sint32 s32 = 7;
  sint64 s64 = 8;
  fixed32 fx32 = 9;
  fixed64 fx64 = 10;
  sfixed32 sf32 = 11;
  sfixed64 sf64 = 12;
  bool b = 13;
  string s = 14;
  bytes by = 15;
  Mood mood = 16;
  optional string opt = 17;
  repeated double ds = 18;
  repeated Mood moods = 19;
  map<string, int64> counts = 20;
  map<int32, string> names = 21;
  map<bool, Everything> nested = 22;
  map<uint64, bytes> blobs = 23;
  oneof choice {
    string text = 24;
    int64 number = 25;
    Everything child = 26;
  }
  google.protobuf.Timestamp at = 27;
  google.protobuf.Duration took = 28;
  google.protobuf.FieldMask mask = 29;
  google.protobuf.Struct obj = 30;
  google.protobuf.Value any_value = 31;
  google.protobuf.ListValue list = 32;
  google.protobuf.Any packed = 33;
  google.protobuf.Int64Value w_i64 = 34;
  google.protobuf.UInt64Value w_u64 = 35;
  google.protobuf.Int32Value w_i32 = 36;
  google.protobuf.UInt32Value w_u32 = 37;
  google.protobuf.DoubleValue w_d = 38;
  google.protobuf.FloatValue w_f = 39;
  google.protobuf.BoolValue w_b = 40;
  google.protobuf.StringValue w_s = 41;
  google.protobuf.BytesValue w_by = 42;
  optional google.protobuf.NullValue nothing = 43;
  string snake_case_name = 44;
  int32 custom = 45 [json_name = "renamed"];
  repeated google.protobuf.Timestamp times = 46;
}
"#;

fn sample_pool() -> DescriptorPool {
    let dir = tempfile::tempdir().expect("temp dir");
    fs::write(dir.path().join("sample.proto"), SAMPLE_PROTO).expect("write proto");
    let fds = protox::compile(["sample.proto"], [dir.path()]).expect("sample proto compiles");
    DescriptorPool::decode(fds.encode_to_vec().as_slice()).expect("descriptors decode")
}

fn document(pool: &DescriptorPool) -> Json {
    otter_openapi::document(pool, "0.0.0")
        .expect("document builds")
        .to_json()
}

const EVERYTHING: &str = "sample.v1.Everything";

#[test]
fn encoder_output_validates() {
    let pool = sample_pool();
    let doc = document(&pool);
    let desc = pool.get_message_by_name(EVERYTHING).unwrap();
    for depth in [0, 1, 3] {
        let json = to_proto_json(&sample(&desc, depth));
        assert_valid(&doc, EVERYTHING, &json);
    }
    // The full sample has what the mapping is about.
    let json = to_proto_json(&sample(&desc, 1));
    assert_eq!(json["i64"], "-9223372036854775808");
    assert_eq!(json["u64"], "18446744073709551615");
    assert_eq!(json["ds"][1], "NaN");
    assert_eq!(json["mood"], "MOOD_GOOD");
    assert_eq!(json["renamed"], -2147483648);
    assert!(json.get("snakeCaseName").is_some());
    assert!(json["nothing"].is_null() && json.get("nothing").is_some());
    assert_eq!(json["took"], "-1.500s");
    assert_eq!(json["wF"], -0.5);
    assert_eq!(json["f"], -0.25);
    assert!(json["at"].as_str().unwrap().ends_with('Z'));
    assert!(json["child"].is_null() && json["text"].is_string());
}

#[test]
fn schema_follows_the_json_mapping() {
    let pool = sample_pool();
    let doc = document(&pool);
    let schema = &doc["components"]["schemas"][EVERYTHING];
    let props = schema["properties"].as_object().unwrap();
    assert!(props.contains_key("renamed") && !props.contains_key("custom"));
    assert!(props.contains_key("snakeCaseName") && !props.contains_key("snake_case_name"));
    assert_eq!(props["i64"]["type"], "string");
    assert_eq!(props["i32"]["type"], "integer");
    assert_eq!(props["by"]["contentEncoding"], "base64");
    assert_eq!(props["nothing"], json!({"type": "null"}));
    let schemas = &doc["components"]["schemas"];
    assert_eq!(
        props["wB"]["$ref"],
        "#/components/schemas/google.protobuf.BoolValue"
    );
    assert_eq!(
        schemas["google.protobuf.BoolValue"],
        json!({"type": "boolean"})
    );
    assert_eq!(schemas["google.protobuf.Int64Value"]["type"], "string");
    assert_eq!(schemas["google.protobuf.Struct"]["type"], "object");
    assert_eq!(schema["additionalProperties"], false);
    assert!(schema.get("required").is_none(), "no field is required");
    let mood = &doc["components"]["schemas"]["sample.v1.Everything.Mood"];
    assert_eq!(mood["enum"], json!(["MOOD_UNSPECIFIED", "MOOD_GOOD"]));
    assert_eq!(mood["description"], "- `MOOD_GOOD`: Fine.");
    assert_eq!(
        doc["components"]["schemas"]["google.protobuf.Timestamp"]["format"],
        "date-time"
    );
}

#[test]
fn values_no_encoder_writes_are_rejected() {
    let pool = sample_pool();
    let doc = document(&pool);
    for good in [
        json!({}),
        json!({"d": "Infinity", "f": 2.5, "u32": 4294967295u32, "took": "3s"}),
        json!({"wD": "NaN", "wF": "-Infinity", "wBy": "", "wU64": "0"}),
        json!({"names": {"-3": "x"}, "nested": {"false": {}}, "blobs": {"7": ""}}),
        json!({"number": "5"}),
        json!({"packed": {"@type": "x/sample.v1.Everything", "s": "x"}}),
        json!({"obj": {"a": [1, {"b": null}]}, "anyValue": "x", "list": [true]}),
    ] {
        assert_valid(&doc, EVERYTHING, &good);
    }
    for bad in [
        json!({"text": "a", "number": "1"}),
        json!({"text": "a", "child": {}}),
        json!({"custom": 1}),
        json!({"snake_case_name_typo": 1}),
        json!({"i32": 2_147_483_648i64}),
        json!({"u32": -1}),
        json!({"i64": "9223372036854775808000"}),
        json!({"u64": "-1"}),
        json!({"d": "nan"}),
        json!({"by": "*"}),
        json!({"mood": "HAPPY"}),
        json!({"names": {"x": "y"}}),
        json!({"nested": {"yes": {}}}),
        json!({"blobs": {"-1": ""}}),
        json!({"took": "3m"}),
        json!({"obj": [1]}),
        json!({"list": {}}),
        json!({"packed": {"s": "no type"}}),
        json!({"wI64": 5}),
        json!({"nothing": 0}),
    ] {
        assert_invalid(&doc, EVERYTHING, &bad);
    }
}

#[test]
fn operations_cover_unary_methods_only() {
    let pool = sample_pool();
    let doc = document(&pool);
    let paths = doc["paths"].as_object().unwrap();
    let keys: Vec<_> = paths.keys().cloned().collect();
    assert_eq!(
        keys,
        [
            "/sample.v1.SampleService/Read",
            "/sample.v1.SampleService/Write"
        ]
    );
    let read = &paths["/sample.v1.SampleService/Read"];
    assert_eq!(read["post"]["description"], "Reads.");
    assert!(read.get("get").is_some());
    assert_eq!(
        read["get"]["parameters"][2]["content"]["application/json"]["schema"]["$ref"],
        format!("#/components/schemas/{EVERYTHING}")
    );
    assert!(paths["/sample.v1.SampleService/Write"].get("get").is_none());
    let description = doc["info"]["description"].as_str().unwrap();
    assert!(description.contains("`SampleService.Follow`, `SampleService.Upload`"));
    assert_eq!(doc["tags"][0]["description"], "Sample service.");
}
