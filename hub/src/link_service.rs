//! `otterscale.link.v1.LinkService`: agents register, operators list links.

use std::{collections::BTreeMap, sync::Arc};

use otter_pki::{AgentIdentity, PkiError, identity::PeerCertificate};
use otter_proto::link::v1::{
    GetAgentManifestRequest, GetAgentManifestResponse, Link, LinkState, ListLinksRequest,
    ListLinksResponse, ListRancherProjectsRequest, ListRancherProjectsResponse, RegisterRequest,
    RegisterResponse, link_service_server::LinkService,
};
use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status};

use crate::{
    auth, manifest,
    registry::drain,
    server::{ConnInfo, HubState},
    store::{StoreExt, tree},
    tokens::{self, JoinTokenError},
    unix_now,
};

/// Request header naming the tenant a manifest is for.
pub const TENANT_HEADER: &str = "otter-tenant";

/// Longest agent version string accepted.
/// The path of Register, the one method the tunnel port answers.
pub const REGISTER_PATH: &str = "/otterscale.link.v1.LinkService/Register";

/// The path of ListLinks, answered by [`serve_list_links`].
pub const LIST_LINKS_PATH: &str = "/otterscale.link.v1.LinkService/ListLinks";

const MAX_VERSION_LEN: usize = 64;
/// Longest Rancher project id accepted.
const MAX_RANCHER_ID_LEN: usize = 253;
/// How many times one Register reads and writes again after losing a race
/// for its token, its cluster's name or its link: each loss means another
/// writer got there, and the next read says who.
const MAX_REGISTER_PASSES: u32 = 8;

/// A link as stored: one per cluster, the latest registered agent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LinkRecord {
    pub cluster: String,
    /// The tenant the cluster belongs to (links of hubs from before
    /// tenancy: `default`).
    #[serde(default = "default_tenant")]
    pub tenant: String,
    pub agent_id: String,
    pub agent_version: String,
    #[serde(default)]
    pub rancher_project_id: String,
    pub cert_serial: String,
    /// The certificate the agent renewed with, accepted beside
    /// `cert_serial` until a tunnel on the new one is admitted (the agent
    /// may not have received it). Any other certificate of the cluster, a
    /// copy of an older one say, is refused at the tunnel and at renewal.
    #[serde(default)]
    pub prev_serial: Option<String>,
    /// This agent's own enrollment retries answered before the one in
    /// `prev_serial`, newest first, at most [`RETRIES_KEPT`]: when three or
    /// more of its Registers on one token raced, the agent holds whichever
    /// answer reached it, and that may be any of them. Accepted and retired
    /// with `prev_serial`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retried_serials: Vec<String>,
    /// Unix seconds.
    pub cert_not_after: i64,
    pub first_seen: i64,
    pub last_seen: i64,
    #[serde(default)]
    pub last_transport: String,
    /// Fingerprint of the CA that signed the current certificate.
    #[serde(default)]
    pub cert_ca: String,
    /// Fingerprints of the CAs the agent was told to trust at its last
    /// Register (it follows them): a CA rotation waits for these.
    #[serde(default)]
    pub trusted_cas: Vec<String>,
    /// Set by an admin's re-enrollment (unix seconds): the cluster then
    /// takes one join token authorized at or after this, whose agent
    /// replaces the current one. Cleared by that Register.
    #[serde(default)]
    pub reenroll_after: Option<i64>,
    /// Labels that select the cluster for fan-out calls: from its join
    /// token at enrollment, then changed by FleetService.LabelLink.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

fn default_tenant() -> String {
    crate::tenancy::DEFAULT_TENANT.to_owned()
}

impl LinkRecord {
    /// Whether a certificate with `serial` is this link's: the one last
    /// issued, or the one its agent renewed with.
    pub fn holds(&self, serial: &str) -> bool {
        self.cert_serial == serial
            || self.prev_serial.as_deref() == Some(serial)
            || self.retried_serials.iter().any(|s| s == serial)
    }

    /// Whether a certificate other than the newest is still accepted.
    pub fn keeps_older(&self) -> bool {
        self.prev_serial.is_some() || !self.retried_serials.is_empty()
    }

    /// Retires every certificate but the newest.
    pub fn forget_older(&mut self) {
        self.prev_serial = None;
        self.retried_serials.clear();
    }
}

/// Enrollment retries of one agent whose certificates a link accepts
/// beside the newest two ([`LinkRecord::retried_serials`]). An agent asks
/// again only after giving up on an answer, so a few at once is already
/// a hub far behind; more are not kept, and an agent holding one of
/// those is refused until an admin re-enrolls it.
pub const RETRIES_KEPT: usize = 4;

/// Renewals of one cluster are at least this far apart.
pub const MIN_RENEWAL_GAP: std::time::Duration = std::time::Duration::from_secs(2);

/// When each cluster last renewed, to keep renewals [`MIN_RENEWAL_GAP`]
/// apart.
#[derive(Debug, Default)]
pub struct RenewalGaps {
    last: std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>,
}

impl RenewalGaps {
    /// Records a renewal of `cluster` now, or says how long until one may.
    pub fn try_renew(&self, cluster: &str) -> Result<(), std::time::Duration> {
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = std::time::Instant::now();
        if let Some(at) = last.get(cluster) {
            let since = now.duration_since(*at);
            if since < MIN_RENEWAL_GAP {
                return Err(MIN_RENEWAL_GAP - since);
            }
        }
        // Entries past the gap say nothing: dropped once there are many.
        if last.len() >= 10_000 {
            last.retain(|_, at| now.duration_since(*at) < MIN_RENEWAL_GAP);
        }
        last.insert(cluster.to_owned(), now);
        Ok(())
    }
}

/// The LinkService handlers.
#[derive(Debug, Clone)]
pub struct LinkSvc {
    pub state: Arc<HubState>,
}

