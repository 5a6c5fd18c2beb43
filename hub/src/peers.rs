//! Replicas reaching each other. A replica that admits a tunnel records,
//! under its etcd lease, that it holds that cluster; a call arriving at
//! another replica goes to it over a peer connection: HTTP/2 with mutual
//! TLS, both sides presenting a replica certificate from the hub CA, one
//! stream per call (HTTP/2's flow control carries the caller's back
//! pressure end to end). The caller was authenticated by the first replica;
//! its verified identity travels in a header only a peer is believed about.
//! The replica that holds the tunnel authorizes the call again, as for any
//! call, and writes its audit line with the caller's own address.

use std::{collections::HashMap, net::SocketAddr, sync::Arc, time::Duration};

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use http_body_util::BodyExt;
use hyper::{body::Incoming, client::conn::http2::SendRequest};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use url::Url;

use crate::{
    auth::Principal,
    forward::HttpBody,
    registry::TunnelEntry,
    server::{ConnInfo, HubState},
    store::{Store, StoreExt, Swap, tree},
};

/// The verified caller, as the first replica authenticated it.
pub const PRINCIPAL_HEADER: &str = "otter-peer-principal";
/// The caller's own address, for the audit line.
pub const REMOTE_HEADER: &str = "otter-peer-remote";
/// An upgraded kubectl connection (HTTP/2 has no Upgrade): the protocol
/// the caller asked for. The caller's bytes follow as the request body.
pub const UPGRADE_HEADER: &str = "otter-peer-upgrade";
/// On the answer: the agent switched protocols; the agent's bytes follow
/// as the response body.
pub const SWITCHED_HEADER: &str = "otter-peer-switched";

/// How long a replica certificate is good for (issued at every start).
const REPLICA_CERT_LIFETIME: Duration = Duration::from_secs(397 * 24 * 3600);

/// Which replica holds a cluster's tunnel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TunnelOwner {
    pub replica: String,
    /// Where its peer port answers.
    pub peer_url: String,
    pub agent_id: String,
    pub transport: String,
    /// The tunnel's id on that replica.
    pub tunnel: u64,
    pub since: i64,
}

/// Set on a request that came from a peer: it is never sent on again.
#[derive(Debug, Clone)]
pub struct FromPeer(pub String);

/// Records that this replica holds `entry`'s tunnel (a store shared by
/// replicas only; nothing otherwise).
pub fn claim(state: &HubState, entry: &TunnelEntry) {
    // A lost race reads the winner (the store learns it) and decides again.
    for _ in 0..3 {
        let written = claim_swap(state, entry).and_then(|swap| match swap {
            Some(swap) => state.store.compare_and_swap_all(&[swap]),
            None => Ok(true),
        });
        match written {
            Ok(true) => return,
            Ok(false) => continue,
            Err(e) => {
                tracing::warn!(cluster = %entry.cluster, error = %e, "could not record the tunnel's replica");
                return;
            }
        }
    }
    tracing::warn!(cluster = %entry.cluster, "the cluster's tunnel record kept changing; not taken");
}

/// Most keys one transaction writes: etcd refuses a transaction of more
/// than 128 operations (`--max-txn-ops`), and one record changed since it
/// was read fails the whole transaction, whose writes are then made one
/// tunnel at a time.
const KEYS_PER_TRANSACTION: usize = 64;

/// Records of tunnels waiting to be written: claims of admitted tunnels
/// (with a link's first tunnel, see [`crate::tunnels::first_tunnel`]) and
/// releases of closed ones. Each is an etcd transaction. Tunnels are
/// admitted one at a time: when a replica died and its agents all came to
/// this one, each admission waited for its own (an fsync on etcd's disk),
/// and the last agent in line for all of them. A release waited on the
/// runtime worker of the tunnel's task: when a replica holding 10,000
/// tunnels stopped, their releases held both workers, one transaction
/// after the other, and its goodbyes went out late (the stop took 29 s,
/// its agents half 15 s to be back elsewhere). They wait here instead,
/// and those that came in meanwhile go in one transaction.
#[derive(Debug, Default)]
pub struct Claims {
    pending: std::sync::Mutex<std::collections::VecDeque<Record>>,
    wake: tokio::sync::Notify,
    /// Held while a batch is taken and written: batches go one after the
    /// other (the writer's, and the stop's), so a release queued after a
    /// claim is written after it.
    writing: std::sync::Mutex<()>,
}

