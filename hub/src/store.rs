//! What the hub keeps across restarts, behind a small trait so the embedded
//! default (sled) can be swapped for a shared store (etcd) without touching
//! callers.
//!
//! Records are JSON: readable with any sled tool, and a field added later
//! loads fine from an older record.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use serde::{Serialize, de::DeserializeOwned};

use crate::{HubError, Result};

/// Why the store failed, by cause ([`HubError::Store`]).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The embedded database failed.
    #[error(transparent)]
    Sled(#[from] sled::Error),
    /// etcd refused or failed a request, and retrying will not help.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// etcd failed a lookup made for several callers at once (each gets
    /// the failure's message).
    #[error("{0}")]
    Lookup(String),
    /// A record did not convert to or from JSON (`at`: tree/key).
    #[error("{at}: {source}")]
    Json {
        at: String,
        #[source]
        source: serde_json::Error,
    },
    /// A secret kept as hex is not hex.
    #[error("{at}: {source}")]
    Hex {
        at: String,
        #[source]
        source: hex::FromHexError,
    },
    /// A sealed record could not be sealed or opened.
    #[error("{at}: {why}")]
    Sealed { at: String, why: &'static str },
    /// A record just written was not there to read back.
    #[error("{at}: written and gone")]
    Vanished { at: String },
    /// The data directory could not be made, opened or made private.
    #[error("data dir {}: {source}", path.display())]
    DataDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// sled could not open its database in the data directory.
    #[error("cannot open store in {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: sled::Error,
    },
    /// The thread that runs the etcd client did not start.
    #[error("etcd client thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The task that opened the store did not finish.
    #[error("opening the store: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// `value` as the JSON kept at `tree`/`key`.
pub fn encode<T: Serialize>(tree: &str, key: &str, value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|source| json_err(tree, key, source))
}

/// The record kept at `tree`/`key`, from its JSON `raw`.
pub fn decode<T: DeserializeOwned>(tree: &str, key: &str, raw: &[u8]) -> Result<T> {
    serde_json::from_slice(raw).map_err(|source| json_err(tree, key, source))
}

fn json_err(tree: &str, key: &str, source: serde_json::Error) -> HubError {
    HubError::Store(StoreError::Json {
        at: format!("{tree}/{key}"),
        source,
    })
}

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
    /// `ManifestUrlRecord` (fetches so far) by a digest of the URL.
    pub const MANIFEST_URLS: &str = "manifest_urls";
    /// `TenantRecord` by tenant name.
    pub const TENANTS: &str = "tenants";
    /// `ClusterClaim` (the tenant a cluster name belongs to) by cluster.
    pub const CLUSTER_TENANTS: &str = "cluster_tenants";
    /// `TunnelOwner` (the replica holding a cluster's tunnel) by cluster,
    /// kept for as long as that replica lives.
    pub const TUNNELS: &str = "tunnels";
    /// `ReplicaRecord` (where a replica serves its API and tunnels) by
    /// replica name, kept for as long as that replica lives.
    pub const REPLICAS: &str = "replicas";
    /// When a cluster's link was deleted (unix seconds, JSON), by cluster:
    /// join tokens authorized before then enroll nobody.
    pub const RELEASED: &str = "released_clusters";
}

