//! Pods that ask for a kerf GPU by extended resource name (`resources.limits:
//! {gpu.kerf.dev/…: 1}`, no ResourceClaim): what the suite builds and how it recognises the
//! claim kube-scheduler makes for them.
//!
//! kube-scheduler (kubernetes/kubernetes
//! `pkg/scheduler/framework/plugins/dynamicresources/extendeddynamicresources.go`) creates that
//! claim at PreBind (`createExtendedResourceClaimInAPI`): named `<pod>-extended-resources-…`
//! (generateName), owned by the pod (`controller: true`), annotated
//! `resource.kubernetes.io/extended-resource-claim: "true"`, with requests
//! `container-<i>-request-<j>`; and records it in `pod.status.extendedResourceClaimStatus`
//! (`patchPodExtendedResourceClaimStatus`). The kubelet prepares it like any other claim.

use std::collections::BTreeMap;

use anyhow::{Context as _, Result, ensure};
use k8s_openapi::api::core::v1::{Pod, PodSpec, ResourceRequirements};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_api::features::{Probed, extended_resource_probe, kept_extended_resource};
use kube::api::PostParams;
use kube::{Api, Client};

use super::manifests::{self, PodClaim, Script};
use super::settings::Settings;

/// The annotation kube-scheduler puts on the claim it makes for a pod's extended resources
/// (`resourceapi.ExtendedResourceClaimAnnotation`).
pub const EXTENDED_RESOURCE_CLAIM_ANNOTATION: &str =
    "resource.kubernetes.io/extended-resource-claim";

/// Whether the API server keeps DeviceClass `spec.extendedResourceName` (DRAExtendedResource),
/// asked the way kerf's controller asks: a dry-run create, nothing stored.
pub async fn probe_extended_resource(client: &Client, driver: &str) -> Probed {
    let params = PostParams {
        dry_run: true,
        field_manager: Some("kerf-e2e".to_owned()),
    };
    match Api::<DeviceClass>::all(client.clone())
        .create(&params, &extended_resource_probe(driver))
        .await
    {
        Ok(answer) => kept_extended_resource(&answer),
        Err(error) => Probed::Failed(error.to_string()),
    }
}

/// An extended resource name of `driver` that no other test or class uses: `<driver>/<unique>`
/// (the namespace name is unique and a valid name part).
pub fn unique_resource_name(driver: &str, namespace: &str) -> Result<String> {
    let name = format!("{driver}/{namespace}");
    kerf_api::gpuclass::validate_extended_resource_name(&name, "extendedResourceName")?;
    Ok(name)
}

/// The suite's test pod spec, asking for one `resource` in its limits instead of a claim.
pub fn pod_spec(settings: &Settings, resource: &str, script: Script) -> PodSpec {
    let mut spec = manifests::pod_spec(settings, PodClaim::Claim("unused"), script, "Never");
    spec.resource_claims = None;
    for container in &mut spec.containers {
        container.resources = Some(ResourceRequirements {
            limits: Some(BTreeMap::from([(
                resource.to_owned(),
                Quantity("1".to_owned()),
            )])),
            ..ResourceRequirements::default()
        });
    }
    spec
}

/// The name of the claim kube-scheduler made for `pod`'s extended resources, once recorded.
pub fn claim_name(pod: &Pod) -> Option<&str> {
    pod.status
        .as_ref()?
        .extended_resource_claim_status
        .as_ref()
        .map(|s| s.resource_claim_name.as_str())
        .filter(|n| !n.is_empty())
}

/// The name kube-scheduler gives the request of the special claim for `resource` of `pod`:
/// `container-<i>-request-<j>`, where `i` is the container's index among the init containers
/// followed by the containers, and `j` the resource's index among the container's requests
/// sorted by name (kubernetes/kubernetes
/// `pkg/scheduler/framework/plugins/dynamicresources/extended/`, `createDeviceRequests`). Read
/// it from the pod as the API server stored it: limits of extended resources are defaulted into
/// requests there. `None` when no container requests `resource`.
pub fn request_name(pod: &Pod, resource: &str) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    let containers = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers);
    containers.enumerate().find_map(|(at, container)| {
        let requests = container.resources.as_ref()?.requests.as_ref()?;
        // BTreeMap keys iterate sorted, as upstream sorts the names.
        let index = requests.keys().position(|name| name == resource)?;
        Some(format!("container-{at}-request-{index}"))
    })
}