#[derive(Debug)]
enum Record {
    Claim {
        entry: Arc<TunnelEntry>,
        /// The link's first tunnel, written with the claim.
        first: bool,
    },
    /// The cluster's record goes if it still names tunnel `id` here.
    Release { cluster: String, id: u64 },
}

impl Record {
    fn cluster(&self) -> &str {
        match self {
            Record::Claim { entry, .. } => &entry.cluster,
            Record::Release { cluster, .. } => cluster,
        }
    }

    fn keys(&self) -> usize {
        match self {
            Record::Claim { first, .. } => 1 + usize::from(*first),
            Record::Release { .. } => 1,
        }
    }

    /// The write this record makes now, as the store holds it: none when
    /// there is nothing to write (or, for a claim, its tunnel is gone).
    fn swaps(&self, state: &HubState) -> crate::Result<Vec<Swap>> {
        match self {
            Record::Claim { entry, first } => {
                // Closed or replaced meanwhile: its release found nothing
                // to undo.
                let live = state
                    .registry
                    .get(&entry.cluster)
                    .is_some_and(|e| e.id == entry.id);
                if !live {
                    return Ok(Vec::new());
                }
                let first = match first {
                    true => crate::tunnels::first_tunnel_swap(state, entry)?,
                    false => None,
                };
                Ok(first.into_iter().chain(claim_swap(state, entry)?).collect())
            }
            Record::Release { cluster, id } => {
                Ok(release_swap(state, cluster, *id)?.into_iter().collect())
            }
        }
    }

    /// Writes it alone, reading the store again (a batch's compare failed).
    fn write_alone(&self, state: &HubState) {
        match self {
            Record::Claim { entry, first: true } => crate::tunnels::first_tunnel(state, entry),
            Record::Claim {
                entry,
                first: false,
            } => claim(state, entry),
            Record::Release { cluster, id } => release_now(state, cluster, *id),
        }
    }
}

fn locked<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Records soon that this replica holds `entry`'s tunnel (see [`Claims`]),
/// and with it the link's first tunnel when `first`; false without peers,
/// where nothing is claimed and the caller writes the first tunnel itself.
pub fn claim_soon(state: &HubState, entry: &Arc<TunnelEntry>, first: bool) -> bool {
    if state.config.peer_url.is_none() {
        return false;
    }
    locked(&state.claims.pending).push_back(Record::Claim {
        entry: entry.clone(),
        first,
    });
    state.claims.wake.notify_one();
    true
}

/// Forgets soon that this replica holds the cluster's tunnel `id`, unless
/// another replica (or a newer tunnel here) took it meanwhile. A claim of
/// the tunnel still waiting is dropped instead: nothing was written.
pub fn release(state: &HubState, cluster: &str, id: u64) {
    if state.config.peer_url.is_none() {
        return;
    }
    let mut pending = locked(&state.claims.pending);
    let waiting = pending.len();
    pending.retain(
        |r| !matches!(r, Record::Claim { entry, .. } if entry.cluster == cluster && entry.id == id),
    );
    if pending.len() < waiting {
        return;
    }
    pending.push_back(Record::Release {
        cluster: cluster.to_owned(),
        id,
    });
    drop(pending);
    state.claims.wake.notify_one();
}

/// Writes the records claims and releases leave, a batch at a time (those
/// that came in while one was written are the next), until `shutdown`;
/// the stop writes its releases itself ([`write_records_now`]).
pub async fn write_claims(state: Arc<HubState>, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            () = state.claims.wake.notified() => {}
            () = shutdown.cancelled() => return,
        }
        // Off the workers: the store blocks for the transaction.
        let s = state.clone();
        let _ = tokio::task::spawn_blocking(move || while write_claim_batch(&s) {}).await;
    }
}

