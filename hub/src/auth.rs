//! Who is calling: bearer tokens, checked against the configured OpenID
//! Connect issuer (JWTs) or the hub's own token store (embedded default).

use otter_tunnel::Caller;

use crate::{server::HubState, tokens};

/// Message of every authentication failure: says how to authenticate.
pub const HOW_TO_AUTHENTICATE: &str = "send `authorization: Bearer <token>` with a token from your identity provider \
    or the hub (the embedded hub writes an admin token to <data dir>/admin-token; `otter login` stores one for the CLI)";

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