fn timestamp(secs: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: secs,
        nanos: 0,
    }
}

fn printable(s: &str) -> bool {
    s.chars().all(|c| !c.is_control())
}

impl LinkSvc {
    async fn register_inner(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let conn = request.extensions().get::<Arc<ConnInfo>>().cloned();
        let req = request.into_inner();
        let cluster = req.cluster.unwrap_or_default();
        let agent_id = req.agent_id.unwrap_or_default();
        let agent_version = req.agent_version.unwrap_or_default();
        let rancher_project_id = req.rancher_project_id.unwrap_or_default();
        let identity = AgentIdentity::new(&cluster, &agent_id)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        if agent_version.is_empty()
            || agent_version.len() > MAX_VERSION_LEN
            || !printable(&agent_version)
        {
            return Err(Status::invalid_argument(format!(
                "agent_version must be 1 to {MAX_VERSION_LEN} printable characters"
            )));
        }
        if rancher_project_id.len() > MAX_RANCHER_ID_LEN || !printable(&rancher_project_id) {
            return Err(Status::invalid_argument(
                "rancher_project_id is too long or not printable",
            ));
        }
        let csr = req.csr.unwrap_or_default();
        if csr.is_empty() {
            return Err(Status::invalid_argument(
                "csr is empty: send a PEM PKCS#10 request for the agent's key",
            ));
        }
        let csr = std::str::from_utf8(&csr)
            .map_err(|_| Status::invalid_argument("csr must be PEM text"))?;

        // The tunnel port renews and nothing else: a join token is for the
        // API port, which an enrolling agent reaches anyway.
        if conn.as_ref().is_some_and(|c| c.tunnel_port)
            && req.join_token.as_deref().is_some_and(|t| !t.is_empty())
        {
            return Err(Status::permission_denied(
                "the tunnel port renews with the agent's certificate only; enroll with a join token on the API port",
            ));
        }
        // Of two Registers racing for one token or one name, one wins; the
        // other's next pass reads what won and answers as it says (a renewal
        // writes its link alone and never passes again).
        let enrolment = Enrolment {
            conn: conn.as_deref(),
            cluster: &cluster,
            agent_id: &agent_id,
            agent_version: &agent_version,
            rancher_project_id: &rancher_project_id,
            csr,
            identity: &identity,
            join_token: req.join_token.as_deref().filter(|t| !t.is_empty()),
        };
        let mut passes = 0;
        let (cas, issued) = loop {
            passes += 1;
            if passes > MAX_REGISTER_PASSES {
                return Err(Status::aborted(format!(
                    "cluster {cluster} is being written by others at the same time; retry"
                )));
            }
            if let Some(done) = self.register_pass(&enrolment)? {
                break done;
            }
        };
        // Latest agent wins: a tunnel of the agent this one replaces is
        // drained and closed.
        if let Some(old) = self.state.registry.take_if_other_agent(&cluster, &agent_id) {
            drain(
                old,
                self.state.config.drain_timeout,
                "replaced by a newly registered agent",
            );
        }
        tracing::info!(%cluster, %agent_id, serial = %issued.serial, "agent registered");

        // This replica's first, then the other live replicas'.
        let tunnel_urls: Vec<String> = crate::peers::tunnel_urls_for_agents(&self.state)
            .iter()
            .map(|u| u.to_string())
            .collect();
        Ok(Response::new(RegisterResponse {
            endpoint: tunnel_urls.first().cloned(),
            certificate: Some(issued.pem.into_bytes()),
            // Every CA the hub trusts, so an agent keeps up with a rotation.
            ca_certificate: Some(cas.bundle_pem().into_bytes()),
            server_version: Some(crate::VERSION.to_owned()),
            tunnel_urls,
            certificate_expires: Some(timestamp(issued.not_after)),
        }))
    }
    /// One read, check and write of a Register: what it signed, or none
    /// when another writer changed the token, the name's claim or the link
    /// between the read and the write.
    fn register_pass(
        &self,
        enrolment: &Enrolment<'_>,
    ) -> Result<Option<(Arc<crate::authority::CaSet>, otter_pki::IssuedCertificate)>, Status> {
        let Enrolment {
            conn,
            cluster,
            agent_id,
            agent_version,
            rancher_project_id,
            csr,
            identity,
            join_token,
        } = *enrolment;
        // Who may register: a join token for this cluster, or (renewal) the
        // certificate of this cluster's current agent presented over mTLS.
        let current = self
            .state
            .store
            .get::<LinkRecord>(tree::LINKS, cluster)
            .map_err(|e| e.into_status())?;
        // The certificate a renewal proved possession of.
        let mut renewed_with = None;
        // This agent retrying a Register whose outcome it never learnt: no
        // link yet, or its own that never carried a tunnel.
        let maybe_retry = current
            .as_ref()
            .is_none_or(|l| l.agent_id == agent_id && l.last_transport.is_empty());
        let join_token = match join_token {
            Some(token) => {
                let retry_by = maybe_retry.then_some(agent_id);
                let checked =
                    match tokens::check_join_token(&*self.state.store, token, cluster, retry_by)
                        .map_err(|e| e.into_status())?
                    {
                        Ok(checked) => checked,
                        Err(e @ JoinTokenError::WrongCluster(_)) => {
                            return Err(Status::permission_denied(e.to_string()));
                        }
                        Err(e) => return Err(Status::unauthenticated(e.to_string())),
                    };
                // A token does not take an enrolled cluster over: only an
                // admin's re-enrollment lets a new agent in, with a token
                // authorized after it.
                let retrying = checked.record.uses > 0;
                if let Some(link) = current.as_ref().filter(|_| !retrying) {
                    match link.reenroll_after {
                        Some(after) if checked.record.authorized >= after => {}
                        Some(_) => {
                            return Err(Status::failed_precondition(format!(
                                "cluster {cluster} is being re-enrolled and this join token was made before that; apply a manifest made after `otter re-enroll {cluster}`"
                            )));
                        }
                        None => {
                            return Err(Status::failed_precondition(format!(
                                "cluster {cluster} is already enrolled (agent {:?}); a join token enrolls a cluster once and its agent renews with its certificate. To replace the agent, an admin runs `otter re-enroll {cluster}` and applies a new manifest",
                                link.agent_id
                            )));
                        }
                    }
                }
                // The token's tenant must still be the one it was minted
                // in: not deleted, nor deleted and made again.
                let tenant_alive =
                    crate::tenancy::tenant(&*self.state.store, &checked.record.tenant)
                        .map_err(|e| e.into_status())?
                        .is_some_and(|t| t.created <= checked.record.created);
                // Nor from before the cluster's link was deleted.
                let released = crate::tenancy::released_at(&*self.state.store, cluster)
                    .map_err(|e| e.into_status())?;
                if !tenant_alive || released.is_some_and(|at| checked.record.authorized <= at) {
                    return Err(Status::unauthenticated(JoinTokenError::Unknown.to_string()));
                }
                // The token's tenant holds the name (a claim made when its
                // manifest was minted); one released since is claimed again.
                let claim = match crate::tenancy::claim_swap(
                    &*self.state.store,
                    cluster,
                    &checked.record.tenant,
                )
                .map_err(|e| e.into_status())?
                {
                    Ok(claim) => claim,
                    Err(e) => return Err(Status::permission_denied(e.to_string())),
                };
                Some((checked, claim))
            }
            None => {
                let peer = conn
                    .as_ref()
                    .and_then(|c| c.peer_cert.as_ref())
                    .ok_or_else(|| {
                        Status::unauthenticated(
                            "Register needs a join token (from the agent manifest) or, to renew, the agent's current certificate",
                        )
                    })
                    .and_then(|der| {
                        PeerCertificate::from_der(der).map_err(|e| Status::unauthenticated(e.to_string()))
                    })?;
                if peer.identity.cluster != cluster {
                    return Err(Status::permission_denied(format!(
                        "certificate belongs to cluster {:?}, not {cluster:?}",
                        peer.identity.cluster
                    )));
                }
                if current.as_ref().map(|l| &l.agent_id) != Some(&peer.identity.agent_id)
                    || peer.identity.agent_id != agent_id
                {
                    return Err(Status::permission_denied(
                        "this certificate's agent has been replaced; register with a join token",
                    ));
                }
                if !current.as_ref().is_some_and(|l| l.holds(&peer.serial)) {
                    return Err(Status::permission_denied(
                        "this certificate was superseded by a renewal; an agent renews with its newest certificate",
                    ));
                }
                renewed_with = Some(peer.serial.clone());
                // However wrong an agent's clock, its renewals cannot
                // keep the hub signing.
                if let Err(after) = self.state.renewals.try_renew(cluster) {
                    let mut s = Status::unavailable(format!(
                        "cluster {cluster} renewed less than {} s ago; retry after {} ms",
                        MIN_RENEWAL_GAP.as_secs(),
                        after.as_millis()
                    ));
                    if let Ok(v) = after.as_millis().to_string().parse() {
                        s.metadata_mut()
                            .insert(otter_tunnel::pace::GRPC_RETRY_AFTER_MS, v);
                    }
                    return Err(s);
                }
                None
            }
        };

        let cas = self.state.authority.current();
        let issued = cas
            .active
            .sign_agent_csr(csr, identity, self.state.config.agent_cert_lifetime)
            .map_err(|e| match e {
                PkiError::MalformedCsr(_) | PkiError::KeyTypeNotAllowed(_) => {
                    Status::invalid_argument(e.to_string())
                }
                PkiError::CsrTooLarge { .. } => Status::resource_exhausted(e.to_string()),
                PkiError::CsrIdentityMismatch { .. } => Status::permission_denied(e.to_string()),
                other => crate::HubError::from(other).into_status(),
            })?;

        let enrolling = join_token.is_some();
        let join_token_labels = join_token
            .as_ref()
            .map(|(t, _)| t.record.labels.clone())
            .filter(|l| !l.is_empty());
        let tenant = match (&join_token, &current) {
            (Some((checked, _)), _) => checked.record.tenant.clone(),
            (None, Some(link)) => link.tenant.clone(),
            (None, None) => no_link_to_renew(cluster)?,
        };
        // The token is spent and the name claimed only now that the request
        // is known to be good, with the link, in one write.
        let with = match &join_token {
            Some((checked, claim)) => vec![
                checked.spend(agent_id).map_err(|e| e.into_status())?,
                claim.clone(),
            ],
            None => Vec::new(),
        };
        let now = unix_now();
        let previous = current;
        let record = LinkRecord {
            cluster: cluster.to_owned(),
            tenant,
            agent_id: agent_id.to_owned(),
            agent_version: agent_version.to_owned(),
            rancher_project_id: rancher_project_id.to_owned(),
            cert_serial: issued.serial.clone(),
            prev_serial: renewed_with,
            // An own retry's (write_link reads them where they are).
            retried_serials: Vec::new(),
            cert_not_after: issued.not_after,
            first_seen: previous.as_ref().map_or(now, |p| p.first_seen),
            last_seen: now,
            last_transport: previous
                .as_ref()
                .map(|p| p.last_transport.clone())
                .unwrap_or_default(),
            cert_ca: cas.active.fingerprint(),
            trusted_cas: cas.fingerprints(),
            // A renewal keeps a pending re-enrollment; the enrollment ends it.
            reenroll_after: previous
                .as_ref()
                .and_then(|p| p.reenroll_after)
                .filter(|_| !enrolling),
            // The enrolling token's labels; otherwise the link keeps its own
            // (write_link reads them where they are).
            labels: match &join_token_labels {
                Some(labels) => labels.clone(),
                None => BTreeMap::new(),
            },
        };
        let keep_labels = join_token_labels.is_none();
        let own_retry = join_token.as_ref().is_some_and(|(t, _)| t.record.uses > 0);
        let written = write_link(
            &*self.state.store,
            cluster,
            record,
            Writing {
                enrolling,
                keep_labels,
                own_retry,
            },
            &with,
        )
        .map_err(|e| e.into_status())?;
        Ok(written.then_some((cas, issued)))
    }
}

