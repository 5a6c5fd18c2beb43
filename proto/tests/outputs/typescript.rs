//! The TypeScript package in `ts/`: its generated sources are what
//! protoc-gen-es makes of our protos today, it builds with `npm run build`,
//! and the built package talks the same wire format as the Rust code.
//!
//! Needs `ts/node_modules` (`scripts/setup.sh npm`). Without it the test
//! prints why and passes, unless `OTTER_REQUIRE_TOOLS=1` (set by `make test`).

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use otter_proto::link::v1::{LinkState, ListLinksResponse};
use prost::Message;
use serde_json::{Value as Json, json};

fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
}

fn skip_or_fail(why: &str) {
    if std::env::var("OTTER_REQUIRE_TOOLS").is_ok_and(|v| v == "1") {
        panic!("{why}");
    }
    eprintln!("skipped: {why} (run `scripts/setup.sh npm`)");
}

/// Every file under `dir`, by path relative to it.
fn read_tree(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for entry in entries {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                walk(base, &path, out);
            } else {
                let rel = path.strip_prefix(base).expect("under base").to_owned();
                out.insert(rel, fs::read(&path).expect("read file"));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

fn run(cmd: &mut Command, what: &str) -> String {
    let output = cmd.output().unwrap_or_else(|e| panic!("run {what}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf-8 output")
}

/// Uses the built package: a message to binary and JSON, and the method
/// table of every service.
const SMOKE: &str = r#"
import { create, fromBinary, toBinary, toJson } from "@bufbuild/protobuf";
import { timestampFromMs } from "@bufbuild/protobuf/wkt";
import { fleetv1, linkv1, resourcev1, runtimev1 } from "./dist/index.js";

const schema = linkv1.ListLinksResponseSchema;
const msg = create(schema, {
  links: [{
    cluster: "edge-1",
    state: linkv1.LinkState.CONNECTED,
    lastSeen: timestampFromMs(1767225600250),
    diagnosis: { rttMicros: 1500n, attempts: [{ transport: "quic", ok: false, error: "blocked" }] },
  }],
});
const bytes = toBinary(schema, msg);
const services = {};
for (const svc of [linkv1.LinkService, resourcev1.ResourceService, runtimev1.RuntimeService, fleetv1.FleetService]) {
  services[svc.typeName] = svc.methods.map((m) => [m.name, m.methodKind]);
}
console.log(JSON.stringify({
  hex: Buffer.from(bytes).toString("hex"),
  json: toJson(schema, fromBinary(schema, bytes)),
  services,
}));
"#;

#[test]
fn typescript_package_is_fresh_builds_and_agrees_on_the_wire() {
    let root = workspace_root();
    let ts = root.join("ts");
    let bin = ts.join("node_modules/.bin");
    if !bin.join("buf").exists() || !bin.join("tsc").exists() {
        skip_or_fail("no npm packages at ts/node_modules");
        return;
    }
    let tmp = tempfile::tempdir().expect("temp dir");

    // 1. Regenerate into a temp dir and compare with the checked-in sources.
    run(
        Command::new(bin.join("buf"))
            .current_dir(root)
            .args(["generate", "--template", "ts/buf.gen.yaml", "--output"])
            .arg(tmp.path().join("gen-root")),
        "buf generate",
    );
    let fresh = read_tree(&tmp.path().join("gen-root/ts/src/gen"));
    let committed = read_tree(&ts.join("src/gen"));
    assert!(!fresh.is_empty(), "buf generate produced nothing");
    let names = |t: &BTreeMap<PathBuf, Vec<u8>>| t.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(&fresh),
        names(&committed),
        "ts/src/gen has other files than protoc-gen-es makes; run `make proto`"
    );
    let stale: Vec<_> = fresh
        .iter()
        .filter(|(path, bytes)| committed.get(*path) != Some(*bytes))
        .map(|(path, _)| path.display().to_string())
        .collect();
    assert!(
        stale.is_empty(),
        "ts/src/gen is out of date: {stale:?}; run `make proto` and commit it"
    );

    // 2. `npm run build`, into a temp dir beside a link to the package's
    //    node_modules, so the checkout's ts/dist is left alone.
    let pkg = tmp.path().join("pkg");
    fs::create_dir_all(&pkg).expect("pkg dir");
    fs::copy(ts.join("package.json"), pkg.join("package.json")).expect("copy package.json");
    std::os::unix::fs::symlink(ts.join("node_modules"), pkg.join("node_modules"))
        .expect("link node_modules");
    run(
        Command::new("npm")
            .current_dir(&ts)
            .args(["run", "--silent", "build", "--", "--outDir"])
            .arg(pkg.join("dist")),
        "npm run build",
    );
    let built = read_tree(&pkg.join("dist"));
    for file in committed.keys() {
        let stem = file.with_extension("");
        for ext in ["js", "d.ts"] {
            let out = PathBuf::from("gen").join(format!("{}.{ext}", stem.display()));
            assert!(built.contains_key(&out), "npm run build made no {out:?}");
        }
    }
    assert!(built.contains_key(Path::new("index.d.ts")));

    // 3. The built package encodes what the Rust types decode, and describes
    //    the same services and methods as the descriptor set.
    fs::write(pkg.join("smoke.mjs"), SMOKE).expect("write smoke.mjs");
    let out = run(
        Command::new("node").current_dir(&pkg).arg("smoke.mjs"),
        "node smoke.mjs",
    );
    let out: Json = serde_json::from_str(&out).expect("smoke output is JSON");

    let bytes = hex::decode(out["hex"].as_str().expect("hex")).expect("hex decodes");
    let decoded = ListLinksResponse::decode(bytes.as_slice()).expect("Rust decodes TS bytes");
    let link = &decoded.links[0];
    assert_eq!(link.cluster.as_deref(), Some("edge-1"));
    assert_eq!(link.state, Some(LinkState::Connected as i32));
    let seen = link.last_seen.expect("last_seen");
    assert_eq!((seen.seconds, seen.nanos), (1_767_225_600, 250_000_000));
    let diagnosis = link.diagnosis.as_ref().expect("diagnosis");
    assert_eq!(diagnosis.rtt_micros, Some(1500));
    assert_eq!(diagnosis.attempts[0].error.as_deref(), Some("blocked"));
    assert_eq!(
        out["json"],
        json!({"links": [{
            "cluster": "edge-1",
            "state": "LINK_STATE_CONNECTED",
            "lastSeen": "2026-01-01T00:00:00.250Z",
            "diagnosis": {"attempts": [{"transport": "quic", "ok": false, "error": "blocked"}],
                          "rttMicros": "1500"},
        }]})
    );

    let fds = prost_types::FileDescriptorSet::decode(otter_proto::FILE_DESCRIPTOR_SET)
        .expect("descriptor set decodes");
    let mut expected = serde_json::Map::new();
    for file in &fds.file {
        for service in &file.service {
            let methods: Vec<Json> = service
                .method
                .iter()
                .map(|m| {
                    let kind = match (m.client_streaming(), m.server_streaming()) {
                        (false, false) => "unary",
                        (false, true) => "server_streaming",
                        (true, false) => "client_streaming",
                        (true, true) => "bidi_streaming",
                    };
                    json!([m.name(), kind])
                })
                .collect();
            expected.insert(
                format!("{}.{}", file.package(), service.name()),
                Json::Array(methods),
            );
        }
    }
    assert_eq!(out["services"], Json::Object(expected));
}
