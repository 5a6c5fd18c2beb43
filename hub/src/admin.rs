//! The admin API, `/admin/v1/…`, under the `otter` CLI. The caller was
//! authenticated by the front door; each endpoint says who may use it.
//!
//! - `ca`, `ca/{stage,activate,finish}[?force=true]` (operators): the hub
//!   CA rotation (see [`crate::authority`]); 409 with the clusters that
//!   are not ready for a step, unless forced.
//! - `tenants` (POST: operators; GET: the caller's tenants, operators all)
//!   and `tenants/<name>` (DELETE, operators, an empty tenant).
//! - `tokens` (POST mints, GET lists) and `tokens/<id>` (DELETE revokes):
//!   a tenant's admins for their tenant, operators for any.
//! - `links/<cluster>/re-enroll` (POST) lets the cluster take one join
//!   token authorized from now on, whose agent replaces the current one;
//!   `links/<cluster>` (DELETE) forgets the link. Both for the cluster's
//!   tenant admins; to anyone else the cluster does not exist.

use std::sync::Arc;

use hyper::body::Incoming;

use crate::{
    auth::Principal,
    authority::{NotReady, Phase},
    forward::HttpBody,
    server::{HubState, plain},
    store::StoreExt,
    tenancy::{Role, TenancyError},
    tokens::TokenSpec,
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

/// Serves `/admin/v1/…`. The caller was authenticated by the front door;
/// each endpoint's methods are checked here, and an answer that needs no
/// body drains it ([`crate::server::unread_body`]).
pub async fn route(
    state: Arc<HubState>,
    path: &str,
    req: http::Request<Incoming>,
) -> http::Response<HttpBody> {
    use http::Method as M;
    let caller = match crate::auth::verified(req.extensions()) {
        Ok(c) => c,
        Err(s) => return crate::server::unread_body(refused(&s), req),
    };
    let parts: Vec<&str> = path.trim_start_matches("/admin/v1/").split('/').collect();
    let endpoint = match parts.as_slice() {
        ["ca"] => Endpoint::Ca(None),
        ["ca", step] => Endpoint::Ca(Some(step)),
        ["tokens"] => Endpoint::Tokens,
        ["tokens", id] => Endpoint::Token(id),
        ["tenants"] => Endpoint::Tenants,
        ["tenants", name] => Endpoint::Tenant(name),
        ["links", cluster, "re-enroll"] => Endpoint::ReEnroll(cluster),
        ["links", cluster] => Endpoint::Link(cluster),
        ["audit"] => Endpoint::Audit,
        _ => {
            let text = format!("no such endpoint: {path}");
            return crate::server::unread_body(plain(http::StatusCode::NOT_FOUND, &text), req);
        }
    };
    let allowed = endpoint.methods();
    let method = req.method().clone();
    if !allowed.contains(&method) {
        let names: Vec<&str> = allowed.iter().map(M::as_str).collect();
        let text = format!("use {}", names.join(" or "));
        return crate::server::unread_body(plain(http::StatusCode::METHOD_NOT_ALLOWED, &text), req);
    }
    let (state, caller) = (&*state, &caller);
    let timer = crate::audit::Timer::start();
    // A tenant admin's actions are its tenant's (with one tenant: the one
    // it acts in); an operator's belong to no tenant.
    let mut admin_of = caller.admin_tenants();
    let tenant = match (caller.operator, admin_of.next(), admin_of.next()) {
        (false, Some(only), None) => only.to_owned(),
        _ => String::new(),
    };
    let event = crate::audit::Event {
        kind: "admin",
        action: format!("{method} {path}"),
        tenant,
        user: caller.cluster_user.clone(),
        groups: caller.groups.clone(),
        remote: crate::server::ConnInfo::remote_of(req.extensions()),
        ..Default::default()
    };
    let record = |resp: http::Response<HttpBody>| {
        let mut event = event.clone();
        event.code = resp.status().as_u16().to_string();
        event.duration_ms = timer.millis();
        state.audit.record(event);
        resp
    };
    let resp = match (method, endpoint) {
        (M::POST, Endpoint::Tokens) => return record(mint_token(state, caller, req).await),
        (M::POST, Endpoint::Tenants) => return record(create_tenant(state, caller, req).await),
        (_, Endpoint::Audit) => {
            let query = req.uri().query().unwrap_or_default().to_owned();
            read_audit(state, caller, &query).await
        }
        (_, Endpoint::Ca(step)) => {
            let force = req
                .uri()
                .query()
                .is_some_and(|q| q.split('&').any(|kv| kv == "force=true" || kv == "force=1"));
            ca(state, caller, step, force)
        }
        (_, Endpoint::Tokens) => list_tokens(state, caller),
        (_, Endpoint::Token(id)) => revoke_token(state, caller, id),
        (_, Endpoint::Tenants) => list_tenants(state, caller),
        (_, Endpoint::Tenant(name)) => delete_tenant(state, caller, name),
        (_, Endpoint::ReEnroll(cluster)) => re_enroll(state, caller, cluster),
        (_, Endpoint::Link(cluster)) => delete_link(state, caller, cluster),
    };
    record(crate::server::unread_body(resp, req))
}

/// An admin endpoint, from its path.
enum Endpoint<'a> {
    Ca(Option<&'a str>),
    Tokens,
    Token(&'a str),
    Tenants,
    Tenant(&'a str),
    ReEnroll(&'a str),
    Link(&'a str),
    Audit,
}

impl Endpoint<'_> {
    fn methods(&self) -> &'static [http::Method] {
        use http::Method as M;
        match self {
            Endpoint::Ca(None) | Endpoint::Audit => &[M::GET],
            Endpoint::Ca(Some(_)) | Endpoint::ReEnroll(_) => &[M::POST],
            Endpoint::Tokens | Endpoint::Tenants => &[M::GET, M::POST],
            Endpoint::Token(_) | Endpoint::Tenant(_) | Endpoint::Link(_) => &[M::DELETE],
        }
    }
}

/// A gRPC status as the admin API's plain answer.
fn refused(status: &tonic::Status) -> http::Response<HttpBody> {
    let code = match status.code() {
        tonic::Code::InvalidArgument => http::StatusCode::BAD_REQUEST,
        tonic::Code::Unauthenticated => http::StatusCode::UNAUTHORIZED,
        tonic::Code::PermissionDenied => http::StatusCode::FORBIDDEN,
        tonic::Code::NotFound => http::StatusCode::NOT_FOUND,
        tonic::Code::AlreadyExists | tonic::Code::FailedPrecondition => http::StatusCode::CONFLICT,
        tonic::Code::Unavailable => http::StatusCode::SERVICE_UNAVAILABLE,
        _ => http::StatusCode::INTERNAL_SERVER_ERROR,
    };
    plain(code, status.message())
}

/// Reads a small JSON body.
async fn json_body<T: serde::de::DeserializeOwned>(
    req: http::Request<Incoming>,
    shape: &str,
) -> Result<T, http::Response<HttpBody>> {
    use http_body_util::BodyExt;
    let body = http_body_util::Limited::new(req.into_body(), 64 * 1024)
        .collect()
        .await
        .map_err(|_| {
            // The rest is not read: the connection cannot carry more.
            let mut resp = plain(
                http::StatusCode::PAYLOAD_TOO_LARGE,
                "request body over 64 KiB",
            );
            resp.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
            resp
        })?
        .to_bytes();
    serde_json::from_slice(&body).map_err(|e| {
        plain(
            http::StatusCode::BAD_REQUEST,
            &format!("expected {shape}: {e}"),
        )
    })
}

/// `POST /admin/v1/tokens`: mints a hub API token (the token is in the
/// answer and nowhere else).
///
/// A tenant admin mints members and admins of its tenant; an operator
/// mints operators and a tenant's first admins (any membership).
async fn mint_token(
    state: &HubState,
    caller: &Principal,
    req: http::Request<Incoming>,
) -> http::Response<HttpBody> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        name: String,
        #[serde(default)]
        groups: Vec<String>,
        #[serde(default)]
        tenant: Option<String>,
        #[serde(default)]
        role: Option<String>,
        #[serde(default)]
        operator: bool,
        #[serde(default)]
        ttl_secs: Option<u64>,
    }
    let body: Body = match json_body(
        req,
        r#"{"name": …, "groups": […], "tenant": …, "role": "member"|"admin", "operator": false, "ttl_secs": …}"#,
    )
    .await
    {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let bad = |s: &str| s.is_empty() || s.len() > 253 || s.chars().any(char::is_control);
    if bad(&body.name) || body.groups.len() > 64 || body.groups.iter().any(|g| bad(g)) {
        return plain(
            http::StatusCode::BAD_REQUEST,
            "name and groups must be 1 to 253 printable characters, at most 64 groups",
        );
    }
    // No tenant, and no identity provider, names a Kubernetes built-in
    // identity or the hub's own operator group.
    let reserved = |g: &str| {
        crate::auth::is_role_name(g)
            || g.starts_with("system:")
            || g.starts_with("otter:")
            || g.starts_with("oidc:")
            || g == state.config.admin_group
    };
    if body.name.starts_with("system:") || body.groups.iter().any(|g| reserved(g)) {
        return plain(
            http::StatusCode::BAD_REQUEST,
            &format!(
                "user names may not start with \"system:\", group names not with \"system:\", \"otter:\" or \"oidc:\" nor be \"admins\", \"members\" (roles) or {:?} (make an operator with \"operator\": true)",
                state.config.admin_group
            ),
        );
    }
    let mut spec = TokenSpec {
        user: body.name.clone(),
        groups: body.groups.clone(),
        ttl: body.ttl_secs.map(std::time::Duration::from_secs),
        created_by: caller.user.clone(),
        ..Default::default()
    };
    if body.operator {
        if let Err(s) = crate::auth::require_operator(caller) {
            return refused(&s);
        }
        if body.tenant.is_some() || body.role.is_some() {
            return plain(
                http::StatusCode::BAD_REQUEST,
                "an operator token belongs to no tenant; make tenant tokens separately",
            );
        }
        spec.operator = true;
    } else {
        let role = match body.role.as_deref().unwrap_or("member").parse::<Role>() {
            Ok(r) => r,
            Err(e) => return plain(http::StatusCode::BAD_REQUEST, &e.to_string()),
        };
        let tenant = match crate::auth::admin_tenant(caller, body.tenant.as_deref(), true) {
            Ok(t) => t,
            Err(s) => return refused(&s),
        };
        match crate::tenancy::tenant(&*state.store, &tenant) {
            Ok(Some(_)) => {}
            Ok(None) => return refused(&TenancyError::NoSuchTenant(tenant).status()),
            Err(e) => return refused(&e.into_status()),
        }
        // An operator names a tenant's first admin and nothing else, once:
        // it cannot make itself, or anyone, a member of a tenant later
        // (revoking the tenant's admins first does not reopen it).
        if !caller.is_admin_of(&tenant) {
            let first = role == Role::Admin
                && match crate::tenancy::mark_admins_named(&*state.store, &tenant) {
                    Ok(first) => first,
                    Err(e) => return refused(&e.into_status()),
                };
            if !first {
                return plain(
                    http::StatusCode::FORBIDDEN,
                    &format!(
                        "{} is not an admin of tenant {tenant:?}; an operator only names a tenant's first admin",
                        caller.user
                    ),
                );
            }
        }
        spec.tenants.insert(tenant, role);
    }
    match crate::tokens::mint_api_token(&*state.store, &spec) {
        Ok((token, id)) => {
            tracing::info!(user = %spec.user, %id, operator = spec.operator, tenants = ?spec.tenants, by = %caller.user, "API token created");
            json(
                http::StatusCode::OK,
                &serde_json::json!({
                    "id": id,
                    "name": spec.user,
                    "groups": spec.groups,
                    "tenants": spec.tenants,
                    "operator": spec.operator,
                    "token": token,
                }),
            )
        }
        Err(e) => refused(&e.into_status()),
    }
}

/// `GET /admin/v1/audit[?tenant=T][&since=SECONDS]`: the audit lines of a
/// tenant (its admins; operators any, or all), newest last, the last
/// [`crate::audit::MAX_READ_LINES`] at most.
async fn read_audit(state: &HubState, caller: &Principal, query: &str) -> http::Response<HttpBody> {
    let mut tenant = None;
    let mut since = std::time::Duration::from_secs(3600);
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        match &*k {
            "tenant" => tenant = Some(v.into_owned()),
            "since" => match v.parse() {
                Ok(secs) => since = std::time::Duration::from_secs(secs),
                Err(_) => return plain(http::StatusCode::BAD_REQUEST, "since: whole seconds"),
            },
            _ => {}
        }
    }
    // Operators read any tenant's lines, or all; an admin its own tenant's.
    let tenant = match (tenant, caller.operator) {
        (t, true) => t,
        (t, false) => match crate::auth::admin_tenant(caller, t.as_deref(), false) {
            Ok(t) => Some(t),
            Err(s) => return refused(&s),
        },
    };
    let path = match state.audit.target() {
        Some(crate::audit::Target::File { path, .. }) => path.clone(),
        Some(crate::audit::Target::Stdout) => {
            return plain(
                http::StatusCode::CONFLICT,
                "this hub writes its audit log to stdout; read it from there",
            );
        }
        None => {
            return plain(
                http::StatusCode::CONFLICT,
                "this hub keeps no audit log (start it with --audit-log)",
            );
        }
    };
    let Some(permit) = state.audit.reader() else {
        return plain(
            http::StatusCode::TOO_MANY_REQUESTS,
            "the audit log is being read by others; retry in a moment",
        );
    };
    // A tenant made again under a deleted one's name is someone else: it
    // reads nothing from before its own creation.
    let born = match &tenant {
        Some(t) => match crate::tenancy::tenant(&*state.store, t) {
            Ok(record) => record.map(|r| r.created),
            Err(e) => return refused(&e.into_status()),
        },
        None => None,
    };
    // Streaming the files blocks: off the async workers.
    let read = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        crate::audit::read(&path, tenant.as_deref(), since, born)
    })
    .await;
    match read {
        Ok(Ok(lines)) => json(
            http::StatusCode::OK,
            &serde_json::json!({ "events": lines }),
        ),
        Ok(Err(e)) => refused(&e.into_status()),
        Err(_) => plain(
            http::StatusCode::INTERNAL_SERVER_ERROR,
            "reading the audit log failed; see the hub's log",
        ),
    }
}

