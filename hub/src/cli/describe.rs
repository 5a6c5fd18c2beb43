//! `otter describe`: the text `kubectl describe` prints, for pods,
//! deployments, services, nodes and events (and kubectl's generic layout
//! for every other kind), so a Kubernetes admin reads what they are used
//! to. Lines are labelled cells ended by tabs, aligned the way kubectl's
//! tab writer aligns them ([`Lines::render`]).
//!
//! What kubectl looks up beside the object (a deployment's ReplicaSets, a
//! service's EndpointSlices, a node's pods and lease) is fetched by the
//! caller and handed in as [`Related`].

use std::collections::BTreeMap;

use serde_json::Value as Json;
use time::OffsetDateTime;

use super::output::printable_lines;

/// What kubectl fetches beside the object for some kinds; `None` where the
/// lookup failed or does not apply.
#[derive(Debug, Default)]
pub struct Related {
    /// A deployment's ReplicaSets in its namespace.
    pub replica_sets: Option<Vec<Json>>,
    /// A service's EndpointSlices.
    pub endpoint_slices: Option<Vec<Json>>,
    /// A node's pods that have not terminated; `Err` when listing them was
    /// forbidden.
    pub node_pods: Option<Result<Vec<Json>, ()>>,
    /// A node's lease in `kube-node-lease`, or why it could not be read.
    pub lease: Option<Result<Json, String>>,
}

/// The description of `obj` (a `kind` object) with its `events` (`None`:
/// none were looked up, so no Events section), as of `now`.
pub fn describe(
    kind: &str,
    obj: &Json,
    events: Option<&[Json]>,
    related: &Related,
    now: OffsetDateTime,
) -> String {
    let mut w = Lines::default();
    let at = Clock(now);
    match kind {
        "Pod" => pod(&mut w, obj, at),
        "Deployment" => deployment(&mut w, obj, related, at),
        "Service" => service(&mut w, obj, related),
        "Node" => node(&mut w, obj, related, at),
        _ => generic(&mut w, obj),
    }
    if let Some(events) = events {
        event_table(&mut w, events, at);
    }
    w.render()
}

// ------------------------------------------------------------- the writer

/// Lines of tab-ended cells, as kubectl's prefix writer produces them.
#[derive(Default)]
struct Lines {
    lines: Vec<String>,
}

impl Lines {
    /// Writes `text` at `level` (two spaces each); the prefix goes before
    /// its first line only, as kubectl's does.
    fn w(&mut self, level: usize, text: impl AsRef<str>) {
        let text = format!("{}{}", "  ".repeat(level), text.as_ref());
        for line in text.split('\n') {
            self.lines.push(printable_lines(line).into_owned());
        }
    }

    /// The text, aligned as Go's tabwriter does with kubectl's settings
    /// (no minimum width, padding 2, spaces): a column's cells, over a run
    /// of consecutive lines that all have a cell in that column, take the
    /// widest one's width plus the padding; the text after a line's last
    /// tab is not aligned.
    fn render(self) -> String {
        let cells: Vec<Vec<&str>> = self.lines.iter().map(|l| l.split('\t').collect()).collect();
        let mut out = String::new();
        let mut widths = Vec::new();
        format_block(&cells, 0, cells.len(), &mut widths, &mut out);
        out
    }
}

fn width(s: &str) -> usize {
    s.chars().count()
}

/// Go's tabwriter `format`: lines `from..to` at the depth of `widths`.
fn format_block(
    cells: &[Vec<&str>],
    from: usize,
    to: usize,
    widths: &mut Vec<usize>,
    out: &mut String,
) {
    let column = widths.len();
    let mut start = from;
    let mut this = from;
    while this < to {
        if column + 1 >= cells[this].len() {
            this += 1;
            continue;
        }
        write_lines(cells, start, this, widths, out);
        start = this;
        let mut w = 0;
        while this < to && column + 1 < cells[this].len() {
            w = w.max(width(cells[this][column]) + 2);
            this += 1;
        }
        widths.push(w);
        format_block(cells, start, this, widths, out);
        widths.pop();
        start = this;
    }
    write_lines(cells, start, to, widths, out);
}

fn write_lines(cells: &[Vec<&str>], from: usize, to: usize, widths: &[usize], out: &mut String) {
    for line in &cells[from..to] {
        for (j, cell) in line.iter().enumerate() {
            out.push_str(cell);
            if j < widths.len() && j + 1 < line.len() {
                out.push_str(&" ".repeat(widths[j].saturating_sub(width(cell))));
            }
        }
        out.push('\n');
    }
}

// ---------------------------------------------------------------- helpers

fn at<'a>(v: &'a Json, path: &str) -> &'a Json {
    path.split('.')
        .filter(|p| !p.is_empty())
        .fold(v, |v, p| v.get(p).unwrap_or(&Json::Null))
}

fn text<'a>(v: &'a Json, path: &str) -> &'a str {
    at(v, path).as_str().unwrap_or("")
}

/// A scalar as Go's `%v` prints it.
fn scalar(v: &Json) -> String {
    match v {
        Json::String(s) => s.clone(),
        Json::Null => "<nil>".into(),
        Json::Bool(b) => b.to_string(),
        Json::Number(n) => n.to_string(),
        other => other.to_string(),
    }
}

fn items<'a>(v: &'a Json, path: &str) -> &'a [Json] {
    at(v, path).as_array().map_or(&[], Vec::as_slice)
}

fn int(v: &Json, path: &str) -> i64 {
    at(v, path).as_i64().unwrap_or(0)
}

fn go_bool(v: bool) -> &'static str {
    if v { "True" } else { "False" }
}

/// The time the description is made, for ages.
#[derive(Clone, Copy)]
struct Clock(OffsetDateTime);

impl Clock {
    /// kubectl's `HumanDuration` of the time since `ts` (RFC 3339);
    /// `<unknown>` without one.
    fn since(self, ts: &str) -> String {
        match parse_time(ts) {
            Some(t) => human_duration((self.0 - t).whole_seconds()),
            None => "<unknown>".into(),
        }
    }
}

fn parse_time(ts: &str) -> Option<OffsetDateTime> {
    OffsetDateTime::parse(ts, &time::format_description::well_known::Rfc3339).ok()
}

/// An RFC 3339 time as kubectl prints it (Go's RFC1123Z, in UTC).
fn rfc1123z(ts: &str) -> String {
    const LAYOUT: &[time::format_description::FormatItem<'static>] = time::macros::format_description!(
        "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] [offset_hour sign:mandatory][offset_minute]"
    );
    parse_time(ts)
        .and_then(|t| t.to_offset(time::UtcOffset::UTC).format(LAYOUT).ok())
        .unwrap_or_else(|| ts.to_owned())
}

/// kubectl's `HumanDuration` (apimachinery's `duration.HumanDuration`).
fn human_duration(secs: i64) -> String {
    if secs < -1 {
        return "<invalid>".into();
    }
    let s = secs.max(0);
    let (m, h, d) = (s / 60, s / 3600, s / 86_400);
    let y = d / 365;
    match s {
        _ if s < 120 => format!("{s}s"),
        _ if m < 10 => match s % 60 {
            0 => format!("{m}m"),
            r => format!("{m}m{r}s"),
        },
        _ if h < 3 => format!("{m}m"),
        _ if h < 8 => match m % 60 {
            0 => format!("{h}h"),
            r => format!("{h}h{r}m"),
        },
        _ if h < 48 => format!("{h}h"),
        _ if h < 192 => match h % 24 {
            0 => format!("{d}d"),
            r => format!("{d}d{r}h"),
        },
        _ if y < 2 => format!("{d}d"),
        _ if y < 8 => match d % 365 {
            0 => format!("{y}y"),
            r => format!("{y}y{r}d"),
        },
        _ => format!("{y}y"),
    }
}

fn sorted_map(v: &Json) -> BTreeMap<&str, String> {
    v.as_object()
        .map(|m| m.iter().map(|(k, v)| (k.as_str(), scalar(v))).collect())
        .unwrap_or_default()
}

