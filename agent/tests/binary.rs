//! The `otter-agent` binary as shipped (its own `main`): it reports the
//! workspace's version, which `make release` and the default agent image's
//! tag go by. (Being here also makes `cargo test --workspace` build the
//! binary, which `make release`'s test in the hub package packages.)

#[test]
fn the_binary_reports_the_workspace_version() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_otter-agent"))
        .arg("--version")
        .output()
        .expect("otter-agent runs");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("otter-agent {}", env!("CARGO_PKG_VERSION"))
    );
}
