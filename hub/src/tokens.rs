//! Join tokens (an agent's first Register) and API tokens (users of the
//! embedded default, without an identity provider).
//!
//! A token is `<prefix>_<id>_<secret>`. The store keeps the id in clear and
//! only a SHA-256 of the secret, so a copy of the store cannot be replayed;
//! secrets are compared in constant time.
//!
//! Join-token policy: a join token enrolls its cluster once. The Register
//! that uses it spends it (a compare-and-swap in the store, so two agents
//! racing with one token cannot both win); from then on the agent renews
//! with its certificate, never the token, and a token found later in the
//! agent's Secret, a manifest or a log enrolls nobody. A cluster that has a
//! link takes a join token only after an admin re-enrolled it, and only a
//! token authorized after that (see `link_service`).

use std::{path::Path, time::Duration};

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;

use crate::{
    Result,
    store::{Store, StoreExt, Swap, tree},
    tenancy::{Memberships, Role},
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
    /// The tenant whose admin minted it; the cluster joins that tenant.
    #[serde(default = "default_tenant")]
    pub tenant: String,
    pub secret_sha256: String,
    pub created: i64,
    pub expires: i64,
    #[serde(default)]
    pub uses: u64,
    #[serde(default)]
    pub last_used: Option<i64>,
    /// When an admin authorized it: the minting, or for a token a manifest
    /// URL handed out, when the URL was minted. A re-enrolled cluster
    /// takes only tokens authorized after its re-enrollment. Records of
    /// older hubs read 0: before any re-enrollment.
    #[serde(default)]
    pub authorized: i64,
    /// The agent that enrolled with it.
    #[serde(default)]
    pub used_by: Option<String>,
    /// Labels the link gets at enrollment.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
}

fn default_tenant() -> String {
    crate::tenancy::DEFAULT_TENANT.to_owned()
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
    #[error(
        "join token was already used: it enrolls a cluster once, and the agent then renews with its certificate; to enroll this cluster again, an admin runs `otter re-enroll <cluster>` and applies a new manifest"
    )]
    Used,
}

/// Mints a join token for `cluster` of `tenant`, valid for `ttl`,
/// authorized now.
pub fn mint_join_token(
    store: &dyn Store,
    cluster: &str,
    tenant: &str,
    ttl: Duration,
) -> Result<String> {
    mint_join_token_authorized(store, cluster, tenant, ttl, unix_now(), &Default::default())
}

/// Like [`mint_join_token`], for a token an admin authorized at
/// `authorized` (unix seconds), a manifest URL minted then, that gives the
/// link `labels`.
pub fn mint_join_token_authorized(
    store: &dyn Store,
    cluster: &str,
    tenant: &str,
    ttl: Duration,
    authorized: i64,
    labels: &std::collections::BTreeMap<String, String>,
) -> Result<String> {
    otter_pki::validate_cluster_name(cluster)?;
    let (token, id, secret_sha256) = new_token(JOIN_PREFIX);
    let now = unix_now();
    let rec = JoinTokenRecord {
        id: id.clone(),
        cluster: cluster.to_owned(),
        tenant: tenant.to_owned(),
        secret_sha256,
        created: now,
        expires: now + ttl.as_secs() as i64,
        uses: 0,
        last_used: None,
        authorized,
        used_by: None,
        labels: labels.clone(),
    };
    store.put(tree::JOIN_TOKENS, &id, &rec)?;
    Ok(token)
}

/// A join token that is valid for its cluster and not yet spent.
#[derive(Debug)]
pub struct CheckedJoinToken {
    pub record: JoinTokenRecord,
    /// The record as read, for the compare-and-swap that spends it.
    raw: Vec<u8>,
}

/// Checks a join token for `cluster` without spending it.
///
/// `retry_by` names the agent of a Register that may be retrying one whose
/// outcome it never learnt: the caller passes it only when the cluster's
/// link never carried a tunnel. A token that agent spent is then accepted
/// again. Without this, a spend the store applied after the Register had
/// given up on it (a write that timed out while etcd had no quorum, then
/// committed when the quorum came back) would leave the agent with a spent
/// token and no certificate.
pub fn check_join_token(
    store: &dyn Store,
    token: &str,
    cluster: &str,
    retry_by: Option<&str>,
) -> Result<Result<CheckedJoinToken, JoinTokenError>> {
    let Some((id, secret)) = parse(JOIN_PREFIX, token) else {
        return Ok(Err(JoinTokenError::Malformed));
    };
    let Some(raw) = store.get_raw(tree::JOIN_TOKENS, id)? else {
        return Ok(Err(JoinTokenError::Unknown));
    };
    let record: JoinTokenRecord = crate::store::decode(tree::JOIN_TOKENS, id, &raw)?;
    if !secret_matches(&record.secret_sha256, secret) {
        return Ok(Err(JoinTokenError::Unknown));
    }
    if unix_now() >= record.expires {
        return Ok(Err(JoinTokenError::Expired));
    }
    if record.cluster != cluster {
        return Ok(Err(JoinTokenError::WrongCluster(record.cluster)));
    }
    let own_retry = retry_by.is_some_and(|a| record.used_by.as_deref() == Some(a));
    if record.uses > 0 && !own_retry {
        return Ok(Err(JoinTokenError::Used));
    }
    Ok(Ok(CheckedJoinToken { record, raw }))
}

