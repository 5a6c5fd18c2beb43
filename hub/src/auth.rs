//! Who is calling: bearer tokens checked against the hub's token store.
//! (An OIDC issuer plugs in here too.)

use otter_tunnel::Caller;

use crate::{server::HubState, tokens};

/// Message of every authentication failure: says how to authenticate.
pub const HOW_TO_AUTHENTICATE: &str = "send `authorization: Bearer <token>`; \
    the embedded hub writes an admin token to <data dir>/admin-token, and `otter login` stores one for the CLI";

/// The verified caller of a gRPC request.
pub fn authenticate_grpc(
    state: &HubState,
    metadata: &tonic::metadata::MetadataMap,
) -> Result<Caller, tonic::Status> {
    let value = metadata
        .get("authorization")
        .map(|v| v.to_str().unwrap_or("\u{0}"));
    authenticate_value(state, value)
}

/// The verified caller of an HTTP request, from its `authorization` header.
pub fn authenticate(state: &HubState, headers: &http::HeaderMap) -> Result<Caller, tonic::Status> {
    let value = headers
        .get(http::header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or("\u{0}"));
    authenticate_value(state, value)
}

fn authenticate_value(state: &HubState, value: Option<&str>) -> Result<Caller, tonic::Status> {
    let value = value.ok_or_else(|| {
        tonic::Status::unauthenticated(format!("no credentials: {HOW_TO_AUTHENTICATE}"))
    })?;
    let token = Some(value)
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .ok_or_else(|| {
            tonic::Status::unauthenticated(format!(
                "malformed authorization header: {HOW_TO_AUTHENTICATE}"
            ))
        })?;
    match tokens::verify_api_token(&*state.store, token) {
        Ok(Some(mut caller)) => {
            if !caller.groups.iter().any(|g| g == "system:authenticated") {
                caller.groups.push("system:authenticated".into());
            }
            Ok(caller)
        }
        Ok(None) => Err(tonic::Status::unauthenticated(format!(
            "invalid or revoked token: {HOW_TO_AUTHENTICATE}"
        ))),
        Err(e) => Err(e.into_status()),
    }
}