/// Checks that `claim` is the special claim kube-scheduler makes for `pod`.
pub fn expect_special_claim(claim: &ResourceClaim, pod: &Pod) -> Result<()> {
    let annotated = claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(EXTENDED_RESOURCE_CLAIM_ANNOTATION))
        .map(String::as_str);
    ensure!(
        annotated == Some("true"),
        "claim {:?} lacks {EXTENDED_RESOURCE_CLAIM_ANNOTATION}=true (annotations {:?})",
        claim.metadata.name,
        claim.metadata.annotations
    );
    let pod_uid = pod.metadata.uid.as_deref().context("the pod has no UID")?;
    let owned = claim
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "Pod" && o.uid == pod_uid && o.controller == Some(true));
    ensure!(
        owned,
        "claim {:?} is not controlled by pod {:?} (owners {:?})",
        claim.metadata.name,
        pod.metadata.name,
        claim.metadata.owner_references
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodExtendedResourceClaimStatus, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    use kube::api::ObjectMeta;

    fn settings() -> Settings {
        Settings::from_lookup(|_| None).unwrap()
    }

    #[test]
    fn request_names_count_init_containers_and_sorted_requests() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {
                "initContainers": [{"name": "init"}],
                "containers": [
                    {"name": "a"},
                    {"name": "b", "resources": {"requests": {
                        "memory": "1Gi", "cpu": "1", "gpu.kerf.dev/x": "1"
                    }}}
                ]
            }
        }))
        .unwrap();
        assert_eq!(
            request_name(&pod, "gpu.kerf.dev/x").as_deref(),
            Some("container-2-request-1")
        );
        assert_eq!(request_name(&pod, "gpu.kerf.dev/y"), None);
    }

    #[test]
    fn the_pod_asks_by_limit_and_names_no_claim() {
        let spec = pod_spec(&settings(), "gpu.kerf.dev/gpu", Script::ReportAndSleep);
        assert!(spec.resource_claims.is_none());
        let resources = spec.containers[0].resources.as_ref().unwrap();
        assert!(resources.claims.is_none());
        assert_eq!(
            resources.limits.as_ref().unwrap()["gpu.kerf.dev/gpu"],
            Quantity("1".to_owned())
        );
    }

    #[test]
    fn names_are_unique_and_valid() {
        assert_eq!(
            unique_resource_name("gpu.kerf.dev", "kerf-e2e-extended-x1z9q").unwrap(),
            "gpu.kerf.dev/kerf-e2e-extended-x1z9q"
        );
        assert!(unique_resource_name("gpu.kerf.dev", "-bad").is_err());
    }

    #[test]
    fn the_special_claim_is_recognised() {
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some("p".to_owned()),
                uid: Some("u1".to_owned()),
                ..ObjectMeta::default()
            },
            status: Some(PodStatus {
                extended_resource_claim_status: Some(PodExtendedResourceClaimStatus {
                    request_mappings: Vec::new(),
                    resource_claim_name: "p-extended-resources-abcde".to_owned(),
                }),
                ..PodStatus::default()
            }),
            ..Pod::default()
        };
        assert_eq!(claim_name(&pod), Some("p-extended-resources-abcde"));
        assert_eq!(claim_name(&Pod::default()), None);
        let mut claim = ResourceClaim::default();
        claim.metadata.name = Some("p-extended-resources-abcde".to_owned());
        assert!(expect_special_claim(&claim, &pod).is_err());
        claim.metadata.annotations = Some(BTreeMap::from([(
            EXTENDED_RESOURCE_CLAIM_ANNOTATION.to_owned(),
            "true".to_owned(),
        )]));
        claim.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "v1".to_owned(),
            kind: "Pod".to_owned(),
            name: "p".to_owned(),
            uid: "u2".to_owned(),
            controller: Some(true),
            ..OwnerReference::default()
        }]);
        assert!(expect_special_claim(&claim, &pod).is_err(), "another pod's");
        claim.metadata.owner_references.as_mut().unwrap()[0].uid = "u1".to_owned();
        expect_special_claim(&claim, &pod).unwrap();
    }
}