/// What ListLinks shows `caller`: only its tenants' links; the agent, its
/// address and certificate only to the tenant's admins.
fn views(
    state: &Arc<HubState>,
    records: &[Arc<LinkRecord>],
    caller: &auth::Principal,
) -> Vec<Link> {
    records
        .iter()
        .filter_map(|r| caller.role_in(&r.tenant).map(|role| (role, r)))
        .map(|(role, r)| link_view(state, r, role))
        .collect()
}

/// ListLinks, with its answer encoded where it is built, on a listing
/// thread: over a large fleet the encoding is a quarter of a listing's
/// work, and on a runtime worker it held up the calls forwarded meanwhile.
/// tonic frames the bytes as they are.
pub async fn serve_list_links(
    state: Arc<HubState>,
    req: http::Request<crate::forward::HttpBody>,
) -> http::Response<crate::forward::HttpBody> {
    struct List(Arc<HubState>);
    impl tonic::server::UnaryService<ListLinksRequest> for List {
        type Response = bytes::Bytes;
        type Future = futures::future::BoxFuture<'static, Result<Response<bytes::Bytes>, Status>>;
        fn call(&mut self, request: Request<ListLinksRequest>) -> Self::Future {
            let state = self.0.clone();
            Box::pin(async move {
                let caller = auth::verified(request.extensions())?;
                let owner = caller.cluster_user.clone();
                let answer = crate::links::read(&state, &owner, move |state, records| {
                    let links = views(state, records, &caller);
                    prost::Message::encode_to_vec(&ListLinksResponse { links })
                })
                .await?;
                Ok(Response::new(answer.into()))
            })
        }
    }
    let mut grpc = tonic::server::Grpc::new(Encoded)
        .apply_max_message_size_config(Some(crate::server::MAX_OWN_MESSAGE), None);
    grpc.unary(List(state), req).await.map(|b| {
        use http_body_util::BodyExt;
        b.map_err(|e| -> crate::protocol::BoxError { Box::new(e) })
            .boxed_unsync()
    })
}

