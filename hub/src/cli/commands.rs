//! The client commands of `otter`: each turns flags into RPCs on the hub
//! and prints what a kubectl user expects.

use std::{io::Write, path::PathBuf, time::Duration};

use futures::StreamExt;
use otter_proto::{
    link::v1::{
        GetAgentManifestRequest, LinkState, ListLinksRequest,
        link_service_client::LinkServiceClient,
    },
    resource::v1::{
        ApplyRequest, DeleteRequest, DescribeRequest, GetRequest, ListRequest, WatchRequest,
        resource_service_client::ResourceServiceClient, watch_event,
    },
    runtime::v1::{
        ExecuteTtyRequest, PodLogRequest, PortForwardRequest, ResizeTtyRequest, RestartRequest,
        ScaleRequest, WritePortForwardRequest, WriteTtyRequest,
        runtime_service_client::RuntimeServiceClient,
    },
};
use serde_json::Value as Json;

use super::{
    client::{FileConfig, Hub, save_file},
    output::{self, struct_to_json},
    resources,
    resume::{self, ResumingWatch, Watched},
    status_error,
};

/// `otter config use-cluster X`: the cluster commands act on without
/// `--cluster`; empty clears it.
pub fn use_cluster(cluster: &str) -> anyhow::Result<()> {
    if !cluster.is_empty() {
        otter_pki::validate_cluster_name(cluster)
            .map_err(|e| anyhow::anyhow!("{cluster:?}: {e}"))?;
    }
    let mut file = super::client::load_file()?;
    file.cluster = (!cluster.is_empty()).then(|| cluster.to_owned());
    let path = save_file(&file)?;
    match &file.cluster {
        Some(c) => println!(
            "Commands act on cluster {c} without --cluster (saved to {})",
            path.display()
        ),
        None => println!("No default cluster (saved to {})", path.display()),
    }
    Ok(())
}

/// `otter login`.
pub async fn login(hub: url::Url, token: String, ca_file: Option<PathBuf>) -> anyhow::Result<()> {
    let ca_pem = ca_file
        .map(|p| std::fs::read_to_string(&p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display())))
        .transpose()?;
    // Check before saving: a login that cannot list links is no login.
    let channel = super::client::channel(&hub, ca_pem.as_deref()).await?;
    let h = Hub {
        url: hub.clone(),
        token: token.clone(),
        ca_pem: ca_pem.clone(),
        channel,
    };
    LinkServiceClient::new(h.channel.clone())
        .list_links(h.req(ListLinksRequest {}))
        .await
        .map_err(status_error)?;
    // The default cluster stays across logins to the same hub.
    let kept = super::client::load_file()
        .ok()
        .filter(|f| f.hub.as_deref() == Some(hub.as_str()))
        .and_then(|f| f.cluster);
    let path = save_file(&FileConfig {
        hub: Some(hub.to_string()),
        token: Some(token),
        ca_pem,
        cluster: kept,
    })?;
    println!("Logged in to {hub}; settings saved to {}", path.display());
    Ok(())
}

/// Sends one request to the hub's admin HTTP API (`path` under the hub
/// URL) with the login's token; the answer's body, or its text as the error.
async fn admin_http(
    hub: &Hub,
    method: http::Method,
    path: &str,
    body: Option<String>,
) -> anyhow::Result<bytes::Bytes> {
    use http_body_util::BodyExt;
    let url = format!("{}{path}", hub.url.as_str().trim_end_matches('/'));
    let tls = match &hub.ca_pem {
        // hyper-rustls sets ALPN itself.
        Some(ca) => otter_pki::tls::client_config(ca, None, &[])?,
        None => otter_pki::tls::public_client_config(None, &[])?,
    };
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http1()
        .build();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(https);
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {}", hub.token))
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.unwrap_or_default(),
        )))?;
    let resp = client.request(req).await?;
    let status = resp.status();
    let text = resp.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        anyhow::bail!("{}", String::from_utf8_lossy(&text).trim());
    }
    Ok(text)
}

/// What `otter token create` asks for.
#[derive(Debug, Default)]
pub struct NewToken {
    pub name: String,
    pub groups: Vec<String>,
    pub tenant: Option<String>,
    pub role: Option<String>,
    pub operator: bool,
    pub ttl: Option<std::time::Duration>,
}

/// `otter token create`: prints the token (and nothing else, for scripts).
pub async fn token_create(hub: &Hub, new: &NewToken) -> anyhow::Result<()> {
    let body = serde_json::json!({
        "name": new.name, "groups": new.groups, "tenant": new.tenant, "role": new.role,
        "operator": new.operator, "ttl_secs": new.ttl.map(|t| t.as_secs()),
    })
    .to_string();
    let text = admin_http(hub, http::Method::POST, "/admin/v1/tokens", Some(body)).await?;
    let v: Json = serde_json::from_slice(&text)?;
    println!("{}", v["token"].as_str().unwrap_or_default());
    Ok(())
}

/// `otter token list`.
pub async fn token_list(hub: &Hub, output: Option<&str>) -> anyhow::Result<()> {
    let text = admin_http(hub, http::Method::GET, "/admin/v1/tokens", None).await?;
    let v: Json = serde_json::from_slice(&text)?;
    if output == Some("json") {
        println!("{}", serde_json::to_string_pretty(&v["tokens"])?);
        return Ok(());
    }
    let now = crate::unix_now();
    let mut rows = Vec::new();
    for t in v["tokens"].as_array().into_iter().flatten() {
        let tenants = t["tenants"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, r)| format!("{k}:{}", r.as_str().unwrap_or_default()))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        let expires = t["expires"].as_i64().map_or("never".to_owned(), |e| {
            if e <= now {
                "expired".to_owned()
            } else {
                format!("in {}", crate::short_duration(e - now))
            }
        });
        rows.push(vec![
            t["id"].as_str().unwrap_or_default().to_owned(),
            output::printable(t["name"].as_str().unwrap_or_default()).into_owned(),
            output::printable(&tenants).into_owned(),
            t["operator"].as_bool().unwrap_or_default().to_string(),
            crate::short_duration(now - t["created"].as_i64().unwrap_or(now)),
            expires,
        ]);
    }
    print!(
        "{}",
        output::table(
            &["ID", "USER", "TENANTS", "OPERATOR", "AGE", "EXPIRES"],
            &rows
        )
    );
    Ok(())
}

