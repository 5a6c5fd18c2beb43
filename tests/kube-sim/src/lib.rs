//! A Kubernetes API server for tests, faithful enough that real clients we did not write
//! (kubectl 1.20 and 1.33, the Python `kubernetes` client, kube-rs) accept it.
//!
//! It serves HTTP/1.1 and HTTP/2 over TLS on loopback with a CA of its own, authenticates
//! bearer tokens, honours impersonation, authorises with a small rules table, and keeps
//! objects in memory: discovery (legacy and aggregated), OpenAPI v3, CRUD with
//! resourceVersions, selectors and paging, watches with bookmarks and 410s, JSON, merge and
//! strategic merge patches, server-side apply with managedFields and conflicts, `/status`
//! and `/scale`, CustomResourceDefinitions with schema validation, pod logs, and exec,
//! attach and port-forward over WebSocket and SPDY/3.1 backed by real local processes and
//! sockets.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kube_sim::Error> {
//! use kube_sim::{KubeSim, SimConfig, ADMIN_TOKEN};
//! let sim = KubeSim::start(SimConfig::default_with_admin().pod("default", "web", &["app"])).await?;
//! let kubeconfig = sim.kubeconfig_yaml(ADMIN_TOKEN);
//! # let _ = kubeconfig;
//! sim.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! # Layout
//! - `lib.rs`: [`KubeSim`] (start, kubeconfig, fixtures for logs and ports, shutdown).
//! - `config.rs`: [`SimConfig`]: users, rules, seeded pods, timing knobs.
//! - `http.rs`: TLS accept loop, HTTP/1.1 + HTTP/2 serving, routing, authentication.
//! - `api.rs`: dispatch; list, get, create, update, patch. `delete.rs`: deletion.
//!   `subresources.rs`: status, scale, eviction, generic subresources, reviews.
//!   `output.rs`: Table and metadata-only output. `seed.rs`: a fresh cluster's objects.
//! - `watch.rs`: watch streams (initial events, bookmarks, timeouts, 410).
//! - `store.rs`: objects, the resourceVersion counter, event history, watch fan-out.
//! - `resources.rs`: the table of served kinds (built-ins plus CRD-defined ones).
//! - `objects.rs`: what controllers would do (pods Running, workload status, CRDs).
//! - `discovery.rs`, `openapi.rs`: discovery documents and OpenAPI v3/v2.
//! - `patch.rs`, `apply.rs`: patch formats; server-side apply and managedFields.
//! - `schema.rs`: validation of custom resources against `openAPIV3Schema`.
//! - `protobuf.rs`: protobuf request bodies of the kinds kubectl's typed clients send.
//! - `rbac.rs`: tokens, impersonation, rules and 403s.
//! - `logs.rs`: pod logs; `ws.rs`: WebSocket upgrade and channel framing;
//!   `exec.rs`: exec and attach; `portforward.rs`: port-forward.
//! - `spdy/`: SPDY/3.1 frames, header compression, connections and the WebSocket tunnel;
//!   `spdy_exec.rs`, `spdy_portforward.rs`: the Kubernetes stream protocols over it;
//!   `spdy_wire_tests.rs`: a hand-written SPDY client against a running server.
//! - `tls.rs`: the CA and serving certificate. `util.rs`: time, uids, selectors.

mod api;
mod apply;
mod config;
mod container;
mod delete;
mod discovery;
mod error;
mod exec;
mod http;
mod logs;
mod objects;
mod openapi;
mod output;
mod patch;
mod portforward;
mod protobuf;
mod rbac;
mod resources;
mod schema;
mod seed;
mod spdy;
mod spdy_exec;
mod spdy_portforward;
#[cfg(test)]
mod spdy_wire_tests;
mod store;
mod subresources;
mod tls;
mod util;
mod watch;
mod ws;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::{ADMIN_TOKEN, ADMIN_USER, PodSeed, Rule, SimConfig, Subject, UserEntry};
pub use error::{ApiError, Error, FieldCause};

/// How many subresource calls and terminal resizes are remembered for tests (the latest).
pub(crate) const MAX_RECORDED: usize = 1000;

/// A call to a generic subresource (PUT/POST/PATCH), recorded for tests.
#[derive(Debug, Clone)]
pub struct SubresourceCall {
    pub method: String,
    pub path: String,
    pub body: Value,
}

