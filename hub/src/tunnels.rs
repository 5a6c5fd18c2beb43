//! Admission of tunnel connections: the certificate says which cluster and
//! agent a tunnel belongs to; the stored link says whether that agent is
//! still the cluster's current one.

use std::sync::Arc;

use otter_pki::identity::PeerCertificate;
use otter_tunnel::transport::Accepted;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::{
    link_service::LinkRecord,
    registry::{TunnelEntry, drain},
    server::HubState,
    store::{StoreExt, tree},
    unix_now,
};

/// Takes accepted connections from every transport's listener until shutdown.
pub async fn run(
    state: Arc<HubState>,
    mut accepted: mpsc::Receiver<Accepted>,
    shutdown: CancellationToken,
) {
    loop {
        let a = tokio::select! {
            a = accepted.recv() => match a { Some(a) => a, None => return },
            _ = shutdown.cancelled() => return,
        };
        let remote = a.remote;
        if let Err(why) = admit(&state, a) {
            tracing::warn!(%remote, reason = %why, "tunnel refused");
        }
    }
}

/// Why a tunnel was not admitted: logged, audited, and told to the agent
/// as the reason its connection closed.
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("no client certificate")]
    NoCertificate,
    #[error("client certificate: {0}")]
    Certificate(#[source] otter_pki::PkiError),
    #[error("cluster {0} is not registered")]
    NotRegistered(String),
    #[error(transparent)]
    Store(crate::HubError),
    #[error("agent {agent} of cluster {cluster} was replaced by agent {by}")]
    Replaced {
        agent: String,
        cluster: String,
        by: String,
    },
    #[error("certificate {serial} of cluster {cluster} was superseded by a renewal")]
    Superseded { serial: String, cluster: String },
    #[error("cluster {0} has a tunnel from this agent dialled after this one")]
    Stale(String),
}

