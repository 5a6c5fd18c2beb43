//! RuntimeService on kube-rs: pod logs, exec and port-forward sessions over
//! WebSocket, scale, restart and subresource actions, all as the caller.
//!
//! Exec and port-forward are sessions ([`crate::sessions`]): the streaming
//! call's first message carries only the session id; input comes as unary
//! calls naming that id, accepted only from the user who opened the
//! session. The session ends when the stream ends, on either side: the
//! caller going away closes the WebSocket to the kubelet, and the process
//! exiting (or the pod closing the port) ends the stream.
//!
//! Exit status: an exec whose command exits 0 ends the stream with OK. A
//! non-zero exit ends it with code `Unknown`, the message `command
//! terminated with exit code N`, and the code also in the trailer
//! `exit-code` (a number, for programs). Idle sessions end with
//! `DeadlineExceeded`.

use std::{
    pin::Pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use futures::{AsyncReadExt as _, SinkExt, Stream};
use k8s_openapi::{api::core::v1::Pod, jiff};
use kube::{
    Api,
    api::{AttachParams, AttachedProcess, LogParams, Patch, PatchParams, PostParams, TerminalSize},
};
use otter_proto::runtime::v1::{self as pb, runtime_service_server::RuntimeService};
use serde_json::{Value, json};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    sync::mpsc,
    time::Instant,
};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::{
    convert::{self, MAX_MANIFEST},
    discovery::Catalog,
    kube::KubeAccess,
    resource::{api_for, caller, opt_segment, receiver_stream, segment},
    sessions::{Kind, Limits, SessionTable},
    status::{from_kube, from_kube_status},
};

/// Largest stdin or port-forward chunk in one call.
pub const MAX_INPUT: usize = otter_tunnel::MAX_SESSION_INPUT;
/// Input bytes queued per session and not yet written to the pod; a writer
/// beyond it waits (so 200 busy sessions hold at most 400 MiB).
const INPUT_BUDGET: usize = 2 * MAX_INPUT;
/// Bytes read from a pod per message.
const CHUNK: usize = 64 * 1024;
/// Input calls queued per session before a writer waits.
const INPUT_QUEUE: usize = 16;
/// How long an input call waits for room in a busy session.
const INPUT_WAIT: Duration = Duration::from_secs(30);

/// Settings of the runtime service.
#[derive(Debug, Clone, Default)]
pub struct RuntimeConfig {
    pub sessions: Limits,
    /// Where live sessions are counted.
    pub gauges: Arc<crate::gauges::Gauges>,
}

enum Input {
    /// Bytes, holding their share of the session's input budget until written.
    Data(Bytes, tokio::sync::OwnedSemaphorePermit),
    CloseStdin,
    Resize(u16, u16),
}

/// What the table keeps of a live session.
#[derive(Clone)]
struct Handle {
    input: mpsc::Sender<Input>,
    budget: Arc<tokio::sync::Semaphore>,
    /// Cancelled when the session is reaped.
    reaped: CancellationToken,
    tty: bool,
    /// Where the hub's ordered writes of a port-forward upload stand.
    order: Arc<crate::ordered::Order>,
}

type Table = Arc<Mutex<SessionTable<Handle>>>;

/// The service.
#[derive(Clone)]
pub struct Runtime {
    kube: KubeAccess,
    catalog: Arc<Catalog>,
    sessions: Table,
    gauges: Arc<crate::gauges::Gauges>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").finish_non_exhaustive()
    }
}

