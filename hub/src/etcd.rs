//! The store several hub replicas share: etcd, through `etcd-client`.
//!
//! Each replica keeps a copy of the hub's keys in memory: one range read
//! fills it, and a watch from that read's revision keeps it current. Reads
//! are served from the copy, so the call path (token checks, tenancy)
//! makes no round trip to etcd. Writes go to etcd and land in the copy at
//! their revision, so a replica reads its own writes at once and the
//! others' as soon as its watch delivers them (milliseconds).
//! Compare-and-swap is an etcd transaction on the key's current value:
//! what must not race (a join token spent once, a cluster name claimed
//! once, a first-start secret made once) is decided by etcd, never by a
//! copy.
//!
//! The [`Store`] trait is synchronous, as sled is; etcd's client is not.
//! The client runs on a thread of its own, and a store call waits for its
//! answer there, bounded, like a sled write waits for its disk.

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use tokio::sync::oneshot;

use crate::{
    HubError, Result,
    store::{Store, Swap, tree},
};

/// Trees whose keys, when the copy lacks them, are asked of etcd: tokens
/// and tenants are used right after they are made, possibly on another
/// replica (a script, an agent joining through a load balancer). Nowhere
/// else: a round trip only for absent keys would let the time of an answer
/// tell an absent cluster from another tenant's. Anyone can name such a
/// key (a made-up bearer token), so these lookups are batched and bounded
/// ([`look_up`]).
const READ_THROUGH: [&str; 3] = [tree::API_TOKENS, tree::JOIN_TOKENS, tree::TENANTS];

/// Keys of the hub under etcd, unless `--store-prefix` says otherwise.
pub const DEFAULT_PREFIX: &str = "/otterscale-link/";

/// How to reach the etcd cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdOptions {
    /// `http(s)://host:port` of each member.
    pub endpoints: Vec<String>,
    /// Every key the hub writes starts with it.
    pub prefix: String,
    /// The CA that signed etcd's serving certificate: TLS on.
    pub ca_file: Option<PathBuf>,
    /// A client certificate and its key, for etcd's `--client-cert-auth`.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// etcd's own authentication (`etcdctl user add`).
    pub user: Option<String>,
    pub password: Option<String>,
    /// How long one store operation may take.
    pub timeout: Duration,
}

impl EtcdOptions {
    /// Options from `etcd://HOST:PORT[,HOST:PORT…]`.
    pub fn from_url(url: &str) -> Result<Self> {
        let hosts = url.strip_prefix("etcd://").ok_or_else(|| {
            HubError::Invalid(format!("{url:?}: a store is etcd://HOST:PORT[,HOST:PORT…]"))
        })?;
        let hosts: Vec<&str> = hosts.trim_end_matches('/').split(',').collect();
        for h in &hosts {
            let ok = h
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !ok {
                return Err(HubError::Invalid(format!(
                    "{url:?}: {h:?} is not HOST:PORT"
                )));
            }
        }
        Ok(EtcdOptions {
            endpoints: hosts.iter().map(|h| (*h).to_owned()).collect(),
            prefix: DEFAULT_PREFIX.to_owned(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            user: None,
            password: None,
            timeout: Duration::from_secs(5),
        })
    }

    fn scheme(&self) -> &'static str {
        if self.ca_file.is_some() {
            "https"
        } else {
            "http"
        }
    }

    fn connect_options(&self) -> Result<ConnectOptions> {
        // One attempt gets a part of the call's bound (see `wait_on`), and
        // a member without a leader refuses at once rather than holding the
        // request: after a member's loss the call moves on to a member of
        // the new majority within the bound.
        let mut o = ConnectOptions::new()
            .with_connect_timeout(self.timeout.min(ATTEMPT_TIMEOUT))
            .with_timeout(self.timeout.min(ATTEMPT_TIMEOUT))
            .with_require_leader(true)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        if let (Some(user), Some(password)) = (&self.user, &self.password) {
            o = o.with_user(user.clone(), password.clone());
        }
        if let Some(ca) = &self.ca_file {
            let read = |p: &PathBuf| {
                std::fs::read(p).map_err(|e| HubError::Config(format!("{}: {e}", p.display())))
            };
            let mut tls = etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(read(ca)?));
            match (&self.cert_file, &self.key_file) {
                (Some(cert), Some(key)) => {
                    tls = tls.identity(etcd_client::Identity::from_pem(read(cert)?, read(key)?));
                }
                (None, None) => {}
                _ => {
                    return Err(HubError::Config(
                        "an etcd client certificate needs both --etcd-cert-file and --etcd-key-file"
                            .into(),
                    ));
                }
            }
            o = o.with_tls(tls);
        }
        Ok(o)
    }
}

/// One key of the copy: its value (none: deleted) at its revision.
#[derive(Debug, Clone)]
struct Entry {
    value: Option<Vec<u8>>,
    revision: i64,
}