/// `Labels:` and the like: the first `k=v` on the title's line, the rest
/// under it, sorted; `<none>` when empty.
fn labels(w: &mut Lines, title: &str, map: &Json) {
    let m = sorted_map(map);
    if m.is_empty() {
        return w.w(0, format!("{title}:\t<none>"));
    }
    for (i, (k, v)) in m.iter().enumerate() {
        match i {
            0 => w.w(0, format!("{title}:\t{k}={v}")),
            _ => w.w(0, format!("\t{k}={v}")),
        }
    }
}

/// `Annotations:`: like [`labels`] as `k: v`, without kubectl's own
/// last-applied copy; long or multi-line values under their key.
fn annotations(w: &mut Lines, title: &str, map: &Json) {
    let m: BTreeMap<&str, String> = sorted_map(map)
        .into_iter()
        .filter(|(k, _)| *k != "kubectl.kubernetes.io/last-applied-configuration")
        .collect();
    if m.is_empty() {
        return w.w(0, format!("{title}:\t<none>"));
    }
    for (i, (k, v)) in m.iter().enumerate() {
        let lead = if i == 0 {
            format!("{title}:\t")
        } else {
            "\t".into()
        };
        let v = v.trim_end_matches('\n');
        if v.len() + k.len() + 2 > 140 || v.contains('\n') {
            w.w(0, format!("{lead}{k}:"));
            for line in v.split('\n') {
                let short = match line.char_indices().nth(138) {
                    Some((cut, _)) => format!("{}...", &line[..cut]),
                    None => line.to_owned(),
                };
                w.w(0, format!("\t  {short}"));
            }
        } else {
            w.w(0, format!("{lead}{k}: {v}"));
        }
    }
}

/// `label:\tvalue` when the value is not empty (kubectl leaves such
/// lines out).
fn optional(w: &mut Lines, level: usize, label: &str, value: &str) {
    if !value.is_empty() {
        w.w(level, format!("{label}:\t{value}"));
    }
}

/// `Name:`, `Namespace:`, labels and annotations, as most describers begin.
fn object_head(w: &mut Lines, obj: &Json, namespaced: bool) {
    w.w(0, format!("Name:\t{}", text(obj, "metadata.name")));
    if namespaced {
        w.w(
            0,
            format!("Namespace:\t{}", text(obj, "metadata.namespace")),
        );
    }
}

fn tolerations(w: &mut Lines, title: &str, list: &[Json]) {
    if list.is_empty() {
        return w.w(0, format!("{title}:\t<none>"));
    }
    let mut sorted: Vec<&Json> = list.iter().collect();
    sorted.sort_by(|a, b| text(a, "key").cmp(text(b, "key")));
    for (i, t) in sorted.iter().enumerate() {
        let (key, value, effect) = (text(t, "key"), text(t, "value"), text(t, "effect"));
        let mut s = key.to_owned();
        if !value.is_empty() {
            s.push_str(&format!("={value}"));
        }
        if !effect.is_empty() {
            s.push_str(&format!(":{effect}"));
        }
        if text(t, "operator") == "Exists" && value.is_empty() {
            s.push_str(if key.is_empty() && effect.is_empty() {
                "op=Exists"
            } else {
                " op=Exists"
            });
        }
        if let Some(secs) = at(t, "tolerationSeconds").as_i64() {
            s.push_str(&format!(" for {secs}s"));
        }
        let lead = if i == 0 {
            format!("{title}:\t")
        } else {
            "\t".into()
        };
        w.w(0, format!("{lead}{s}"));
    }
}

// -------------------------------------------------------------------- pod

fn pod(w: &mut Lines, p: &Json, clock: Clock) {
    object_head(w, p, true);
    if let Some(prio) = at(p, "spec.priority").as_i64() {
        w.w(0, format!("Priority:\t{prio}"));
    }
    for (label, path) in [
        ("Priority Class Name", "spec.priorityClassName"),
        ("Runtime Class Name", "spec.runtimeClassName"),
        ("Service Account", "spec.serviceAccountName"),
    ] {
        if !text(p, path).is_empty() {
            w.w(0, format!("{label}:\t{}", text(p, path)));
        }
    }
    match text(p, "spec.nodeName") {
        "" => w.w(0, "Node:\t<none>"),
        node => w.w(0, format!("Node:\t{node}/{}", text(p, "status.hostIP"))),
    }
    if !text(p, "status.startTime").is_empty() {
        w.w(
            0,
            format!("Start Time:\t{}", rfc1123z(text(p, "status.startTime"))),
        );
    }
    labels(w, "Labels", at(p, "metadata.labels"));
    annotations(w, "Annotations", at(p, "metadata.annotations"));
    let phase = text(p, "status.phase");
    if !text(p, "metadata.deletionTimestamp").is_empty() && !matches!(phase, "Failed" | "Succeeded")
    {
        w.w(
            0,
            format!(
                "Status:\tTerminating (lasts {})",
                clock.since(text(p, "metadata.deletionTimestamp"))
            ),
        );
        w.w(
            0,
            format!(
                "Termination Grace Period:\t{}s",
                int(p, "metadata.deletionGracePeriodSeconds")
            ),
        );
    } else {
        w.w(0, format!("Status:\t{phase}"));
    }
    for (label, path) in [("Reason", "status.reason"), ("Message", "status.message")] {
        if !text(p, path).is_empty() {
            w.w(0, format!("{label}:\t{}", text(p, path)));
        }
    }
    let seccomp = at(p, "spec.securityContext.seccompProfile");
    if !seccomp.is_null() {
        w.w(0, format!("SeccompProfile:\t{}", text(seccomp, "type")));
        if text(seccomp, "type") == "Localhost" {
            w.w(
                0,
                format!("LocalhostProfile:\t{}", text(seccomp, "localhostProfile")),
            );
        }
    }
    w.w(0, format!("IP:\t{}", text(p, "status.podIP")));
    let ips = items(p, "status.podIPs");
    if ips.is_empty() {
        w.w(0, "IPs:\t<none>");
    } else {
        w.w(0, "IPs:");
        for ip in ips {
            w.w(1, format!("IP:\t{}", text(ip, "ip")));
        }
    }
    if let Some(owner) = items(p, "metadata.ownerReferences")
        .iter()
        .find(|o| at(o, "controller").as_bool() == Some(true))
    {
        w.w(
            0,
            format!(
                "Controlled By:\t{}/{}",
                text(owner, "kind"),
                text(owner, "name")
            ),
        );
    }
    optional(
        w,
        0,
        "NominatedNodeName",
        text(p, "status.nominatedNodeName"),
    );
    let pod_resources = at(p, "spec.resources");
    if !pod_resources.is_null() {
        w.w(0, "Resources:");
        resources(w, 1, pod_resources);
    }
    let statuses = |path: &str| items(p, path).to_vec();
    if !items(p, "spec.initContainers").is_empty() {
        containers(
            w,
            "Init Containers",
            items(p, "spec.initContainers"),
            Some(&statuses("status.initContainerStatuses")),
            Some(p),
            "",
        );
    }
    containers(
        w,
        "Containers",
        items(p, "spec.containers"),
        Some(&statuses("status.containerStatuses")),
        Some(p),
        "",
    );
    if !items(p, "spec.ephemeralContainers").is_empty() {
        containers(
            w,
            "Ephemeral Containers",
            items(p, "spec.ephemeralContainers"),
            Some(&statuses("status.ephemeralContainerStatuses")),
            Some(p),
            "",
        );
    }
    let conditions = items(p, "status.conditions");
    let gates = items(p, "spec.readinessGates");
    if !gates.is_empty() {
        w.w(0, "Readiness Gates:\n  Type\tStatus");
        for g in gates {
            let t = text(g, "conditionType");
            let status = conditions
                .iter()
                .find(|c| text(c, "type") == t)
                .map_or("<none>", |c| text(c, "status"));
            w.w(1, format!("{t} \t{status} "));
        }
    }
    if !conditions.is_empty() {
        w.w(0, "Conditions:\n  Type\tStatus");
        for c in conditions {
            w.w(1, format!("{} \t{} ", text(c, "type"), text(c, "status")));
        }
    }
    volumes(w, items(p, "spec.volumes"), "");
    let qos = match text(p, "status.qosClass") {
        "" => qos_class(p),
        q => q,
    };
    w.w(0, format!("QoS Class:\t{qos}"));
    labels(w, "Node-Selectors", at(p, "spec.nodeSelector"));
    tolerations(w, "Tolerations", items(p, "spec.tolerations"));
    spread_constraints(
        w,
        "Topology Spread Constraints",
        items(p, "spec.topologySpreadConstraints"),
    );
}

