//! Encryption at rest of the hub's secrets: the CA private keys, the
//! manifest-URL signing key and the QUIC reset secret, all in the store's
//! `meta` tree.
//!
//! The data directory is already private to the hub's user; sealing is for
//! where its files go without the hub: backups, volume snapshots, a disk
//! taken out of a machine. With `--store-key-file` every value of `meta` is
//! kept as AES-256-GCM ciphertext (a fresh nonce each write; the tree and
//! key as associated data, so a sealed value moved under another key does
//! not open), and values an earlier start wrote in the clear are sealed at
//! start. The other trees hold hashes and public data and stay as they are.
//!
//! A sealed store started without the key, or with another key, refuses to
//! start and says so.

use std::path::Path;

use base64::Engine;
use ring::{
    aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey},
    rand::{SecureRandom, SystemRandom},
};

use crate::{
    HubError, Result,
    store::{Store, Swap, tree},
};

/// What a sealed value starts with; then the nonce and the ciphertext.
const PREFIX: &[u8] = b"otter-sealed:v1:";

/// A store whose `meta` values are sealed with a key from a file.
pub struct SealedStore<S> {
    inner: S,
    key: LessSafeKey,
}

impl<S> std::fmt::Debug for SealedStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealedStore")
    }
}

/// The 32-byte key in `path`: raw, hex (64 characters) or base64.
pub fn read_key(path: &Path) -> Result<[u8; 32]> {
    let bytes = std::fs::read(path)
        .map_err(|e| HubError::Config(format!("store key {}: {e}", path.display())))?;
    let text = std::str::from_utf8(&bytes).map(str::trim).unwrap_or("");
    let key = if bytes.len() == 32 {
        bytes
    } else if let Ok(k) = hex::decode(text) {
        k
    } else {
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .unwrap_or_default()
    };
    key.try_into().map_err(|_| {
        HubError::Config(format!(
            "store key {} must hold 32 random bytes (raw, hex or base64), as `head -c 32 /dev/urandom` makes",
            path.display()
        ))
    })
}

fn is_sealed(raw: &[u8]) -> bool {
    raw.starts_with(PREFIX)
}

/// Refuses a store whose secrets are sealed when no key was given.
pub fn check_unsealed(store: &dyn Store) -> Result<()> {
    if store
        .scan_raw(tree::META)?
        .iter()
        .any(|(_, v)| is_sealed(v))
    {
        return Err(HubError::Config(
            "the store's secrets are sealed: start the hub with --store-key-file and the key they were sealed with".into(),
        ));
    }
    Ok(())
}

impl<S: Store> SealedStore<S> {
    /// Wraps `inner`, sealing with `key`: values written in the clear
    /// before are sealed now, and every sealed one must open with `key`.
    pub fn new(inner: S, key: &[u8; 32]) -> Result<Self> {
        let key = LessSafeKey::new(
            UnboundKey::new(&AES_256_GCM, key)
                .map_err(|_| HubError::Config("store key rejected".into()))?,
        );
        let store = Self { inner, key };
        for (k, raw) in store.inner.scan_raw(tree::META)? {
            if is_sealed(&raw) {
                store.unseal(tree::META, &k, &raw)?;
            } else {
                let sealed = store.seal(tree::META, &k, &raw)?;
                store.inner.put_raw(tree::META, &k, &sealed)?;
            }
        }
        store.inner.flush()?;
        Ok(store)
    }

    fn seal(&self, tree: &str, key: &str, value: &[u8]) -> Result<Vec<u8>> {
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| seal_err(tree, key, "no randomness for a nonce"))?;
        let mut data = value.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(format!("{tree}/{key}").as_bytes()),
                &mut data,
            )
            .map_err(|_| seal_err(tree, key, "cannot seal"))?;
        Ok([PREFIX, &nonce, &data].concat())
    }

    fn unseal(&self, tree: &str, key: &str, raw: &[u8]) -> Result<Vec<u8>> {
        let body = raw
            .strip_prefix(PREFIX)
            .filter(|b| b.len() >= NONCE_LEN)
            .ok_or_else(|| seal_err(tree, key, "not sealed"))?;
        let (nonce, sealed) = body.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce)
            .map_err(|_| seal_err(tree, key, "bad nonce"))?;
        let mut data = sealed.to_vec();
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(format!("{tree}/{key}").as_bytes()), &mut data)
            .map_err(|_| {
                HubError::Config(format!(
                    "the store key does not open {tree}/{key}: start the hub with the key the store was sealed with"
                ))
            })?;
        Ok(plain.to_vec())
    }

    fn sealed_tree(tree: &str) -> bool {
        tree == tree::META
    }
}

