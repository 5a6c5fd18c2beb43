//! An ordered document tree and a small YAML emitter for it.
//!
//! The OpenAPI document is built as a [`Node`] tree whose maps keep insertion
//! order, so the emitted YAML is byte-for-byte stable and reads in a sensible
//! order (no dependency on a map type's ordering features). The emitter only
//! needs what the document uses: block mappings and sequences, plain scalars
//! where they cannot be mistaken for another type, literal blocks for
//! multi-line text and JSON-style double quotes for everything else (a JSON
//! string is a valid YAML double-quoted scalar).

use serde_json::Value as Json;

/// A JSON-compatible value whose maps keep insertion order.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    Bool(bool),
    Int(i64),
    Str(String),
    Seq(Vec<Node>),
    Map(Vec<(String, Node)>),
}

impl Node {
    /// An empty map.
    pub fn map() -> Node {
        Node::Map(Vec::new())
    }

    /// Appends `key: value` to a map (replacing an existing key in place).
    ///
    /// # Panics
    /// When `self` is not a map: a bug in the caller.
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<Node>) -> &mut Self {
        let Node::Map(entries) = self else {
            panic!("set on a non-map node")
        };
        let key = key.into();
        let value = value.into();
        match entries.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => entries.push((key, value)),
        }
        self
    }

    /// Builder form of [`Node::set`].
    pub fn with(mut self, key: impl Into<String>, value: impl Into<Node>) -> Self {
        self.set(key, value);
        self
    }

    /// The value under `key` of a map.
    pub fn get(&self, key: &str) -> Option<&Node> {
        match self {
            Node::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The same value as `serde_json` data (for validation and tests).
    pub fn to_json(&self) -> Json {
        match self {
            Node::Bool(b) => Json::Bool(*b),
            Node::Int(i) => Json::from(*i),
            Node::Str(s) => Json::String(s.clone()),
            Node::Seq(items) => Json::Array(items.iter().map(Node::to_json).collect()),
            Node::Map(entries) => Json::Object(
                entries
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_json()))
                    .collect(),
            ),
        }
    }

    /// The YAML text of this node as a document, ending in a newline.
    pub fn to_yaml(&self) -> String {
        let mut out = String::new();
        match self {
            Node::Map(entries) if !entries.is_empty() => write_map(entries, 0, &mut out),
            Node::Seq(items) if !items.is_empty() => write_seq(items, 0, &mut out),
            scalar => {
                out.push_str(&inline(scalar, 0));
                out.push('\n');
            }
        }
        out
    }
}

impl From<&str> for Node {
    fn from(s: &str) -> Self {
        Node::Str(s.to_owned())
    }
}

impl From<String> for Node {
    fn from(s: String) -> Self {
        Node::Str(s)
    }
}

impl From<bool> for Node {
    fn from(b: bool) -> Self {
        Node::Bool(b)
    }
}

impl From<i64> for Node {
    fn from(i: i64) -> Self {
        Node::Int(i)
    }
}

impl From<Vec<Node>> for Node {
    fn from(items: Vec<Node>) -> Self {
        Node::Seq(items)
    }
}

fn pad(out: &mut String, indent: usize) {
    out.extend(std::iter::repeat_n(' ', indent));
}

fn write_map(entries: &[(String, Node)], indent: usize, out: &mut String) {
    for (key, value) in entries {
        pad(out, indent);
        out.push_str(&scalar_str(key, indent));
        out.push(':');
        write_value(value, indent, out);
    }
}

fn write_seq(items: &[Node], indent: usize, out: &mut String) {
    for item in items {
        match item {
            // A nested collection is written one level deeper, then its
            // first indentation is replaced by the dash.
            Node::Map(entries) if !entries.is_empty() => {
                let mut inner = String::new();
                write_map(entries, indent + 2, &mut inner);
                pad(out, indent);
                out.push_str("- ");
                out.push_str(&inner[indent + 2..]);
            }
            Node::Seq(nested) if !nested.is_empty() => {
                let mut inner = String::new();
                write_seq(nested, indent + 2, &mut inner);
                pad(out, indent);
                out.push_str("- ");
                out.push_str(&inner[indent + 2..]);
            }
            scalar => {
                pad(out, indent);
                out.push_str("- ");
                out.push_str(&inline(scalar, indent + 2));
                out.push('\n');
            }
        }
    }
}

/// Writes what follows `key:` (the colon is already written).
fn write_value(value: &Node, indent: usize, out: &mut String) {
    match value {
        Node::Map(entries) if !entries.is_empty() => {
            out.push('\n');
            write_map(entries, indent + 2, out);
        }
        Node::Seq(items) if !items.is_empty() => {
            out.push('\n');
            write_seq(items, indent + 2, out);
        }
        scalar => {
            out.push(' ');
            out.push_str(&inline(scalar, indent + 2));
            out.push('\n');
        }
    }
}

/// A scalar or an empty collection on one line (a literal block spans more).
fn inline(node: &Node, indent: usize) -> String {
    match node {
        Node::Bool(b) => b.to_string(),
        Node::Int(i) => i.to_string(),
        Node::Str(s) => scalar_str(s, indent),
        Node::Seq(_) => "[]".to_owned(),
        Node::Map(_) => "{}".to_owned(),
    }
}

/// Words a plain scalar must not be: YAML 1.1 and 1.2 read them as booleans
/// or null.
const RESERVED: &[&str] = &[
    "true", "false", "null", "yes", "no", "on", "off", "y", "n", "~",
];

fn is_plain_safe(s: &str) -> bool {
    let mut chars = s.chars();
    let Some(first) = chars.next() else {
        return false;
    };
    (first.is_ascii_alphabetic() || matches!(first, '_' | '$' | '/'))
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '$' | '/' | '.' | '-'))
        && !RESERVED.contains(&s.to_ascii_lowercase().as_str())
}

/// A literal block keeps multi-line text readable; only text that it renders
/// exactly qualifies.
fn is_literal_safe(s: &str) -> bool {
    s.contains('\n')
        && !s.ends_with('\n')
        && !s.starts_with([' ', '\n'])
        && s.lines()
            .all(|l| !l.ends_with([' ', '\t']) && !l.chars().any(|c| c.is_control()))
}

fn scalar_str(s: &str, indent: usize) -> String {
    if is_plain_safe(s) {
        return s.to_owned();
    }
    if is_literal_safe(s) {
        let mut out = String::from("|-");
        for line in s.split('\n') {
            out.push('\n');
            if !line.is_empty() {
                pad(&mut out, indent);
                out.push_str(line);
            }
        }
        return out;
    }
    serde_json::to_string(s).expect("a string serialises to JSON")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_that_look_like_other_types_are_quoted() {
        for s in [
            "true", "No", "null", "200", "1.5", "", "#/x", "a: b", "- x", "x #y",
        ] {
            assert_eq!(scalar_str(s, 0), serde_json::to_string(s).unwrap(), "{s}");
        }
        for s in ["object", "$ref", "/a.b.C/D", "int64", "date-time"] {
            assert_eq!(scalar_str(s, 0), s);
        }
    }

    #[test]
    fn multi_line_text_becomes_a_literal_block_only_when_exact() {
        assert_eq!(scalar_str("a\n\nb", 2), "|-\n  a\n\n  b");
        // Trailing newline, leading space, trailing space: quoted instead.
        for s in ["a\nb\n", " a\nb", "a \nb"] {
            assert!(scalar_str(s, 0).starts_with('"'), "{s:?}");
        }
    }
}