/// May `caller` see and revoke this token: operators every one, a tenant
/// admin those whose every membership is in tenants it administers.
fn manages(caller: &Principal, rec: &crate::tokens::ApiTokenRecord) -> bool {
    caller.operator
        || (!rec.operator
            && !rec.tenants.is_empty()
            && rec.tenants.keys().all(|t| caller.is_admin_of(t)))
}

/// `GET /admin/v1/tokens`: the tokens the caller manages, without their
/// secrets.
fn list_tokens(state: &HubState, caller: &Principal) -> http::Response<HttpBody> {
    let records = match state
        .store
        .scan::<crate::tokens::ApiTokenRecord>(crate::store::tree::API_TOKENS)
    {
        Ok(r) => r,
        Err(e) => return refused(&e.into_status()),
    };
    let list: Vec<serde_json::Value> = records
        .iter()
        .filter(|r| manages(caller, r))
        .map(|r| {
            serde_json::json!({
                "id": r.id, "name": r.name, "groups": r.groups, "tenants": r.tenants,
                "operator": r.operator, "created": r.created, "expires": r.expires,
                "created_by": r.created_by,
            })
        })
        .collect();
    json(http::StatusCode::OK, &serde_json::json!({ "tokens": list }))
}

/// `DELETE /admin/v1/tokens/<id>`: the token fails from its next call on.
fn revoke_token(state: &HubState, caller: &Principal, id: &str) -> http::Response<HttpBody> {
    // A token the caller does not manage is as unknown as one that is not.
    let not_found = || plain(http::StatusCode::NOT_FOUND, &format!("no token {id:?}"));
    let rec = match state
        .store
        .get::<crate::tokens::ApiTokenRecord>(crate::store::tree::API_TOKENS, id)
    {
        Ok(Some(r)) if manages(caller, &r) => r,
        Ok(_) => return not_found(),
        Err(e) => return refused(&e.into_status()),
    };
    match crate::tokens::revoke_api_token(&*state.store, &rec.id) {
        Ok(_) => {
            tracing::info!(%id, user = %rec.name, by = %caller.user, "API token revoked");
            state.live.revoke(&rec.id);
            json(
                http::StatusCode::OK,
                &serde_json::json!({ "id": id, "revoked": true }),
            )
        }
        Err(e) => refused(&e.into_status()),
    }
}

