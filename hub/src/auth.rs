//! Who is calling: bearer tokens, checked against the configured OpenID
//! Connect issuer (JWTs) or the hub's own token store (embedded default).

use otter_tunnel::Caller;

use crate::{
    server::HubState,
    tenancy::{Memberships, Role},
    tokens,
};

/// Message of every authentication failure: says how to authenticate.
pub const HOW_TO_AUTHENTICATE: &str = "send `authorization: Bearer <token>` with a token from your identity provider \
    or the hub (the embedded hub writes an admin token to <data dir>/admin-token; `otter login` stores one for the CLI)";

/// A caller the front door already verified from the request's headers,
/// carried in the request's extensions (which no client can set) so the
/// handlers behind it need not verify the token again.
#[derive(Debug, Clone)]
pub struct Verified(pub Principal);

/// Who a verified caller is to the hub: a user, the groups its token or
/// identity provider gave it, and what it may do here.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Principal {
    /// The name it authenticated as (hub token user, identity provider
    /// subject): for logs and the hub's own bounds.
    pub user: String,
    /// The name clusters know it by: `otter:<user>` for hub tokens, the
    /// identity provider's prefix and subject otherwise.
    pub cluster_user: String,
    pub groups: Vec<String>,
    /// A hub operator: creates and deletes tenants and names their first
    /// admins. Reaches no cluster by this alone.
    pub operator: bool,
    /// The tenants whose clusters the caller reaches, with its role.
    pub tenants: Memberships,
    /// The hub token it authenticated with: its streams end with it.
    pub credential: Option<crate::credentials::Credential>,
}

impl Principal {
    pub fn role_in(&self, tenant: &str) -> Option<Role> {
        self.tenants.get(tenant).copied()
    }

    pub fn is_admin_of(&self, tenant: &str) -> bool {
        self.role_in(tenant) == Some(Role::Admin)
    }

    /// The tenants the caller administers.
    pub fn admin_tenants(&self) -> impl Iterator<Item = &str> {
        self.tenants
            .iter()
            .filter(|(_, r)| **r == Role::Admin)
            .map(|(t, _)| t.as_str())
    }

    /// The identity a cluster of `tenant` sees for this caller, namespaced
    /// so that no tenant or identity provider can name a built-in one:
    /// its cluster user name, `system:authenticated`, each of its groups
    /// as `otter:<tenant>:<group>`, and its role in the tenant as a group
    /// ([`role_group`]), which the manifest's RBAC binds.
    pub fn identity_in(&self, tenant: &str) -> Caller {
        let mut groups = vec!["system:authenticated".to_owned()];
        groups.extend(
            self.groups
                .iter()
                // The role groups come from the role alone.
                .filter(|g| !g.starts_with("system:") && !is_role_name(g))
                .map(|g| format!("otter:{tenant}:{g}")),
        );
        match self.role_in(tenant) {
            Some(Role::Admin) => {
                groups.push(role_group(tenant, Role::Member));
                groups.push(role_group(tenant, Role::Admin));
            }
            Some(Role::Member) => groups.push(role_group(tenant, Role::Member)),
            None => {}
        }
        Caller {
            user: self.cluster_user.clone(),
            groups,
            ..Default::default()
        }
    }
}

/// `admins` and `members`: within a tenant's group names, the roles'.
pub fn is_role_name(group: &str) -> bool {
    matches!(group, "admins" | "members")
}

/// Prefix of the names clusters know hub token users by.
pub const HUB_USER_PREFIX: &str = "otter:";

/// The group a cluster sees for a role in its tenant:
/// `otter:<tenant>:admins` or `otter:<tenant>:members` (admins are in
/// both). No identity provider or token can name it: token groups are
/// checked, and identity provider groups arrive prefixed `oidc:`.
pub fn role_group(tenant: &str, role: Role) -> String {
    match role {
        Role::Admin => format!("otter:{tenant}:admins"),
        Role::Member => format!("otter:{tenant}:members"),
    }
}