impl CheckedJoinToken {
    /// The swap that spends this token for `agent_id`, to commit with what
    /// it pays for (an enrollment): it applies only if no other Register
    /// spent the token since it was checked.
    pub fn spend(&self, agent_id: &str) -> Result<Swap> {
        let mut record = self.record.clone();
        record.uses += 1;
        record.last_used = Some(unix_now());
        record.used_by = Some(agent_id.to_owned());
        let new = crate::store::encode(tree::JOIN_TOKENS, &record.id, &record)?;
        Ok(Swap::new(
            tree::JOIN_TOKENS,
            &record.id,
            Some(self.raw.clone()),
            Some(new),
        ))
    }
}

/// Removes join tokens that expired more than a day ago (kept that long
/// so an agent late with one is told "expired", not "unknown"), and the
/// fetch counts of manifest URLs that expired.
pub fn prune_join_tokens(store: &dyn Store) -> Result<usize> {
    let now = unix_now();
    let cutoff = now - 24 * 3600;
    let mut removed = 0;
    for rec in store.scan::<JoinTokenRecord>(tree::JOIN_TOKENS)? {
        if rec.expires < cutoff {
            store.delete(tree::JOIN_TOKENS, &rec.id)?;
            removed += 1;
        }
    }
    for (key, raw) in store.scan_raw(tree::MANIFEST_URLS)? {
        let expired = serde_json::from_slice::<crate::manifest::ManifestUrlRecord>(&raw)
            .map_or(true, |r| r.expires < now);
        if expired {
            store.delete(tree::MANIFEST_URLS, &key)?;
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
    /// The tenants the user reaches, with the role in each.
    #[serde(default)]
    pub tenants: Memberships,
    /// A hub operator: manages tenants, reaches no cluster by this alone.
    #[serde(default)]
    pub operator: bool,
    /// Unix seconds; none: until revoked.
    #[serde(default)]
    pub expires: Option<i64>,
    /// Who minted it.
    #[serde(default)]
    pub created_by: String,
    /// 0 for records of hubs from before tenancy (see [`migrate_api_tokens`]).
    #[serde(default)]
    pub schema: u32,
}

/// What a new API token says about its user.
#[derive(Debug, Clone, Default)]
pub struct TokenSpec {
    pub user: String,
    pub groups: Vec<String>,
    pub tenants: Memberships,
    pub operator: bool,
    pub ttl: Option<Duration>,
    pub created_by: String,
}

impl TokenSpec {
    /// A member of `tenant`.
    pub fn member(user: &str, groups: &[String], tenant: &str) -> Self {
        TokenSpec {
            user: user.to_owned(),
            groups: groups.to_vec(),
            tenants: [(tenant.to_owned(), Role::Member)].into(),
            ..Default::default()
        }
    }
}

/// Mints an API token; returns the token and its id.
pub fn mint_api_token(store: &dyn Store, spec: &TokenSpec) -> Result<(String, String)> {
    let (token, id, secret_sha256) = new_token(API_PREFIX);
    let now = unix_now();
    let rec = ApiTokenRecord {
        id: id.clone(),
        name: spec.user.clone(),
        groups: spec.groups.clone(),
        secret_sha256,
        created: now,
        tenants: spec.tenants.clone(),
        operator: spec.operator,
        expires: spec.ttl.map(|t| next_second() + t.as_secs() as i64),
        created_by: spec.created_by.clone(),
        schema: 1,
    };
    store.put(tree::API_TOKENS, &id, &rec)?;
    Ok((token, id))
}

/// The record of a valid, unexpired API token.
pub fn verify_api_token(store: &dyn Store, token: &str) -> Result<Option<ApiTokenRecord>> {
    let Some((id, secret)) = parse(API_PREFIX, token) else {
        return Ok(None);
    };
    let Some(mut rec) = store.get::<ApiTokenRecord>(tree::API_TOKENS, id)? else {
        return Ok(None);
    };
    if !secret_matches(&rec.secret_sha256, secret) {
        return Ok(None);
    }
    if rec.expires.is_some_and(|e| unix_now() >= e) {
        return Ok(None);
    }
    // A membership counts only in the tenant it was given in: one deleted,
    // or deleted and made again under its name, is not the same tenant.
    let mut kept = Memberships::new();
    for (tenant, role) in std::mem::take(&mut rec.tenants) {
        if crate::tenancy::tenant(store, &tenant)?.is_some_and(|t| t.created <= rec.created) {
            kept.insert(tenant, role);
        }
    }
    rec.tenants = kept;
    Ok(Some(rec))
}

/// Revokes an API token by id; whether it existed.
pub fn revoke_api_token(store: &dyn Store, id: &str) -> Result<bool> {
    let existed = store.get_raw(tree::API_TOKENS, id)?.is_some();
    store.delete(tree::API_TOKENS, id)?;
    Ok(existed)
}

/// API tokens of a hub from before tenancy: the admin group's become hub
/// operators and admins of tenant `default` (so the first-start admin
/// token keeps reaching what it reached), every other one a member of
/// `default`.
pub fn migrate_api_tokens(store: &dyn Store, admin_group: &str) -> Result<()> {
    for (id, raw) in store.scan_raw(tree::API_TOKENS)? {
        let Ok(mut rec) = serde_json::from_slice::<ApiTokenRecord>(&raw) else {
            continue;
        };
        if rec.schema != 0 {
            continue;
        }
        let admin = rec.groups.iter().any(|g| g == admin_group);
        rec.groups.retain(|g| g != admin_group);
        rec.operator = admin;
        let role = if admin { Role::Admin } else { Role::Member };
        rec.tenants = [(crate::tenancy::DEFAULT_TENANT.to_owned(), role)].into();
        // Memberships count from the token's creation on.
        rec.created = rec.created.max(
            crate::tenancy::tenant(store, crate::tenancy::DEFAULT_TENANT)?.map_or(0, |t| t.created),
        );
        rec.schema = 1;
        store.replace(tree::API_TOKENS, &id, &raw, &rec)?;
    }
    Ok(())
}

/// On first start (no API token yet) makes an admin token (a hub operator
/// and an admin of tenant `default`) and writes it to
/// `<data dir>/admin-token`, readable by the owner only. Returns the token
/// when it was just made.
pub fn ensure_admin_token(store: &dyn Store, data_dir: &Path) -> Result<Option<String>> {
    if !store.scan_raw(tree::API_TOKENS)?.is_empty() {
        return Ok(None);
    }
    // Replicas starting together on an empty shared store: the one whose
    // swap of this marker wins mints it. (A store whose every token was
    // revoked gets a new one at the next start, as before.)
    let marker = store.get_raw(tree::META, "first-admin-token")?;
    let mine = hex::encode(rand::random::<[u8; 16]>());
    let mine = crate::store::encode(tree::META, "first-admin-token", &mine)?;
    if !store.compare_and_swap_raw(
        tree::META,
        "first-admin-token",
        marker.as_deref(),
        Some(&mine),
    )? {
        return Ok(None);
    }
    let spec = TokenSpec {
        user: "admin".to_owned(),
        tenants: [(crate::tenancy::DEFAULT_TENANT.to_owned(), Role::Admin)].into(),
        operator: true,
        created_by: "hub".to_owned(),
        ..Default::default()
    };
    let (token, _) = mint_api_token(store, &spec)?;
    let path = data_dir.join("admin-token");
    write_private(&path, &format!("{token}\n"))?;
    Ok(Some(token))
}

/// Writes a file only its owner can read.
pub fn write_private(path: &Path, contents: &str) -> Result<()> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    // Written beside it, then renamed over it: a reader (an agent starting
    // with `--hub-ca-file`, a script waiting for `admin-token`) sees the
    // old contents or the new, never a part.
    let mut partial = path.as_os_str().to_owned();
    partial.push(format!(".{}.partial", std::process::id()));
    let partial = std::path::PathBuf::from(partial);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&partial)?;
    f.write_all(contents.as_bytes())?;
    drop(f);
    std::fs::rename(&partial, path)?;
    Ok(())
}

