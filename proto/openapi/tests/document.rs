//! The checked-in `openapi/openapi.yaml`: fresh, complete, readable as YAML,
//! valid OpenAPI 3.1 (checked by openapi-spec-validator from the project's
//! venv), and its schemas accept what a proto3 JSON encoder writes for our
//! messages while rejecting what it never writes.

mod common;

use std::{fs, process::Command};

use common::{assert_invalid, assert_valid, sample, skip_or_fail, to_proto_json, workspace_root};
use prost_reflect::{DescriptorPool, MethodDescriptor};
use serde_json::{Value as Json, json};

fn pool() -> DescriptorPool {
    DescriptorPool::decode(otter_proto::FILE_DESCRIPTOR_SET).expect("descriptor set decodes")
}

fn document() -> Json {
    otter_openapi::document(&pool(), env!("CARGO_PKG_VERSION"))
        .expect("document builds")
        .to_json()
}

fn unary(method: &MethodDescriptor) -> bool {
    !method.is_client_streaming() && !method.is_server_streaming()
}

#[test]
fn checked_in_document_is_fresh() {
    let path = workspace_root().join("openapi/openapi.yaml");
    let committed = fs::read_to_string(&path).unwrap_or_default();
    let fresh = otter_openapi::generate().expect("generate");
    assert!(
        committed == fresh,
        "openapi/openapi.yaml is out of date with the protos or the generator; \
         run `make proto` and commit it"
    );
}

#[test]
fn yaml_reads_back_as_the_document() {
    let yaml = otter_openapi::generate().expect("generate");
    let read: Json = serde_saphyr::from_str(&yaml).expect("the YAML parses");
    assert_eq!(read, document());
}

#[test]
fn every_unary_rpc_is_an_operation_and_streams_are_named() {
    let doc = document();
    let paths = doc["paths"].as_object().expect("paths");
    let description = doc["info"]["description"].as_str().expect("description");
    let mut unary_count = 0;
    for service in pool().services() {
        for method in service.methods() {
            let path = format!("/{}/{}", service.full_name(), method.name());
            if !unary(&method) {
                assert!(!paths.contains_key(&path), "streaming {path} listed");
                assert!(
                    description.contains(&format!("`{}.{}`", service.name(), method.name())),
                    "streaming {path} not named in the description"
                );
                continue;
            }
            unary_count += 1;
            let item = &paths[&path];
            let post = &item["post"];
            assert_eq!(
                post["requestBody"]["content"]["application/json"]["schema"]["$ref"],
                format!("#/components/schemas/{}", method.input().full_name()),
                "{path}"
            );
            assert_eq!(
                post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"],
                format!("#/components/schemas/{}", method.output().full_name()),
                "{path}"
            );
            assert_eq!(
                post["responses"]["default"]["$ref"], "#/components/responses/connect.Error",
                "{path}"
            );
            let no_side_effects = method
                .method_descriptor_proto()
                .options
                .as_ref()
                .is_some_and(|o| o.idempotency_level == Some(1));
            assert_eq!(item.get("get").is_some(), no_side_effects, "{path} GET");
            if no_side_effects {
                let names: Vec<_> = item["get"]["parameters"]
                    .as_array()
                    .expect("GET parameters")
                    .iter()
                    .map(|p| {
                        p.get("$ref")
                            .or(p.get("name"))
                            .and_then(Json::as_str)
                            .expect("parameter")
                            .to_owned()
                    })
                    .collect();
                assert_eq!(
                    names,
                    [
                        "#/components/parameters/connect-query",
                        "#/components/parameters/encoding-query",
                        "message"
                    ]
                );
            }
            // Every RPC of ours names its feature switch.
            let options = method.options();
            let ext = pool()
                .get_extension_by_name("otterscale.api.feature")
                .expect("feature extension");
            let feature = options.get_extension(&ext);
            let feature = feature
                .as_message()
                .and_then(|m| m.get_field_by_name("name"))
                .and_then(|v| v.as_str().map(str::to_owned))
                .expect("feature name");
            assert_eq!(post["x-otterscale-feature"], feature, "{path}");

            let public = otter_openapi::PUBLIC_METHODS
                .contains(&format!("{}.{}", service.full_name(), method.name()).as_str());
            assert_eq!(post.get("security") == Some(&json!([])), public, "{path}");
        }
    }
    assert_eq!(paths.len(), unary_count, "no extra paths");
    assert!(paths.contains_key("/otterscale.link.v1.LinkService/ListLinks"));
    assert!(paths.contains_key("/otterscale.resource.v1.ResourceService/Get"));
    assert_eq!(doc["security"], json!([{"bearer": []}]));
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
}

