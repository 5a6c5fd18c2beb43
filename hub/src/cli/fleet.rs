//! `otter get … --clusters SELECTOR`: one table over every cluster a link
//! selector picks, from one FleetService call.

use futures::StreamExt;
use otter_proto::{
    fleet::v1::{
        ClusterError, FanOut, GetResourcesRequest, ListResourcesRequest,
        fleet_service_client::FleetServiceClient, get_resources_response, list_resources_response,
    },
    link::v1::{LinkState, ListLinksRequest, link_service_client::LinkServiceClient},
    resource::v1::ApiResource,
};
use serde_json::{Value as Json, json};

use super::{
    client::Hub,
    commands::GetArgs,
    output::{self, struct_to_json},
    resources, status_error,
};
use crate::fleet::Selector;

/// What one cluster answered.
struct Answer {
    cluster: String,
    outcome: Result<Vec<Json>, (String, String)>,
    elapsed_millis: u32,
}

impl Answer {
    /// A cluster's answer: its objects, its error, or (a message without
    /// a result) nothing.
    fn new(
        cluster: &str,
        elapsed_millis: u32,
        outcome: Option<Result<Vec<Json>, &ClusterError>>,
    ) -> Answer {
        Answer {
            cluster: cluster.to_owned(),
            outcome: match outcome {
                Some(Ok(items)) => Ok(items),
                Some(Err(e)) => Err((e.code().to_owned(), e.message().to_owned())),
                None => Err(("unknown".into(), "no answer".into())),
            },
            elapsed_millis,
        }
    }
}

fn object_json(r: &otter_proto::resource::v1::Resource) -> Json {
    r.object.as_ref().map(struct_to_json).unwrap_or_default()
}

/// Resolves the resource type with the Discovery of a connected cluster the
/// selector picks (the first that answers).
async fn resource_type(hub: &Hub, selector: &str, name: &str) -> anyhow::Result<ApiResource> {
    let parsed = Selector::parse(selector)?;
    let links = LinkServiceClient::new(hub.channel.clone())
        .list_links(hub.req(ListLinksRequest {}))
        .await
        .map_err(status_error)?
        .into_inner()
        .links;
    let connected = links.into_iter().filter(|l| {
        l.state == Some(LinkState::Connected as i32)
            && parsed.matches(&l.labels.clone().into_iter().collect())
    });
    let mut last_error = None;
    for link in connected.take(3) {
        match resources::discover(hub, link.cluster()).await {
            Ok(all) => return Ok(resources::resolve(&all, name)?.clone()),
            Err(e) => last_error = Some(e),
        }
    }
    Err(last_error
        .unwrap_or_else(|| anyhow::anyhow!("no connected cluster matches --clusters {selector:?}")))
}

