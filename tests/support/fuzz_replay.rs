//! The seed and regression replay shared by the crates that have fuzz
//! targets (`shared/tunnel`, `shared/pki`, `hub`). Each includes this file
//! in its `tests/fuzz_regressions.rs` with `#[path]`, as it does its fuzz
//! harness, so no crate depends on another for it; `CARGO_MANIFEST_DIR` is
//! then the including crate's folder.

use std::path::{Path, PathBuf};

/// How many inputs [`replay`] fed to the harness, by where they came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replayed {
    /// Files of `fuzz/seeds/<target>/`.
    pub seeds: usize,
    /// Files of `tests/fuzz-regressions/<target>/` (none until a fuzzer
    /// first crashes the target).
    pub regressions: usize,
}

/// The files of `dir`, sorted, so the replay order is the same everywhere.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .collect();
    files.sort();
    for f in &files {
        assert!(
            f.is_file(),
            "{} is not a file: a fuzz input folder holds only input files",
            f.display()
        );
    }
    files
}

fn feed(files: &[PathBuf], run: fn(&[u8])) {
    for path in files {
        eprintln!("{}", path.display());
        let data = std::fs::read(path)
            .unwrap_or_else(|e| panic!("cannot read fuzz input {}: {e}", path.display()));
        run(&data);
    }
}

/// Feeds every file of the target's seed folder (`fuzz/seeds/<target>/`)
/// and regression folder (`tests/fuzz-regressions/<target>/`) to `run`;
/// returns how many of each there were.
///
/// Panics when the seed folder or the crate's regression folder
/// (`tests/fuzz-regressions/`) is missing: a replay that finds nothing to
/// replay must not pass. Only the target's sub-folder of the regression
/// folder may be absent (no input has crashed that target yet).
pub fn replay(target: &str, run: fn(&[u8])) -> Replayed {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let seeds_dir = root.join("fuzz/seeds").join(target);
    assert!(
        seeds_dir.is_dir(),
        "the seed folder of fuzz target {target:?} is missing: {} \
         (the seeds are committed with the target)",
        seeds_dir.display()
    );
    let regressions_root = root.join("tests/fuzz-regressions");
    assert!(
        regressions_root.is_dir(),
        "the fuzz regression folder is missing: {} \
         (it is committed with a README.md; inputs that once crashed a target \
         go into its sub-folder <target>/ and are replayed here)",
        regressions_root.display()
    );
    let seeds = files(&seeds_dir);
    feed(&seeds, run);
    let regressions_dir = regressions_root.join(target);
    let regressions = if regressions_dir.exists() {
        files(&regressions_dir)
    } else {
        Vec::new()
    };
    feed(&regressions, run);
    Replayed {
        seeds: seeds.len(),
        regressions: regressions.len(),
    }
}