/// A transactional-enough key-value store: a write is atomic (several keys
/// together through [`Store::compare_and_swap_all`]) and durable once
/// `flush` returns.
pub trait Store: Send + Sync + 'static {
    fn get_raw(&self, tree: &str, key: &str) -> Result<Option<Vec<u8>>>;
    fn put_raw(&self, tree: &str, key: &str, value: &[u8]) -> Result<()>;
    fn delete(&self, tree: &str, key: &str) -> Result<()>;
    /// Writes `new` (or deletes, with `None`) only if the key still holds
    /// `old` (`None`: absent); whether it did. Writes that must not race
    /// (a join token used once) go through this.
    fn compare_and_swap_raw(
        &self,
        tree: &str,
        key: &str,
        old: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<bool>;
    /// Every swap of `swaps`, or none: only if each key still holds its
    /// `old`; whether they all did. One round trip to a shared store, where
    /// a write of several records (an enrollment spends its token, claims
    /// the cluster's name and writes its link) would otherwise take one
    /// each. The keys must differ.
    fn compare_and_swap_all(&self, swaps: &[Swap]) -> Result<bool>;
    /// Every (key, value) of a tree, in key order.
    fn scan_raw(&self, tree: &str) -> Result<Vec<(String, Vec<u8>)>>;
    /// [`Store::scan_raw`] a record at a time, to a reader that keeps
    /// what it makes of each (ListLinks, 10,000 links five times a second
    /// from a dashboard): a store that can lend its values saves a copy
    /// of the whole tree. Stops at the first error.
    fn for_each_raw(
        &self,
        tree: &str,
        visit: &mut dyn FnMut(&str, &[u8]) -> Result<()>,
    ) -> Result<()> {
        for (key, value) in self.scan_raw(tree)? {
            visit(&key, &value)?;
        }
        Ok(())
    }
    /// Writes `value` for as long as this replica lives: on a store shared
    /// by replicas it goes when the replica does (an etcd lease), so what
    /// it says (which replica holds a cluster's tunnel) cannot outlive a
    /// crash. A store of one replica keeps no such records: its own routing
    /// table says it all.
    fn put_leased(&self, _tree: &str, _key: &str, _value: &[u8]) -> Result<()> {
        Ok(())
    }
    /// [`Store::compare_and_swap_raw`] writing `new` as [`Store::put_leased`]
    /// does: how a replica takes a cluster's tunnel record, so ownership
    /// moves only by transaction.
    fn compare_and_swap_leased(
        &self,
        tree: &str,
        key: &str,
        old: Option<&[u8]>,
        new: &[u8],
    ) -> Result<bool> {
        self.compare_and_swap_raw(tree, key, old, Some(new))
    }
    /// Ticks whenever other writers' changes arrive (a shared store's
    /// watch): what follows the store (closing a deleted link's tunnel, the
    /// CA of a rotation made on another replica) wakes on it rather than
    /// on a timer. A store only this process writes has none.
    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }
    /// Makes every write so far durable.
    fn flush(&self) -> Result<()>;
    /// Whether writes currently succeed (for health).
    fn writable(&self) -> bool;
    /// A number that moves whenever `tree` may have changed (a write of
    /// this process, or of another replica once it is in this one's copy):
    /// while it stays, a scan finds what the last one found, so a reader
    /// may keep what it made of that (ListLinks, polled by dashboards).
    /// `None`: this store cannot tell; scan each time.
    fn version(&self, _tree: &str) -> Option<u64> {
        None
    }
    /// A number that moves whenever the key's value changes, 0 while it
    /// is absent (etcd: the revision it was written at, in this replica's
    /// copy): while it stays, what was made of the value still holds.
    /// `None`: this store cannot tell; read the value each time.
    fn stamp(&self, _tree: &str, _key: &str) -> Option<i64> {
        None
    }
}

/// Writes counted per tree, for [`Store::version`].
#[derive(Debug, Default)]
pub struct TreeVersions {
    by_tree: HashMap<String, u64>,
    /// Moves every tree's number at once (a store read anew).
    all: u64,
}

impl TreeVersions {
    /// `tree` was written (or may have been).
    pub fn wrote(&mut self, tree: &str) {
        match self.by_tree.get_mut(tree) {
            Some(n) => *n += 1,
            None => {
                self.by_tree.insert(tree.to_owned(), 1);
            }
        }
    }

    /// Every tree may have changed.
    pub fn wrote_all(&mut self) {
        self.all += 1;
    }

    /// `tree`'s number: both parts only grow, so their sum moves with
    /// either.
    pub fn of(&self, tree: &str) -> u64 {
        self.all + self.by_tree.get(tree).copied().unwrap_or(0)
    }
}

/// One key's part of [`Store::compare_and_swap_all`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Swap {
    pub tree: String,
    pub key: String,
    /// What the key must hold (`None`: absent).
    pub old: Option<Vec<u8>>,
    /// What it is to hold (`None`: deleted). Equal to `old`, the key is
    /// only checked, not written.
    pub new: Option<Vec<u8>>,
    /// Written for as long as this replica lives, as
    /// [`Store::compare_and_swap_leased`] writes.
    pub leased: bool,
}