/// `otter get RESOURCE [NAME] --clusters SELECTOR`.
pub async fn get(hub: &Hub, a: GetArgs, selector: &str) -> anyhow::Result<()> {
    let rt = resource_type(hub, selector, &a.resource).await?;
    let namespaced = rt.namespaced.unwrap_or(false);
    let namespace = if !namespaced || a.all_namespaces {
        String::new()
    } else {
        a.namespace.clone().unwrap_or_else(|| "default".into())
    };
    let fan_out = Some(FanOut {
        link_selector: Some(selector.to_owned()),
        timeout_millis: None,
    });
    let mut client = FleetServiceClient::new(hub.channel.clone());
    let mut answers = Vec::new();
    match &a.name {
        Some(name) => {
            let mut stream = client
                .get_resources(hub.req(GetResourcesRequest {
                    fan_out,
                    group: rt.group.clone(),
                    version: rt.version.clone(),
                    resource: rt.resource.clone(),
                    namespace: Some(namespace.clone()),
                    name: Some(name.clone()),
                }))
                .await
                .map_err(status_error)?
                .into_inner();
            while let Some(m) = stream.next().await {
                let m = m.map_err(status_error)?;
                use get_resources_response::Result as R;
                let outcome = m.result.as_ref().map(|r| match r {
                    R::Resource(r) => Ok(vec![object_json(r)]),
                    R::Error(e) => Err(e),
                });
                answers.push(Answer::new(m.cluster(), m.elapsed_millis(), outcome));
            }
        }
        None => {
            let mut stream = client
                .list_resources(hub.req(ListResourcesRequest {
                    fan_out,
                    group: rt.group.clone(),
                    version: rt.version.clone(),
                    resource: rt.resource.clone(),
                    namespace: Some(namespace.clone()),
                    label_selector: a.selector.clone(),
                    ..Default::default()
                }))
                .await
                .map_err(status_error)?
                .into_inner();
            while let Some(m) = stream.next().await {
                let m = m.map_err(status_error)?;
                use list_resources_response::Result as R;
                let outcome = m.result.as_ref().map(|r| match r {
                    R::List(l) => Ok(l.items.iter().map(object_json).collect()),
                    R::Error(e) => Err(e),
                });
                answers.push(Answer::new(m.cluster(), m.elapsed_millis(), outcome));
            }
        }
    }
    // Answers come as clusters give them; the table is in cluster order.
    answers.sort_by(|x, y| x.cluster.cmp(&y.cluster));
    let failed = answers.iter().filter(|a| a.outcome.is_err()).count();
    match a.output.as_deref() {
        Some("json") => {
            let clusters: Vec<Json> = answers
                .iter()
                .map(|ans| match &ans.outcome {
                    Ok(items) => json!({
                        "cluster": ans.cluster, "items": items,
                        "elapsedMillis": ans.elapsed_millis,
                    }),
                    Err((code, message)) => json!({
                        "cluster": ans.cluster,
                        "error": { "code": code, "message": message },
                        "elapsedMillis": ans.elapsed_millis,
                    }),
                })
                .collect();
            println!("{}", output::json(&json!({ "clusters": clusters }))?);
        }
        Some("yaml") => anyhow::bail!("-o yaml: with --clusters, use -o json or a table"),
        other => {
            let wide = other == Some("wide");
            let kind = rt.kind.clone().unwrap_or_default();
            let show_ns = a.all_namespaces && namespaced;
            let mut headers = vec!["CLUSTER"];
            let mut rows = Vec::new();
            for ans in &answers {
                for o in ans.outcome.as_deref().unwrap_or_default() {
                    let (h, mut r) = output::row(&kind, o, show_ns, wide);
                    headers.truncate(1);
                    headers.extend(h);
                    r.insert(0, ans.cluster.clone());
                    rows.push(r);
                }
            }
            if rows.is_empty() && failed == 0 {
                eprintln!("No resources found in {} clusters", answers.len());
            } else if !rows.is_empty() {
                print!("{}", output::table(&headers, &rows));
            }
        }
    }
    for ans in &answers {
        if let Err((code, message)) = &ans.outcome {
            eprintln!(
                "error: cluster {}: {code}: {}",
                output::printable(&ans.cluster),
                output::printable(message)
            );
        }
    }
    if failed > 0 {
        anyhow::bail!("{failed} of {} clusters gave no answer", answers.len());
    }
    Ok(())
}