impl Runtime {
    /// The service for the agent of `cluster`. Starts the idle reaper (it
    /// ends when the service is dropped), so call it inside a runtime.
    pub fn new(
        kube: KubeAccess,
        catalog: Arc<Catalog>,
        cluster: &str,
        config: RuntimeConfig,
    ) -> Self {
        let sessions: Table = Arc::new(Mutex::new(SessionTable::new(cluster, config.sessions)));
        let weak = Arc::downgrade(&sessions);
        let every =
            (config.sessions.idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(30));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(table) = weak.upgrade() else { return };
                let reaped = lock(&table).reap(Instant::now());
                for (id, h) in reaped {
                    tracing::info!(session_id = %id, "idle session reaped");
                    h.reaped.cancel();
                }
            }
        });
        Self {
            kube,
            catalog,
            sessions,
            gauges: config.gauges,
        }
    }

    /// Every call that reaches the cluster starts here: the verified
    /// caller, a client acting as them, and the request.
    fn begin<T>(
        &self,
        request: Request<T>,
    ) -> Result<(otter_tunnel::Caller, kube::Client, T), Status> {
        let who = caller(&request)?;
        let client = self.kube.for_caller(&who)?;
        Ok((who, client, request.into_inner()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SessionTable<Handle>> {
        lock(&self.sessions)
    }

    /// Opens a session entry; the guard removes it when dropped.
    fn open(
        &self,
        kind: Kind,
        user: &str,
        tty: bool,
    ) -> Result<(SessionGuard, mpsc::Receiver<Input>, CancellationToken), Status> {
        let (tx, rx) = mpsc::channel(INPUT_QUEUE);
        let reaped = CancellationToken::new();
        let handle = Handle {
            input: tx,
            budget: Arc::new(tokio::sync::Semaphore::new(INPUT_BUDGET)),
            reaped: reaped.clone(),
            tty,
            order: Arc::default(),
        };
        let id = self
            .lock()
            .open(kind, user, rand::random(), Instant::now(), handle)?;
        tracing::info!(session_id = %id, kind = kind.as_str(), user, "session opened");
        Ok((
            SessionGuard {
                id,
                table: self.sessions.clone(),
                _counted: self.gauges.session(kind),
            },
            rx,
            reaped,
        ))
    }

    fn session(&self, id: &Option<String>, kind: Kind, user: &str) -> Result<Handle, Status> {
        let id = id
            .as_deref()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| Status::invalid_argument("session_id is required"))?;
        Ok(self.lock().use_session(id, kind, user, Instant::now())?)
    }

    /// Queues bytes for the pod once the session's input budget has room.
    async fn deliver_data(handle: &Handle, data: Vec<u8>) -> Result<(), Status> {
        let n = u32::try_from(data.len().min(INPUT_BUDGET)).unwrap_or(u32::MAX);
        let permit =
            match tokio::time::timeout(INPUT_WAIT, handle.budget.clone().acquire_many_owned(n))
                .await
            {
                Ok(Ok(p)) => p,
                Ok(Err(_)) => return Err(Status::not_found("session ended")),
                Err(_) => {
                    return Err(Status::resource_exhausted(
                        "the session is not taking input fast enough; retry",
                    ));
                }
            };
        Self::deliver(handle, Input::Data(data.into(), permit)).await
    }

    async fn deliver(handle: &Handle, input: Input) -> Result<(), Status> {
        match tokio::time::timeout(INPUT_WAIT, handle.input.send(input)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Status::not_found("session ended")),
            Err(_) => Err(Status::resource_exhausted(
                "the session is not taking input fast enough; retry",
            )),
        }
    }
}

/// Removes a session from the table when its task ends, however it ends.
struct SessionGuard {
    id: String,
    table: Table,
    _counted: crate::gauges::Held,
}

impl SessionGuard {
    fn touch(&self) {
        lock(&self.table).touch(&self.id, Instant::now());
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        lock(&self.table).remove(&self.id);
        tracing::info!(session_id = %self.id, "session ended");
    }
}

/// The session table, poisoned or not: each change to it is one call
/// that leaves it whole (the workspace's one lock policy).
fn lock(table: &Mutex<SessionTable<Handle>>) -> std::sync::MutexGuard<'_, SessionTable<Handle>> {
    table
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The container to use when the caller names none: the one the
/// `kubectl.kubernetes.io/default-container` annotation names, else the first.
async fn default_container(pods: &Api<Pod>, name: &str) -> Result<Option<String>, Status> {
    let pod = pods.get(name).await.map_err(from_kube)?;
    let containers: Vec<String> = pod
        .spec
        .as_ref()
        .map(|s| s.containers.iter().map(|c| c.name.clone()).collect())
        .unwrap_or_default();
    let annotated = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("kubectl.kubernetes.io/default-container"))
        .filter(|c| containers.contains(c))
        .cloned();
    Ok(annotated.or_else(|| containers.into_iter().next()))
}

fn non_negative(v: Option<i64>, what: &str) -> Result<Option<i64>, Status> {
    match v {
        Some(n) if n < 0 => Err(Status::invalid_argument(format!("{what} must be ≥ 0"))),
        other => Ok(other),
    }
}

