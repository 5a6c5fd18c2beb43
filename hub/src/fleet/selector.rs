//! Link labels and the Kubernetes label-selector language over them
//! (`env=prod,region in (eu,us),!legacy`), with Kubernetes' syntax rules
//! for keys and values, so a selector that works with kubectl works here.

use std::collections::BTreeMap;

/// Labels one link may carry.
pub const MAX_LABELS: usize = 32;
/// Most bytes of keys and values one link's labels hold together (they
/// travel in manifest URLs).
pub const MAX_LABEL_BYTES: usize = 1024;
/// Longest selector accepted.
pub const MAX_SELECTOR_LEN: usize = 4096;
/// Most requirements (comma-separated terms) in one selector.
const MAX_REQUIREMENTS: usize = 64;

/// Why a label or a selector was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("label key {0:?} is not valid: {1}")]
    Key(String, &'static str),
    #[error("label value {0:?} is not valid: {1}")]
    Value(String, &'static str),
    #[error("a link carries at most {MAX_LABELS} labels of {MAX_LABEL_BYTES} bytes in all")]
    TooMany,
    #[error("link selector: {0}")]
    Selector(String),
}

/// A name part (the key after its optional prefix, or a value): at most 63
/// characters, alphanumeric at both ends, `-`, `_`, `.` inside.
fn name_part(s: &str) -> Result<(), &'static str> {
    if s.is_empty() {
        return Err("must not be empty");
    }
    if s.len() > 63 {
        return Err("must be at most 63 characters");
    }
    let ok_inner = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if !s.chars().all(ok_inner) {
        return Err("may hold only letters, digits, '-', '_' and '.'");
    }
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if !edge(s.chars().next()) || !edge(s.chars().last()) {
        return Err("must begin and end with a letter or digit");
    }
    Ok(())
}

/// A key's prefix: a DNS subdomain (lower-case, at most 253 characters).
fn prefix_part(s: &str) -> Result<(), &'static str> {
    if s.is_empty() || s.len() > 253 {
        return Err("its prefix must be a DNS subdomain of 1 to 253 characters");
    }
    let ok = s.split('.').all(|label| {
        !label.is_empty()
            && label.len() <= 63
            && label
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    });
    if !ok {
        return Err("its prefix must be a lower-case DNS subdomain");
    }
    Ok(())
}

/// Checks a label key: `[prefix/]name`.
pub fn validate_key(key: &str) -> Result<(), LabelError> {
    let bad = |why| LabelError::Key(truncated(key), why);
    match key.split_once('/') {
        Some((prefix, name)) => {
            prefix_part(prefix).map_err(bad)?;
            name_part(name).map_err(bad)
        }
        None => name_part(key).map_err(bad),
    }
}

/// Checks a label value: empty, or a name part.
pub fn validate_value(value: &str) -> Result<(), LabelError> {
    if value.is_empty() {
        return Ok(());
    }
    name_part(value).map_err(|why| LabelError::Value(truncated(value), why))
}

/// Checks a whole label set.
pub fn validate(labels: &BTreeMap<String, String>) -> Result<(), LabelError> {
    let bytes: usize = labels.iter().map(|(k, v)| k.len() + v.len()).sum();
    if labels.len() > MAX_LABELS || bytes > MAX_LABEL_BYTES {
        return Err(LabelError::TooMany);
    }
    for (k, v) in labels {
        validate_key(k)?;
        validate_value(v)?;
    }
    Ok(())
}

/// At most 80 characters of what a peer sent, for an error message.
fn truncated(s: &str) -> String {
    s.chars().take(80).collect()
}

/// One term of a selector.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Exists(String),
    Absent(String),
    /// `key in (values)`; `key=value` is `In` with one value.
    In(String, Vec<String>),
    /// `key notin (values)`; `key!=value` is `NotIn` with one value. Like
    /// Kubernetes, a link without the key matches.
    NotIn(String, Vec<String>),
}

