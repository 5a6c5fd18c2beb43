//! The hub as a Kubernetes API endpoint per cluster: `/clusters/<name>/…`
//! (prefix configurable). kubectl's bearer token is checked here, its
//! `Authorization` and any `Impersonate-*` headers are dropped, and the
//! request travels on its own tunnel stream to the cluster's agent, which
//! sends it to its apiserver as the verified caller.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use otter_tunnel::frame::{Limits, TARGET_KUBE};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    sync::mpsc,
};

use crate::{
    auth,
    forward::HttpBody,
    quota::{Place, Quota},
    server::HubState,
};

/// Splits `/clusters/<name>/<rest>` into the cluster and the apiserver path
/// (with the query). `None` when the path is not under the prefix.
pub fn split<'a>(prefix: &str, path_and_query: &'a str) -> Option<(&'a str, String)> {
    let rest = path_and_query.strip_prefix(prefix)?.strip_prefix('/')?;
    let (cluster, tail) = match rest.find(['/', '?']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if cluster.is_empty() {
        return None;
    }
    let tail = if tail.is_empty() || tail.starts_with('?') {
        format!("/{tail}")
    } else {
        tail.to_owned()
    };
    Some((cluster, tail))
}

/// A Kubernetes `Status` error, which kubectl prints as its usual message.
pub fn status(code: u16, reason: &str, message: &str) -> http::Response<HttpBody> {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    });
    let mut resp = http::Response::new(
        Full::new(Bytes::from(body.to_string()))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *resp.status_mut() =
        http::StatusCode::from_u16(code).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

/// Serves one request of the proxy; each is one audit line (verb, path
/// without its query, status) written when its answer starts.
pub async fn handle(
    state: Arc<HubState>,
    cluster: String,
    tail: String,
    req: http::Request<Incoming>,
) -> http::Response<HttpBody> {
    let timer = crate::audit::Timer::start();
    let mut event = crate::audit::Event {
        kind: "kube",
        action: format!(
            "{} {}",
            req.method(),
            tail.split_once('?').map_or(tail.as_str(), |(p, _)| p)
        ),
        cluster: cluster.clone(),
        remote: crate::server::ConnInfo::remote_of(req.extensions()),
        ..Default::default()
    };
    let audit = state.audit.clone();
    let resp = serve(state, cluster, tail, req, &mut event, &timer).await;
    // Sent on to the replica holding the tunnel, which writes the line.
    if event.kind.is_empty() {
        return resp;
    }
    event.code = resp.status().as_u16().to_string();
    event.duration_ms = timer.millis();
    audit.record(event);
    resp
}

async fn serve(
    state: Arc<HubState>,
    cluster: String,
    tail: String,
    mut req: http::Request<Incoming>,
    event: &mut crate::audit::Event,
    timer: &crate::audit::Timer,
) -> http::Response<HttpBody> {
    let caller = match auth::verified(req.extensions()) {
        Ok(c) => c,
        Err(e) => return crate::server::unread_body(unauthorized(e.message()), req),
    };
    let Ok(uri) = tail.parse::<http::Uri>() else {
        return crate::server::unread_body(status(400, "BadRequest", "bad request path"), req);
    };
    event.user = caller.cluster_user.clone();
    event.groups = caller.groups.clone();
    let opened = state
        .registry
        .open_call(&caller, &cluster, &*state.store, &state.config.replica)
        .await;
    let call = match opened {
        Ok(call) => call,
        Err(crate::registry::RouteError::Elsewhere(owner, place))
            if req.extensions().get::<crate::peers::FromPeer>().is_none()
                && req.headers().contains_key(http::header::UPGRADE)
                && let Some(peers) = &state.peers =>
        {
            event.kind = "";
            let to = Relayed {
                peers,
                owner: &owner,
                place,
            };
            return upgrade_through_peer(&state, to, &caller, cluster, req).await;
        }
        Err(crate::registry::RouteError::Elsewhere(owner, place))
            if req.extensions().get::<crate::peers::FromPeer>().is_none()
                && let Some(peers) = &state.peers =>
        {
            // Another replica holds the tunnel: the request goes there
            // whole and is audited there.
            event.kind = "";
            let remote = crate::server::ConnInfo::remote_of(req.extensions());
            let (mut parts, body) = req.into_parts();
            crate::forward::strip_client_headers(&mut parts.headers);
            let body = crate::limits::RequestBody::new(body, parts.version)
                .map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
                .boxed_unsync();
            return match peers
                .send(
                    &owner,
                    &caller,
                    &remote,
                    http::Request::from_parts(parts, body),
                )
                .await
            {
                Ok(resp) => crate::peers::relayed(resp, place),
                Err(e) => status(
                    503,
                    "ServiceUnavailable",
                    &format!("cluster {cluster}: {e}"),
                ),
            };
        }
        Err(e) => {
            let (code, reason) = e.http();
            return crate::server::unread_body(status(code, reason, &e.to_string()), req);
        }
    };
    event.tenant = call.tunnel.tenant.clone();
    // kubectl exec, attach, port-forward (and cp): an HTTP/1.1 Upgrade to
    // WebSocket or SPDY. Counted against the caller's and the cluster's
    // bounds before anything is relayed (after the authorization, so
    // nobody learns of another tenant's cluster from its bound).
    // From a replica relaying the caller, the protocol comes in a header
    // of its own (HTTP/2 has no Upgrade).
    let from_peer_upgrade = req
        .extensions()
        .get::<crate::peers::FromPeer>()
        .and_then(|_| req.headers().get(crate::peers::UPGRADE_HEADER).cloned());
    let upgrade = from_peer_upgrade
        .clone()
        .or_else(|| req.headers().get(http::header::UPGRADE).cloned());
    let upgrade_guard = match &upgrade {
        None => None,
        Some(_) => match state.upgrades.try_acquire(
            &state.config.kube_upgrades,
            &call.tunnel.tenant,
            &caller.cluster_user,
            &cluster,
            &state.metrics,
        ) {
            Ok(guard) => Some(guard),
            Err(full) => {
                return crate::server::unread_body(
                    status(429, "TooManyRequests", &full.to_string()),
                    req,
                );
            }
        },
    };
    let hold = crate::credentials::hold_for(&state.live, &caller);
    let on_upgrade = match (&upgrade, &from_peer_upgrade) {
        (Some(_), None) => Some(hyper::upgrade::on(&mut req)),
        _ => None,
    };
    let (mut parts, body) = req.into_parts();
    crate::forward::strip_client_headers(&mut parts.headers);
    parts.uri = uri;
    // A peer's caller: its bytes are this request's body, ours go back as
    // the response's.
    let (caller_side, peer_body, body) = match (on_upgrade, &from_peer_upgrade) {
        (Some(on_upgrade), _) => (Some(CallerSide::Upgrade(on_upgrade)), None, None),
        (None, Some(_)) => {
            let (ours, back) = bridge(&state, body);
            (Some(CallerSide::Peer(ours)), Some(back), None)
        }
        (None, None) => (None, None, Some(body)),
    };
    // An upgrade's request has no body of its own: after the switch the
    // caller's bytes follow as the tunnel stream's request body.
    let (body, upgrading) = match (upgrade, caller_side, upgrade_guard) {
        (Some(protocol), Some(caller_side), Some(guard)) => {
            parts.headers.insert(http::header::UPGRADE, protocol);
            parts.headers.insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("Upgrade"),
            );
            let (to_agent, mut rx) = mpsc::channel(4);
            let body = StreamBody::new(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)));
            (body.boxed_unsync(), Some((caller_side, to_agent, guard)))
        }
        // Drained if the agent answers before the end (HTTP/1.1 keeps
        // the connection; see `limits::RequestBody`).
        _ => match body {
            Some(body) => (
                crate::limits::RequestBody::new(body, parts.version)
                    .map_err(|e| std::io::Error::other(e.to_string()))
                    .boxed_unsync(),
                None,
            ),
            None => (
                http_body_util::Empty::new()
                    .map_err(|e| match e {})
                    .boxed_unsync(),
                None,
            ),
        },
    };
    let forwarded = otter_tunnel::http::forward(
        call.stream,
        TARGET_KUBE,
        Some(call.identity),
        http::Request::from_parts(parts, body),
        Limits::default(),
        Some(Box::new(call.permit)),
    )
    .await;
    match (forwarded, upgrading) {
        (Ok(resp), Some((caller, to_agent, guard)))
            if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS =>
        {
            let (mut parts, from_agent) = resp.into_parts();
            // A session: this line opens it, the relay's last closes it.
            event.kind = "session";
            event.phase = "open";
            let close = state.audit.enabled().then(|| SessionClose {
                audit: state.audit.clone(),
                event: crate::audit::Event {
                    phase: "close",
                    code: "101".to_owned(),
                    ..event.clone()
                },
                timer: timer.clone(),
            });
            let idle = state.config.kube_upgrades.idle_timeout;
            state.tasks.spawn(relay(
                Relay {
                    caller,
                    to_agent,
                    from_agent: from_agent
                        .map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
                        .boxed_unsync(),
                    idle,
                    _guard: Some(guard),
                    _place: None,
                    hold,
                    cluster,
                },
                close,
            ));
            match peer_body {
                None => http::Response::from_parts(parts, empty()),
                // To the relaying replica: switched, in a header; the
                // agent's bytes as the body.
                Some(body) => {
                    parts.status = http::StatusCode::OK;
                    for h in [http::header::UPGRADE, http::header::CONNECTION] {
                        parts.headers.remove(h);
                    }
                    parts.headers.insert(
                        crate::peers::SWITCHED_HEADER,
                        http::HeaderValue::from_static("1"),
                    );
                    http::Response::from_parts(parts, body)
                }
            }
        }
        // Anything else, a refused upgrade included (RBAC, no such pod), is
        // an ordinary response; a dropped sender ends the request body. A
        // long one (a watch) ends when the caller's token is revoked.
        (Ok(resp), _) => resp.map(|b| {
            HeldBody { inner: b, hold }
                .map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
                .boxed_unsync()
        }),
        (Err(e), _) => status(
            503,
            "ServiceUnavailable",
            &format!("cluster {cluster}: {e}"),
        ),
    }
}

