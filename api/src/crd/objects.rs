//! GpuClass objects read from a manifest file, as kerf-controller reads its default classes
//! (`--default-gpu-classes`, the ConfigMap kerf-default-gpu-classes the Helm chart renders).

use std::collections::BTreeSet;

use kube::Resource as _;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::gpuclass::GpuClass;

/// The GpuClasses in `text`, a YAML file of one or more documents (`---`) each holding one
/// GpuClass; `origin` names the file in errors. Documents that are empty are skipped.
///
/// # Errors
///
/// [`Error::InvalidConfig`] whose path names `origin`, the document (1-based) and the field:
/// YAML that does not parse, a document that is not a `gpu.kerf.dev/v1alpha1` GpuClass, a
/// missing `metadata.name`, a `metadata.namespace` (GpuClasses are cluster-scoped), a field
/// the GpuClass type does not have or whose value it cannot hold, or a name used twice.
pub fn parse_gpu_classes(origin: &str, text: &str) -> Result<Vec<GpuClass>> {
    let documents: Vec<Value> =
        serde_saphyr::from_multiple(text).map_err(|e| Error::InvalidConfig {
            path: origin.to_owned(),
            message: format!("invalid YAML: {e}"),
        })?;
    let mut names = BTreeSet::new();
    let mut classes = Vec::new();
    for (index, document) in documents.into_iter().enumerate() {
        if document.is_null() {
            continue;
        }
        let at = |field: &str, message: String| Error::InvalidConfig {
            path: format!("{origin}: document {}{field}", index + 1),
            message,
        };
        expect_string(&document, "apiVersion", &GpuClass::api_version(&()))
            .map_err(|m| at(".apiVersion", m))?;
        expect_string(&document, "kind", &GpuClass::kind(&())).map_err(|m| at(".kind", m))?;
        let class: GpuClass = serde_path_to_error::deserialize(&document).map_err(|e| {
            let field = e.path().to_string();
            let field = if field == "." {
                String::new()
            } else {
                format!(".{field}")
            };
            at(&field, e.into_inner().to_string())
        })?;
        // GpuClass's types ignore unknown fields (the API server prunes them); in a file an
        // admin wrote they are typos, which would otherwise vanish silently.
        let decoded = serde_json::to_value(&class).map_err(|e| Error::Serialize {
            what: "GpuClass",
            message: e.to_string(),
        })?;
        if let Some(field) = unknown_field(&document, &decoded, "") {
            return Err(at(&field, "is not a field of GpuClass".to_owned()));
        }
        let name = class.metadata.name.clone().unwrap_or_default();
        if name.is_empty() {
            return Err(at(".metadata.name", "is missing".to_owned()));
        }
        if let Some(namespace) = &class.metadata.namespace {
            return Err(at(
                ".metadata.namespace",
                format!("{namespace:?}: GpuClasses are cluster-scoped, leave it out"),
            ));
        }
        if !names.insert(name.clone()) {
            return Err(at(".metadata.name", format!("{name:?} is defined twice")));
        }
        classes.push(class);
    }
    Ok(classes)
}

/// The first field of `written` (not null) that decoding dropped, as `.a.b[2].c`.
fn unknown_field(written: &Value, decoded: &Value, path: &str) -> Option<String> {
    match (written, decoded) {
        (Value::Object(written), Value::Object(decoded)) => {
            written
                .iter()
                .find_map(|(key, value)| match decoded.get(key) {
                    Some(kept) => unknown_field(value, kept, &format!("{path}.{key}")),
                    None if value.is_null() => None,
                    None => Some(format!("{path}.{key}")),
                })
        }
        (Value::Array(written), Value::Array(decoded)) => written
            .iter()
            .zip(decoded)
            .enumerate()
            .find_map(|(i, (value, kept))| unknown_field(value, kept, &format!("{path}[{i}]"))),
        _ => None,
    }
}

