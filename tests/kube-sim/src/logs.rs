//! Pod logs: lines fed by the test (or by attach sessions), served by `pods/log` with the
//! kubelet's options: container, follow, tailLines, sinceSeconds, sinceTime, limitBytes,
//! timestamps and previous.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response};
use time::OffsetDateTime;
use tokio::sync::{Notify, mpsc};

use crate::State;
use crate::api::{key, load_pod, pick_container};
use crate::error::ApiError;
use crate::http::{Body, Ctx, ResReq, channel_body, full};
use crate::util::{format_time_nanos, parse_time, str_at};

#[derive(Debug, Clone)]
pub(crate) struct LogLine {
    pub at: OffsetDateTime,
    pub text: String,
}

type LogKey = (String, String, String);

/// Every container's log, and a wake-up for followers.
#[derive(Debug, Default)]
pub struct LogBook {
    lines: Mutex<HashMap<LogKey, Vec<LogLine>>>,
    pub(crate) notify: Notify,
    /// Bytes that `follow` streams have handed to their HTTP response
    /// bodies: a reader that stops reading stops this too, once flow
    /// control reaches the server's writes.
    pub(crate) followed_bytes: std::sync::atomic::AtomicU64,
}

/// Lines kept per container; older ones are dropped so a chatty test cannot grow memory.
const MAX_LINES: usize = 100_000;

/// Lines a follower takes from the log at a time, and so the most one of
/// its writes carries: its writes block as soon as the reader's side is
/// full, as a kubelet's would.
const FOLLOW_BATCH: usize = 64;

impl LogBook {
    pub fn append(&self, ns: &str, pod: &str, container: &str, line: &str) {
        if let Ok(mut l) = self.lines.lock() {
            let v = l
                .entry((ns.into(), pod.into(), container.into()))
                .or_default();
            for part in line.trim_end_matches('\n').split('\n') {
                v.push(LogLine {
                    at: OffsetDateTime::now_utc(),
                    text: part.to_string(),
                });
            }
            if v.len() > MAX_LINES {
                let extra = v.len() - MAX_LINES;
                v.drain(..extra);
            }
        }
        self.notify.notify_waiters();
    }

    pub fn forget_pod(&self, ns: &str, pod: &str) {
        if let Ok(mut l) = self.lines.lock() {
            l.retain(|(n, p, _), _| !(n == ns && p == pod));
        }
        self.notify.notify_waiters();
    }

    /// At most `max` lines from index `from`.
    pub(crate) fn since(&self, k: &LogKey, from: usize, max: usize) -> Vec<LogLine> {
        self.lines
            .lock()
            .ok()
            .and_then(|l| {
                l.get(k)
                    .map(|v| v.iter().skip(from).take(max).cloned().collect())
            })
            .unwrap_or_default()
    }

    pub(crate) fn len(&self, k: &LogKey) -> usize {
        self.lines
            .lock()
            .ok()
            .and_then(|l| l.get(k).map(Vec::len))
            .unwrap_or(0)
    }
}

fn render(line: &LogLine, timestamps: bool) -> String {
    if timestamps {
        format!("{} {}\n", format_time_nanos(line.at), line.text)
    } else {
        format!("{}\n", line.text)
    }
}

/// Cuts `s` so that at most `left` bytes go out (a cut may split a line, as the kubelet's does).
fn take_bytes(s: String, left: &mut Option<u64>) -> String {
    match left {
        None => s,
        Some(n) => {
            let mut out = s;
            if out.len() as u64 > *n {
                let mut cut = *n as usize;
                while !out.is_char_boundary(cut) {
                    cut -= 1;
                }
                out.truncate(cut);
            }
            *n -= out.len() as u64;
            out
        }
    }
}