/// `otter token revoke <id>`.
pub async fn token_revoke(hub: &Hub, id: &str) -> anyhow::Result<()> {
    admin_http(
        hub,
        http::Method::DELETE,
        &format!("/admin/v1/tokens/{id}"),
        None,
    )
    .await?;
    println!("token {} revoked", output::printable(id));
    Ok(())
}

/// `otter tenant create|list|delete`.
pub async fn tenant(hub: &Hub, action: &super::TenantCommand) -> anyhow::Result<()> {
    use super::TenantCommand;
    match action {
        TenantCommand::Create { name, .. } => {
            let body = serde_json::json!({ "name": name }).to_string();
            admin_http(hub, http::Method::POST, "/admin/v1/tenants", Some(body)).await?;
            println!("tenant {} created", output::printable(name));
        }
        TenantCommand::Delete { name, .. } => {
            admin_http(
                hub,
                http::Method::DELETE,
                &format!("/admin/v1/tenants/{name}"),
                None,
            )
            .await?;
            println!("tenant {} deleted", output::printable(name));
        }
        TenantCommand::List { .. } => {
            let text = admin_http(hub, http::Method::GET, "/admin/v1/tenants", None).await?;
            let v: Json = serde_json::from_slice(&text)?;
            let now = crate::unix_now();
            let mut rows = Vec::new();
            for t in v["tenants"].as_array().into_iter().flatten() {
                rows.push(vec![
                    output::printable(t["name"].as_str().unwrap_or_default()).into_owned(),
                    t["clusters"].as_u64().unwrap_or_default().to_string(),
                    t["role"].as_str().unwrap_or("-").to_owned(),
                    crate::short_duration(now - t["created"].as_i64().unwrap_or(now)),
                ]);
            }
            print!(
                "{}",
                output::table(&["NAME", "CLUSTERS", "ROLE", "AGE"], &rows)
            );
        }
    }
    Ok(())
}

/// `otter audit`.
pub async fn audit(
    hub: &Hub,
    tenant: Option<&str>,
    since: std::time::Duration,
    output: Option<&str>,
) -> anyhow::Result<()> {
    let mut query = format!("since={}", since.as_secs());
    if let Some(t) = tenant {
        query.push_str(&format!("&tenant={t}"));
    }
    let text = admin_http(
        hub,
        http::Method::GET,
        &format!("/admin/v1/audit?{query}"),
        None,
    )
    .await?;
    let v: Json = serde_json::from_slice(&text)?;
    let events = v["events"].as_array().cloned().unwrap_or_default();
    if output == Some("json") {
        for e in &events {
            println!("{e}");
        }
        return Ok(());
    }
    let field = |e: &Json, k: &str| output::printable(e[k].as_str().unwrap_or("-")).into_owned();
    let rows: Vec<Vec<String>> = events
        .iter()
        .map(|e| {
            vec![
                field(e, "time"),
                field(e, "kind"),
                field(e, "tenant"),
                field(e, "user"),
                field(e, "cluster"),
                field(e, "action"),
                field(e, "code"),
                format!("{:.1}", e["duration_ms"].as_f64().unwrap_or_default()),
            ]
        })
        .collect();
    print!(
        "{}",
        output::table(
            &[
                "TIME", "KIND", "TENANT", "USER", "CLUSTER", "ACTION", "CODE", "MS"
            ],
            &rows
        )
    );
    Ok(())
}

/// `otter links delete <cluster>`.
pub async fn link_delete(hub: &Hub, cluster: &str) -> anyhow::Result<()> {
    admin_http(
        hub,
        http::Method::DELETE,
        &format!("/admin/v1/links/{cluster}"),
        None,
    )
    .await?;
    println!(
        "link {} deleted: its tunnel is closed and its agent's certificate refused",
        output::printable(cluster)
    );
    Ok(())
}

/// `otter ca …`: one rotation step (or the status), then the status.
pub async fn ca(hub: &Hub, step: super::CaStep) -> anyhow::Result<()> {
    use super::CaStep;
    let (method, path) = match step {
        CaStep::Status => (http::Method::GET, "/admin/v1/ca".to_owned()),
        CaStep::Stage => (http::Method::POST, "/admin/v1/ca/stage".to_owned()),
        CaStep::Activate { force } => (
            http::Method::POST,
            format!(
                "/admin/v1/ca/activate{}",
                if force { "?force=true" } else { "" }
            ),
        ),
        CaStep::Finish { force } => (
            http::Method::POST,
            format!(
                "/admin/v1/ca/finish{}",
                if force { "?force=true" } else { "" }
            ),
        ),
    };
    let text = admin_http(hub, method, &path, None).await?;
    let v: Json = serde_json::from_slice(&text)?;
    println!("phase:     {}", v["phase"].as_str().unwrap_or_default());
    println!("active CA: {}", v["active"].as_str().unwrap_or_default());
    if let Some(other) = v["other"].as_str() {
        println!("other CA:  {other}");
    }
    let pending: Vec<&str> = v["pending"]
        .as_array()
        .map(|a| a.iter().filter_map(|c| c.as_str()).collect())
        .unwrap_or_default();
    let next = v["next_step"].as_str().unwrap_or_default();
    if pending.is_empty() {
        println!("next step: {next} (every cluster is ready)");
    } else {
        println!(
            "next step: {next}, waiting for {} cluster(s) to renew: {}",
            pending.len(),
            output::printable(&pending.join(", "))
        );
    }
    Ok(())
}

/// `otter re-enroll <cluster>`.
pub async fn re_enroll(hub: &Hub, cluster: &str) -> anyhow::Result<()> {
    let path = format!("/admin/v1/links/{cluster}/re-enroll");
    admin_http(hub, http::Method::POST, &path, None).await?;
    println!(
        "cluster {} takes a new agent: apply a manifest made from now on (otter agent-manifest --cluster {}); its current agent is replaced when the new one registers",
        output::printable(cluster),
        output::printable(cluster)
    );
    Ok(())
}