/// Writes every record waiting, for at most `limit` (the stop's releases,
/// all at once: what is left when etcd answers too slowly goes with this
/// replica's lease).
pub async fn write_records_now(state: &Arc<HubState>, limit: std::time::Duration) {
    let s = state.clone();
    let until = std::time::Instant::now() + limit;
    let _ = tokio::task::spawn_blocking(move || {
        while std::time::Instant::now() < until && write_claim_batch(&s) {}
    })
    .await;
}

/// Writes the waiting records of up to [`KEYS_PER_TRANSACTION`] keys in
/// one transaction; whether there were any. A batch names each cluster
/// once (a transaction may not write one key twice): the next record of a
/// cluster already in it starts the next batch, and reads what this one
/// wrote.
fn write_claim_batch(state: &HubState) -> bool {
    let _writing = locked(&state.claims.writing);
    let mut batch: Vec<Record> = Vec::new();
    {
        let mut pending = locked(&state.claims.pending);
        let mut keys = 0;
        while let Some(next) = pending.front()
            && keys + next.keys() <= KEYS_PER_TRANSACTION
            && !batch.iter().any(|r| r.cluster() == next.cluster())
        {
            keys += next.keys();
            batch.extend(pending.pop_front());
        }
    }
    if batch.is_empty() {
        return false;
    }
    let mut written = Vec::with_capacity(batch.len());
    let mut swaps = Vec::with_capacity(KEYS_PER_TRANSACTION);
    for record in batch {
        match record.swaps(state) {
            Ok(mine) if mine.is_empty() => {}
            Ok(mine) => {
                swaps.extend(mine);
                written.push(record);
            }
            Err(e) => {
                tracing::warn!(cluster = %record.cluster(), error = %e, "could not record the tunnel's replica")
            }
        }
    }
    if swaps.is_empty() {
        return true;
    }
    let first = |r: &Record| matches!(r, Record::Claim { first: true, .. });
    match state.store.compare_and_swap_all(&swaps) {
        Ok(true) if written.iter().any(first) => state.last_seen.flush_soon(),
        Ok(true) => {}
        // A record changed since it was read: each on its own, reading it
        // again.
        Ok(false) => {
            for record in &written {
                record.write_alone(state);
            }
        }
        Err(e) => {
            tracing::warn!(tunnels = written.len(), error = %e, "could not record the tunnels' replica")
        }
    }
    true
}

/// The write that records this replica as holding `entry`'s tunnel, under
/// its lease, from the record read now; none without peers, or when a
/// newer tunnel of the cluster is on another replica (which keeps it, and
/// the periodic check drains this one). Ownership moves only by
/// transaction, from the record read: absent, this replica's, or an older
/// tunnel's elsewhere.
pub fn claim_swap(state: &HubState, entry: &TunnelEntry) -> crate::Result<Option<Swap>> {
    let Some(peer_url) = &state.config.peer_url else {
        return Ok(None);
    };
    let owner = TunnelOwner {
        replica: state.config.replica.clone(),
        peer_url: peer_url.to_string(),
        agent_id: entry.agent_id.clone(),
        transport: entry.transport.as_str().to_owned(),
        tunnel: entry.id,
        since: entry.connected_at,
    };
    let mine = crate::store::encode(tree::TUNNELS, &entry.cluster, &owner)?;
    let current = state.store.get_raw(tree::TUNNELS, &entry.cluster)?;
    let newer_elsewhere = current
        .as_deref()
        .and_then(|raw| serde_json::from_slice::<TunnelOwner>(raw).ok())
        .is_some_and(|o| o.replica != owner.replica && o.since > owner.since);
    if newer_elsewhere {
        tracing::info!(cluster = %entry.cluster, "a newer tunnel of the cluster is on another replica");
        return Ok(None);
    }
    Ok(Some(Swap {
        leased: true,
        ..Swap::new(tree::TUNNELS, &entry.cluster, current, Some(mine))
    }))
}

/// The write that clears the cluster's record if it names this
/// replica's tunnel `id`; none otherwise (another replica, or a newer
/// tunnel here, took it meanwhile).
fn release_swap(state: &HubState, cluster: &str, id: u64) -> crate::Result<Option<Swap>> {
    let Some(raw) = state.store.get_raw(tree::TUNNELS, cluster)? else {
        return Ok(None);
    };
    let ours = serde_json::from_slice::<TunnelOwner>(&raw)
        .is_ok_and(|o| o.replica == state.config.replica && o.tunnel == id);
    Ok(ours.then(|| Swap::new(tree::TUNNELS, cluster, Some(raw), None)))
}