impl Swap {
    pub fn new(tree: &str, key: &str, old: Option<Vec<u8>>, new: Option<Vec<u8>>) -> Self {
        Self {
            tree: tree.to_owned(),
            key: key.to_owned(),
            old,
            new,
            leased: false,
        }
    }

    /// Whether the key is only checked.
    pub fn checks_only(&self) -> bool {
        self.old == self.new
    }
}

/// Typed helpers over any [`Store`].
pub trait StoreExt: Store {
    fn get<T: DeserializeOwned>(&self, tree: &str, key: &str) -> Result<Option<T>> {
        self.get_raw(tree, key)?
            .map(|v| decode(tree, key, &v))
            .transpose()
    }

    fn put<T: Serialize>(&self, tree: &str, key: &str, value: &T) -> Result<()> {
        let bytes = encode(tree, key, value)?;
        self.put_raw(tree, key, &bytes)?;
        self.flush()
    }

    /// Replaces the record `old` (as read, raw) with `new` unless another
    /// write came between; whether it did. Durable when it returns true.
    fn replace<T: Serialize>(&self, tree: &str, key: &str, old: &[u8], new: &T) -> Result<bool> {
        let bytes = encode(tree, key, new)?;
        let swapped = self.compare_and_swap_raw(tree, key, Some(old), Some(&bytes))?;
        if swapped {
            self.flush()?;
        }
        Ok(swapped)
    }

    /// The record at `key`, made by `make` and written if there is none.
    /// Replicas starting together on one shared store agree on one: the
    /// first write wins and the others read it.
    fn get_or_create<T: Serialize + DeserializeOwned>(
        &self,
        tree: &str,
        key: &str,
        make: impl FnOnce() -> Result<T>,
    ) -> Result<(T, bool)> {
        if let Some(found) = self.get(tree, key)? {
            return Ok((found, false));
        }
        let made = make()?;
        let bytes = encode(tree, key, &made)?;
        if self.compare_and_swap_raw(tree, key, None, Some(&bytes))? {
            self.flush()?;
            return Ok((made, true));
        }
        self.get(tree, key)?
            .map(|found| (found, false))
            .ok_or_else(|| {
                HubError::Store(StoreError::Vanished {
                    at: format!("{tree}/{key}"),
                })
            })
    }

    fn scan<T: DeserializeOwned>(&self, tree: &str) -> Result<Vec<T>> {
        let mut records = Vec::new();
        self.for_each_raw(tree, &mut |key, raw| {
            records.push(decode(tree, key, raw)?);
            Ok(())
        })?;
        Ok(records)
    }
}

impl<S: Store + ?Sized> StoreExt for S {}

/// Wakes a task that follows the store: when changes arrive (at most once
/// every `min_gap`, so a reconnect storm's writes do not make it spin), and
/// at least every `max_gap` whatever the store says.
#[derive(Debug)]
pub struct Follower {
    changes: Option<tokio::sync::watch::Receiver<u64>>,
    min_gap: std::time::Duration,
    max_gap: std::time::Duration,
    last: tokio::time::Instant,
}

impl Follower {
    pub fn new(
        store: &dyn Store,
        min_gap: std::time::Duration,
        max_gap: std::time::Duration,
    ) -> Self {
        Follower {
            changes: store.changes(),
            min_gap,
            max_gap,
            last: tokio::time::Instant::now(),
        }
    }

    /// Returns when it is time to look at the store again.
    pub async fn next(&mut self) {
        let deadline = self.last + self.max_gap;
        match &mut self.changes {
            Some(rx) => {
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() {
                        // The store's watch is gone: the timer alone.
                        self.changes = None;
                        tokio::time::sleep_until(deadline).await;
                    },
                    () = tokio::time::sleep_until(deadline) => {}
                }
            }
            None => tokio::time::sleep_until(deadline).await,
        }
        tokio::time::sleep_until(self.last + self.min_gap).await;
        self.last = tokio::time::Instant::now();
    }
}

/// A random 32-byte secret kept (hex) under `meta/<name>`, made on first
/// use; replicas starting together agree on one.
pub fn secret(store: &dyn Store, name: &str) -> Result<Vec<u8>> {
    let (hex_key, _) = store.get_or_create(tree::META, name, || {
        Ok(hex::encode(rand::random::<[u8; 32]>()))
    })?;
    hex::decode(hex_key).map_err(|source| {
        HubError::Store(StoreError::Hex {
            at: format!("{}/{name}", tree::META),
            source,
        })
    })
}

