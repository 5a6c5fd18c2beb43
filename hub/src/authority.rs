//! The hub CA, created on first start and kept in the store, the server
//! certificate of the hub's listeners, and CA rotation.
//!
//! Rotation goes in three steps, each refused while it would strand an
//! agent (unless forced):
//!
//! 1. **stage**: a new CA is made and trusted next to the active one. Agents
//!    learn the pair (the bundle) when they register or renew; the hub asks
//!    every connected agent to renew at once.
//! 2. **activate**: once every link has been told to trust the new CA (at a
//!    Register since staging), the new CA becomes the active one: it signs the hub's server
//!    certificate and new agent certificates. The old CA stays trusted for
//!    the agent certificates it signed.
//! 3. **finish**: once every link holds a certificate from the new CA, the
//!    old one is dropped.
//!
//! The listeners' TLS is swapped in place ([`otter_pki::live::LiveTls`]):
//! no restart, no tunnel dropped.

use std::{
    path::PathBuf,
    sync::{Arc, Mutex, RwLock},
};

use otter_pki::{CertificateAuthority, live::LiveTls};
use serde::{Deserialize, Serialize};

use crate::{
    HubError, Result,
    link_service::LinkRecord,
    store::{Store, StoreExt, tree},
};

#[derive(Serialize, Deserialize)]
struct CaRecord {
    cert_pem: String,
    key_pem: String,
    created: i64,
}

impl CaRecord {
    fn of(ca: &CertificateAuthority) -> Self {
        CaRecord {
            cert_pem: ca.cert_pem().to_owned(),
            key_pem: ca.key_pem().to_owned(),
            created: crate::unix_now(),
        }
    }

    fn load(&self) -> Result<CertificateAuthority> {
        Ok(CertificateAuthority::from_pem(
            &self.cert_pem,
            &self.key_pem,
        )?)
    }
}

/// Where a rotation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// One CA.
    Steady,
    /// A new CA is trusted, not yet signing.
    Staged,
    /// The new CA signs; the old one is still trusted.
    Activated,
}

/// The rotation record of hubs before the CAs were kept as one record:
/// read once, to move to [`SetRecord`].
#[derive(Serialize, Deserialize)]
struct RotationRecord {
    phase: Phase,
    /// The staged CA (staged) or the previous one (activated).
    other: CaRecord,
    /// Unix seconds of the last step.
    since: i64,
}

/// Every CA of the hub and where the rotation stands, as one record: a
/// rotation step replaces it by one compare-and-swap, so two replicas (or
/// two admins) taking a step at once cannot both succeed, and a replica
/// never sees half a step.
#[derive(Serialize, Deserialize)]
struct SetRecord {
    active: CaRecord,
    other: Option<CaRecord>,
    phase: Phase,
    since: i64,
}

impl SetRecord {
    fn of(set: &CaSet) -> Self {
        SetRecord {
            active: CaRecord::of(&set.active),
            other: set.other.as_ref().map(CaRecord::of),
            phase: set.phase,
            since: set.since,
        }
    }

    fn load(&self) -> Result<CaSet> {
        Ok(CaSet {
            active: self.active.load()?,
            other: self.other.as_ref().map(CaRecord::load).transpose()?,
            phase: self.phase,
            since: self.since,
        })
    }
}

/// The CAs at one moment.
#[derive(Debug)]
pub struct CaSet {
    /// Signs agent and server certificates.
    pub active: CertificateAuthority,
    /// Trusted besides the active CA during a rotation.
    pub other: Option<CertificateAuthority>,
    pub phase: Phase,
    /// Unix seconds of the last rotation step.
    pub since: i64,
}

impl CaSet {
    /// Fingerprints of every trusted CA, the active one first.
    pub fn fingerprints(&self) -> Vec<String> {
        std::iter::once(&self.active)
            .chain(self.other.as_ref())
            .map(|c| c.fingerprint())
            .collect()
    }

    /// Every trusted CA, the active one first: what agents and clients
    /// should trust (its first certificate names the active CA).
    pub fn bundle_pem(&self) -> String {
        let mut pem = self.active.cert_pem().to_owned();
        if let Some(other) = &self.other {
            if !pem.ends_with('\n') {
                pem.push('\n');
            }
            pem.push_str(other.cert_pem());
        }
        pem
    }
}

/// The record of every CA.
const CA_SET: &str = "ca.set";
/// What hubs before [`CA_SET`] kept: the active CA and the rotation.
const LEGACY_CA: &str = "ca";
const LEGACY_ROTATION: &str = "ca.rotation";

