//! Join tokens (an agent's first Register) and API tokens (users of the
//! embedded default, without an identity provider).
//!
//! A token is `<prefix>_<id>_<secret>`. The store keeps the id in clear and
//! only a SHA-256 of the secret, so a copy of the store cannot be replayed;
//! secrets are compared in constant time.
//!
//! Join-token reuse policy: a join token may be used by its own cluster any
//! number of times until it expires, so an agent pod that restarts before
//! saving its certificate can register again. Each use is counted.

use std::{path::Path, time::Duration};

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use otter_tunnel::Caller;
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;

use crate::{
    Result,
    store::{Store, StoreExt, tree},
    unix_now,
};

const JOIN_PREFIX: &str = "otj";
const API_PREFIX: &str = "ots";

/// Group of the admin token made on first start.
pub const ADMIN_GROUP: &str = "otterscale:admins";

fn sha256_hex(s: &str) -> String {
    hex::encode(ring::digest::digest(&ring::digest::SHA256, s.as_bytes()))
}

fn new_token(prefix: &str) -> (String, String, String) {
    let id = hex::encode(rand::random::<[u8; 8]>());
    let secret = URL_SAFE_NO_PAD.encode(rand::random::<[u8; 32]>());
    let token = format!("{prefix}_{id}_{secret}");
    (token, id, sha256_hex(&secret))
}

/// Splits a token into (id, secret) if it has the expected prefix and shape.
fn parse<'a>(prefix: &str, token: &'a str) -> Option<(&'a str, &'a str)> {
    let rest = token.strip_prefix(prefix)?.strip_prefix('_')?;
    let (id, secret) = rest.split_once('_')?;
    (id.len() == 16
        && id.bytes().all(|b| b.is_ascii_hexdigit())
        && !secret.is_empty()
        && secret.len() <= 64)
        .then_some((id, secret))
}

fn secret_matches(stored_hash: &str, secret: &str) -> bool {
    stored_hash
        .as_bytes()
        .ct_eq(sha256_hex(secret).as_bytes())
        .into()
}

/// A join token as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinTokenRecord {
    pub id: String,
    pub cluster: String,
    pub secret_sha256: String,
    pub created: i64,
    pub expires: i64,
    #[serde(default)]
    pub uses: u64,
    #[serde(default)]
    pub last_used: Option<i64>,
}

/// Why a join token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JoinTokenError {
    #[error("join token is malformed; copy it again from the agent manifest")]
    Malformed,
    #[error(
        "join token is unknown or its secret is wrong; get a new agent manifest with `otter agent-manifest`"
    )]
    Unknown,
    #[error("join token expired; get a new agent manifest with `otter agent-manifest`")]
    Expired,
    #[error(
        "join token was issued for cluster {0:?}, not this one; use the manifest made for this cluster"
    )]
    WrongCluster(String),
}

/// Mints a join token for `cluster`, valid for `ttl`.
pub fn mint_join_token(store: &dyn Store, cluster: &str, ttl: Duration) -> Result<String> {
    otter_pki::validate_cluster_name(cluster)?;
    let (token, id, secret_sha256) = new_token(JOIN_PREFIX);
    let now = unix_now();
    let rec = JoinTokenRecord {
        id: id.clone(),
        cluster: cluster.to_owned(),
        secret_sha256,
        created: now,
        expires: now + ttl.as_secs() as i64,
        uses: 0,
        last_used: None,
    };
    store.put(tree::JOIN_TOKENS, &id, &rec)?;
    Ok(token)
}

/// Checks a join token for `cluster` and counts the use.
pub fn use_join_token(
    store: &dyn Store,
    token: &str,
    cluster: &str,
) -> Result<Result<(), JoinTokenError>> {
    let Some((id, secret)) = parse(JOIN_PREFIX, token) else {
        return Ok(Err(JoinTokenError::Malformed));
    };
    let Some(mut rec) = store.get::<JoinTokenRecord>(tree::JOIN_TOKENS, id)? else {
        return Ok(Err(JoinTokenError::Unknown));
    };
    if !secret_matches(&rec.secret_sha256, secret) {
        return Ok(Err(JoinTokenError::Unknown));
    }
    let now = unix_now();
    if now >= rec.expires {
        return Ok(Err(JoinTokenError::Expired));
    }
    if rec.cluster != cluster {
        return Ok(Err(JoinTokenError::WrongCluster(rec.cluster)));
    }
    rec.uses += 1;
    rec.last_used = Some(now);
    store.put(tree::JOIN_TOKENS, id, &rec)?;
    Ok(Ok(()))
}