/// A streaming session the server accepted (exec, attach, port-forward), recorded for tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSession {
    /// `exec`, `attach` or `portforward`.
    pub subresource: String,
    /// `websocket`, `spdy`, or `spdy-over-websocket`.
    pub transport: String,
    /// The negotiated stream protocol, e.g. `v4.channel.k8s.io` or `portforward.k8s.io`.
    pub protocol: String,
}

/// Shared state of a running server.
#[derive(Debug)]
pub(crate) struct State {
    pub cfg: SimConfig,
    pub store: store::Store,
    pub registry: resources::Registry,
    pub logs: logs::LogBook,
    pub ports: Mutex<HashMap<(String, String, u16), SocketAddr>>,
    pub subresource_calls: Mutex<Vec<SubresourceCall>>,
    pub resizes: Mutex<Vec<(String, String, u16, u16)>>,
    pub sessions: Mutex<Vec<StreamSession>>,
    /// The pods' own directories, where their commands run.
    pub pods: container::PodRoots,
    pub cancel: CancellationToken,
    pub tracker: TaskTracker,
    pub addr: SocketAddr,
}

impl State {
    /// Spawns a task owned by the server: it is waited for at shutdown.
    pub fn spawn<F>(&self, fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.tracker.spawn(fut);
    }

    /// Remembers an accepted streaming session (only the latest ones are kept).
    pub fn record_session(&self, subresource: &str, transport: &str, protocol: &str) {
        if let Ok(mut s) = self.sessions.lock() {
            if s.len() >= MAX_RECORDED {
                s.remove(0);
            }
            s.push(StreamSession {
                subresource: subresource.into(),
                transport: transport.into(),
                protocol: protocol.into(),
            });
        }
    }
}

/// Appends to one container's log (see [`KubeSim::log_writer`]).
#[derive(Debug, Clone)]
pub struct LogWriter {
    state: Arc<State>,
    at: (String, String, String),
}

impl LogWriter {
    /// Appends a line; `logs -f` readers see it at once.
    pub fn append(&self, line: &str) {
        let (ns, pod, container) = &self.at;
        self.state.logs.append(ns, pod, container, line);
    }
}

/// A running Kubernetes API test server. Dropping it (or [`KubeSim::shutdown`]) stops the
/// listener, every connection and every process it started.
#[derive(Debug)]
pub struct KubeSim {
    state: Arc<State>,
    ca_pem: String,
}

