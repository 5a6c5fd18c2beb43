//! Resource names as kubectl users type them (`pods`, `po`, `deploy`,
//! `deployments.apps`, `Deployment`), resolved with the cluster's Discovery.

use otter_proto::resource::v1::{
    ApiResource, DiscoveryRequest, resource_service_client::ResourceServiceClient,
};

use super::client::Hub;

/// The cluster's resource types.
pub async fn discover(hub: &Hub, cluster: &str) -> anyhow::Result<Vec<ApiResource>> {
    let mut c = ResourceServiceClient::new(hub.channel.clone());
    let resp = c
        .discovery(hub.req(DiscoveryRequest {
            cluster: Some(cluster.to_owned()),
        }))
        .await
        .map_err(super::status_error)?;
    Ok(resp.into_inner().api_resources)
}

fn s(o: &Option<String>) -> &str {
    o.as_deref().unwrap_or("")
}

/// Finds a resource type by plural, kind, short name or `plural.group`.
pub fn resolve<'a>(all: &'a [ApiResource], name: &str) -> anyhow::Result<&'a ApiResource> {
    let name_l = name.to_ascii_lowercase();
    let (base, group) = match name_l.split_once('.') {
        Some((b, g)) => (b.to_owned(), Some(g.to_owned())),
        None => (name_l.clone(), None),
    };
    let matches = |r: &&ApiResource| {
        let names_match = s(&r.resource) == base
            || s(&r.kind).to_ascii_lowercase() == base
            || r.short_names.iter().any(|sn| sn == &base);
        let group_match = group
            .as_deref()
            .is_none_or(|g| s(&r.group) == g || s(&r.group).starts_with(&format!("{g}.")));
        // Subresources (pods/log) are not resources you can get.
        names_match && group_match && !s(&r.resource).contains('/')
    };
    // The core group first, as kubectl prefers it for ambiguous names.
    let mut found: Vec<&ApiResource> = all.iter().filter(matches).collect();
    found.sort_by_key(|r| (!s(&r.group).is_empty(), s(&r.group).to_owned()));
    found
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("the server doesn't have a resource type \"{name}\""))
}

/// Finds the resource type of an object by its apiVersion and kind.
pub fn by_kind<'a>(
    all: &'a [ApiResource],
    api_version: &str,
    kind: &str,
) -> anyhow::Result<&'a ApiResource> {
    let (group, version) = match api_version.split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", api_version),
    };
    all.iter()
        .find(|r| {
            s(&r.group) == group
                && s(&r.version) == version
                && s(&r.kind) == kind
                && !s(&r.resource).contains('/')
        })
        .ok_or_else(|| {
            anyhow::anyhow!("no resource type for {kind} in {api_version} on this cluster")
        })
}
