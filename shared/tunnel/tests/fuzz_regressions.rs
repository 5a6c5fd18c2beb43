//! Replays the fuzz seed corpus (`fuzz/seeds/<target>/`) and every input a
//! fuzzer ever crashed on (`tests/fuzz-regressions/<target>/`) through the
//! same harness functions the fuzz targets call, under plain `cargo test`.
//!
//! The seed counts asserted here are exact (the files committed under
//! `fuzz/seeds/<target>/`), so a lost seed fails, and so does a missing
//! `tests/fuzz-regressions/`: the replay never passes by finding nothing.

#[path = "../../../tests/support/fuzz_replay.rs"]
mod fuzz_replay;
#[path = "../fuzz/harness.rs"]
mod harness;

use fuzz_replay::replay;

#[test]
fn frame_decode_corpus() {
    let n = replay("frame_decode", harness::frame_decode);
    assert_eq!(n.seeds, 5, "files in fuzz/seeds/frame_decode/: {n:?}");
}

#[test]
fn stream_head_corpus() {
    let n = replay("stream_head", harness::stream_head);
    assert_eq!(n.seeds, 6, "files in fuzz/seeds/stream_head/: {n:?}");
}
