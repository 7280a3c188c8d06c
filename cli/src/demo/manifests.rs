//! Loading the demo's Kubernetes manifests: multi-document YAML files, decoded as strictly as
//! the API server does with `kubectl`'s default strict field validation (an unknown field is
//! an error naming it, a wrong type an error naming its path).

use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceClaimTemplate};
use kerf_api::GpuClass;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{Error, Result};

/// The example manifests compiled into the binary: `(folder, file name, content)`, with folder
/// `admin` or `claims`, in load order.
pub const EMBEDDED_EXAMPLES: &[(&str, &str, &str)] =
    include!(concat!(env!("OUT_DIR"), "/embedded_examples.rs"));

/// The chart's default install, `deploy/kerf.yaml`, embedded at build time: its ConfigMap
/// kerf-default-gpu-classes holds the default GpuClasses, which every cluster with kerf has
/// and so every demo run loads first.
const INSTALL: &str = include_str!("../../../deploy/kerf.yaml");

/// The ConfigMap of [`INSTALL`] that holds the default classes.
const DEFAULT_CLASSES_CONFIG_MAP: &str = "kerf-default-gpu-classes";

/// Where the default classes come from, as the origin of their documents.
pub const DEFAULT_CLASSES_ORIGIN: &str = "deploy/kerf.yaml#kerf-default-gpu-classes";

/// The default GpuClasses as kerf-controller gets them from the chart's default install: the
/// `gpuclasses.yaml` of its ConfigMap kerf-default-gpu-classes, a YAML stream of GpuClasses.
///
/// # Errors
/// [`Error::Config`] when the embedded install does not parse or lacks that entry.
pub fn default_classes() -> Result<String> {
    let documents: Vec<Value> = serde_saphyr::from_multiple(INSTALL)
        .map_err(|e| Error::Config(format!("deploy/kerf.yaml: invalid YAML: {e}")))?;
    documents
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == DEFAULT_CLASSES_CONFIG_MAP)
        .and_then(|d| d["data"]["gpuclasses.yaml"].as_str())
        .map(str::to_owned)
        .ok_or_else(|| {
            Error::Config(format!(
                "deploy/kerf.yaml: no ConfigMap {DEFAULT_CLASSES_CONFIG_MAP} with gpuclasses.yaml"
            ))
        })
}

/// Where a set of manifests comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManifestSource {
    /// The default GpuClasses ([`default_classes`]).
    DefaultClasses,
    /// The files of `examples/<folder>` embedded at build time.
    Embedded(&'static str),
    /// Every `*.yaml` / `*.yml` file of a directory, in name order.
    Dir(PathBuf),
}

/// One YAML document and where it was read.
#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    /// `file#index` (index from 1), e.g. `claims/slice.yaml#2`.
    pub origin: String,
    /// The document as JSON.
    pub value: Value,
}

/// A decoded object and where it was read.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed<T> {
    /// `file#index`.
    pub origin: String,
    /// The object.
    pub object: T,
}

/// A document that did not decode: the API server would have refused it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    /// `file#index`, or the file alone when the file is not valid YAML.
    pub origin: String,
    /// Its `kind`, when readable.
    pub kind: String,
    /// Its `metadata.namespace`, when set.
    pub namespace: Option<String>,
    /// Its `metadata.name`, when readable.
    pub name: String,
    /// Why it was refused, naming the field.
    pub error: String,
}

/// The objects the demo models, by kind, in load order.
#[derive(Debug, Clone, Default)]
pub struct Manifests {
    /// `GpuClass` objects.
    pub gpu_classes: Vec<Parsed<GpuClass>>,
    /// Hand-written `DeviceClass` objects.
    pub device_classes: Vec<Parsed<DeviceClass>>,
    /// `ResourceClaim` objects.
    pub claims: Vec<Parsed<ResourceClaim>>,
    /// `ResourceClaimTemplate` objects.
    pub templates: Vec<Parsed<ResourceClaimTemplate>>,
    /// `Pod` objects.
    pub pods: Vec<Parsed<Pod>>,
    /// `Deployment` objects.
    pub deployments: Vec<Parsed<Deployment>>,
    /// Objects of kinds the demo does not model, as `Kind/name (origin)`.
    pub ignored: Vec<String>,
    /// Documents that did not decode.
    pub invalid: Vec<Invalid>,
}