/// The two ends of a replica-relayed upgrade on this side: the request
/// body (the caller's bytes) is written into the returned stream's peer,
/// and what the relay writes there becomes the returned response body.
fn bridge(state: &HubState, body: Incoming) -> (tokio::io::DuplexStream, HttpBody) {
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let (read, mut write) = tokio::io::split(theirs);
    state.tasks.spawn(async move {
        let mut body = body;
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data()
                && write.write_all(&data).await.is_err()
            {
                return;
            }
        }
        let _ = write.shutdown().await;
    });
    let back = futures::StreamExt::map(tokio_util::io::ReaderStream::new(read), |chunk| {
        chunk
            .map(Frame::data)
            .map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
    });
    (ours, StreamBody::new(back).boxed_unsync())
}

/// An upgraded kubectl connection for a cluster whose tunnel another
/// replica holds: the switch is asked of that replica over the peer
/// connection (the protocol in a header, the bytes as the stream's bodies)
/// and, once the agent switched, the caller's connection is relayed to it.
/// Where an upgraded connection this replica relays goes, and its call's
/// place in the tenant's bound.
struct Relayed<'a> {
    peers: &'a crate::peers::Peers,
    owner: &'a crate::peers::TunnelOwner,
    place: crate::registry::TenantPlace,
}