/// `otter agent-manifest`.
/// Reads `key=value` (set) and `key-` (remove) arguments, as `kubectl
/// label` takes them.
pub fn label_args(
    args: &[String],
) -> anyhow::Result<(std::collections::BTreeMap<String, String>, Vec<String>)> {
    let mut set = std::collections::BTreeMap::new();
    let mut remove = Vec::new();
    for arg in args {
        match arg.split_once('=') {
            Some((k, v)) => {
                set.insert(k.to_owned(), v.to_owned());
            }
            None => match arg.strip_suffix('-') {
                Some(k) => remove.push(k.to_owned()),
                None => anyhow::bail!("{arg:?}: use key=value to set a label, key- to remove one"),
            },
        }
    }
    Ok((set, remove))
}

/// `otter links label`: sets and removes labels of one link.
pub async fn link_label(hub: &Hub, cluster: &str, args: &[String]) -> anyhow::Result<()> {
    let (labels, remove) = label_args(args)?;
    if labels.is_empty() && remove.is_empty() {
        anyhow::bail!("name labels to set (key=value) or remove (key-)");
    }
    let resp =
        otter_proto::fleet::v1::fleet_service_client::FleetServiceClient::new(hub.channel.clone())
            .label_link(hub.req(otter_proto::fleet::v1::LabelLinkRequest {
                cluster: Some(cluster.to_owned()),
                labels: labels.into_iter().collect(),
                remove,
            }))
            .await
            .map_err(status_error)?
            .into_inner();
    println!("link/{cluster} labeled: {}", labels_text(&resp.labels));
    Ok(())
}

/// Labels as `k=v,k2=v2` in key order; `<none>` for none, as kubectl
/// prints them.
pub fn labels_text(labels: &std::collections::HashMap<String, String>) -> String {
    if labels.is_empty() {
        return "<none>".to_owned();
    }
    let sorted: std::collections::BTreeMap<_, _> = labels.iter().collect();
    sorted
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

pub async fn agent_manifest(
    hub: &Hub,
    cluster: &str,
    tenant: Option<&str>,
    extra_users: Vec<String>,
    rancher: Option<String>,
    labels: &[String],
    yaml: bool,
) -> anyhow::Result<()> {
    let (labels, removed) = label_args(labels)?;
    if let Some(key) = removed.first() {
        anyhow::bail!("--label {key}-: a new link has no labels to remove");
    }
    let mut req = hub.req(GetAgentManifestRequest {
        cluster: Some(cluster.to_owned()),
        extra_users,
        rancher_project_id: rancher,
        labels: labels.into_iter().collect(),
    });
    if let Some(tenant) = tenant {
        req.metadata_mut().insert(
            crate::link_service::TENANT_HEADER,
            tenant
                .parse()
                .map_err(|_| anyhow::anyhow!("not a tenant name: {tenant:?}"))?,
        );
    }
    let resp = LinkServiceClient::new(hub.channel.clone())
        .get_agent_manifest(req)
        .await
        .map_err(status_error)?
        .into_inner();
    if yaml {
        print!("{}", resp.manifest.unwrap_or_default());
    } else {
        println!("{}", resp.url.unwrap_or_default());
    }
    Ok(())
}

/// `otter links`.
/// A link's state as `otter links` shows it.
fn state_name(state: Option<i32>) -> &'static str {
    match state.and_then(|s| LinkState::try_from(s).ok()) {
        Some(LinkState::Connected) => "Connected",
        Some(LinkState::Unresponsive) => "Unresponsive",
        _ => "Offline",
    }
}

pub async fn links(hub: &Hub, output: Option<&str>) -> anyhow::Result<()> {
    let resp = LinkServiceClient::new(hub.channel.clone())
        .list_links(hub.req(ListLinksRequest {}))
        .await
        .map_err(status_error)?
        .into_inner();
    if output == Some("json") {
        let items: Vec<Json> = resp
            .links
            .iter()
            .map(|l| {
                serde_json::json!({
                    "cluster": l.cluster, "agentId": l.agent_id, "agentVersion": l.agent_version,
                    "state": state_name(l.state).to_lowercase(),
                    "transport": l.transport, "remoteAddress": l.remote_address,
                    "lastSeen": l.last_seen.as_ref().map(|t| t.seconds),
                    "certificateExpires": l.certificate_expires.as_ref().map(|t| t.seconds),
                    "rancherProjectId": l.rancher_project_id,
                    "tenant": l.tenant,
                    "labels": l.labels.iter().collect::<std::collections::BTreeMap<_, _>>(),
                    "diagnosis": l.diagnosis.as_ref().map(|d| serde_json::json!({
                        "proxy": d.proxy, "rttMicros": d.rtt_micros,
                        "attempts": d.attempts.iter().map(|a| serde_json::json!({
                            "transport": a.transport, "ok": a.ok, "error": a.error,
                        })).collect::<Vec<_>>(),
                        "clockSkewMillis": d.clock_skew_millis,
                        "lastRenewalError": d.last_renewal_error,
                        "renewalFailures": d.renewal_failures,
                        "lastTunnelEnd": d.last_tunnel_end,
                        "reportedAt": d.reported_at.as_ref().map(|t| t.seconds),
                    })),
                })
            })
            .collect();
        println!("{}", output::json(&items)?);
        return Ok(());
    }
    let wide = output == Some("wide");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let mut rows = Vec::new();
    for l in &resp.links {
        let state = state_name(l.state);
        let seen = l
            .last_seen
            .as_ref()
            .map_or("-".into(), |t| crate::short_duration(now - t.seconds));
        let mut row = vec![
            l.cluster.clone().unwrap_or_default(),
            state.to_owned(),
            l.transport
                .clone()
                .filter(|t| !t.is_empty())
                .unwrap_or_else(|| "-".into()),
            l.agent_version.clone().unwrap_or_default(),
            seen,
        ];
        if wide {
            row.push(l.tenant.clone().unwrap_or_else(|| "-".into()));
            row.push(l.agent_id.clone().unwrap_or_else(|| "-".into()));
            row.push(l.remote_address.clone().unwrap_or_else(|| "-".into()));
            row.push(l.certificate_expires.as_ref().map_or("-".into(), |t| {
                format!("in {}", crate::short_duration(t.seconds - now))
            }));
            let d = l.diagnosis.as_ref();
            row.push(
                d.and_then(|d| d.proxy.clone())
                    .unwrap_or_else(|| "direct".into()),
            );
            row.push(
                d.and_then(|d| d.rtt_micros)
                    .map_or("-".into(), |us| format!("{:.1}ms", us as f64 / 1000.0)),
            );
            let failed: Vec<String> = d
                .map(|d| {
                    d.attempts
                        .iter()
                        .filter(|a| a.ok == Some(false))
                        .filter_map(|a| a.transport.clone())
                        .collect()
                })
                .unwrap_or_default();
            row.push(if failed.is_empty() {
                "-".into()
            } else {
                format!("{} failed", failed.join(","))
            });
            row.push(d.and_then(|d| d.clock_skew_millis).map_or("-".into(), skew));
            // The error itself is in `-o json`; a table cell says whether
            // renewals are failing and how often.
            row.push(d.map_or("-".into(), |d| match &d.last_renewal_error {
                Some(_) => format!("failing ({} failed)", d.renewal_failures.unwrap_or(0)),
                None => "ok".into(),
            }));
            row.push(labels_text(&l.labels));
        }
        rows.push(row);
    }
    let mut headers = vec![
        "CLUSTER",
        "STATE",
        "TRANSPORT",
        "AGENT VERSION",
        "LAST SEEN",
    ];
    if wide {
        headers.extend([
            "TENANT",
            "AGENT",
            "REMOTE",
            "CERT EXPIRES",
            "VIA",
            "RTT",
            "FALLBACK",
            "SKEW",
            "RENEWAL",
            "LABELS",
        ]);
    }
    print!("{}", output::table(&headers, &rows));
    Ok(())
}