/// The QoS class Kubernetes gives a pod, for a status that does not say.
fn qos_class(p: &Json) -> &'static str {
    let all: Vec<&Json> = items(p, "spec.containers")
        .iter()
        .chain(items(p, "spec.initContainers"))
        .collect();
    let set = |c: &Json, kind: &str, res: &str| {
        at(c, &format!("resources.{kind}"))
            .get(res)
            .is_some_and(|q| quantity(q).is_some_and(|q| q.value != 0))
    };
    let any = all.iter().any(|c| {
        ["cpu", "memory"]
            .iter()
            .any(|r| set(c, "requests", r) || set(c, "limits", r))
    });
    if !any {
        return "BestEffort";
    }
    let guaranteed = all.iter().all(|c| {
        ["cpu", "memory"].iter().all(|r| {
            let limit = at(c, "resources.limits")
                .get(*r)
                .and_then(quantity)
                .map(|q| q.value);
            let request = at(c, "resources.requests")
                .get(*r)
                .and_then(quantity)
                .map(|q| q.value);
            limit.is_some_and(|l| l != 0) && request.is_none_or(|q| Some(q) == limit)
        })
    });
    if guaranteed {
        "Guaranteed"
    } else {
        "Burstable"
    }
}

fn spread_constraints(w: &mut Lines, title: &str, list: &[Json]) {
    if list.is_empty() {
        return;
    }
    let mut sorted: Vec<&Json> = list.iter().collect();
    sorted.sort_by(|a, b| text(a, "topologyKey").cmp(text(b, "topologyKey")));
    for (i, c) in sorted.iter().enumerate() {
        let mut s = format!(
            "{}:{} when max skew {} is exceeded",
            text(c, "topologyKey"),
            text(c, "whenUnsatisfiable"),
            int(c, "maxSkew")
        );
        let selector = label_selector(at(c, "labelSelector"));
        if !at(c, "labelSelector").is_null() {
            s.push_str(&format!(" for selector {selector}"));
        }
        let lead = if i == 0 {
            format!("{title}:\t")
        } else {
            "\t".into()
        };
        w.w(0, format!("{lead}{s}"));
    }
}

fn resources(w: &mut Lines, level: usize, r: &Json) {
    for (title, key) in [("Limits", "limits"), ("Requests", "requests")] {
        let m = sorted_map(at(r, key));
        if m.is_empty() {
            continue;
        }
        w.w(level, format!("{title}:"));
        for (name, q) in m {
            w.w(level + 1, format!("{name}:\t{q}"));
        }
    }
}

/// A container state as kubectl prints it, under `title`.
fn container_state(w: &mut Lines, title: &str, state: &Json) {
    if let Some(running) = state.get("running") {
        w.w(2, format!("{title}:\tRunning"));
        w.w(
            3,
            format!("Started:\t{}", rfc1123z(text(running, "startedAt"))),
        );
    } else if let Some(waiting) = state.get("waiting") {
        w.w(2, format!("{title}:\tWaiting"));
        optional(w, 3, "Reason", text(waiting, "reason"));
    } else if let Some(t) = state.get("terminated") {
        w.w(2, format!("{title}:\tTerminated"));
        optional(w, 3, "Reason", text(t, "reason"));
        optional(w, 3, "Message", text(t, "message"));
        w.w(3, format!("Exit Code:\t{}", int(t, "exitCode")));
        if int(t, "signal") > 0 {
            w.w(3, format!("Signal:\t{}", int(t, "signal")));
        }
        w.w(3, format!("Started:\t{}", rfc1123z(text(t, "startedAt"))));
        w.w(3, format!("Finished:\t{}", rfc1123z(text(t, "finishedAt"))));
    } else {
        w.w(2, format!("{title}:\tWaiting"));
    }
}

fn ports(list: &[Json], field: &str) -> String {
    let shown: Vec<String> = list
        .iter()
        .map(|p| format!("{}/{}", int(p, field), text(p, "protocol")))
        .collect();
    match shown.is_empty() {
        true => "<none>".into(),
        false => shown.join(", "),
    }
}

fn probe(p: &Json) -> String {
    let port = |v: &Json| scalar(at(v, "port"));
    let how = if let Some(h) = p.get("httpGet") {
        let host_port = match (text(h, "host"), port(h)) {
            (host, port) if host.contains(':') => format!("[{host}]:{port}"),
            (host, port) => format!("{host}:{port}"),
        };
        // As Go prints a URL: no scheme, no "scheme:".
        let scheme = match text(h, "scheme") {
            "" => String::new(),
            s => format!("{}:", s.to_ascii_lowercase()),
        };
        format!("http-get {scheme}//{host_port}{} ", text(h, "path"))
    } else if let Some(e) = p.get("exec") {
        let cmd: Vec<String> = items(e, "command").iter().map(scalar).collect();
        format!("exec [{}] ", cmd.join(" "))
    } else if let Some(t) = p.get("tcpSocket") {
        format!("tcp-socket {}:{} ", text(t, "host"), port(t))
    } else if let Some(g) = p.get("grpc") {
        format!("grpc <pod>:{} {} ", port(g), text(g, "service"))
    } else {
        "unknown ".into()
    };
    // As stored: the apiserver has put its defaults in.
    format!(
        "{how}delay={}s timeout={}s period={}s #success={} #failure={}",
        int(p, "initialDelaySeconds"),
        int(p, "timeoutSeconds"),
        int(p, "periodSeconds"),
        int(p, "successThreshold"),
        int(p, "failureThreshold")
    )
}

/// A field path's value in the pod, as kubectl resolves downward-API
/// references.
fn field_value(pod: &Json, path: &str) -> String {
    let keyed = |prefix: &str, map: &str| {
        path.strip_prefix(prefix)
            .and_then(|r| r.strip_prefix("['").and_then(|r| r.strip_suffix("']")))
            .map(|k| scalar(at(pod, map).get(k).unwrap_or(&Json::Null)))
    };
    if let Some(v) = keyed("metadata.labels", "metadata.labels")
        .or_else(|| keyed("metadata.annotations", "metadata.annotations"))
    {
        return if v == "<nil>" { String::new() } else { v };
    }
    match path {
        "status.podIPs" => items(pod, "status.podIPs")
            .iter()
            .map(|i| text(i, "ip").to_owned())
            .collect::<Vec<_>>()
            .join(","),
        "status.hostIPs" => items(pod, "status.hostIPs")
            .iter()
            .map(|i| text(i, "ip").to_owned())
            .collect::<Vec<_>>()
            .join(","),
        _ => text(pod, path).to_owned(),
    }
}