async fn upgrade_through_peer(
    state: &Arc<HubState>,
    Relayed {
        peers,
        owner,
        place,
    }: Relayed<'_>,
    caller: &auth::Principal,
    cluster: String,
    mut req: http::Request<Incoming>,
) -> http::Response<HttpBody> {
    let Some(protocol) = req.headers().get(http::header::UPGRADE).cloned() else {
        return status(400, "BadRequest", "no protocol to switch to");
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    let remote = crate::server::ConnInfo::remote_of(req.extensions());
    let (mut parts, _) = req.into_parts();
    crate::forward::strip_client_headers(&mut parts.headers);
    parts
        .headers
        .insert(crate::peers::UPGRADE_HEADER, protocol.clone());
    let (to_peer, mut rx) = mpsc::channel::<UpBody>(4);
    let body = StreamBody::new(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)))
        .map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
        .boxed_unsync();
    let resp = match peers
        .send(
            owner,
            caller,
            &remote,
            http::Request::from_parts(parts, body),
        )
        .await
    {
        Ok(resp) => resp,
        Err(e) => {
            return status(
                503,
                "ServiceUnavailable",
                &format!("cluster {cluster}: {e}"),
            );
        }
    };
    if !resp.headers().contains_key(crate::peers::SWITCHED_HEADER) {
        return crate::peers::relayed(resp, place);
    }
    let (mut parts, from_peer) = resp.into_parts();
    parts.status = http::StatusCode::SWITCHING_PROTOCOLS;
    parts.headers.remove(crate::peers::SWITCHED_HEADER);
    parts.headers.remove(http::header::CONTENT_LENGTH);
    parts.headers.insert(http::header::UPGRADE, protocol);
    parts.headers.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("Upgrade"),
    );
    state.tasks.spawn(relay(
        Relay {
            caller: CallerSide::Upgrade(on_upgrade),
            to_agent: to_peer,
            from_agent: from_peer
                .map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
                .boxed_unsync(),
            idle: state.config.kube_upgrades.idle_timeout,
            // Counted where the tunnel is, with the caller's tenant; the
            // tenant's bound counts it here too.
            _guard: None,
            _place: Some(place),
            hold: crate::credentials::hold_for(&state.live, caller),
            cluster,
        },
        None,
    ));
    http::Response::from_parts(parts, empty())
}