/// A Unix time as RFC 3339 with how long ago (or ahead) it is.
fn when(t: Option<&prost_types::Timestamp>, now: i64) -> String {
    let Some(t) = t else {
        return "-".to_owned();
    };
    let text = time::OffsetDateTime::from_unix_timestamp(t.seconds)
        .ok()
        .and_then(|d| {
            d.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| t.seconds.to_string());
    let (gap, word) = match now - t.seconds {
        d if d >= 0 => (d, "ago"),
        d => (-d, "from now"),
    };
    format!("{text} ({} {word})", crate::short_duration(gap))
}

/// `otter links describe CLUSTER`: the link, its diagnosis and what the
/// agent's connectivity doctor found while it could not connect.
pub async fn describe_link(hub: &Hub, cluster: &str) -> anyhow::Result<()> {
    use otter_proto::fleet::v1::DescribeLinkRequest;
    let resp = FleetServiceClient::new(hub.channel.clone())
        .describe_link(hub.req(DescribeLinkRequest {
            cluster: Some(cluster.to_owned()),
        }))
        .await
        .map_err(status_error)?
        .into_inner();
    let l = resp.link.unwrap_or_default();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let state = match l.state.and_then(|s| LinkState::try_from(s).ok()) {
        Some(LinkState::Connected) => "Connected",
        Some(LinkState::Unresponsive) => "Unresponsive",
        _ => "Offline",
    };
    let or_dash = |s: Option<&str>| match s {
        Some(s) if !s.is_empty() => output::printable(s).into_owned(),
        _ => "-".to_owned(),
    };
    let mut out = String::new();
    let mut line = |k: &str, v: String| out.push_str(&format!("{:<17}{v}\n", format!("{k}:")));
    line("Name", or_dash(l.cluster.as_deref()));
    line("Tenant", or_dash(l.tenant.as_deref()));
    line("State", state.to_owned());
    line("Transport", or_dash(l.transport.as_deref()));
    line("Agent", or_dash(l.agent_id.as_deref()));
    line("Agent Version", or_dash(l.agent_version.as_deref()));
    line("Remote", or_dash(l.remote_address.as_deref()));
    let labels: std::collections::BTreeMap<_, _> = l.labels.iter().collect();
    let labels: Vec<String> = labels
        .iter()
        .map(|(k, v)| output::printable(&format!("{k}={v}")).into_owned())
        .collect();
    line(
        "Labels",
        match labels.is_empty() {
            true => "<none>".to_owned(),
            false => labels.join(&format!("\n{:17}", "")),
        },
    );
    line("First Seen", when(l.first_seen.as_ref(), now));
    line("Last Seen", when(l.last_seen.as_ref(), now));
    line("Cert Serial", or_dash(l.certificate_serial.as_deref()));
    line("Cert Expires", when(l.certificate_expires.as_ref(), now));
    if let Some(d) = &l.diagnosis {
        out.push_str("Diagnosis:\n");
        let mut sub = |k: &str, v: String| {
            out.push_str(&format!("  {:<17}{v}\n", format!("{k}:")));
        };
        sub(
            "Proxy",
            match d.proxy.as_deref() {
                Some(p) if !p.is_empty() => output::printable(p).into_owned(),
                _ => "direct".to_owned(),
            },
        );
        sub(
            "RTT",
            d.rtt_micros
                .map_or("-".into(), |us| format!("{:.1}ms", us as f64 / 1000.0)),
        );
        sub(
            "Clock Skew",
            d.clock_skew_millis
                .map_or("-".into(), |ms| format!("{ms}ms")),
        );
        let attempts: Vec<String> = d
            .attempts
            .iter()
            .map(|a| match a.ok {
                Some(true) => format!("{} ok", a.transport()),
                _ => format!("{} failed: {}", a.transport(), output::printable(a.error())),
            })
            .collect();
        sub(
            "Transports",
            match attempts.is_empty() {
                true => "-".to_owned(),
                false => attempts.join(&format!("\n{:19}", "")),
            },
        );
        sub("Last Tunnel End", or_dash(d.last_tunnel_end.as_deref()));
        sub(
            "Renewal",
            match &d.last_renewal_error {
                Some(e) => format!(
                    "failing ({} failed): {}",
                    d.renewal_failures.unwrap_or(0),
                    output::printable(e)
                ),
                None => "ok".to_owned(),
            },
        );
    }
    if resp.doctor_checks.is_empty() {
        out.push_str("Doctor:          <none> (the agent's dials have not kept failing)\n");
    } else {
        out.push_str(&format!(
            "Doctor:          ran {}\n",
            when(resp.doctor_ran_at.as_ref(), now)
        ));
        let width = resp
            .doctor_checks
            .iter()
            .map(|c| c.name().len())
            .max()
            .unwrap_or(0);
        for c in &resp.doctor_checks {
            let verdict = match c.verdict() {
                "fail" => "FAIL",
                v => v,
            };
            out.push_str(&format!(
                "  {:<4}  {:<width$}  {}\n",
                output::printable(verdict),
                output::printable(c.name()),
                output::printable(c.detail())
            ));
        }
    }
    print!("{out}");
    Ok(())
}
