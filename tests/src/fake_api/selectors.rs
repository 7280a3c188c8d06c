//! Field and label selectors of LIST, WATCH and DELETECOLLECTION.

use bytes::Bytes;
use serde_json::Value;

use super::routing::{ParsedPath, Query};
use super::watch::object_event_line;
use super::{ApiError, ApiResult, Change, ChangeKind, ObjKey};

/// One field-selector term.
#[derive(Debug, Clone)]
struct FieldTerm {
    path: String,
    value: String,
    negate: bool,
}

/// One label-selector requirement.
#[derive(Debug, Clone)]
pub(super) enum LabelTerm {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// Which objects a LIST or WATCH selects.
#[derive(Debug, Clone)]
pub(super) struct Filter {
    pub(super) prefix: String,
    resource: String,
    namespace: Option<String>,
    fields: Vec<FieldTerm>,
    labels: Vec<LabelTerm>,
}

impl Filter {
    pub(super) fn new(path: &ParsedPath, query: &Query) -> ApiResult<Self> {
        Ok(Self {
            prefix: path.prefix.clone(),
            resource: path.resource.clone(),
            namespace: path.namespace.clone(),
            fields: parse_field_selector(query.get("fieldSelector").unwrap_or(""))?,
            labels: parse_label_selector(query.get("labelSelector").unwrap_or(""))?,
        })
    }

    fn in_collection(&self, key: &ObjKey) -> bool {
        key.prefix == self.prefix
            && key.resource == self.resource
            && self
                .namespace
                .as_ref()
                .is_none_or(|ns| *ns == key.namespace)
    }

    pub(super) fn matches(&self, key: &ObjKey, obj: &Value) -> bool {
        self.in_collection(key) && self.selects(obj)
    }

    pub(super) fn selects(&self, obj: &Value) -> bool {
        self.fields
            .iter()
            .all(|t| (field_value(obj, &t.path) == t.value) != t.negate)
            && self.labels.iter().all(|t| label_term_matches(t, obj))
    }

    /// The watch event line a change produces for this watch, if any. An object that starts
    /// or stops matching the selectors is reported as added or deleted, as the API server does.
    pub(super) fn render(&self, change: &Change) -> Option<Bytes> {
        if !self.in_collection(&change.key) {
            return None;
        }
        let now = self.selects(&change.new);
        let before = change.old.as_ref().is_some_and(|old| self.selects(old));
        let event = match (change.kind, before, now) {
            (ChangeKind::Modified, true, true) => "MODIFIED",
            (ChangeKind::Added | ChangeKind::Modified, _, true) => "ADDED",
            (ChangeKind::Modified, true, false) | (ChangeKind::Deleted, _, true) => "DELETED",
            _ => return None,
        };
        let object = match &change.raw {
            Some(raw) => raw.render(&change.new),
            None => serde_json::to_vec(&change.new).unwrap_or_default(),
        };
        Some(object_event_line(event, &object))
    }
}

fn parse_field_selector(raw: &str) -> ApiResult<Vec<FieldTerm>> {
    raw.split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|term| {
            let (path, value, negate) = if let Some((p, v)) = term.split_once("!=") {
                (p, v, true)
            } else if let Some((p, v)) = term.split_once("==") {
                (p, v, false)
            } else if let Some((p, v)) = term.split_once('=') {
                (p, v, false)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid field selector term {term:?}"
                )));
            };
            Ok(FieldTerm {
                path: path.trim().to_owned(),
                value: value.trim().to_owned(),
                negate,
            })
        })
        .collect()
}

/// Splits a label selector at the commas that are not inside a `(…)` value set.
fn split_selector_terms(raw: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in raw.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(&raw[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&raw[start..]);
    terms
        .into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

pub(super) fn parse_label_selector(raw: &str) -> ApiResult<Vec<LabelTerm>> {
    split_selector_terms(raw)
        .into_iter()
        .map(parse_label_term)
        .collect()
}

fn parse_label_term(term: &str) -> ApiResult<LabelTerm> {
    let set = |rest: &str| -> ApiResult<Vec<String>> {
        let inner = rest
            .trim()
            .strip_prefix('(')
            .and_then(|r| r.strip_suffix(')'))
            .ok_or_else(|| {
                ApiError::bad_request(format!("invalid label selector term {term:?}"))
            })?;
        Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
    };
    if let Some(key) = term.strip_prefix('!') {
        return Ok(LabelTerm::NotExists(key.trim().to_owned()));
    }
    if let Some((k, v)) = term.split_once("!=") {
        return Ok(LabelTerm::NotEquals(
            k.trim().to_owned(),
            v.trim().to_owned(),
        ));
    }
    if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(LabelTerm::Equals(k.trim().to_owned(), v.trim().to_owned()));
    }
    if let Some((k, rest)) = term.split_once(" notin ") {
        return Ok(LabelTerm::NotIn(k.trim().to_owned(), set(rest)?));
    }
    if let Some((k, rest)) = term.split_once(" in ") {
        return Ok(LabelTerm::In(k.trim().to_owned(), set(rest)?));
    }
    if term
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
    {
        return Ok(LabelTerm::Exists(term.to_owned()));
    }
    Err(ApiError::bad_request(format!(
        "invalid label selector term {term:?}"
    )))
}

pub(super) fn label_term_matches(term: &LabelTerm, obj: &Value) -> bool {
    let labels = obj.pointer("/metadata/labels").and_then(Value::as_object);
    let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    match term {
        LabelTerm::Equals(k, v) => label(k) == Some(v.as_str()),
        LabelTerm::NotEquals(k, v) => label(k) != Some(v.as_str()),
        LabelTerm::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
        LabelTerm::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
        LabelTerm::Exists(k) => label(k).is_some(),
        LabelTerm::NotExists(k) => label(k).is_none(),
    }
}

/// The value of a dotted field path as a field selector compares it (missing: empty).
fn field_value(obj: &Value, path: &str) -> String {
    let mut current = obj;
    for part in path.split('.') {
        match current.get(part) {
            Some(next) => current = next,
            None => return String::new(),
        }
    }
    match current {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}