/// A codec whose answers are already encoded messages, and whose requests
/// are ListLinks requests.
#[derive(Debug, Clone, Copy)]
struct Encoded;

impl tonic::codec::Codec for Encoded {
    type Encode = bytes::Bytes;
    type Decode = ListLinksRequest;
    type Encoder = Encoded;
    type Decoder = tonic_prost::ProstDecoder<ListLinksRequest>;

    fn encoder(&mut self) -> Self::Encoder {
        Encoded
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::new(tonic::codec::BufferSettings::default())
    }
}

impl tonic::codec::Encoder for Encoded {
    type Item = bytes::Bytes;
    type Error = Status;

    fn encode(
        &mut self,
        message: bytes::Bytes,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Status> {
        bytes::BufMut::put(dst, message);
        Ok(())
    }
}

/// A Register request, its form checked.
struct Enrolment<'a> {
    conn: Option<&'a ConnInfo>,
    cluster: &'a str,
    agent_id: &'a str,
    agent_version: &'a str,
    rancher_project_id: &'a str,
    csr: &'a str,
    identity: &'a AgentIdentity,
    /// None: a renewal, with the agent's certificate.
    join_token: Option<&'a str>,
}

#[tonic::async_trait]
impl LinkService for LinkSvc {
    async fn list_links(
        &self,
        request: Request<ListLinksRequest>,
    ) -> Result<Response<ListLinksResponse>, Status> {
        // The hub's router answers ListLinks with `serve_list_links`; this
        // is the same answer for the service as tonic sees it.
        let caller = auth::verified(request.extensions())?;
        let owner = caller.cluster_user.clone();
        let links = crate::links::read(&self.state, &owner, move |state, records| {
            views(state, records, &caller)
        })
        .await?;
        Ok(Response::new(ListLinksResponse { links }))
    }

    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let renewal = request
            .get_ref()
            .join_token
            .as_deref()
            .is_none_or(str::is_empty);
        let timer = crate::audit::Timer::start();
        let mut event = crate::audit::Event {
            kind: "register",
            action: if renewal { "renew" } else { "enroll" }.to_owned(),
            cluster: request.get_ref().cluster.clone().unwrap_or_default(),
            // The agent is who asks.
            user: format!(
                "agent:{}",
                request.get_ref().agent_id.as_deref().unwrap_or_default()
            ),
            remote: crate::server::ConnInfo::remote_of(request.extensions()),
            ..Default::default()
        };
        // Signing is the costly part: at most so many at once, the others
        // are told when to come back (agents honour the hint).
        let result = match self.state.register_pacer.try_enter() {
            Ok(_slot) => self.register_inner(request).await,
            Err(after) => Err(busy(after)),
        };
        let outcome = match &result {
            Ok(_) if renewal => "renewed",
            Ok(_) => "registered",
            Err(s)
                if s.metadata()
                    .contains_key(otter_tunnel::pace::GRPC_RETRY_AFTER_MS) =>
            {
                "busy"
            }
            Err(s) => match s.code() {
                tonic::Code::InvalidArgument => "invalid",
                tonic::Code::Unauthenticated => "unauthenticated",
                tonic::Code::PermissionDenied => "permission_denied",
                _ => "error",
            },
        };
        self.state.metrics.register_outcome(outcome);
        // Anyone may call Register: a line lands in a tenant's view only
        // for a registration that succeeded (an anonymous caller cannot
        // write into it), and names the peer sent are kept only when valid.
        let agent_id = event.user.trim_start_matches("agent:").to_owned();
        if AgentIdentity::new(&event.cluster, &agent_id).is_err() {
            event.cluster.clear();
            event.user = "agent:?".to_owned();
        }
        if let Err(refusal) = &result
            && outcome != "busy"
            && refusal_logged()
        {
            // The names only when valid (cleared above otherwise).
            tracing::warn!(
                cluster = %event.cluster,
                agent = %event.user,
                remote = %event.remote,
                code = ?refusal.code(),
                reason = %refusal.message(),
                "registration refused"
            );
        }
        if result.is_ok() {
            event.tenant = crate::tenancy::tenant_of(&*self.state.store, &event.cluster)
                .ok()
                .flatten()
                .unwrap_or_default();
        }
        event.code = outcome.to_owned();
        event.duration_ms = timer.millis();
        self.state.audit.record(event);
        result
    }

    async fn get_agent_manifest(
        &self,
        request: Request<GetAgentManifestRequest>,
    ) -> Result<Response<GetAgentManifestResponse>, Status> {
        let caller = auth::verified(request.extensions())?;
        // The upstream request names no tenant: the caller's only one, or
        // the one its `otter-tenant` header names.
        let named = request
            .metadata()
            .get(TENANT_HEADER)
            .map(|v| v.to_str().unwrap_or("\u{0}").to_owned());
        let tenant = auth::admin_tenant(&caller, named.as_deref(), false)?;
        let req = request.into_inner();
        let cluster = req.cluster.unwrap_or_default();
        otter_pki::validate_cluster_name(&cluster)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        manifest::validate_users(&req.extra_users).map_err(crate::HubError::into_status)?;
        let labels: BTreeMap<String, String> = req.labels.into_iter().collect();
        crate::fleet::selector::validate(&labels)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let rancher = req.rancher_project_id.unwrap_or_default();
        if rancher.len() > MAX_RANCHER_ID_LEN || !printable(&rancher) {
            return Err(Status::invalid_argument(
                "rancher_project_id is too long or not printable",
            ));
        }
        // The tenant's admins group is bound in every manifest of the
        // tenant; further users by the name clusters know them by.
        let mut admins: Vec<String> = Vec::new();
        for u in req
            .extra_users
            .iter()
            .map(|u| manifest::cluster_user_name(u))
        {
            if !admins.contains(&u) {
                admins.push(u);
            }
        }
        let stale_after = self.state.config.manifest_ttl + self.state.config.join_token_ttl;
        match crate::tenancy::claim_cluster_for_manifest(
            &*self.state.store,
            &cluster,
            &tenant,
            stale_after,
        )
        .map_err(|e| e.into_status())?
        {
            Ok(()) => {}
            Err(e) => return Err(e.status()),
        }
        let mut claims = manifest::claims(
            &cluster,
            &tenant,
            &admins,
            &rancher,
            self.state.config.manifest_ttl,
            &self.state.authority.current().active.fingerprint(),
        );
        claims.labels = labels;
        let token = manifest::sign(&self.state.manifest_key, &claims);
        let url = format!(
            "{}/link/manifest/{token}",
            self.state.external_url.as_str().trim_end_matches('/')
        );
        let yaml = render_manifest(&self.state, &claims).map_err(|e| e.into_status())?;
        tracing::info!(%cluster, %tenant, user = %caller.user, "agent manifest issued");
        Ok(Response::new(GetAgentManifestResponse {
            manifest: Some(yaml),
            url: Some(url),
        }))
    }

    async fn list_rancher_projects(
        &self,
        request: Request<ListRancherProjectsRequest>,
    ) -> Result<Response<ListRancherProjectsResponse>, Status> {
        let caller = auth::verified(request.extensions())?;
        // The hub's Rancher lists every customer's projects: operators
        // only, until projects are mapped to tenants.
        auth::require_operator(&caller)?;
        let rancher = self.state.rancher.as_ref().ok_or_else(|| {
            Status::failed_precondition(
                "no Rancher management cluster configured (start the hub with --rancher-kubeconfig)",
            )
        })?;
        let projects = rancher.list_projects().await?;
        Ok(Response::new(ListRancherProjectsResponse { projects }))
    }
}