/// Removes join tokens that expired more than a day ago.
pub fn prune_join_tokens(store: &dyn Store) -> Result<usize> {
    let cutoff = unix_now() - 24 * 3600;
    let mut removed = 0;
    for rec in store.scan::<JoinTokenRecord>(tree::JOIN_TOKENS)? {
        if rec.expires < cutoff {
            store.delete(tree::JOIN_TOKENS, &rec.id)?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// An API token as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiTokenRecord {
    pub id: String,
    /// The user the token authenticates as.
    pub name: String,
    pub groups: Vec<String>,
    pub secret_sha256: String,
    pub created: i64,
}

/// Mints an API token for user `name` with `groups`.
pub fn mint_api_token(store: &dyn Store, name: &str, groups: &[String]) -> Result<String> {
    let (token, id, secret_sha256) = new_token(API_PREFIX);
    let rec = ApiTokenRecord {
        id: id.clone(),
        name: name.to_owned(),
        groups: groups.to_vec(),
        secret_sha256,
        created: unix_now(),
    };
    store.put(tree::API_TOKENS, &id, &rec)?;
    Ok(token)
}

/// The caller an API token authenticates, if it is valid.
pub fn verify_api_token(store: &dyn Store, token: &str) -> Result<Option<Caller>> {
    let Some((id, secret)) = parse(API_PREFIX, token) else {
        return Ok(None);
    };
    let Some(rec) = store.get::<ApiTokenRecord>(tree::API_TOKENS, id)? else {
        return Ok(None);
    };
    if !secret_matches(&rec.secret_sha256, secret) {
        return Ok(None);
    }
    Ok(Some(Caller {
        user: rec.name,
        groups: rec.groups,
        ..Default::default()
    }))
}

/// On first start (no API token yet) makes an admin token and writes it to
/// `<data dir>/admin-token`, readable by the owner only. Returns the token
/// when it was just made.
pub fn ensure_admin_token(store: &dyn Store, data_dir: &Path) -> Result<Option<String>> {
    if !store.scan_raw(tree::API_TOKENS)?.is_empty() {
        return Ok(None);
    }
    let token = mint_api_token(store, "admin", &[ADMIN_GROUP.to_owned()])?;
    let path = data_dir.join("admin-token");
    write_private(&path, &format!("{token}\n"))?;
    Ok(Some(token))
}

/// Writes a file only its owner can read.
pub fn write_private(path: &Path, contents: &str) -> Result<()> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(contents.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SledStore;

    #[test]
    fn join_tokens_are_checked_for_secret_expiry_and_cluster() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let token = mint_join_token(&store, "edge-1", Duration::from_secs(60)).unwrap();
        assert_eq!(use_join_token(&store, &token, "edge-1").unwrap(), Ok(()));
        assert_eq!(
            use_join_token(&store, &token, "edge-1").unwrap(),
            Ok(()),
            "reusable until expiry"
        );
        assert_eq!(
            use_join_token(&store, &token, "edge-2").unwrap(),
            Err(JoinTokenError::WrongCluster("edge-1".into()))
        );
        let forged = format!("{}x", &token[..token.len() - 1]);
        assert_eq!(
            use_join_token(&store, &forged, "edge-1").unwrap(),
            Err(JoinTokenError::Unknown)
        );
        assert_eq!(
            use_join_token(&store, "garbage", "edge-1").unwrap(),
            Err(JoinTokenError::Malformed)
        );
        let expired = mint_join_token(&store, "edge-1", Duration::ZERO).unwrap();
        assert_eq!(
            use_join_token(&store, &expired, "edge-1").unwrap(),
            Err(JoinTokenError::Expired)
        );
        let (_, id, _) = (0, parse(JOIN_PREFIX, &token).unwrap().0, 0);
        let rec: JoinTokenRecord = store.get(tree::JOIN_TOKENS, id).unwrap().unwrap();
        assert_eq!(rec.uses, 2);
        assert!(
            !rec.secret_sha256
                .contains(parse(JOIN_PREFIX, &token).unwrap().1)
        );
    }

    #[test]
    fn admin_token_is_made_once_and_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let token = ensure_admin_token(&store, dir.path())
            .unwrap()
            .expect("made on first start");
        assert!(ensure_admin_token(&store, dir.path()).unwrap().is_none());
        let caller = verify_api_token(&store, &token).unwrap().unwrap();
        assert_eq!(caller.user, "admin");
        assert!(
            verify_api_token(&store, &token.replace('_', "-"))
                .unwrap()
                .is_none()
        );
        let mode = std::fs::metadata(dir.path().join("admin-token"))
            .unwrap()
            .permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
    }
}