fn containers(
    w: &mut Lines,
    title: &str,
    list: &[Json],
    statuses: Option<&[Json]>,
    pod: Option<&Json>,
    space: &str,
) {
    let none = if list.is_empty() { " <none>" } else { "" };
    w.w(0, format!("{space}{title}:{none}"));
    for c in list {
        let name = text(c, "name");
        // A template's containers sit one space further in, their fields not.
        let indent = if space.is_empty() { "" } else { " " };
        w.w(1, format!("{indent}{name}:"));
        let status = statuses.and_then(|s| s.iter().find(|s| text(s, "name") == name));
        if let Some(s) = status {
            w.w(2, format!("Container ID:\t{}", text(s, "containerID")));
        }
        w.w(2, format!("Image:\t{}", text(c, "image")));
        if let Some(s) = status {
            w.w(2, format!("Image ID:\t{}", text(s, "imageID")));
        }
        let ps = items(c, "ports");
        let (port, host) = (ports(ps, "containerPort"), ports(ps, "hostPort"));
        let plural = |s: &str| if s.contains(',') { "s" } else { "" };
        w.w(2, format!("Port{}:\t{port}", plural(&port)));
        w.w(2, format!("Host Port{}:\t{host}", plural(&host)));
        let seccomp = at(c, "securityContext.seccompProfile");
        if !seccomp.is_null() {
            w.w(2, format!("SeccompProfile:\t{}", text(seccomp, "type")));
            if text(seccomp, "type") == "Localhost" {
                w.w(
                    3,
                    format!("LocalhostProfile:\t{}", text(seccomp, "localhostProfile")),
                );
            }
        }
        for (label, key) in [("Command", "command"), ("Args", "args")] {
            let args = items(c, key);
            if args.is_empty() {
                continue;
            }
            w.w(2, format!("{label}:"));
            for a in args {
                for line in scalar(a).split('\n') {
                    w.w(3, line);
                }
            }
        }
        if let Some(s) = status {
            container_state(w, "State", at(s, "state"));
            if !at(s, "lastState.terminated").is_null() {
                container_state(w, "Last State", at(s, "lastState"));
            }
            w.w(
                2,
                format!(
                    "Ready:\t{}",
                    go_bool(at(s, "ready").as_bool() == Some(true))
                ),
            );
            w.w(2, format!("Restart Count:\t{}", int(s, "restartCount")));
        }
        for (title, key) in [("Limits", "limits"), ("Requests", "requests")] {
            let m = sorted_map(at(c, &format!("resources.{key}")));
            if m.is_empty() {
                continue;
            }
            w.w(2, format!("{title}:"));
            for (name, q) in m {
                w.w(3, format!("{name}:\t{q}"));
            }
        }
        for (label, key) in [
            ("Liveness", "livenessProbe"),
            ("Readiness", "readinessProbe"),
            ("Startup", "startupProbe"),
        ] {
            if let Some(p) = c.get(key) {
                w.w(2, format!("{label}:\t{}", probe(p)));
            }
        }
        let env_from = items(c, "envFrom");
        if !env_from.is_empty() {
            w.w(2, "Environment Variables from:");
            for e in env_from {
                let (from, kind) = match (e.get("configMapRef"), e.get("secretRef")) {
                    (Some(r), _) => (r, "ConfigMap"),
                    (_, Some(r)) => (r, "Secret"),
                    _ => continue,
                };
                let kind = match text(e, "prefix") {
                    "" => kind.to_owned(),
                    prefix => format!("{kind} with prefix '{prefix}'"),
                };
                let optional = at(from, "optional").as_bool() == Some(true);
                w.w(
                    3,
                    format!("{}\t{kind}\tOptional: {optional}", text(from, "name")),
                );
            }
        }
        let env = items(c, "env");
        if env.is_empty() {
            w.w(2, "Environment:\t<none>");
        } else {
            w.w(2, "Environment:");
            for e in env {
                let name = text(e, "name");
                if let Some(v) = e.get("valueFrom") {
                    if let Some(f) = v.get("fieldRef") {
                        let path = text(f, "fieldPath");
                        let value = pod.map(|p| field_value(p, path)).unwrap_or_default();
                        let version = match text(f, "apiVersion") {
                            "" => "v1",
                            v => v,
                        };
                        w.w(3, format!("{name}:\t{value} ({version}:{path})"));
                    } else if let Some(r) = v.get("resourceFieldRef") {
                        w.w(
                            3,
                            format!("{name}:\t{} ({})", text(r, "resource"), text(r, "resource")),
                        );
                    } else if let Some(s) = v.get("secretKeyRef") {
                        w.w(
                            3,
                            format!(
                                "{name}:\t<set to the key '{}' in secret '{}'>\tOptional: {}",
                                text(s, "key"),
                                text(s, "name"),
                                at(s, "optional").as_bool() == Some(true)
                            ),
                        );
                    } else if let Some(m) = v.get("configMapKeyRef") {
                        w.w(
                            3,
                            format!(
                                "{name}:\t<set to the key '{}' of config map '{}'>\tOptional: {}",
                                text(m, "key"),
                                text(m, "name"),
                                at(m, "optional").as_bool() == Some(true)
                            ),
                        );
                    }
                } else {
                    let value = text(e, "value");
                    let mut lines = value.split('\n');
                    w.w(3, format!("{name}:\t{}", lines.next().unwrap_or("")));
                    for more in lines {
                        w.w(3, format!("\t{more}"));
                    }
                }
            }
        }
        let mut mounts: Vec<&Json> = items(c, "volumeMounts").iter().collect();
        if mounts.is_empty() {
            w.w(2, "Mounts:\t<none>");
        } else {
            mounts.sort_by(|a, b| text(a, "mountPath").cmp(text(b, "mountPath")));
            w.w(2, "Mounts:");
            for m in mounts {
                let mut flags = match at(m, "readOnly").as_bool() {
                    Some(true) => "ro".to_owned(),
                    _ => "rw".to_owned(),
                };
                if !text(m, "subPath").is_empty() {
                    flags.push_str(&format!(",path=\"{}\"", text(m, "subPath")));
                }
                w.w(
                    3,
                    format!(
                        "{} from {} ({flags})",
                        text(m, "mountPath"),
                        text(m, "name")
                    ),
                );
            }
        }
        let devices = items(c, "volumeDevices");
        if !devices.is_empty() {
            w.w(2, "Devices:");
            for d in devices {
                w.w(
                    3,
                    format!("{} from {}", text(d, "devicePath"), text(d, "name")),
                );
            }
        }
    }
}

fn volumes(w: &mut Lines, list: &[Json], space: &str) {
    if list.is_empty() {
        return w.w(0, format!("{space}Volumes:\t<none>"));
    }
    w.w(0, format!("{space}Volumes:"));
    for v in list {
        let indent = if space.is_empty() { "" } else { " " };
        w.w(1, format!("{indent}{}:", text(v, "name")));
        let opt = |s: &Json| at(s, "optional").as_bool() == Some(true);
        if let Some(e) = v.get("emptyDir") {
            let limit = match scalar(at(e, "sizeLimit")).as_str() {
                "<nil>" | "0" => "<unset>".to_owned(),
                l => l.to_owned(),
            };
            w.w(
                2,
                "Type:\tEmptyDir (a temporary directory that shares a pod's lifetime)",
            );
            w.w(2, format!("Medium:\t{}", text(e, "medium")));
            w.w(2, format!("SizeLimit:\t{limit}"));
        } else if let Some(c) = v.get("configMap") {
            w.w(2, "Type:\tConfigMap (a volume populated by a ConfigMap)");
            w.w(2, format!("Name:\t{}", text(c, "name")));
            w.w(2, format!("Optional:\t{}", opt(c)));
        } else if let Some(s) = v.get("secret") {
            w.w(2, "Type:\tSecret (a volume populated by a Secret)");
            w.w(2, format!("SecretName:\t{}", text(s, "secretName")));
            w.w(2, format!("Optional:\t{}", opt(s)));
        } else if let Some(h) = v.get("hostPath") {
            let kind = match text(h, "type") {
                "" if h.get("type").is_none() => "<none>",
                t => t,
            };
            w.w(2, "Type:\tHostPath (bare host directory volume)");
            w.w(2, format!("Path:\t{}", text(h, "path")));
            w.w(2, format!("HostPathType:\t{kind}"));
        } else if let Some(c) = v.get("persistentVolumeClaim") {
            w.w(2, "Type:\tPersistentVolumeClaim (a reference to a PersistentVolumeClaim in the same namespace)");
            w.w(2, format!("ClaimName:\t{}", text(c, "claimName")));
            w.w(
                2,
                format!("ReadOnly:\t{}", at(c, "readOnly").as_bool() == Some(true)),
            );
        } else if let Some(p) = v.get("projected") {
            w.w(
                2,
                "Type:\tProjected (a volume that contains injected data from multiple sources)",
            );
            for s in items(p, "sources") {
                if let Some(t) = s.get("serviceAccountToken") {
                    w.w(
                        2,
                        format!("TokenExpirationSeconds:\t{}", int(t, "expirationSeconds")),
                    );
                } else if let Some(c) = s.get("configMap") {
                    w.w(2, format!("ConfigMapName:\t{}", text(c, "name")));
                    w.w(
                        2,
                        format!("ConfigMapOptional:\t{}", scalar(at(c, "optional"))),
                    );
                } else if s.get("downwardAPI").is_some() {
                    w.w(2, "DownwardAPI:\ttrue");
                } else if let Some(c) = s.get("secret") {
                    w.w(2, format!("SecretName:\t{}", text(c, "name")));
                    w.w(
                        2,
                        format!("SecretOptionalName:\t{}", scalar(at(c, "optional"))),
                    );
                }
            }
        } else if let Some(d) = v.get("downwardAPI") {
            w.w(
                2,
                "Type:\tDownwardAPI (a volume populated by information about the pod)",
            );
            w.w(2, "Items:");
            for i in items(d, "items") {
                let from = match i.get("fieldRef") {
                    Some(f) => text(f, "fieldPath").to_owned(),
                    None => text(i, "resourceFieldRef.resource").to_owned(),
                };
                w.w(3, format!("{from} -> {}", text(i, "path")));
            }
        } else {
            w.w(2, "Type:\t<unknown>");
        }
    }
}