fn dimension(v: Option<u32>, what: &str) -> Result<Option<u16>, Status> {
    match v {
        None | Some(0) => Ok(None),
        Some(n) => u16::try_from(n)
            .map(Some)
            .map_err(|_| Status::invalid_argument(format!("{what} must be at most 65535"))),
    }
}

/// The end of an exec, from the Status on the error channel.
fn exec_end(
    status: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Status>,
) -> Result<(), Status> {
    let Some(s) = status else {
        return Err(Status::unavailable(
            "the exec connection ended without an exit status",
        ));
    };
    if s.status.as_deref() == Some("Success") {
        return Ok(());
    }
    if s.reason.as_deref() == Some("NonZeroExitCode") {
        let code = s
            .details
            .as_ref()
            .and_then(|d| d.causes.as_ref())
            .and_then(|c| c.iter().find(|c| c.reason.as_deref() == Some("ExitCode")))
            .and_then(|c| c.message.clone())
            .unwrap_or_else(|| "unknown".into());
        let mut st = Status::unknown(format!("command terminated with exit code {code}"));
        if let Ok(v) = code.parse() {
            st.metadata_mut().insert("exit-code", v);
        }
        return Err(st);
    }
    let ks = kube::core::Status {
        status: None,
        code: s.code.unwrap_or(500) as u16,
        message: s.message.unwrap_or_default(),
        metadata: None,
        reason: s.reason.unwrap_or_default(),
        details: None,
    };
    Err(from_kube_status(&ks))
}

