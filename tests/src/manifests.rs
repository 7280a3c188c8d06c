//! kerf's one-file installs, rendered from the Helm chart (`deploy/render`, drift-checked by
//! `.ci/validate-manifests`) and compiled in, so that the fakes authorize, admit and call
//! webhooks exactly as the chart installs them and a test binary needs no checkout at run time.

use serde_json::Value;

/// `deploy/kerf.yaml`: the chart's defaults (real GPUs through NVML).
pub const INSTALL: &str = include_str!("../../deploy/kerf.yaml");

/// Where [`INSTALL`] comes from, for messages.
pub const INSTALL_PATH: &str = "deploy/kerf.yaml";

/// `deploy/kerf-mock.yaml`: the chart with mock GPUs and the image `kerf:dev`.
pub const MOCK_INSTALL: &str = include_str!("../../deploy/kerf-mock.yaml");

/// Where [`MOCK_INSTALL`] comes from, for messages.
pub const MOCK_INSTALL_PATH: &str = "deploy/kerf-mock.yaml";

/// The ConfigMap the controller reads its default GpuClasses from.
const DEFAULT_CLASSES_CONFIG_MAP: &str = "kerf-default-gpu-classes";

/// Why a compiled-in manifest cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{origin}: {message}")]
pub struct ManifestError {
    origin: &'static str,
    message: String,
}

/// The documents of a multi-document manifest.
///
/// # Errors
/// The text is not YAML.
pub fn documents(origin: &'static str, text: &str) -> Result<Vec<Value>, ManifestError> {
    serde_saphyr::from_multiple::<Value>(text).map_err(|e| ManifestError {
        origin,
        message: format!("invalid YAML: {e}"),
    })
}

/// The object of `kind` named `name` in [`INSTALL`].
///
/// # Errors
/// The manifest does not parse or holds no such object.
pub fn installed(kind: &str, name: &str) -> Result<Value, ManifestError> {
    documents(INSTALL_PATH, INSTALL)?
        .into_iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .ok_or_else(|| ManifestError {
            origin: INSTALL_PATH,
            message: format!("no {kind} {name}"),
        })
}

/// The default GpuClasses the chart gives the controller (a YAML stream of GpuClasses, the
/// `gpuclasses.yaml` of the ConfigMap kerf-default-gpu-classes).
///
/// # Errors
/// The manifest does not parse or holds no such ConfigMap entry.
pub fn default_gpu_classes() -> Result<String, ManifestError> {
    let config_map = installed("ConfigMap", DEFAULT_CLASSES_CONFIG_MAP)?;
    config_map["data"]["gpuclasses.yaml"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| ManifestError {
            origin: INSTALL_PATH,
            message: format!("ConfigMap {DEFAULT_CLASSES_CONFIG_MAP} has no data gpuclasses.yaml"),
        })
}