/// A clock skew for a table: how far the hub's clock is ahead of the
/// agent's (`-` when behind), in the unit that reads best.
fn skew(ms: i64) -> String {
    let sign = if ms < 0 { "-" } else { "+" };
    if ms.abs() < 1000 {
        format!("{sign}{}ms", ms.abs())
    } else {
        format!("{sign}{}", crate::short_duration(ms.abs() / 1000))
    }
}

/// Options of `otter get`.
#[derive(Debug)]
pub struct GetArgs {
    pub cluster: String,
    pub resource: String,
    pub name: Option<String>,
    pub namespace: Option<String>,
    pub all_namespaces: bool,
    pub selector: Option<String>,
    pub output: Option<String>,
    pub watch: bool,
}

/// `otter get`.
pub async fn get(hub: &Hub, a: GetArgs) -> anyhow::Result<()> {
    let all = resources::discover(hub, &a.cluster).await?;
    let rt = resources::resolve(&all, &a.resource)?.clone();
    let namespaced = rt.namespaced.unwrap_or(false);
    let namespace = if !namespaced || a.all_namespaces {
        String::new()
    } else {
        a.namespace.clone().unwrap_or_else(|| "default".into())
    };
    let kind = rt.kind.clone().unwrap_or_default();
    let mut client = ResourceServiceClient::new(hub.channel.clone());
    // Where the watch starts: right after the list, so it repeats nothing.
    let mut listed_at = None;
    let objects: Vec<Json> = match &a.name {
        Some(name) => {
            let r = client
                .get(hub.req(GetRequest {
                    cluster: Some(a.cluster.clone()),
                    group: rt.group.clone(),
                    version: rt.version.clone(),
                    resource: rt.resource.clone(),
                    namespace: Some(namespace.clone()),
                    name: Some(name.clone()),
                }))
                .await
                .map_err(status_error)?;
            vec![
                r.into_inner()
                    .object
                    .as_ref()
                    .map(struct_to_json)
                    .unwrap_or_default(),
            ]
        }
        None => {
            let r = client
                .list(hub.req(ListRequest {
                    cluster: Some(a.cluster.clone()),
                    group: rt.group.clone(),
                    version: rt.version.clone(),
                    resource: rt.resource.clone(),
                    namespace: Some(namespace.clone()),
                    label_selector: a.selector.clone(),
                    ..Default::default()
                }))
                .await
                .map_err(status_error)?;
            let r = r.into_inner();
            listed_at = r.resource_version.clone().filter(|v| !v.is_empty());
            r.items
                .iter()
                .map(|i| i.object.as_ref().map(struct_to_json).unwrap_or_default())
                .collect()
        }
    };
    let show_ns = a.all_namespaces && namespaced;
    match a.output.as_deref() {
        Some("json") | Some("yaml") => {
            let doc = if a.name.is_some() {
                objects.into_iter().next().unwrap_or_default()
            } else {
                serde_json::json!({ "apiVersion": "v1", "kind": "List", "items": objects })
            };
            if a.output.as_deref() == Some("json") {
                println!("{}", output::json(&doc)?);
            } else {
                print!("{}", output::printable_lines(&output::yaml(&doc)));
            }
        }
        other => {
            let wide = other == Some("wide");
            if objects.is_empty() && !a.watch {
                if namespace.is_empty() {
                    eprintln!("No resources found");
                } else {
                    eprintln!("No resources found in {namespace} namespace.");
                }
            } else if !objects.is_empty() {
                let mut headers = Vec::new();
                let rows: Vec<Vec<String>> = objects
                    .iter()
                    .map(|o| {
                        let (h, r) = output::row(&kind, o, show_ns, wide);
                        headers = h;
                        r
                    })
                    .collect();
                print!("{}", output::table(&headers, &rows));
            }
        }
    }
    if a.watch {
        let _ = std::io::stdout().flush();
        // From the list's version there are no initial ADDED events to skip.
        let mut seen_initial = listed_at.is_some();
        let request = WatchRequest {
            cluster: Some(a.cluster.clone()),
            group: rt.group.clone(),
            version: rt.version.clone(),
            resource: rt.resource.clone(),
            namespace: Some(namespace),
            label_selector: a.selector.clone(),
            field_selector: a.name.as_ref().map(|n| format!("metadata.name={n}")),
            resource_version: listed_at,
        };
        // A lost tunnel or a restarted hub ends the call; it is opened
        // again from the last version printed, so nothing is missed or
        // printed twice.
        let mut watch =
            ResumingWatch::new(client, request, |m| hub.req(m), resume::Resume::default());
        while let Some(next) = watch.next().await {
            let ev = match next.map_err(status_error)? {
                Watched::Event(ev) => ev,
                Watched::Resuming {
                    after,
                    from,
                    attempt,
                } => {
                    eprintln!(
                        "watch interrupted ({}); resuming from resourceVersion {} (attempt {attempt})",
                        output::printable(after.message()),
                        output::printable(from.as_deref().unwrap_or("(none)"))
                    );
                    // Resumed from a version: no initial events come again.
                    seen_initial |= from.is_some();
                    continue;
                }
            };
            let ty = ev.r#type.unwrap_or(0);
            if ty == watch_event::Type::Bookmark as i32 {
                seen_initial = true;
                continue;
            }
            if ty == watch_event::Type::Error as i32 {
                let status = ev
                    .resource
                    .and_then(|r| r.object)
                    .map(|o| struct_to_json(&o))
                    .unwrap_or_default();
                anyhow::bail!(
                    "watch ended: {}",
                    output::printable(&status["message"].to_string())
                );
            }
            let o = ev
                .resource
                .as_ref()
                .and_then(|r| r.object.as_ref())
                .map(struct_to_json)
                .unwrap_or_default();
            // The initial ADDED events repeat what was just printed.
            if !seen_initial && ty == watch_event::Type::Added as i32 {
                continue;
            }
            let (_, mut r) = output::row(&kind, &o, show_ns, false);
            if ty == watch_event::Type::Deleted as i32 {
                r.push("(deleted)".into());
            }
            println!("{}", output::printable(&r.join("   ")));
            let _ = std::io::stdout().flush();
        }
    }
    Ok(())
}