/// `GET /admin/v1/tenants`: the tenants the caller sees (operators: all).
fn list_tenants(state: &HubState, caller: &Principal) -> http::Response<HttpBody> {
    let all = match crate::tenancy::list_tenants(&*state.store) {
        Ok(all) => all,
        Err(e) => return refused(&e.into_status()),
    };
    let mut list = Vec::new();
    for t in all {
        let role = caller.role_in(&t.name);
        if !caller.operator && role.is_none() {
            continue;
        }
        let clusters = crate::tenancy::clusters_of(&*state.store, &t.name)
            .map(|c| c.len())
            .unwrap_or_default();
        list.push(serde_json::json!({
            "name": t.name, "created": t.created, "clusters": clusters,
            "role": role.map(Role::as_str),
        }));
    }
    json(
        http::StatusCode::OK,
        &serde_json::json!({ "tenants": list }),
    )
}

/// `POST /admin/v1/tenants {"name": …}` (operators) creates a tenant.
async fn create_tenant(
    state: &HubState,
    caller: &Principal,
    req: http::Request<Incoming>,
) -> http::Response<HttpBody> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        name: String,
    }
    if let Err(s) = crate::auth::require_operator(caller) {
        return crate::server::unread_body(refused(&s), req);
    }
    let body: Body = match json_body(req, r#"{"name": …}"#).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    if let Err(e) = crate::tenancy::validate_tenant_name(&body.name) {
        return plain(http::StatusCode::BAD_REQUEST, &e.to_string());
    }
    match crate::tenancy::create_tenant(&*state.store, &body.name, &caller.user) {
        Ok(Ok(t)) => {
            tracing::info!(tenant = %t.name, by = %caller.user, "tenant created");
            json(
                http::StatusCode::OK,
                &serde_json::json!({ "name": t.name, "created": t.created }),
            )
        }
        Ok(Err(e)) => refused(&e.status()),
        Err(e) => refused(&e.into_status()),
    }
}