/// The replica's copy of the hub's keys.
#[derive(Debug, Default)]
struct Copy {
    /// By `<tree>/<key>`.
    entries: BTreeMap<String, Entry>,
    /// The deletions among `entries`, by revision: the markers
    /// [`Copy::advance`] forgets once the watch has passed them. Found by
    /// a scan of every entry before, on each answer of the watch: a
    /// replica taking in a reconnect storm of 10,000 agents spent a fifth
    /// of its time there (and held every reader of the copy meanwhile).
    deletions: std::collections::BTreeSet<(i64, String)>,
    /// Every change up to this revision is in.
    seen: i64,
    /// Whether the watch is following etcd now.
    following: bool,
    /// Changes taken in, per tree (the copy serves every scan).
    versions: crate::store::TreeVersions,
}

impl Copy {
    /// Takes a key's value at `revision`, unless the copy already holds a
    /// later one (a replica's own write can land before the watch brings
    /// the events before it).
    fn apply(&mut self, key: String, value: Option<Vec<u8>>, revision: i64) {
        if let Some((tree, _)) = key.split_once('/') {
            self.versions.wrote(tree);
        }
        match self.entries.get(&key) {
            Some(e) if e.revision >= revision => {}
            _ => {
                if value.is_none() {
                    self.deletions.insert((revision, key.clone()));
                }
                self.entries.insert(key, Entry { value, revision });
            }
        }
    }

    /// The watch has brought everything up to `revision`: deletions the
    /// watch has passed need no marker any more.
    fn advance(&mut self, revision: i64) {
        if revision <= self.seen {
            return;
        }
        self.seen = revision;
        while let Some(first) = self.deletions.first()
            && first.0 <= revision
        {
            let Some((at, key)) = self.deletions.pop_first() else {
                break;
            };
            // Unless written again since.
            if self
                .entries
                .get(&key)
                .is_some_and(|e| e.value.is_none() && e.revision == at)
            {
                self.entries.remove(&key);
            }
        }
    }
}

/// How long a replica's records outlive its last sign of life.
const LEASE_TTL: i64 = 10;

/// The replica's lease and what it holds: a lease etcd let expire (the
/// replica was cut off longer than its TTL) is replaced and its records
/// written again.
#[derive(Debug, Default)]
struct Lease {
    id: std::sync::atomic::AtomicI64,
    /// Full key → value.
    held: Mutex<BTreeMap<String, Vec<u8>>>,
}

/// The hub's store on etcd.
pub struct EtcdStore {
    client: Client,
    prefix: String,
    copy: Arc<Mutex<Copy>>,
    lease: Arc<Lease>,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
    /// Ticked by the watch after it brought changes.
    changed: tokio::sync::watch::Sender<u64>,
    /// Keys the copy lacks, for [`look_up`] to ask etcd.
    lookups: tokio::sync::mpsc::Sender<Lookup>,
    /// Dropped with the store: ends the client's thread.
    _stop: oneshot::Sender<()>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("prefix", &self.prefix)
            .finish()
    }
}

/// Whether an etcd error may pass if the call is made again.
enum Transient {
    Yes,
    No,
}

/// One that a retry may cure: no member reachable, no leader, no quorum,
/// a timeout (the client's own ends a call as `Cancelled`), a connection
/// that broke under the call (`Unknown`, from the transport).
fn etcd_err_ref(e: &etcd_client::Error) -> Transient {
    use etcd_client::Error as E;
    let transient = match e {
        E::TransportError(_) | E::IoError(_) => true,
        E::GRpcStatus(s) => match s.code() {
            tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Aborted
            | tonic::Code::Cancelled => true,
            tonic::Code::Unknown => std::error::Error::source(s)
                .is_some_and(|c| c.downcast_ref::<tonic::transport::Error>().is_some()),
            _ => false,
        },
        _ => false,
    };
    if transient {
        Transient::Yes
    } else {
        Transient::No
    }
}

/// An etcd error as the hub's: a transient one is
/// [`HubError::StoreUnavailable`], so callers get `Unavailable`.
fn etcd_err(e: etcd_client::Error) -> HubError {
    match etcd_err_ref(&e) {
        Transient::Yes => HubError::StoreUnavailable(format!("etcd: {e}")),
        Transient::No => HubError::Store(e.into()),
    }
}