/// `otter apply -f FILE` (server-side, one call per document).
pub async fn apply(
    hub: &Hub,
    cluster: &str,
    file: &str,
    namespace: Option<String>,
    force: bool,
) -> anyhow::Result<()> {
    let text = if file == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)?;
        s
    } else {
        std::fs::read_to_string(file).map_err(|e| anyhow::anyhow!("{file}: {e}"))?
    };
    let docs: Vec<Json> = split_yaml(&text)?;
    let all = resources::discover(hub, cluster).await?;
    let mut client = ResourceServiceClient::new(hub.channel.clone());
    for doc in docs {
        let api_version = doc["apiVersion"].as_str().unwrap_or_default();
        let kind = doc["kind"].as_str().unwrap_or_default();
        let name = doc["metadata"]["name"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("a {kind} without metadata.name"))?;
        let rt = resources::by_kind(&all, api_version, kind)?;
        let ns = if rt.namespaced.unwrap_or(false) {
            doc["metadata"]["namespace"]
                .as_str()
                .map(str::to_owned)
                .or_else(|| namespace.clone())
                .unwrap_or_else(|| "default".into())
        } else {
            String::new()
        };
        client
            .apply(hub.req(ApplyRequest {
                cluster: Some(cluster.to_owned()),
                group: rt.group.clone(),
                version: rt.version.clone(),
                resource: rt.resource.clone(),
                namespace: Some(ns),
                name: Some(name.to_owned()),
                manifest: Some(serde_json::to_vec(&doc)?),
                force: Some(force),
                field_manager: Some("otter".into()),
            }))
            .await
            .map_err(status_error)?;
        let group = rt.group.clone().unwrap_or_default();
        let qualified = if group.is_empty() {
            kind.to_ascii_lowercase()
        } else {
            format!("{}.{group}", kind.to_ascii_lowercase())
        };
        // The group comes from the cluster's discovery, i.e. the agent.
        println!(
            "{} serverside-applied",
            output::printable(&format!("{qualified}/{name}"))
        );
    }
    Ok(())
}