impl Requirement {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::Absent(k) => !labels.contains_key(k),
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
        }
    }
}

/// A parsed label selector; the empty one matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Word(String),
    Eq,
    NotEq,
    Bang,
    Open,
    Close,
    Comma,
}

fn tokenize(s: &str) -> Result<Vec<Token>, LabelError> {
    let mut tokens = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            c if c.is_whitespace() => {
                chars.next();
            }
            '=' => {
                chars.next();
                if chars.peek() == Some(&'=') {
                    chars.next();
                }
                tokens.push(Token::Eq);
            }
            '!' => {
                chars.next();
                if chars.peek() == Some(&'=') {
                    chars.next();
                    tokens.push(Token::NotEq);
                } else {
                    tokens.push(Token::Bang);
                }
            }
            '(' | ')' | ',' => {
                chars.next();
                tokens.push(match c {
                    '(' => Token::Open,
                    ')' => Token::Close,
                    _ => Token::Comma,
                });
            }
            c if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/') => {
                let mut word = String::new();
                while let Some(&c) = chars.peek() {
                    if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/') {
                        word.push(c);
                        chars.next();
                    } else {
                        break;
                    }
                }
                tokens.push(Token::Word(word));
            }
            other => {
                return Err(LabelError::Selector(format!(
                    "unexpected character {other:?} (operators: =, ==, !=, in, notin, !)"
                )));
            }
        }
    }
    Ok(tokens)
}

impl Selector {
    /// Parses Kubernetes' label-selector syntax.
    pub fn parse(s: &str) -> Result<Self, LabelError> {
        if s.len() > MAX_SELECTOR_LEN {
            return Err(LabelError::Selector(format!(
                "longer than {MAX_SELECTOR_LEN} bytes"
            )));
        }
        let tokens = tokenize(s)?;
        let mut parser = Parser {
            tokens: &tokens,
            at: 0,
        };
        let mut requirements = Vec::new();
        if tokens.is_empty() {
            return Ok(Selector { requirements });
        }
        loop {
            requirements.push(parser.requirement()?);
            if requirements.len() > MAX_REQUIREMENTS {
                return Err(LabelError::Selector(format!(
                    "more than {MAX_REQUIREMENTS} requirements"
                )));
            }
            match parser.next() {
                None => break,
                Some(Token::Comma) => continue,
                Some(t) => return Err(parser.unexpected(Some(&t), "',' or the end")),
            }
        }
        Ok(Selector { requirements })
    }

    /// Whether a link with `labels` is selected.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }
}

struct Parser<'a> {
    tokens: &'a [Token],
    at: usize,
}

