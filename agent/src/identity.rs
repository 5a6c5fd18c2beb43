//! Where the agent keeps its identity (key, certificate, the hub's CAs and
//! tunnel URLs) across restarts: a directory, or a Kubernetes Secret it
//! owns.
//!
//! The Secret is what the agent manifest uses. A pod's files die with the
//! pod, so an agent rescheduled after a node drain (a Talos upgrade) would
//! need a join token again, and join tokens enroll a cluster once and
//! expire. The Secret outlives the pod: the manifest creates it holding
//! the join token; the agent writes its identity into it after enrolling
//! and removes the token, so no usable token stays in the cluster; any pod
//! started later, any number of hours on, reconnects with the identity and
//! renews. The manifest's RBAC lets the agent read and patch that one
//! Secret and nothing else.

use std::path::PathBuf;

use base64::Engine;
use k8s_openapi::api::core::v1::Secret as KubeSecret;
use kube::api::{Api, Patch, PatchParams};

use crate::{AgentError, Result, enroll::Credentials};

/// Keys of the Secret (and file names of the directory).
const KEY: &str = "agent.key";
const CERT: &str = "agent.crt";
/// The hub's CAs as it last sent them (two during a rotation). In the
/// Secret not under `hub-ca.crt`, which holds the CA the manifest pinned
/// by fingerprint (the pod mounts it) and must stay that one.
const CA_FILE: &str = "hub-ca.crt";
const CA_KEY: &str = "hub-cas.crt";
const URLS: &str = "tunnel-urls";
/// The manifest's join token, removed once the agent enrolled.
pub const JOIN_TOKEN: &str = "join-token";

/// Where the identity is kept.
#[derive(Clone)]
pub enum IdentityStore {
    Dir(PathBuf),
    Secret {
        api: Box<Api<KubeSecret>>,
        namespace: String,
        name: String,
    },
}

impl std::fmt::Debug for IdentityStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dir(dir) => write!(f, "directory {}", dir.display()),
            Self::Secret {
                namespace, name, ..
            } => write!(f, "Secret {namespace}/{name}"),
        }
    }
}

impl IdentityStore {
    fn ca_key(&self) -> &'static str {
        match self {
            Self::Dir(_) => CA_FILE,
            Self::Secret { .. } => CA_KEY,
        }
    }

    /// The Secret `namespace/name`, through the agent's own client.
    pub fn secret(client: kube::Client, namespace: &str, name: &str) -> Self {
        Self::Secret {
            api: Box::new(Api::namespaced(client, namespace)),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }

    /// What is kept, by key; empty when nothing is (yet).
    async fn read(&self) -> Result<Vec<(String, String)>> {
        match self {
            Self::Dir(dir) => Ok([KEY, CERT, CA_FILE, URLS]
                .into_iter()
                .filter_map(|k| {
                    let v = std::fs::read_to_string(dir.join(k)).ok()?;
                    Some((k.to_owned(), v))
                })
                .collect()),
            Self::Secret { api, name, .. } => {
                let secret = api
                    .get_opt(name)
                    .await
                    .map_err(|e| AgentError::Identity(format!("{self:?}: {e}")))?;
                Ok(secret
                    .and_then(|s| s.data)
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|(k, v)| Some((k, String::from_utf8(v.0).ok()?)))
                    .collect())
            }
        }
    }

    /// The credentials kept by an earlier run, if complete and unexpired
    /// at `now`.
    pub async fn load(&self, now: i64) -> Result<Option<Credentials>> {
        let kept = self.read().await?;
        let get = |k: &str| {
            kept.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        Ok(match (get(KEY), get(CERT), get(self.ca_key()), get(URLS)) {
            (Some(key), Some(cert), Some(ca), Some(urls)) => {
                Credentials::from_kept(key, cert, ca, urls, now)
            }
            _ => None,
        })
    }

    /// The join token kept beside the identity (the manifest's Secret),
    /// if it is still there.
    pub async fn join_token(&self) -> Result<Option<String>> {
        if let Self::Dir(_) = self {
            return Ok(None);
        }
        let kept = self.read().await?;
        Ok(kept
            .into_iter()
            .find(|(k, _)| k == JOIN_TOKEN)
            .map(|(_, v)| v.trim().to_owned())
            .filter(|t| !t.is_empty()))
    }

    /// Keeps `creds`; in a Secret, also removes the join token it enrolled
    /// with (one merge patch: the identity and the removal land together).
    pub async fn save(&self, creds: &Credentials) -> Result<()> {
        let urls: Vec<&str> = creds.tunnel_urls.iter().map(url::Url::as_str).collect();
        let urls = urls.join("\n");
        let entries = [
            (KEY, creds.key_pem.as_str()),
            (CERT, creds.cert_pem.as_str()),
            (self.ca_key(), creds.ca_pem.as_str()),
            (URLS, urls.as_str()),
        ];
        match self {
            Self::Dir(dir) => save_dir(dir, &entries),
            Self::Secret { api, name, .. } => {
                let b64 = base64::engine::general_purpose::STANDARD;
                let mut data = serde_json::Map::new();
                for (k, v) in entries {
                    data.insert(k.to_owned(), b64.encode(v).into());
                }
                data.insert(JOIN_TOKEN.to_owned(), serde_json::Value::Null);
                let patch = serde_json::json!({ "data": data });
                api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(|e| AgentError::Identity(format!("{self:?}: {e}")))?;
                Ok(())
            }
        }
    }
}

/// Writes each entry to a file of its own, readable by the owner only,
/// replaced atomically.
fn save_dir(dir: &std::path::Path, entries: &[(&str, &str)]) -> Result<()> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    std::fs::create_dir_all(dir)?;
    for (name, data) in entries {
        let tmp = dir.join(format!(".{name}.tmp"));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(data.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(tmp, dir.join(name))?;
    }
    Ok(())
}
