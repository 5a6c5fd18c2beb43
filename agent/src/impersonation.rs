//! Who the agent acts as, in one place for the gRPC services and the
//! kubectl proxy: the caller the hub verified becomes `Impersonate-*`
//! headers, after every identity header a request carried is dropped.
//!
//! The agent also holds the **ceiling**, which the customer sets in the
//! manifest it applied (the hub cannot change it): the identities the
//! agent agrees to impersonate. Never a `system:` user or group (the agent
//! adds `system:authenticated` itself), and only users and groups that
//! start with an allowed prefix. A hub that is compromised and sends
//! `system:masters`, or another tenant's groups, gets `PermissionDenied`.

use http::{HeaderMap, HeaderName, HeaderValue};
use otter_tunnel::Caller;

/// The one `system:` group sent, added here to every caller.
pub const AUTHENTICATED: &str = "system:authenticated";

/// What the agent agrees to impersonate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ceiling {
    users: Vec<String>,
    groups: Vec<String>,
}

impl Default for Ceiling {
    /// Hub users (`otter:`), identity provider users (`oidc:`), and the
    /// hub's tenant groups (`otter:`); the manifest narrows the groups to
    /// its tenant's.
    fn default() -> Self {
        Ceiling {
            users: vec!["otter:".into(), "oidc:".into()],
            groups: vec!["otter:".into()],
        }
    }
}

/// Why a caller is not impersonated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Outside the ceiling.
    #[error("this agent does not act as {0}: outside the identities its manifest allows")]
    Ceiling(String),
    /// Not expressible as a header.
    #[error("caller {0} is not a valid header value")]
    Invalid(String),
}

impl Refusal {
    pub fn status(&self) -> tonic::Status {
        match self {
            Refusal::Ceiling(_) => tonic::Status::permission_denied(self.to_string()),
            Refusal::Invalid(_) => tonic::Status::invalid_argument(self.to_string()),
        }
    }

    /// The HTTP status and Kubernetes reason kubectl is told.
    pub fn http(&self) -> (u16, &'static str) {
        match self {
            Refusal::Ceiling(_) => (403, "Forbidden"),
            Refusal::Invalid(_) => (400, "BadRequest"),
        }
    }
}

impl Ceiling {
    /// A ceiling of user and group prefixes; none may be empty or start
    /// with `system:`.
    pub fn new(users: Vec<String>, groups: Vec<String>) -> crate::Result<Self> {
        for p in users.iter().chain(&groups) {
            if p.is_empty() || p.starts_with("system:") {
                return Err(crate::AgentError::Config(format!(
                    "allowed identity prefix {p:?} must be non-empty and not start with \"system:\""
                )));
            }
        }
        if users.is_empty() {
            return Err(crate::AgentError::Config(
                "at least one allowed user prefix is needed".into(),
            ));
        }
        Ok(Ceiling { users, groups })
    }

    /// Whether the agent may act as `caller`. The hub sends no uid and no
    /// extras, so none are taken: they would reach past the names the
    /// ceiling checks.
    pub fn check(&self, caller: &Caller) -> Result<(), Refusal> {
        if !caller.uid.is_empty() || !caller.extra.is_empty() {
            return Err(Refusal::Ceiling("a uid or extra attributes".to_owned()));
        }
        let allowed = |name: &str, prefixes: &[String]| {
            !name.starts_with("system:") && prefixes.iter().any(|p| name.starts_with(p.as_str()))
        };
        if !allowed(&caller.user, &self.users) {
            return Err(Refusal::Ceiling(format!("user {:?}", caller.user)));
        }
        for g in caller.groups.iter().filter(|g| *g != AUTHENTICATED) {
            if !allowed(g, &self.groups) {
                return Err(Refusal::Ceiling(format!("group {g:?}")));
            }
        }
        Ok(())
    }
}

/// Request headers that name an identity: whatever a request carries of
/// these is dropped before the agent's own are set.
pub fn is_identity_header(name: &str) -> bool {
    name == "authorization" || name.starts_with("impersonate-")
}