fn expect_string(document: &Value, field: &str, expected: &str) -> Result<(), String> {
    match document.get(field) {
        Some(Value::String(value)) if value == expected => Ok(()),
        Some(value) => Err(format!("{value} is not {expected:?}")),
        None if document.is_object() => Err(format!("is missing; expected {expected:?}")),
        None => Err(format!(
            "the document is not an object but {document}; expected a GpuClass"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::Allocator;

    /// The chart's default install, whose ConfigMap kerf-default-gpu-classes holds the
    /// default classes.
    const INSTALL: &str = include_str!("../../../deploy/kerf.yaml");

    fn shipped_defaults() -> String {
        let documents: Vec<Value> = serde_saphyr::from_multiple(INSTALL).unwrap();
        let config_map = documents
            .iter()
            .find(|d| {
                d["kind"] == "ConfigMap" && d["metadata"]["name"] == "kerf-default-gpu-classes"
            })
            .unwrap();
        config_map["data"]["gpuclasses.yaml"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    fn error(text: &str) -> String {
        parse_gpu_classes("defaults.yaml", text)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn the_shipped_default_classes_parse() {
        let classes = parse_gpu_classes("gpuclasses.yaml", &shipped_defaults()).unwrap();
        let names: Vec<_> = classes
            .iter()
            .map(|c| c.metadata.name.as_deref().unwrap())
            .collect();
        assert_eq!(names, ["gpu.kerf.dev", "slice.gpu.kerf.dev"]);
        assert_eq!(classes[1].spec.allocator, Allocator::Controller);
    }

    #[test]
    fn bad_documents_name_the_file_document_and_field() {
        let head = "apiVersion: gpu.kerf.dev/v1alpha1\nkind: GpuClass\nmetadata:\n  name: a\n";
        let class = format!("{head}spec: {{}}\n");
        let cases = [
            ("a: [", "defaults.yaml: invalid YAML"),
            (
                "apiVersion: v1\nkind: GpuClass\n",
                "defaults.yaml: document 1.apiVersion",
            ),
            (
                &format!("{class}---\napiVersion: gpu.kerf.dev/v1alpha1\nkind: ConfigMap\n"),
                "defaults.yaml: document 2.kind",
            ),
            (
                &format!("{head}spec:\n  allocator: Sometimes\n"),
                "defaults.yaml: document 1.spec.allocator",
            ),
            (
                &format!("{head}spec:\n  slicing:\n    defaultCompute: 300\n"),
                "defaults.yaml: document 1.spec.slicing.defaultCompute",
            ),
            (
                &format!("{head}spec:\n  colour: blue\n"),
                "defaults.yaml: document 1.spec.colour: is not a field of GpuClass",
            ),
            (
                "apiVersion: gpu.kerf.dev/v1alpha1\nkind: GpuClass\nmetadata: {}\nspec: {}\n",
                "defaults.yaml: document 1.metadata.name",
            ),
            (
                &format!("{head}  namespace: x\nspec: {{}}\n"),
                "defaults.yaml: document 1.metadata.namespace",
            ),
            (
                &format!("{class}---\n{class}"),
                "defaults.yaml: document 2.metadata.name: \"a\" is defined twice",
            ),
        ];
        for (text, expected) in cases {
            let message = error(text);
            assert!(message.starts_with(expected), "{text:?}: {message}");
        }
        assert!(error("a: [").contains("invalid YAML"));
        assert!(error(&format!("{head}spec:\n  colour: blue\n")).contains("colour"));
    }

    #[test]
    fn empty_documents_are_skipped() {
        assert_eq!(parse_gpu_classes("f", "").unwrap(), []);
        let classes = parse_gpu_classes(
            "f",
            "---\napiVersion: gpu.kerf.dev/v1alpha1\nkind: GpuClass\nmetadata:\n  name: a\nspec: {}\n---\n",
        )
        .unwrap();
        assert_eq!(classes.len(), 1);
    }
}