fn label_selector(sel: &Json) -> String {
    let mut parts: Vec<String> = sorted_map(at(sel, "matchLabels"))
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in items(sel, "matchExpressions") {
        let values: Vec<String> = items(e, "values").iter().map(scalar).collect();
        let key = text(e, "key");
        parts.push(match text(e, "operator") {
            "In" => format!("{key} in ({})", values.join(",")),
            "NotIn" => format!("{key} notin ({})", values.join(",")),
            "Exists" => key.to_owned(),
            "DoesNotExist" => format!("!{key}"),
            op => format!("{key} {op} ({})", values.join(",")),
        });
    }
    match parts.is_empty() {
        true => "<none>".into(),
        false => parts.join(","),
    }
}

// ------------------------------------------------------------- deployment

fn deployment(w: &mut Lines, d: &Json, related: &Related, _clock: Clock) {
    object_head(w, d, true);
    w.w(
        0,
        format!(
            "CreationTimestamp:\t{}",
            rfc1123z(text(d, "metadata.creationTimestamp"))
        ),
    );
    labels(w, "Labels", at(d, "metadata.labels"));
    annotations(w, "Annotations", at(d, "metadata.annotations"));
    w.w(
        0,
        format!("Selector:\t{}", label_selector(at(d, "spec.selector"))),
    );
    w.w(
        0,
        format!(
            "Replicas:\t{} desired | {} updated | {} total | {} available | {} unavailable",
            at(d, "spec.replicas").as_i64().unwrap_or(1),
            int(d, "status.updatedReplicas"),
            int(d, "status.replicas"),
            int(d, "status.availableReplicas"),
            int(d, "status.unavailableReplicas")
        ),
    );
    w.w(
        0,
        format!("StrategyType:\t{}", text(d, "spec.strategy.type")),
    );
    w.w(
        0,
        format!("MinReadySeconds:\t{}", int(d, "spec.minReadySeconds")),
    );
    let rolling = at(d, "spec.strategy.rollingUpdate");
    if !rolling.is_null() {
        w.w(
            0,
            format!(
                "RollingUpdateStrategy:\t{} max unavailable, {} max surge",
                scalar(at(rolling, "maxUnavailable")),
                scalar(at(rolling, "maxSurge"))
            ),
        );
    }
    pod_template(w, at(d, "spec.template"));
    let conditions = items(d, "status.conditions");
    if !conditions.is_empty() {
        w.w(0, "Conditions:\n  Type\tStatus\tReason");
        w.w(1, "----\t------\t------");
        for c in conditions {
            w.w(
                1,
                format!(
                    "{} \t{}\t{}",
                    text(c, "type"),
                    text(c, "status"),
                    text(c, "reason")
                ),
            );
        }
    }
    if let Some(sets) = &related.replica_sets {
        let uid = text(d, "metadata.uid");
        let owned: Vec<&Json> = sets
            .iter()
            .filter(|rs| {
                items(rs, "metadata.ownerReferences")
                    .iter()
                    .any(|o| at(o, "controller").as_bool() == Some(true) && text(o, "uid") == uid)
            })
            .collect();
        let template = without_hash(at(d, "spec.template"));
        let (new, old): (Vec<&Json>, Vec<&Json>) = owned
            .into_iter()
            .partition(|rs| without_hash(at(rs, "spec.template")) == template);
        // Old ones that still have pods, as kubectl's "required" ones.
        let old: Vec<&Json> = old
            .into_iter()
            .filter(|rs| int(rs, "spec.replicas") != 0)
            .collect();
        let new = new.into_iter().next();
        if new.is_some() || !old.is_empty() {
            let list = |sets: &[&Json]| match sets.is_empty() {
                true => "<none>".to_owned(),
                false => sets
                    .iter()
                    .map(|rs| {
                        format!(
                            "{} ({}/{} replicas created)",
                            text(rs, "metadata.name"),
                            int(rs, "status.replicas"),
                            int(rs, "spec.replicas")
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
            };
            w.w(0, format!("OldReplicaSets:\t{}", list(&old)));
            w.w(
                0,
                format!(
                    "NewReplicaSet:\t{}",
                    list(&new.into_iter().collect::<Vec<_>>())
                ),
            );
        }
    }
}

/// A pod template without the `pod-template-hash` label its ReplicaSets add.
fn without_hash(template: &Json) -> Json {
    let mut t = template.clone();
    if let Some(labels) = t
        .pointer_mut("/metadata/labels")
        .and_then(Json::as_object_mut)
    {
        labels.remove("pod-template-hash");
    }
    t
}

fn pod_template(w: &mut Lines, t: &Json) {
    if t.is_null() {
        return w.w(0, "Pod Template:\n  <unset>");
    }
    w.w(0, "Pod Template:");
    labels(w, "  Labels", at(t, "metadata.labels"));
    let notes = at(t, "metadata.annotations");
    if notes.as_object().is_some_and(|m| !m.is_empty()) {
        annotations(w, "  Annotations", notes);
    }
    optional(w, 1, "Service Account", text(t, "spec.serviceAccountName"));
    if !items(t, "spec.initContainers").is_empty() {
        containers(
            w,
            "Init Containers",
            items(t, "spec.initContainers"),
            None,
            None,
            "  ",
        );
    }
    containers(
        w,
        "Containers",
        items(t, "spec.containers"),
        None,
        None,
        "  ",
    );
    volumes(w, items(t, "spec.volumes"), "  ");
    spread_constraints(
        w,
        "  Topology Spread Constraints",
        items(t, "spec.topologySpreadConstraints"),
    );
    optional(
        w,
        1,
        "Priority Class Name",
        text(t, "spec.priorityClassName"),
    );
    labels(w, "  Node-Selectors", at(t, "spec.nodeSelector"));
    tolerations(w, "  Tolerations", items(t, "spec.tolerations"));
}

// ---------------------------------------------------------------- service

fn service(w: &mut Lines, s: &Json, related: &Related) {
    object_head(w, s, true);
    labels(w, "Labels", at(s, "metadata.labels"));
    annotations(w, "Annotations", at(s, "metadata.annotations"));
    let selector: Vec<String> = sorted_map(at(s, "spec.selector"))
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    w.w(
        0,
        format!(
            "Selector:\t{}",
            if selector.is_empty() {
                "<none>".into()
            } else {
                selector.join(",")
            }
        ),
    );
    w.w(0, format!("Type:\t{}", text(s, "spec.type")));
    if !at(s, "spec.ipFamilyPolicy").is_null() {
        w.w(
            0,
            format!("IP Family Policy:\t{}", text(s, "spec.ipFamilyPolicy")),
        );
    }
    let joined = |path: &str, sep: &str| {
        let v: Vec<String> = items(s, path).iter().map(scalar).collect();
        if v.is_empty() {
            "<none>".to_owned()
        } else {
            v.join(sep)
        }
    };
    w.w(
        0,
        format!("IP Families:\t{}", joined("spec.ipFamilies", ",")),
    );
    w.w(0, format!("IP:\t{}", text(s, "spec.clusterIP")));
    w.w(0, format!("IPs:\t{}", joined("spec.clusterIPs", ",")));
    if !items(s, "spec.externalIPs").is_empty() {
        w.w(
            0,
            format!("External IPs:\t{}", joined("spec.externalIPs", ",")),
        );
    }
    optional(
        w,
        0,
        "Desired LoadBalancer IP",
        text(s, "spec.loadBalancerIP"),
    );
    optional(w, 0, "External Name", text(s, "spec.externalName"));
    let ingress = items(s, "status.loadBalancer.ingress");
    if !ingress.is_empty() {
        let shown: Vec<String> = ingress
            .iter()
            .map(|i| match (text(i, "ip"), text(i, "ipMode")) {
                ("", _) => text(i, "hostname").to_owned(),
                (ip, "") => ip.to_owned(),
                (ip, mode) => format!("{ip} ({mode})"),
            })
            .collect();
        w.w(0, format!("LoadBalancer Ingress:\t{}", shown.join(", ")));
    }
    for p in items(s, "spec.ports") {
        let name = match text(p, "name") {
            "" => "<unset>",
            n => n,
        };
        let proto = text(p, "protocol");
        w.w(0, format!("Port:\t{name}\t{}/{proto}", int(p, "port")));
        w.w(
            0,
            format!("TargetPort:\t{}/{proto}", scalar(at(p, "targetPort"))),
        );
        if int(p, "nodePort") != 0 {
            w.w(
                0,
                format!("NodePort:\t{name}\t{}/{proto}", int(p, "nodePort")),
            );
        }
        w.w(
            0,
            format!("Endpoints:\t{}", endpoints(related, text(p, "name"))),
        );
    }
    w.w(
        0,
        format!("Session Affinity:\t{}", text(s, "spec.sessionAffinity")),
    );
    optional(
        w,
        0,
        "External Traffic Policy",
        text(s, "spec.externalTrafficPolicy"),
    );
    if !at(s, "spec.internalTrafficPolicy").is_null() {
        w.w(
            0,
            format!(
                "Internal Traffic Policy:\t{}",
                text(s, "spec.internalTrafficPolicy")
            ),
        );
    }
    if int(s, "spec.healthCheckNodePort") != 0 {
        w.w(
            0,
            format!(
                "HealthCheck NodePort:\t{}",
                int(s, "spec.healthCheckNodePort")
            ),
        );
    }
    if !items(s, "spec.loadBalancerSourceRanges").is_empty() {
        w.w(
            0,
            format!(
                "LoadBalancer Source Ranges:\t{}",
                joined("spec.loadBalancerSourceRanges", ",")
            ),
        );
    }
}

/// The ready endpoints of the service port named `port` from its
/// EndpointSlices: at most three, then how many more.
fn endpoints(related: &Related, port: &str) -> String {
    let slices = related.endpoint_slices.as_deref().unwrap_or(&[]);
    if slices.is_empty() {
        return "<none>".into();
    }
    let mut all = Vec::new();
    for slice in slices {
        let ports = items(slice, "ports");
        let ready = items(slice, "endpoints")
            .iter()
            .filter(|e| at(e, "conditions.ready").as_bool() != Some(false))
            .filter_map(|e| items(e, "addresses").first().map(scalar));
        let ready: Vec<String> = ready.collect();
        if ports.is_empty() {
            all.extend(ready);
            continue;
        }
        for p in ports.iter().filter(|p| text(p, "name") == port) {
            let n = int(p, "port");
            all.extend(ready.iter().map(|a| match a.contains(':') {
                true => format!("[{a}]:{n}"),
                false => format!("{a}:{n}"),
            }));
        }
    }
    match all.len() {
        0..=3 => all.join(","),
        n => format!("{} + {} more...", all[..3].join(","), n - 3),
    }
}

// ------------------------------------------------------------------- node

fn node(w: &mut Lines, n: &Json, related: &Related, clock: Clock) {
    object_head(w, n, false);
    let mut roles: Vec<String> = sorted_map(at(n, "metadata.labels"))
        .into_iter()
        .filter_map(|(k, v)| match k.strip_prefix("node-role.kubernetes.io/") {
            Some(role) if !role.is_empty() => Some(role.to_owned()),
            _ if k == "kubernetes.io/role" && !v.is_empty() => Some(v),
            _ => None,
        })
        .collect();
    roles.sort();
    roles.dedup();
    w.w(
        0,
        format!(
            "Roles:\t{}",
            if roles.is_empty() {
                "<none>".into()
            } else {
                roles.join(",")
            }
        ),
    );
    labels(w, "Labels", at(n, "metadata.labels"));
    annotations(w, "Annotations", at(n, "metadata.annotations"));
    w.w(
        0,
        format!(
            "CreationTimestamp:\t{}",
            rfc1123z(text(n, "metadata.creationTimestamp"))
        ),
    );
    let taints = items(n, "spec.taints");
    if taints.is_empty() {
        w.w(0, "Taints:\t<none>");
    } else {
        let mut sorted: Vec<&Json> = taints.iter().collect();
        sorted.sort_by_key(|t| format!("{},{}", text(t, "effect"), text(t, "key")));
        for (i, t) in sorted.iter().enumerate() {
            let shown = match text(t, "value") {
                "" => format!("{}:{}", text(t, "key"), text(t, "effect")),
                v => format!("{}={v}:{}", text(t, "key"), text(t, "effect")),
            };
            let lead = if i == 0 { "Taints:\t" } else { "\t" };
            w.w(0, format!("{lead}{shown}"));
        }
    }
    w.w(
        0,
        format!(
            "Unschedulable:\t{}",
            at(n, "spec.unschedulable").as_bool() == Some(true)
        ),
    );
    match &related.lease {
        Some(Ok(lease)) => {
            let or_unset = |path: &str| match text(lease, path) {
                "" => "<unset>".to_owned(),
                t if path.ends_with("Time") => rfc1123z(t),
                t => t.to_owned(),
            };
            w.w(0, "Lease:");
            w.w(
                1,
                format!("HolderIdentity:\t{}", or_unset("spec.holderIdentity")),
            );
            w.w(1, format!("AcquireTime:\t{}", or_unset("spec.acquireTime")));
            w.w(1, format!("RenewTime:\t{}", or_unset("spec.renewTime")));
        }
        Some(Err(why)) => w.w(0, format!("Lease:\tFailed to get lease: {why}")),
        None => {}
    }
    let conditions = items(n, "status.conditions");
    if !conditions.is_empty() {
        w.w(
            0,
            "Conditions:\n  Type\tStatus\tLastHeartbeatTime\tLastTransitionTime\tReason\tMessage",
        );
        w.w(
            1,
            "----\t------\t-----------------\t------------------\t------\t-------",
        );
        for c in conditions {
            w.w(
                1,
                format!(
                    "{} \t{} \t{} \t{} \t{} \t{}",
                    text(c, "type"),
                    text(c, "status"),
                    rfc1123z(text(c, "lastHeartbeatTime")),
                    rfc1123z(text(c, "lastTransitionTime")),
                    text(c, "reason"),
                    text(c, "message")
                ),
            );
        }
    }
    w.w(0, "Addresses:");
    for a in items(n, "status.addresses") {
        w.w(1, format!("{}:\t{}", text(a, "type"), text(a, "address")));
    }
    for (title, key) in [
        ("Capacity", "status.capacity"),
        ("Allocatable", "status.allocatable"),
    ] {
        let m = sorted_map(at(n, key));
        if m.is_empty() {
            continue;
        }
        w.w(0, format!("{title}:"));
        for (name, q) in m {
            w.w(0, format!("  {name}:\t{q}"));
        }
    }
    w.w(0, "System Info:");
    for (label, key) in [
        ("Machine ID", "machineID"),
        ("System UUID", "systemUUID"),
        ("Boot ID", "bootID"),
        ("Kernel Version", "kernelVersion"),
        ("OS Image", "osImage"),
        ("Operating System", "operatingSystem"),
        ("Architecture", "architecture"),
        ("Container Runtime Version", "containerRuntimeVersion"),
        ("Kubelet Version", "kubeletVersion"),
        ("Kube-Proxy Version", "kubeProxyVersion"),
    ] {
        w.w(
            0,
            format!("  {label}:\t{}", text(n, &format!("status.nodeInfo.{key}"))),
        );
    }
    optional(w, 0, "PodCIDR", text(n, "spec.podCIDR"));
    let cidrs: Vec<String> = items(n, "spec.podCIDRs").iter().map(scalar).collect();
    if !cidrs.is_empty() {
        w.w(0, format!("PodCIDRs:\t{}", cidrs.join(",")));
    }
    optional(w, 0, "ProviderID", text(n, "spec.providerID"));
    match &related.node_pods {
        Some(Err(())) => w.w(0, "Pods:\tnot authorized"),
        Some(Ok(pods)) => node_pods(w, n, pods, clock),
        None => {}
    }
}

fn node_pods(w: &mut Lines, n: &Json, pods: &[Json], clock: Clock) {
    let allocatable = match at(n, "status.allocatable").as_object() {
        Some(m) if !m.is_empty() => at(n, "status.allocatable"),
        _ => at(n, "status.capacity"),
    };
    let share = |q: &Quantity, res: &str| -> i64 {
        let total = allocatable
            .get(res)
            .and_then(quantity)
            .map_or(0, |q| q.value);
        match total {
            0 => 0,
            t => (q.value as f64 / t as f64 * 100.0) as i64,
        }
    };
    w.w(
        0,
        format!("Non-terminated Pods:\t({} in total)", pods.len()),
    );
    w.w(
        1,
        "Namespace\tName\t\tCPU Requests\tCPU Limits\tMemory Requests\tMemory Limits\tAge",
    );
    w.w(
        1,
        "---------\t----\t\t------------\t----------\t---------------\t-------------\t---",
    );
    let mut totals: BTreeMap<String, (Quantity, Quantity)> = BTreeMap::new();
    for p in pods {
        let (req, lim) = pod_totals(p);
        let get = |m: &BTreeMap<String, Quantity>, r: &str| {
            m.get(r).cloned().unwrap_or_else(|| Quantity::zero(r))
        };
        let (cr, cl, mr, ml) = (
            get(&req, "cpu"),
            get(&lim, "cpu"),
            get(&req, "memory"),
            get(&lim, "memory"),
        );
        w.w(
            1,
            format!(
                "{}\t{}\t\t{} ({}%)\t{} ({}%)\t{} ({}%)\t{} ({}%)\t{}",
                text(p, "metadata.namespace"),
                text(p, "metadata.name"),
                cr,
                share(&cr, "cpu"),
                cl,
                share(&cl, "cpu"),
                mr,
                share(&mr, "memory"),
                ml,
                share(&ml, "memory"),
                clock.since(text(p, "metadata.creationTimestamp"))
            ),
        );
        for (name, q) in req {
            let e = totals
                .entry(name.clone())
                .or_insert_with(|| (Quantity::zero(&name), Quantity::zero(&name)));
            e.0 = e.0.add(&q);
        }
        for (name, q) in lim {
            let e = totals
                .entry(name.clone())
                .or_insert_with(|| (Quantity::zero(&name), Quantity::zero(&name)));
            e.1 = e.1.add(&q);
        }
    }
    w.w(
        0,
        "Allocated resources:\n  (Total limits may be over 100 percent, i.e., overcommitted.)",
    );
    w.w(1, "Resource\tRequests\tLimits");
    w.w(1, "--------\t--------\t------");
    let zero = |r: &str| (Quantity::zero(r), Quantity::zero(r));
    for r in ["cpu", "memory", "ephemeral-storage"] {
        let (req, lim) = totals.get(r).cloned().unwrap_or_else(|| zero(r));
        w.w(
            1,
            format!(
                "{r}\t{req} ({}%)\t{lim} ({}%)",
                share(&req, r),
                share(&lim, r)
            ),
        );
    }
    let mut huge: Vec<&String> = allocatable
        .as_object()
        .map(|m| m.keys().filter(|k| k.starts_with("hugepages-")).collect())
        .unwrap_or_default();
    huge.sort();
    for r in huge {
        let (req, lim) = totals.get(r.as_str()).cloned().unwrap_or_else(|| zero(r));
        w.w(
            1,
            format!(
                "{r}\t{req} ({}%)\t{lim} ({}%)",
                share(&req, r),
                share(&lim, r)
            ),
        );
    }
    let standard = |r: &str| {
        matches!(r, "cpu" | "memory" | "ephemeral-storage" | "pods") || r.starts_with("hugepages-")
    };
    for (r, (req, lim)) in totals.iter().filter(|(r, _)| !standard(r)) {
        w.w(1, format!("{r}\t{req}\t{lim}"));
    }
}

/// A pod's requests and limits as the scheduler counts them: the sum over
/// its containers, or the largest init container's when that is larger.
fn pod_totals(p: &Json) -> (BTreeMap<String, Quantity>, BTreeMap<String, Quantity>) {
    let mut out = (BTreeMap::new(), BTreeMap::new());
    for (which, key) in [(&mut out.0, "requests"), (&mut out.1, "limits")] {
        for c in items(p, "spec.containers") {
            for (name, q) in at(c, &format!("resources.{key}"))
                .as_object()
                .into_iter()
                .flatten()
            {
                if let Some(q) = quantity(q) {
                    let sum = which
                        .remove(name)
                        .map_or(q.clone(), |s: Quantity| s.add(&q));
                    which.insert(name.clone(), sum);
                }
            }
        }
        for c in items(p, "spec.initContainers") {
            for (name, q) in at(c, &format!("resources.{key}"))
                .as_object()
                .into_iter()
                .flatten()
            {
                if let Some(q) = quantity(q)
                    && which.get(name).is_none_or(|s: &Quantity| q.value > s.value)
                {
                    which.insert(name.clone(), q);
                }
            }
        }
    }
    out
}

// ------------------------------------------------------------- quantities

/// A resource quantity, as a whole number of thousandths, in the format it
/// was written in (binary suffixes stay binary), printed canonically.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Quantity {
    /// Thousandths of the unit (millicores, millibytes).
    value: i128,
    binary: bool,
}

impl Quantity {
    fn zero(_resource: &str) -> Quantity {
        Quantity {
            value: 0,
            binary: false,
        }
    }

    fn add(&self, other: &Quantity) -> Quantity {
        Quantity {
            value: self.value + other.value,
            binary: if self.value == 0 {
                other.binary
            } else {
                self.binary
            },
        }
    }
}

fn quantity(v: &Json) -> Option<Quantity> {
    let s = match v {
        Json::String(s) => s.clone(),
        Json::Number(n) => n.to_string(),
        _ => return None,
    };
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let (mult, binary): (i128, bool) = match suffix {
        "" => (1000, false),
        "m" => (1, false),
        "k" => (1000 * 1000, false),
        "M" => (1000 * 1000_i128.pow(2), false),
        "G" => (1000 * 1000_i128.pow(3), false),
        "T" => (1000 * 1000_i128.pow(4), false),
        "P" => (1000 * 1000_i128.pow(5), false),
        "E" => (1000 * 1000_i128.pow(6), false),
        "Ki" => (1000 * 1024, true),
        "Mi" => (1000 * 1024_i128.pow(2), true),
        "Gi" => (1000 * 1024_i128.pow(3), true),
        "Ti" => (1000 * 1024_i128.pow(4), true),
        "Pi" => (1000 * 1024_i128.pow(5), true),
        "Ei" => (1000 * 1024_i128.pow(6), true),
        _ => return None,
    };
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    let whole: i128 = whole.parse().ok()?;
    let mut value = whole * mult;
    if !frac.is_empty() {
        let digits = frac.len().min(18) as u32;
        let f: i128 = frac[..digits as usize].parse().ok()?;
        value += f * mult / 10_i128.pow(digits);
    }
    Some(Quantity { value, binary })
}

impl std::fmt::Display for Quantity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.value;
        if v == 0 {
            return f.write_str("0");
        }
        if v % 1000 != 0 {
            return write!(f, "{v}m");
        }
        let units = v / 1000;
        if self.binary {
            let mut n = units;
            let mut i = 0;
            while n % 1024 == 0 && i < 6 {
                n /= 1024;
                i += 1;
            }
            let suffix = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"][i];
            return write!(f, "{n}{suffix}");
        }
        let mut n = units;
        let mut i = 0;
        while n % 1000 == 0 && i < 6 {
            n /= 1000;
            i += 1;
        }
        let suffix = ["", "k", "M", "G", "T", "P", "E"][i];
        write!(f, "{n}{suffix}")
    }
}