/// The Unix second after the one under way. Expiry is kept and checked in
/// whole seconds: counted from the second under way, a token of one second
/// could live a millisecond (a test's did, on a loaded machine); counted
/// from the next, it lives at least its time to live, and less than a
/// second more.
fn next_second() -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    now.as_secs() as i64 + 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SledStore;

    #[test]
    fn join_tokens_are_checked_for_secret_expiry_and_cluster_and_spent_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let token = mint_join_token(&store, "edge-1", "default", Duration::from_secs(60)).unwrap();
        let check = |t: &str, cluster: &str| {
            check_join_token(&store, t, cluster, None)
                .unwrap()
                .map(|_| ())
        };
        assert_eq!(
            check(&token, "edge-2"),
            Err(JoinTokenError::WrongCluster("edge-1".into()))
        );
        let forged = format!("{}x", &token[..token.len() - 1]);
        assert_eq!(check(&forged, "edge-1"), Err(JoinTokenError::Unknown));
        assert_eq!(check("garbage", "edge-1"), Err(JoinTokenError::Malformed));
        let expired = mint_join_token(&store, "edge-1", "default", Duration::ZERO).unwrap();
        assert_eq!(check(&expired, "edge-1"), Err(JoinTokenError::Expired));

        // Two Registers check the same token; only the first to spend it wins.
        let first = check_join_token(&store, &token, "edge-1", None)
            .unwrap()
            .unwrap();
        let second = check_join_token(&store, &token, "edge-1", None)
            .unwrap()
            .unwrap();
        // Spent only if no one spent it since it was checked.
        let spend = |c: CheckedJoinToken, by: &str| {
            store.compare_and_swap_all(&[c.spend(by).unwrap()]).unwrap()
        };
        assert!(spend(first, "agent-a"));
        assert!(!spend(second, "rogue"));
        assert_eq!(check(&token, "edge-1"), Err(JoinTokenError::Used));
        // The agent that spent it, retrying a Register it never heard back
        // from, may spend it again; nobody else may.
        let retry = |by: &str| check_join_token(&store, &token, "edge-1", Some(by)).unwrap();
        assert_eq!(retry("rogue").map(|_| ()), Err(JoinTokenError::Used));
        let again = retry("agent-a").expect("the spender's retry");
        assert!(spend(again, "agent-a"));
        let id = parse(JOIN_PREFIX, &token).unwrap().0;
        let rec: JoinTokenRecord = store.get(tree::JOIN_TOKENS, id).unwrap().unwrap();
        assert_eq!((rec.uses, rec.used_by.as_deref()), (2, Some("agent-a")));
        assert!(
            !rec.secret_sha256
                .contains(parse(JOIN_PREFIX, &token).unwrap().1)
        );
    }

    #[test]
    fn pruning_removes_long_expired_tokens_and_expired_url_counts() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let live = mint_join_token(&store, "edge-1", "default", Duration::from_secs(60)).unwrap();
        let old = mint_join_token(&store, "edge-1", "default", Duration::ZERO).unwrap();
        let old_id = parse(JOIN_PREFIX, &old).unwrap().0;
        let mut rec: JoinTokenRecord = store.get(tree::JOIN_TOKENS, old_id).unwrap().unwrap();
        rec.expires -= 2 * 24 * 3600;
        store.put(tree::JOIN_TOKENS, old_id, &rec).unwrap();
        let url = |expires| crate::manifest::ManifestUrlRecord {
            fetches: 3,
            expires,
        };
        store
            .put(tree::MANIFEST_URLS, "spent", &url(unix_now() - 1))
            .unwrap();
        store
            .put(tree::MANIFEST_URLS, "open", &url(unix_now() + 60))
            .unwrap();
        assert_eq!(prune_join_tokens(&store).unwrap(), 2);
        let live_id = parse(JOIN_PREFIX, &live).unwrap().0;
        let left: Vec<String> = store
            .scan_raw(tree::JOIN_TOKENS)
            .unwrap()
            .into_iter()
            .chain(store.scan_raw(tree::MANIFEST_URLS).unwrap())
            .map(|(k, _)| k)
            .collect();
        assert_eq!(left, [live_id, "open"]);
    }

    /// A token of one second lives at least a second, whenever in the
    /// second it is minted.
    #[test]
    fn an_expiring_token_lives_at_least_its_time_to_live() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let spec = TokenSpec {
            user: "brief".into(),
            ttl: Some(Duration::from_secs(1)),
            ..Default::default()
        };
        let (_, id) = mint_api_token(&store, &spec).unwrap();
        let rec: ApiTokenRecord = store.get(tree::API_TOKENS, &id).unwrap().unwrap();
        let expires = rec.expires.expect("an expiry") as f64;
        assert!(
            expires >= before + 1.0,
            "expires {expires}, minted after {before}"
        );
        assert!(
            expires < before + 2.0 + 0.5,
            "expires {expires}, minted after {before}"
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
        crate::tenancy::migrate(&store).unwrap();
        let caller = verify_api_token(&store, &token).unwrap().unwrap();
        assert_eq!(caller.name, "admin");
        assert!(caller.operator);
        assert_eq!(
            caller.tenants,
            Memberships::from([("default".to_owned(), Role::Admin)])
        );
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