/// `DELETE /admin/v1/tenants/<name>` (operators): an empty tenant only.
fn delete_tenant(state: &HubState, caller: &Principal, name: &str) -> http::Response<HttpBody> {
    if let Err(s) = crate::auth::require_operator(caller) {
        return refused(&s);
    }
    match crate::tenancy::delete_tenant(&*state.store, name) {
        Ok(Ok(())) => {
            tracing::info!(tenant = %name, by = %caller.user, "tenant deleted");
            json(
                http::StatusCode::OK,
                &serde_json::json!({ "name": name, "deleted": true }),
            )
        }
        Ok(Err(e)) => refused(&e.status()),
        Err(e) => refused(&e.into_status()),
    }
}

/// The tenant of `cluster` if the caller administers it; otherwise the
/// answer for a cluster that does not exist, whoever holds it.
fn administered_cluster(
    state: &HubState,
    caller: &Principal,
    cluster: &str,
) -> Result<String, tonic::Status> {
    if otter_pki::validate_cluster_name(cluster).is_err() {
        return Err(tonic::Status::invalid_argument("not a cluster name"));
    }
    match crate::tenancy::tenant_of(&*state.store, cluster) {
        Ok(Some(tenant)) if caller.is_admin_of(&tenant) => Ok(tenant),
        Ok(_) => Err(tonic::Status::not_found(format!(
            "cluster {cluster} is not enrolled; a new manifest enrolls it"
        ))),
        Err(e) => Err(e.into_status()),
    }
}