impl EtcdStore {
    /// Connects, reads every key under the prefix and starts following
    /// changes. Blocks (bounded by the options' timeout per step).
    pub fn connect(options: &EtcdOptions) -> Result<Self> {
        if !options.prefix.starts_with('/') || !options.prefix.ends_with('/') {
            return Err(HubError::Config(format!(
                "store prefix {:?} must start and end with /",
                options.prefix
            )));
        }
        let (handle_tx, handle_rx) = std::sync::mpsc::sync_channel(1);
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("otter-etcd".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = handle_tx.send(Err(e));
                        return;
                    }
                };
                let _ = handle_tx.send(Ok(runtime.handle().clone()));
                // Until the store is dropped; the watch and every call in
                // flight end with the runtime.
                let _ = runtime.block_on(stopped);
            })?;
        let runtime = handle_rx
            .recv()
            .map_err(|_| {
                crate::store::StoreError::Thread(std::io::Error::other("it ended before starting"))
            })?
            .map_err(crate::store::StoreError::Thread)?;
        let endpoints: Vec<String> = options
            .endpoints
            .iter()
            .map(|h| format!("{}://{h}", options.scheme()))
            .collect();
        let connect_options = options.connect_options()?;
        let timeout = options.timeout;
        let client = wait_on(&runtime, timeout, move || {
            let (endpoints, options) = (endpoints.clone(), connect_options.clone());
            async move { Client::connect(endpoints, Some(options)).await }
        })?;
        let lease = Arc::new(Lease::default());
        let granted = {
            let c = client.clone();
            wait_on(&runtime, timeout, move || {
                let mut c = c.clone();
                async move { c.lease_grant(LEASE_TTL, None).await }
            })?
        };
        lease
            .id
            .store(granted.id(), std::sync::atomic::Ordering::Relaxed);
        runtime.spawn(keep_lease(client.clone(), lease.clone()));
        let copy = Arc::<Mutex<Copy>>::default();
        let (lookups, waiting) = tokio::sync::mpsc::channel(LOOKUPS_WAITING);
        runtime.spawn(look_up(
            client.clone(),
            options.prefix.clone(),
            copy.clone(),
            timeout,
            waiting,
        ));
        let store = EtcdStore {
            client,
            prefix: options.prefix.clone(),
            copy,
            lease,
            runtime,
            timeout,
            changed: tokio::sync::watch::Sender::new(0),
            lookups,
            _stop: stop,
        };
        let revision = store.reload()?;
        tracing::info!(
            endpoints = ?options.endpoints,
            prefix = %store.prefix,
            keys = store.copy.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entries.len(),
            revision,
            "store on etcd"
        );
        store.runtime.spawn(follow(
            store.client.clone(),
            store.prefix.clone(),
            store.copy.clone(),
            store.changed.clone(),
            revision,
        ));
        Ok(store)
    }

    /// Reads every key under the prefix into the copy; the revision read at.
    fn reload(&self) -> Result<i64> {
        let (client, prefix) = (self.client.clone(), self.prefix.clone());
        let all = self.wait(move || read_all(client.clone(), prefix.clone()))?;
        Ok(replace_copy(&self.copy, &self.prefix, all))
    }

    fn wait<T: Send + 'static, F>(&self, call: impl FnMut() -> F + Send + 'static) -> Result<T>
    where
        F: Future<Output = std::result::Result<T, etcd_client::Error>> + Send,
    {
        wait_on(&self.runtime, self.timeout, call)
    }

    fn key(&self, tree: &str, key: &str) -> String {
        format!("{}{tree}/{key}", self.prefix)
    }

    /// A compare-and-swap as one etcd transaction; the new value under the
    /// replica's lease when `leased`.
    fn swap(
        &self,
        tree: &str,
        key: &str,
        old: Option<&[u8]>,
        new: Option<&[u8]>,
        leased: bool,
    ) -> Result<bool> {
        let swap = Swap {
            leased,
            ..Swap::new(tree, key, old.map(<[u8]>::to_vec), new.map(<[u8]>::to_vec))
        };
        self.swap_all(std::slice::from_ref(&swap))
    }

    /// One transaction: every swap's compare, then every write (under the
    /// replica's lease where leased); when one compare fails, the keys'
    /// values instead, for the copy.
    fn swap_all(&self, swaps: &[Swap]) -> Result<bool> {
        let lease =
            PutOptions::new().with_lease(self.lease.id.load(std::sync::atomic::Ordering::Relaxed));
        let mut when = Vec::with_capacity(swaps.len());
        let mut then = Vec::with_capacity(swaps.len());
        let mut or_else = Vec::with_capacity(swaps.len());
        for s in swaps {
            let k = self.key(&s.tree, &s.key);
            when.push(match &s.old {
                Some(v) => Compare::value(k.clone(), CompareOp::Equal, v.clone()),
                // Absent: never made, or deleted since.
                None => Compare::version(k.clone(), CompareOp::Equal, 0),
            });
            if !s.checks_only() {
                then.push(match &s.new {
                    Some(v) => TxnOp::put(k.clone(), v.clone(), s.leased.then(|| lease.clone())),
                    None => TxnOp::delete(k.clone(), None),
                });
            }
            or_else.push(TxnOp::get(k, None));
        }
        let txn = Txn::new().when(when).and_then(then).or_else(or_else);
        let client = self.client.clone();
        // Sent again when a member did not take it; should a first attempt
        // have been applied after all, a later one finds every key holding
        // its `new` already, which then counts as done (below).
        let attempts = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = attempts.clone();
        let resp = self.wait(move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (mut client, txn) = (client.clone(), txn.clone());
            async move { client.txn(txn).await }
        })?;
        let retried = attempts.load(std::sync::atomic::Ordering::Relaxed) > 1;
        let revision = resp.header().map_or(0, |h| h.revision());
        let mut copy = self
            .copy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if resp.succeeded() {
            for s in swaps.iter().filter(|s| !s.checks_only()) {
                // What the lease holds is written again should etcd let
                // the lease go.
                let mut held = self
                    .lease
                    .held
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                match &s.new {
                    Some(v) if s.leased => {
                        held.insert(self.key(&s.tree, &s.key), v.clone());
                    }
                    None => {
                        held.remove(&self.key(&s.tree, &s.key));
                    }
                    Some(_) => {}
                }
                drop(held);
                copy.apply(format!("{}/{}", s.tree, s.key), s.new.clone(), revision);
            }
            return Ok(true);
        }
        // Lost: the copy learns the values that won. Unless, after a retry,
        // those values are the `new` ones: the earlier attempt was applied
        // although its answer never came. (Without a retry equal values
        // are another writer's: a counter two writers both moved to 5.)
        let mut holds_new = true;
        let gets = resp.op_responses().into_iter().filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get),
            _ => None,
        });
        for (s, get) in swaps.iter().zip(gets) {
            let name = format!("{}/{}", s.tree, s.key);
            match get.kvs().first() {
                Some(kv) => {
                    holds_new &= s.new.as_deref() == Some(kv.value());
                    copy.apply(name, Some(kv.value().to_vec()), kv.mod_revision());
                }
                None => {
                    holds_new &= s.new.is_none();
                    copy.apply(name, None, revision);
                }
            }
        }
        Ok(retried && holds_new)
    }

    /// One put, then the value in the copy at the put's revision.
    fn put_with(
        &self,
        tree: &str,
        key: &str,
        value: &[u8],
        options: Option<PutOptions>,
    ) -> Result<()> {
        let (client, k, v) = (self.client.clone(), self.key(tree, key), value.to_vec());
        // A put is idempotent: sent again when a member did not take it.
        let resp = self.wait(move || {
            let (mut client, k, v, options) =
                (client.clone(), k.clone(), v.clone(), options.clone());
            async move { client.put(k, v, options).await }
        })?;
        let revision = resp.header().map_or(0, |h| h.revision());
        self.copy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .apply(format!("{tree}/{key}"), Some(value.to_vec()), revision);
        Ok(())
    }
}

