//! The seed and regression replay shared by the crates that have fuzz
//! targets (`shared/tunnel`, `shared/pki`, `hub`). Each includes this file
//! in its `tests/fuzz_regressions.rs` with `#[path]`, as it does its fuzz
//! harness, so no crate depends on another for it; `CARGO_MANIFEST_DIR` is
//! then the including crate's folder.

use std::path::Path;

/// Feeds every file of the target's seed folder (`fuzz/seeds/<target>/`)
/// and regression folder (`tests/fuzz-regressions/<target>/`) to `run`;
/// returns how many there were.
pub fn replay(target: &str, run: fn(&[u8])) -> usize {
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
