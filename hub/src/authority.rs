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
    sync::{Arc, RwLock},
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

#[derive(Serialize, Deserialize)]
struct RotationRecord {
    phase: Phase,
    /// The staged CA (staged) or the previous one (activated).
    other: CaRecord,
    /// Unix seconds of the last step.
    since: i64,
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

const ROTATION: &str = "ca.rotation";

/// A rotation step that would strand agents: the links that are not ready.
#[derive(Debug)]
pub struct NotReady {
    pub step: &'static str,
    pub clusters: Vec<String>,
}

/// The hub's CAs and the TLS of its listeners, which follow them.
pub struct Authority {
    set: RwLock<Arc<CaSet>>,
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

impl Authority {
    /// Loads the CAs from the store, creating the first on first start
    /// (keeping it is what lets agents reconnect after a hub restart with
    /// the certificates they have), and issues the server certificate for
    /// `server_names`. The bundle is written to `<data dir>/ca.crt`.
    pub fn load(store: &dyn Store, server_names: Vec<String>, data_dir: PathBuf) -> Result<Self> {
        // Replicas starting together on a shared store agree on one CA.
        let (record, created) = store.get_or_create(tree::META, "ca", || {
            Ok(CaRecord::of(&CertificateAuthority::generate(
                "OtterScale Link hub CA",
            )?))
        })?;
        let active = record.load()?;
        if created {
            tracing::info!(fingerprint = %active.fingerprint(), "created hub CA");
        }
        let set = match store.get::<RotationRecord>(tree::META, ROTATION)? {
            Some(r) => CaSet {
                active,
                other: Some(r.other.load()?),
                phase: r.phase,
                since: r.since,
            },
            None => CaSet {
                active,
                other: None,
                phase: Phase::Steady,
                since: 0,
            },
        };
        let (cert, key) = set.active.issue_server_cert(&server_names)?;
        let live = LiveTls::new(&cert, &key, &set.bundle_pem())?;
        let authority = Authority {
            set: RwLock::new(Arc::new(set)),
            live,
            server_names,
            data_dir,
        };
        authority.write_bundle()?;
        Ok(authority)
    }

    /// The CAs now.
    pub fn current(&self) -> Arc<CaSet> {
        self.set.read().expect("authority lock").clone()
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

    /// Makes `next` current: store first, then the listeners, then the file.
    fn install(&self, store: &dyn Store, next: CaSet) -> Result<()> {
        match &next.other {
            Some(other) => store.put(
                tree::META,
                ROTATION,
                &RotationRecord {
                    phase: next.phase,
                    other: CaRecord::of(other),
                    since: next.since,
                },
            )?,
            None => store.delete(tree::META, ROTATION)?,
        }
        store.put(tree::META, "ca", &CaRecord::of(&next.active))?;
        let (cert, key) = next.active.issue_server_cert(&self.server_names)?;
        self.live.update(&cert, &key, &next.bundle_pem())?;
        *self.set.write().expect("authority lock") = Arc::new(next);
        self.write_bundle()
    }

    /// Step 1: a new CA, trusted but not signing yet.
    pub fn stage(&self, store: &dyn Store) -> Result<()> {
        let now = self.current();
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
        let active = CertificateAuthority::from_pem(now.active.cert_pem(), now.active.key_pem())?;
        self.install(
            store,
            CaSet {
                active,
                other: Some(next),
                phase: Phase::Staged,
                since: crate::unix_now(),
            },
        )
    }

    /// Step 2: the staged CA signs from now on. Refused while a link was not
    /// told to trust it (it would not trust the new server certificate),
    /// unless `force`.
    pub fn activate(
        &self,
        store: &dyn Store,
        force: bool,
    ) -> Result<std::result::Result<(), NotReady>> {
        let now = self.current();
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
        let next = CaSet {
            active: CertificateAuthority::from_pem(staged.cert_pem(), staged.key_pem())?,
            other: Some(CertificateAuthority::from_pem(
                now.active.cert_pem(),
                now.active.key_pem(),
            )?),
            phase: Phase::Activated,
            since: crate::unix_now(),
        };
        tracing::info!(fingerprint = %next.active.fingerprint(), "activated the new hub CA");
        self.install(store, next).map(Ok)
    }

    /// Step 3: the previous CA is no longer trusted. Refused while a link
    /// still holds a certificate it signed, unless `force`.
    pub fn finish(
        &self,
        store: &dyn Store,
        force: bool,
    ) -> Result<std::result::Result<(), NotReady>> {
        let now = self.current();
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
        let next = CaSet {
            active: CertificateAuthority::from_pem(now.active.cert_pem(), now.active.key_pem())?,
            other: None,
            phase: Phase::Steady,
            since: crate::unix_now(),
        };
        tracing::info!("finished the hub CA rotation");
        self.install(store, next).map(Ok)
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