/// A key the copy lacks (`tree/key`) and where its value goes.
struct Lookup {
    name: String,
    answer: std::sync::mpsc::SyncSender<Result<Option<Vec<u8>>>>,
}

/// Keys asked of etcd in one transaction (etcd takes 128 by default).
const LOOKUP_BATCH: usize = 64;

/// Lookups that may wait behind the transaction in flight; one more is
/// refused at once ([`HubError::Busy`]).
const LOOKUPS_WAITING: usize = 64;

/// Asks etcd for the keys the copy lacks, one transaction at a time, each
/// for every lookup waiting then. Anyone who can reach the API port can
/// make a lookup (a bearer token names the key it is kept under), so the
/// work it costs etcd is one request per round trip however many callers
/// there are, and while etcd does not answer (no quorum: the whole bound)
/// at most the batch and the queue wait, each holding a thread.
async fn look_up(
    client: Client,
    prefix: String,
    copy: Arc<Mutex<Copy>>,
    timeout: Duration,
    mut waiting: tokio::sync::mpsc::Receiver<Lookup>,
) {
    let mut batch = Vec::with_capacity(LOOKUP_BATCH);
    while waiting.recv_many(&mut batch, LOOKUP_BATCH).await > 0 {
        let mut names: Vec<&str> = batch.iter().map(|l: &Lookup| l.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        let gets: Vec<TxnOp> = names
            .iter()
            .map(|n| TxnOp::get(format!("{prefix}{n}"), None))
            .collect();
        let txn = Txn::new().and_then(gets);
        let c = client.clone();
        let answer = retrying(timeout, move || {
            let (mut c, txn) = (c.clone(), txn.clone());
            async move { c.txn(txn).await }
        })
        .await;
        let found = answer.map(|resp| {
            let mut copy = copy
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut found = HashMap::new();
            for op in resp.op_responses() {
                let TxnOpResponse::Get(get) = op else {
                    continue;
                };
                for kv in get.kvs() {
                    let Some(name) = kv.key().strip_prefix(prefix.as_bytes()) else {
                        continue;
                    };
                    let name = String::from_utf8_lossy(name).into_owned();
                    copy.apply(name.clone(), Some(kv.value().to_vec()), kv.mod_revision());
                    found.insert(name, kv.value().to_vec());
                }
            }
            found
        });
        for Lookup { name, answer } in batch.drain(..) {
            let _ = answer.send(match &found {
                Ok(found) => Ok(found.get(&name).cloned()),
                Err(HubError::StoreUnavailable(e)) => Err(HubError::StoreUnavailable(e.clone())),
                Err(HubError::Store(e)) => {
                    Err(crate::store::StoreError::Lookup(e.to_string()).into())
                }
                Err(e) => Err(crate::store::StoreError::Lookup(e.to_string()).into()),
            });
        }
    }
}

/// Bound of the readiness probe's write.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Runs `call` on the client's thread and waits for it, at most `timeout`
/// in all. A call that fails in a way a retry may cure (the member it went
/// to is down or gone, no leader yet) is made again until then, so one
/// member down changes nothing for the hub: the client's balancing across
/// members still sends a request to a dead one now and then.
fn wait_on<T: Send + 'static, F>(
    runtime: &tokio::runtime::Handle,
    timeout: Duration,
    call: impl FnMut() -> F + Send + 'static,
) -> Result<T>
where
    F: Future<Output = std::result::Result<T, etcd_client::Error>> + Send,
{
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    runtime.spawn(async move {
        let _ = tx.send(retrying(timeout, call).await);
    });
    receive(&rx)
}

