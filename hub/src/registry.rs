//! Live tunnels by cluster: the hub's routing table.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use otter_tunnel::{Opener, TransportKind, TunnelStream};

use crate::auth::Principal;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::{
    link_service::LinkRecord,
    quota::{Place, Quota},
    store::{Store, StoreExt, tree},
};

/// One live tunnel.
pub struct TunnelEntry {
    /// Unique per connection, so a stale close cannot remove its successor.
    pub id: u64,
    pub cluster: String,
    /// The tenant the cluster belongs to.
    pub tenant: String,
    pub agent_id: String,
    pub opener: Arc<dyn Opener>,
    pub transport: TransportKind,
    pub remote: SocketAddr,
    /// Unix seconds.
    pub connected_at: i64,
    /// When its connection reached the hub (see
    /// [`otter_tunnel::transport::Accepted::began`]).
    pub began: std::time::Instant,
    /// One permit per call in flight; the bound on concurrent calls.
    pub calls: Arc<Semaphore>,
    pub max_calls: u32,
    /// The agent's report on how it got through (JSON), once fetched.
    pub diagnosis: Diagnosis,
    /// When the agent was last heard from.
    pub liveness: Liveness,
}

/// When a tunnel's agent was last heard from, as sampled by
/// [`crate::tunnels::watch_liveness`] from the transport's count of
/// keepalives answered or datagrams received.
#[derive(Debug)]
pub struct Liveness {
    heard: AtomicU64,
    at: std::sync::Mutex<std::time::Instant>,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            heard: AtomicU64::new(0),
            at: std::sync::Mutex::new(std::time::Instant::now()),
        }
    }
}

impl Liveness {
    /// Takes a sample of the transport's count; `None` (a transport that
    /// cannot tell) counts as heard.
    pub fn observe(&self, heard: Option<u64>) {
        let changed = heard.is_none_or(|h| self.heard.swap(h, Ordering::AcqRel) != h);
        if changed {
            *self
                .at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = std::time::Instant::now();
        }
    }

    /// How long since the agent was last heard from.
    pub fn silent_for(&self) -> Duration {
        self.at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .elapsed()
    }
}

/// The agent's report on its tunnel (JSON: transports tried, proxy, clock
/// skew, renewals) and when it was fetched. Fetched when the tunnel comes
/// up, and again when a reader finds it older than the hub's
/// `diagnosis_max_age`: a renewal that fails while the tunnel serves shows
/// up without the hub asking every agent on a timer.
#[derive(Debug, Default)]
pub struct Diagnosis {
    kept: std::sync::Mutex<Option<Report>>,
    refreshing: std::sync::atomic::AtomicBool,
}

/// A report as fetched and as ListLinks shows it. Both are shared, not
/// copied, with each reader: ListLinks reads every tunnel's report, and a
/// copy of each was a quarter of its work, then reading the shown fields
/// out of the JSON again for every listing was half of what remained.
#[derive(Debug, Clone)]
struct Report {
    fetched: std::time::Instant,
    /// Unix seconds.
    at: i64,
    json: Arc<serde_json::Value>,
    shown: Arc<otter_proto::link::v1::LinkDiagnosis>,
}

impl Diagnosis {
    /// The latest report and when it came (Unix seconds).
    pub fn report(&self) -> Option<(i64, Arc<serde_json::Value>)> {
        self.lock().as_ref().map(|r| (r.at, r.json.clone()))
    }

    /// The latest report as ListLinks shows it, without the round-trip
    /// time (the hub measures that, it is not in the report).
    pub fn shown(&self) -> Option<Arc<otter_proto::link::v1::LinkDiagnosis>> {
        self.lock().as_ref().map(|r| r.shown.clone())
    }

    /// Takes `older`'s report (a replaced tunnel of the same agent), so a
    /// listing between the two shows the last report rather than none.
    pub fn inherit(&self, older: &Diagnosis) {
        let kept = older.lock().clone();
        *self.lock() = kept;
    }

    pub fn set(&self, report: serde_json::Value) {
        let at = crate::unix_now();
        let shown = Arc::new(crate::link_service::diagnosis_shown(&report, at));
        *self.lock() = Some(Report {
            fetched: std::time::Instant::now(),
            at,
            json: Arc::new(report),
            shown,
        });
    }