/// Reads the documents of `source`.
///
/// # Errors
/// A directory or file cannot be read. A file that is not valid YAML is not an error: it is
/// returned as an [`Invalid`] entry in the second list.
pub fn read_source(source: &ManifestSource) -> Result<(Vec<Document>, Vec<Invalid>)> {
    let mut documents = Vec::new();
    let mut invalid = Vec::new();
    let files: Vec<(String, String)> = match source {
        ManifestSource::DefaultClasses => {
            vec![(DEFAULT_CLASSES_ORIGIN.to_owned(), default_classes()?)]
        }
        ManifestSource::Embedded(folder) => EMBEDDED_EXAMPLES
            .iter()
            .filter(|(f, _, _)| f == folder)
            .map(|(f, name, text)| (format!("examples/{f}/{name}"), (*text).to_owned()))
            .collect(),
        ManifestSource::Dir(dir) => read_dir(dir)?,
    };
    for (origin, text) in files {
        match parse_documents(&text, &origin) {
            Ok(docs) => documents.extend(docs),
            Err(error) => invalid.push(Invalid {
                origin,
                kind: String::new(),
                namespace: None,
                name: String::new(),
                error,
            }),
        }
    }
    Ok((documents, invalid))
}

/// The manifests of every source, in order.
///
/// # Errors
/// As [`read_source`].
pub fn load(sources: &[ManifestSource]) -> Result<Manifests> {
    let mut manifests = Manifests::default();
    for source in sources {
        let (documents, invalid) = read_source(source)?;
        manifests.invalid.extend(invalid);
        for document in documents {
            manifests.add(document);
        }
    }
    Ok(manifests)
}

/// True when `source` holds at least one file.
pub fn is_empty(source: &ManifestSource) -> bool {
    match source {
        ManifestSource::DefaultClasses => {
            default_classes().map_or(true, |classes| classes.trim().is_empty())
        }
        ManifestSource::Embedded(folder) => !EMBEDDED_EXAMPLES.iter().any(|(f, _, _)| f == folder),
        ManifestSource::Dir(dir) => read_dir(dir).map_or(true, |files| files.is_empty()),
    }
}

fn read_dir(dir: &Path) -> Result<Vec<(String, String)>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("read directory", dir, e))?;
    let mut paths = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|e| Error::io("read directory", dir, e))?
            .path();
        let yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
        if yaml && path.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).map_err(|e| Error::io("read", &path, e))?;
            Ok((path.display().to_string(), text))
        })
        .collect()
}

/// Splits a multi-document YAML text into JSON documents; empty documents are skipped.
///
/// # Errors
/// The text is not valid YAML (the message says where).
pub fn parse_documents(text: &str, origin: &str) -> Result<Vec<Document>, String> {
    let values: Vec<Value> =
        serde_saphyr::from_multiple(text).map_err(|e| format!("{origin}: invalid YAML: {e}"))?;
    Ok(values
        .into_iter()
        .filter(|v| !v.is_null())
        .enumerate()
        .map(|(i, value)| Document {
            origin: format!("{origin}#{}", i + 1),
            value,
        })
        .collect())
}

impl Manifests {
    /// Decodes one document into its kind's list, or records why it cannot be.
    pub fn add(&mut self, document: Document) {
        let Document { origin, value } = document;
        let kind = string_at(&value, &["kind"]).unwrap_or_default();
        let api_version = string_at(&value, &["apiVersion"]).unwrap_or_default();
        match (api_version.as_str(), kind.as_str()) {
            (kerf_api::API_VERSION, "GpuClass") => {
                push(&mut self.gpu_classes, &mut self.invalid, origin, &value);
            }
            ("resource.k8s.io/v1", "DeviceClass") => {
                push(&mut self.device_classes, &mut self.invalid, origin, &value);
            }
            ("resource.k8s.io/v1", "ResourceClaim") => {
                push(&mut self.claims, &mut self.invalid, origin, &value);
            }
            ("resource.k8s.io/v1", "ResourceClaimTemplate") => {
                push(&mut self.templates, &mut self.invalid, origin, &value);
            }
            ("v1", "Pod") => push(&mut self.pods, &mut self.invalid, origin, &value),
            ("apps/v1", "Deployment") => {
                push(&mut self.deployments, &mut self.invalid, origin, &value);
            }
            _ => {
                let name = string_at(&value, &["metadata", "name"]).unwrap_or_default();
                self.ignored
                    .push(format!("{api_version} {kind}/{name} ({origin})"));
            }
        }
    }
}