impl<S: Store> Store for SealedStore<S> {
    fn get_raw(&self, tree: &str, key: &str) -> Result<Option<Vec<u8>>> {
        let raw = self.inner.get_raw(tree, key)?;
        match raw {
            Some(raw) if Self::sealed_tree(tree) => Ok(Some(self.unseal(tree, key, &raw)?)),
            other => Ok(other),
        }
    }

    fn put_raw(&self, tree: &str, key: &str, value: &[u8]) -> Result<()> {
        if Self::sealed_tree(tree) {
            return self.inner.put_raw(tree, key, &self.seal(tree, key, value)?);
        }
        self.inner.put_raw(tree, key, value)
    }

    fn delete(&self, tree: &str, key: &str) -> Result<()> {
        self.inner.delete(tree, key)
    }

    fn compare_and_swap_raw(
        &self,
        tree: &str,
        key: &str,
        old: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<bool> {
        if !Self::sealed_tree(tree) {
            return self.inner.compare_and_swap_raw(tree, key, old, new);
        }
        // Sealed values differ on every write: compare the plain text, then
        // swap against the stored ciphertext.
        let stored = self.inner.get_raw(tree, key)?;
        let plain = stored
            .as_deref()
            .map(|raw| self.unseal(tree, key, raw))
            .transpose()?;
        if plain.as_deref() != old {
            return Ok(false);
        }
        let new = new.map(|v| self.seal(tree, key, v)).transpose()?;
        self.inner
            .compare_and_swap_raw(tree, key, stored.as_deref(), new.as_deref())
    }

    fn compare_and_swap_all(&self, swaps: &[Swap]) -> Result<bool> {
        // A sealed key is compared in plain text, as in
        // `compare_and_swap_raw`, and swapped against its ciphertext.
        let mut sealed = Vec::with_capacity(swaps.len());
        for s in swaps {
            if !Self::sealed_tree(&s.tree) {
                sealed.push(s.clone());
                continue;
            }
            let stored = self.inner.get_raw(&s.tree, &s.key)?;
            let plain = stored
                .as_deref()
                .map(|raw| self.unseal(&s.tree, &s.key, raw))
                .transpose()?;
            if plain != s.old {
                return Ok(false);
            }
            let new = if s.checks_only() {
                stored.clone()
            } else {
                s.new
                    .as_deref()
                    .map(|v| self.seal(&s.tree, &s.key, v))
                    .transpose()?
            };
            sealed.push(Swap {
                old: stored,
                new,
                ..s.clone()
            });
        }
        self.inner.compare_and_swap_all(&sealed)
    }

    fn scan_raw(&self, tree: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let all = self.inner.scan_raw(tree)?;
        if !Self::sealed_tree(tree) {
            return Ok(all);
        }
        all.into_iter()
            .map(|(k, raw)| {
                let v = self.unseal(tree, &k, &raw)?;
                Ok((k, v))
            })
            .collect()
    }

    fn for_each_raw(
        &self,
        tree: &str,
        visit: &mut dyn FnMut(&str, &[u8]) -> Result<()>,
    ) -> Result<()> {
        if !Self::sealed_tree(tree) {
            return self.inner.for_each_raw(tree, visit);
        }
        // Unsealing makes a copy anyway.
        for (key, value) in self.scan_raw(tree)? {
            visit(&key, &value)?;
        }
        Ok(())
    }

    fn put_leased(&self, tree: &str, key: &str, value: &[u8]) -> Result<()> {
        // Never a sealed tree: routing records hold no secret.
        self.inner.put_leased(tree, key, value)
    }

    fn compare_and_swap_leased(
        &self,
        tree: &str,
        key: &str,
        old: Option<&[u8]>,
        new: &[u8],
    ) -> Result<bool> {
        // Never a sealed tree, as above.
        self.inner.compare_and_swap_leased(tree, key, old, new)
    }

    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.inner.changes()
    }

    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    fn writable(&self) -> bool {
        self.inner.writable()
    }

