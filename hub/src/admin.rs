//! `/admin/v1/ca`: the hub CA rotation, for admins (see
//! [`crate::authority`] for the steps).
//!
//! - `GET /admin/v1/ca`: the phase, the CAs' fingerprints and the links not
//!   ready for the next step.
//! - `POST /admin/v1/ca/{stage,activate,finish}[?force=true]`: one step;
//!   409 with the clusters that are not ready, unless forced.
//!
//! `/admin/v1/links/<cluster>/re-enroll`: lets the cluster take one join
//! token authorized from now on, whose agent replaces the current one
//! (a join token enrolls a cluster once otherwise).

use std::sync::Arc;

use hyper::body::Incoming;

use crate::{
    authority::{NotReady, Phase},
    forward::HttpBody,
    server::{HubState, plain},
};

/// How many agents are asked to renew at once after a step.
const RENEW_FAN_OUT: usize = 32;

fn json(status: http::StatusCode, value: &serde_json::Value) -> http::Response<HttpBody> {
    let mut resp = plain(status, &value.to_string());
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

/// The caller, if an admin; else the 401 or 403 to answer.
pub(crate) async fn admin(
    state: &HubState,
    req: &http::Request<Incoming>,
) -> Result<otter_tunnel::Caller, http::Response<HttpBody>> {
    let caller = crate::auth::authenticate(state, req.headers())
        .await
        .map_err(|s| plain(http::StatusCode::UNAUTHORIZED, s.message()))?;
    crate::auth::require_admin(state, &caller)
        .map_err(|s| plain(http::StatusCode::FORBIDDEN, s.message()))?;
    Ok(caller)
}

/// The rotation's state as the API shows it.
pub fn status(state: &HubState) -> crate::Result<serde_json::Value> {
    let cas = state.authority.current();
    let pending = state.authority.pending(&*state.store)?;
    let next = match cas.phase {
        Phase::Steady => "stage",
        Phase::Staged => "activate",
        Phase::Activated => "finish",
    };
    Ok(serde_json::json!({
        "phase": cas.phase,
        "active": cas.active.fingerprint(),
        "other": cas.other.as_ref().map(|c| c.fingerprint()),
        "since": cas.since,
        "next_step": next,
        // Links that would be stranded by the next step.
        "pending": pending,
    }))
}

/// Serves `/admin/v1/ca` and its steps.
pub async fn ca(
    state: Arc<HubState>,
    step: Option<&str>,
    req: http::Request<Incoming>,
) -> http::Response<HttpBody> {
    let caller = match admin(&state, &req).await {
        Ok(c) => c,
        Err(resp) => return crate::server::unread_body(resp, req),
    };
    let force = req
        .uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "force=true" || kv == "force=1"));
    let result = match (req.method().clone(), step) {
        (http::Method::GET, None) => None,
        (http::Method::POST, Some("stage")) => Some(state.authority.stage(&*state.store).map(Ok)),
        (http::Method::POST, Some("activate")) => {
            Some(state.authority.activate(&*state.store, force))
        }
        (http::Method::POST, Some("finish")) => Some(state.authority.finish(&*state.store, force)),
        (_, None) => return plain(http::StatusCode::METHOD_NOT_ALLOWED, "use GET"),
        (_, Some("stage" | "activate" | "finish")) => {
            return plain(http::StatusCode::METHOD_NOT_ALLOWED, "use POST");
        }
        (_, Some(other)) => {
            return plain(
                http::StatusCode::NOT_FOUND,
                &format!("no CA step {other:?}: stage, activate or finish"),
            );
        }
    };
    match result {
        None => {}
        Some(Err(e)) => return plain(http::StatusCode::CONFLICT, &e.to_string()),
        Some(Ok(Err(NotReady { step, clusters }))) => {
            return plain(
                http::StatusCode::CONFLICT,
                &format!(
                    "{step} would strand {} link(s) that have not renewed yet: {}; wait for them (they are asked to renew), re-enroll them, or force",
                    clusters.len(),
                    clusters.join(", ")
                ),
            );
        }
        Some(Ok(Ok(()))) => {
            tracing::info!(by = %caller.user, step = step.unwrap_or_default(), "CA rotation step");
            ask_agents_to_renew(&state);
        }
    }
    match status(&state) {
        Ok(v) => json(http::StatusCode::OK, &v),
        Err(e) => plain(http::StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

/// Asks every connected agent, on a stream of its own, to renew its
/// certificate now: after staging it learns the new CA, after activation it
/// gets a certificate the new CA signed. A few at a time, so hundreds of
/// clusters do not all register in the same instant.
pub fn ask_agents_to_renew(state: &Arc<HubState>) {
    let tunnels = state.registry.all();
    let limit = Arc::new(tokio::sync::Semaphore::new(RENEW_FAN_OUT));
    for entry in tunnels {
        let limit = limit.clone();
        state.tasks.spawn(async move {
            let Ok(_permit) = limit.acquire_owned().await else {
                return;
            };
            let answer = crate::registry::ask_agent(
                &entry,
                otter_tunnel::frame::TARGET_RENEW,
                http::Method::POST,
                std::time::Duration::from_secs(10),
            )
            .await
            .map(|r| r.status());
            tracing::debug!(cluster = %entry.cluster, ?answer, "asked the agent to renew");
        });
    }
}

/// Serves `POST /admin/v1/links/<cluster>/re-enroll`.
pub async fn re_enroll(
    state: Arc<HubState>,
    cluster: &str,
    req: http::Request<Incoming>,
) -> http::Response<HttpBody> {
    let caller = match admin(&state, &req).await {
        Ok(c) => c,
        Err(resp) => return crate::server::unread_body(resp, req),
    };
    if req.method() != http::Method::POST {
        return plain(http::StatusCode::METHOD_NOT_ALLOWED, "use POST");
    }
    if otter_pki::validate_cluster_name(cluster).is_err() {
        return plain(http::StatusCode::BAD_REQUEST, "not a cluster name");
    }
    let now = match crate::link_service::open_for_reenrollment(&*state.store, cluster) {
        Ok(Some(now)) => now,
        Ok(None) => {
            return plain(
                http::StatusCode::NOT_FOUND,
                &format!("cluster {cluster} is not enrolled; a new manifest enrolls it"),
            );
        }
        Err(e) => return plain(http::StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    };
    tracing::info!(%cluster, by = %caller.user, "cluster opened for re-enrollment");
    json(
        http::StatusCode::OK,
        &serde_json::json!({ "cluster": cluster, "reenroll_after": now }),
    )
}
