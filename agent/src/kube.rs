//! The agent's Kubernetes access: one client with the agent's own
//! credentials (in-cluster ServiceAccount, `--kubeconfig` or `KUBECONFIG`),
//! and, per caller, a client that impersonates the caller the hub verified.
//!
//! Impersonated clients share the agent client's connection pool, TLS and
//! token refresh: they are a thin layer that adds the `Impersonate-*`
//! headers to every request. They are cached, a bounded number, least
//! recently used first out.

use std::{
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use otter_tunnel::Caller;

use crate::impersonation::Ceiling;
use tonic::Status;

/// How many impersonating clients are kept.
pub const DEFAULT_CLIENT_CACHE: usize = 256;

/// The group every authenticated caller belongs to.
pub use crate::impersonation::AUTHENTICATED;

/// Builds the agent's own client configuration: the kubeconfig file when
/// given, else `KUBECONFIG` / `~/.kube/config`, else the in-cluster
/// ServiceAccount.
pub async fn load_config(kubeconfig: Option<&Path>) -> crate::Result<kube::Config> {
    let mut config = match kubeconfig {
        Some(path) => {
            let unusable = |source| crate::AgentError::Kubeconfig {
                path: path.to_owned(),
                source,
            };
            let kc = kube::config::Kubeconfig::read_from(path).map_err(unusable)?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(unusable)?
        }
        None => kube::Config::infer().await?,
    };
    // Watches, `logs -f`, exec and port-forward stay open as long as the
    // caller wants: no read timeout on the connection. Unary calls are
    // bounded by the caller's deadline instead.
    config.read_timeout = None;
    config.connect_timeout = Some(Duration::from_secs(10));
    apply_proxy_rules(&mut config)?;
    Ok(config)
}

/// The proxy to the apiserver, decided the way the hub's is: the
/// kubeconfig's `proxy-url`, else `HTTPS_PROXY` / `HTTP_PROXY` (which
/// clusters inject into every pod, in-cluster too, as client-go honours
/// them), unless `NO_PROXY` exempts the apiserver's host: in-cluster
/// addresses stay direct. (kube checks `NO_PROXY` against the proxy's own
/// address, so the agent decides here.) Errors never show the proxy's
/// credentials.
fn apply_proxy_rules(config: &mut kube::Config) -> crate::Result<()> {
    let invalid = |why: String| crate::AgentError::Config(why);
    let from_env = otter_tunnel::proxy::Proxy::from_env()
        .transpose()
        .map_err(|e| invalid(format!("HTTPS_PROXY / HTTP_PROXY: {e}")))?;
    let configured = match config.proxy_url.take() {
        Some(uri) => {
            let url = url::Url::parse(&uri.to_string())
                .map_err(|e| invalid(format!("the kubeconfig's proxy-url: {e}")))?;
            let no_proxy = std::env::var("NO_PROXY")
                .or_else(|_| std::env::var("no_proxy"))
                .unwrap_or_default();
            Some(
                otter_tunnel::proxy::Proxy::new(url, &no_proxy)
                    .map_err(|e| invalid(e.to_string()))?,
            )
        }
        None => from_env,
    };
    let Some(proxy) = configured else {
        return Ok(());
    };
    let host = config.cluster_url.host().unwrap_or_default();
    let port = config.cluster_url.port_u16().unwrap_or(443);
    if proxy.bypass(host.trim_start_matches('[').trim_end_matches(']'), port) {
        tracing::info!(apiserver = %config.cluster_url, "apiserver reached directly (NO_PROXY)");
        return Ok(());
    }
    tracing::info!(apiserver = %config.cluster_url, proxy = %proxy.display(), "apiserver reached through the proxy");
    config.proxy_url = Some(
        proxy
            .url
            .as_str()
            .parse()
            .map_err(|_| invalid(format!("proxy {} is not a valid URI", proxy.display())))?,
    );
    Ok(())
}

/// Kubernetes clients for the agent and for its callers.
#[derive(Clone)]
pub struct KubeAccess {
    agent: kube::Client,
    /// Impersonating clients by caller, the least recently used out.
    cache: Arc<Mutex<lru::LruCache<Caller, kube::Client>>>,
    ceiling: Ceiling,
}

impl std::fmt::Debug for KubeAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeAccess").finish_non_exhaustive()
    }
}

impl KubeAccess {
    /// From the agent's own configuration.
    pub fn new(config: kube::Config) -> crate::Result<KubeAccess> {
        let agent = kube::Client::try_from(config).map_err(crate::AgentError::KubeClient)?;
        Ok(Self::from_client(agent, DEFAULT_CLIENT_CACHE))
    }

    /// From a client, keeping at most `cache` impersonating clients.
    pub fn from_client(agent: kube::Client, cache: usize) -> KubeAccess {
        KubeAccess {
            agent,
            cache: Arc::new(Mutex::new(lru::LruCache::new(
                std::num::NonZeroUsize::new(cache).unwrap_or(std::num::NonZeroUsize::MIN),
            ))),
            ceiling: Ceiling::default(),
        }
    }

    /// Acts only as callers within `ceiling` (the manifest's).
    pub fn with_ceiling(mut self, ceiling: Ceiling) -> KubeAccess {
        self.ceiling = ceiling;
        self
    }

    /// What this access agrees to impersonate.
    pub fn ceiling(&self) -> &Ceiling {
        &self.ceiling
    }

    /// The agent's own client: only for what the agent itself needs
    /// (discovery and OpenAPI documents, which every authenticated user may
    /// read anyway).
    pub fn agent(&self) -> &kube::Client {
        &self.agent
    }

    /// A client acting as `caller`.
    pub fn for_caller(&self, caller: &Caller) -> Result<kube::Client, Status> {
        if caller.user.is_empty() {
            return Err(Status::unauthenticated(
                "the call carries no verified caller",
            ));
        }
        if let Some(c) = self.cache().get(caller) {
            return Ok(c.clone());
        }
        let headers =
            Arc::new(crate::impersonation::headers(&self.ceiling, caller).map_err(|r| r.status())?);
        let base = self.agent.clone();
        let service = tower::service_fn(move |mut req: http::Request<kube::client::Body>| {
            let (base, headers) = (base.clone(), headers.clone());
            async move {
                let h = req.headers_mut();
                // Nothing upstream may choose the identity but us.
                crate::impersonation::strip(h);
                for (name, value) in headers.iter() {
                    h.append(name.clone(), value.clone());
                }
                base.send(req).await
            }
        });
        let client = kube::Client::new(service, self.agent.default_namespace().to_owned());
        self.cache().put(caller.clone(), client.clone());
        Ok(client)
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, lru::LruCache<Caller, kube::Client>> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn cache_is_bounded_and_keeps_recent_callers() {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let access = KubeAccess::from_client(kube::Client::try_from(config).unwrap(), 2);
        let who = |u: &str| Caller {
            user: if u.is_empty() {
                String::new()
            } else {
                format!("otter:{u}")
            },
            ..Default::default()
        };
        for u in ["a", "b", "a", "c"] {
            access.for_caller(&who(u)).unwrap();
        }
        let cache = access.cache();
        assert_eq!(cache.len(), 2);
        assert!(cache.contains(&who("a")));
        assert!(cache.contains(&who("c")));
        drop(cache);
        match access.for_caller(&who("")) {
            Err(e) => assert_eq!(e.code(), tonic::Code::Unauthenticated),
            Ok(_) => panic!("a call without a caller got a client"),
        }
    }
}