    fn version(&self, tree: &str) -> Option<u64> {
        self.inner.version(tree)
    }

    fn stamp(&self, tree: &str, key: &str) -> Option<i64> {
        self.inner.stamp(tree, key)
    }
}

/// A record that could not be sealed or opened, and why.
fn seal_err(tree: &str, key: &str, why: &'static str) -> HubError {
    HubError::Store(crate::store::StoreError::Sealed {
        at: format!("{tree}/{key}"),
        why,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{SledStore, StoreExt};

    #[test]
    fn sealed_swaps_several_keys_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let sealed = SealedStore::new(SledStore::open(dir.path()).unwrap(), &[7u8; 32]).unwrap();
        crate::store::tests::swaps_are_all_or_none(&sealed);
        // The gate, only checked, is still sealed as it was written.
        let raw = sealed.inner.get_raw(tree::META, "gate").unwrap().unwrap();
        assert!(is_sealed(&raw));
    }

    #[test]
    fn secrets_are_sealed_at_rest_and_open_only_with_their_key() {
        let dir = tempfile::tempdir().unwrap();
        let key = [7u8; 32];
        {
            // Written in the clear by a hub without a key...
            let plain = SledStore::open(dir.path()).unwrap();
            plain
                .put(tree::META, "ca", &"-----BEGIN PRIVATE KEY----- secret")
                .unwrap();
            plain.put(tree::LINKS, "edge-1", &"public").unwrap();
            check_unsealed(&plain).unwrap();
            // ...and sealed when one starts with a key.
            let sealed = SealedStore::new(plain, &key).unwrap();
            assert_eq!(
                sealed.get::<String>(tree::META, "ca").unwrap().unwrap(),
                "-----BEGIN PRIVATE KEY----- secret"
            );
            sealed.put(tree::META, "manifest-url-key", &"abc").unwrap();
            assert_eq!(sealed.scan_raw(tree::META).unwrap().len(), 2);
            let opened: Vec<String> = sealed.scan(tree::META).unwrap();
            assert!(opened.contains(&"abc".to_owned()), "{opened:?}");
            assert!(
                sealed
                    .compare_and_swap_raw(
                        tree::META,
                        "manifest-url-key",
                        Some(b"\"abc\""),
                        Some(b"\"def\"")
                    )
                    .unwrap()
            );
            assert!(
                !sealed
                    .compare_and_swap_raw(
                        tree::META,
                        "manifest-url-key",
                        Some(b"\"abc\""),
                        Some(b"\"x\"")
                    )
                    .unwrap()
            );
            let raw = sealed.inner.get_raw(tree::META, "ca").unwrap().unwrap();
            assert!(is_sealed(&raw));
            assert!(!String::from_utf8_lossy(&raw).contains("PRIVATE KEY"));
            // Other trees are left as they are.
            assert_eq!(
                sealed
                    .inner
                    .get_raw(tree::LINKS, "edge-1")
                    .unwrap()
                    .unwrap(),
                b"\"public\""
            );
            // Without the key the store is refused; with another key too.
            assert!(check_unsealed(&sealed.inner).is_err());
            let SealedStore { inner, .. } = sealed;
            let wrong = SealedStore::new(inner, &[8u8; 32]).unwrap_err();
            assert!(wrong.to_string().contains("does not open"), "{wrong}");
        }
    }

    #[test]
    fn keys_are_read_raw_hex_or_base64() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        for content in [
            vec![1u8; 32],
            hex::encode([1u8; 32]).into_bytes(),
            format!(
                "{}\n",
                base64::engine::general_purpose::STANDARD.encode([1u8; 32])
            )
            .into_bytes(),
        ] {
            std::fs::write(&path, content).unwrap();
            assert_eq!(read_key(&path).unwrap(), [1u8; 32]);
        }
        std::fs::write(&path, "too short").unwrap();
        assert!(
            read_key(&path)
                .unwrap_err()
                .to_string()
                .contains("32 random bytes")
        );
    }
}
