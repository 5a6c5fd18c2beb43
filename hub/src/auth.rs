//! Who is calling: bearer tokens, checked against the configured OpenID
//! Connect issuer (JWTs) or the hub's own token store (embedded default).

use otter_tunnel::Caller;

use crate::{server::HubState, tokens};

/// Message of every authentication failure: says how to authenticate.
pub const HOW_TO_AUTHENTICATE: &str = "send `authorization: Bearer <token>` with a token from your identity provider \
    or the hub (the embedded hub writes an admin token to <data dir>/admin-token; `otter login` stores one for the CLI)";

/// A caller the front door already verified from the request's headers,
/// carried in the request's extensions (which no client can set) so the
/// handlers behind it need not verify the token again.
#[derive(Debug, Clone)]
pub struct Verified(pub Caller);

/// Methods anyone may call: an agent's first Register carries its join
/// token in the message, and health checks and reflection come from
/// probes and tools without credentials. Everything else is refused
/// before its body is read unless the headers authenticate the caller.
pub fn needs_token(path: &str) -> bool {
    !(path == "/otterscale.link.v1.LinkService/Register"
        || path.starts_with("/grpc.health.v1.Health/")
        || path.starts_with("/grpc.reflection.v1.ServerReflection/")
        || path.starts_with("/grpc.reflection.v1alpha.ServerReflection/"))
}

/// The verified caller of a request: the one the front door verified (in
/// its extensions), or the one its `authorization` header authenticates.
pub async fn caller_of(
    state: &HubState,
    extensions: &http::Extensions,
    headers: &http::HeaderMap,
) -> Result<Caller, tonic::Status> {
    match extensions.get::<Verified>() {
        Some(Verified(caller)) => Ok(caller.clone()),
        None => authenticate(state, headers).await,
    }
}

/// The verified caller of a gRPC request.
pub async fn authenticate_grpc(
    state: &HubState,
    metadata: &tonic::metadata::MetadataMap,
) -> Result<Caller, tonic::Status> {
    let value = metadata
        .get("authorization")
        .map(|v| v.to_str().unwrap_or("\u{0}"));
    authenticate_value(state, value).await
}

/// The verified caller of an HTTP request, from its `authorization` header.
pub async fn authenticate(
    state: &HubState,
    headers: &http::HeaderMap,
) -> Result<Caller, tonic::Status> {
    let value = headers
        .get(http::header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or("\u{0}"));
    authenticate_value(state, value).await
}

async fn authenticate_value(
    state: &HubState,
    value: Option<&str>,
) -> Result<Caller, tonic::Status> {
    let value = value.ok_or_else(|| {
        tonic::Status::unauthenticated(format!("no credentials: {HOW_TO_AUTHENTICATE}"))
    })?;
    let token = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            tonic::Status::unauthenticated(format!(
                "malformed authorization header: {HOW_TO_AUTHENTICATE}"
            ))
        })?;
    // A JWT has three dot-separated parts; hub tokens have none.
    if token.split('.').count() == 3 {
        return match &state.oidc {
            Some(oidc) => oidc.verify(token).await,
            None => Err(tonic::Status::unauthenticated(format!(
                "this hub has no identity provider configured: {HOW_TO_AUTHENTICATE}"
            ))),
        };
    }
    match tokens::verify_api_token(&*state.store, token) {
        Ok(Some(mut caller)) => {
            if !caller.groups.iter().any(|g| g == "system:authenticated") {
                caller.groups.insert(0, "system:authenticated".into());
            }
            Ok(caller)
        }
        Ok(None) => Err(tonic::Status::unauthenticated(format!(
            "invalid or revoked token: {HOW_TO_AUTHENTICATE}"
        ))),
        Err(e) => Err(e.into_status()),
    }
}

/// PermissionDenied unless the caller is in the hub's admin group.
pub fn require_admin(state: &HubState, caller: &Caller) -> Result<(), tonic::Status> {
    if caller.groups.iter().any(|g| g == &state.config.admin_group) {
        Ok(())
    } else {
        Err(tonic::Status::permission_denied(format!(
            "{} is not in the admin group {:?}",
            caller.user, state.config.admin_group
        )))
    }
}
