//! Replays the fuzz seed corpus (`fuzz/seeds/<target>/`) and every input a
//! fuzzer ever crashed on (`tests/fuzz-regressions/<target>/`) through the
//! same harness functions the fuzz targets call, under plain `cargo test`.

#[path = "../../../tests/support/fuzz_replay.rs"]
mod fuzz_replay;
#[path = "../fuzz/harness.rs"]
mod harness;

use fuzz_replay::replay;

#[test]
fn frame_decode_corpus() {
    assert!(replay("frame_decode", harness::frame_decode) >= 5);
}

#[test]
fn stream_head_corpus() {
    assert!(replay("stream_head", harness::stream_head) >= 5);
}