/// The `Impersonate-*` headers for a caller within the ceiling: its user,
/// `system:authenticated` and its groups.
pub fn headers(
    ceiling: &Ceiling,
    caller: &Caller,
) -> Result<Vec<(HeaderName, HeaderValue)>, Refusal> {
    ceiling.check(caller)?;
    let value = |v: &str, what: &str| {
        HeaderValue::from_str(v).map_err(|_| Refusal::Invalid(format!("{what} {v:?}")))
    };
    let mut out = vec![(
        HeaderName::from_static("impersonate-user"),
        value(&caller.user, "user")?,
    )];
    let mut groups: Vec<&str> = vec![AUTHENTICATED];
    for g in &caller.groups {
        if !groups.contains(&g.as_str()) {
            groups.push(g);
        }
    }
    for g in groups {
        out.push((
            HeaderName::from_static("impersonate-group"),
            value(g, "group")?,
        ));
    }
    Ok(out)
}

/// Replaces the identity headers of a request with the caller's.
pub fn impersonate(map: &mut HeaderMap, ceiling: &Ceiling, caller: &Caller) -> Result<(), Refusal> {
    let set = headers(ceiling, caller)?;
    strip(map);
    for (name, value) in set {
        map.append(name, value);
    }
    Ok(())
}

/// Drops every identity header.
pub fn strip(map: &mut HeaderMap) {
    let stale: Vec<HeaderName> = map
        .keys()
        .filter(|n| is_identity_header(n.as_str()))
        .cloned()
        .collect();
    for n in stale {
        map.remove(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(user: &str, groups: &[&str]) -> Caller {
        Caller {
            user: user.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_ceiling_refuses_system_and_foreign_identities() {
        let ceiling = Ceiling::new(vec!["otter:".into()], vec!["otter:acme:".into()]).unwrap();
        assert!(
            ceiling
                .check(&who("otter:ann", &["otter:acme:admins", AUTHENTICATED]))
                .is_ok()
        );
        for (user, groups) in [
            ("system:admin", &[][..]),
            ("admin", &[][..]),
            ("otter:ann", &["system:masters"][..]),
            ("otter:ann", &["otter:globex:admins"][..]),
            ("otter:ann", &["devs"][..]),
        ] {
            let refused = ceiling.check(&who(user, groups)).unwrap_err();
            assert!(matches!(refused, Refusal::Ceiling(_)), "{user} {groups:?}");
            assert_eq!(refused.status().code(), tonic::Code::PermissionDenied);
        }
        assert!(Ceiling::new(vec!["system:".into()], vec![]).is_err());
        assert!(Ceiling::new(vec![], vec![]).is_err());
    }

    #[test]
    fn request_identity_headers_are_replaced_by_the_callers() {
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer stolen".parse().unwrap());
        h.insert("impersonate-user", "otter:mallory".parse().unwrap());
        h.append("impersonate-group", "otter:acme:admins".parse().unwrap());
        h.insert("accept", "application/json".parse().unwrap());
        let caller = who("otter:ann", &["otter:acme:devs"]);
        impersonate(&mut h, &Ceiling::default(), &caller).unwrap();
        assert!(h.get("authorization").is_none());
        assert_eq!(h["impersonate-user"], "otter:ann");
        let groups: Vec<_> = h.get_all("impersonate-group").iter().collect();
        assert_eq!(groups, [AUTHENTICATED, "otter:acme:devs"]);
        assert!(h.get("impersonate-uid").is_none());
        // A uid or extras are beyond the ceiling.
        let with_uid = Caller {
            uid: "0".into(),
            ..caller.clone()
        };
        assert!(impersonate(&mut h, &Ceiling::default(), &with_uid).is_err());
        let with_extra = Caller {
            extra: vec![otter_tunnel::frame::Extra {
                key: "scopes".into(),
                values: vec!["everything".into()],
            }],
            ..caller
        };
        assert!(impersonate(&mut h, &Ceiling::default(), &with_extra).is_err());
        assert_eq!(h["accept"], "application/json");
    }
}
