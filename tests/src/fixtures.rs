//! Objects as users and the API server write them, for the integration tests and the
//! benchmarks: one shape written once, so a change to what a claim looks like is made here.

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Resource as _;
use serde_json::{Value, json};

/// The driver name the tests' clusters run kerf under (kerf's default).
pub const DRIVER: &str = "gpu.kerf.dev";

/// The API path of ResourceClaim `name` in `namespace`.
#[must_use]
pub fn claim_path(namespace: &str, name: &str) -> String {
    format!("{}/{name}", ResourceClaim::url_path(&(), Some(namespace)))
}

/// A claim of one GPU slice as a user writes it: one request `gpu` of `class` (with the API
/// server's defaults spelled out, `ExactCount` of one device), configured by kerf's
/// `GpuClaimParameters` of `memory` and, when set, `compute` percent.
#[derive(Clone, Copy, Debug)]
pub struct SliceClaim<'a> {
    /// `metadata.name`.
    pub name: &'a str,
    /// `metadata.namespace`; `None` leaves it to the request's path, as kubectl does.
    pub namespace: Option<&'a str>,
    /// The request's DeviceClass.
    pub class: &'a str,
    /// The parameters' `memory` (a quantity, e.g. `10Gi`).
    pub memory: &'a str,
    /// The parameters' `compute`; `None` leaves it out.
    pub compute: Option<u64>,
}

impl<'a> SliceClaim<'a> {
    /// Claim `name` of `memory` from `class`, with no namespace and no compute.
    #[must_use]
    pub fn new(name: &'a str, class: &'a str, memory: &'a str) -> Self {
        Self {
            name,
            namespace: None,
            class,
            memory,
            compute: None,
        }
    }

    /// The same claim in `namespace`.
    #[must_use]
    pub fn in_namespace(self, namespace: &'a str) -> Self {
        Self {
            namespace: Some(namespace),
            ..self
        }
    }

    /// The same claim asking `percent` of the GPU's compute.
    #[must_use]
    pub fn compute(self, percent: u64) -> Self {
        Self {
            compute: Some(percent),
            ..self
        }
    }

    /// The claim as JSON.
    #[must_use]
    pub fn json(&self) -> Value {
        let mut parameters = json!({
            "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters",
            "memory": self.memory,
        });
        if let Some(compute) = self.compute {
            parameters["compute"] = json!(compute);
        }
        let mut metadata = json!({"name": self.name});
        if let Some(namespace) = self.namespace {
            metadata["namespace"] = json!(namespace);
        }
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": metadata,
            "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": self.class, "allocationMode": "ExactCount", "count": 1}}],
                "config": [{"opaque": {"driver": DRIVER, "parameters": parameters}}],
            }},
        })
    }

    /// The claim as the typed object.
    ///
    /// # Errors
    ///
    /// When serde cannot decode the JSON of [`Self::json`] as a `ResourceClaim`.
    pub fn resource(&self) -> Result<ResourceClaim, serde_json::Error> {
        serde_json::from_value(self.json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_claim_decodes_with_its_parameters_and_path() {
        let claim = SliceClaim::new("c", "slices", "5Gi")
            .in_namespace("team")
            .compute(10)
            .resource()
            .unwrap();
        let request = &claim
            .spec
            .devices
            .as_ref()
            .unwrap()
            .requests
            .as_ref()
            .unwrap()[0];
        let exactly = request.exactly.as_ref().unwrap();
        assert_eq!(exactly.device_class_name, "slices");
        assert_eq!(exactly.count, Some(1));
        let json = SliceClaim::new("c", "slices", "5Gi").json();
        assert!(json["metadata"].get("namespace").is_none());
        assert!(
            json["spec"]["devices"]["config"][0]["opaque"]["parameters"]
                .get("compute")
                .is_none()
        );
        assert_eq!(
            claim_path("team", "c"),
            "/apis/resource.k8s.io/v1/namespaces/team/resourceclaims/c"
        );
    }
}