/// Splits multi-document YAML (or JSON) into objects, skipping empty documents.
fn split_yaml(text: &str) -> anyhow::Result<Vec<Json>> {
    let mut docs = Vec::new();
    for (i, part) in text.split("\n---").enumerate() {
        let part = part.trim_start_matches("---");
        if part
            .lines()
            .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
        {
            continue;
        }
        let v: Json =
            serde_saphyr::from_str(part).map_err(|e| anyhow::anyhow!("document {}: {e}", i + 1))?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

/// `otter delete`.
pub async fn delete(
    hub: &Hub,
    cluster: &str,
    resource: &str,
    name: &str,
    namespace: Option<String>,
    grace: Option<i64>,
) -> anyhow::Result<()> {
    let all = resources::discover(hub, cluster).await?;
    let rt = resources::resolve(&all, resource)?;
    let ns = if rt.namespaced.unwrap_or(false) {
        namespace.unwrap_or_else(|| "default".into())
    } else {
        String::new()
    };
    ResourceServiceClient::new(hub.channel.clone())
        .delete(hub.req(DeleteRequest {
            cluster: Some(cluster.to_owned()),
            group: rt.group.clone(),
            version: rt.version.clone(),
            resource: rt.resource.clone(),
            namespace: Some(ns),
            name: Some(name.to_owned()),
            grace_period_seconds: grace,
        }))
        .await
        .map_err(status_error)?;
    println!(
        "{} \"{name}\" deleted",
        output::printable(rt.resource.as_deref().unwrap_or_default())
    );
    Ok(())
}

/// `otter describe`: what `kubectl describe` prints ([`super::describe`]),
/// with what kubectl looks up beside the object.
pub async fn describe(
    hub: &Hub,
    cluster: &str,
    resource: &str,
    name: &str,
    namespace: Option<String>,
) -> anyhow::Result<()> {
    let all = resources::discover(hub, cluster).await?;
    let rt = resources::resolve(&all, resource)?;
    let ns = if rt.namespaced.unwrap_or(false) {
        namespace.unwrap_or_else(|| "default".into())
    } else {
        String::new()
    };
    let resp = ResourceServiceClient::new(hub.channel.clone())
        .describe(hub.req(DescribeRequest {
            cluster: Some(cluster.to_owned()),
            group: rt.group.clone(),
            version: rt.version.clone(),
            resource: rt.resource.clone(),
            namespace: Some(ns.clone()),
            name: Some(name.to_owned()),
        }))
        .await
        .map_err(status_error)?
        .into_inner();
    let obj = resp
        .resource
        .and_then(|r| r.object)
        .map(|o| struct_to_json(&o))
        .unwrap_or_default();
    let events: Vec<Json> = resp
        .events
        .iter()
        .filter_map(|e| e.object.as_ref().map(struct_to_json))
        .collect();
    let kind = rt.kind.clone().unwrap_or_default();
    let related = describe_related(hub, cluster, &kind, &ns, name).await;
    let now = time::OffsetDateTime::now_utc();
    print!(
        "{}",
        super::describe::describe(&kind, &obj, Some(&events), &related, now)
    );
    Ok(())
}

/// What kubectl looks up beside an object of `kind` to describe it.
async fn describe_related(
    hub: &Hub,
    cluster: &str,
    kind: &str,
    namespace: &str,
    name: &str,
) -> super::describe::Related {
    let list =
        |group: &str, resource: &str, ns: &str, labels: Option<String>, fields: Option<String>| {
            let req = hub.req(ListRequest {
                cluster: Some(cluster.to_owned()),
                group: Some(group.to_owned()),
                version: Some("v1".to_owned()),
                resource: Some(resource.to_owned()),
                namespace: Some(ns.to_owned()),
                label_selector: labels,
                field_selector: fields,
                ..Default::default()
            });
            let mut client = ResourceServiceClient::new(hub.channel.clone());
            async move {
                client.list(req).await.map(|r| {
                    r.into_inner()
                        .items
                        .iter()
                        .filter_map(|i| i.object.as_ref().map(struct_to_json))
                        .collect::<Vec<Json>>()
                })
            }
        };
    let mut related = super::describe::Related::default();
    match kind {
        "Deployment" => {
            related.replica_sets = list("apps", "replicasets", namespace, None, None)
                .await
                .ok();
        }
        "Service" => {
            let selector = format!("kubernetes.io/service-name={name}");
            related.endpoint_slices = list(
                "discovery.k8s.io",
                "endpointslices",
                namespace,
                Some(selector),
                None,
            )
            .await
            .ok();
        }
        "Node" => {
            let fields =
                format!("spec.nodeName={name},status.phase!=Failed,status.phase!=Succeeded");
            related.node_pods = match list("", "pods", "", None, Some(fields)).await {
                Ok(pods) => Some(Ok(pods)),
                Err(s) if s.code() == tonic::Code::PermissionDenied => Some(Err(())),
                Err(_) => None,
            };
            let lease = ResourceServiceClient::new(hub.channel.clone())
                .get(hub.req(GetRequest {
                    cluster: Some(cluster.to_owned()),
                    group: Some("coordination.k8s.io".to_owned()),
                    version: Some("v1".to_owned()),
                    resource: Some("leases".to_owned()),
                    namespace: Some("kube-node-lease".to_owned()),
                    name: Some(name.to_owned()),
                }))
                .await;
            related.lease = Some(match lease {
                Ok(r) => Ok(r
                    .into_inner()
                    .object
                    .as_ref()
                    .map(struct_to_json)
                    .unwrap_or_default()),
                Err(s) => Err(s.message().to_owned()),
            });
        }
        _ => {}
    }
    related
}

/// `otter logs`.
pub async fn logs(
    hub: &Hub,
    scope: &super::Scope,
    pod: &str,
    follow: bool,
    tail: Option<i64>,
    since: Option<Duration>,
    container: Option<String>,
) -> anyhow::Result<()> {
    let mut stream = RuntimeServiceClient::new(hub.channel.clone())
        .pod_log(hub.req(PodLogRequest {
            cluster: Some(scope.cluster()?),
            namespace: Some(scope.namespace.clone().unwrap_or_else(|| "default".into())),
            name: Some(pod.to_owned()),
            container,
            follow: Some(follow),
            tail_lines: tail,
            since_seconds: since.map(|d| d.as_secs().max(1) as i64),
            ..Default::default()
        }))
        .await
        .map_err(status_error)?
        .into_inner();
    let mut out = std::io::stdout();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(status_error)?;
        out.write_all(&chunk.data.unwrap_or_default())?;
        out.flush()?;
    }
    Ok(())
}

/// `otter scale`.
pub async fn scale(
    hub: &Hub,
    cluster: &str,
    resource: &str,
    name: &str,
    namespace: Option<String>,
    replicas: i32,
) -> anyhow::Result<()> {
    let all = resources::discover(hub, cluster).await?;
    let rt = resources::resolve(&all, resource)?;
    let resp = RuntimeServiceClient::new(hub.channel.clone())
        .scale(hub.req(ScaleRequest {
            cluster: Some(cluster.to_owned()),
            group: rt.group.clone(),
            version: rt.version.clone(),
            resource: rt.resource.clone(),
            namespace: Some(namespace.unwrap_or_else(|| "default".into())),
            name: Some(name.to_owned()),
            replicas: Some(replicas),
        }))
        .await
        .map_err(status_error)?
        .into_inner();
    println!(
        "{}/{name} scaled to {}",
        output::printable(rt.resource.as_deref().unwrap_or_default()),
        resp.replicas.unwrap_or(replicas)
    );
    Ok(())
}

/// `otter restart`.
pub async fn restart(
    hub: &Hub,
    cluster: &str,
    resource: &str,
    name: &str,
    namespace: Option<String>,
) -> anyhow::Result<()> {
    let all = resources::discover(hub, cluster).await?;
    let rt = resources::resolve(&all, resource)?;
    RuntimeServiceClient::new(hub.channel.clone())
        .restart(hub.req(RestartRequest {
            cluster: Some(cluster.to_owned()),
            group: rt.group.clone(),
            version: rt.version.clone(),
            resource: rt.resource.clone(),
            namespace: Some(namespace.unwrap_or_else(|| "default".into())),
            name: Some(name.to_owned()),
        }))
        .await
        .map_err(status_error)?;
    println!(
        "{}/{name} restarted",
        output::printable(rt.resource.as_deref().unwrap_or_default())
    );
    Ok(())
}

/// Restores the terminal on every way out of `otter exec -t`.
struct RawMode;

impl RawMode {
    fn enter() -> anyhow::Result<Self> {
        crossterm::terminal::enable_raw_mode()?;
        Ok(Self)
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = crossterm::terminal::disable_raw_mode();
    }
}

/// `otter exec`: returns the remote command's exit code.
pub async fn exec(
    hub: &Hub,
    scope: &super::Scope,
    pod: &str,
    container: Option<String>,
    stdin: bool,
    tty: bool,
    command: Vec<String>,
) -> anyhow::Result<i32> {
    use std::io::IsTerminal;
    let (cols, rows) = if tty {
        crossterm::terminal::size().unwrap_or((80, 24))
    } else {
        (0, 0)
    };
    let mut runtime = RuntimeServiceClient::new(hub.channel.clone());
    let mut stream = runtime
        .execute_tty(hub.req(ExecuteTtyRequest {
            cluster: Some(scope.cluster()?),
            namespace: Some(scope.namespace.clone().unwrap_or_else(|| "default".into())),
            name: Some(pod.to_owned()),
            container,
            command,
            tty: Some(tty),
            rows: tty.then_some(u32::from(rows)),
            cols: tty.then_some(u32::from(cols)),
        }))
        .await
        .map_err(status_error)?
        .into_inner();
    let first = stream
        .next()
        .await
        .ok_or_else(|| anyhow::anyhow!("exec ended before it started"))?
        .map_err(status_error)?;
    let session = first
        .session_id
        .clone()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| anyhow::anyhow!("the hub sent no session id"))?;
    let _raw = if tty && std::io::stdin().is_terminal() {
        Some(RawMode::enter()?)
    } else {
        None
    };

    let input = stdin.then(|| {
        let (hub, session, mut runtime) = (hub.clone(), session.clone(), runtime.clone());
        tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut stdin = tokio::io::stdin();
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = match stdin.read(&mut buf).await {
                    Ok(0) | Err(_) => 0,
                    Ok(n) => n,
                };
                // An empty write tells the agent stdin is closed.
                let data = buf[..n].to_vec();
                let r = runtime
                    .write_tty(hub.req(WriteTtyRequest {
                        session_id: Some(session.clone()),
                        stdin: Some(data),
                    }))
                    .await;
                if n == 0 || r.is_err() {
                    return;
                }
            }
        })
    });
    let resize = tty.then(|| {
        let (hub, session, mut runtime) = (hub.clone(), session.clone(), runtime.clone());
        tokio::spawn(async move {
            let Ok(mut winch) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
            else {
                return;
            };
            while winch.recv().await.is_some() {
                if let Ok((cols, rows)) = crossterm::terminal::size() {
                    let _ = runtime
                        .resize_tty(hub.req(ResizeTtyRequest {
                            session_id: Some(session.clone()),
                            rows: Some(u32::from(rows)),
                            cols: Some(u32::from(cols)),
                        }))
                        .await;
                }
            }
        })
    });
    let mut code = 0;
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
    while let Some(msg) = stream.next().await {
        match msg {
            Ok(m) => {
                if let Some(d) = m.stdout.filter(|d| !d.is_empty()) {
                    out.write_all(&d)?;
                    out.flush()?;
                }
                if let Some(d) = m.stderr.filter(|d| !d.is_empty()) {
                    err.write_all(&d)?;
                    err.flush()?;
                }
            }
            Err(status) => {
                code = exit_code_of(&status).ok_or_else(|| status_error(status))?;
                break;
            }
        }
    }
    for task in [input, resize].into_iter().flatten() {
        task.abort();
    }
    Ok(code)
}