fn empty() -> HttpBody {
    http_body_util::Empty::new()
        .map_err(|e| match e {})
        .boxed_unsync()
}

type UpBody = Result<Frame<Bytes>, std::io::Error>;

/// A failed authentication, as a Kubernetes Status kubectl shows.
pub fn unauthorized(message: &str) -> http::Response<HttpBody> {
    status(401, "Unauthorized", message)
}

/// Where the caller's side of an upgraded connection is.
enum CallerSide {
    /// The caller's own HTTP/1.1 connection, once switched.
    Upgrade(hyper::upgrade::OnUpgrade),
    /// A replica relaying the caller: the caller's bytes arrive as that
    /// request's body, and go back as this response's body.
    Peer(tokio::io::DuplexStream),
}

/// The two ends of an upgraded connection, as bytes both ways.
trait Duplex: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Duplex for T {}

/// What one upgraded connection's relay holds.
struct Relay {
    caller: CallerSide,
    to_agent: mpsc::Sender<UpBody>,
    /// The agent's bytes (or, on the caller's replica, the holding
    /// replica's answer).
    from_agent: HttpBody,
    idle: Duration,
    _guard: Option<UpgradeGuard>,
    /// The call's place in its tenant's bound, on a replica relaying it.
    _place: Option<crate::registry::TenantPlace>,
    /// Ends the relay when the caller's hub token is revoked or expires.
    hold: Option<crate::credentials::Hold>,
    cluster: String,
}

/// A session's closing audit line, written when its relay ends.
struct SessionClose {
    audit: crate::audit::Audit,
    event: crate::audit::Event,
    timer: crate::audit::Timer,
}

/// Relays an upgraded connection and writes its closing audit line with
/// who ended it.
async fn relay(relay: Relay, close: Option<SessionClose>) {
    let reason = relay_bytes(relay).await;
    if let Some(mut close) = close {
        close.event.reason = reason.to_owned();
        close.event.duration_ms = close.timer.millis();
        close.audit.record(close.event);
    }
}