/// Lets an enrolled `cluster` take one join token authorized from now on
/// (an admin's re-enrollment); the time it was opened, or `None` when the
/// cluster has no link.
pub fn open_for_reenrollment(
    store: &dyn crate::store::Store,
    cluster: &str,
) -> crate::Result<Option<i64>> {
    let now = unix_now();
    let opened = update_link(store, cluster, |link| {
        link.reenroll_after = Some(now);
        true
    })?;
    Ok(opened.then_some(now))
}

/// Changes the cluster's link in place: `change` says whether it changed
/// anything. Read and written back with a compare-and-swap, retried until
/// no other write came between, so writers of one link (a renewal, a
/// re-enrollment mark, last seen, a retired serial) never lose each
/// other's changes. Whether there was a link.
pub fn update_link(
    store: &dyn crate::store::Store,
    cluster: &str,
    change: impl FnMut(&mut LinkRecord) -> bool,
) -> crate::Result<bool> {
    let wrote = change_link(store, cluster, change)?;
    if wrote == Some(true) {
        store.flush()?;
    }
    Ok(wrote.is_some())
}

/// [`update_link`] without making the write durable, for a caller that
/// writes many links and then flushes once.
pub fn update_link_unflushed(
    store: &dyn crate::store::Store,
    cluster: &str,
    change: impl FnMut(&mut LinkRecord) -> bool,
) -> crate::Result<bool> {
    Ok(change_link(store, cluster, change)?.is_some())
}