/// The embedded default: sled in the hub's data directory.
#[derive(Debug)]
pub struct SledStore {
    db: sled::Db,
    /// Only this process writes the store (sled locks its directory).
    versions: std::sync::Mutex<TreeVersions>,
}

impl SledStore {
    /// Opens (or creates) the store under `dir`. sled locks the directory, so
    /// a second hub on the same data dir fails here with a clear error.
    ///
    /// The directory ends up 0700 and everything in it 0600 (directories
    /// 0700) whatever the umask: sled's files hold the CA key and token
    /// hashes, `admin-token` a bearer token.
    pub fn open(dir: &Path) -> Result<Self> {
        create_private_dir(dir).map_err(|source| {
            HubError::Store(StoreError::DataDir {
                path: dir.to_owned(),
                source,
            })
        })?;
        let db = sled::Config::new()
            .path(dir.join("db"))
            .cache_capacity(16 * 1024 * 1024)
            .open()
            .map_err(|e| {
                // sled says so only in its message (an `Other` I/O error):
                // recognised here, once, and typed from here on.
                if e.to_string().contains("could not acquire lock") {
                    HubError::Locked(dir.to_owned())
                } else {
                    HubError::Store(StoreError::Open {
                        path: dir.to_owned(),
                        source: e,
                    })
                }
            })?;
        // sled creates its files with the process umask (0644 under the
        // usual 022), and files an older hub left behind keep their mode.
        // Files sled makes later land in `db/`, which is 0700 by then.
        restrict_tree(dir).map_err(|source| {
            HubError::Store(StoreError::DataDir {
                path: dir.to_owned(),
                source,
            })
        })?;
        Ok(Self {
            db,
            versions: Default::default(),
        })
    }

    fn tree(&self, name: &str) -> Result<sled::Tree> {
        self.db.open_tree(name).map_err(sled_err)
    }
}

/// Mode of the data directory and every directory in it.
const DIR_MODE: u32 = 0o700;
/// Mode of every file in the data directory.
const FILE_MODE: u32 = 0o600;

/// Creates `dir` with mode 0700 (missing parents as usual), or makes an
/// existing one 0700.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::DirBuilder::new().mode(DIR_MODE).create(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => {}
        other => other?,
    }
    restrict(dir, DIR_MODE)?;
    Ok(())
}

/// Makes every file under `dir` 0600 and every directory 0700, recursively.
/// Symbolic links are left alone: their targets are not the hub's.
fn restrict_tree(dir: &Path) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        // Gone meanwhile (sled removes old snapshots).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        // Another user's directory that already had mode 0700.
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            tracing::warn!(path = %dir.display(), "cannot read a directory in the data dir: {e}");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let file_type = entry.file_type()?;
        let mode = match file_type {
            t if t.is_dir() => DIR_MODE,
            t if t.is_file() => FILE_MODE,
            _ => continue,
        };
        let path = entry.path();
        if restrict(&path, mode)? && file_type.is_dir() {
            restrict_tree(&path)?;
        }
    }
    Ok(())
}