/// `call`, made again while it fails in a way a retry may cure, until
/// `timeout` in all.
async fn retrying<T, F>(timeout: Duration, mut call: impl FnMut() -> F) -> Result<T>
where
    F: Future<Output = std::result::Result<T, etcd_client::Error>>,
{
    // Until the bound: a member's loss can cost an election (a second or
    // two without a leader) before the others take writes again.
    let attempts = async {
        let mut pause = RETRY_PAUSE;
        loop {
            match call().await {
                Err(e) if matches!(etcd_err_ref(&e), Transient::Yes) => {
                    tracing::debug!(error = %e, ?pause, "etcd call failed; again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RETRY_PAUSE_MAX);
                }
                other => return other,
            }
        }
    };
    match tokio::time::timeout(timeout, attempts).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(etcd_err(e)),
        Err(_) => Err(HubError::StoreUnavailable(format!(
            "etcd: no answer within {timeout:?}"
        ))),
    }
}

/// The answer of a store call made on the client's thread, waited for on
/// the caller's. Most answers come within a millisecond or two: waited
/// for in place. A longer wait (no quorum: the whole bound) lets the
/// worker go first.
fn receive<T>(rx: &std::sync::mpsc::Receiver<Result<T>>) -> Result<T> {
    let answer = match rx.recv_timeout(QUICK_ANSWER) {
        Ok(answer) => Ok(answer),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => wait_off_the_runtime(|| rx.recv()),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(std::sync::mpsc::RecvError),
    };
    answer.unwrap_or_else(|_| {
        Err(HubError::StoreUnavailable(
            "etcd: the client has stopped".into(),
        ))
    })
}

/// How long a store call holds the worker it was made on before the
/// worker goes on without it. Handing the worker over costs a thread
/// switch and, per new thread, a malloc arena (hub RSS per tunnel went
/// from 57-59 to 69-81 KiB when every sled flush did it), so the common
/// quick answer is waited for in place.
const QUICK_ANSWER: Duration = Duration::from_millis(20);

/// Runs `wait`, which blocks (on the store, up to its bound), without
/// holding a worker of a multi-threaded runtime: the store's callers are
/// request handlers on the hub's runtime, and without a quorum each write
/// waits out the bound, so a few writes at once would hold every worker
/// (and the tasks queued behind them): tunnels would go unanswered until
/// their agents called them dead. Elsewhere (a blocking thread, a runtime
/// of one thread, no runtime) it just blocks.
fn wait_off_the_runtime<R>(wait: impl FnOnce() -> R) -> R {
    let on_worker = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if on_worker {
        tokio::task::block_in_place(wait)
    } else {
        wait()
    }
}

/// The longest one attempt of an etcd call may take.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// Pauses between attempts of one etcd call in [`wait_on`]: doubling from
/// the first to the last.
const RETRY_PAUSE: Duration = Duration::from_millis(50);
const RETRY_PAUSE_MAX: Duration = Duration::from_millis(800);

/// Keeps the replica's lease alive; when etcd let it expire anyway, takes
/// a new one and writes the records it held again.
async fn keep_lease(client: Client, lease: Arc<Lease>) {
    use std::sync::atomic::Ordering::Relaxed;
    let beat = Duration::from_secs((LEASE_TTL / 3).max(1) as u64);
    loop {
        let id = lease.id.load(Relaxed);
        let mut c = client.clone();
        if let Ok((mut keeper, mut answers)) = c.lease_keep_alive(id).await {
            loop {
                if keeper.keep_alive().await.is_err() {
                    break;
                }
                match answers.message().await {
                    Ok(Some(a)) if a.ttl() > 0 => tokio::time::sleep(beat).await,
                    _ => break,
                }
            }
        }
        // Still ours after a hiccup? Keep it; gone: a new one.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut c = client.clone();
        let alive = c
            .lease_time_to_live(id, None)
            .await
            .is_ok_and(|t| t.ttl() > 0);
        if alive {
            continue;
        }
        let Ok(granted) = c.lease_grant(LEASE_TTL, None).await else {
            continue;
        };
        lease.id.store(granted.id(), Relaxed);
        rewrite_held(&mut c, &lease, granted.id()).await;
    }
}