    /// Whether the caller should fetch a new report now: the one kept is
    /// missing or older than `max_age`, and no fetch is under way. The
    /// caller calls [`Diagnosis::fetched`] when done, whatever the outcome.
    pub fn claim_refresh(&self, max_age: Duration) -> bool {
        let stale = self
            .lock()
            .as_ref()
            .is_none_or(|r| r.fetched.elapsed() >= max_age);
        stale && !self.refreshing.swap(true, Ordering::AcqRel)
    }

    pub fn fetched(&self) {
        self.refreshing.store(false, Ordering::Release);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Report>> {
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl std::fmt::Debug for TunnelEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelEntry")
            .field("id", &self.id)
            .field("cluster", &self.cluster)
            .field("agent_id", &self.agent_id)
            .field("transport", &self.transport)
            .field("remote", &self.remote)
            .finish()
    }
}

impl TunnelEntry {
    /// Calls in flight right now.
    pub fn calls_in_flight(&self) -> u32 {
        self.max_calls - self.calls.available_permits() as u32
    }
}

/// The routing table. Reads are frequent (every call), writes rare (tunnel up
/// or down), so a read-write lock with short critical sections is enough.
#[derive(Debug)]
pub struct Registry {
    tunnels: RwLock<HashMap<String, Arc<TunnelEntry>>>,
    next_id: AtomicU64,
    /// Bounds the diagnosis fetches one listing of many stale links starts.
    pub diagnosing: Arc<Semaphore>,
    /// Calls in flight per tenant, across its clusters.
    tenant_calls: Arc<Quota<String>>,
    max_calls_per_tenant: u32,
}

/// Diagnosis fetches in flight at once, across all tunnels.
const DIAGNOSIS_FAN_OUT: usize = 16;

impl Default for Registry {
    fn default() -> Self {
        Registry::new(crate::config::DEFAULT_MAX_CALLS_PER_TENANT)
    }
}

impl Registry {
    /// A routing table letting each tenant have `max_calls_per_tenant`
    /// calls in flight across its clusters.
    pub fn new(max_calls_per_tenant: u32) -> Self {
        Registry {
            tunnels: RwLock::default(),
            next_id: AtomicU64::default(),
            diagnosing: Arc::new(Semaphore::new(DIAGNOSIS_FAN_OUT)),
            tenant_calls: Arc::default(),
            max_calls_per_tenant,
        }
    }

    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn get(&self, cluster: &str) -> Option<Arc<TunnelEntry>> {
        self.read().get(cluster).cloned()
    }

