//! Tenants: the customers of one hub. Every cluster belongs to exactly one
//! tenant, fixed when its first manifest is minted (a claim in the store);
//! users reach a tenant's clusters through a membership (`member` or
//! `admin`), and hub operators, who manage tenants, reach none unless a
//! tenant made them a member.
//!
//! Cluster names stay unique per hub (the API's `cluster` field is a plain
//! name): a name claimed by one tenant is refused to every other with the
//! same answer whoever holds it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{
    HubError, Result,
    store::{Store, StoreExt, Swap, tree},
    unix_now,
};

/// The tenant links and tokens of hubs from before tenancy belong to.
pub const DEFAULT_TENANT: &str = "default";

/// What a member may do in a tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reaches the tenant's clusters; each cluster's RBAC decides the rest.
    Member,
    /// Also mints manifests and tokens for the tenant, re-enrolls and
    /// deletes its links.
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Member => "member",
            Role::Admin => "admin",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = HubError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "member" => Ok(Role::Member),
            "admin" => Ok(Role::Admin),
            other => Err(HubError::Invalid(format!(
                "role {other:?} is not member or admin"
            ))),
        }
    }
}

/// A caller's roles, by tenant.
pub type Memberships = BTreeMap<String, Role>;

/// A tenant as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantRecord {
    pub name: String,
    pub created: i64,
    /// The operator who created it.
    pub created_by: String,
    /// Set, once and for good, when an operator named the tenant's first
    /// admin: from then on only the tenant's admins make members and
    /// admins, so no operator can make itself one.
    #[serde(default)]
    pub admins_named: bool,
}

/// Which tenant a cluster name belongs to, from its first manifest on.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterClaim {
    pub tenant: String,
    pub claimed: i64,
}

/// Why a tenant or a cluster name could not be taken or let go.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenancyError {
    #[error("tenant {0:?} does not exist")]
    NoSuchTenant(String),
    #[error("tenant {0:?} already exists")]
    TenantExists(String),
    /// Says nothing of who holds the name.
    #[error("cluster name {0:?} is already taken on this hub; choose another")]
    ClusterTaken(String),
    #[error("tenant {tenant:?} still holds {clusters} cluster(s); delete its links first")]
    NotEmpty { tenant: String, clusters: usize },
}

impl TenancyError {
    pub fn status(&self) -> tonic::Status {
        let text = self.to_string();
        match self {
            TenancyError::NoSuchTenant(_) => tonic::Status::not_found(text),
            TenancyError::TenantExists(_) | TenancyError::ClusterTaken(_) => {
                tonic::Status::already_exists(text)
            }
            TenancyError::NotEmpty { .. } => tonic::Status::failed_precondition(text),
        }
    }
}

/// Tenant names are DNS labels, like cluster names: they appear in the
/// group names sent to clusters.
pub fn validate_tenant_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(HubError::Invalid(format!(
            "tenant name {:?} must be 1 to 63 lowercase letters, digits and '-', not starting or ending with '-'",
            name.chars().take(64).collect::<String>()
        )))
    }
}

/// Creates a tenant; `TenantExists` when the name is taken.
pub fn create_tenant(
    store: &dyn Store,
    name: &str,
    by: &str,
) -> Result<std::result::Result<TenantRecord, TenancyError>> {
    let record = TenantRecord {
        name: name.to_owned(),
        created: unix_now(),
        created_by: by.to_owned(),
        admins_named: false,
    };
    let raw = crate::store::encode(tree::TENANTS, name, &record)?;
    if store.compare_and_swap_raw(tree::TENANTS, name, None, Some(&raw))? {
        Ok(Ok(record))
    } else {
        Ok(Err(TenancyError::TenantExists(name.to_owned())))
    }
}

pub fn tenant(store: &dyn Store, name: &str) -> Result<Option<TenantRecord>> {
    store.get(tree::TENANTS, name)
}

pub fn list_tenants(store: &dyn Store) -> Result<Vec<TenantRecord>> {
    store.scan(tree::TENANTS)
}

/// The clusters a tenant holds.
pub fn clusters_of(store: &dyn Store, tenant: &str) -> Result<Vec<String>> {
    Ok(store
        .scan_raw(tree::CLUSTER_TENANTS)?
        .into_iter()
        .filter_map(|(cluster, raw)| {
            let claim: ClusterClaim = serde_json::from_slice(&raw).ok()?;
            (claim.tenant == tenant).then_some(cluster)
        })
        .collect())
}

/// Deletes an empty tenant. Its tokens stop reaching anything: their
/// membership names a tenant that holds no cluster, and a tenant made
/// again later under the name does not revive them (see
/// `tokens::verify_api_token`).
pub fn delete_tenant(
    store: &dyn Store,
    name: &str,
) -> Result<std::result::Result<(), TenancyError>> {
    let Some(record) = tenant(store, name)? else {
        return Ok(Err(TenancyError::NoSuchTenant(name.to_owned())));
    };
    let clusters = clusters_of(store, name)?.len();
    if clusters > 0 {
        return Ok(Err(TenancyError::NotEmpty {
            tenant: name.to_owned(),
            clusters,
        }));
    }
    let raw = crate::store::encode(tree::TENANTS, name, &record)?;
    let _ = store.compare_and_swap_raw(tree::TENANTS, name, Some(&raw), None)?;
    Ok(Ok(()))
}

