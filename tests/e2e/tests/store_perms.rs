//! The hub's data directory is owner-only whatever the umask: the directory
//! and every directory in it 0700, every file 0600, so that no other user
//! can read the store (CA key, token hashes), `admin-token` or `ca.crt`.
//!
//! Runs under umask 022, what CI and most shells have, under which sled
//! and `std::fs::write` would leave files 0644.

use std::{path::Path, sync::Arc, time::Duration};

use otter_e2e::{
    TestHub,
    double::{WAIT, start_agent, wait_connected},
};
use otter_hub::{Hub, HubConfig};
use otter_tunnel::TransportKind;

/// Group and others may not write: 0644 files, 0755 directories.
fn umask_022() {
    use rustix::fs::Mode;
    rustix::process::umask(Mode::WGRP | Mode::WOTH);
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// Every path under `dir` that is not owner-only, with its mode.
fn not_private(dir: &Path) -> Vec<String> {
    let mut wrong = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read data dir") {
        let path = entry.expect("dir entry").path();
        let (m, file_type) = (
            mode(&path),
            std::fs::symlink_metadata(&path).unwrap().file_type(),
        );
        let want = if file_type.is_dir() { 0o700 } else { 0o600 };
        if m != want {
            wrong.push(format!("{} is {m:o}", path.display()));
        }
        if file_type.is_dir() {
            wrong.extend(not_private(&path));
        }
    }
    wrong
}

fn assert_private(dir: &Path, files: &[&str]) {
    assert_eq!(mode(dir), 0o700, "data dir {}", dir.display());
    for f in files {
        assert!(dir.join(f).exists(), "{f} was written");
    }
    let wrong = not_private(dir);
    assert!(wrong.is_empty(), "not owner-only: {wrong:#?}");
}

const WRITTEN: &[&str] = &["admin-token", "ca.crt", "db/conf", "db/db"];

#[tokio::test]
async fn a_data_dir_made_by_the_hub_is_owner_only() {
    umask_022();
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("otter-data");
    let mut config = HubConfig::new(&dir);
    config.api_listen = "127.0.0.1:0".parse().unwrap();
    config.tunnel_listen = "127.0.0.1:0".parse().unwrap();
    let hub = Hub::start(config).await.expect("hub starts");
    assert_private(&dir, WRITTEN);
    hub.shutdown().await;
    assert_private(&dir, WRITTEN);
}

#[tokio::test]
async fn an_existing_data_dir_is_made_owner_only_and_stays_so_with_an_agent() {
    use std::os::unix::fs::PermissionsExt;
    umask_022();
    // As `mkdir` under umask 022 leaves it, with a file an older hub left
    // readable by everyone.
    let dir = Arc::new(tempfile::tempdir().unwrap());
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.path().join("ca.crt"), "old").unwrap();
    assert_eq!(mode(&dir.path().join("ca.crt")), 0o644, "umask 022 applies");

    let hub = TestHub::start_in(dir.clone(), None).await;
    assert_private(dir.path(), WRITTEN);

    // A registration writes the link and the agent's certificate record.
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "agent-1", &token, TransportKind::H2);
    agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("agent connects");
    wait_connected(&hub.channel().await, &hub.admin_token, 1).await;
    assert_private(dir.path(), WRITTEN);

    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
    // sled flushes on the way out; give its flusher thread a moment.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_private(dir.path(), WRITTEN);
}

/// Whether any file under `dir` contains `needle`.
fn any_file_contains(dir: &Path, needle: &[u8]) -> bool {
    std::fs::read_dir(dir).expect("read dir").any(|entry| {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            return any_file_contains(&path, needle);
        }
        std::fs::read(&path).is_ok_and(|data| data.windows(needle.len()).any(|w| w == needle))
    })
}

/// With `--store-key-file` the CA key and the signing secrets are sealed in
/// the store's files (a backup or a disk image shows no private key); a
/// hub without the key refuses the store, one with it serves as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_secrets_are_sealed_with_a_store_key() {
    let start = |dir: &Path, key: Option<&Path>| {
        let mut config = HubConfig::new(dir);
        config.api_listen = "127.0.0.1:0".parse().unwrap();
        config.tunnel_listen = "127.0.0.1:0".parse().unwrap();
        config.store_key_file = key.map(Path::to_path_buf);
        Hub::start(config)
    };
    let secrets = tempfile::tempdir().unwrap();
    let key = secrets.path().join("store.key");
    std::fs::write(&key, [42u8; 32]).unwrap();

    // The control: without a key the CA's private key is in the files.
    let plain = tempfile::tempdir().unwrap();
    start(plain.path(), None).await.unwrap().shutdown().await;
    assert!(any_file_contains(plain.path(), b"PRIVATE KEY"));

    let sealed = tempfile::tempdir().unwrap();
    let hub = start(sealed.path(), Some(&key)).await.unwrap();
    let ca = hub.ca_pem().to_owned();
    hub.shutdown().await;
    assert!(!any_file_contains(sealed.path(), b"PRIVATE KEY"));
    let refused = start(sealed.path(), None).await.unwrap_err();
    assert!(
        refused.to_string().contains("--store-key-file"),
        "{refused}"
    );
    let hub = start(sealed.path(), Some(&key)).await.unwrap();
    assert_eq!(hub.ca_pem(), ca, "the same CA, opened with the key");
    hub.shutdown().await;

    // A store written in the clear is sealed when a key is first given
    // (and opens with it from then on); sled may keep the old clear copies
    // in its log until it rewrites them, which the README says.
    start(plain.path(), Some(&key))
        .await
        .unwrap()
        .shutdown()
        .await;
    assert!(start(plain.path(), None).await.is_err());
}
