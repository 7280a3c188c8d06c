//! The CRD manifests generated from the Rust types, as committed under `deploy/helm/kerf/crds/` (the chart installs them).
//!
//! [`formats`]: the schemas carry only `format`s kube-apiserver knows. [`objects`]: GpuClass
//! objects read from a manifest (kerf-controller's default classes).

pub mod formats;
pub mod objects;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

use crate::error::{Error, Result};
use crate::gpuclass::GpuClass;
use crate::gpuquota::GpuQuota;

/// The first line of every generated manifest.
pub const HEADER: &str = "# Generated from kerf-api's Rust types by `cargo run -p kerf-api --bin crdgen`. Do not edit.\n";

/// One generated manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrdFile {
    /// File name under `deploy/helm/kerf/crds/`, e.g. `gpuclasses.gpu.kerf.dev.yaml`.
    pub file_name: String,
    /// The YAML document, starting with [`HEADER`].
    pub yaml: String,
}

/// The GpuClass CRD as kerf installs it: kube's derived CRD with the integer formats turned
/// into ones kube-apiserver knows ([`formats::kubernetes_formats`]).
pub fn gpuclass_crd() -> CustomResourceDefinition {
    let mut crd = GpuClass::crd();
    formats::kubernetes_formats(&mut crd);
    crd
}

/// The GpuQuota CRD as kerf installs it, with formats as in [`gpuclass_crd`].
pub fn gpuquota_crd() -> CustomResourceDefinition {
    let mut crd = GpuQuota::crd();
    formats::kubernetes_formats(&mut crd);
    crd
}

/// Every CRD kerf defines, rendered as YAML.
///
/// # Errors
///
/// [`Error::Serialize`] if YAML serialisation fails.
pub fn crd_files() -> Result<Vec<CrdFile>> {
    [
        ("GpuClass CRD", gpuclass_crd()),
        ("GpuQuota CRD", gpuquota_crd()),
    ]
    .into_iter()
    .map(|(what, crd)| {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let body = serde_saphyr::to_string(&crd).map_err(|e| Error::Serialize {
            what,
            message: e.to_string(),
        })?;
        Ok(CrdFile {
            file_name: format!("{name}.yaml"),
            yaml: format!("{HEADER}{body}"),
        })
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_crds_match_the_types() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/kerf/crds");
        for file in crd_files().expect("CRDs render") {
            let committed = std::fs::read_to_string(dir.join(&file.file_name)).unwrap_or_default();
            assert!(
                committed == file.yaml,
                "deploy/helm/kerf/crds/{} is out of date; run `cargo run -p kerf-api --bin crdgen`",
                file.file_name
            );
        }
    }

    #[test]
    fn generated_crds_use_only_formats_kubernetes_knows() {
        assert_eq!(formats::unknown_formats(&gpuquota_crd()), []);
        let crd = gpuclass_crd();
        assert_eq!(formats::unknown_formats(&crd), []);
        let schema = serde_json::to_value(&crd.spec.versions[0].schema).expect("schema serialises");
        let slicing =
            &schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["slicing"]["properties"];
        assert_eq!(slicing["defaultCompute"]["format"], "int32");
        assert_eq!(slicing["defaultCompute"]["minimum"].as_f64(), Some(1.0));
        assert_eq!(slicing["defaultCompute"]["maximum"].as_f64(), Some(100.0));
        assert_eq!(slicing["maxSlicesPerGpu"]["format"], "int64");
        assert_eq!(slicing["maxSlicesPerGpu"]["minimum"].as_f64(), Some(1.0));
        assert_eq!(
            slicing["maxSlicesPerGpu"]["maximum"].as_f64(),
            Some(f64::from(u32::MAX))
        );
    }

    #[test]
    fn gpuclass_crd_shape() {
        let crd = gpuclass_crd();
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some("gpuclasses.gpu.kerf.dev")
        );
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(crd.spec.names.short_names, Some(vec!["gpuc".to_owned()]));
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        let columns: Vec<&str> = version
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(
            columns,
            [
                "Allocator",
                "DeviceClass",
                "Extended resource",
                "Devices",
                "Free memory",
                "Ready",
                "Age"
            ]
        );
        assert!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some()
        );
        let schema = serde_json::to_value(&version.schema).expect("schema serialises");
        let spec = &schema["openAPIV3Schema"]["properties"]["spec"];
        assert_eq!(spec["properties"]["allocator"]["default"], "Scheduler");
        assert_eq!(
            spec["properties"]["allocator"]["enum"],
            serde_json::json!(["Scheduler", "Controller"])
        );
        assert_eq!(
            spec["properties"]["slicing"]["properties"]["memoryGranularity"]["default"],
            "1Gi"
        );
        let maximum =
            spec["properties"]["slicing"]["properties"]["defaultCompute"]["maximum"].as_f64();
        assert_eq!(maximum, Some(100.0));
        assert!(
            spec["x-kubernetes-validations"][0]["rule"]
                .as_str()
                .unwrap_or_default()
                .contains("migProfile")
        );
        let name = &spec["properties"]["extendedResourceName"];
        assert_eq!(name["maxLength"], 308);
        assert!(name["pattern"].as_str().is_some_and(|p| p.contains('/')));
        let rules: Vec<&str> = spec["x-kubernetes-validations"]
            .as_array()
            .map(|rules| rules.iter().filter_map(|r| r["rule"].as_str()).collect())
            .unwrap_or_default();
        assert!(
            rules.iter().any(|rule| rule.contains("kubernetes.io/")),
            "{rules:?}"
        );
        let conditions =
            &schema["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"];
        assert_eq!(conditions["x-kubernetes-list-type"], "map");
        for field in [
            "type",
            "status",
            "reason",
            "message",
            "lastTransitionTime",
            "observedGeneration",
        ] {
            assert!(
                conditions["items"]["properties"].get(field).is_some(),
                "condition field {field}"
            );
        }
    }
}