fn admit(state: &Arc<HubState>, mut a: Accepted) -> Result<(), Refused> {
    // The tunnel's slot among those being set up: held until the agent
    // has answered on the tunnel (its diagnosis), freed at once on refusal.
    let admission = a.admission.take();
    let audit = |cluster: &str, tenant: &str, code: &str| {
        state.audit.record(crate::audit::Event {
            kind: "tunnel",
            action: format!("admit {}", a.transport.as_str()),
            cluster: cluster.to_owned(),
            tenant: tenant.to_owned(),
            code: code.to_owned(),
            remote: a.remote.to_string(),
            ..Default::default()
        })
    };
    let refuse = |why: Refused| {
        let said = why.to_string();
        audit("", "", &format!("refused: {said}"));
        a.opener.close(&said);
        Err(why)
    };
    let Some(der) = a.peer_cert.as_ref() else {
        return refuse(Refused::NoCertificate);
    };
    // A resumed TLS session did not verify the certificate it carries (the
    // one of the handshake it resumes): checked here as a full handshake
    // would, against the CAs trusted now and the clock now.
    if let Err(e) = state.authority.live_tls().verify_client(der) {
        return refuse(Refused::Certificate(e));
    }
    let peer = match PeerCertificate::from_der(der) {
        Ok(p) => p,
        Err(e) => return refuse(Refused::Certificate(e)),
    };
    let cluster = peer.identity.cluster.clone();
    let link = match state.store.get::<LinkRecord>(tree::LINKS, &cluster) {
        Ok(Some(l)) => l,
        Ok(None) => return refuse(Refused::NotRegistered(cluster)),
        Err(e) => return refuse(Refused::Store(e)),
    };
    if link.agent_id != peer.identity.agent_id {
        return refuse(Refused::Replaced {
            agent: peer.identity.agent_id,
            cluster,
            by: link.agent_id,
        });
    }
    // The serial is pinned: a copy of an older certificate of this very
    // agent is refused once the agent renewed and moved on.
    if !link.holds(&peer.serial) {
        return refuse(Refused::Superseded {
            serial: peer.serial,
            cluster,
        });
    }
    if link.cert_serial == peer.serial && link.keeps_older() {
        forget_previous_serial(state, &cluster, &peer.serial);
    }
    // The tunnel the agent dialled last wins, not the one admitted last: a
    // connection that reached the hub before the agent's live tunnel did
    // is one the agent gave up on (its handshake or its admission outlasted
    // the agent's bound) and would only displace the tunnel in use. A make-
    // before-break dial, a renewal's, a restarted agent's all come later.
    if state
        .registry
        .get(&cluster)
        .is_some_and(|live| live.agent_id == peer.identity.agent_id && live.began > a.began)
    {
        return refuse(Refused::Stale(cluster));
    }
    audit(&cluster, &link.tenant, "admitted");
    let max_calls = state.config.max_calls_per_tunnel;
    let entry = Arc::new(TunnelEntry {
        id: state.registry.next_id(),
        cluster: cluster.clone(),
        tenant: link.tenant.clone(),
        agent_id: peer.identity.agent_id.clone(),
        opener: a.opener.clone(),
        transport: a.transport,
        remote: a.remote,
        connected_at: unix_now(),
        began: a.began,
        calls: Arc::new(Semaphore::new(max_calls as usize)),
        max_calls,
        diagnosis: Default::default(),
        liveness: Default::default(),
    });
    if let Some(prev) = state
        .registry
        .get(&cluster)
        .filter(|p| p.agent_id == entry.agent_id)
    {
        entry.diagnosis.inherit(&prev.diagnosis);
    }
    if let Some(old) = state.registry.insert(entry.clone()) {
        drain(
            old,
            state.config.reconnect_drain_timeout,
            "replaced by a newer tunnel from the same agent",
        );
    }
    if link.last_transport.is_empty() {
        // The link's first tunnel: until it is written Register takes the
        // same agent's join token again (a retried Register whose answer
        // was lost).
        if !crate::peers::claim_soon(state, &entry, true) {
            first_tunnel(state, &entry);
        }
    } else {
        touch(state, &cluster, a.transport.as_str());
        crate::peers::claim_soon(state, &entry, false);
    }
    let gauge = state
        .metrics
        .tunnels
        .get_or_create(&crate::metrics::TransportLabel {
            transport: a.transport.as_str().to_owned(),
        })
        .clone();
    gauge.inc();
    tracing::info!(%cluster, agent_id = %entry.agent_id, transport = %a.transport, remote = %a.remote, "tunnel up");

    let diagnosed = entry.clone();
    let urls = crate::peers::tunnel_urls_for_agents(state);
    state.tasks.spawn(async move {
        if diagnosed.diagnosis.claim_refresh(std::time::Duration::ZERO) {
            fetch_diagnosis(&urls, &diagnosed).await;
        }
        drop(admission);
    });
    let state = state.clone();
    // A tunnel lives no longer than the certificate it was opened with: an
    // agent that renewed opens a new tunnel with the new one before then.
    let expires_in =
        std::time::Duration::from_secs(u64::try_from(peer.not_after - unix_now()).unwrap_or(0));
    state.tasks.clone().spawn(async move {
        let reason = tokio::select! {
            reason = entry.opener.closed() => reason,
            _ = tokio::time::sleep(expires_in) => {
                crate::registry::close_with_goodbye(&entry, "the agent's certificate expired").await;
                entry.opener.closed().await
            }
        };
        gauge.dec();
        if state.registry.remove_if(&entry.cluster, entry.id) {
            touch(&state, &entry.cluster, "");
        }
        crate::peers::release(&state, &entry.cluster, entry.id);
        tracing::info!(cluster = %entry.cluster, agent_id = %entry.agent_id, %reason, "tunnel down");
    });
    Ok(())
}

/// Samples every tunnel's sign of life four times a keepalive interval,
/// so a link shows `Unresponsive` about as soon as its agent has missed a
/// keepalive, well before the keepalive timeout ends the tunnel. One task
/// for all tunnels: an idle tunnel costs a counter read per sample.
pub async fn watch_liveness(state: Arc<HubState>, shutdown: CancellationToken) {
    let every = (state.config.keepalive.interval / 4).max(std::time::Duration::from_millis(50));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        for entry in state.registry.all() {
            entry.liveness.observe(entry.opener.heard());
        }
    }
}