/// [`release_swap`] written now, alone.
fn release_now(state: &HubState, cluster: &str, id: u64) {
    let written = release_swap(state, cluster, id).and_then(|swap| match swap {
        Some(swap) => state.store.compare_and_swap_all(&[swap]).map(drop),
        None => Ok(()),
    });
    if let Err(e) = written {
        tracing::warn!(%cluster, error = %e, "could not clear the tunnel's replica");
    }
}

/// Where a replica serves, as the others (and agents, through them) learn
/// it: under the replica's lease, so a replica that died is gone from the
/// list once its lease is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReplicaRecord {
    pub api_url: String,
    pub tunnel_urls: Vec<String>,
}

/// Records this replica's URLs in the shared store.
pub fn announce(state: &HubState) {
    let record = ReplicaRecord {
        api_url: state.external_url.to_string(),
        tunnel_urls: state.tunnel_urls.iter().map(Url::to_string).collect(),
    };
    let written =
        crate::store::encode(tree::REPLICAS, &state.config.replica, &record).and_then(|v| {
            state
                .store
                .put_leased(tree::REPLICAS, &state.config.replica, &v)
        });
    if let Err(e) = written {
        tracing::warn!(error = %e, "could not record this replica's URLs");
    }
}

/// The tunnel URLs agents are told: this replica's first, then every other
/// live replica's, so an agent whose replica is gone tries the next
/// without a load balancer in front.
pub fn tunnel_urls_for_agents(state: &HubState) -> Vec<Url> {
    let mut urls = state.tunnel_urls.clone();
    if state.config.store.is_none() {
        return urls;
    }
    let others = state
        .store
        .scan::<ReplicaRecord>(tree::REPLICAS)
        .unwrap_or_default();
    for u in others.iter().flat_map(|r| &r.tunnel_urls) {
        if let Ok(u) = Url::parse(u)
            && !urls.contains(&u)
        {
            urls.push(u);
        }
    }
    urls
}

/// The replica other than `me` that holds the cluster's tunnel, if any.
pub fn owner(store: &dyn Store, cluster: &str, me: &str) -> crate::Result<Option<TunnelOwner>> {
    Ok(store
        .get::<TunnelOwner>(tree::TUNNELS, cluster)?
        .filter(|o| o.replica != me))
}

/// How often a replica on a shared store checks its tunnels against it.
/// The closing below runs when the store's watch brings changes, at most
/// this often (a storm of tunnel records must not make it spin)...
const TUNNEL_CHECK_GAP: Duration = Duration::from_millis(50);
/// ...and at least this often.
const TUNNEL_CHECK_EVERY: Duration = Duration::from_secs(1);