type Out<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl RuntimeService for Runtime {
    type PodLogStream = Out<pb::PodLogResponse>;

    async fn pod_log(
        &self,
        request: Request<pb::PodLogRequest>,
    ) -> Result<Response<Self::PodLogStream>, Status> {
        let (_, client, r) = self.begin(request)?;
        let ns = segment(&r.namespace, "namespace")?;
        let name = segment(&r.name, "name")?;
        let pods: Api<Pod> = Api::namespaced(client, ns);
        let container = match opt_segment(&r.container, "container")? {
            "" => default_container(&pods, name).await?,
            c => Some(c.to_owned()),
        };
        let since_time = match r.since_time {
            None => None,
            Some(t) => Some(
                jiff::Timestamp::new(t.seconds, t.nanos)
                    .map_err(|e| Status::invalid_argument(format!("since_time: {e}")))?,
            ),
        };
        let lp = LogParams {
            container,
            follow: r.follow.unwrap_or(false),
            limit_bytes: non_negative(r.limit_bytes, "limit_bytes")?.filter(|n| *n > 0),
            pretty: false,
            previous: r.previous.unwrap_or(false),
            since_seconds: non_negative(r.since_seconds, "since_seconds")?.filter(|n| *n > 0),
            since_time,
            tail_lines: non_negative(r.tail_lines, "tail_lines")?,
            timestamps: r.timestamps.unwrap_or(false),
        };
        let mut body = Box::pin(pods.log_stream(name, &lp).await.map_err(from_kube)?);
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            let mut buf = vec![0u8; CHUNK];
            loop {
                let n = tokio::select! {
                    _ = tx.closed() => return,
                    n = body.read(&mut buf) => n,
                };
                let msg = match n {
                    Ok(0) => return,
                    Ok(n) => Ok(pb::PodLogResponse {
                        data: Some(buf[..n].to_vec()),
                    }),
                    Err(e) => Err(Status::unavailable(format!("reading the log failed: {e}"))),
                };
                let stop = msg.is_err();
                if tx.send(msg).await.is_err() || stop {
                    return;
                }
            }
        });
        Ok(Response::new(receiver_stream(rx)))
    }

    type ExecuteTTYStream = Out<pb::ExecuteTtyResponse>;

    async fn execute_tty(
        &self,
        request: Request<pb::ExecuteTtyRequest>,
    ) -> Result<Response<Self::ExecuteTTYStream>, Status> {
        let (who, client, r) = self.begin(request)?;
        let ns = segment(&r.namespace, "namespace")?;
        let name = segment(&r.name, "name")?;
        if r.command.is_empty() {
            return Err(Status::invalid_argument("command is required"));
        }
        if r.command.len() > 1024 || r.command.iter().map(String::len).sum::<usize>() > 256 * 1024 {
            return Err(Status::invalid_argument("command is too long"));
        }
        let tty = r.tty.unwrap_or(false);
        let rows = dimension(r.rows, "rows")?;
        let cols = dimension(r.cols, "cols")?;
        let (guard, mut input, reaped) = self.open(Kind::Exec, &who.user, tty)?;
        let pods: Api<Pod> = Api::namespaced(client, ns);
        let container = match opt_segment(&r.container, "container")? {
            "" => default_container(&pods, name).await?,
            c => Some(c.to_owned()),
        };
        let ap = AttachParams {
            container,
            stdin: true,
            stdout: true,
            stderr: !tty,
            tty,
            ..Default::default()
        };
        let mut proc: AttachedProcess = pods.exec(name, r.command, &ap).await.map_err(from_kube)?;
        let mut resize = proc.terminal_size();
        if let (Some(sender), Some(rows), Some(cols)) = (resize.as_mut(), rows, cols) {
            let _ = sender
                .send(TerminalSize {
                    width: cols,
                    height: rows,
                })
                .await;
        }
        let (tx, rx) = mpsc::channel(16);
        let first = pb::ExecuteTtyResponse {
            session_id: Some(guard.id.clone()),
            ..Default::default()
        };
        tx.try_send(Ok(first))
            .map_err(|_| Status::internal("session stream closed"))?;
        tokio::spawn(async move {
            // Input is written by a task of its own, so a pod that is slow to
            // read stdin never stops its output from being read (and the
            // other way round).
            let stdin = proc.stdin();
            let writer = tokio::spawn(async move {
                let mut stdin = stdin;
                while let Some(i) = input.recv().await {
                    match i {
                        Input::Data(b, _permit) => {
                            if let Some(w) = stdin.as_mut()
                                && w.write_all(&b).await.is_err()
                            {
                                stdin = None;
                            }
                        }
                        Input::CloseStdin => {
                            if let Some(mut w) = stdin.take() {
                                let _ = w.shutdown().await;
                            }
                        }
                        Input::Resize(rows, cols) => {
                            if let Some(s) = resize.as_mut() {
                                let _ = s
                                    .send(TerminalSize {
                                        width: cols,
                                        height: rows,
                                    })
                                    .await;
                            }
                        }
                    }
                }
            });
            let mut stdout = proc.stdout();
            let mut stderr = proc.stderr();
            let status = proc.take_status();
            let (mut out_buf, mut err_buf) = (vec![0u8; CHUNK], vec![0u8; CHUNK]);
            let end: Result<(), Status> = loop {
                if stdout.is_none() && stderr.is_none() {
                    let st = match status {
                        Some(f) => tokio::time::timeout(Duration::from_secs(5), f)
                            .await
                            .ok()
                            .flatten(),
                        None => None,
                    };
                    break exec_end(st);
                }
                tokio::select! {
                    _ = tx.closed() => break Ok(()),
                    _ = reaped.cancelled() => break Err(Status::deadline_exceeded("session ended after idling too long")),
                    n = read_opt(&mut stdout, &mut out_buf) => match n {
                        Some(n) => {
                            guard.touch();
                            let msg = pb::ExecuteTtyResponse { stdout: Some(out_buf[..n].to_vec()), ..Default::default() };
                            if tx.send(Ok(msg)).await.is_err() { break Ok(()); }
                        }
                        None => stdout = None,
                    },
                    n = read_opt(&mut stderr, &mut err_buf) => match n {
                        Some(n) => {
                            guard.touch();
                            let msg = pb::ExecuteTtyResponse { stderr: Some(err_buf[..n].to_vec()), ..Default::default() };
                            if tx.send(Ok(msg)).await.is_err() { break Ok(()); }
                        }
                        None => stderr = None,
                    },
                }
            };
            writer.abort();
            proc.abort();
            if let Err(e) = end {
                let _ = tx.send(Err(e)).await;
            }
            drop(guard);
        });
        Ok(Response::new(receiver_stream(rx)))
    }

    async fn write_tty(
        &self,
        request: Request<pb::WriteTtyRequest>,
    ) -> Result<Response<()>, Status> {
        let who = caller(&request)?;
        let r = request.into_inner();
        let handle = self.session(&r.session_id, Kind::Exec, &who.user)?;
        let input = match r.stdin {
            None => Input::CloseStdin,
            Some(b) if b.len() > MAX_INPUT => {
                return Err(Status::invalid_argument(format!(
                    "stdin chunk of {} bytes is over the limit of {MAX_INPUT}",
                    b.len()
                )));
            }
            Some(b) => {
                Self::deliver_data(&handle, b).await?;
                return Ok(Response::new(()));
            }
        };
        Self::deliver(&handle, input).await?;
        Ok(Response::new(()))
    }

    async fn resize_tty(
        &self,
        request: Request<pb::ResizeTtyRequest>,
    ) -> Result<Response<()>, Status> {
        let who = caller(&request)?;
        let r = request.into_inner();
        let rows = dimension(r.rows, "rows")?
            .ok_or_else(|| Status::invalid_argument("rows must be 1 to 65535"))?;
        let cols = dimension(r.cols, "cols")?
            .ok_or_else(|| Status::invalid_argument("cols must be 1 to 65535"))?;
        let handle = self.session(&r.session_id, Kind::Exec, &who.user)?;
        if !handle.tty {
            return Err(Status::failed_precondition(
                "the session has no terminal (it was opened with tty off)",
            ));
        }
        Self::deliver(&handle, Input::Resize(rows, cols)).await?;
        Ok(Response::new(()))
    }

    type PortForwardStream = Out<pb::PortForwardResponse>;

    async fn port_forward(
        &self,
        request: Request<pb::PortForwardRequest>,
    ) -> Result<Response<Self::PortForwardStream>, Status> {
        let (who, client, r) = self.begin(request)?;
        let ns = segment(&r.namespace, "namespace")?;
        let name = segment(&r.name, "name")?.to_owned();
        let port = r
            .port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p > 0)
            .ok_or_else(|| Status::invalid_argument("port must be 1 to 65535"))?;
        let (guard, mut input, reaped) = self.open(Kind::PortForward, &who.user, false)?;
        let pods: Api<Pod> = Api::namespaced(client, ns);
        let mut pf = pods.portforward(&name, &[port]).await.map_err(from_kube)?;
        let stream = pf
            .take_stream(port)
            .ok_or_else(|| Status::internal("port-forward stream missing"))?;
        let error = pf
            .take_error(port)
            .ok_or_else(|| Status::internal("port-forward error channel missing"))?;
        let (tx, rx) = mpsc::channel(16);
        let first = pb::PortForwardResponse {
            session_id: Some(guard.id.clone()),
            data: None,
        };
        tx.try_send(Ok(first))
            .map_err(|_| Status::internal("session stream closed"))?;
        tokio::spawn(async move {
            let (mut rd, mut wr) = tokio::io::split(stream);
            // Writing to the pod runs apart from reading, so neither direction
            // can hold up the other (an echo would otherwise deadlock).
            let mut writer = tokio::spawn(async move {
                while let Some(i) = input.recv().await {
                    if let Input::Data(b, _permit) = i
                        && wr.write_all(&b).await.is_err()
                    {
                        return;
                    }
                }
                // Input ended: the session is over; stay until aborted.
                std::future::pending::<()>().await;
            });
            let mut error: Pin<Box<dyn std::future::Future<Output = Option<String>> + Send>> =
                Box::pin(error);
            let mut buf = vec![0u8; CHUNK];
            let pod_error = |msg: String| {
                Status::unavailable(format!(
                    "port-forward to pod {name} port {port} failed: {msg}"
                ))
            };
            let end: Result<(), Status> = loop {
                tokio::select! {
                    _ = tx.closed() => break Ok(()),
                    _ = reaped.cancelled() => break Err(Status::deadline_exceeded("session ended after idling too long")),
                    e = &mut error => match e {
                        Some(msg) => break Err(pod_error(msg)),
                        // No error will come; keep forwarding.
                        None => error = Box::pin(futures::future::pending()),
                    },
                    n = rd.read(&mut buf) => match n {
                        Ok(0) | Err(_) => {
                            // The pod side closed: say why if it said so.
                            let why = tokio::time::timeout(Duration::from_secs(1), &mut error).await;
                            break match why {
                                Ok(Some(msg)) => Err(pod_error(msg)),
                                _ => Ok(()),
                            };
                        }
                        Ok(n) => {
                            guard.touch();
                            let msg = pb::PortForwardResponse { session_id: None, data: Some(buf[..n].to_vec()) };
                            if tx.send(Ok(msg)).await.is_err() { break Ok(()); }
                        }
                    },
                    _ = &mut writer => {
                        break Err(pod_error("the connection to the pod closed".into()));
                    }
                }
            };
            writer.abort();
            pf.abort();
            if let Err(e) = end {
                let _ = tx.send(Err(e)).await;
            }
            drop(guard);
        });
        Ok(Response::new(receiver_stream(rx)))
    }

    async fn write_port_forward(
        &self,
        request: Request<pb::WritePortForwardRequest>,
    ) -> Result<Response<()>, Status> {
        let who = caller(&request)?;
        let place = match request
            .metadata()
            .get(otter_tunnel::frame::UPLOAD_ORDER_HEADER)
        {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .ok()
                    .and_then(crate::ordered::Place::parse)
                    .ok_or_else(|| Status::invalid_argument("bad upload order header"))?,
            ),
        };
        let r = request.into_inner();
        let handle = self.session(&r.session_id, Kind::PortForward, &who.user)?;
        let data = r.data.unwrap_or_default();
        if data.len() > MAX_INPUT {
            return Err(Status::invalid_argument(format!(
                "data chunk of {} bytes is over the limit of {MAX_INPUT}",
                data.len()
            )));
        }
        let turn = match place {
            Some(place) => Some(handle.order.turn(place, INPUT_WAIT).await?),
            None => None,
        };
        let delivered = match data.is_empty() {
            true => Ok(()),
            false => Self::deliver_data(&handle, data).await,
        };
        if let Some(turn) = turn {
            turn.finish(delivered.is_ok());
        }
        delivered?;
        Ok(Response::new(()))
    }

    async fn scale(
        &self,
        request: Request<pb::ScaleRequest>,
    ) -> Result<Response<pb::ScaleResponse>, Status> {
        let (_, client, r) = self.begin(request)?;
        let entry = self
            .catalog
            .resolve_named(&r.group, &r.version, &r.resource)
            .await?;
        if !entry.subresources.iter().any(|s| s == "scale") {
            return Err(Status::invalid_argument(format!(
                "{} has no scale subresource",
                entry.display()
            )));
        }
        let replicas = match r.replicas {
            Some(n) if n >= 0 => n,
            Some(_) => return Err(Status::invalid_argument("replicas must be ≥ 0")),
            None => return Err(Status::invalid_argument("replicas is required")),
        };
        let name = segment(&r.name, "name")?;
        let api = api_for(
            client,
            &entry,
            opt_segment(&r.namespace, "namespace")?,
            true,
        )?;
        let patch = json!({"spec": {"replicas": replicas}});
        let scale = api
            .send(api.request().patch_subresource(
                "scale",
                name,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            ))
            .await?;
        let set = scale.pointer("/spec/replicas").and_then(Value::as_i64);
        Ok(Response::new(pb::ScaleResponse {
            replicas: Some(set.and_then(|n| i32::try_from(n).ok()).unwrap_or(replicas)),
        }))
    }

    async fn restart(&self, request: Request<pb::RestartRequest>) -> Result<Response<()>, Status> {
        let (_, client, r) = self.begin(request)?;
        let entry = self
            .catalog
            .resolve_named(&r.group, &r.version, &r.resource)
            .await?;
        entry.require("patch")?;
        let name = segment(&r.name, "name")?;
        let api = api_for(
            client,
            &entry,
            opt_segment(&r.namespace, "namespace")?,
            true,
        )?;
        let workload = entry.group == "apps"
            && matches!(
                entry.resource.as_str(),
                "deployments" | "statefulsets" | "daemonsets"
            );
        // Other kinds are restartable when they carry a pod template.
        if !workload && api.get(name).await?.pointer("/spec/template").is_none() {
            return Err(Status::invalid_argument(format!(
                "{} {name:?} has no pod template to restart (spec.template)",
                entry.display()
            )));
        }
        let now = jiff::Timestamp::now()
            .round(jiff::Unit::Second)
            .unwrap_or_else(|_| jiff::Timestamp::now());
        let patch = json!({"spec": {"template": {"metadata": {"annotations": {
            "kubectl.kubernetes.io/restartedAt": now.to_string()
        }}}}});
        let pp = PatchParams {
            field_manager: Some("kubectl-rollout".into()),
            ..Default::default()
        };
        api.send(api.request().patch(name, &pp, &Patch::Merge(&patch)))
            .await?;
        Ok(Response::new(()))
    }

    /// The hub serves ShowChart itself (the request names no cluster), so
    /// no call reaches an agent; one that does is told where it belongs.
    async fn show_chart(
        &self,
        _request: Request<pb::ShowChartRequest>,
    ) -> Result<Response<pb::ShowChartResponse>, Status> {
        Err(Status::failed_precondition(
            "ShowChart is served by the hub, not by an agent",
        ))
    }

    async fn sub_resource_action(
        &self,
        request: Request<pb::SubResourceActionRequest>,
    ) -> Result<Response<pb::SubResourceActionResponse>, Status> {
        let (_, client, r) = self.begin(request)?;
        let method = r.method.as_deref().unwrap_or("").to_ascii_uppercase();
        if method != "PUT" && method != "POST" {
            return Err(Status::invalid_argument(format!(
                "method must be PUT or POST, not {:?}",
                r.method.as_deref().unwrap_or("")
            )));
        }
        let entry = self
            .catalog
            .resolve_named(&r.group, &r.version, &r.resource)
            .await?;
        let sub = segment(&r.subresource, "subresource")?;
        if !entry.subresources.iter().any(|s| s == sub) {
            return Err(Status::not_found(format!(
                "{} has no subresource {sub:?}",
                entry.display()
            )));
        }
        let name = segment(&r.name, "name")?;
        let body = r.body.unwrap_or_default();
        if body.len() > MAX_MANIFEST {
            return Err(Status::invalid_argument("body is over 3 MiB"));
        }
        if !body.is_empty() {
            serde_json::from_slice::<Value>(&body)
                .map_err(|e| Status::invalid_argument(format!("body is not JSON: {e}")))?;
        }
        let api = api_for(
            client,
            &entry,
            opt_segment(&r.namespace, "namespace")?,
            true,
        )?;
        let req = api.request();
        let pp = PostParams::default();
        let mut http_req = if method == "PUT" {
            req.replace_subresource(sub, name, &pp, body)
        } else {
            req.create_subresource(sub, name, &pp, body)
        }
        .map_err(|e| Status::invalid_argument(format!("bad request: {e}")))?;
        http_req.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        let text = api
            .client()
            .request_text(http_req)
            .await
            .map_err(from_kube)?;
        let result = match serde_json::from_str::<Value>(&text) {
            Ok(v @ Value::Object(_)) => {
                let mut v = v;
                convert::clean(&mut v);
                v
            }
            Ok(other) => json!({ "result": other }),
            Err(_) if text.trim().is_empty() => json!({}),
            Err(_) => json!({ "result": text }),
        };
        Ok(Response::new(pb::SubResourceActionResponse {
            result: Some(convert::to_struct(result)),
        }))
    }
}

