//! Replays the fuzz seed corpus (`fuzz/seeds/<target>/`) and every input a
//! fuzzer ever crashed on (`tests/fuzz-regressions/<target>/`) through the
//! same harness functions the fuzz targets call, under plain `cargo test`.

#[path = "../fuzz/harness.rs"]
mod harness;

use std::path::Path;

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
            eprintln!("{}", path.display());
            run(&std::fs::read(&path).expect("read input"));
            n += 1;
        }
    }
    n
}

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