/// Methods anyone may call: an agent's first Register carries its join
/// token in the message, and health checks and reflection come from
/// probes and tools without credentials. Everything else is refused
/// before its body is read unless the headers authenticate the caller.
pub fn needs_token(path: &str) -> bool {
    !(path == crate::link_service::REGISTER_PATH
        || path.starts_with("/grpc.health.v1.Health/")
        || path.starts_with("/grpc.reflection.v1.ServerReflection/")
        || path.starts_with("/grpc.reflection.v1alpha.ServerReflection/"))
}

/// The caller the front door verified (`server::route` authenticates
/// every request that needs it, once, and puts the caller in its
/// extensions, which no client can set). A handler reached any other way
/// sees no caller: it fails closed.
pub fn verified(extensions: &http::Extensions) -> Result<Principal, tonic::Status> {
    extensions
        .get::<Verified>()
        .map(|v| v.0.clone())
        .ok_or_else(|| {
            tonic::Status::unauthenticated(format!("no credentials: {HOW_TO_AUTHENTICATE}"))
        })
}

/// The verified caller of an HTTP request, from its `authorization` header.
pub async fn authenticate(
    state: &HubState,
    headers: &http::HeaderMap,
) -> Result<Principal, tonic::Status> {
    let value = headers
        .get(http::header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or("\u{0}"));
    authenticate_value(state, value).await
}

async fn authenticate_value(
    state: &HubState,
    value: Option<&str>,
) -> Result<Principal, tonic::Status> {
    let value = value.ok_or_else(|| {
        tonic::Status::unauthenticated(format!("no credentials: {HOW_TO_AUTHENTICATE}"))
    })?;
    let token = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            tonic::Status::unauthenticated(format!(
                "malformed authorization header: {HOW_TO_AUTHENTICATE}"
            ))
        })?;
    // A JWT has three dot-separated parts; hub tokens have none.
    if token.split('.').count() == 3 {
        return match &state.oidc {
            Some(oidc) => oidc.verify(token).await,
            None => Err(tonic::Status::unauthenticated(format!(
                "this hub has no identity provider configured: {HOW_TO_AUTHENTICATE}"
            ))),
        };
    }
    match tokens::verify_api_token(&*state.store, token) {
        Ok(Some(rec)) => Ok(Principal {
            cluster_user: format!("{HUB_USER_PREFIX}{}", rec.name),
            user: rec.name,
            groups: rec.groups,
            operator: rec.operator,
            tenants: rec.tenants,
            credential: Some(crate::credentials::Credential {
                id: rec.id,
                expires: rec.expires,
            }),
        }),
        Ok(None) => Err(tonic::Status::unauthenticated(format!(
            "invalid, expired or revoked token: {HOW_TO_AUTHENTICATE}"
        ))),
        Err(e) => Err(e.into_status()),
    }
}

/// PermissionDenied unless the caller is a hub operator.
pub fn require_operator(caller: &Principal) -> Result<(), tonic::Status> {
    if caller.operator {
        Ok(())
    } else {
        Err(tonic::Status::permission_denied(format!(
            "{} is not a hub operator",
            caller.user
        )))
    }
}

/// The tenant a tenant admin acts in: the one named, which the caller must
/// administer (operators may too, to name a tenant's first admins, when
/// `operators` says so), or the caller's only one.
pub fn admin_tenant(
    caller: &Principal,
    named: Option<&str>,
    operators: bool,
) -> Result<String, tonic::Status> {
    match named.filter(|t| !t.is_empty()) {
        Some(tenant) if caller.is_admin_of(tenant) || (operators && caller.operator) => {
            Ok(tenant.to_owned())
        }
        Some(tenant) => Err(tonic::Status::permission_denied(format!(
            "{} is not an admin of tenant {tenant:?}",
            caller.user
        ))),
        None => {
            let mut admin = caller.admin_tenants();
            match (admin.next(), admin.next()) {
                (Some(only), None) => Ok(only.to_owned()),
                (None, _) => Err(tonic::Status::permission_denied(format!(
                    "{} is not an admin of any tenant",
                    caller.user
                ))),
                (Some(_), Some(_)) => Err(tonic::Status::invalid_argument(format!(
                    "{} administers several tenants; name one (--tenant)",
                    caller.user
                ))),
            }
        }
    }
}