/// Writes what the replica holds again under its new lease `id`. etcd
/// that has just got its quorum back may refuse a put for a moment: one
/// refused is tried again (what the replica still holds then, as it holds
/// it then) for about a lease's time to live, after which the lease is
/// checked, and maybe replaced, again.
async fn rewrite_held(client: &mut Client, lease: &Lease, id: i64) {
    let mut pending: Option<Vec<String>> = None;
    for _ in 0..LEASE_TTL * 2 {
        let todo: Vec<(String, Vec<u8>)> = {
            let held = lease
                .held
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match &pending {
                None => held.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                Some(keys) => keys
                    .iter()
                    .filter_map(|k| Some((k.clone(), held.get(k)?.clone())))
                    .collect(),
            }
        };
        if pending.is_none() {
            tracing::warn!(
                records = todo.len(),
                "the replica's etcd lease expired; writing its records again"
            );
        }
        let mut failed = Vec::new();
        for (k, v) in todo {
            let options = PutOptions::new().with_lease(id);
            if let Err(e) = client.put(k.clone(), v, Some(options)).await {
                tracing::debug!(error = %e, "could not write a record again; trying again");
                failed.push(k);
            }
        }
        if failed.is_empty() {
            return;
        }
        pending = Some(failed);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tracing::warn!("could not write the replica's records again; checking its lease");
}

/// Every key and value under `prefix` with its revision, and the revision
/// the read was made at.
type Snapshot = (Vec<(String, Vec<u8>, i64)>, i64);

async fn read_all(
    mut client: Client,
    prefix: String,
) -> std::result::Result<Snapshot, etcd_client::Error> {
    let end = range_end(prefix.as_bytes());
    let mut kvs = Vec::new();
    let mut from = prefix.as_bytes().to_vec();
    // The first page's revision, for every page: one consistent read.
    let mut revision = None;
    let mut page = READ_PAGE;
    loop {
        let mut options = GetOptions::new().with_range(end.clone()).with_limit(page);
        if let Some(r) = revision {
            options = options.with_revision(r);
        }
        let resp = match client.get(from.clone(), Some(options)).await {
            Ok(resp) => resp,
            // Larger than the client takes in one answer: fewer at once.
            // One key always fits (etcd takes no value over 1.5 MiB).
            Err(etcd_client::Error::GRpcStatus(status))
                if status.code() == tonic::Code::OutOfRange && page > 1 =>
            {
                page /= 2;
                continue;
            }
            Err(e) => return Err(e),
        };
        let at = *revision.get_or_insert(resp.header().map_or(0, |h| h.revision()));
        kvs.extend(resp.kvs().iter().map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.value().to_vec(),
                kv.mod_revision(),
            )
        }));
        match resp.kvs().last() {
            Some(last) if resp.more() => {
                // The next page starts just after the last key read.
                from = last.key().to_vec();
                from.push(0);
            }
            _ => return Ok((kvs, at)),
        }
    }
}

/// Keys a full read asks for at once. One answer holding every key was
/// refused by the client past 4 MiB (its bound on a message): a replica
/// of a hub with 10,000 clusters could not start. Pages of this many keys
/// stay far below it (a link's record is well under a KiB); a page that
/// does not is asked again in halves.
const READ_PAGE: i64 = 500;

/// The end of the range of keys that start with `prefix` (as etcd's
/// `--prefix` reads it): the prefix with its last byte below 0xff
/// incremented, and what follows cut.
fn range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff (or none): to the end of the key space.
    vec![0]
}

/// Makes the copy what a full read found: keys it lacks were deleted.
fn replace_copy(copy: &Mutex<Copy>, prefix: &str, (kvs, revision): Snapshot) -> i64 {
    let mut copy = copy
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut fresh = BTreeMap::new();
    for (key, value, rev) in kvs {
        if let Some(k) = key.strip_prefix(prefix) {
            fresh.insert(
                k.to_owned(),
                Entry {
                    value: Some(value),
                    revision: rev,
                },
            );
        }
    }
    // A write of this replica newer than the read stays.
    for (k, e) in std::mem::take(&mut copy.entries) {
        if e.revision > revision {
            fresh.insert(k, e);
        }
    }
    copy.deletions = fresh
        .iter()
        .filter(|(_, e)| e.value.is_none())
        .map(|(k, e)| (e.revision, k.clone()))
        .collect();
    copy.entries = fresh;
    copy.versions.wrote_all();
    copy.seen = revision;
    copy.following = true;
    revision
}

/// The largest answer of a watch taken in. A watch that starts behind
/// (made again after a break, while replicas wrote) gets the changes of up
/// to 1,000 revisions in one answer, far over the client's default 4 MiB
/// in a reconnect storm of thousands of agents: refused, the watch would
/// be made again from the same revision, refused again, and the copy would
/// stay behind for good. etcd itself is trusted (the operator's), and a
/// revision holds at most 1.5 MiB.
const WATCH_ANSWER_MAX: usize = 256 << 20;

