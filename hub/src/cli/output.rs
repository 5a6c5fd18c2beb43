//! Printing objects the way kubectl users read them.
//!
//! Most of what `otter` prints comes from agents (link fields, versions,
//! object names, events), and an agent may be hostile: every such string
//! goes through [`printable`] (or [`printable_lines`], or is printed by
//! [`table`] or [`json`], which do it themselves) so that it cannot drive
//! the terminal.

use std::{borrow::Cow, fmt::Write as _};

use serde_json::Value as Json;

pub use otter_proto::json::struct_to_json;

/// "5s", "3m", "2h", "4d" since an RFC 3339 time.
pub fn age(timestamp: Option<&str>) -> String {
    let Some(ts) = timestamp else {
        return "<unknown>".into();
    };
    let Ok(t) = time::OffsetDateTime::parse(ts, &time::format_description::well_known::Rfc3339)
    else {
        return "<unknown>".into();
    };
    crate::short_duration((time::OffsetDateTime::now_utc() - t).whole_seconds())
}

/// `s` made safe to show on a terminal: control characters (C0 including
/// line breaks, DEL, C1) and the bidi embeddings, overrides and isolates
/// that reorder what the reader sees are written as escapes (`\x1b`,
/// `\u{202e}`). Borrowed when there is nothing to escape.
pub fn printable(s: &str) -> Cow<'_, str> {
    escape(s, false)
}

/// Like [`printable`], but keeps line feeds and tabs, for text that is
/// meant to span lines; a carriage return is still escaped, since it can
/// overwrite what was printed before it on the same line.
pub fn printable_lines(s: &str) -> Cow<'_, str> {
    escape(s, true)
}

fn escape(s: &str, keep_lines: bool) -> Cow<'_, str> {
    if !s.chars().any(|c| needs_escape(c, keep_lines)) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if !needs_escape(c, keep_lines) {
            out.push(c);
            continue;
        }
        let _ = match c {
            '\n' => out.write_str("\\n"),
            '\r' => out.write_str("\\r"),
            '\t' => out.write_str("\\t"),
            c if u32::from(c) <= 0xff => write!(out, "\\x{:02x}", u32::from(c)),
            c => write!(out, "\\u{{{:x}}}", u32::from(c)),
        };
    }
    Cow::Owned(out)
}

/// Whether a terminal could act on `c` rather than show it.
fn needs_escape(c: char, keep_lines: bool) -> bool {
    match c {
        '\n' | '\t' => !keep_lines,
        // Unicode's Cc: C0, DEL and C1 (U+009B is a one-byte CSI to some
        // terminals).
        c if c.is_control() => true,
        // The bidi controls of "Trojan Source" (CVE-2021-42574).
        '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' => true,
        _ => false,
    }
}