/// Whether the link was written (none: there is no link).
fn change_link(
    store: &dyn crate::store::Store,
    cluster: &str,
    change: impl FnMut(&mut LinkRecord) -> bool,
) -> crate::Result<Option<bool>> {
    change_link_with(store, cluster, change, || Ok(None))
}

/// [`update_link_unflushed`] in one write with what `with` makes, made
/// again for every try (another record read where it stands then): all or
/// none. Whether there was a link.
pub fn update_link_with_unflushed(
    store: &dyn crate::store::Store,
    cluster: &str,
    change: impl FnMut(&mut LinkRecord) -> bool,
    with: impl FnMut() -> crate::Result<Option<crate::store::Swap>>,
) -> crate::Result<bool> {
    Ok(change_link_with(store, cluster, change, with)?.is_some())
}

fn change_link_with(
    store: &dyn crate::store::Store,
    cluster: &str,
    mut change: impl FnMut(&mut LinkRecord) -> bool,
    mut with: impl FnMut() -> crate::Result<Option<crate::store::Swap>>,
) -> crate::Result<Option<bool>> {
    loop {
        let Some(raw) = store.get_raw(tree::LINKS, cluster)? else {
            return Ok(None);
        };
        let mut link: LinkRecord = crate::store::decode(tree::LINKS, cluster, &raw)?;
        if !change(&mut link) {
            return Ok(Some(false));
        }
        let new = crate::store::encode(tree::LINKS, cluster, &link)?;
        let mut swaps = vec![crate::store::Swap::new(
            tree::LINKS,
            cluster,
            Some(raw),
            Some(new),
        )];
        swaps.extend(with()?);
        if store.compare_and_swap_all(&swaps)? {
            return Ok(Some(true));
        }
    }
}

/// The write `change` makes to the cluster's link as the store holds it
/// now, for a caller that writes several links in one transaction (and
/// changes them one at a time should it fail); none when there is no link
/// or `change` leaves it as it was.
pub fn link_swap(
    store: &dyn crate::store::Store,
    cluster: &str,
    change: impl FnOnce(&mut LinkRecord) -> bool,
) -> crate::Result<Option<crate::store::Swap>> {
    let Some(raw) = store.get_raw(tree::LINKS, cluster)? else {
        return Ok(None);
    };
    let mut link: LinkRecord = crate::store::decode(tree::LINKS, cluster, &raw)?;
    if !change(&mut link) {
        return Ok(None);
    }
    let new = crate::store::encode(tree::LINKS, cluster, &link)?;
    Ok(Some(crate::store::Swap::new(
        tree::LINKS,
        cluster,
        Some(raw),
        Some(new),
    )))
}

/// How [`write_link`] writes a Register's link.
#[derive(Debug, Clone, Copy)]
struct Writing {
    /// With a join token (not a renewal).
    enrolling: bool,
    /// The token has no labels of its own: the link keeps its labels.
    keep_labels: bool,
    /// This agent enrolling again on a token it already spent.
    own_retry: bool,
}

/// Writes a link Register made, over whatever is there by then (a
/// compare-and-swap, retried): a re-enrollment mark set since the link
/// was read stays, unless this is the enrollment that ends it, and so do
/// the labels there unless `keep_labels` is false (an enrollment with
/// labels of its own). Written with `with` (the token an enrollment spends,
/// its claim on the name), all or none: false when one of those no longer
/// holds what it was read as. Durable when it returns true: the
/// certificate Register hands out names the serial written.
fn write_link(
    store: &dyn crate::store::Store,
    cluster: &str,
    mut record: LinkRecord,
    how: Writing,
    with: &[crate::store::Swap],
) -> crate::Result<bool> {
    let Writing {
        enrolling,
        keep_labels,
        own_retry,
    } = how;
    loop {
        let raw = store.get_raw(tree::LINKS, cluster)?;
        if let Some(raw) = &raw
            && (!enrolling || keep_labels || own_retry)
        {
            let there: LinkRecord = crate::store::decode(tree::LINKS, cluster, raw)?;
            if !enrolling {
                record.reenroll_after = there.reenroll_after;
            }
            // An enrollment this agent asked for again (the answer to the
            // first was lost, or came after the agent gave up on it): the
            // hub answered every one, and the agent holds whichever reached
            // it. All stay good until the newest carries a tunnel, as after
            // a renewal, whatever order their writes came in. Never for a
            // re-enrollment's first Register: the replaced agent's
            // certificate goes.
            if own_retry
                && there.agent_id == record.agent_id
                && there.reenroll_after.is_none()
                && there.cert_serial != record.cert_serial
            {
                record.retried_serials = there
                    .prev_serial
                    .iter()
                    .chain(&there.retried_serials)
                    .filter(|s| **s != record.cert_serial)
                    .take(RETRIES_KEPT)
                    .cloned()
                    .collect();
                record.prev_serial = Some(there.cert_serial.clone());
            }
            if keep_labels {
                record.labels = there.labels;
            }
        }
        let mut swaps = with.to_vec();
        let new = crate::store::encode(tree::LINKS, cluster, &record)?;
        swaps.push(crate::store::Swap::new(
            tree::LINKS,
            cluster,
            raw,
            Some(new),
        ));
        if store.compare_and_swap_all(&swaps)? {
            store.flush()?;
            return Ok(true);
        }
        // The link alone changed (a tunnel's last-seen time): merged again.
        for s in with {
            if store.get_raw(&s.tree, &s.key)? != s.old {
                return Ok(false);
            }
        }
    }
}

