//! Replays the fuzz seed corpus (`fuzz/seeds/<target>/`) and every input a
//! fuzzer ever crashed on (`tests/fuzz-regressions/<target>/`) through the
//! same harness functions the fuzz targets call, under plain `cargo test`.
//!
//! The seed counts asserted here are exact (the files committed under
//! `fuzz/seeds/<target>/`), so a lost seed fails, and so does a missing
//! `tests/fuzz-regressions/`: the replay never passes by finding nothing.

#[path = "../../tests/support/fuzz_replay.rs"]
mod fuzz_replay;
#[path = "../fuzz/harness.rs"]
mod harness;

use fuzz_replay::replay;

#[test]
fn connect_envelope_corpus() {
    let n = replay("connect_envelope", harness::connect_envelope);
    assert_eq!(n.seeds, 4, "files in fuzz/seeds/connect_envelope/: {n:?}");
}

#[test]
fn connect_json_corpus() {
    let n = replay("connect_json", harness::connect_json);
    assert_eq!(n.seeds, 6, "files in fuzz/seeds/connect_json/: {n:?}");
}

#[test]
fn proto_json_corpus() {
    let n = replay("proto_json", harness::proto_json);
    assert_eq!(n.seeds, 5, "files in fuzz/seeds/proto_json/: {n:?}");
}

#[test]
fn grpc_web_corpus() {
    let n = replay("grpc_web", harness::grpc_web);
    assert_eq!(n.seeds, 4, "files in fuzz/seeds/grpc_web/: {n:?}");
}

#[test]
fn manifest_url_corpus() {
    let n = replay("manifest_url", harness::manifest_url);
    assert_eq!(n.seeds, 5, "files in fuzz/seeds/manifest_url/: {n:?}");
}
