//! `otterlink.fleet.v1.FleetService`: one question to many clusters.
//!
//! A fan-out call picks the links its selector matches among those the
//! caller reaches, then sends each cluster an ordinary ResourceService call
//! on the path every forwarded call takes ([`forward::send`]: this
//! replica's tunnel or the replica holding it, the caller's identity in the
//! cluster's tenant). Answers stream back in the order clusters give them;
//! a cluster that fails, or says nothing within the deadline, becomes an
//! error entry of its own and never holds the others back.

pub mod selector;

use std::{
    collections::BTreeMap,
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::{BufMut, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use http_body_util::BodyExt;
use otter_proto::{
    fleet::v1::{
        ClusterError, DescribeLinkRequest, DescribeLinkResponse, DoctorCheck, FanOut,
        GetResourcesRequest, GetResourcesResponse, LabelLinkRequest, LabelLinkResponse,
        ListResourcesRequest, ListResourcesResponse, fleet_service_server, get_resources_response,
        list_resources_response,
    },
    resource::v1 as resource,
};
use prost::Message;
use tonic::{Code, Request, Response, Status};

pub use self::selector::{LabelError, MAX_LABELS, Selector};
use crate::{
    auth::{self, Principal},
    forward::{self, HttpBody, Sent},
    link_service::LinkRecord,
    quota::Place,
    server::HubState,
    store::{StoreExt, tree},
};

/// A cluster's deadline when the call names none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest deadline a call may ask for.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(60);
/// Clusters asked at once by one fan-out call: with [`MAX_ANSWER`], what
/// one call may hold in memory.
pub const CONCURRENCY: usize = 32;
/// Largest answer of one cluster: what a gRPC client takes in one message
/// by default. A bigger list pages with `limit` per cluster.
pub const MAX_ANSWER: usize = 4 * 1024 * 1024;
/// Fan-out calls one caller may have open at once: each asks up to
/// [`CONCURRENCY`] clusters, so this bounds what one user sets going.
pub const MAX_FAN_OUTS_PER_CALLER: usize = 4;
/// Most keys one LabelLink may remove.
const MAX_REMOVALS: usize = 256;

const LIST: &str = "/otterscale.resource.v1.ResourceService/List";
const GET: &str = "/otterscale.resource.v1.ResourceService/Get";
const LIST_RESOURCES: &str = "/otterlink.fleet.v1.FleetService/ListResources";
const GET_RESOURCES: &str = "/otterlink.fleet.v1.FleetService/GetResources";
const LABEL_LINK: &str = "/otterlink.fleet.v1.FleetService/LabelLink";
/// Doctor lines shown of one agent's report, and the longest detail: the
/// report comes from the agent.
const MAX_DOCTOR_CHECKS: usize = 32;
const MAX_DOCTOR_DETAIL: usize = 1024;

/// A place for one more fan-out of `user`, or ResourceExhausted; given back
/// when the call's answers end.
fn enter_fan_out(state: &Arc<HubState>, user: &str) -> Result<Place<String>, Status> {
    state
        .fan_outs
        .take(&user.to_owned(), MAX_FAN_OUTS_PER_CALLER)
        .ok_or_else(|| {
            Status::resource_exhausted(format!(
                "at most {MAX_FAN_OUTS_PER_CALLER} fan-out calls at once per caller; \
                 wait for one to end"
            ))
        })
}

/// A fan-out call's stream of answers.
pub type Answers<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The FleetService handlers.
#[derive(Debug, Clone)]
pub struct FleetSvc {
    pub state: Arc<HubState>,
}

/// Which clusters one fan-out asks, and for how long each.
struct Plan {
    clusters: Vec<String>,
    timeout: Duration,
}

/// A fan-out's caller, as the per-cluster calls and their audit lines
/// need it.
#[derive(Clone)]
struct Asker {
    state: Arc<HubState>,
    caller: Principal,
    remote: String,
    /// The fan-out method, for the audit lines.
    action: &'static str,
}

impl FleetSvc {
    async fn plan(&self, caller: &Principal, fan: Option<FanOut>) -> Result<Plan, Status> {
        let fan = fan.unwrap_or_default();
        let selector = Selector::parse(fan.link_selector.as_deref().unwrap_or_default())
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let timeout = fan
            .timeout_millis
            .filter(|ms| *ms > 0)
            .map_or(DEFAULT_TIMEOUT, |ms| Duration::from_millis(ms.into()))
            .min(MAX_TIMEOUT);
        // Only the caller's tenants' links: another tenant's cluster is
        // neither asked nor named.
        let owner = &caller.cluster_user;
        let caller = caller.clone();
        let mut clusters: Vec<String> = crate::links::read(&self.state, owner, move |_, links| {
            links
                .iter()
                .filter(|l| caller.role_in(&l.tenant).is_some() && selector.matches(&l.labels))
                .map(|l| l.cluster.clone())
                .collect()
        })
        .await?;
        clusters.sort();
        Ok(Plan { clusters, timeout })
    }

    fn asker<T>(&self, request: &Request<T>, action: &'static str) -> Result<Asker, Status> {
        Ok(Asker {
            state: self.state.clone(),
            caller: auth::verified(request.extensions())?,
            remote: crate::server::ConnInfo::remote_of(request.extensions()),
            action,
        })
    }
}

impl Asker {
    /// Asks every planned cluster, [`CONCURRENCY`] at a time; `request`
    /// makes one cluster's message, `answer` wraps its outcome.
    fn fan_out<M, R>(
        self,
        place: Place<String>,
        plan: Plan,
        path: &'static str,
        request: impl Fn(&str) -> Bytes + Send + 'static,
        answer: fn(String, Result<M, Status>, u32) -> R,
    ) -> Answers<R>
    where
        M: Message + Default + 'static,
        R: Send + 'static,
    {
        let Plan { clusters, timeout } = plan;
        let started = Instant::now();
        let answers = futures::stream::iter(clusters)
            .map(move |cluster| {
                let message = request(&cluster);
                let asker = self.clone();
                async move {
                    let timer = crate::audit::Timer::start();
                    let result = tokio::time::timeout(
                        timeout,
                        asker.ask::<M>(&cluster, path, message, timeout),
                    )
                    .await
                    .unwrap_or_else(|_| {
                        Err(Status::deadline_exceeded(format!(
                            "cluster {cluster} did not answer within {} ms",
                            timeout.as_millis()
                        )))
                    });
                    asker.audit(&cluster, &result, &timer);
                    let elapsed = u32::try_from(started.elapsed().as_millis()).unwrap_or(u32::MAX);
                    Ok(answer(cluster, result, elapsed))
                }
            })
            .buffer_unordered(CONCURRENCY)
            // The caller's place is held until the stream is done with.
            .map(move |answer| {
                let _held = &place;
                answer
            });
        Box::pin(answers)
    }

    /// One cluster's unary call, sent as any forwarded call is.
    async fn ask<M: Message + Default>(
        &self,
        cluster: &str,
        path: &'static str,
        message: Bytes,
        timeout: Duration,
    ) -> Result<M, Status> {
        let (parts, ()) = http::Request::post(path)
            .header(http::header::CONTENT_TYPE, "application/grpc")
            .header(http::header::TE, "trailers")
            // The agent gives up when the hub does.
            .header("grpc-timeout", format!("{}m", timeout.as_millis()))
            .body(())
            .map_err(|e| Status::internal(format!("building the call: {e}")))?
            .into_parts();
        let mut framed = BytesMut::with_capacity(5 + message.len());
        framed.put_u8(0);
        framed.put_u32(u32::try_from(message.len()).unwrap_or(u32::MAX));
        framed.extend_from_slice(&message);
        let empty = http_body_util::Empty::<Bytes>::new()
            .map_err(|never| match never {})
            .boxed_unsync();
        let sent = forward::send(
            &self.state,
            &self.caller,
            cluster,
            parts,
            framed.freeze(),
            empty,
        )
        .await?;
        let resp: http::Response<HttpBody> = match sent {
            Sent::Tunnel { resp, .. } => resp.map(|b| b.map_err(Into::into).boxed_unsync()),
            Sent::Peer(resp) => resp,
        };
        read_unary(resp, cluster).await
    }

    /// One audit line per cluster asked, as a forwarded call gets.
    fn audit<M>(&self, cluster: &str, result: &Result<M, Status>, timer: &crate::audit::Timer) {
        if !self.state.audit.enabled() {
            return;
        }
        self.state.audit.record(crate::audit::Event {
            kind: "call",
            action: self.action.to_owned(),
            user: self.caller.cluster_user.clone(),
            groups: self.caller.groups.clone(),
            cluster: cluster.to_owned(),
            code: match result {
                Ok(_) => "Ok".to_owned(),
                Err(s) => format!("{:?}", s.code()),
            },
            duration_ms: timer.millis(),
            remote: self.remote.clone(),
            ..Default::default()
        });
    }
}

/// Reads a unary gRPC answer: its one message, or the status it ended with.
async fn read_unary<M: Message + Default>(
    resp: http::Response<HttpBody>,
    cluster: &str,
) -> Result<M, Status> {
    // A trailers-only answer carries its status in the headers.
    if let Some(status) = Status::from_header_map(resp.headers())
        && status.code() != Code::Ok
    {
        return Err(status);
    }
    let mut body = resp.into_body();
    let mut data = BytesMut::new();
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Status::unavailable(format!("cluster {cluster}: {e}")))?;
        match frame.into_data() {
            Ok(chunk) => {
                if data.len() + chunk.len() > 5 + MAX_ANSWER {
                    return Err(Status::resource_exhausted(format!(
                        "cluster {cluster} answered with more than {} MiB; ask for fewer \
                         objects per cluster (limit)",
                        MAX_ANSWER >> 20
                    )));
                }
                data.extend_from_slice(&chunk);
            }
            Err(frame) => trailers = frame.into_trailers().ok(),
        }
    }
    let status = trailers
        .as_ref()
        .and_then(Status::from_header_map)
        .ok_or_else(|| {
            Status::unavailable(format!(
                "cluster {cluster}: the answer ended without a status"
            ))
        })?;
    if status.code() != Code::Ok {
        return Err(status);
    }
    let malformed = || Status::internal(format!("cluster {cluster}: malformed answer"));
    if data.len() < 5 || data[0] != 0 {
        return Err(malformed());
    }
    let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
    if data.len() != 5 + len {
        return Err(malformed());
    }
    M::decode(&data[5..]).map_err(|_| malformed())
}