/// `DELETE /admin/v1/links/<cluster>` (the tenant's admins): the tunnel is
/// closed, the link, its certificate serial and the cluster's name are
/// forgotten; the old certificate is refused at the tunnel and at renewal
/// from then on, as it names no link.
fn delete_link(state: &HubState, caller: &Principal, cluster: &str) -> http::Response<HttpBody> {
    let tenant = match administered_cluster(state, caller, cluster) {
        Ok(t) => t,
        Err(s) => return refused(&s),
    };
    let forget = || -> crate::Result<()> {
        state.store.delete(crate::store::tree::LINKS, cluster)?;
        crate::tenancy::release_cluster(&*state.store, cluster)?;
        state.store.flush()
    };
    if let Err(e) = forget() {
        return refused(&e.into_status());
    }
    if let Some(entry) = state.registry.take(cluster) {
        crate::registry::close_soon(entry, "the link was deleted");
    }
    tracing::info!(%cluster, %tenant, by = %caller.user, "link deleted");
    json(
        http::StatusCode::OK,
        &serde_json::json!({ "cluster": cluster, "deleted": true }),
    )
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
fn ca(
    state: &HubState,
    caller: &Principal,
    step: Option<&str>,
    force: bool,
) -> http::Response<HttpBody> {
    if let Err(s) = crate::auth::require_operator(caller) {
        return refused(&s);
    }
    // The methods were checked: GET for the status, POST for a step.
    let result = match step {
        None => None,
        Some("stage") => Some(state.authority.stage(&*state.store).map(Ok)),
        Some("activate") => Some(state.authority.activate(&*state.store, force)),
        Some("finish") => Some(state.authority.finish(&*state.store, force)),
        Some(other) => {
            return plain(
                http::StatusCode::NOT_FOUND,
                &format!("no CA step {other:?}: stage, activate or finish"),
            );
        }
    };
    // A step refused because another was taken meanwhile took that one up.
    cas_changed(state);
    match result {
        None => {}
        Some(Err(e @ crate::HubError::StoreUnavailable(_))) => {
            return plain(http::StatusCode::SERVICE_UNAVAILABLE, &e.to_string());
        }
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
        }
    }
    match status(state) {
        Ok(v) => json(http::StatusCode::OK, &v),
        Err(e) => plain(http::StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

/// After a rotation step, here or on another replica (once per change):
/// new connections to the other replicas present a certificate of the CAs
/// now, and connected agents renew.
pub fn cas_changed(state: &HubState) {
    if !state.authority.take_change() {
        return;
    }
    if let Some(peers) = &state.peers
        && let Err(e) = peers.refresh(&state.authority, &state.config.replica)
    {
        tracing::warn!(error = %e, "could not renew the replica certificate");
    }
    ask_agents_to_renew(state);
}

/// Asks every connected agent, on a stream of its own, to renew its
/// certificate now: after staging it learns the new CA, after activation it
/// gets a certificate the new CA signed. A few at a time, so hundreds of
/// clusters do not all register in the same instant.
pub fn ask_agents_to_renew(state: &HubState) {
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
                http::HeaderMap::new(),
                std::time::Duration::from_secs(10),
            )
            .await
            .map(|r| r.status());
            tracing::debug!(cluster = %entry.cluster, ?answer, "asked the agent to renew");
        });
    }
}

/// Serves `POST /admin/v1/links/<cluster>/re-enroll`.
fn re_enroll(state: &HubState, caller: &Principal, cluster: &str) -> http::Response<HttpBody> {
    if let Err(s) = administered_cluster(state, caller, cluster) {
        return refused(&s);
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