/// Mints a join token and renders the manifest the claims describe.
fn render_manifest(state: &HubState, claims: &manifest::UrlClaims) -> crate::Result<String> {
    let cas = state.authority.current();
    let join_token = tokens::mint_join_token_authorized(
        &*state.store,
        &claims.cluster,
        &claims.tenant,
        state.config.join_token_ttl,
        claims.issued,
        &claims.labels,
    )?;
    let mut user_prefixes = vec![crate::auth::HUB_USER_PREFIX.to_owned()];
    if let Some(oidc) = &state.config.oidc {
        user_prefixes.push(oidc.username_prefix.clone());
    }
    Ok(manifest::render(&manifest::ManifestSpec {
        cluster: claims.cluster.clone(),
        tenant: claims.tenant.clone(),
        admins: claims.admins.clone(),
        user_prefixes,
        rancher_project_id: claims.rancher_project_id.clone(),
        join_token,
        hub_url: state.external_url.as_str().trim_end_matches('/').to_owned(),
        // During a rotation both CAs, so a new agent keeps up with it.
        ca_pem: cas.bundle_pem(),
        ca_fingerprint: cas.active.fingerprint(),
        api_trust: match &state.config.api_tls {
            None => manifest::ApiTrust::HubCa,
            Some(files) => match &files.ca_file {
                // Read at each manifest: the operator may replace it.
                Some(path) => {
                    manifest::ApiTrust::Ca(std::fs::read_to_string(path).map_err(|source| {
                        crate::HubError::ReadFile {
                            path: path.clone(),
                            source,
                        }
                    })?)
                }
                None => manifest::ApiTrust::PublicRoots,
            },
        },
        namespace: state.config.agent_namespace.clone(),
        image: state.config.agent_image.clone(),
    }))
}

/// Serves a manifest URL: the YAML, or the status and a plain message.
pub fn manifest_from_url(
    state: &HubState,
    token: &str,
) -> Result<String, (http::StatusCode, String)> {
    let active = state.authority.current().active.fingerprint();
    let claims = manifest::verify(&state.manifest_key, token, &active)
        .map_err(|e| (http::StatusCode::UNAUTHORIZED, e.to_string()))?;
    match manifest::count_fetch(&*state.store, token, &claims) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err((http::StatusCode::GONE, e.to_string())),
        Err(e) => {
            tracing::error!(error = %e, "counting a manifest fetch failed");
            return Err((
                http::StatusCode::SERVICE_UNAVAILABLE,
                "the hub could not serve the manifest; see its log".to_owned(),
            ));
        }
    }
    render_manifest(state, &claims).map_err(|e| {
        tracing::error!(error = %e, "rendering a manifest failed");
        (
            http::StatusCode::INTERNAL_SERVER_ERROR,
            "the hub could not render the manifest; see its log".to_owned(),
        )
    })
}

/// The agent's report, plus the round-trip time the hub measures.
fn diagnosis(t: &crate::registry::TunnelEntry) -> otter_proto::link::v1::LinkDiagnosis {
    let mut shown = t
        .diagnosis
        .shown()
        .map(|shown| (*shown).clone())
        .unwrap_or_default();
    shown.rtt_micros = t.opener.rtt().map(|d| d.as_micros() as i64);
    shown
}

