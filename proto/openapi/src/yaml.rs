//! An ordered document tree, written as YAML by serde-saphyr.
//!
//! The OpenAPI document is built as a [`Node`] tree whose maps keep insertion
//! order, so the emitted YAML is byte-for-byte stable and reads in a sensible
//! order (no dependency on a map type's ordering features). The tree
//! serializes as the JSON-compatible value it is; the YAML library decides
//! quoting, and writes multi-line text as literal blocks.

use serde::ser::{Serialize, SerializeMap, Serializer};
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
        serde_saphyr::to_string(self).expect("a tree of strings, numbers and maps is YAML")
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

/// Maps in their order; scalars and sequences as the JSON they are.
impl Serialize for Node {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Node::Bool(b) => s.serialize_bool(*b),
            Node::Int(i) => s.serialize_i64(*i),
            Node::Str(v) => s.serialize_str(v),
            Node::Seq(items) => s.collect_seq(items),
            Node::Map(entries) => {
                let mut map = s.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_yaml_reads_back_as_the_same_document_in_the_same_order() {
        let doc = Node::map()
            .with("openapi", "3.1.0")
            .with("true", "no")
            .with("zeta", 1i64)
            .with(
                "alpha",
                Node::Seq(vec!["200".into(), "a: b".into(), "x\n\ny".into()]),
            )
            .with("empty", Node::map())
            .with("flag", true);
        let yaml = doc.to_yaml();
        let back: Json = serde_saphyr::from_str(&yaml).unwrap();
        assert_eq!(back, doc.to_json(), "{yaml}");
        let keys: Vec<&str> = yaml
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with([' ', '-']))
            .filter_map(|l| l.split(':').next())
            .collect();
        assert_eq!(
            keys,
            ["openapi", "\"true\"", "zeta", "alpha", "empty", "flag"],
            "{yaml}"
        );
    }
}