/// A rotation step that would strand agents: the links that are not ready.
#[derive(Debug)]
pub struct NotReady {
    pub step: &'static str,
    pub clusters: Vec<String>,
}

/// The hub's CAs and the TLS of its listeners, which follow them.
pub struct Authority {
    set: RwLock<Arc<CaSet>>,
    /// The stored record `set` was made from: another replica's step shows
    /// as a different one.
    record: Mutex<Vec<u8>>,
    /// CA sets taken up since the start, and how many of them were
    /// acted upon (see [`Authority::take_change`]).
    adopted: std::sync::atomic::AtomicU64,
    handled: std::sync::atomic::AtomicU64,
    live: Arc<LiveTls>,
    server_names: Vec<String>,
    data_dir: PathBuf,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority")
            .field("phase", &self.current().phase)
            .finish()
    }
}

/// The stored record of every CA, made on first start (from a former
/// hub's records when there are some). Replicas starting together on a
/// shared store agree on one.
fn stored(store: &dyn Store) -> Result<(Vec<u8>, SetRecord)> {
    let parse = |raw: Vec<u8>| -> Result<(Vec<u8>, SetRecord)> {
        let record = crate::store::decode(tree::META, CA_SET, &raw)?;
        Ok((raw, record))
    };
    if let Some(raw) = store.get_raw(tree::META, CA_SET)? {
        return parse(raw);
    }
    let legacy = store.get::<CaRecord>(tree::META, LEGACY_CA)?;
    let moved = legacy.is_some();
    let fresh = match legacy {
        Some(active) => {
            let rotation = store.get::<RotationRecord>(tree::META, LEGACY_ROTATION)?;
            SetRecord {
                active,
                phase: rotation.as_ref().map_or(Phase::Steady, |r| r.phase),
                since: rotation.as_ref().map_or(0, |r| r.since),
                other: rotation.map(|r| r.other),
            }
        }
        None => {
            let ca = CertificateAuthority::generate("OtterScale Link hub CA")?;
            SetRecord {
                active: CaRecord::of(&ca),
                other: None,
                phase: Phase::Steady,
                since: 0,
            }
        }
    };
    let raw = crate::store::encode(tree::META, CA_SET, &fresh)?;
    if store.compare_and_swap_raw(tree::META, CA_SET, None, Some(&raw))? {
        if moved {
            // The keys live in the new record only from now on.
            store.delete(tree::META, LEGACY_ROTATION)?;
            store.delete(tree::META, LEGACY_CA)?;
            tracing::info!("moved the hub CAs to one record");
        } else {
            tracing::info!(fingerprint = %fresh.active.load()?.fingerprint(), "created hub CA");
        }
        return Ok((raw, fresh));
    }
    // Another replica made it first.
    let raw = store.get_raw(tree::META, CA_SET)?.ok_or_else(|| {
        HubError::Store(crate::store::StoreError::Vanished {
            at: format!("{}/{CA_SET}", tree::META),
        })
    })?;
    parse(raw)
}

impl Authority {
    /// Loads the CAs from the store, creating the first on first start
    /// (keeping it is what lets agents reconnect after a hub restart with
    /// the certificates they have), and issues the server certificate for
    /// `server_names`. The bundle is written to `<data dir>/ca.crt`.
    pub fn load(store: &dyn Store, server_names: Vec<String>, data_dir: PathBuf) -> Result<Self> {
        let (raw, record) = stored(store)?;
        let set = record.load()?;
        let (cert, key) = set.active.issue_server_cert(&server_names)?;
        let live = LiveTls::new(&cert, &key, &set.bundle_pem())?;
        let authority = Authority {
            set: RwLock::new(Arc::new(set)),
            record: Mutex::new(raw),
            adopted: Default::default(),
            handled: Default::default(),
            live,
            server_names,
            data_dir,
        };
        authority.write_bundle()?;
        Ok(authority)
    }

