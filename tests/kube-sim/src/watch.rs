//! Watch streams: one JSON event per line over a chunked response. Supports starting from
//! "now" with synthetic ADDED events, resuming from a resourceVersion (410 in an ERROR event
//! when it is too old), `sendInitialEvents` with the initial-events-end bookmark, periodic
//! bookmarks, selectors and `timeoutSeconds`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};

use crate::State;
use crate::error::ApiError;
use crate::http::{Body, Ctx, ResReq, channel_body};
use crate::output::{partial_metadata, present, table, wants_metadata, wants_table};
use crate::store::{EventType, StoreEvent};
use crate::util::{FieldSelector, LabelSelector, str_at};

/// Longest watch when the client sets no timeout (the apiserver picks 30–60 minutes).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

struct Filter {
    rr: ResReq,
    labels: LabelSelector,
    fields: FieldSelector,
    as_metadata: bool,
    as_table: bool,
}

impl Filter {
    /// The event type this watch reports for a store event, if any.
    fn classify(&self, ev: &StoreEvent) -> Option<&'static str> {
        if !self.in_scope(ev) {
            return None;
        }
        let now = self.selects(&ev.object);
        match (ev.etype, ev.prev.as_deref().map(|p| self.selects(p))) {
            (EventType::Modified, Some(false)) if now => Some("ADDED"),
            (EventType::Modified, Some(true)) if !now => Some("DELETED"),
            (_, _) if now => Some(ev.etype.as_str()),
            _ => None,
        }
    }

    fn selects(&self, obj: &Value) -> bool {
        self.labels.matches_object(obj) && self.fields.matches_object(obj)
    }

    fn in_scope(&self, ev: &StoreEvent) -> bool {
        if ev.key.group != self.rr.rt.group || ev.key.plural != self.rr.rt.plural {
            return false;
        }
        if let Some(ns) = &self.rr.namespace
            && ev.key.namespace != *ns
        {
            return false;
        }
        if let Some(name) = &self.rr.name
            && ev.key.name != *name
        {
            return false;
        }
        true
    }

    fn render(&self, etype: &str, obj: &Value) -> Bytes {
        let object = if self.as_table {
            let meta = json!({ "resourceVersion": str_at(obj, "metadata.resourceVersion").unwrap_or_default() });
            table(&self.rr.rt, std::slice::from_ref(obj), meta)
        } else if self.as_metadata {
            partial_metadata(obj)
        } else {
            present(&self.rr.rt, obj)
        };
        let mut line =
            serde_json::to_vec(&json!({ "type": etype, "object": object })).unwrap_or_default();
        line.push(b'\n');
        Bytes::from(line)
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Bytes {
        let mut meta = json!({ "resourceVersion": rv.to_string(), "creationTimestamp": null });
        if initial_end {
            meta["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
        }
        let kind = if self.as_metadata {
            "PartialObjectMetadata".to_string()
        } else {
            self.rr.rt.kind.clone()
        };
        let api_version = if self.as_metadata {
            "meta.k8s.io/v1".to_string()
        } else {
            self.rr.rt.api_version()
        };
        let obj = json!({ "kind": kind, "apiVersion": api_version, "metadata": meta });
        let mut line =
            serde_json::to_vec(&json!({ "type": "BOOKMARK", "object": obj })).unwrap_or_default();
        line.push(b'\n');
        Bytes::from(line)
    }
}

fn parse_rv(s: Option<&str>) -> Result<Option<u64>, ApiError> {
    match s {
        None | Some("") | Some("0") => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| ApiError::bad_request(format!("invalid resource version: {v:?}"))),
    }
}

pub(crate) fn watch(state: Arc<State>, ctx: &Ctx, rr: &ResReq) -> Result<Response<Body>, ApiError> {
    let q = &ctx.query;
    let mut rr = rr.clone();
    // `/pods/NAME?watch=true` and `fieldSelector=metadata.name=NAME` both narrow to one object.
    let filter = Filter {
        labels: LabelSelector::parse(q.get("labelSelector").unwrap_or_default())?,
        fields: FieldSelector::parse(q.get("fieldSelector").unwrap_or_default())?,
        as_metadata: wants_metadata(ctx),
        as_table: wants_table(ctx),
        rr: {
            rr.sub = None;
            rr
        },
    };
    let bookmarks = q.flag("allowWatchBookmarks");
    let send_initial = q.get("sendInitialEvents").map(|v| v == "true");
    let from = parse_rv(q.get("resourceVersion"))?;
    let timeout = q
        .int("timeoutSeconds")?
        .filter(|t| *t > 0)
        .map(|t| Duration::from_secs(t as u64).min(DEFAULT_TIMEOUT))
        .unwrap_or(DEFAULT_TIMEOUT);
    let start_from = if send_initial == Some(true) {
        None
    } else {
        from
    };

    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let start = state
        .store
        .watch(&filter.rr.rt.group, &filter.rr.rt.plural, start_from);
    let mut resp = Response::new(channel_body(rx));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let start = match start {
        Ok(s) => s,
        Err(compacted) => {
            // Like the apiserver: 200, then one ERROR event carrying a 410 Status.
            let status = ApiError::gone(format!(
                "too old resource version: {} ({})",
                from.unwrap_or(0),
                compacted + 1
            ))
            .to_status();
            let mut line = serde_json::to_vec(&json!({ "type": "ERROR", "object": status }))
                .unwrap_or_default();
            line.push(b'\n');
            let _ = tx.try_send(Bytes::from(line));
            return Ok(resp);
        }
    };
    let interval = state.cfg.bookmark_interval;
    let cancel = state.cancel.clone();
    state.spawn(async move {
        // The subscription was taken under the store lock, so the replay and the live events
        // neither overlap nor leave a gap.
        let mut last_rv = start.rv;
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        for ev in &start.initial {
            if let Some(t) = filter.classify(ev)
                && tx.send(filter.render(t, &ev.object)).await.is_err() {
                    return;
                }
        }
        if send_initial == Some(true) && bookmarks && tx.send(filter.bookmark(last_rv, true)).await.is_err() {
            return;
        }
        let mut rx = start.rx;
        let mut ticker = tokio::time::interval(interval);
        ticker.tick().await;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = &mut deadline => return,
                _ = tx.closed() => return,
                _ = ticker.tick(), if bookmarks => {
                    if tx.send(filter.bookmark(last_rv, false)).await.is_err() {
                        return;
                    }
                }
                ev = rx.recv() => match ev {
                    Ok(ev) => {
                        last_rv = last_rv.max(ev.rv);
                        if let Some(t) = filter.classify(&ev)
                            && tx.send(filter.render(t, &ev.object)).await.is_err() {
                                return;
                            }
                    }
                    // A watcher that fell too far behind is ended; its client resumes from
                    // the last resourceVersion it saw.
                    Err(broadcast::error::RecvError::Lagged(_)) | Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        }
    });
    Ok(resp)
}