/// Whether a tunnel's agent has missed a keepalive: nothing heard for two
/// intervals means the keepalive sent after the last answer has gone a
/// whole interval unanswered (on QUIC both ends send one every interval).
pub fn unresponsive(state: &HubState, entry: &TunnelEntry) -> bool {
    entry.liveness.silent_for() > state.config.keepalive.interval * 2
}

/// The agent is on its newest certificate: the one it renewed with is
/// accepted no more. A compare-and-swap, so a renewal landing meanwhile
/// keeps what it wrote.
///
/// Flushed with the next batch of last-seen times, not waited for: a
/// crash before then leaves the previous serial, which the agent's next
/// tunnel on its new certificate retires again.
fn forget_previous_serial(state: &HubState, cluster: &str, current: &str) {
    let retired = crate::link_service::update_link_unflushed(&*state.store, cluster, |link| {
        if link.cert_serial != current || !link.keeps_older() {
            return false;
        }
        link.forget_older();
        true
    });
    match retired {
        Ok(_) => state.last_seen.flush_soon(),
        Err(e) => {
            tracing::warn!(%cluster, error = %e, "could not retire the certificate renewed with")
        }
    }
}

/// Writes a link's first tunnel (now, and its transport), with this
/// replica's record of holding the tunnel: on etcd one transaction, where
/// each would take one. Flushed with the next batch of last-seen times, not
/// waited for: admissions are made one at a time, and an fsync each held
/// every agent behind it (a first connect of 2,000 agents, three
/// alternating pairs: 4.1-5.0 s against 4.6-5.6); a crash before the flush
/// only lets this agent's retried Register spend its join token once more.
/// Replicas batch these writes (see [`crate::peers::Claims`]).
pub(crate) fn first_tunnel(state: &HubState, entry: &TunnelEntry) {
    let cluster = &entry.cluster;
    let written = crate::link_service::update_link_with_unflushed(
        &*state.store,
        cluster,
        |link| {
            first_seen_over(link, entry);
            true
        },
        || crate::peers::claim_swap(state, entry),
    );
    match written {
        Ok(true) => state.last_seen.flush_soon(),
        // The link went meanwhile (deleted: its tunnel is closed soon).
        Ok(false) => crate::peers::claim(state, entry),
        Err(e) => {
            tracing::warn!(%cluster, error = %e, "could not record the first tunnel");
            crate::peers::claim(state, entry);
        }
    }
}

/// The link now that `entry` is its first tunnel.
fn first_seen_over(link: &mut LinkRecord, entry: &TunnelEntry) {
    link.last_seen = unix_now();
    link.last_transport = entry.transport.as_str().to_owned();
}

/// [`first_tunnel`]'s write of the link as the store holds it now, for a
/// batch; none when the link is gone.
pub(crate) fn first_tunnel_swap(
    state: &HubState,
    entry: &TunnelEntry,
) -> crate::Result<Option<crate::store::Swap>> {
    crate::link_service::link_swap(&*state.store, &entry.cluster, |link| {
        first_seen_over(link, entry);
        true
    })
}

/// Records when a cluster was last seen (and over which transport, unless
/// `transport` is empty), for [`write_last_seen`] to write.
pub(crate) fn touch(state: &HubState, cluster: &str, transport: &str) {
    state.last_seen.record(cluster, transport);
}

/// When links were last seen, waiting to be written. A tunnel coming up or
/// going down records the time, but does not wait for the write: in a
/// reconnect storm each would hold its admission (and, while the store
/// answers slowly, a thread) for a store round trip, an fsync or an etcd
/// transaction, and for one cluster only the latest time matters.
#[derive(Debug, Default)]
pub struct LastSeen {
    pending: std::sync::Mutex<std::collections::HashMap<String, Seen>>,
    /// A write made elsewhere waits for the next batch's flush.
    flush_wanted: std::sync::atomic::AtomicBool,
    wake: tokio::sync::Notify,
}