/// Marks that an operator named `tenant`'s first admin; false when that
/// was done before (or the tenant is gone). A compare-and-swap: of two
/// operators racing, one names the first admin.
pub fn mark_admins_named(store: &dyn Store, tenant: &str) -> Result<bool> {
    loop {
        let Some(raw) = store.get_raw(tree::TENANTS, tenant)? else {
            return Ok(false);
        };
        let mut record: TenantRecord = crate::store::decode(tree::TENANTS, tenant, &raw)?;
        if record.admins_named {
            return Ok(false);
        }
        record.admins_named = true;
        if store.replace(tree::TENANTS, tenant, &raw, &record)? {
            return Ok(true);
        }
    }
}

/// The tenant a cluster name belongs to, if any tenant claimed it.
pub fn tenant_of(store: &dyn Store, cluster: &str) -> Result<Option<String>> {
    Ok(store
        .get::<ClusterClaim>(tree::CLUSTER_TENANTS, cluster)?
        .map(|c| c.tenant))
}

/// Claims `cluster` for `tenant`: done when it is free or already the
/// tenant's; `ClusterTaken` when another tenant holds it. A compare-and-
/// swap, so two tenants racing for one name cannot both win.
pub fn claim_cluster(
    store: &dyn Store,
    cluster: &str,
    tenant: &str,
) -> Result<std::result::Result<(), TenancyError>> {
    loop {
        let claim = match claim_swap(store, cluster, tenant)? {
            Ok(claim) => claim,
            Err(e) => return Ok(Err(e)),
        };
        // Lost to another claim: whose it is decides, read again.
        if claim.checks_only() || store.compare_and_swap_all(std::slice::from_ref(&claim))? {
            return Ok(Ok(()));
        }
    }
}

/// `tenant`'s claim on `cluster` as a swap, to commit with what it is
/// for (an enrollment): it takes a name no one holds, and checks without
/// writing one `tenant` holds already.
pub fn claim_swap(
    store: &dyn Store,
    cluster: &str,
    tenant: &str,
) -> Result<std::result::Result<Swap, TenancyError>> {
    let held = store.get_raw(tree::CLUSTER_TENANTS, cluster)?;
    let new = match &held {
        Some(raw) => {
            let claim: ClusterClaim = crate::store::decode(tree::CLUSTER_TENANTS, cluster, raw)?;
            if claim.tenant != tenant {
                return Ok(Err(TenancyError::ClusterTaken(cluster.to_owned())));
            }
            raw.clone()
        }
        None => crate::store::encode(
            tree::CLUSTER_TENANTS,
            cluster,
            &ClusterClaim {
                tenant: tenant.to_owned(),
                claimed: unix_now(),
            },
        )?,
    };
    Ok(Ok(Swap::new(
        tree::CLUSTER_TENANTS,
        cluster,
        held,
        Some(new),
    )))
}

/// Like [`claim_cluster`], for minting a manifest: a claim of another
/// tenant that never enrolled a cluster lapses `stale_after` its last
/// manifest (every join token it could have minted has expired by then),
/// so nobody holds a name by minting manifests and never applying them.
/// The tenant's own claim is renewed.
pub fn claim_cluster_for_manifest(
    store: &dyn Store,
    cluster: &str,
    tenant: &str,
    stale_after: std::time::Duration,
) -> Result<std::result::Result<(), TenancyError>> {
    let fresh = ClusterClaim {
        tenant: tenant.to_owned(),
        claimed: unix_now(),
    };
    let fresh = crate::store::encode(tree::CLUSTER_TENANTS, cluster, &fresh)?;
    loop {
        let Some(raw) = store.get_raw(tree::CLUSTER_TENANTS, cluster)? else {
            if store.compare_and_swap_raw(tree::CLUSTER_TENANTS, cluster, None, Some(&fresh))? {
                return Ok(Ok(()));
            }
            continue;
        };
        let held: ClusterClaim = crate::store::decode(tree::CLUSTER_TENANTS, cluster, &raw)?;
        let lapsed = held.claimed + (stale_after.as_secs() as i64) < unix_now()
            && store.get_raw(tree::LINKS, cluster)?.is_none();
        if held.tenant != tenant && !lapsed {
            return Ok(Err(TenancyError::ClusterTaken(cluster.to_owned())));
        }
        if store.compare_and_swap_raw(tree::CLUSTER_TENANTS, cluster, Some(&raw), Some(&fresh))? {
            return Ok(Ok(()));
        }
    }
}