/// Follows every change under `prefix` from `revision` on, for as long as
/// the client's thread runs. A broken watch is made again from where it
/// stopped; one whose history etcd compacted away reads everything anew.
async fn follow(
    client: Client,
    prefix: String,
    copy: Arc<Mutex<Copy>>,
    changed: tokio::sync::watch::Sender<u64>,
    mut revision: i64,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut c = client
            .watch_client()
            .max_decoding_message_size(WATCH_ANSWER_MAX);
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let mut stream = match c.watch(prefix.as_bytes(), Some(options)).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "etcd watch failed; retrying");
                copy.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .following = false;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        loop {
            match stream.message().await {
                Ok(Some(resp)) if resp.compact_revision() > 0 => {
                    tracing::warn!(
                        compacted = resp.compact_revision(),
                        "etcd compacted past the watch; reading every key again"
                    );
                    match read_all(client.clone(), prefix.clone()).await {
                        Ok(all) => {
                            revision = replace_copy(&copy, &prefix, all);
                            changed.send_modify(|n| *n = n.wrapping_add(1));
                        }
                        Err(e) => tracing::warn!(error = %e, "etcd read failed"),
                    }
                    break;
                }
                Ok(Some(resp)) if resp.canceled() => break,
                Ok(Some(resp)) => {
                    backoff = Duration::from_millis(100);
                    let mut copy = copy
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    let brought = !resp.events().is_empty();
                    copy.following = true;
                    for event in resp.events() {
                        let Some(kv) = event.kv() else { continue };
                        let key = String::from_utf8_lossy(kv.key());
                        let Some(k) = key.strip_prefix(prefix.as_str()) else {
                            continue;
                        };
                        let value = match event.event_type() {
                            EventType::Put => Some(kv.value().to_vec()),
                            EventType::Delete => None,
                        };
                        copy.apply(k.to_owned(), value, kv.mod_revision());
                        revision = revision.max(kv.mod_revision());
                    }
                    copy.advance(revision);
                    drop(copy);
                    if brought {
                        changed.send_modify(|n| *n = n.wrapping_add(1));
                    }
                }
                Ok(None) | Err(_) => {
                    copy.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .following = false;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    break;
                }
            }
        }
    }
}

impl Store for EtcdStore {
    fn stamp(&self, tree: &str, key: &str) -> Option<i64> {
        let copy = self
            .copy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Some(
            copy.entries
                .get(&format!("{tree}/{key}"))
                .map_or(0, |e| e.revision),
        )
    }

    fn get_raw(&self, tree: &str, key: &str) -> Result<Option<Vec<u8>>> {
        let name = format!("{tree}/{key}");
        if let Some(e) = self
            .copy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entries
            .get(&name)
        {
            return Ok(e.value.clone());
        }
        if !READ_THROUGH.contains(&tree) {
            return Ok(None);
        }
        // A token minted on another replica a moment ago, used here at
        // once (a script, an agent joining through a load balancer).
        let (answer, rx) = std::sync::mpsc::sync_channel(1);
        self.lookups
            .try_send(Lookup { name, answer })
            .map_err(|e| match e {
                tokio::sync::mpsc::error::TrySendError::Full(_) => HubError::Busy(
                    "the hub is looking up too many unknown credentials at once; retry this later"
                        .into(),
                ),
                tokio::sync::mpsc::error::TrySendError::Closed(_) => {
                    HubError::StoreUnavailable("etcd: the client has stopped".into())
                }
            })?;
        receive(&rx)
    }

    fn put_raw(&self, tree: &str, key: &str, value: &[u8]) -> Result<()> {
        self.put_with(tree, key, value, None)
    }

    fn put_leased(&self, tree: &str, key: &str, value: &[u8]) -> Result<()> {
        let id = self.lease.id.load(std::sync::atomic::Ordering::Relaxed);
        self.put_with(tree, key, value, Some(PutOptions::new().with_lease(id)))?;
        self.lease
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(self.key(tree, key), value.to_vec());
        Ok(())
    }