/// Relays an upgraded connection: the caller's bytes become DATA chunks of
/// the tunnel stream, the agent's come back as the response body. Ends when
/// the agent's side ends or fails (a dead tunnel included), after `idle`
/// without a byte either way, or when the caller's token is revoked; every
/// end drops the tunnel stream, which ends the agent's connection to its
/// apiserver, and closes the caller's. Returns who ended it.
async fn relay_bytes(relay: Relay) -> &'static str {
    let Relay {
        caller,
        to_agent,
        mut from_agent,
        idle,
        _guard,
        _place,
        mut hold,
        cluster,
    } = relay;
    let io: Box<dyn Duplex> = match caller {
        CallerSide::Upgrade(on_upgrade) => match on_upgrade.await {
            Ok(u) => Box::new(TokioIo::new(u)),
            Err(e) => {
                tracing::debug!(%cluster, error = %e, "caller left before the protocol switch");
                return "caller";
            }
        },
        CallerSide::Peer(io) => Box::new(io),
    };
    let (mut read, mut write) = tokio::io::split(io);
    let start = tokio::time::Instant::now();
    let last = AtomicU64::new(0);
    let touch = || last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
    // Owns the sender: the caller's EOF ends the request body (END), a
    // half-close the agent passes on to its apiserver.
    let up = async move {
        let mut buf = BytesMut::with_capacity(64 * 1024);
        loop {
            buf.reserve(64 * 1024);
            match read.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    touch();
                    if to_agent
                        .send(Ok(Frame::data(buf.split().freeze())))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    };
    let down = async {
        while let Some(frame) = from_agent.frame().await {
            let Ok(frame) = frame else { return };
            if let Ok(data) = frame.into_data() {
                touch();
                if write.write_all(&data).await.is_err() {
                    return;
                }
            }
        }
        let _ = write.shutdown().await;
    };
    let watchdog = async {
        loop {
            let quiet = start
                .elapsed()
                .saturating_sub(Duration::from_millis(last.load(Ordering::Relaxed)));
            if quiet >= idle {
                tracing::debug!(%cluster, "closing an idle upgraded connection");
                return;
            }
            tokio::time::sleep(idle - quiet).await;
        }
    };
    // The agent's side decides: once it ended (the apiserver closed, or
    // the tunnel died) there is nothing more to relay, and the caller is
    // told at once by the connection closing; kubectl's port-forward and
    // exec end with an error then instead of waiting on a dead tunnel.
    // The caller's EOF alone only ends the request body.
    let revoked = async {
        match &mut hold {
            Some(hold) => hold.ended().await.reason(),
            None => std::future::pending().await,
        }
    };
    tokio::pin!(up, down, watchdog, revoked);
    let mut caller_done = false;
    loop {
        tokio::select! {
            _ = &mut up, if !caller_done => caller_done = true,
            _ = &mut down => return if caller_done { "caller" } else { "cluster" },
            _ = &mut watchdog => return "idle",
            reason = &mut revoked => {
                tracing::info!(%cluster, reason, "closing an upgraded connection: its token is no longer valid");
                return reason;
            }
        }
    }
}

/// A response body that ends with an error once the caller's hub token is
/// revoked or expires (a watch through the proxy would otherwise outlive
/// it).
struct HeldBody<B> {
    inner: B,
    hold: Option<crate::credentials::Hold>,
}

impl<B> http_body::Body for HeldBody<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if let Some(hold) = &mut self.hold
            && let std::task::Poll::Ready(ended) = hold.poll_ended(cx)
        {
            self.hold = None;
            return std::task::Poll::Ready(Some(Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                ended.message(),
            ))));
        }
        std::pin::Pin::new(&mut self.inner)
            .poll_frame(cx)
            .map(|f| f.map(|r| r.map_err(std::io::Error::other)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

/// Which bound on upgraded connections is full (answered 429).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum UpgradesFull {
    #[error(
        "too many exec, attach and port-forward connections for this user (limit {0}); close one and retry"
    )]
    PerUser(usize),
    #[error(
        "too many exec, attach and port-forward connections to this cluster (limit {0}); retry later"
    )]
    PerCluster(usize),
}