    /// The one way from a call to its cluster: finds the cluster's tunnel,
    /// takes a slot of its bound on calls in flight and opens a stream.
    /// Every forwarding path (gRPC, Connect and gRPC-Web after the protocol
    /// layer, kubectl) comes through here, so what decides whether a call
    /// may reach a cluster has one place. `links` tells an offline cluster
    /// from an unknown one.
    pub async fn open_call(
        &self,
        caller: &Principal,
        cluster: &str,
        links: &dyn Store,
        me: &str,
    ) -> Result<OpenCall, RouteError> {
        let tunnel = self.get(cluster);
        // The one authorization point: a cluster of a tenant the caller is
        // not a member of answers exactly as one that does not exist.
        let tenant = match &tunnel {
            Some(t) => Some(t.tenant.clone()),
            None => crate::tenancy::tenant_of(links, cluster).map_err(RouteError::Store)?,
        };
        let Some(tenant) = tenant.filter(|t| caller.role_in(t).is_some()) else {
            return Err(RouteError::NotRegistered(cluster.to_owned()));
        };
        let Some(tunnel) = tunnel else {
            // Another replica holds it: the caller's replica sends the call
            // on (after this same decision).
            match crate::peers::owner(links, cluster, me) {
                // This replica relays the call and holds its caller's
                // side, so the tenant's bound counts it here too.
                Ok(Some(owner)) => {
                    return Err(RouteError::Elsewhere(
                        Box::new(owner),
                        self.tenant_place(&tenant)?,
                    ));
                }
                Ok(None) => {}
                Err(e) => return Err(RouteError::Store(e)),
            }
            return Err(match links.get::<LinkRecord>(tree::LINKS, cluster) {
                Ok(Some(link)) => RouteError::Offline {
                    cluster: cluster.to_owned(),
                    last_seen: link.last_seen,
                },
                Ok(None) => RouteError::NotRegistered(cluster.to_owned()),
                Err(e) => RouteError::Store(e),
            });
        };
        // The tenant's bound first: a tenant whose calls fill it waits on
        // nothing of another's, and cannot take the hub's memory (each call
        // may hold an answer's send buffer) from the others.
        let for_tenant = self.tenant_place(&tenant)?;
        let for_tunnel =
            tunnel
                .calls
                .clone()
                .try_acquire_owned()
                .map_err(|_| RouteError::Busy {
                    cluster: cluster.to_owned(),
                    max_calls: tunnel.max_calls,
                })?;
        let permit = CallPermit {
            _tunnel: for_tunnel,
            _tenant: for_tenant,
        };
        // Opening never waits for the peer's stream credit, but a wedged
        // connection must not hold the call slot until keepalive gives up.
        let stream = tokio::time::timeout(OPEN_TIMEOUT, tunnel.opener.open())
            .await
            .map_err(|_| RouteError::TunnelFailed {
                cluster: cluster.to_owned(),
                reason: format!("no stream within {} s", OPEN_TIMEOUT.as_secs()),
            })?
            .map_err(|e| RouteError::TunnelFailed {
                cluster: cluster.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(OpenCall {
            stream,
            permit,
            tunnel,
            identity: caller.identity_in(&tenant),
        })
    }

    /// A place for one more call of `tenant`'s, or TenantBusy.
    fn tenant_place(&self, tenant: &str) -> Result<Place<String>, RouteError> {
        self.tenant_calls
            .take(&tenant.to_owned(), self.max_calls_per_tenant as usize)
            .ok_or(RouteError::TenantBusy {
                max_calls: self.max_calls_per_tenant,
            })
    }

    /// Puts `entry` in place and returns the tunnel it replaced.
    pub fn insert(&self, entry: Arc<TunnelEntry>) -> Option<Arc<TunnelEntry>> {
        self.write().insert(entry.cluster.clone(), entry)
    }

    /// Removes the cluster's tunnel if it is still the one with `id`.
    pub fn remove_if(&self, cluster: &str, id: u64) -> bool {
        let mut map = self.write();
        if map.get(cluster).is_some_and(|e| e.id == id) {
            map.remove(cluster);
            true
        } else {
            false
        }
    }

    /// Removes and returns the cluster's tunnel if it belongs to another agent.
    pub fn take_if_other_agent(&self, cluster: &str, agent_id: &str) -> Option<Arc<TunnelEntry>> {
        let mut map = self.write();
        if map.get(cluster).is_some_and(|e| e.agent_id != agent_id) {
            map.remove(cluster)
        } else {
            None
        }
    }

    /// Removes the cluster's tunnel, whichever it is (its link was deleted).
    pub fn take(&self, cluster: &str) -> Option<Arc<TunnelEntry>> {
        self.write().remove(cluster)
    }

    /// Forgets every tunnel (the hub is stopping).
    pub fn clear(&self) {
        self.write().clear();
    }

    pub fn all(&self) -> Vec<Arc<TunnelEntry>> {
        self.read().values().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<TunnelEntry>>> {
        self.tunnels
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Arc<TunnelEntry>>> {
        self.tunnels
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// How long opening a stream on a tunnel may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// A stream to a cluster's agent, holding one of its tunnel's call slots
/// until the permit is dropped (the forwarders hand it to the stream's
/// guard, so the slot is held as long as the call).
pub struct OpenCall {
    pub stream: TunnelStream,
    pub permit: CallPermit,
    pub tunnel: Arc<TunnelEntry>,
    /// Who the cluster is told the caller is.
    pub identity: otter_tunnel::Caller,
}

/// A call's place in its tenant's bound, given back when dropped.
pub type TenantPlace = Place<String>;

/// A call's places in its tunnel's and its tenant's bounds, given back
/// when the call ends (dropped with its answer).
#[derive(Debug)]
pub struct CallPermit {
    _tunnel: OwnedSemaphorePermit,
    _tenant: Place<String>,
}

impl std::fmt::Debug for OpenCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenCall")
            .field("tunnel", &self.tunnel)
            .finish()
    }
}

/// Why a call found no way to its cluster.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("cluster {0} is not registered")]
    NotRegistered(String),
    #[error("cluster {cluster} is offline (last seen {})", ago(*last_seen))]
    Offline { cluster: String, last_seen: i64 },
    #[error(
        "cluster {cluster} has {max_calls} calls in flight, the most one tunnel carries; retry later"
    )]
    Busy { cluster: String, max_calls: u32 },
    #[error(
        "the cluster's tenant has {max_calls} calls in flight, the most one tenant may; retry when one has ended"
    )]
    TenantBusy { max_calls: u32 },
    #[error("cluster {cluster}: tunnel failed: {reason}")]
    TunnelFailed { cluster: String, reason: String },
    /// Another replica holds the tunnel.
    #[error("the cluster's tunnel is on replica {}, which did not answer", .0.replica)]
    Elsewhere(Box<crate::peers::TunnelOwner>, TenantPlace),
    #[error(transparent)]
    Store(crate::HubError),
}