fn push<T: DeserializeOwned + serde::Serialize>(
    list: &mut Vec<Parsed<T>>,
    invalid: &mut Vec<Invalid>,
    origin: String,
    value: &Value,
) {
    match decode_strict::<T>(value) {
        Ok(object) => list.push(Parsed { origin, object }),
        Err(error) => invalid.push(Invalid {
            origin,
            kind: string_at(value, &["kind"]).unwrap_or_default(),
            namespace: string_at(value, &["metadata", "namespace"]),
            name: string_at(value, &["metadata", "name"]).unwrap_or_default(),
            error,
        }),
    }
}

/// Decodes `value` as `T`, refusing fields `T` does not know, as the API server does with
/// strict field validation: `strict decoding error: unknown field "spec.foo"`. Explicit
/// nulls are accepted (the server drops them).
///
/// # Errors
/// The message names the offending field path.
pub fn decode_strict<T: DeserializeOwned + serde::Serialize>(value: &Value) -> Result<T, String> {
    let object: T = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.into_inner().to_string()
        } else {
            format!("{path}: {}", e.into_inner())
        }
    })?;
    let round_trip = serde_json::to_value(&object).map_err(|e| e.to_string())?;
    let mut unknown = Vec::new();
    unknown_fields(value, &round_trip, "", &mut unknown);
    if unknown.is_empty() {
        Ok(object)
    } else {
        let fields: Vec<String> = unknown
            .iter()
            .map(|f| format!("unknown field {f:?}"))
            .collect();
        Err(format!("strict decoding error: {}", fields.join(", ")))
    }
}

/// Paths of the keys of `raw` that `typed` (the decoded object written back) lacks.
fn unknown_fields(raw: &Value, typed: &Value, path: &str, out: &mut Vec<String>) {
    match (raw, typed) {
        (Value::Object(raw), Value::Object(typed)) => {
            for (key, value) in raw {
                let at = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match typed.get(key) {
                    _ if value.is_null() => {}
                    None => out.push(at),
                    Some(typed_value) => unknown_fields(value, typed_value, &at, out),
                }
            }
        }
        (Value::Array(raw), Value::Array(typed)) => {
            for (i, (r, t)) in raw.iter().zip(typed).enumerate() {
                unknown_fields(r, t, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// The string at `path` of `value`.
pub fn string_at(value: &Value, path: &[&str]) -> Option<String> {
    let mut at = value;
    for key in path {
        at = at.get(key)?;
    }
    at.as_str().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_default_classes_are_the_charts() {
        let (documents, invalid) = read_source(&ManifestSource::DefaultClasses).unwrap();
        assert!(invalid.is_empty(), "{invalid:?}");
        let names: Vec<String> = documents
            .iter()
            .map(|d| string_at(&d.value, &["metadata", "name"]).unwrap())
            .collect();
        assert_eq!(names, ["gpu.kerf.dev", "slice.gpu.kerf.dev"]);
        assert!(
            documents
                .iter()
                .all(|d| d.origin.starts_with(DEFAULT_CLASSES_ORIGIN))
        );
    }

    #[test]
    fn unknown_fields_are_named_with_their_path() {
        let value = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x", "colour": "red"}}]}}
        });
        let err = decode_strict::<ResourceClaim>(&value).unwrap_err();
        assert!(
            err.contains("unknown field \"spec.devices.requests[0].exactly.colour\""),
            "{err}"
        );
    }

    #[test]
    fn opaque_parameters_and_nulls_pass() {
        let value = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c", "labels": null},
            "spec": {"devices": {"config": [{"opaque": {"driver": "d", "parameters": {"anything": 1}}}]}}
        });
        decode_strict::<ResourceClaim>(&value).unwrap();
    }

    #[test]
    fn wrong_types_name_their_path() {
        let value = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x", "count": "two"}}]}}
        });
        let err = decode_strict::<ResourceClaim>(&value).unwrap_err();
        assert!(
            err.contains("spec.devices.requests[0].exactly.count"),
            "{err}"
        );
    }

    #[test]
    fn documents_are_split_and_dispatched() {
        let text = "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n---\n---\napiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {name: dc}\nspec: {}\n";
        let docs = parse_documents(text, "f.yaml").unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[1].origin, "f.yaml#2");
        let mut manifests = Manifests::default();
        for doc in docs {
            manifests.add(doc);
        }
        assert_eq!(manifests.device_classes.len(), 1);
        assert_eq!(manifests.ignored.len(), 1);
        assert!(parse_documents("a: [", "bad.yaml").is_err());
    }
}