#[test]
fn descriptions_come_from_the_proto_comments() {
    let doc = document();
    let op = &doc["paths"]["/otterscale.link.v1.LinkService/ListLinks"]["post"];
    assert_eq!(
        op["description"],
        "Every link known to the hub, connected or not."
    );
    let link = &doc["components"]["schemas"]["otterscale.link.v1.Link"];
    assert_eq!(
        link["description"],
        "One member cluster as the hub sees it."
    );
    assert_eq!(
        link["properties"]["certificateSerial"]["description"],
        "Serial number of the agent's current client certificate, hex."
    );
    let state = &doc["components"]["schemas"]["otterscale.link.v1.LinkState"];
    assert!(
        state["description"]
            .as_str()
            .unwrap()
            .contains("- `LINK_STATE_OFFLINE`: Registered, but no tunnel is up."),
        "{state}"
    );
}

#[test]
fn schemas_accept_proto_json_of_every_message() {
    let doc = document();
    let pool = pool();
    let schemas = doc["components"]["schemas"].as_object().expect("schemas");
    let mut checked = 0;
    for name in schemas.keys() {
        let Some(desc) = pool.get_message_by_name(name) else {
            continue;
        };
        for depth in [0, 3] {
            let json = to_proto_json(&sample(&desc, depth));
            assert_valid(&doc, name, &json);
        }
        checked += 1;
    }
    // Every request and response of a unary RPC has a schema that was checked.
    for method in pool
        .services()
        .flat_map(|s| s.methods().collect::<Vec<_>>())
    {
        if unary(&method) {
            assert!(schemas.contains_key(method.input().full_name()));
            assert!(schemas.contains_key(method.output().full_name()));
        }
    }
    assert!(checked >= 30, "only {checked} message schemas checked");
}

#[test]
fn schemas_reject_what_proto_json_never_writes() {
    let doc = document();
    let list = "otterscale.link.v1.ListLinksResponse";
    assert_valid(&doc, list, &json!({}));
    assert_valid(
        &doc,
        list,
        &json!({"links": [{"state": "LINK_STATE_CONNECTED", "lastSeen": "2026-01-01T00:00:00Z",
                "diagnosis": {"rttMicros": "1500", "attempts": [{"ok": false}]}}]}),
    );
    for bad in [
        json!({"links": [{"unknownField": 1}]}),
        json!({"links": [{"state": "CONNECTED"}]}),
        json!({"links": [{"diagnosis": {"rttMicros": 1500}}]}),
        json!({"links": [{"diagnosis": {"rttMicros": "15e2"}}]}),
        json!({"links": [{"lastSeen": 1_700_000_000}]}),
        json!({"links": {}}),
    ] {
        assert_invalid(&doc, list, &bad);
    }
    let register = "otterscale.link.v1.RegisterRequest";
    assert_valid(&doc, register, &json!({"csr": "LS0tLQ=="}));
    assert_invalid(&doc, register, &json!({"csr": "not base64!"}));
    let scale = "otterscale.runtime.v1.ScaleRequest";
    assert_valid(&doc, scale, &json!({"replicas": 3}));
    assert_invalid(&doc, scale, &json!({"replicas": 2_147_483_648i64}));
    assert_invalid(&doc, scale, &json!({"replicas": "3"}));
    let resource = "otterscale.resource.v1.Resource";
    assert_valid(
        &doc,
        resource,
        &json!({"object": {"kind": "Pod", "spec": {"x": [1, null]}}}),
    );
    assert_invalid(&doc, resource, &json!({"object": [1]}));
    let empty = "google.protobuf.Empty";
    assert_valid(&doc, empty, &json!({}));
    assert_invalid(&doc, empty, &json!({"x": 1}));

    let error = "connect.Error";
    assert_valid(
        &doc,
        error,
        &json!({"code": "not_found", "message": "no link edge-1",
                "details": [{"type": "google.rpc.RetryInfo", "value": "CgIIAQ"}]}),
    );
    assert_invalid(&doc, error, &json!({"code": "NOT_FOUND"}));
    assert_invalid(&doc, error, &json!({"message": "no code"}));
}

#[test]
fn openapi_spec_validator_accepts_the_document() {
    let root = workspace_root();
    let validator = root.join(".venv/bin/openapi-spec-validator");
    if !validator.exists() {
        skip_or_fail(
            "no openapi-spec-validator in the venv at .venv",
            "scripts/setup.sh python",
        );
        return;
    }
    // The checked-in file (its freshness is checked above), and a broken copy
    // to show the validator does reject.
    let output = Command::new(&validator)
        .arg(root.join("openapi/openapi.yaml"))
        .output()
        .expect("run openapi-spec-validator");
    assert!(
        output.status.success(),
        "openapi-spec-validator rejects openapi/openapi.yaml:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );

    let broken = otter_openapi::generate().expect("generate").replace(
        "$ref: \"#/components/responses/connect.Error\"",
        "$ref: \"#/components/responses/missing\"",
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let broken_path = dir.path().join("openapi.yaml");
    fs::write(&broken_path, broken).expect("write broken copy");
    let output = Command::new(&validator)
        .arg(&broken_path)
        .output()
        .expect("run openapi-spec-validator");
    assert!(
        !output.status.success(),
        "openapi-spec-validator accepted a document with a dangling $ref"
    );
}