impl RouteError {
    /// The gRPC status a caller gets.
    pub fn status(self) -> tonic::Status {
        let text = self.to_string();
        match self {
            RouteError::NotRegistered(_) => tonic::Status::not_found(text),
            RouteError::Offline { .. }
            | RouteError::TunnelFailed { .. }
            | RouteError::Elsewhere(..) => tonic::Status::unavailable(text),
            RouteError::Busy { .. } | RouteError::TenantBusy { .. } => {
                tonic::Status::resource_exhausted(text)
            }
            RouteError::Store(e) => e.into_status(),
        }
    }

    /// The HTTP status and Kubernetes `reason` a kubectl caller gets.
    pub fn http(&self) -> (u16, &'static str) {
        match self {
            RouteError::NotRegistered(_) => (404, "NotFound"),
            RouteError::Offline { .. }
            | RouteError::TunnelFailed { .. }
            | RouteError::Elsewhere(..) => (503, "ServiceUnavailable"),
            RouteError::Busy { .. } | RouteError::TenantBusy { .. } => (429, "TooManyRequests"),
            RouteError::Store(_) => (500, "InternalError"),
        }
    }
}

/// "3m ago", for a Unix time in the past.
fn ago(unix: i64) -> String {
    format!("{} ago", crate::short_duration(crate::unix_now() - unix))
}

/// Sends the hub's own request (no caller) to the agent's `target` on a
/// stream of its own; the response, or `None` when the tunnel or the agent
/// failed. Bounded by `limit`.
pub async fn ask_agent(
    entry: &TunnelEntry,
    target: &str,
    method: http::Method,
    headers: http::HeaderMap,
    limit: Duration,
) -> Option<http::Response<otter_tunnel::http::ResponseBody>> {
    let ask = async {
        let stream = entry.opener.open().await.ok()?;
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("/{target}"))
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .ok()?;
        *req.headers_mut() = headers;
        otter_tunnel::http::forward(
            stream,
            target,
            None,
            req,
            otter_tunnel::frame::Limits::default(),
            None,
        )
        .await
        .ok()
    };
    tokio::time::timeout(limit, ask).await.ok().flatten()
}

/// Lets a tunnel that is out of the routing table finish its calls, then
/// closes it; after `timeout` it is closed regardless. Nothing is leaked: the
/// connection ends either way.
pub fn drain(entry: Arc<TunnelEntry>, timeout: Duration, reason: &'static str) {
    tokio::spawn(async move {
        let all = entry.calls.acquire_many(entry.max_calls);
        let _ = tokio::time::timeout(timeout, all).await;
        tracing::info!(cluster = %entry.cluster, agent_id = %entry.agent_id, reason, "closing drained tunnel");
        close_with_goodbye(&entry, reason).await;
    });
}

/// How long the agent has to take a goodbye before its tunnel is closed
/// regardless.
pub const GOODBYE_TIMEOUT: Duration = Duration::from_millis(500);

/// Tells the agent why its tunnel is being closed, then closes it. The
/// goodbye is what lets the agent's log say the hub closed the tunnel (and
/// why) rather than a proxy or the network: over TCP every close looks the
/// same. Bounded by [`GOODBYE_TIMEOUT`]; an agent that does not answer is
/// closed all the same.
pub async fn close_with_goodbye(entry: &TunnelEntry, reason: &str) {
    let mut headers = http::HeaderMap::new();
    if let Ok(v) = http::HeaderValue::from_str(reason) {
        headers.insert(otter_tunnel::frame::REASON_HEADER, v);
    }
    let _ = ask_agent(
        entry,
        otter_tunnel::frame::TARGET_BYE,
        http::Method::POST,
        headers,
        GOODBYE_TIMEOUT,
    )
    .await;
    entry.opener.close(reason);
}

/// [`close_with_goodbye`] off the caller's task, for callers that must not wait.
pub fn close_soon(entry: Arc<TunnelEntry>, reason: &'static str) {
    tokio::spawn(async move { close_with_goodbye(&entry, reason).await });
}
