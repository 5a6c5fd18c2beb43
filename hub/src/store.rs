//! What the hub keeps across restarts, behind a small trait so the embedded
//! default (sled) can be swapped for a shared store (etcd) without touching
//! callers.
//!
//! Records are JSON: readable with any sled tool, and a field added later
//! loads fine from an older record.

use std::path::Path;

use serde::{Serialize, de::DeserializeOwned};

use crate::{HubError, Result};

/// Trees (tables) of the store.
pub mod tree {
    /// Singletons: the CA, the token signing key.
    pub const META: &str = "meta";
    /// `LinkRecord` by cluster name.
    pub const LINKS: &str = "links";
    /// `JoinTokenRecord` by token id.
    pub const JOIN_TOKENS: &str = "join_tokens";
    /// `ApiTokenRecord` by token id.
    pub const API_TOKENS: &str = "api_tokens";
}

/// A transactional-enough key-value store: single-key writes are atomic and
/// durable once `flush` returns.
pub trait Store: Send + Sync + 'static {
    fn get_raw(&self, tree: &str, key: &str) -> Result<Option<Vec<u8>>>;
    fn put_raw(&self, tree: &str, key: &str, value: &[u8]) -> Result<()>;
    fn delete(&self, tree: &str, key: &str) -> Result<()>;
    /// Every (key, value) of a tree, in key order.
    fn scan_raw(&self, tree: &str) -> Result<Vec<(String, Vec<u8>)>>;
    /// Makes every write so far durable.
    fn flush(&self) -> Result<()>;
    /// Whether writes currently succeed (for health).
    fn writable(&self) -> bool;
}

/// Typed helpers over any [`Store`].
pub trait StoreExt: Store {
    fn get<T: DeserializeOwned>(&self, tree: &str, key: &str) -> Result<Option<T>> {
        self.get_raw(tree, key)?
            .map(|v| {
                serde_json::from_slice(&v)
                    .map_err(|e| HubError::Store(format!("{tree}/{key}: {e}")))
            })
            .transpose()
    }

    fn put<T: Serialize>(&self, tree: &str, key: &str, value: &T) -> Result<()> {
        let bytes = serde_json::to_vec(value).map_err(|e| HubError::Store(e.to_string()))?;
        self.put_raw(tree, key, &bytes)?;
        self.flush()
    }

    fn scan<T: DeserializeOwned>(&self, tree: &str) -> Result<Vec<T>> {
        self.scan_raw(tree)?
            .into_iter()
            .map(|(k, v)| {
                serde_json::from_slice(&v).map_err(|e| HubError::Store(format!("{tree}/{k}: {e}")))
            })
            .collect()
    }
}

impl<S: Store + ?Sized> StoreExt for S {}

/// The embedded default: sled in the hub's data directory.
#[derive(Debug)]
pub struct SledStore {
    db: sled::Db,
}

impl SledStore {
    /// Opens (or creates) the store under `dir`. sled locks the directory, so
    /// a second hub on the same data dir fails here with a clear error.
    pub fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| {
            HubError::Store(format!("cannot create data dir {}: {e}", dir.display()))
        })?;
        let db = sled::Config::new()
            .path(dir.join("db"))
            .cache_capacity(16 * 1024 * 1024)
            .open()
            .map_err(|e| HubError::Store(format!("cannot open store in {}: {e}", dir.display())))?;
        Ok(Self { db })
    }

    fn tree(&self, name: &str) -> Result<sled::Tree> {
        self.db.open_tree(name).map_err(sled_err)
    }
}

fn sled_err(e: sled::Error) -> HubError {
    HubError::Store(e.to_string())
}

impl Store for SledStore {
    fn get_raw(&self, tree: &str, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self
            .tree(tree)?
            .get(key)
            .map_err(sled_err)?
            .map(|v| v.to_vec()))
    }

    fn put_raw(&self, tree: &str, key: &str, value: &[u8]) -> Result<()> {
        self.tree(tree)?.insert(key, value).map_err(sled_err)?;
        Ok(())
    }

    fn delete(&self, tree: &str, key: &str) -> Result<()> {
        self.tree(tree)?.remove(key).map_err(sled_err)?;
        self.flush()
    }

    fn scan_raw(&self, tree: &str) -> Result<Vec<(String, Vec<u8>)>> {
        self.tree(tree)?
            .iter()
            .map(|kv| {
                let (k, v) = kv.map_err(sled_err)?;
                Ok((String::from_utf8_lossy(&k).into_owned(), v.to_vec()))
            })
            .collect()
    }

    fn flush(&self) -> Result<()> {
        self.db.flush().map_err(sled_err)?;
        Ok(())
    }

    fn writable(&self) -> bool {
        self.put_raw(tree::META, "health-probe", b"1").is_ok() && self.db.flush().is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = SledStore::open(dir.path()).unwrap();
            s.put(
                tree::LINKS,
                "edge-1",
                &serde_json::json!({"cluster": "edge-1"}),
            )
            .unwrap();
            s.put(
                tree::LINKS,
                "edge-2",
                &serde_json::json!({"cluster": "edge-2"}),
            )
            .unwrap();
            s.delete(tree::LINKS, "edge-2").unwrap();
        }
        // sled's flusher thread can hold the file lock a moment after drop.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let s = loop {
            match SledStore::open(dir.path()) {
                Ok(s) => break s,
                Err(e) if std::time::Instant::now() < deadline => {
                    assert!(e.to_string().contains("could not acquire lock"), "{e}");
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => panic!("{e}"),
            }
        };
        let all: Vec<serde_json::Value> = s.scan(tree::LINKS).unwrap();
        assert_eq!(all, vec![serde_json::json!({"cluster": "edge-1"})]);
        assert!(s.writable());
    }
}