/// Reads once from an optional pipe; None at EOF. Pends forever once the
/// pipe is gone, so `select!` stops polling it.
async fn read_opt<R: tokio::io::AsyncRead + Unpin>(
    pipe: &mut Option<R>,
    buf: &mut [u8],
) -> Option<usize> {
    match pipe {
        Some(p) => match p.read(buf).await {
            Ok(0) | Err(_) => None,
            Ok(n) => Some(n),
        },
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
        Status as MetaStatus, StatusCause, StatusDetails,
    };

    #[test]
    fn exit_codes_become_errors_with_the_code() {
        assert!(
            exec_end(Some(MetaStatus {
                status: Some("Success".into()),
                ..Default::default()
            }))
            .is_ok()
        );
        let failed = exec_end(Some(MetaStatus {
            status: Some("Failure".into()),
            reason: Some("NonZeroExitCode".into()),
            details: Some(StatusDetails {
                causes: Some(vec![StatusCause {
                    reason: Some("ExitCode".into()),
                    message: Some("3".into()),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }))
        .unwrap_err();
        assert_eq!(failed.code(), tonic::Code::Unknown);
        assert_eq!(failed.message(), "command terminated with exit code 3");
        assert_eq!(failed.metadata().get("exit-code").unwrap(), "3");
        assert_eq!(exec_end(None).unwrap_err().code(), tonic::Code::Unavailable);
    }

    #[test]
    fn dimensions_are_bounded() {
        assert_eq!(dimension(Some(65535), "rows").unwrap(), Some(65535));
        assert!(dimension(Some(65536), "rows").is_err());
        assert_eq!(dimension(None, "rows").unwrap(), None);
    }
}