fn cluster_error(status: &Status) -> ClusterError {
    ClusterError {
        code: Some(crate::protocol::code_name(status.code()).to_owned()),
        message: Some(status.message().to_owned()),
    }
}

fn list_answer(
    cluster: String,
    result: Result<resource::ListResponse, Status>,
    elapsed: u32,
) -> ListResourcesResponse {
    use list_resources_response::Result as R;
    ListResourcesResponse {
        cluster: Some(cluster),
        result: Some(match result {
            Ok(list) => R::List(list),
            Err(status) => R::Error(cluster_error(&status)),
        }),
        elapsed_millis: Some(elapsed),
    }
}

fn get_answer(
    cluster: String,
    result: Result<resource::Resource, Status>,
    elapsed: u32,
) -> GetResourcesResponse {
    use get_resources_response::Result as R;
    GetResourcesResponse {
        cluster: Some(cluster),
        result: Some(match result {
            Ok(object) => R::Resource(object),
            Err(status) => R::Error(cluster_error(&status)),
        }),
        elapsed_millis: Some(elapsed),
    }
}

/// Checks a LabelLink request: the labels to set, and the keys to remove.
fn check_label_change(set: &BTreeMap<String, String>, remove: &[String]) -> Result<(), LabelError> {
    for (k, v) in set {
        selector::validate_key(k)?;
        selector::validate_value(v)?;
    }
    if set.len() > MAX_LABELS {
        return Err(LabelError::TooMany);
    }
    for k in remove {
        selector::validate_key(k)?;
        if set.contains_key(k) {
            return Err(LabelError::Key(k.clone(), "is both set and removed"));
        }
    }
    Ok(())
}