/// The remote exit code carried by an exec error ("… exit code N").
fn exit_code_of(status: &tonic::Status) -> Option<i32> {
    let msg = status.message();
    let i = msg.find("exit code")?;
    msg[i + "exit code".len()..]
        .trim_start_matches([' ', ':'])
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// `LOCAL:REMOTE` or `PORT` (both the same), as kubectl takes them; a
/// local port of 0 lets the system pick one.
pub fn forwarded_ports(spec: &str) -> anyhow::Result<(u16, u16)> {
    let port = |what: &str, text: &str, zero_ok: bool| -> anyhow::Result<u16> {
        match text.parse::<u16>() {
            Ok(0) if !zero_ok => anyhow::bail!("{spec:?}: the {what}port cannot be 0"),
            Ok(p) => Ok(p),
            Err(_) => anyhow::bail!(
                "{spec:?}: the {what}port {text:?} is not a port number (1-65535); \
                 expected LOCAL:REMOTE, like 8080:80, or one PORT for both"
            ),
        }
    };
    match spec.split_once(':') {
        Some((l, r)) => Ok((port("local ", l, true)?, port("remote ", r, false)?)),
        None => {
            let p = port("", spec, false)?;
            Ok((p, p))
        }
    }
}

/// `otter port-forward POD LOCAL:REMOTE`.
pub async fn port_forward(
    hub: &Hub,
    cluster: &str,
    pod: &str,
    namespace: Option<String>,
    local: u16,
    remote: u16,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", local))
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => anyhow::anyhow!(
                "cannot listen on 127.0.0.1:{local}: the port is in use by another program; \
                 pick another local port (LOCAL:{remote}) or 0 for any free one"
            ),
            _ => anyhow::anyhow!("cannot listen on 127.0.0.1:{local}: {e}"),
        })?;
    let ns = namespace.unwrap_or_else(|| "default".into());
    println!("Forwarding from {} -> {remote}", listener.local_addr()?);
    loop {
        let (tcp, _) = listener.accept().await?;
        let (hub, cluster, pod, ns) = (hub.clone(), cluster.to_owned(), pod.to_owned(), ns.clone());
        tokio::spawn(async move {
            if let Err(e) = forward_one(&hub, &cluster, &pod, &ns, remote, tcp).await {
                eprintln!("port-forward: {}", output::printable(&e.to_string()));
            }
        });
    }
}