#[derive(Debug)]
struct Seen {
    at: i64,
    /// Empty: the transport is left as it was (a tunnel that closed).
    transport: String,
}

impl Seen {
    /// Whether `link` changed.
    fn apply(&self, link: &mut LinkRecord) -> bool {
        let mut changed = false;
        if self.at > link.last_seen {
            link.last_seen = self.at;
            changed = true;
        }
        if !self.transport.is_empty() && link.last_transport != self.transport {
            link.last_transport.clone_from(&self.transport);
            changed = true;
        }
        changed
    }
}

/// Most links one write of last-seen times changes (etcd refuses a
/// transaction of more than 128 operations, `--max-txn-ops`).
const LINKS_PER_WRITE: usize = 64;

impl LastSeen {
    fn record(&self, cluster: &str, transport: &str) {
        let mut pending = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let seen = pending.entry(cluster.to_owned()).or_insert(Seen {
            at: 0,
            transport: String::new(),
        });
        seen.at = unix_now();
        if !transport.is_empty() {
            seen.transport = transport.to_owned();
        }
        drop(pending);
        self.wake.notify_one();
    }

    /// Has the next batch flushed even if no time was recorded: a write
    /// made elsewhere that need not wait for its fsync.
    pub fn flush_soon(&self) {
        self.flush_wanted
            .store(true, std::sync::atomic::Ordering::Release);
        self.wake.notify_one();
    }