/// The doctor lines of an agent's diagnosis report, bounded.
fn doctor_checks(report: &serde_json::Value) -> Vec<DoctorCheck> {
    let text = |v: &serde_json::Value, max: usize| {
        v.as_str()
            .map(|s| s.chars().filter(|c| !c.is_control()).take(max).collect())
    };
    report["doctor"]
        .as_array()
        .map(|checks| {
            checks
                .iter()
                .take(MAX_DOCTOR_CHECKS)
                .map(|c| DoctorCheck {
                    name: text(&c["check"], 64),
                    verdict: text(&c["verdict"], 16).map(|v: String| v.to_lowercase()),
                    detail: text(&c["detail"], MAX_DOCTOR_DETAIL),
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tonic::async_trait]
impl fleet_service_server::FleetService for FleetSvc {
    async fn describe_link(
        &self,
        request: Request<DescribeLinkRequest>,
    ) -> Result<Response<DescribeLinkResponse>, Status> {
        let caller = auth::verified(request.extensions())?;
        let cluster = request.into_inner().cluster.unwrap_or_default();
        otter_pki::validate_cluster_name(&cluster)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let record = self
            .state
            .store
            .get::<LinkRecord>(tree::LINKS, &cluster)
            .map_err(|e| e.into_status())?;
        // Another tenant's link answers as one that does not exist.
        let Some((role, record)) =
            record.and_then(|r| caller.role_in(&r.tenant).map(|role| (role, r)))
        else {
            return Err(Status::not_found(format!(
                "cluster {cluster} is not registered"
            )));
        };
        let live = self
            .state
            .registry
            .get(&cluster)
            .filter(|t| t.agent_id == record.agent_id);
        let report = live
            .as_ref()
            .filter(|_| role == crate::tenancy::Role::Admin)
            .and_then(|t| t.diagnosis.report())
            .map(|(_, report)| report)
            .unwrap_or_default();
        let link = crate::link_service::link_view(&self.state, &record, role);
        Ok(Response::new(DescribeLinkResponse {
            link: Some(link),
            doctor_checks: doctor_checks(&report),
            doctor_ran_at: report["doctor_at"]
                .as_i64()
                .map(|seconds| prost_types::Timestamp { seconds, nanos: 0 }),
        }))
    }

    async fn label_link(
        &self,
        request: Request<LabelLinkRequest>,
    ) -> Result<Response<LabelLinkResponse>, Status> {
        let asker = self.asker(&request, LABEL_LINK)?;
        let caller = &asker.caller;
        let req = request.into_inner();
        let cluster = req.cluster.unwrap_or_default();
        otter_pki::validate_cluster_name(&cluster)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        if req.remove.len() > MAX_REMOVALS {
            return Err(Status::invalid_argument(format!(
                "at most {MAX_REMOVALS} keys may be removed at once"
            )));
        }
        let set: BTreeMap<String, String> = req.labels.into_iter().collect();
        check_label_change(&set, &req.remove)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let timer = crate::audit::Timer::start();
        // A cluster of another tenant answers as one that does not exist.
        let not_found = || Status::not_found(format!("cluster {cluster} is not registered"));
        let mut outcome: Result<BTreeMap<String, String>, Status> = Err(not_found());
        let found = crate::link_service::update_link(&*self.state.store, &cluster, |link| {
            outcome = match caller.role_in(&link.tenant) {
                None => Err(not_found()),
                Some(crate::tenancy::Role::Admin) => {
                    let mut labels = link.labels.clone();
                    labels.extend(set.clone());
                    for k in &req.remove {
                        labels.remove(k);
                    }
                    selector::validate(&labels)
                        .map(|()| labels)
                        .map_err(|e| Status::invalid_argument(e.to_string()))
                }
                Some(_) => Err(Status::permission_denied(format!(
                    "labels of cluster {cluster} are changed by the admins of tenant {}",
                    link.tenant
                ))),
            };
            match &outcome {
                Ok(labels) if *labels != link.labels => {
                    link.labels = labels.clone();
                    true
                }
                _ => false,
            }
        })
        .map_err(|e| e.into_status())?;
        if !found {
            outcome = Err(not_found());
        }
        if outcome.is_ok() {
            self.state.store.flush().map_err(|e| e.into_status())?;
        }
        asker.audit(&cluster, &outcome, &timer);
        Ok(Response::new(LabelLinkResponse {
            labels: outcome?.into_iter().collect(),
        }))
    }

    type ListResourcesStream = Answers<ListResourcesResponse>;

    async fn list_resources(
        &self,
        request: Request<ListResourcesRequest>,
    ) -> Result<Response<Self::ListResourcesStream>, Status> {
        let asker = self.asker(&request, LIST_RESOURCES)?;
        let req = request.into_inner();
        let plan = self.plan(&asker.caller, req.fan_out).await?;
        let place = enter_fan_out(&self.state, &asker.caller.user)?;
        let one = resource::ListRequest {
            cluster: None,
            group: req.group,
            version: req.version,
            resource: req.resource,
            namespace: req.namespace,
            label_selector: req.label_selector,
            field_selector: req.field_selector,
            limit: req.limit,
            r#continue: None,
        };
        let request = move |cluster: &str| {
            let mut one = one.clone();
            one.cluster = Some(cluster.to_owned());
            Bytes::from(one.encode_to_vec())
        };
        Ok(Response::new(asker.fan_out(
            place,
            plan,
            LIST,
            request,
            list_answer,
        )))
    }

    type GetResourcesStream = Answers<GetResourcesResponse>;

    async fn get_resources(
        &self,
        request: Request<GetResourcesRequest>,
    ) -> Result<Response<Self::GetResourcesStream>, Status> {
        let asker = self.asker(&request, GET_RESOURCES)?;
        let req = request.into_inner();
        if req.name.as_deref().unwrap_or_default().is_empty() {
            return Err(Status::invalid_argument(
                "name is required (ListResources lists every object)",
            ));
        }
        let plan = self.plan(&asker.caller, req.fan_out).await?;
        let place = enter_fan_out(&self.state, &asker.caller.user)?;
        let one = resource::GetRequest {
            cluster: None,
            group: req.group,
            version: req.version,
            resource: req.resource,
            namespace: req.namespace,
            name: req.name,
        };
        let request = move |cluster: &str| {
            let mut one = one.clone();
            one.cluster = Some(cluster.to_owned());
            Bytes::from(one.encode_to_vec())
        };
        Ok(Response::new(
            asker.fan_out(place, plan, GET, request, get_answer),
        ))
    }
}
