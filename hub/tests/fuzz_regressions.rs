//! Replays the fuzz seed corpus (`fuzz/seeds/<target>/`) and every input a
//! fuzzer ever crashed on (`tests/fuzz-regressions/<target>/`) through the
//! same harness functions the fuzz targets call, under plain `cargo test`.

#[path = "../../tests/support/fuzz_replay.rs"]
mod fuzz_replay;
#[path = "../fuzz/harness.rs"]
mod harness;

use fuzz_replay::replay;

#[test]
fn connect_envelope_corpus() {
    assert!(replay("connect_envelope", harness::connect_envelope) >= 4);
}

#[test]
fn connect_json_corpus() {
    assert!(replay("connect_json", harness::connect_json) >= 5);
}

#[test]
fn grpc_web_corpus() {
    assert!(replay("grpc_web", harness::grpc_web) >= 4);
}

#[test]
fn manifest_url_corpus() {
    assert!(replay("manifest_url", harness::manifest_url) >= 5);
}