/// Closes this replica's tunnels whose link was deleted, or taken by
/// another agent, on another replica, and lets go of those another
/// replica took over (a newer tunnel of the same cluster): one cluster is
/// served by one replica. Tells every connected agent when the replicas'
/// tunnel URLs change (one came or went), so an agent knows where to turn
/// when its replica stops, not only from the next diagnosis refresh.
/// Woken by the store's watch; reads the store's local copy only.
pub async fn check_local_tunnels(state: Arc<HubState>, shutdown: CancellationToken) {
    let mut follower =
        crate::store::Follower::new(&*state.store, TUNNEL_CHECK_GAP, TUNNEL_CHECK_EVERY);
    let mut told = tunnel_urls_for_agents(&state);
    // Tunnels still to be told the change: those with a fetch under way
    // (which may carry the list from before it) are tried on the next wake.
    let mut untold: Vec<Arc<crate::registry::TunnelEntry>> = Vec::new();
    // By cluster: the tunnel checked last and its records' stamps then.
    let mut checked: HashMap<String, (u64, i64, i64)> = HashMap::new();
    // How long the last pass took: the next waits nine times that at
    // least, so however many tunnels a pass looks at, these passes take
    // at most a tenth of a core (a reconnect storm changes the store all
    // the time).
    let mut took = Duration::ZERO;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            () = async {
                follower.next().await;
                tokio::time::sleep((took * 9).min(TUNNEL_CHECK_EVERY)).await;
            } => {}
        }
        let began = tokio::time::Instant::now();
        let urls = tunnel_urls_for_agents(&state);
        if urls != told {
            tracing::info!(tunnel_urls = ?urls.iter().map(Url::as_str).collect::<Vec<_>>(), "the replicas' tunnel URLs changed; telling connected agents");
            told = urls;
            untold = state.registry.all();
        }
        untold.retain(|t| {
            let live = state.registry.get(&t.cluster).is_some_and(|e| e.id == t.id);
            live && !crate::tunnels::retell_tunnel_urls(&state, t)
        });
        let tunnels = state.registry.all();
        let mut now_checked = HashMap::with_capacity(tunnels.len());
        for t in tunnels {
            // Records unchanged since this tunnel was last checked: so is
            // the verdict. Each check reads and decodes two records, and
            // this runs whenever the store changes: with 10,000 tunnels,
            // through a reconnect storm, that took a core.
            let stamps = (
                state.store.stamp(tree::LINKS, &t.cluster),
                state.store.stamp(tree::TUNNELS, &t.cluster),
            );
            if let (Some(link), Some(record)) = stamps {
                let seen = (t.id, link, record);
                let same = checked.get(&t.cluster) == Some(&seen);
                now_checked.insert(t.cluster.clone(), seen);
                if same {
                    continue;
                }
            }
            let link = state
                .store
                .get::<crate::link_service::LinkRecord>(tree::LINKS, &t.cluster);
            let gone = match link {
                Ok(None) => Some("the link was deleted"),
                Ok(Some(l)) if l.agent_id != t.agent_id => {
                    Some("another agent of the cluster registered")
                }
                _ => None,
            };
            if let Some(why) = gone {
                if state.registry.remove_if(&t.cluster, t.id) {
                    tracing::info!(cluster = %t.cluster, why, "closing a tunnel");
                    crate::registry::close_soon(t, why);
                }
                continue;
            }
            if let Ok(Some(other)) = owner(&*state.store, &t.cluster, &state.config.replica)
                && other.since >= t.connected_at
                && state.registry.remove_if(&t.cluster, t.id)
            {
                tracing::info!(cluster = %t.cluster, replica = %other.replica, "the cluster's tunnel moved to another replica");
                crate::registry::drain(
                    t,
                    state.config.reconnect_drain_timeout,
                    "the cluster's agent is connected to another replica",
                );
            }
        }
        checked = now_checked;
        took = began.elapsed();
    }
}

/// Connections to the other replicas.
pub struct Peers {
    /// A replica certificate of the CAs now (replaced after a rotation
    /// step: a finished rotation leaves the old CA's untrusted).
    tls: std::sync::RwLock<(u64, tokio_rustls::TlsConnector)>,
    /// By peer URL, with the generation of `tls` each was made with.
    conns: tokio::sync::Mutex<HashMap<String, (u64, SendRequest<HttpBody>)>>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Peers")
    }
}

impl Peers {
    /// Presents a replica certificate for `replica` issued now by the
    /// active CA, and trusts the CAs of `authority`.
    pub fn new(authority: &crate::authority::Authority, replica: &str) -> crate::Result<Self> {
        Ok(Peers {
            tls: std::sync::RwLock::new((0, Self::connector(authority, replica)?)),
            conns: Default::default(),
        })
    }

    fn connector(
        authority: &crate::authority::Authority,
        replica: &str,
    ) -> crate::Result<tokio_rustls::TlsConnector> {
        let set = authority.current();
        let (cert, key) = set
            .active
            .issue_replica_cert(replica, &[], REPLICA_CERT_LIFETIME)?;
        let config =
            otter_pki::tls::client_config(&set.bundle_pem(), Some((&cert, &key)), &[b"h2"])?;
        Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
    }