    /// Writes every time recorded so far, then flushes once (also when
    /// only [`LastSeen::flush_soon`] asked). Blocks on the store.
    pub fn write_pending(&self, store: &dyn crate::store::Store) {
        let flush_wanted = self
            .flush_wanted
            .swap(false, std::sync::atomic::Ordering::AcqRel);
        let pending = std::mem::take(
            &mut *self
                .pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        if pending.is_empty() && !flush_wanted {
            return;
        }
        // Compare-and-swaps: the close of a tunnel must not undo a renewal
        // or a re-enrollment written meanwhile. Many links to a write: on
        // etcd each is a transaction, and a failover brings thousands.
        let pending: Vec<_> = pending.into_iter().collect();
        for batch in pending.chunks(LINKS_PER_WRITE) {
            let mut swaps = Vec::with_capacity(batch.len());
            for (cluster, seen) in batch {
                match crate::link_service::link_swap(store, cluster, |link| seen.apply(link)) {
                    Ok(swap) => swaps.extend(swap),
                    Err(e) => tracing::warn!(%cluster, error = %e, "could not record last seen"),
                }
            }
            if swaps.is_empty() || store.compare_and_swap_all(&swaps).unwrap_or(false) {
                continue;
            }
            // A link changed since it was read (or the write failed): each
            // on its own, reading it again.
            for (cluster, seen) in batch {
                let touched = crate::link_service::update_link_unflushed(store, cluster, |link| {
                    seen.apply(link)
                });
                if let Err(e) = touched {
                    tracing::warn!(%cluster, error = %e, "could not record last seen");
                }
            }
        }
        if let Err(e) = store.flush() {
            tracing::warn!(links = pending.len(), error = %e, "could not flush last-seen times");
        }
    }
}

/// Writes the last-seen times tunnels record, a batch at a time (what came
/// in while one batch was written is the next), until `stop`; then what is
/// left. The hub stops it once every tunnel has closed.
pub async fn write_last_seen(state: Arc<HubState>, stop: CancellationToken) {
    loop {
        let stopping = tokio::select! {
            () = state.last_seen.wake.notified() => false,
            () = stop.cancelled() => true,
        };
        // Off the workers: on etcd a batch is a transaction per link, and
        // a thousand of them would hold a worker for a second. One batch
        // at a time, so this takes one blocking thread at most.
        let s = state.clone();
        let _ = tokio::task::spawn_blocking(move || s.last_seen.write_pending(&*s.store)).await;
        if stopping {
            return;
        }
    }
}

/// Fetches `entry`'s diagnosis again, off the caller's task, if the one
/// kept is older than the hub's `diagnosis_max_age` (a few at a time).
pub fn refresh_diagnosis(state: &Arc<HubState>, entry: &Arc<TunnelEntry>) {
    refresh_diagnosis_older_than(state, entry, state.config.diagnosis_max_age);
}

/// Tells `entry`'s agent where the hub serves tunnels now (with a new
/// diagnosis), whatever the age of the one kept. Whether a fetch was
/// started: not while another is under way, whose telling may predate
/// the caller's news.
pub fn retell_tunnel_urls(state: &Arc<HubState>, entry: &Arc<TunnelEntry>) -> bool {
    refresh_diagnosis_older_than(state, entry, std::time::Duration::ZERO)
}

fn refresh_diagnosis_older_than(
    state: &Arc<HubState>,
    entry: &Arc<TunnelEntry>,
    max_age: std::time::Duration,
) -> bool {
    if !entry.diagnosis.claim_refresh(max_age) {
        return false;
    }
    let (entry, limit, state2) = (
        entry.clone(),
        state.registry.diagnosing.clone(),
        state.clone(),
    );
    state.tasks.spawn(async move {
        if let Ok(_slot) = limit.acquire_owned().await {
            // Read once the slot is ours: a fetch queued behind a
            // thousand others tells what is true when it goes.
            let urls = crate::peers::tunnel_urls_for_agents(&state2);
            fetch_diagnosis(&urls, &entry).await;
        } else {
            entry.diagnosis.fetched();
        }
    });
    true
}

/// Asks the agent, on a stream of its own, how it got through (transports
/// tried, proxy, clock, renewals) and keeps the answer for ListLinks; tells
/// it the hub's clock and `tunnel_urls`, where the hub serves tunnels now.
/// The caller claimed the fetch ([`crate::registry::Diagnosis::claim_refresh`]).
async fn fetch_diagnosis(tunnel_urls: &[url::Url], entry: &TunnelEntry) {
    use http_body_util::BodyExt;
    let fetch = async {
        // The hub's clock, so the agent learns its skew on every tunnel.
        let mut headers = http::HeaderMap::new();
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        if let Ok(v) = http::HeaderValue::from_str(&now_ms.to_string()) {
            headers.insert(otter_tunnel::frame::HUB_TIME_HEADER, v);
        }
        // And where it serves tunnels now, which may have moved since the
        // agent registered.
        let urls: Vec<&str> = tunnel_urls.iter().map(url::Url::as_str).collect();
        if let Ok(v) = http::HeaderValue::from_str(&urls.join(",")) {
            headers.insert(otter_tunnel::frame::TUNNEL_URLS_HEADER, v);
        }
        let resp = crate::registry::ask_agent(
            entry,
            otter_tunnel::frame::TARGET_DIAG,
            http::Method::GET,
            headers,
            std::time::Duration::from_secs(10),
        )
        .await?;
        let body = http_body_util::Limited::new(resp.into_body(), 64 * 1024)
            .collect()
            .await
            .ok()?
            .to_bytes();
        serde_json::from_slice::<serde_json::Value>(&body).ok()
    };
    if let Ok(Some(diag)) = tokio::time::timeout(std::time::Duration::from_secs(10), fetch).await {
        entry.diagnosis.set(diag);
    }
    entry.diagnosis.fetched();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{SledStore, Store};

    fn read(store: &SledStore, cluster: &str) -> Option<LinkRecord> {
        store.get(tree::LINKS, cluster).unwrap()
    }

    #[test]
    fn last_seen_times_are_written_together_keeping_other_writes() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let mut link = crate::link_service::tests::link();
        link.last_transport = "h2".into();
        store.put(tree::LINKS, "edge-1", &link).unwrap();
        link.cluster = "edge-2".into();
        store.put(tree::LINKS, "edge-2", &link).unwrap();

        let seen = LastSeen::default();
        // edge-1's tunnel came up over QUIC and went down again; edge-2's
        // went down; a cluster with no link is seen too (deleted meanwhile).
        seen.record("edge-1", "quic");
        seen.record("edge-1", "");
        seen.record("edge-2", "");
        seen.record("gone", "quic");
        // A renewal written after the times were recorded stays.
        crate::link_service::update_link(&store, "edge-1", |l| {
            l.cert_serial = "02".into();
            true
        })
        .unwrap();
        assert_eq!(
            read(&store, "edge-1").unwrap().last_seen,
            1,
            "nothing written yet"
        );

        seen.write_pending(&store);
        let edge1 = read(&store, "edge-1").unwrap();
        assert_eq!(
            edge1.last_transport, "quic",
            "the transport of the last tunnel up"
        );
        assert!(edge1.last_seen > 1);
        assert_eq!(edge1.cert_serial, "02", "the renewal kept");
        let edge2 = read(&store, "edge-2").unwrap();
        assert_eq!(edge2.last_transport, "h2", "a close leaves the transport");
        assert!(edge2.last_seen > 1);
        assert!(read(&store, "gone").is_none(), "no link made for it");
        assert!(seen.pending.lock().unwrap().is_empty());
        let _ = store.flush();
    }

