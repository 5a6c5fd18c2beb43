//! `pods/exec` and `pods/attach` over WebSocket. Exec runs the requested command as a real
//! local process in the pod's own directory ([`crate::container`]; with `tty=true` on a
//! real pseudo-terminal, which resize messages resize, and which carries stderr too);
//! attach joins the container's log stream, and what is typed on stdin is echoed into that
//! log, like a container whose main process is `cat`.

use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use http::{Request, Response};
use hyper::body::Incoming;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::State;
use crate::api::{key, load_pod, pick_container};
use crate::container::Proc;
use crate::error::ApiError;
use crate::http::{Body, Ctx, ResReq};
use crate::spdy;
use crate::spdy_exec;
use crate::util::str_at;
use crate::ws::{self, CLOSE, ERROR, RESIZE, STDERR, STDIN, STDOUT, Ws, frame};

/// What the client asked for.
#[derive(Debug, Clone)]
pub(crate) struct Opts {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub command: Vec<String>,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
    pub v5: bool,
}

pub(crate) fn handle(
    state: Arc<State>,
    ctx: Ctx,
    rr: ResReq,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let pod = load_pod(&state, &rr)?;
    let q = &ctx.query;
    let container = pick_container(&pod, q.get("container"))?;
    let attach = rr.sub.as_deref() == Some("attach");
    let command = q.all("command");
    if !attach && command.is_empty() {
        return Err(ApiError::bad_request("you must specify at least 1 command"));
    }
    let (stdin, stdout, stderr, tty) = (
        q.flag("stdin"),
        q.flag("stdout"),
        q.flag("stderr"),
        q.flag("tty"),
    );
    if !stdin && !stdout && !stderr {
        return Err(ApiError::bad_request(
            "you must specify at least one of stdin, stdout, stderr",
        ));
    }
    let mut opts = Opts {
        namespace: rr.namespace.clone().unwrap_or_default(),
        pod: rr.name.clone().unwrap_or_default(),
        container,
        command,
        stdin,
        stdout,
        stderr: stderr && !tty,
        tty,
        v5: false,
    };
    let pod_uid = str_at(&pod, "metadata.uid").unwrap_or_default().to_string();
    let sub = if attach { "attach" } else { "exec" };
    if !ws::is_upgrade(req.headers()) {
        if spdy::is_upgrade(req.headers()) {
            return Ok(spdy_exec::handle(state, req, opts, attach, rr, pod_uid));
        }
        return Err(ws::upgrade_required());
    }
    let supported: &[&'static str] = if state.cfg.exec_v4_only {
        &[ws::V4]
    } else {
        &[ws::V5, ws::V4]
    };
    let protocol = ws::choose(req.headers(), supported).ok_or_else(|| {
        ApiError::bad_request(format!("none of the offered subprotocols {:?} is supported (want v5.channel.k8s.io or v4.channel.k8s.io)", ws::offered(req.headers())))
    })?;
    opts.v5 = protocol == ws::V5;
    state.record_session(sub, "websocket", protocol);
    let st = state.clone();
    ws::accept(&state, req, protocol, move |ws| async move {
        if attach {
            run_attach(st, ws, opts, rr, pod_uid).await
        } else {
            run_exec(st, ws, opts).await
        }
    })
}

pub(crate) fn success() -> Value {
    json!({ "metadata": {}, "status": "Success" })
}

pub(crate) fn exit_failure(command: &[String], code: i32) -> Value {
    json!({
        "metadata": {},
        "status": "Failure",
        "message": format!("command terminated with non-zero exit code: error executing command [{}], exit code {code}", command.join(" ")),
        "reason": "NonZeroExitCode",
        "details": { "causes": [{ "reason": "ExitCode", "message": code.to_string() }] }
    })
}

async fn finish(ws: &mut Ws, status: &Value) {
    let _ = ws.send(frame(ERROR, status.to_string().as_bytes())).await;
    let _ = ws
        .send(Message::Close(Some(CloseFrame {
            code: CloseCode::Normal,
            reason: "".into(),
        })))
        .await;
    // Give the client a moment to read the status and answer the close.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while let Some(Ok(m)) = ws.next().await {
            if m.is_close() {
                break;
            }
        }
    })
    .await;
}

/// Records a resize message (JSON `{"Width":..,"Height":..}`) and returns the size.
pub(crate) fn record_resize(state: &State, opts: &Opts, data: &[u8]) -> Option<(u16, u16)> {
    let v = serde_json::from_slice::<Value>(data).ok()?;
    let w = v.get("Width").and_then(Value::as_u64).unwrap_or(0) as u16;
    let h = v.get("Height").and_then(Value::as_u64).unwrap_or(0) as u16;
    if let Ok(mut r) = state.resizes.lock() {
        // Only the latest ones are kept: a client may resize as often as it likes.
        if r.len() >= crate::MAX_RECORDED {
            r.remove(0);
        }
        r.push((opts.pod.clone(), opts.container.clone(), w, h));
    }
    Some((w, h))
}

