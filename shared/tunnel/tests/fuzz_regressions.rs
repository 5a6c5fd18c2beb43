//! Replays the fuzz seed corpus (`fuzz/seeds/<target>/`) and every input a
//! fuzzer ever crashed on (`tests/fuzz-regressions/<target>/`) through the
//! same harness functions the fuzz targets call, under plain `cargo test`.

#[path = "../fuzz/harness.rs"]
mod harness;

use std::path::Path;

/// Feeds every file of the target's seed and regression folders to `run`;
/// returns how many there were.
fn replay(target: &str, run: fn(&[u8])) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut n = 0;
    for dir in [
        root.join("fuzz/seeds").join(target),
        root.join("tests/fuzz-regressions").join(target),
    ] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry.expect("directory entry").path();
            let data = std::fs::read(&path).expect("read input");
            eprintln!("{}", path.display());
            run(&data);
            n += 1;
        }
    }
    n
}

#[test]
fn frame_decode_corpus() {
    assert!(replay("frame_decode", harness::frame_decode) >= 5);
}

#[test]
fn stream_head_corpus() {
    assert!(replay("stream_head", harness::stream_head) >= 5);
}