/// Lets a cluster name go (its link was deleted). Join tokens of the
/// cluster not yet spent are deleted, and any authorized before now (a
/// manifest URL minted earlier mints more) enrolls nobody: only a manifest
/// made after the deletion brings the name back.
pub fn release_cluster(store: &dyn Store, cluster: &str) -> Result<()> {
    store.put(tree::RELEASED, cluster, &unix_now())?;
    for rec in store.scan::<crate::tokens::JoinTokenRecord>(tree::JOIN_TOKENS)? {
        if rec.cluster == cluster {
            store.delete(tree::JOIN_TOKENS, &rec.id)?;
        }
    }
    store.delete(tree::CLUSTER_TENANTS, cluster)
}

/// When the cluster's link was last deleted, if ever.
pub fn released_at(store: &dyn Store, cluster: &str) -> Result<Option<i64>> {
    store.get(tree::RELEASED, cluster)
}

/// Brings a store of a hub from before tenancy into the model: tenant
/// `default` exists, and every link without a claim belongs to it. API
/// tokens are migrated where they are read (`tokens`).
pub fn migrate(store: &dyn Store) -> Result<()> {
    if tenant(store, DEFAULT_TENANT)?.is_none() {
        let _ = create_tenant(store, DEFAULT_TENANT, "hub")?;
        // Its admins come from the hub's own tokens (the first-start one,
        // those migrated): no operator names more.
        mark_admins_named(store, DEFAULT_TENANT)?;
    }
    for (cluster, _) in store.scan_raw(tree::LINKS)? {
        if tenant_of(store, &cluster)?.is_none() {
            let _ = claim_cluster(store, &cluster, DEFAULT_TENANT)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SledStore;

    #[test]
    fn a_cluster_name_belongs_to_one_tenant() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        create_tenant(&store, "acme", "op").unwrap().unwrap();
        create_tenant(&store, "globex", "op").unwrap().unwrap();
        assert_eq!(
            create_tenant(&store, "acme", "op").unwrap().unwrap_err(),
            TenancyError::TenantExists("acme".into())
        );
        assert!(mark_admins_named(&store, "acme").unwrap());
        assert!(!mark_admins_named(&store, "acme").unwrap(), "once only");
        assert_eq!(claim_cluster(&store, "edge-1", "acme").unwrap(), Ok(()));
        assert_eq!(claim_cluster(&store, "edge-1", "acme").unwrap(), Ok(()));
        let taken = claim_cluster(&store, "edge-1", "globex")
            .unwrap()
            .unwrap_err();
        assert_eq!(taken, TenancyError::ClusterTaken("edge-1".into()));
        assert!(!taken.to_string().contains("acme"));
        assert_eq!(
            tenant_of(&store, "edge-1").unwrap().as_deref(),
            Some("acme")
        );
        assert_eq!(
            delete_tenant(&store, "acme").unwrap(),
            Err(TenancyError::NotEmpty {
                tenant: "acme".into(),
                clusters: 1
            })
        );
        release_cluster(&store, "edge-1").unwrap();
        assert_eq!(delete_tenant(&store, "acme").unwrap(), Ok(()));
        assert!(tenant(&store, "acme").unwrap().is_none());
    }

    #[test]
    fn a_claim_that_never_enrolled_lapses() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let old = ClusterClaim {
            tenant: "acme".into(),
            claimed: unix_now() - 100,
        };
        store.put(tree::CLUSTER_TENANTS, "edge-1", &old).unwrap();
        let wait = std::time::Duration::from_secs(1000);
        let lapse = std::time::Duration::from_secs(10);
        assert!(
            claim_cluster_for_manifest(&store, "edge-1", "globex", wait)
                .unwrap()
                .is_err()
        );
        // An enrolled cluster's claim never lapses.
        store.put_raw(tree::LINKS, "edge-1", b"{}").unwrap();
        assert!(
            claim_cluster_for_manifest(&store, "edge-1", "globex", lapse)
                .unwrap()
                .is_err()
        );
        store.delete(tree::LINKS, "edge-1").unwrap();
        assert_eq!(
            claim_cluster_for_manifest(&store, "edge-1", "globex", lapse).unwrap(),
            Ok(())
        );
        assert_eq!(
            tenant_of(&store, "edge-1").unwrap().as_deref(),
            Some("globex")
        );
        // The holder renews its own claim; acme's old join tokens now fail
        // their claim at Register.
        assert_eq!(
            claim_cluster_for_manifest(&store, "edge-1", "globex", lapse).unwrap(),
            Ok(())
        );
        assert!(claim_cluster(&store, "edge-1", "acme").unwrap().is_err());
    }

    #[test]
    fn tenant_names_are_dns_labels() {
        assert!(validate_tenant_name("acme-2").is_ok());
        for bad in ["", "Acme", "a:b", "-a", "a-", &"x".repeat(64)] {
            assert!(validate_tenant_name(bad).is_err(), "{bad}");
        }
    }
}