    /// The CAs now.
    pub fn current(&self) -> Arc<CaSet> {
        self.set
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The listeners' swappable TLS material.
    pub fn live_tls(&self) -> &Arc<LiveTls> {
        &self.live
    }

    fn write_bundle(&self) -> Result<()> {
        // Owner-only like everything in the data dir (`SledStore::open`).
        crate::tokens::write_private(&self.data_dir.join("ca.crt"), &self.current().bundle_pem())?;
        Ok(())
    }

    /// Makes the CAs of the stored record `raw` current: the listeners,
    /// then the bundle file.
    fn adopt(&self, raw: Vec<u8>, next: CaSet) -> Result<()> {
        let (cert, key) = next.active.issue_server_cert(&self.server_names)?;
        self.live.update(&cert, &key, &next.bundle_pem())?;
        *self
            .set
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(next);
        *self
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = raw;
        self.adopted
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.write_bundle()
    }

    /// Whether the CAs changed since the last call: what follows them
    /// (agents asked to renew, the replica certificate) runs once per
    /// change, whichever path took the change up (a step here, a step
    /// taken up at the start of one, the store's watch).
    pub fn take_change(&self) -> bool {
        use std::sync::atomic::Ordering;
        let now = self.adopted.load(Ordering::Acquire);
        self.handled.swap(now, Ordering::AcqRel) != now
    }

    /// Takes up a step another replica took: whether the CAs changed.
    pub fn follow(&self, store: &dyn Store) -> Result<bool> {
        let Some(raw) = store.get_raw(tree::META, CA_SET)? else {
            return Ok(false);
        };
        if *self
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            == raw
        {
            return Ok(false);
        }
        let record: SetRecord = crate::store::decode(tree::META, CA_SET, &raw)?;
        let next = record.load()?;
        tracing::info!(phase = ?next.phase, active = %next.active.fingerprint(), "took up a CA rotation step made on another replica");
        self.adopt(raw, next)?;
        Ok(true)
    }

    /// One rotation step: `decide` gets the CAs as the store has them now
    /// (another replica may have stepped since this one looked) and says
    /// what comes next; the store takes it only if nobody stepped
    /// meanwhile.
    fn step(
        &self,
        store: &dyn Store,
        decide: impl FnOnce(&CaSet) -> Result<std::result::Result<CaSet, NotReady>>,
    ) -> Result<std::result::Result<(), NotReady>> {
        self.follow(store)?;
        let now = self.current();
        let raw = self
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let next = match decide(&now)? {
            Ok(next) => next,
            Err(not_ready) => return Ok(Err(not_ready)),
        };
        let new_raw = crate::store::encode(tree::META, CA_SET, &SetRecord::of(&next))?;
        if !store.compare_and_swap_raw(tree::META, CA_SET, Some(&raw), Some(&new_raw))? {
            // Someone stepped in between: take up theirs, refuse this one.
            self.follow(store)?;
            return Err(HubError::Config(format!(
                "the CA rotation moved on meanwhile (now {:?}, on another replica or by \
                 another admin); look at the status and try again",
                self.current().phase
            )));
        }
        self.adopt(new_raw, next).map(Ok)
    }

    /// Step 1: a new CA, trusted but not signing yet.
    pub fn stage(&self, store: &dyn Store) -> Result<()> {
        let staged = self.step(store, |now| {
            if now.phase != Phase::Steady {
                return Err(HubError::Config(format!(
                    "a rotation is already {:?}; activate or finish it first",
                    now.phase
                )));
            }
            let next = CertificateAuthority::generate(&format!(
                "OtterScale Link hub CA {}",
                crate::unix_now()
            ))?;
            tracing::info!(fingerprint = %next.fingerprint(), "staged a new hub CA");
            Ok(Ok(CaSet {
                active: copy(&now.active)?,
                other: Some(next),
                phase: Phase::Staged,
                since: crate::unix_now(),
            }))
        })?;
        // Staging strands nobody: it is never refused for links.
        staged.map_err(|n| HubError::Config(format!("{} refused", n.step)))
    }

    /// Step 2: the staged CA signs from now on. Refused while a link was not
    /// told to trust it (it would not trust the new server certificate),
    /// unless `force`.
    pub fn activate(
        &self,
        store: &dyn Store,
        force: bool,
    ) -> Result<std::result::Result<(), NotReady>> {
        self.step(store, |now| {
            let (Phase::Staged, Some(staged)) = (now.phase, &now.other) else {
                return Err(HubError::Config(
                    "no staged CA to activate; stage one first".into(),
                ));
            };
            let staged_fp = staged.fingerprint();
            let stale = links_where(store, |l| !l.trusted_cas.contains(&staged_fp))?;
            if !stale.is_empty() && !force {
                return Ok(Err(NotReady {
                    step: "activate",
                    clusters: stale,
                }));
            }
            tracing::info!(fingerprint = %staged_fp, "activated the new hub CA");
            Ok(Ok(CaSet {
                active: copy(staged)?,
                other: Some(copy(&now.active)?),
                phase: Phase::Activated,
                since: crate::unix_now(),
            }))
        })
    }

    /// Step 3: the previous CA is no longer trusted. Refused while a link
    /// still holds a certificate it signed, unless `force`.
    pub fn finish(
        &self,
        store: &dyn Store,
        force: bool,
    ) -> Result<std::result::Result<(), NotReady>> {
        self.step(store, |now| {
            if now.phase != Phase::Activated {
                return Err(HubError::Config("no activated rotation to finish".into()));
            }
            let active = now.active.fingerprint();
            let stale = links_where(store, |l| l.cert_ca != active)?;
            if !stale.is_empty() && !force {
                return Ok(Err(NotReady {
                    step: "finish",
                    clusters: stale,
                }));
            }
            tracing::info!("finished the hub CA rotation");
            Ok(Ok(CaSet {
                active: copy(&now.active)?,
                other: None,
                phase: Phase::Steady,
                since: crate::unix_now(),
            }))
        })
    }

    /// Links that are not ready for the next step, for the status report.
    pub fn pending(&self, store: &dyn Store) -> Result<Vec<String>> {
        let now = self.current();
        match now.phase {
            Phase::Steady => Ok(Vec::new()),
            Phase::Staged => {
                let staged = now
                    .other
                    .as_ref()
                    .map(|c| c.fingerprint())
                    .unwrap_or_default();
                links_where(store, |l| !l.trusted_cas.contains(&staged))
            }
            Phase::Activated => {
                let active = now.active.fingerprint();
                links_where(store, |l| l.cert_ca != active)
            }
        }
    }
}

fn copy(ca: &CertificateAuthority) -> Result<CertificateAuthority> {
    Ok(CertificateAuthority::from_pem(ca.cert_pem(), ca.key_pem())?)
}

fn links_where(store: &dyn Store, pred: impl Fn(&LinkRecord) -> bool) -> Result<Vec<String>> {
    let mut out: Vec<String> = store
        .scan::<LinkRecord>(tree::LINKS)?
        .into_iter()
        .filter(|l| pred(l))
        .map(|l| l.cluster)
        .collect();
    out.sort();
    Ok(out)
}

/// Names for the hub's server certificate: the hosts of the external and
/// tunnel URLs, plus loopback names so the embedded default works.
pub fn server_names<'a>(urls: impl IntoIterator<Item = &'a url::Url>) -> Vec<String> {
    let mut names: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
    for url in urls {
        if let Some(host) = url.host_str() {
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            if !names.contains(&host) {
                names.push(host);
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SledStore;

    /// A hub's data from before the CAs were one record: the active CA and
    /// a staged one come through, and the old keys are gone.
    #[test]
    fn a_former_hubs_cas_move_to_one_record() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let active = CertificateAuthority::generate("old active").unwrap();
        let staged = CertificateAuthority::generate("old staged").unwrap();
        store
            .put(tree::META, LEGACY_CA, &CaRecord::of(&active))
            .unwrap();
        store
            .put(
                tree::META,
                LEGACY_ROTATION,
                &RotationRecord {
                    phase: Phase::Staged,
                    other: CaRecord::of(&staged),
                    since: 42,
                },
            )
            .unwrap();
        let authority =
            Authority::load(&store, vec!["localhost".into()], dir.path().into()).unwrap();
        let set = authority.current();
        assert_eq!(
            set.fingerprints(),
            [active.fingerprint(), staged.fingerprint()]
        );
        assert_eq!((set.phase, set.since), (Phase::Staged, 42));
        assert!(store.get_raw(tree::META, LEGACY_CA).unwrap().is_none());
        assert!(
            store
                .get_raw(tree::META, LEGACY_ROTATION)
                .unwrap()
                .is_none()
        );
        // And a second start reads the one record.
        drop(authority);
        let again = Authority::load(&store, vec!["localhost".into()], dir.path().into()).unwrap();
        assert_eq!(again.current().fingerprints(), set.fingerprints());
    }

    /// Two hubs on one store: a step taken by one is taken up by the other,
    /// and a step decided on what the other has since replaced is refused.
    #[test]
    fn a_step_taken_elsewhere_is_taken_up_and_wins() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let names = || vec!["localhost".to_owned()];
        for d in ["1", "2"] {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
        }
        let one = Authority::load(&store, names(), dir.path().join("1")).unwrap();
        let two = Authority::load(&store, names(), dir.path().join("2")).unwrap();
        one.stage(&store).unwrap();
        assert_eq!(two.current().phase, Phase::Steady);
        // Staging again on the other is refused: it looks at the store.
        let err = two.stage(&store).unwrap_err().to_string();
        assert!(err.contains("already Staged"), "{err}");
        assert_eq!(two.current().fingerprints(), one.current().fingerprints());
        assert!(two.take_change(), "the other took a change up");
        assert!(!two.take_change(), "once");
    }
}