// ---------------------------------------------------------------- generic

/// kubectl's generic describer: name, namespace, labels and annotations,
/// then every other field, keys sorted, nested by indentation.
fn generic(w: &mut Lines, obj: &Json) {
    let namespaced = !text(obj, "metadata.namespace").is_empty();
    object_head(w, obj, namespaced);
    labels(w, "Labels", at(obj, "metadata.labels"));
    annotations(w, "Annotations", at(obj, "metadata.annotations"));
    let mut rest = obj.clone();
    if let Some(meta) = rest.get_mut("metadata").and_then(Json::as_object_mut) {
        for k in [
            "managedFields",
            "name",
            "namespace",
            "labels",
            "annotations",
        ] {
            meta.remove(k);
        }
    }
    unstructured(w, 0, &rest);
}

fn unstructured(w: &mut Lines, level: usize, v: &Json) {
    let Some(map) = v.as_object() else { return };
    let sorted: BTreeMap<&String, &Json> = map.iter().collect();
    for (k, v) in sorted {
        let label = smart_label(k);
        match v {
            Json::Object(_) => {
                w.w(level, format!("{label}:"));
                unstructured(w, level + 1, v);
            }
            Json::Array(list) => {
                w.w(level, format!("{label}:"));
                for item in list {
                    match item {
                        Json::Object(_) => unstructured(w, level + 1, item),
                        other => w.w(level + 1, scalar(other)),
                    }
                }
            }
            other => w.w(level, format!("{label}:\t{}", scalar(other))),
        }
    }
}