impl KubeSim {
    /// Binds the configured loopback address (127.0.0.1:0 by default) and starts serving.
    pub async fn start(cfg: SimConfig) -> Result<KubeSim, Error> {
        if !cfg.listen.ip().is_loopback() {
            return Err(Error::Config(format!(
                "refusing to listen on non-loopback address {}",
                cfg.listen
            )));
        }
        let tls = tls::make_server_tls()?;
        let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            store: store::Store::new(cfg.event_window).with_max_bytes(cfg.max_store_bytes),
            registry: resources::Registry::new(),
            logs: logs::LogBook::default(),
            ports: Mutex::new(HashMap::new()),
            subresource_calls: Mutex::new(Vec::new()),
            resizes: Mutex::new(Vec::new()),
            sessions: Mutex::new(Vec::new()),
            pods: container::PodRoots::create()?,
            cancel: CancellationToken::new(),
            tracker: TaskTracker::new(),
            addr,
            cfg,
        });
        seed::seed(&state)?;
        let st = state.clone();
        state.spawn(http::serve(st, listener, tls.config));
        Ok(KubeSim {
            state,
            ca_pem: tls.ca_pem,
        })
    }

    /// `https://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        match self.state.addr {
            SocketAddr::V4(a) => format!("https://{a}"),
            SocketAddr::V6(a) => format!("https://[{}]:{}", a.ip(), a.port()),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.state.addr
    }

    /// The CA certificate (PEM) that signed the serving certificate.
    pub fn ca_pem(&self) -> String {
        self.ca_pem.clone()
    }

    /// A kubeconfig (YAML) for the user of `token`, with the CA embedded.
    pub fn kubeconfig_yaml(&self, token: &str) -> String {
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD.encode(self.ca_pem.as_bytes());
        let name = &self.state.cfg.cluster_name;
        let user = self
            .state
            .cfg
            .users
            .iter()
            .find(|u| u.token == token)
            .map(|u| u.name.clone())
            .unwrap_or_else(|| "user".into());
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: {name}\n  cluster:\n    server: {url}\n    certificate-authority-data: {ca}\nusers:\n- name: {user}\n  user:\n    token: {token}\ncontexts:\n- name: {name}\n  context:\n    cluster: {name}\n    user: {user}\n    namespace: default\ncurrent-context: {name}\npreferences: {{}}\n",
            url = self.url()
        )
    }

    /// Makes `port` of a pod reachable by port-forward: connections go to `target`.
    pub fn add_pod_port(&self, namespace: &str, pod: &str, port: u16, target: SocketAddr) {
        if let Ok(mut p) = self.state.ports.lock() {
            p.insert((namespace.to_string(), pod.to_string(), port), target);
        }
    }

    /// Appends a line to a container's log; `logs -f` readers see it at once.
    pub fn append_log(&self, namespace: &str, pod: &str, container: &str, line: &str) {
        self.state.logs.append(namespace, pod, container, line);
    }

    /// A handle that appends to a container's log from anywhere (another
    /// thread, a task): a pod that keeps logging on its own.
    pub fn log_writer(&self, namespace: &str, pod: &str, container: &str) -> LogWriter {
        LogWriter {
            state: self.state.clone(),
            at: (namespace.into(), pod.into(), container.into()),
        }
    }

    /// Bytes of log that `follow` streams have written so far (after the
    /// lines there when each started): stops growing while their readers
    /// stop reading, once flow control has reached this server.
    pub fn followed_log_bytes(&self) -> u64 {
        self.state
            .logs
            .followed_bytes
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Forgets all watch history: resuming a watch from any earlier resourceVersion, or
    /// continuing a list, now gets 410 Expired.
    pub fn compact(&self) {
        self.state.store.compact();
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.state.store.current_rv()
    }

    /// Calls made to generic subresources so far.
    pub fn subresource_calls(&self) -> Vec<SubresourceCall> {
        self.state
            .subresource_calls
            .lock()
            .map(|c| c.clone())
            .unwrap_or_default()
    }

    /// Terminal resizes received by exec/attach sessions: (pod, container, width, height).
    pub fn resizes(&self) -> Vec<(String, String, u16, u16)> {
        self.state
            .resizes
            .lock()
            .map(|c| c.clone())
            .unwrap_or_default()
    }

    /// The directory a pod's commands run in (made on first use), and
    /// whether their `/tmp` is its `tmp` folder (a mount namespace of their
    /// own, where this server may make one) rather than the machine's.
    pub fn pod_dir(
        &self,
        namespace: &str,
        pod: &str,
    ) -> std::io::Result<(std::path::PathBuf, bool)> {
        Ok((
            self.state.pods.dir(namespace, pod)?,
            self.state.pods.private_tmp,
        ))
    }

    /// Streaming sessions accepted so far: which subresource, over which transport, with
    /// which negotiated protocol.
    pub fn stream_sessions(&self) -> Vec<StreamSession> {
        self.state
            .sessions
            .lock()
            .map(|c| c.clone())
            .unwrap_or_default()
    }

    /// Reads an object straight from the store (group "" for core), in its stored form.
    pub fn object(&self, group: &str, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        self.state
            .store
            .get(&store::ObjKey::new(group, plural, namespace, name))
    }

    /// Creates an object directly, as an admin would (defaults and status are applied).
    pub fn create_object(&self, object: Value) -> Result<Value, ApiError> {
        api::create_direct(&self.state, object)
    }

    /// Stops accepting, ends every connection and task, kills every exec process.
    pub async fn shutdown(self) {
        self.state.cancel.cancel();
        self.state.tracker.close();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), self.state.tracker.wait())
            .await;
    }
}

impl Drop for KubeSim {
    fn drop(&mut self) {
        self.state.cancel.cancel();
        self.state.tracker.close();
    }
}

/// The `Status` object a successful delete returns for most kinds.
pub(crate) fn success_status(name: &str, group: &str, plural: &str, uid: &str) -> Value {
    let mut details = json!({ "name": name, "kind": plural, "uid": uid });
    if !group.is_empty() {
        details["group"] = json!(group);
    }
    json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details })
}