    /// After a CA rotation step: the next call to each replica opens a new
    /// connection, presenting a certificate of the active CA and trusting
    /// what is trusted now. Calls on the connections made before go on to
    /// their end (their certificates were checked when they were made).
    pub fn refresh(
        &self,
        authority: &crate::authority::Authority,
        replica: &str,
    ) -> crate::Result<()> {
        let next = Self::connector(authority, replica)?;
        let mut tls = self
            .tls
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *tls = (tls.0 + 1, next);
        Ok(())
    }

    /// Sends `req` to the replica `owner` names, as `caller` from `remote`.
    pub async fn send(
        &self,
        owner: &TunnelOwner,
        caller: &Principal,
        remote: &str,
        mut req: http::Request<HttpBody>,
    ) -> Result<http::Response<Incoming>, PeerError> {
        let principal = serde_json::to_vec(caller)?;
        let headers = req.headers_mut();
        headers.insert(
            PRINCIPAL_HEADER,
            http::HeaderValue::from_str(&URL_SAFE_NO_PAD.encode(principal))?,
        );
        if let Ok(v) = http::HeaderValue::from_str(remote) {
            headers.insert(REMOTE_HEADER, v);
        }
        let url: url::Url = owner.peer_url.parse().map_err(|source| PeerError::Url {
            url: owner.peer_url.clone(),
            source,
        })?;
        let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
        *req.uri_mut() = format!(
            "https://{}:{}{path}",
            url.host_str().unwrap_or("localhost"),
            url.port().unwrap_or(443)
        )
        .parse()?;
        // Whatever the caller spoke, the peer connection is HTTP/2.
        *req.version_mut() = http::Version::HTTP_2;
        let req = req.map(skip_empty);
        let mut sender = self.connection(&url).await?;
        match sender.try_send_request(req).await {
            Ok(resp) => Ok(resp),
            // The pooled connection ended before the request left (the
            // replica restarted, or closed an idle connection): the call
            // goes once more, on a new connection.
            Err(mut e) => match e.take_message() {
                Some(req) => {
                    tracing::debug!(replica = %owner.replica, error = %e.error(), "peer connection gone; one more try");
                    self.forget(&url).await;
                    self.connection(&url)
                        .await?
                        .send_request(req)
                        .await
                        .map_err(|source| PeerError::Send {
                            replica: owner.replica.clone(),
                            source,
                        })
                }
                None => Err(PeerError::Send {
                    replica: owner.replica.clone(),
                    source: e.into_error(),
                }),
            },
        }
    }

    async fn forget(&self, url: &url::Url) {
        self.conns.lock().await.remove(url.as_str());
    }

    /// The open connection to `url`, or a new one.
    async fn connection(&self, url: &url::Url) -> Result<SendRequest<HttpBody>, PeerError> {
        let key = url.as_str().to_owned();
        let (generation, connector) = self
            .tls
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let mut conns = self.conns.lock().await;
        if let Some((made_with, c)) = conns.get(&key)
            && *made_with == generation
            && !c.is_closed()
        {
            return Ok(c.clone());
        }
        let host = url
            .host_str()
            .ok_or_else(|| PeerError::NoHost(url.to_string()))?
            .to_owned();
        let port = url.port().unwrap_or(443);
        let at = |step: &'static str| {
            move |source| PeerError::Io {
                step,
                url: url.to_string(),
                source,
            }
        };
        let connect = async {
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
                .await
                .map_err(at("connecting to"))?;
            let _ = tcp.set_nodelay(true);
            let name = rustls::pki_types::ServerName::try_from(host.clone())?;
            let tls = connector.connect(name, tcp).await.map_err(at("TLS to"))?;
            let (sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                    .await
                    .map_err(|source| PeerError::Handshake {
                        url: url.to_string(),
                        source,
                    })?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            Ok::<_, PeerError>(sender)
        };
        let sender = tokio::time::timeout(Duration::from_secs(10), connect)
            .await
            .map_err(|_| PeerError::Timeout(url.to_string()))??;
        conns.insert(key, (generation, sender.clone()));
        Ok(sender)
    }
}

