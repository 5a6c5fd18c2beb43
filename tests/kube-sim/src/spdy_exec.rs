//! `pods/exec` and `pods/attach` over SPDY/3.1, with the stream protocols of
//! `remotecommand`: `v4.channel.k8s.io` (the error stream carries a JSON Status with the
//! exit code), `v3.channel.k8s.io` (adds the resize stream), `v2.channel.k8s.io` and
//! `channel.k8s.io` (the error stream carries only a failure's message). The client opens
//! one stream per channel, named by its `streamType` header; the session starts once all
//! the request asked for are open. What runs is the same as over WebSocket: a real local
//! process for exec, the container's log for attach.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use serde_json::Value;
use tokio::io::AsyncWriteExt;

use crate::State;
use crate::api::key;
use crate::container::Proc;
use crate::exec::{Opts, exit_failure, read_some, record_resize, start_failure, success};
use crate::http::{Body, ResReq};
use crate::spdy::frame::rst;
use crate::spdy::{self, Event, Events, Handle};
use crate::util::str_at;

pub(crate) const V4: &str = "v4.channel.k8s.io";
pub(crate) const V3: &str = "v3.channel.k8s.io";
pub(crate) const V2: &str = "v2.channel.k8s.io";
pub(crate) const V1: &str = "channel.k8s.io";
/// Server preference does not matter: the client's order decides.
pub(crate) const PROTOCOLS: &[&str] = &[V4, V3, V2, V1];

/// How long the client has to open every stream it asked for (the kubelet's default).
const STREAM_WAIT: Duration = Duration::from_secs(30);
/// Data that may arrive on stdin before the process starts, in frames.
const EARLY_EVENTS: usize = 32;
/// Largest pending resize message.
const MAX_RESIZE: usize = 4096;

/// The streams of one session, by id.
#[derive(Debug, Default)]
struct Streams {
    error: Option<u32>,
    stdin: Option<u32>,
    stdout: Option<u32>,
    stderr: Option<u32>,
    resize: Option<u32>,
}

pub(crate) fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
    opts: Opts,
    attach: bool,
    rr: ResReq,
    uid: String,
) -> Response<Body> {
    let protocol = match spdy::negotiate(req.headers(), PROTOCOLS) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    state.record_session(if attach { "attach" } else { "exec" }, "spdy", protocol);
    let st = state.clone();
    spdy::accept(&state, req, protocol, move |h, ev| {
        session(st, h, ev, opts, protocol, attach, rr, uid)
    })
}

#[allow(clippy::too_many_arguments)]
async fn session(
    state: Arc<State>,
    h: Handle,
    mut ev: Events,
    opts: Opts,
    protocol: &'static str,
    attach: bool,
    rr: ResReq,
    uid: String,
) {
    let resizable = opts.tty && matches!(protocol, V4 | V3);
    let Some((streams, early)) = open_streams(&h, &mut ev, &opts, resizable).await else {
        return;
    };
    let status = if attach {
        run_attach(&state, &h, &mut ev, &opts, &streams, early, &rr, &uid).await
    } else {
        run_exec(&state, &h, &mut ev, &opts, &streams, early).await
    };
    let Some(status) = status else { return };
    for id in [streams.stdout, streams.stderr].into_iter().flatten() {
        h.finish(id).await;
    }
    if let Some(id) = streams.error {
        if let Some(bytes) = status_bytes(protocol, &status) {
            h.send(id, &bytes).await;
        }
        h.finish(id).await;
    }
    for id in [streams.stdin, streams.resize].into_iter().flatten() {
        h.finish(id).await;
    }
}

/// How the final status is written: v4 sends the Status as JSON; older protocols send
/// nothing on success and the message on failure.
fn status_bytes(protocol: &str, status: &Value) -> Option<Vec<u8>> {
    if protocol == V4 {
        return Some(status.to_string().into_bytes());
    }
    if status.get("status").and_then(Value::as_str) == Some("Success") {
        return None;
    }
    let msg = status
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("error executing remote command");
    Some(msg.as_bytes().to_vec())
}

/// Waits for the streams the request asked for; anything not asked for (or a second stream
/// of one type) is refused. Data arriving early is kept for the session.
async fn open_streams(
    h: &Handle,
    ev: &mut Events,
    opts: &Opts,
    resizable: bool,
) -> Option<(Streams, Vec<Event>)> {
    let expected =
        1 + opts.stdin as usize + opts.stdout as usize + opts.stderr as usize + resizable as usize;
    let mut s = Streams::default();
    let mut early = Vec::new();
    let mut open = 0;
    let deadline = tokio::time::sleep(STREAM_WAIT);
    tokio::pin!(deadline);
    while open < expected {
        let e = tokio::select! {
            _ = &mut deadline => {
                tracing::debug!("spdy exec: timed out waiting for the client's streams");
                return None;
            }
            e = ev.next() => e?,
        };
        match e {
            Event::Open { id, headers, .. } => {
                let slot = match headers.get("streamtype").unwrap_or_default() {
                    "error" => Some(&mut s.error),
                    "stdin" if opts.stdin => Some(&mut s.stdin),
                    "stdout" if opts.stdout => Some(&mut s.stdout),
                    "stderr" if opts.stderr => Some(&mut s.stderr),
                    "resize" if resizable => Some(&mut s.resize),
                    _ => None,
                };
                match slot {
                    Some(slot) if slot.is_none() => {
                        *slot = Some(id);
                        open += 1;
                        h.accept(id).await;
                    }
                    _ => {
                        h.refuse(id, rst::REFUSED_STREAM).await;
                    }
                }
            }
            other => {
                if early.len() >= EARLY_EVENTS {
                    return None;
                }
                early.push(other);
            }
        }
    }
    Some((s, early))
}