/// Pretty JSON of `v`, safe for a terminal and still the same JSON:
/// serde_json escapes C0 itself, and DEL, C1 and the bidi controls (which
/// can only occur inside strings) become `\uXXXX` escapes of the same
/// characters.
pub fn json(v: &impl serde::Serialize) -> serde_json::Result<String> {
    let text = serde_json::to_string_pretty(v)?;
    if !text.chars().any(|c| needs_escape(c, true)) {
        return Ok(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if needs_escape(c, true) {
            // All of them are in the Basic Multilingual Plane.
            let _ = write!(out, "\\u{:04x}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

/// Prints rows as aligned columns; every cell is passed through
/// [`printable`], so callers can put agent-supplied strings in as they are.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<Cow<'_, str>>> = rows
        .iter()
        .map(|row| row.iter().map(|c| printable(c)).collect())
        .collect();
    // Widths in chars: that is what `{:<w$}` pads to.
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (i, cell) in row.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(cell.chars().count());
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
    for row in &rows {
        out.push_str(&line(row.iter().map(|c| c.as_ref()).collect()));
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

/// YAML of a JSON value, as it goes into a file. For a terminal, pass it
/// through [`printable_lines`]: serde-saphyr writes control characters as
/// YAML escapes itself, but leaves the bidi controls (YAML counts them
/// printable) as they are.
pub fn yaml(v: &Json) -> String {
    serde_saphyr::to_string(v).unwrap_or_else(|e| format!("# cannot render YAML: {e}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a terminal would act on anything in `s`.
    fn has_controls(s: &str) -> bool {
        s.chars().any(|c| needs_escape(c, true))
    }

    #[test]
    fn plain_text_is_borrowed_unchanged() {
        for s in ["", "v1.2.3", "prod-eu", "naïve ünïcode 名前", "a\\x1b b"] {
            assert!(matches!(printable(s), Cow::Borrowed(t) if t == s));
        }
    }

    #[test]
    fn controls_are_escaped() {
        assert_eq!(
            printable("\u{1b}[2J\u{1b}]0;pwned\u{7}"),
            "\\x1b[2J\\x1b]0;pwned\\x07"
        );
        assert_eq!(printable("ok\rFAKE"), "ok\\rFAKE");
        assert_eq!(printable("a\nb\tc"), "a\\nb\\tc");
        assert_eq!(printable("\u{0}\u{7f}"), "\\x00\\x7f");
        // C1: U+009B is CSI, U+009D OSC.
        assert_eq!(printable("\u{9b}31m\u{9d}"), "\\x9b31m\\x9d");
        assert_eq!(printable("\u{85}"), "\\x85");
    }

    #[test]
    fn bidi_controls_are_escaped() {
        assert_eq!(printable("abc\u{202e}fed"), "abc\\u{202e}fed");
        for c in ('\u{202a}'..='\u{202e}').chain('\u{2066}'..='\u{2069}') {
            assert!(!has_controls(&printable(&c.to_string())), "{c:?}");
        }
        // Neighbours are ordinary text.
        assert_eq!(
            printable("\u{2029}\u{2065}\u{206a}"),
            "\u{2029}\u{2065}\u{206a}"
        );
    }

    #[test]
    fn multi_line_text_keeps_its_lines_but_not_cr_or_esc() {
        assert_eq!(
            printable_lines("line 1\n\tline 2\r\u{1b}[1A"),
            "line 1\n\tline 2\\r\\x1b[1A"
        );
    }

    #[test]
    fn table_cells_are_escaped_and_aligned() {
        let rows = vec![
            vec!["evil\u{1b}[31m".to_owned(), "x".to_owned()],
            vec!["名前".to_owned(), "y".to_owned()],
        ];
        let out = table(&["CLUSTER", "STATE"], &rows);
        assert!(!has_controls(&out), "{out}");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[1], "evil\\x1b[31m   x");
        // Widths count characters, not bytes.
        assert_eq!(
            lines[2],
            format!("{:<w$}   y", "名前", w = "evil\\x1b[31m".len())
        );
    }

    #[test]
    fn json_is_safe_and_still_the_same_json() {
        let v = serde_json::json!({
            "agentVersion": "1.0\u{1b}[2J\r\u{9b}\u{7f}\u{202e}",
            "ke\u{1b}y": "ok",
        });
        let text = json(&v).unwrap();
        assert!(
            !text.chars().any(|c| c != '\n' && needs_escape(c, false)),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<Json>(&text).unwrap(), v);
    }

    #[test]
    fn yaml_for_a_terminal_is_safe() {
        let v = serde_json::json!({
            "metadata": { "name": "p\u{1b}]0;x\u{7}" },
            "multi": "line 1\nline 2\r\u{1b}[1A\n",
            "c1": "\u{9b}31m",
            "bidi": "abc\u{202e}def",
            "ke\u{1b}y": 1,
        });
        let text = printable_lines(&yaml(&v)).into_owned();
        assert!(!has_controls(&text), "{text}");
        // What serde-saphyr escaped itself still reads back the same.
        let back: Json = serde_saphyr::from_str(&text).unwrap();
        assert_eq!(back["metadata"], v["metadata"]);
        assert_eq!(back["multi"], v["multi"]);
        assert_eq!(back["c1"], v["c1"]);
    }
}