    fn delete(&self, tree: &str, key: &str) -> Result<()> {
        self.lease
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.key(tree, key));
        let (client, k) = (self.client.clone(), self.key(tree, key));
        let resp = self.wait(move || {
            let (mut client, k) = (client.clone(), k.clone());
            async move { client.delete(k, None).await }
        })?;
        let revision = resp.header().map_or(0, |h| h.revision());
        self.copy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .apply(format!("{tree}/{key}"), None, revision);
        Ok(())
    }

    fn compare_and_swap_raw(
        &self,
        tree: &str,
        key: &str,
        old: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<bool> {
        self.swap(tree, key, old, new, false)
    }

    fn compare_and_swap_all(&self, swaps: &[Swap]) -> Result<bool> {
        self.swap_all(swaps)
    }

    fn compare_and_swap_leased(
        &self,
        tree: &str,
        key: &str,
        old: Option<&[u8]>,
        new: &[u8],
    ) -> Result<bool> {
        self.swap(tree, key, old, Some(new), true)
    }

    fn scan_raw(&self, tree: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let start = format!("{tree}/");
        let copy = self
            .copy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(copy
            .entries
            .range(start.clone()..)
            .take_while(|(k, _)| k.starts_with(&start))
            .filter_map(|(k, e)| Some((k[start.len()..].to_owned(), e.value.clone()?)))
            .collect())
    }

    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.changed.subscribe())
    }

    fn version(&self, tree: &str) -> Option<u64> {
        Some(
            self.copy
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .versions
                .of(tree),
        )
    }

    /// etcd answers a write once a quorum has it on disk.
    fn flush(&self) -> Result<()> {
        Ok(())
    }

    /// Following the store and a probe write answered within a second: a
    /// readiness probe must not wait out the store's own timeout when etcd
    /// has lost its quorum.
    fn writable(&self) -> bool {
        if !self
            .copy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .following
        {
            return false;
        }
        let (client, k) = (self.client.clone(), self.key(tree::META, "health-probe"));
        wait_on(&self.runtime, PROBE_TIMEOUT, move || {
            let (mut client, k) = (client.clone(), k.clone());
            async move { client.put(k, b"1".to_vec(), None).await }
        })
        .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_urls() {
        let o = EtcdOptions::from_url("etcd://10.0.0.1:2379,etcd-1.etcd:2379").unwrap();
        assert_eq!(o.endpoints, vec!["10.0.0.1:2379", "etcd-1.etcd:2379"]);
        assert_eq!(o.prefix, DEFAULT_PREFIX);
        for bad in [
            "http://a:1",
            "etcd://",
            "etcd://a",
            "etcd://a:x",
            "etcd://:1",
        ] {
            assert!(EtcdOptions::from_url(bad).is_err(), "{bad}");
        }
    }

    /// A watch made again far behind takes the changes it missed, 6 MiB
    /// of them in one answer of etcd.
    #[test]
    fn a_watch_far_behind_takes_answers_over_4_mib() {
        let Some(etcd) = otter_e2e::etcd::Etcd::start() else {
            return;
        };
        let endpoints = EtcdOptions::from_url(&etcd.url()).unwrap().endpoints;
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let mut client = Client::connect(endpoints, None).await.unwrap();
            let from = client.get("/p/", None).await.unwrap();
            let from = from.header().unwrap().revision();
            for i in 0..6u8 {
                let key = format!("/p/ballast/k{i}");
                client
                    .put(key, vec![b'a' + i; 1 << 20], None)
                    .await
                    .unwrap();
            }
            let copy = Arc::new(Mutex::new(Copy::default()));
            let (changed, _seen) = tokio::sync::watch::channel(0);
            let following = tokio::spawn(follow(client, "/p/".into(), copy.clone(), changed, from));
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let held = || copy.lock().unwrap().entries.len();
            while held() < 6 && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            following.abort();
            assert_eq!(held(), 6, "the copy took in every change");
            let copy = copy.lock().unwrap();
            assert_eq!(
                copy.entries["ballast/k5"].value.as_deref(),
                Some(&vec![b'f'; 1 << 20][..])
            );
        });
    }

    #[test]
    fn a_prefix_range_ends_after_its_last_key() {
        assert_eq!(range_end(b"/otterscale-link/"), b"/otterscale-link0");
        assert_eq!(range_end(b"a\xff"), b"b");
        assert_eq!(range_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn the_copy_keeps_the_latest_revision_and_forgets_passed_deletions() {
        let mut c = Copy::default();
        c.apply("links/a".into(), Some(b"2".to_vec()), 7);
        // An older event the watch brings after the replica's own write.
        c.apply("links/a".into(), Some(b"1".to_vec()), 5);
        assert_eq!(c.entries["links/a"].value.as_deref(), Some(&b"2"[..]));
        c.apply("links/b".into(), None, 9);
        c.advance(8);
        assert!(c.entries.contains_key("links/b"), "not passed yet");
        // Its PUT from before the deletion must not bring it back.
        c.apply("links/b".into(), Some(b"old".to_vec()), 6);
        assert!(c.entries["links/b"].value.is_none());
        c.advance(9);
        assert!(!c.entries.contains_key("links/b"));
        // A key deleted and written again keeps its value past the
        // deletion's revision; no marker is left behind.
        c.apply("links/c".into(), None, 10);
        c.apply("links/c".into(), Some(b"back".to_vec()), 11);
        c.advance(11);
        assert_eq!(c.entries["links/c"].value.as_deref(), Some(&b"back"[..]));
        assert!(c.deletions.is_empty());
    }

    /// A tree's version moves with every change the copy takes in for it
    /// (this replica's writes and the watch's alike), and every tree's when
    /// the copy is read anew; other trees' stay.
    #[test]
    fn the_copys_versions_move_with_what_it_takes_in() {
        let copy = Mutex::new(Copy::default());
        let of = |tree: &str| copy.lock().unwrap().versions.of(tree);
        let (links, tokens) = (of("links"), of("tokens"));
        copy.lock()
            .unwrap()
            .apply("links/a".into(), Some(b"1".to_vec()), 3);
        assert_ne!(of("links"), links);
        assert_eq!(of("tokens"), tokens);
        let links = of("links");
        copy.lock().unwrap().apply("links/a".into(), None, 4);
        assert_ne!(of("links"), links);
        let (links, tokens) = (of("links"), of("tokens"));
        replace_copy(
            &copy,
            "/p/",
            (vec![("/p/tokens/t".into(), b"x".to_vec(), 5)], 5),
        );
        assert_ne!(of("links"), links);
        assert_ne!(of("tokens"), tokens);
    }
}
