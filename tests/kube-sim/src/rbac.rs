//! Who is calling and what they may do: bearer-token authentication, impersonation headers
//! (checked attribute by attribute, like the apiserver's impersonation filter) and a small
//! rules table (verbs × resources × namespaces per user or group) that yields real 403s.

use std::collections::BTreeMap;

use http::HeaderMap;
use serde_json::{Value, json};

use crate::config::{SimConfig, Subject};
use crate::error::ApiError;

/// An authenticated (and possibly impersonated) identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub user: String,
    pub uid: Option<String>,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

impl Identity {
    /// The `userInfo` object of SelfSubjectReview.
    pub fn user_info(&self) -> Value {
        let mut v = json!({ "username": self.user, "groups": self.groups });
        if let Some(uid) = &self.uid {
            v["uid"] = json!(uid);
        }
        if !self.extra.is_empty() {
            v["extra"] = json!(self.extra);
        }
        v
    }
}

/// Finds the user of the request's bearer token.
pub fn authenticate(cfg: &SimConfig, headers: &HeaderMap) -> Result<Identity, ApiError> {
    let token = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .ok_or_else(ApiError::unauthorized)?;
    let u = cfg
        .users
        .iter()
        .find(|u| u.token == token)
        .ok_or_else(ApiError::unauthorized)?;
    Ok(Identity {
        user: u.name.clone(),
        uid: None,
        groups: u.groups.clone(),
        extra: BTreeMap::new(),
    })
}

/// Does a rule list allow `verb` on `resource` (e.g. `pods/exec`) in `namespace`
/// (None: cluster scope)?
pub fn allowed(
    cfg: &SimConfig,
    who: &Identity,
    verb: &str,
    resource: &str,
    namespace: Option<&str>,
) -> bool {
    // Like the bootstrap role system:basic-user: anyone authenticated may ask who they are
    // and what they may do.
    if verb == "create"
        && matches!(
            resource,
            "selfsubjectreviews" | "selfsubjectaccessreviews" | "selfsubjectrulesreviews"
        )
        && who.groups.iter().any(|g| g == "system:authenticated")
    {
        return true;
    }
    cfg.rules.iter().any(|r| {
        let subject_ok = match &r.subject {
            Subject::User(u) => *u == who.user,
            Subject::Group(g) => who.groups.contains(g),
        };
        let verb_ok = r.verbs.iter().any(|v| v == "*" || v == verb);
        let res_ok = r.resources.iter().any(|x| {
            x == "*"
                || x == resource
                || x.strip_suffix("/*")
                    .is_some_and(|base| resource.starts_with(&format!("{base}/")))
        });
        let ns_ok = r.namespaces.is_empty()
            || r.namespaces
                .iter()
                .any(|n| n == "*" || Some(n.as_str()) == namespace);
        subject_ok && verb_ok && res_ok && ns_ok
    })
}

/// Whether a ClusterRoleBinding stored in the server makes `who`
/// cluster-admin. The rules table is the test server's own RBAC model; this
/// honours the one binding agent manifests create, so a manifest applied to
/// the server grants what it would grant on a real cluster.
pub fn bound_cluster_admin(store: &crate::store::Store, who: &Identity) -> bool {
    let (bindings, _) = store.list("rbac.authorization.k8s.io", "clusterrolebindings", None);
    bindings.iter().any(|b| {
        b["roleRef"]["kind"] == "ClusterRole"
            && b["roleRef"]["name"] == "cluster-admin"
            && b["subjects"].as_array().is_some_and(|subjects| {
                subjects.iter().any(|s| match s["kind"].as_str() {
                    Some("User") => s["name"] == who.user.as_str(),
                    Some("Group") => s["name"]
                        .as_str()
                        .is_some_and(|g| who.groups.iter().any(|x| x == g)),
                    _ => false,
                })
            })
    })
}

/// The apiserver's 403 wording.
pub fn forbidden(
    who: &Identity,
    verb: &str,
    group: &str,
    resource: &str,
    name: Option<&str>,
    namespace: Option<&str>,
) -> ApiError {
    let qualified = crate::error::qualified(group, resource);
    let subject = match name {
        Some(n) if !n.is_empty() => format!("{qualified} \"{n}\" is forbidden"),
        _ => format!("{qualified} is forbidden"),
    };
    let scope = match namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".to_string(),
    };
    let message = format!(
        "{subject}: User \"{}\" cannot {verb} resource \"{resource}\" in API group \"{group}\" {scope}",
        who.user
    );
    // The kind in details is the resource without its subresource.
    let base = resource.split('/').next().unwrap_or(resource);
    let mut details = json!({ "kind": base });
    if let Some(n) = name {
        details["name"] = json!(n);
    }
    if !group.is_empty() {
        details["group"] = json!(group);
    }
    ApiError::forbidden(message, details)
}

