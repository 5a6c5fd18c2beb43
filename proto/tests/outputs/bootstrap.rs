//! Regenerates the checked-in code under `src/gen/` and fails when it differs
//! from what is committed, so the protos and the Rust code cannot drift.
//!
//! `OTTER_PROTO_REGEN=1 cargo test -p otter-proto --test outputs bootstrap::` (which is
//! what `make proto` runs) writes the fresh output instead of comparing.

use std::{fs, path::Path};

#[test]
fn generated_code_is_fresh() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().expect("temp dir");

    // The encoded set keeps custom options (the feature extension); a
    // round trip through prost_types would drop them as unknown fields.
    let mut compiler = protox::Compiler::new([root]).expect("include path");
    compiler.include_imports(true).include_source_info(true);
    compiler
        .open_files(otter_proto::PROTO_FILES)
        .expect("protos compile");
    let descriptor = compiler.encode_file_descriptor_set();
    let fds = compiler.file_descriptor_set();

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .out_dir(out.path())
        .compile_fds(fds)
        .expect("code generation");
    fs::write(out.path().join("descriptor.bin"), &descriptor).expect("write descriptor");

    let gen_dir = root.join("src/gen");
    let regen = std::env::var_os("OTTER_PROTO_REGEN").is_some();
    let mut stale = Vec::new();
    let mut fresh_names = Vec::new();
    for entry in fs::read_dir(out.path()).expect("read output") {
        let entry = entry.expect("dir entry");
        let name = entry.file_name().into_string().expect("utf-8 name");
        let fresh = fs::read(entry.path()).expect("read generated");
        let committed = fs::read(gen_dir.join(&name)).ok();
        if committed.as_deref() != Some(fresh.as_slice()) {
            if regen {
                fs::write(gen_dir.join(&name), &fresh).expect("write generated");
            } else {
                stale.push(name.clone());
            }
        }
        fresh_names.push(name);
    }
    // Files left over from a proto that was removed are stale too.
    for entry in fs::read_dir(&gen_dir).expect("read src/gen") {
        let name = entry
            .expect("dir entry")
            .file_name()
            .into_string()
            .expect("utf-8 name");
        if !fresh_names.contains(&name) {
            if regen {
                fs::remove_file(gen_dir.join(&name)).expect("remove stale");
            } else {
                stale.push(name);
            }
        }
    }
    assert!(
        stale.is_empty(),
        "generated code is out of date: {stale:?}; run `make proto` and commit src/gen/"
    );
}