async fn forward_one(
    hub: &Hub,
    cluster: &str,
    pod: &str,
    ns: &str,
    port: u16,
    tcp: tokio::net::TcpStream,
) -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut runtime = RuntimeServiceClient::new(hub.channel.clone());
    let mut stream = runtime
        .port_forward(hub.req(PortForwardRequest {
            cluster: Some(cluster.to_owned()),
            namespace: Some(ns.to_owned()),
            name: Some(pod.to_owned()),
            port: Some(i32::from(port)),
        }))
        .await
        .map_err(status_error)?
        .into_inner();
    let first = stream
        .next()
        .await
        .ok_or_else(|| anyhow::anyhow!("port-forward ended before it started"))?
        .map_err(status_error)?;
    let session = first
        .session_id
        .filter(|s| !s.is_empty())
        .ok_or_else(|| anyhow::anyhow!("no session id"))?;
    let (mut rd, mut wr) = tcp.into_split();
    let up = {
        let hub = hub.clone();
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = rd.read(&mut buf).await?;
                if n == 0 {
                    return Ok::<_, anyhow::Error>(());
                }
                runtime
                    .write_port_forward(hub.req(WritePortForwardRequest {
                        session_id: Some(session.clone()),
                        data: Some(buf[..n].to_vec()),
                    }))
                    .await
                    .map_err(status_error)?;
            }
        }
    };
    let down = async move {
        while let Some(msg) = stream.next().await {
            let msg = msg.map_err(status_error)?;
            if let Some(d) = msg.data.filter(|d| !d.is_empty()) {
                wr.write_all(&d).await?;
            }
        }
        wr.shutdown().await?;
        Ok::<_, anyhow::Error>(())
    };
    // Either side ending ends the session (dropping the stream cancels it).
    tokio::select! {
        r = up => r,
        r = down => r,
    }
}

/// How `otter kubeconfig` writes its entries.
#[derive(Debug)]
pub struct KubeconfigOptions {
    pub all: bool,
    pub prefix: String,
    pub exec_plugin: bool,
}

/// `otter token get`: the login's token as a kubectl ExecCredential.
pub fn token_get(flags: &super::client::HubFlags) -> anyhow::Result<()> {
    let token = match &flags.token {
        Some(t) => t.clone(),
        None => super::client::load_file()?
            .token
            .ok_or_else(|| anyhow::anyhow!("no token: run `otter login` or set OTTER_TOKEN"))?,
    };
    let cred = serde_json::json!({
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": { "token": token },
    });
    println!("{cred}");
    Ok(())
}

/// `otter kubeconfig`: writes or merges one context per cluster, pointing
/// kubectl at the hub's Kubernetes API proxy with this login's token (or
/// with `otter token get` as a credential plugin).
pub async fn kubeconfig(
    hub: &Hub,
    mut clusters: Vec<String>,
    path: PathBuf,
    opts: &KubeconfigOptions,
) -> anyhow::Result<()> {
    use base64::Engine;
    let (all, prefix) = (opts.all, opts.prefix.as_str());
    if all {
        let resp = LinkServiceClient::new(hub.channel.clone())
            .list_links(hub.req(ListLinksRequest {}))
            .await
            .map_err(status_error)?;
        clusters.extend(
            resp.into_inner()
                .links
                .into_iter()
                .filter_map(|l| l.cluster),
        );
    }
    if clusters.is_empty() {
        anyhow::bail!("name a cluster with --cluster, or use --all");
    }
    let mut config: Json = match std::fs::read_to_string(&path) {
        Ok(text) if !text.trim().is_empty() => {
            serde_saphyr::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
        }
        _ => serde_json::json!({ "apiVersion": "v1", "kind": "Config", "preferences": {} }),
    };
    let host = hub.url.host_str().unwrap_or("hub").to_owned();
    let user = format!("otter@{host}");
    let base = hub.url.as_str().trim_end_matches('/').to_owned();
    let upsert = |config: &mut Json, list: &str, name: &str, entry: Json| {
        let items = config[list]
            .as_array_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        let mut items: Vec<Json> = items.into_iter().filter(|i| i["name"] != name).collect();
        items.push(entry);
        config[list] = Json::Array(items);
    };
    let credentials = if opts.exec_plugin {
        let otter = std::env::current_exe()?.display().to_string();
        let config_path = super::client::config_path().display().to_string();
        serde_json::json!({ "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": otter,
            "args": ["token", "get"],
            "env": [{ "name": "OTTER_CONFIG", "value": config_path }],
            "interactiveMode": "Never",
        }})
    } else {
        serde_json::json!({ "token": hub.token })
    };
    upsert(
        &mut config,
        "users",
        &user,
        serde_json::json!({ "name": user, "user": credentials }),
    );
    for cluster in &clusters {
        let name = format!("otter-{cluster}");
        let mut c = serde_json::json!({ "server": format!("{base}{prefix}/{cluster}") });
        if let Some(ca) = &hub.ca_pem {
            c["certificate-authority-data"] =
                Json::from(base64::engine::general_purpose::STANDARD.encode(ca));
        }
        upsert(
            &mut config,
            "clusters",
            &name,
            serde_json::json!({ "name": name, "cluster": c }),
        );
        upsert(
            &mut config,
            "contexts",
            &name,
            serde_json::json!({ "name": name, "context": { "cluster": name, "user": user } }),
        );
    }
    if clusters.len() == 1 || config["current-context"].as_str().is_none_or(str::is_empty) {
        config["current-context"] = Json::from(format!("otter-{}", clusters[0]));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    crate::tokens::write_private(&path, &output::yaml(&config))?;
    for cluster in &clusters {
        println!(
            "context otter-{} written to {}",
            output::printable(cluster),
            path.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod port_tests {
    use super::forwarded_ports;

    #[test]
    fn forwarded_ports_as_kubectl_takes_them() {
        assert_eq!(forwarded_ports("8080:80").unwrap(), (8080, 80));
        assert_eq!(forwarded_ports("5432").unwrap(), (5432, 5432));
        assert_eq!(forwarded_ports("0:80").unwrap(), (0, 80));
        for bad in ["80x", "8080:", ":80", "70000", "80:0", "0"] {
            let e = forwarded_ports(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
    }
}