/// Applies `Impersonate-*` headers: each requested attribute must be allowed for the real
/// caller; the result is the identity the request then runs as.
pub fn impersonate(
    cfg: &SimConfig,
    real: Identity,
    headers: &HeaderMap,
) -> Result<Identity, ApiError> {
    let values = |name: &str| -> Vec<String> {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(|s| s.trim().to_string())
            .collect()
    };
    let user = values("impersonate-user").into_iter().next();
    let uid = values("impersonate-uid").into_iter().next();
    let groups = values("impersonate-group");
    let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in headers.iter() {
        if let Some(key) = name.as_str().strip_prefix("impersonate-extra-") {
            let key = percent_encoding::percent_decode_str(key)
                .decode_utf8_lossy()
                .to_string();
            if let Ok(v) = value.to_str() {
                extra.entry(key).or_default().push(v.to_string());
            }
        }
    }
    let Some(user) = user else {
        if uid.is_some() || !groups.is_empty() || !extra.is_empty() {
            return Err(ApiError::internal(
                "Internal error occurred: requested [{UserInfo ...}] without impersonating a user"
                    .to_string(),
            ));
        }
        return Ok(real);
    };
    let check = |resource: &str, name: &str, ns: Option<&str>| -> Result<(), ApiError> {
        if allowed(cfg, &real, "impersonate", resource, ns) {
            Ok(())
        } else {
            Err(forbidden(
                &real,
                "impersonate",
                "",
                resource,
                Some(name),
                ns,
            ))
        }
    };
    if let Some(sa) = user.strip_prefix("system:serviceaccount:") {
        let (ns, name) = sa.split_once(':').unwrap_or(("", sa));
        check("serviceaccounts", name, Some(ns))?;
    } else {
        check("users", &user, None)?;
    }
    for g in &groups {
        check("groups", g, None)?;
    }
    if let Some(u) = &uid {
        check("uids", u, None)?;
    }
    for key in extra.keys() {
        for v in &extra[key] {
            check(&format!("userextras/{key}"), v, None)?;
        }
    }
    let mut all_groups = groups;
    if user != "system:anonymous" && !all_groups.iter().any(|g| g == "system:authenticated") {
        all_groups.push("system:authenticated".into());
    }
    Ok(Identity {
        user,
        uid,
        groups: all_groups,
        extra,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn cfg() -> SimConfig {
        SimConfig::default_with_admin()
            .user("bob-token", "bob", &["devs"])
            .allow("group:devs", &["get", "list"], &["pods"], &["default"])
            .allow("bob", &["impersonate"], &["users"], &[])
    }

    #[test]
    fn rules_and_impersonation() {
        let cfg = cfg();
        let mut h = HeaderMap::new();
        h.insert(
            "authorization",
            HeaderValue::from_static("Bearer bob-token"),
        );
        let bob = authenticate(&cfg, &h).unwrap();
        assert!(allowed(&cfg, &bob, "list", "pods", Some("default")));
        assert!(!allowed(&cfg, &bob, "list", "pods", Some("other")));
        assert!(!allowed(&cfg, &bob, "create", "pods/exec", Some("default")));
        h.insert("impersonate-user", HeaderValue::from_static("jane"));
        let jane = impersonate(&cfg, bob.clone(), &h).unwrap();
        assert_eq!(jane.user, "jane");
        assert_eq!(jane.groups, vec!["system:authenticated".to_string()]);
        h.append("impersonate-group", HeaderValue::from_static("ops"));
        let err = impersonate(&cfg, bob.clone(), &h).unwrap_err();
        assert_eq!(err.code, 403);
        assert!(
            err.message
                .contains("cannot impersonate resource \"groups\""),
            "{}",
            err.message
        );
        let mut only_group = HeaderMap::new();
        only_group.insert("impersonate-group", HeaderValue::from_static("ops"));
        assert_eq!(impersonate(&cfg, bob, &only_group).unwrap_err().code, 500);
    }
}