impl Parser<'_> {
    fn next(&mut self) -> Option<Token> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t
    }

    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    fn unexpected(&self, got: Option<&Token>, wanted: &str) -> LabelError {
        let got = match got {
            None => "the end".to_owned(),
            Some(Token::Word(w)) => format!("{:?}", truncated(w)),
            Some(t) => format!("{t:?}"),
        };
        LabelError::Selector(format!("expected {wanted}, found {got}"))
    }

    fn key(&mut self) -> Result<String, LabelError> {
        match self.next() {
            Some(Token::Word(k)) => {
                validate_key(&k).map_err(|e| LabelError::Selector(e.to_string()))?;
                Ok(k)
            }
            other => Err(self.unexpected(other.as_ref(), "a label key")),
        }
    }

    fn value(&mut self) -> Result<String, LabelError> {
        // `key=` (an empty value) is allowed, as in Kubernetes.
        let Some(Token::Word(v)) = self.peek() else {
            return Ok(String::new());
        };
        let v = v.clone();
        self.at += 1;
        validate_value(&v).map_err(|e| LabelError::Selector(e.to_string()))?;
        Ok(v)
    }

    fn values(&mut self) -> Result<Vec<String>, LabelError> {
        match self.next() {
            Some(Token::Open) => {}
            other => return Err(self.unexpected(other.as_ref(), "'('")),
        }
        let mut values = vec![self.value()?];
        loop {
            match self.next() {
                Some(Token::Comma) => values.push(self.value()?),
                Some(Token::Close) => return Ok(values),
                other => return Err(self.unexpected(other.as_ref(), "',' or ')'")),
            }
        }
    }

    fn requirement(&mut self) -> Result<Requirement, LabelError> {
        if self.peek() == Some(&Token::Bang) {
            self.next();
            return Ok(Requirement::Absent(self.key()?));
        }
        let key = self.key()?;
        match self.peek() {
            None | Some(Token::Comma) => Ok(Requirement::Exists(key)),
            Some(Token::Eq) => {
                self.next();
                Ok(Requirement::In(key, vec![self.value()?]))
            }
            Some(Token::NotEq) => {
                self.next();
                Ok(Requirement::NotIn(key, vec![self.value()?]))
            }
            Some(Token::Word(w)) if w == "in" => {
                self.next();
                Ok(Requirement::In(key, self.values()?))
            }
            Some(Token::Word(w)) if w == "notin" => {
                self.next();
                Ok(Requirement::NotIn(key, self.values()?))
            }
            other => {
                let other = other.cloned();
                Err(self.unexpected(other.as_ref(), "=, ==, !=, in or notin"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn selects_as_kubernetes_does() {
        let prod_eu = labels(&[("env", "prod"), ("region", "eu")]);
        let dev_us = labels(&[("env", "dev"), ("region", "us"), ("legacy", "")]);
        let bare = labels(&[]);
        let cases: &[(&str, [bool; 3])] = &[
            ("", [true, true, true]),
            ("env=prod", [true, false, false]),
            ("env==prod", [true, false, false]),
            ("env!=prod", [false, true, true]),
            ("region in (eu, us)", [true, true, false]),
            ("region notin (eu)", [false, true, true]),
            ("legacy", [false, true, false]),
            ("!legacy", [true, false, true]),
            ("env=prod,region in (eu,us),!legacy", [true, false, false]),
            ("legacy=", [false, true, false]),
            ("  env = dev ,  region=us ", [false, true, false]),
        ];
        for (text, want) in cases {
            let s = Selector::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            let got = [s.matches(&prod_eu), s.matches(&dev_us), s.matches(&bare)];
            assert_eq!(&got, want, "{text}");
        }
    }

    #[test]
    fn refuses_what_kubernetes_refuses() {
        for bad in [
            "=prod",
            "env in eu",
            "env in (eu",
            "env prod",
            "env=prod,",
            "env>1",
            "-env=prod",
            "env=prod-",
            "Example.COM/env=prod",
            "env=a/b",
            "!",
        ] {
            assert!(
                matches!(Selector::parse(bad), Err(LabelError::Selector(_))),
                "{bad} should be refused"
            );
        }
        let long = "a=b,".repeat(MAX_SELECTOR_LEN / 4 + 1);
        assert!(Selector::parse(&long).is_err());
        let many = vec!["a=b"; MAX_REQUIREMENTS + 1].join(",");
        assert!(Selector::parse(&many).is_err());
    }

    #[test]
    fn keys_and_values_follow_kubernetes_syntax() {
        for good in ["env", "example.com/env", "a", "A_b.c-d", &"x".repeat(63)] {
            validate_key(good).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
        for bad in [
            "",
            "-a",
            "a-",
            "a b",
            "Example.com/a",
            "/a",
            "a/",
            &"x".repeat(64),
        ] {
            assert!(validate_key(bad).is_err(), "{bad:?}");
        }
        validate_value("").unwrap();
        validate_value("prod-1").unwrap();
        assert!(validate_value("a/b").is_err());
        let too_many: BTreeMap<_, _> = (0..=MAX_LABELS)
            .map(|i| (format!("k{i}"), String::new()))
            .collect();
        assert_eq!(validate(&too_many), Err(LabelError::TooMany));
    }
}