/// Why a call could not be passed to the replica holding the tunnel
/// (answered `Unavailable`, naming the cluster).
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("the caller's identity: {0}")]
    Principal(#[from] serde_json::Error),
    #[error("the caller's identity header: {0}")]
    Header(#[from] http::header::InvalidHeaderValue),
    #[error("peer URL {url:?}: {source}")]
    Url {
        url: String,
        #[source]
        source: url::ParseError,
    },
    #[error("peer request URI: {0}")]
    Uri(#[from] http::uri::InvalidUri),
    #[error("peer URL {0} has no host")]
    NoHost(String),
    #[error("peer host: {0}")]
    ServerName(#[from] rustls::pki_types::InvalidDnsNameError),
    #[error("{step} {url}: {source}")]
    Io {
        step: &'static str,
        url: String,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP/2 to {url}: {source}")]
    Handshake {
        url: String,
        #[source]
        source: hyper::Error,
    },
    #[error("no connection to {0} within 10 s")]
    Timeout(String),
    #[error("replica {replica}: {source}")]
    Send {
        replica: String,
        #[source]
        source: hyper::Error,
    },
}

/// A body without its empty DATA frames. A request or response passed on
/// can carry them (its sender's way to mark the end); on the long-lived
/// peer connection they would add up, and h2 closes a connection that
/// received too many (a flood guard), with every call on it.
struct SkipEmpty(HttpBody);

impl http_body::Body for SkipEmpty {
    type Data = bytes::Bytes;
    type Error = crate::protocol::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        loop {
            match std::task::ready!(std::pin::Pin::new(&mut self.0).poll_frame(cx)) {
                Some(Ok(f)) if f.data_ref().is_some_and(|d| d.is_empty()) => continue,
                other => return std::task::Poll::Ready(other),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}

fn skip_empty(body: HttpBody) -> HttpBody {
    SkipEmpty(body).boxed_unsync()
}

/// A peer's answer as this replica's response body.
pub fn into_body(resp: http::Response<Incoming>) -> http::Response<HttpBody> {
    resp.map(|b| {
        b.map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
            .boxed_unsync()
    })
}

/// [`into_body`] for a call this replica relays: the call's place in its
/// tenant's bound is held until the answer ends (or the caller leaves).
pub fn relayed(
    resp: http::Response<Incoming>,
    place: crate::registry::TenantPlace,
) -> http::Response<HttpBody> {
    into_body(resp).map(|inner| {
        Placed {
            inner,
            place: Some(place),
        }
        .boxed_unsync()
    })
}

/// An answer holding its call's place until its end, which is let go
/// before the last frame goes on: a caller who saw the end and calls again
/// finds the place free.
struct Placed {
    inner: HttpBody,
    place: Option<crate::registry::TenantPlace>,
}

impl http_body::Body for Placed {
    type Data = bytes::Bytes;
    type Error = crate::protocol::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let next = std::task::ready!(std::pin::Pin::new(&mut self.inner).poll_frame(cx));
        let last = match &next {
            Some(Ok(frame)) => frame.is_trailers() || self.inner.is_end_stream(),
            Some(Err(_)) | None => true,
        };
        if last {
            self.place = None;
        }
        std::task::Poll::Ready(next)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// How long a connection to the peer port may take to show a replica
/// certificate. Replicas handshake in a few milliseconds.
const PEER_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Bounds of the peer port's connections before they showed a replica
/// certificate. The port should be reachable from the replicas only, but
/// nothing guarantees that: strangers' connections hold places here, one
/// source at most its share, and one stalled over a second is dropped for
/// a newcomer, so a replica's handshake (milliseconds) still gets in.
const PEER_HANDSHAKES: otter_tunnel::handshakes::HandshakeLimits =
    otter_tunnel::handshakes::HandshakeLimits {
        max_pending: 256,
        per_source: 16,
        evict_after: Duration::from_secs(1),
    };

/// Serves the peer port: only replica certificates from the hub CA.
pub async fn serve(
    state: Arc<HubState>,
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    shutdown: CancellationToken,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let gate = otter_tunnel::handshakes::Handshakes::new(PEER_HANDSHAKES);
    loop {
        let (tcp, remote) = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "peer port accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // While every place is taken by young handshakes, accepting waits
        // (new connections stay in the kernel's backlog).
        let place = tokio::select! {
            _ = shutdown.cancelled() => return,
            place = gate.begin(otter_tunnel::handshakes::source_key(remote.ip())) => place,
        };
        let Some(place) = place else {
            tracing::debug!(%remote, "peer connection refused: its source holds its share of handshakes");
            continue;
        };
        let (state, acceptor, shutdown) = (state.clone(), acceptor.clone(), shutdown.clone());
        state.tasks.clone().spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = serve_connection(state, acceptor, tcp, remote, place) => {}
            }
        });
    }
}

async fn serve_connection(
    state: Arc<HubState>,
    acceptor: tokio_rustls::TlsAcceptor,
    tcp: tokio::net::TcpStream,
    remote: SocketAddr,
    place: otter_tunnel::handshakes::Handshake,
) {
    let evicted = place.evicted();
    // Calls are small frames both ways: Nagle's algorithm against the
    // peer's delayed ACKs would hold some for tens of milliseconds.
    let _ = tcp.set_nodelay(true);
    let tls = tokio::select! {
        tls = tokio::time::timeout(PEER_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)) => tls,
        _ = evicted.cancelled() => {
            return tracing::debug!(%remote, "peer handshake dropped for a newer one");
        }
    };
    let Ok(Ok(tls)) = tls else {
        return tracing::debug!(%remote, "peer handshake failed or timed out");
    };
    // The chain is the hub CA's (the TLS layer checked it, or, for a
    // resumed session, checked here again); only a replica's certificate
    // is believed about a caller.
    let replica = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .filter(|c| state.authority.live_tls().verify_client(c).is_ok())
        .map(|c| otter_pki::identity::replica_of_der(c));
    let replica = match replica {
        Some(Ok(r)) => r,
        other => {
            tracing::warn!(%remote, ?other, "refused a peer connection without a replica certificate");
            return;
        }
    };
    place.verified();
    let service = hyper::service::service_fn(move |req| {
        let (state, replica) = (state.clone(), replica.clone());
        async move {
            let resp = handle(state, replica, remote, req).await;
            Ok::<_, std::convert::Infallible>(resp.map(skip_empty))
        }
    });
    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(tls), service)
        .await;
}

/// One call from a peer: the caller it carries, then the same handlers as
/// the API port's.
async fn handle(
    state: Arc<HubState>,
    replica: String,
    peer: SocketAddr,
    mut req: http::Request<Incoming>,
) -> http::Response<HttpBody> {
    let caller = req
        .headers()
        .get(PRINCIPAL_HEADER)
        .and_then(|v| URL_SAFE_NO_PAD.decode(v.as_bytes()).ok())
        .and_then(|json| serde_json::from_slice::<Principal>(&json).ok());
    let Some(caller) = caller else {
        return crate::server::unread_body(
            crate::server::plain(http::StatusCode::BAD_REQUEST, "no caller from the peer"),
            req,
        );
    };
    let remote = req
        .headers()
        .get(REMOTE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(peer);
    req.headers_mut().remove(PRINCIPAL_HEADER);
    req.headers_mut().remove(REMOTE_HEADER);
    let ext = req.extensions_mut();
    ext.insert(Arc::new(ConnInfo {
        remote,
        peer_cert: None,
        tunnel_port: false,
    }));
    ext.insert(crate::auth::Verified(caller));
    ext.insert(FromPeer(replica));
    let path_and_query = req
        .uri()
        .path_and_query()
        .map_or_else(|| req.uri().path().to_owned(), |p| p.as_str().to_owned());
    if let Some((cluster, tail)) =
        crate::kube_proxy::split(&state.config.kube_proxy_prefix, &path_and_query)
    {
        let (cluster, tail) = (cluster.to_owned(), tail.to_owned());
        return crate::kube_proxy::handle(state, cluster, tail, req).await;
    }
    if crate::forward::is_forwarded(req.uri().path()) {
        let req = req.map(|b| {
            b.map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
                .boxed_unsync()
        });
        return crate::forward::handle(state, req).await;
    }
    crate::server::unread_body(
        crate::server::plain(http::StatusCode::NOT_FOUND, "not a peer path"),
        req,
    )
}