/// Accumulates the resize stream: one JSON object per line.
#[derive(Default)]
struct Resizes {
    buf: Vec<u8>,
}

impl Resizes {
    /// Takes resize bytes; the last complete size among them, if any.
    fn feed(&mut self, state: &State, opts: &Opts, data: &[u8]) -> Option<(u16, u16)> {
        self.buf.extend_from_slice(data);
        let mut last = None;
        while let Some(nl) = self.buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            last = record_resize(state, opts, &line).or(last);
        }
        if self.buf.len() > MAX_RESIZE {
            self.buf.clear();
        }
        last
    }
}

async fn run_exec(
    state: &State,
    h: &Handle,
    ev: &mut Events,
    opts: &Opts,
    s: &Streams,
    early: Vec<Event>,
) -> Option<Value> {
    let mut proc = match Proc::spawn(&state.pods, opts) {
        Ok(p) => p,
        Err(e) => return Some(start_failure(opts, &e)),
    };
    let mut out = proc.stdout.take();
    let mut err = proc.stderr.take();
    let err_stream = s.stderr;
    let mut resizes = Resizes::default();
    let mut early = early.into_iter();
    let mut out_buf = vec![0u8; 32 * 1024];
    let mut err_buf = vec![0u8; 32 * 1024];
    let mut exit: Option<std::process::ExitStatus> = None;
    // Ends when the process has exited and both pipes are drained, or the client is gone.
    loop {
        if out.is_none() && err.is_none() && exit.is_some() {
            break;
        }
        let next = async {
            match early.next() {
                Some(e) => Some(e),
                None => ev.next().await,
            }
        };
        tokio::select! {
            e = next => match e {
                // The client went away: the process goes too (kill_on_drop).
                None => return None,
                Some(Event::Data { id, data }) if Some(id) == s.stdin => {
                    if let Some(p) = proc.stdin.as_mut()
                        && p.write_all(&data).await.is_err()
                    {
                        proc.stdin = None;
                    }
                }
                Some(Event::Data { id, data }) if Some(id) == s.resize => {
                    if let Some((w, h)) = resizes.feed(state, opts, &data) {
                        proc.resize(w, h);
                    }
                }
                // End of stdin: the pipe's EOF, a terminal's ^D.
                Some(Event::Fin { id } | Event::Reset { id }) if Some(id) == s.stdin => proc.close_stdin().await,
                Some(_) => {}
            },
            n = read_some(&mut out, &mut out_buf) => match n {
                Some(n) => {
                    if let Some(id) = s.stdout {
                        h.send(id, &out_buf[..n]).await;
                    }
                }
                None => out = None,
            },
            n = read_some(&mut err, &mut err_buf) => match n {
                Some(n) => {
                    if let Some(id) = err_stream {
                        h.send(id, &err_buf[..n]).await;
                    }
                }
                None => err = None,
            },
            status = proc.wait(), if exit.is_none() => {
                exit = Some(status);
                proc.stdin = None;
            }
        }
    }
    let code = exit.and_then(|s| s.code()).unwrap_or(1);
    Some(if code == 0 {
        success()
    } else {
        exit_failure(&opts.command, code)
    })
}

/// Attach: the container's log from now on goes to stdout; what is typed on stdin is
/// appended to the log. Ends with success when the client closes stdin or the pod goes.
#[allow(clippy::too_many_arguments)]
async fn run_attach(
    state: &State,
    h: &Handle,
    ev: &mut Events,
    opts: &Opts,
    s: &Streams,
    early: Vec<Event>,
    rr: &ResReq,
    uid: &str,
) -> Option<Value> {
    let k = (
        opts.namespace.clone(),
        opts.pod.clone(),
        opts.container.clone(),
    );
    let mut pos = state.logs.len(&k);
    let pod_key = key(rr, &opts.pod);
    let mut resizes = Resizes::default();
    let mut early = early.into_iter();
    loop {
        let notified = state.logs.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let fresh = state.logs.since(&k, pos, usize::MAX);
        if !fresh.is_empty() {
            pos += fresh.len();
            if let Some(id) = s.stdout {
                let text: String = fresh.iter().map(|l| format!("{}\n", l.text)).collect();
                if !h.send(id, text.as_bytes()).await {
                    return None;
                }
            }
            continue;
        }
        let alive = state
            .store
            .get(&pod_key)
            .is_some_and(|p| str_at(&p, "metadata.uid") == Some(uid));
        if !alive {
            return Some(success());
        }
        let next = async {
            match early.next() {
                Some(e) => Some(e),
                None => ev.next().await,
            }
        };
        tokio::select! {
            _ = &mut notified => {}
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            e = next => match e {
                None => return None,
                Some(Event::Data { id, data }) if Some(id) == s.stdin => {
                    let text = String::from_utf8_lossy(&data).to_string();
                    state.logs.append(&opts.namespace, &opts.pod, &opts.container, &text);
                }
                Some(Event::Data { id, data }) if Some(id) == s.resize => {
                    resizes.feed(state, opts, &data);
                }
                Some(Event::Fin { id } | Event::Reset { id }) if Some(id) == s.stdin => {
                    return Some(success());
                }
                Some(_) => {}
            },
        }
    }
}