/// The Status a runtime reports when the command cannot be started.
pub(crate) fn start_failure(opts: &Opts, e: &std::io::Error) -> Value {
    json!({
        "metadata": {},
        "status": "Failure",
        "message": format!("OCI runtime exec failed: exec failed: unable to start container process: exec: \"{}\": {e}: unknown", opts.command[0]),
        "reason": "InternalError",
        "details": { "causes": [{ "message": format!("OCI runtime exec failed: exec: \"{}\": {e}", opts.command[0]) }] },
        "code": 500
    })
}

async fn run_exec(state: Arc<State>, mut ws: Ws, opts: Opts) {
    let mut proc = match Proc::spawn(&state.pods, &opts) {
        Ok(p) => p,
        Err(e) => {
            finish(&mut ws, &start_failure(&opts, &e)).await;
            return;
        }
    };
    let mut out = proc.stdout.take();
    let mut err = proc.stderr.take();
    let mut out_buf = vec![0u8; 32 * 1024];
    let mut err_buf = vec![0u8; 32 * 1024];
    let mut exit: Option<std::process::ExitStatus> = None;
    loop {
        if out.is_none() && err.is_none() && exit.is_some() {
            break;
        }
        tokio::select! {
            msg = ws.next() => match msg {
                Some(Ok(m)) if ws::payload(&m).is_some() => {
                    let data = ws::payload(&m).unwrap_or_default();
                    match data[0] {
                    STDIN => {
                        if let Some(s) = proc.stdin.as_mut()
                            && s.write_all(&data[1..]).await.is_err() {
                                proc.stdin = None;
                            }
                    }
                    RESIZE => {
                        if let Some((w, h)) = record_resize(&state, &opts, &data[1..]) {
                            proc.resize(w, h);
                        }
                    }
                    CLOSE if opts.v5 && data.get(1) == Some(&STDIN) => proc.close_stdin().await,
                    _ => {}
                }
                },
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => {
                    // The client went away: the process goes too (kill_on_drop).
                    return;
                }
                Some(Ok(_)) => {}
            },
            n = read_some(&mut out, &mut out_buf) => match n {
                Some(n) => {
                    if opts.stdout && ws.send(frame(STDOUT, &out_buf[..n])).await.is_err() {
                        return;
                    }
                }
                None => out = None,
            },
            n = read_some(&mut err, &mut err_buf) => match n {
                Some(n) => {
                    if opts.stderr && ws.send(frame(STDERR, &err_buf[..n])).await.is_err() {
                        return;
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
    let status = if code == 0 {
        success()
    } else {
        exit_failure(&opts.command, code)
    };
    finish(&mut ws, &status).await;
}

/// Reads once from an optional pipe; `None` at EOF. Pends forever once the pipe is gone,
/// so `select!` simply stops polling it.
pub(crate) async fn read_some<R: tokio::io::AsyncRead + Unpin>(
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

async fn run_attach(state: Arc<State>, mut ws: Ws, opts: Opts, rr: ResReq, uid: String) {
    let k = (
        opts.namespace.clone(),
        opts.pod.clone(),
        opts.container.clone(),
    );
    let mut pos = state.logs.len(&k);
    let pod_key = key(&rr, &opts.pod);
    loop {
        let notified = state.logs.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let fresh = state.logs.since(&k, pos, usize::MAX);
        if !fresh.is_empty() {
            pos += fresh.len();
            if opts.stdout {
                let text: String = fresh.iter().map(|l| format!("{}\n", l.text)).collect();
                if ws.send(frame(STDOUT, text.as_bytes())).await.is_err() {
                    return;
                }
            }
            continue;
        }
        let alive = state
            .store
            .get(&pod_key)
            .is_some_and(|p| str_at(&p, "metadata.uid") == Some(uid.as_str()));
        if !alive {
            finish(&mut ws, &success()).await;
            return;
        }
        tokio::select! {
            _ = &mut notified => {}
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            msg = ws.next() => match msg {
                Some(Ok(m)) if ws::payload(&m).is_some() => {
                    let data = ws::payload(&m).unwrap_or_default();
                    match data[0] {
                    STDIN if opts.stdin => {
                        let text = String::from_utf8_lossy(&data[1..]).to_string();
                        state.logs.append(&opts.namespace, &opts.pod, &opts.container, &text);
                    }
                    RESIZE => {
                        record_resize(&state, &opts, &data[1..]);
                    }
                    CLOSE if opts.v5 && data.get(1) == Some(&STDIN) => {
                        finish(&mut ws, &success()).await;
                        return;
                    }
                    _ => {}
                }
                },
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                Some(Ok(_)) => {}
            },
        }
    }
}