/// What ListLinks shows of an agent's `report`, fetched at `reported_at`
/// (Unix seconds); made once per report.
pub fn diagnosis_shown(
    report: &serde_json::Value,
    reported_at: i64,
) -> otter_proto::link::v1::LinkDiagnosis {
    let text = |key: &str| {
        report[key]
            .as_str()
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    let attempts = report["attempts"]
        .as_array()
        .map(|list| {
            list.iter()
                .map(|a| otter_proto::link::v1::TransportAttempt {
                    transport: a["transport"].as_str().map(str::to_owned),
                    ok: a["ok"].as_bool(),
                    error: a["error"]
                        .as_str()
                        .filter(|e| !e.is_empty())
                        .map(str::to_owned),
                })
                .collect()
        })
        .unwrap_or_default();
    otter_proto::link::v1::LinkDiagnosis {
        attempts,
        proxy: report["proxy"].as_str().map(str::to_owned),
        rtt_micros: None,
        clock_skew_millis: report["clock_skew_ms"].as_i64(),
        last_renewal_error: text("last_renewal_error"),
        renewal_failures: report["renewal_failures"]
            .as_u64()
            .and_then(|n| u32::try_from(n).ok()),
        last_tunnel_end: text("last_tunnel_end"),
        reported_at: Some(timestamp(reported_at)),
    }
}

/// A link as ListLinks shows it to a caller with `role` in its tenant: the
/// agent, its address, certificate serial and diagnosis to admins only.
pub fn link_view(state: &Arc<HubState>, r: &LinkRecord, role: crate::tenancy::Role) -> Link {
    let admin = role == crate::tenancy::Role::Admin;
    let live = state
        .registry
        .get(&r.cluster)
        .filter(|t| t.agent_id == r.agent_id);
    // Or on another replica sharing the store.
    let elsewhere = match live {
        Some(_) => None,
        None => crate::peers::owner(&*state.store, &r.cluster, &state.config.replica)
            .ok()
            .flatten()
            .filter(|o| o.agent_id == r.agent_id),
    };
    let silent = live
        .as_ref()
        .filter(|t| crate::tunnels::unresponsive(state, t))
        .map(|t| t.liveness.silent_for());
    Link {
        cluster: Some(r.cluster.clone()),
        agent_version: Some(r.agent_version.clone()),
        rancher_project_id: Some(r.rancher_project_id.clone()),
        agent_id: admin.then(|| r.agent_id.clone()),
        state: Some(match &live {
            Some(_) if silent.is_some() => LinkState::Unresponsive,
            Some(_) => LinkState::Connected,
            None if elsewhere.is_some() => LinkState::Connected,
            None => LinkState::Offline,
        } as i32),
        transport: Some(
            live.as_ref()
                .map(|t| t.transport.as_str().to_owned())
                .or_else(|| elsewhere.as_ref().map(|o| o.transport.clone()))
                .unwrap_or_default(),
        ),
        // Last heard from, for a tunnel whose agent went silent.
        last_seen: Some(timestamp(match silent {
            Some(for_) => unix_now() - for_.as_secs() as i64,
            None if live.is_some() || elsewhere.is_some() => unix_now(),
            None => r.last_seen,
        })),
        first_seen: Some(timestamp(r.first_seen)),
        certificate_expires: Some(timestamp(r.cert_not_after)),
        certificate_serial: admin.then(|| r.cert_serial.clone()),
        remote_address: live
            .as_ref()
            .filter(|_| admin)
            .map(|t| t.remote.to_string()),
        diagnosis: live.as_ref().filter(|_| admin).map(|t| {
            crate::tunnels::refresh_diagnosis(state, t);
            diagnosis(t)
        }),
        tenant: Some(r.tenant.clone()),
        labels: r
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    }
}

/// A renewal always has a current link (checked above); should that ever
/// change, the call fails instead of guessing a tenant.
fn no_link_to_renew(cluster: &str) -> Result<String, Status> {
    Err(Status::permission_denied(format!(
        "cluster {cluster} has no link to renew; register with a join token"
    )))
}

/// Unavailable with the hub's retry-after hint in the metadata.
fn busy(after: std::time::Duration) -> Status {
    let mut s = Status::unavailable(format!(
        "the hub is busy registering other agents; retry after {} ms",
        after.as_millis()
    ));
    if let Ok(v) = after.as_millis().to_string().parse() {
        s.metadata_mut()
            .insert(otter_tunnel::pace::GRPC_RETRY_AFTER_MS, v);
    }
    s
}

/// Refused registrations logged a second at most: anyone may call
/// Register, and the log must not be theirs to flood.
const REFUSALS_LOGGED_PER_SEC: u32 = 10;

/// Whether this refusal may be logged; says once a second how many were
/// not.
fn refusal_logged() -> bool {
    static WINDOW: std::sync::Mutex<(i64, u32)> = std::sync::Mutex::new((0, 0));
    let now = crate::unix_now();
    let mut w = WINDOW
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if w.0 != now {
        if w.1 > REFUSALS_LOGGED_PER_SEC {
            tracing::warn!(
                not_logged = w.1 - REFUSALS_LOGGED_PER_SEC,
                "more registrations were refused in the last second than logged"
            );
        }
        *w = (now, 0);
    }
    w.1 += 1;
    w.1 <= REFUSALS_LOGGED_PER_SEC
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::{SledStore, Store, StoreExt};

    /// How a Register writes: not an agent's retry of its own enrollment.
    fn how(enrolling: bool, keep_labels: bool) -> Writing {
        Writing {
            enrolling,
            keep_labels,
            own_retry: false,
        }
    }

    /// A link of cluster `edge-1`, agent `a1`, with no tunnel yet.
    pub(crate) fn link() -> LinkRecord {
        serde_json::from_value(serde_json::json!({
            "cluster": "edge-1",
            "agent_id": "a1",
            "agent_version": "test/1",
            "rancher_project_id": "",
            "cert_serial": "01",
            "cert_not_after": 0,
            "first_seen": 1,
            "last_seen": 1,
            "last_transport": "",
            "cert_ca": "",
        }))
        .expect("a link record")
    }

    #[test]
    fn writers_of_one_link_keep_a_re_enrollment_mark_set_meanwhile() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        store.put(tree::LINKS, "edge-1", &link()).unwrap();
        // A renewal read the link before the admin's re-enrollment...
        let stale = store
            .get::<LinkRecord>(tree::LINKS, "edge-1")
            .unwrap()
            .unwrap();
        let opened = open_for_reenrollment(&store, "edge-1").unwrap();
        assert!(opened.is_some());
        // ...and writes after it; so does a tunnel's close (last seen).
        assert!(write_link(&store, "edge-1", stale, how(false, true), &[]).unwrap());
        assert!(
            update_link(&store, "edge-1", |l| {
                l.last_seen = 2;
                true
            })
            .unwrap()
        );
        let now = store
            .get::<LinkRecord>(tree::LINKS, "edge-1")
            .unwrap()
            .unwrap();
        assert_eq!(now.reenroll_after, opened, "the mark survived both writes");
        assert_eq!(now.last_seen, 2);
        // The enrollment it was for ends it.
        assert!(write_link(&store, "edge-1", link(), how(true, true), &[]).unwrap());
        let now = store
            .get::<LinkRecord>(tree::LINKS, "edge-1")
            .unwrap()
            .unwrap();
        assert_eq!(now.reenroll_after, None);
        assert!(!update_link(&store, "absent", |_| true).unwrap());
        let _ = store.flush();
    }

    #[test]
    fn labels_survive_renewals_and_enrollments_without_labels_of_their_own() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        store.put(tree::LINKS, "edge-1", &link()).unwrap();
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        // A renewal read the link before an admin labelled it.
        let stale = store
            .get::<LinkRecord>(tree::LINKS, "edge-1")
            .unwrap()
            .unwrap();
        update_link(&store, "edge-1", |l| {
            l.labels = labels(&[("env", "prod")]);
            true
        })
        .unwrap();
        assert!(write_link(&store, "edge-1", stale, how(false, true), &[]).unwrap());
        let read = || {
            store
                .get::<LinkRecord>(tree::LINKS, "edge-1")
                .unwrap()
                .unwrap()
                .labels
        };
        assert_eq!(read(), labels(&[("env", "prod")]));
        // A re-enrollment whose token carries no labels keeps them...
        assert!(write_link(&store, "edge-1", link(), how(true, true), &[]).unwrap());
        assert_eq!(read(), labels(&[("env", "prod")]));
        // ...one whose token does replaces them.
        let mut enrolled = link();
        enrolled.labels = labels(&[("env", "dev")]);
        assert!(write_link(&store, "edge-1", enrolled, how(true, false), &[]).unwrap());
        assert_eq!(read(), labels(&[("env", "dev")]));
    }
}