pub(crate) fn handle(
    state: Arc<State>,
    ctx: &Ctx,
    rr: &ResReq,
) -> Result<Response<Body>, ApiError> {
    let pod = load_pod(&state, rr)?;
    let q = &ctx.query;
    let pod_name = rr.name.clone().unwrap_or_default();
    let ns = rr.namespace.clone().unwrap_or_default();
    let container = pick_container(&pod, q.get("container"))?;
    if q.flag("previous") {
        return Err(ApiError::bad_request(format!(
            "previous terminated container \"{container}\" in pod \"{pod_name}\" not found"
        )));
    }
    let timestamps = q.flag("timestamps");
    let follow = q.flag("follow");
    let tail = q.int("tailLines")?;
    let mut limit = q.int("limitBytes")?.map(|n| n.max(0) as u64);
    let since = match (q.int("sinceSeconds")?, q.get("sinceTime")) {
        (Some(s), _) => {
            // A huge value means "from the beginning"; it must not overflow the clock.
            let now = OffsetDateTime::now_utc();
            Some(
                now.checked_sub(time::Duration::seconds(s.max(0)))
                    .unwrap_or(OffsetDateTime::UNIX_EPOCH),
            )
        }
        (None, Some(t)) => Some(
            parse_time(t)
                .ok_or_else(|| ApiError::bad_request(format!("invalid sinceTime {t:?}")))?,
        ),
        (None, None) => None,
    };
    let k: LogKey = (ns.clone(), pod_name.clone(), container.clone());
    let all = state.logs.since(&k, 0, usize::MAX);
    let seen = all.len();
    let mut lines: Vec<LogLine> = all
        .into_iter()
        .filter(|l| since.is_none_or(|s| l.at >= s))
        .collect();
    if let Some(t) = tail.filter(|t| *t >= 0) {
        let t = t as usize;
        if lines.len() > t {
            lines.drain(..lines.len() - t);
        }
    }
    let initial: String = lines.iter().map(|l| render(l, timestamps)).collect();
    let initial = take_bytes(initial, &mut limit);
    if !follow || limit == Some(0) {
        let mut r = Response::new(full(initial));
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain"),
        );
        return Ok(r);
    }
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let pod_key = key(rr, &pod_name);
    let uid = str_at(&pod, "metadata.uid").unwrap_or_default().to_string();
    let st = state.clone();
    state.spawn(async move {
        if !initial.is_empty() && tx.send(Bytes::from(initial)).await.is_err() {
            return;
        }
        let mut pos = seen;
        loop {
            let notified = st.logs.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if st.logs.len(&k) > pos || st.logs.len(&k) < pos {
                if st.logs.len(&k) < pos {
                    pos = 0;
                }
                let fresh = st.logs.since(&k, pos, FOLLOW_BATCH);
                pos += fresh.len();
                let text: String = fresh.iter().map(|l| render(l, timestamps)).collect();
                let text = take_bytes(text, &mut limit);
                let sent = text.len() as u64;
                if !text.is_empty() && tx.send(Bytes::from(text)).await.is_err() {
                    return;
                }
                st.logs
                    .followed_bytes
                    .fetch_add(sent, std::sync::atomic::Ordering::SeqCst);
                if limit == Some(0) {
                    return;
                }
                continue;
            }
            // Following ends when the pod goes away, like a finished container's stream.
            let alive = st
                .store
                .get(&pod_key)
                .is_some_and(|p| str_at(&p, "metadata.uid") == Some(uid.as_str()));
            if !alive {
                return;
            }
            tokio::select! {
                _ = st.cancel.cancelled() => return,
                _ = tx.closed() => return,
                _ = &mut notified => {}
                _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            }
        }
    });
    let mut r = Response::new(channel_body(rx));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain"),
    );
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_limits_cut_lines() {
        let mut left = Some(5u64);
        assert_eq!(take_bytes("abc\ndef\n".into(), &mut left), "abc\nd");
        assert_eq!(left, Some(0));
        let mut none = None;
        assert_eq!(take_bytes("x\n".into(), &mut none), "x\n");
    }
}