/// Counts of upgraded connections per user and per cluster.
#[derive(Debug, Default)]
pub struct Upgrades {
    counts: Arc<Quota<UpgradeKey>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum UpgradeKey {
    /// Users are counted within their tenant: the same name in another
    /// tenant is someone else.
    User {
        tenant: String,
        user: String,
    },
    Cluster(String),
}

impl Upgrades {
    /// Takes one slot for `tenant`'s `user` (as the cluster sees the name)
    /// on `cluster`, or says which bound is full.
    pub fn try_acquire(
        &self,
        limits: &crate::config::KubeUpgradeLimits,
        tenant: &str,
        user: &str,
        cluster: &str,
        metrics: &Arc<crate::metrics::Metrics>,
    ) -> Result<UpgradeGuard, UpgradesFull> {
        let user = UpgradeKey::User {
            tenant: tenant.to_owned(),
            user: user.to_owned(),
        };
        let user = self
            .counts
            .take(&user, limits.per_user)
            .ok_or(UpgradesFull::PerUser(limits.per_user))?;
        // The user's place goes back if the cluster is full.
        let cluster = self
            .counts
            .take(&UpgradeKey::Cluster(cluster.to_owned()), limits.per_cluster)
            .ok_or(UpgradesFull::PerCluster(limits.per_cluster))?;
        metrics.kube_upgraded.inc();
        Ok(UpgradeGuard {
            _places: [user, cluster],
            metrics: metrics.clone(),
        })
    }

    /// Connections counted for `tenant`'s `user` right now.
    pub fn user_count(&self, tenant: &str, user: &str) -> usize {
        self.counts.held(&UpgradeKey::User {
            tenant: tenant.to_owned(),
            user: user.to_owned(),
        })
    }
}

/// One counted upgraded connection; dropping it frees the slot.
#[derive(Debug)]
pub struct UpgradeGuard {
    _places: [Place<UpgradeKey>; 2],
    metrics: Arc<crate::metrics::Metrics>,
}

impl Drop for UpgradeGuard {
    fn drop(&mut self) {
        self.metrics.kube_upgraded.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each bound holds, and a refusal by the cluster's bound keeps no
    /// place of the user's.
    #[test]
    fn upgrades_are_bounded_per_user_and_per_cluster() {
        let limits = crate::config::KubeUpgradeLimits {
            per_user: 2,
            per_cluster: 3,
            ..Default::default()
        };
        let metrics = Arc::new(crate::metrics::Metrics::default());
        let upgrades = Upgrades::default();
        let take = |user: &str, cluster: &str| {
            upgrades.try_acquire(&limits, "acme", user, cluster, &metrics)
        };
        let ann = [take("ann", "c1").unwrap(), take("ann", "c1").unwrap()];
        assert_eq!(take("ann", "c2").unwrap_err(), UpgradesFull::PerUser(2));
        let ann_elsewhere = upgrades
            .try_acquire(&limits, "globex", "ann", "c2", &metrics)
            .expect("another tenant's ann is someone else");
        let bob = take("bob", "c1").unwrap();
        assert_eq!(take("cid", "c1").unwrap_err(), UpgradesFull::PerCluster(3));
        assert_eq!(upgrades.user_count("acme", "cid"), 0);
        assert_eq!(metrics.kube_upgraded.get(), 4);
        drop((ann, bob, ann_elsewhere));
        assert_eq!(metrics.kube_upgraded.get(), 0);
        assert!(upgrades.counts.is_empty());
        assert!(take("cid", "c1").is_ok());
    }

    #[test]
    fn splits_cluster_and_path() {
        assert_eq!(
            split("/clusters", "/clusters/edge-1/api/v1/pods?limit=500"),
            Some(("edge-1", "/api/v1/pods?limit=500".into()))
        );
        assert_eq!(
            split("/clusters", "/clusters/edge-1"),
            Some(("edge-1", "/".into()))
        );
        assert_eq!(
            split("/clusters", "/clusters/edge-1?x=1"),
            Some(("edge-1", "/?x=1".into()))
        );
        assert_eq!(split("/clusters", "/clusters/"), None);
        assert_eq!(split("/clusters", "/clustersx/a"), None);
        assert_eq!(split("/k", "/k/c/version"), Some(("c", "/version".into())));
    }
}
