//! Printing objects the way kubectl users read them.

use prost_types::{Struct, Value, value::Kind};
use serde_json::Value as Json;

/// A protobuf Struct as JSON.
pub fn struct_to_json(s: &Struct) -> Json {
    Json::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), value_to_json(v)))
            .collect(),
    )
}

fn value_to_json(v: &Value) -> Json {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Json::Null,
        Some(Kind::NumberValue(n)) => {
            if n.fract() == 0.0 && n.abs() < 9.0e15 {
                Json::from(*n as i64)
            } else {
                serde_json::Number::from_f64(*n).map_or(Json::Null, Json::Number)
            }
        }
        Some(Kind::StringValue(s)) => Json::String(s.clone()),
        Some(Kind::BoolValue(b)) => Json::Bool(*b),
        Some(Kind::StructValue(s)) => struct_to_json(s),
        Some(Kind::ListValue(l)) => Json::Array(l.values.iter().map(value_to_json).collect()),
    }
}

/// "5s", "3m", "2h", "4d" since an RFC 3339 time.
pub fn age(timestamp: Option<&str>) -> String {
    let Some(ts) = timestamp else {
        return "<unknown>".into();
    };
    let Ok(t) = time::OffsetDateTime::parse(ts, &time::format_description::well_known::Rfc3339)
    else {
        return "<unknown>".into();
    };
    let secs = (time::OffsetDateTime::now_utc() - t).whole_seconds().max(0);
    match secs {
        0..=119 => format!("{secs}s"),
        120..=7199 => format!("{}m", secs / 60),
        7200..=172_799 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86400),
    }
}

/// Prints rows as aligned columns.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(cell.len());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                out.push_str(c);
            } else {
                out.push_str(&format!("{c:<w$}   ", w = widths[i]));
            }
        }
        out.trim_end().to_owned()
    };
    let mut out = line(headers.to_vec());
    out.push('\n');
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
        out.push('\n');
    }
    out
}

fn get<'a>(o: &'a Json, path: &str) -> &'a Json {
    path.split('.').fold(o, |v, k| &v[k])
}

/// Columns for `otter get`: name (and namespace), a kind-specific status, age.
pub fn row(
    kind: &str,
    o: &Json,
    all_namespaces: bool,
    wide: bool,
) -> (Vec<&'static str>, Vec<String>) {
    let name = get(o, "metadata.name").as_str().unwrap_or("").to_owned();
    let ns = get(o, "metadata.namespace")
        .as_str()
        .unwrap_or("")
        .to_owned();
    let age = age(get(o, "metadata.creationTimestamp").as_str());
    let mut headers = Vec::new();
    let mut cells = Vec::new();
    if all_namespaces {
        headers.push("NAMESPACE");
        cells.push(ns);
    }
    headers.push("NAME");
    cells.push(name);
    match kind {
        "Pod" => {
            let statuses = get(o, "status.containerStatuses")
                .as_array()
                .cloned()
                .unwrap_or_default();
            let ready = statuses.iter().filter(|c| c["ready"] == true).count();
            let total = get(o, "spec.containers")
                .as_array()
                .map_or(statuses.len(), Vec::len);
            let restarts: i64 = statuses
                .iter()
                .filter_map(|c| c["restartCount"].as_i64())
                .sum();
            headers.extend(["READY", "STATUS", "RESTARTS"]);
            cells.push(format!("{ready}/{total}"));
            cells.push(
                get(o, "status.phase")
                    .as_str()
                    .unwrap_or("Unknown")
                    .to_owned(),
            );
            cells.push(restarts.to_string());
        }
        "Deployment" | "StatefulSet" | "ReplicaSet" => {
            let want = get(o, "spec.replicas").as_i64().unwrap_or(0);
            let ready = get(o, "status.readyReplicas").as_i64().unwrap_or(0);
            headers.push("READY");
            cells.push(format!("{ready}/{want}"));
        }
        "Service" => {
            headers.extend(["TYPE", "CLUSTER-IP"]);
            cells.push(
                get(o, "spec.type")
                    .as_str()
                    .unwrap_or("ClusterIP")
                    .to_owned(),
            );
            cells.push(
                get(o, "spec.clusterIP")
                    .as_str()
                    .unwrap_or("<none>")
                    .to_owned(),
            );
        }
        _ => {}
    }
    headers.push("AGE");
    cells.push(age);
    if wide && kind == "Pod" {
        headers.extend(["IP", "NODE"]);
        cells.push(
            get(o, "status.podIP")
                .as_str()
                .unwrap_or("<none>")
                .to_owned(),
        );
        cells.push(
            get(o, "spec.nodeName")
                .as_str()
                .unwrap_or("<none>")
                .to_owned(),
        );
    }
    (headers, cells)
}

/// YAML of a JSON value.
pub fn yaml(v: &Json) -> String {
    serde_saphyr::to_string(v).unwrap_or_else(|e| format!("# cannot render YAML: {e}\n"))
}