/// Sets the mode of `path`; whether it now has it.
///
/// A path owned by another user cannot be changed: the root of
/// a Kubernetes volume used as the data dir, its `lost+found`. That is
/// left with a warning rather than keeping the hub from starting; what the
/// hub writes is still protected by its own modes.
fn restrict(path: &Path, mode: u32) -> std::io::Result<bool> {
    use std::{io::ErrorKind, os::unix::fs::PermissionsExt};
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if meta.permissions().mode() & 0o7777 == mode {
        return Ok(true);
    }
    match std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) if e.kind() == ErrorKind::PermissionDenied => {
            tracing::warn!(
                path = %path.display(),
                "cannot set mode {mode:o} in the data dir (owned by another user?): {e}"
            );
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

fn sled_err(e: sled::Error) -> HubError {
    HubError::Store(e.into())
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
        let put = self.tree(tree)?.insert(key, value);
        self.wrote(tree);
        put.map_err(sled_err)?;
        Ok(())
    }

    fn delete(&self, tree: &str, key: &str) -> Result<()> {
        let removed = self.tree(tree)?.remove(key);
        self.wrote(tree);
        removed.map_err(sled_err)?;
        self.flush()
    }

    fn compare_and_swap_raw(
        &self,
        tree: &str,
        key: &str,
        old: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<bool> {
        let swapped = self.tree(tree)?.compare_and_swap(key, old, new);
        self.wrote(tree);
        Ok(swapped.map_err(sled_err)?.is_ok())
    }

    fn compare_and_swap_all(&self, swaps: &[Swap]) -> Result<bool> {
        use sled::transaction::{ConflictableTransactionError, TransactionError};
        // One key written needs no transaction (which serializes with
        // every other): the last-seen writer swaps a link at a time.
        if let [s] = swaps
            && !s.checks_only()
        {
            return self.compare_and_swap_raw(&s.tree, &s.key, s.old.as_deref(), s.new.as_deref());
        }
        // A transaction takes each tree once.
        let mut names: Vec<&str> = swaps.iter().map(|s| s.tree.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        let trees = names
            .iter()
            .map(|name| self.tree(name))
            .collect::<Result<Vec<_>>>()?;
        let index = |name: &str| names.binary_search(&name).unwrap_or_default();
        let swapped = sled::Transactional::transaction(trees.as_slice(), |trees| {
            for s in swaps {
                let held = trees[index(&s.tree)].get(s.key.as_bytes())?;
                if held.as_deref() != s.old.as_deref() {
                    return Err(ConflictableTransactionError::Abort(()));
                }
            }
            for s in swaps.iter().filter(|s| !s.checks_only()) {
                let tree = &trees[index(&s.tree)];
                match &s.new {
                    Some(v) => tree.insert(s.key.as_bytes(), v.as_slice())?,
                    None => tree.remove(s.key.as_bytes())?,
                };
            }
            Ok(())
        });
        for name in &names {
            self.wrote(name);
        }
        match swapped {
            Ok(()) => Ok(true),
            Err(TransactionError::Abort(())) => Ok(false),
            Err(TransactionError::Storage(e)) => Err(sled_err(e)),
        }
    }

    fn scan_raw(&self, tree: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let mut all = Vec::new();
        self.for_each_raw(tree, &mut |key, value| {
            all.push((key.to_owned(), value.to_vec()));
            Ok(())
        })?;
        Ok(all)
    }

    fn for_each_raw(
        &self,
        tree: &str,
        visit: &mut dyn FnMut(&str, &[u8]) -> Result<()>,
    ) -> Result<()> {
        for kv in self.tree(tree)?.iter() {
            let (key, value) = kv.map_err(sled_err)?;
            visit(&String::from_utf8_lossy(&key), &value)?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.db.flush().map_err(sled_err)?;
        Ok(())
    }

    fn writable(&self) -> bool {
        self.put_raw(tree::META, "health-probe", b"1").is_ok() && self.db.flush().is_ok()
    }

    fn version(&self, tree: &str) -> Option<u64> {
        Some(self.versions().of(tree))
    }
}

impl SledStore {
    fn versions(&self) -> std::sync::MutexGuard<'_, TreeVersions> {
        self.versions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counted after the write, so a reader that took the number before
    /// its scan sees the write or a number that moved since.
    fn wrote(&self, tree: &str) {
        self.versions().wrote(tree);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn swap(tree: &str, key: &str, old: Option<&str>, new: Option<&str>) -> Swap {
        let bytes = |v: &str| v.as_bytes().to_vec();
        Swap::new(tree, key, old.map(bytes), new.map(bytes))
    }

    /// What every store does with several swaps at once: all of them or
    /// none; a key only checked is left as it is; a deletion deletes.
    pub(crate) fn swaps_are_all_or_none(store: &dyn Store) {
        let read = |tree: &str, key: &str| {
            store
                .get_raw(tree, key)
                .unwrap()
                .map(|v| String::from_utf8(v).unwrap())
        };
        store.put_raw(tree::META, "gate", b"open").unwrap();
        store.put_raw(tree::LINKS, "edge-2", b"old").unwrap();
        let enroll = |gate: &str| {
            vec![
                swap(tree::JOIN_TOKENS, "t1", None, Some("spent")),
                swap(tree::LINKS, "edge-1", None, Some("link")),
                swap(tree::LINKS, "edge-2", Some("old"), None),
                swap(tree::META, "gate", Some(gate), Some(gate)),
            ]
        };
        // One compare fails (the gate): nothing is written.
        assert!(!store.compare_and_swap_all(&enroll("shut")).unwrap());
        assert_eq!(read(tree::JOIN_TOKENS, "t1"), None);
        assert_eq!(read(tree::LINKS, "edge-2").as_deref(), Some("old"));
        // All hold: all written, the gate only checked.
        assert!(store.compare_and_swap_all(&enroll("open")).unwrap());
        assert_eq!(read(tree::JOIN_TOKENS, "t1").as_deref(), Some("spent"));
        assert_eq!(read(tree::LINKS, "edge-1").as_deref(), Some("link"));
        assert_eq!(read(tree::LINKS, "edge-2"), None);
        assert_eq!(read(tree::META, "gate").as_deref(), Some("open"));
        // Once only: the keys no longer hold what the swaps expect.
        assert!(!store.compare_and_swap_all(&enroll("open")).unwrap());
    }

    #[test]
    fn sled_swaps_several_keys_at_once() {
        let dir = tempfile::tempdir().unwrap();
        swaps_are_all_or_none(&SledStore::open(dir.path()).unwrap());
    }

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
                    assert!(matches!(e, HubError::Locked(_)), "{e}");
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => panic!("{e}"),
            }
        };
        let all: Vec<serde_json::Value> = s.scan(tree::LINKS).unwrap();
        assert_eq!(all, vec![serde_json::json!({"cluster": "edge-1"})]);
        assert!(s.writable());
    }

    #[test]
    fn a_scan_goes_in_key_order_and_stops_at_a_record_that_does_not_decode() {
        let dir = tempfile::tempdir().unwrap();
        let s = SledStore::open(dir.path()).unwrap();
        for (key, raw) in [("c", "3"), ("a", "1"), ("b", "2")] {
            s.put_raw(tree::LINKS, key, raw.as_bytes()).unwrap();
        }
        let all: Vec<i64> = s.scan(tree::LINKS).unwrap();
        assert_eq!(all, vec![1, 2, 3]);
        s.put_raw(tree::LINKS, "b", b"not json").unwrap();
        let mut seen = Vec::new();
        let read = s.for_each_raw(tree::LINKS, &mut |key, raw| {
            seen.push(key.to_owned());
            decode::<i64>(tree::LINKS, key, raw).map(drop)
        });
        let err = read.unwrap_err().to_string();
        assert!(err.contains("links/b"), "{err}");
        assert_eq!(seen, ["a", "b"]);
        assert!(s.scan::<i64>(tree::LINKS).is_err());
    }

    fn mode(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::symlink_metadata(path)
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    }

    fn set_mode(path: &Path, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_new_data_dir_is_owner_only() {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("a/data");
        let _s = SledStore::open(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("db")), 0o700);
        assert_eq!(mode(&dir.join("db/conf")), 0o600);
        assert_eq!(mode(&dir.join("db/db")), 0o600);
    }

    #[test]
    fn an_existing_data_dir_is_made_owner_only_but_not_what_links_point_to() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::NamedTempFile::new().unwrap();
        set_mode(outside.path(), 0o644);
        set_mode(dir.path(), 0o755);
        let (file, sub) = (dir.path().join("ca.crt"), dir.path().join("old"));
        std::fs::write(&file, "x").unwrap();
        set_mode(&file, 0o644);
        std::fs::create_dir(&sub).unwrap();
        std::fs::write(sub.join("f"), "x").unwrap();
        set_mode(&sub.join("f"), 0o666);
        set_mode(&sub, 0o777);
        std::os::unix::fs::symlink(outside.path(), dir.path().join("link")).unwrap();

        let _s = SledStore::open(dir.path()).unwrap();
        assert_eq!(mode(dir.path()), 0o700);
        assert_eq!(mode(&file), 0o600);
        assert_eq!(mode(&sub), 0o700);
        assert_eq!(mode(&sub.join("f")), 0o600);
        assert_eq!(mode(outside.path()), 0o644);
    }
}