/// kubectl's `smartLabelFor`: `apiVersion` → `API Version`, `uid` →
/// `UID`; keys with other than letters and dashes stay as they are.
fn smart_label(key: &str) -> String {
    if key.chars().any(|c| !c.is_ascii_alphabetic() && c != '-') {
        return key.to_owned();
    }
    let mut words: Vec<String> = Vec::new();
    let mut current = String::new();
    for c in key.chars() {
        if c.is_ascii_uppercase() && !current.is_empty() && !current.ends_with('-') {
            words.push(std::mem::take(&mut current));
        }
        current.push(c);
    }
    if !current.is_empty() {
        words.push(current);
    }
    words
        .into_iter()
        .map(|w| {
            let upper = w.to_ascii_uppercase();
            if ["API", "URL", "UID", "OSB", "GUID"].contains(&upper.as_str()) {
                return upper;
            }
            let mut chars = w.chars();
            match chars.next() {
                Some(first) => first.to_ascii_uppercase().to_string() + chars.as_str(),
                None => String::new(),
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

// ----------------------------------------------------------------- events

fn event_table(w: &mut Lines, events: &[Json], clock: Clock) {
    if events.is_empty() {
        return w.w(0, "Events:\t<none>");
    }
    let mut sorted: Vec<&Json> = events.iter().collect();
    sorted.sort_by_key(|e| parse_time(text(e, "lastTimestamp")));
    w.w(0, "Events:\n  Type\tReason\tAge\tFrom\tMessage");
    w.w(1, "----\t------\t----\t----\t-------");
    for e in sorted {
        let first = match text(e, "eventTime") {
            "" => clock.since(text(e, "firstTimestamp")),
            t => clock.since(t),
        };
        let age = if let Some(series) = e.get("series").filter(|s| !s.is_null()) {
            format!(
                "{} (x{} over {first})",
                clock.since(text(series, "lastObservedTime")),
                int(series, "count")
            )
        } else if int(e, "count") > 1 {
            format!(
                "{} (x{} over {first})",
                clock.since(text(e, "lastTimestamp")),
                int(e, "count")
            )
        } else {
            first
        };
        let from = match text(e, "source.component") {
            "" => text(e, "reportingComponent"),
            c => c,
        };
        w.w(
            1,
            format!(
                "{}\t{}\t{age}\t{from}\t{}",
                text(e, "type"),
                text(e, "reason"),
                text(e, "message").trim()
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_align_per_run_of_lines_as_gos_tabwriter_does() {
        let mut w = Lines::default();
        w.w(0, "Name:\tweb-0");
        w.w(0, "Namespace:\tdefault");
        w.w(0, "Containers:");
        w.w(1, "web:");
        w.w(2, "Image:\tnginx");
        w.w(2, "Restart Count:\t0");
        w.w(0, "Events:\n  Type\tReason\tAge");
        w.w(1, "----\t------\t---");
        w.w(1, "Normal\tPulled\t5s");
        assert_eq!(
            w.render(),
            "Name:       web-0\nNamespace:  default\nContainers:\n  web:\n    Image:          nginx\n    Restart Count:  0\nEvents:\n  Type    Reason  Age\n  ----    ------  ---\n  Normal  Pulled  5s\n"
        );
    }

    #[test]
    fn durations_read_as_kubectls() {
        for (secs, want) in [
            (5, "5s"),
            (119, "119s"),
            (150, "2m30s"),
            (600, "10m"),
            (3 * 3600 + 60, "3h1m"),
            (10 * 3600, "10h"),
            (3 * 86_400 + 3600, "3d1h"),
            (30 * 86_400, "30d"),
            (-5, "<invalid>"),
        ] {
            assert_eq!(human_duration(secs), want, "{secs}");
        }
    }

    #[test]
    fn quantities_add_and_print_canonically() {
        let q = |s: &str| quantity(&Json::from(s)).unwrap();
        assert_eq!(q("100m").add(&q("400m")).to_string(), "500m");
        assert_eq!(q("1").add(&q("500m")).to_string(), "1500m");
        assert_eq!(q("64Mi").add(&q("64Mi")).to_string(), "128Mi");
        assert_eq!(q("1Gi").to_string(), "1Gi");
        assert_eq!(q("2k").to_string(), "2k");
        assert_eq!(Quantity::zero("cpu").to_string(), "0");
        assert_eq!(q("0.5").to_string(), "500m");
    }

    #[test]
    fn labels_are_smart_as_kubectls() {
        assert_eq!(smart_label("apiVersion"), "API Version");
        assert_eq!(smart_label("uid"), "UID");
        assert_eq!(smart_label("involvedObject"), "Involved Object");
        assert_eq!(smart_label("reportingComponent"), "Reporting Component");
        assert_eq!(smart_label("some_key"), "some_key");
    }
}