    /// A store counting its multi-key writes, whose first one finds a link
    /// renewed just before it (another writer's).
    struct Racing {
        inner: SledStore,
        writes: std::sync::atomic::AtomicUsize,
    }

    impl Store for Racing {
        fn get_raw(&self, tree: &str, key: &str) -> crate::Result<Option<Vec<u8>>> {
            self.inner.get_raw(tree, key)
        }
        fn put_raw(&self, tree: &str, key: &str, value: &[u8]) -> crate::Result<()> {
            self.inner.put_raw(tree, key, value)
        }
        fn delete(&self, tree: &str, key: &str) -> crate::Result<()> {
            self.inner.delete(tree, key)
        }
        fn compare_and_swap_raw(
            &self,
            tree: &str,
            key: &str,
            old: Option<&[u8]>,
            new: Option<&[u8]>,
        ) -> crate::Result<bool> {
            self.inner.compare_and_swap_raw(tree, key, old, new)
        }
        fn compare_and_swap_all(&self, swaps: &[crate::store::Swap]) -> crate::Result<bool> {
            if self
                .writes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                == 0
            {
                crate::link_service::update_link(&self.inner, &swaps[0].key, |l| {
                    l.cert_serial = "02".into();
                    true
                })?;
            }
            self.inner.compare_and_swap_all(swaps)
        }
        fn scan_raw(&self, tree: &str) -> crate::Result<Vec<(String, Vec<u8>)>> {
            self.inner.scan_raw(tree)
        }
        fn flush(&self) -> crate::Result<()> {
            self.inner.flush()
        }
        fn writable(&self) -> bool {
            true
        }
    }

    #[test]
    fn many_links_go_in_few_writes_and_a_lost_race_is_written_again() {
        let dir = tempfile::tempdir().unwrap();
        let store = Racing {
            inner: SledStore::open(dir.path()).unwrap(),
            writes: Default::default(),
        };
        let seen = LastSeen::default();
        let clusters: Vec<String> = (0..150).map(|i| format!("edge-{i:03}")).collect();
        for c in &clusters {
            let mut link = crate::link_service::tests::link();
            link.cluster.clone_from(c);
            store.put(tree::LINKS, c, &link).unwrap();
            seen.record(c, "quic");
        }
        seen.write_pending(&store);
        // Three writes of at most 64 links; the first lost its race and its
        // links went one by one.
        let writes = store.writes.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(writes, 3 + LINKS_PER_WRITE, "{writes} writes");
        let mut renewed = 0;
        for c in &clusters {
            let link: LinkRecord = store.get(tree::LINKS, c).unwrap().unwrap();
            assert_eq!(link.last_transport, "quic", "{c}");
            assert!(link.last_seen > 1, "{c}");
            renewed += usize::from(link.cert_serial == "02");
        }
        assert_eq!(renewed, 1, "the renewal written meanwhile is kept");
    }
}
