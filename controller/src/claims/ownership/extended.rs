//! Pods that ask for GPUs by extended resource name (`resources.limits: {gpu.kerf.dev/gpu: 1}`,
//! no ResourceClaim): how many devices they request and whether kube-scheduler has made
//! their claim yet.
//!
//! kube-scheduler serves such a request from the DeviceClass the name maps to
//! (kubernetes/kubernetes `pkg/scheduler/framework/plugins/dynamicresources/
//! extendeddynamicresources.go`): `preFilterExtendedResources` totals the pod's requests with
//! `resourcehelper.PodRequests` and keeps an in-memory claim; `createRequestsAndMappings`
//! asks `count: <quantity>` devices of the class per container; the claim only reaches the
//! API server at PreBind (`createExtendedResourceClaimInAPI`), already placed. Until then
//! nothing in the cluster names the devices the pod waits for, so kerf-controller reads the
//! pod's requests itself. A node whose device plugin advertises the name serves the pod
//! without DRA (`filterExtendedResources`); a GPU lent for such a pod goes back after the
//! linger period, like one lent for a pod whose selector refuses it.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;

/// The annotation kube-scheduler puts on the claim it makes for a pod's extended resources
/// (`resourceapi.ExtendedResourceClaimAnnotation`, value `"true"`).
pub(super) const CLAIM_ANNOTATION: &str = "resource.kubernetes.io/extended-resource-claim";

/// The UIDs of the pods that control an extended-resource claim: `findExtendedResourceClaim`
/// (extendeddynamicresources.go) recognises a pod's claim by [`CLAIM_ANNOTATION`] `"true"`
/// and an owner reference with `controller: true` to the pod's name and UID.
pub(super) fn claim_owners(claims: &[Arc<ResourceClaim>]) -> HashSet<(String, String)> {
    claims
        .iter()
        .filter(|c| {
            c.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(CLAIM_ANNOTATION))
                .is_some_and(|v| v == "true")
        })
        .flat_map(|c| c.metadata.owner_references.iter().flatten())
        .filter(|o| o.controller == Some(true) && o.kind == "Pod")
        .map(|o| (o.name.clone(), o.uid.clone()))
        .collect()
}

/// True when kube-scheduler has made the pod's extended-resource claim (one of `owners`, see
/// [`claim_owners`]) or recorded it in `status.extendedResourceClaimStatus`
/// (`patchPodExtendedResourceClaimStatus`). Such a claim is allocated, or stale and about to
/// be deleted by kube-scheduler's PostFilter, after which the pod asks again.
pub(super) fn has_claim(pod: &Pod, owners: &HashSet<(String, String)>) -> bool {
    let recorded = pod
        .status
        .as_ref()
        .and_then(|s| s.extended_resource_claim_status.as_ref())
        .is_some_and(|s| !s.resource_claim_name.is_empty());
    let key = (
        pod.metadata.name.clone().unwrap_or_default(),
        pod.metadata.uid.clone().unwrap_or_default(),
    );
    recorded || owners.contains(&key)
}

/// The pod's requests of extended resources (names with a domain: `<domain>/<name>`), totalled
/// as kube-scheduler totals them: k8s.io/component-helpers `resource/helpers.go`
/// `PodRequests` → `aggregateContainerResourcesByFn`, i.e. the sum of the app containers and
/// the restartable (sidecar) init containers, or, when larger, the largest of each other init
/// container plus the sidecars started before it. Pod-level resources carry only cpu, memory
/// and hugepages (`IsSupportedPodLevelResource`), so they never change these.
///
/// A container's request of a name it only limits counts as the limit: the API server
/// defaults requests to limits (kubernetes/kubernetes `pkg/apis/core/v1/defaults.go`,
/// `SetDefaults_Pod`). Quantities that are not positive whole numbers count as zero (the API
/// server refuses fractional extended resources).
pub(super) fn requests(pod: &Pod) -> BTreeMap<String, u64> {
    let Some(spec) = pod.spec.as_ref() else {
        return BTreeMap::new();
    };
    let mut total = BTreeMap::new();
    for container in &spec.containers {
        add(&mut total, &container_requests(container));
    }
    let mut sidecars = BTreeMap::new();
    let mut init_peak = BTreeMap::new();
    for container in spec.init_containers.iter().flatten() {
        let own = container_requests(container);
        let in_use = if container.restart_policy.as_deref() == Some("Always") {
            add(&mut total, &own);
            add(&mut sidecars, &own);
            sidecars.clone()
        } else {
            let mut with_sidecars = own;
            add(&mut with_sidecars, &sidecars);
            with_sidecars
        };
        keep_max(&mut init_peak, &in_use);
    }
    keep_max(&mut total, &init_peak);
    total
}

/// One container's extended-resource requests, limits filling in missing requests.
fn container_requests(container: &Container) -> BTreeMap<String, u64> {
    let Some(resources) = container.resources.as_ref() else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    let limits = resources.limits.iter().flatten();
    let requests = resources.requests.iter().flatten();
    // Requests first: a limit only fills in a name the requests lack.
    for (name, quantity) in requests.chain(limits) {
        if !name.contains('/') || out.contains_key(name) {
            continue;
        }
        let count = kerf_api::quantity::quantity_bytes(quantity).unwrap_or(0);
        out.insert(name.clone(), count);
    }
    out
}

fn add(into: &mut BTreeMap<String, u64>, from: &BTreeMap<String, u64>) {
    for (name, count) in from {
        let entry = into.entry(name.clone()).or_default();
        *entry = entry.saturating_add(*count);
    }
}

fn keep_max(into: &mut BTreeMap<String, u64>, from: &BTreeMap<String, u64>) {
    for (name, count) in from {
        let entry = into.entry(name.clone()).or_default();
        *entry = (*entry).max(*count);
    }
}

#[cfg(test)]
#[allow(
    clippy::needless_pass_by_value,
    reason = "fixtures take JSON values as the tests write them"
)]
mod tests {
    use super::*;
    use serde_json::json;

    const GPU: &str = "gpu.kerf.dev/gpu";

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "uid": "u1"},
            "spec": spec,
        }))
        .unwrap()
    }

    fn container(name: &str, resources: serde_json::Value) -> serde_json::Value {
        json!({"name": name, "image": "busybox", "resources": resources})
    }

    #[test]
    fn limits_count_where_requests_are_missing_and_cpu_is_ignored() {
        let p = pod(json!({"containers": [
            container("a", json!({"limits": {GPU: "1", "cpu": "100m"}})),
            container("b", json!({"requests": {GPU: "2"}, "limits": {GPU: "2", "memory": "1Gi"}})),
            container("c", json!({})),
        ]}));
        assert_eq!(requests(&p), BTreeMap::from([(GPU.to_owned(), 3)]));
        let zero = pod(json!({"containers": [container("a", json!({"limits": {GPU: "0"}}))]}));
        assert_eq!(requests(&zero), BTreeMap::from([(GPU.to_owned(), 0)]));
    }

    #[test]
    fn init_containers_count_by_their_peak_and_sidecars_add_up() {
        // Apps 1; a plain init container 3: the pod needs 3 at its start.
        let p = pod(json!({
            "initContainers": [container("i", json!({"limits": {GPU: "3"}}))],
            "containers": [container("a", json!({"limits": {GPU: "1"}}))],
        }));
        assert_eq!(requests(&p)[GPU], 3);
        // A sidecar of 1 runs beside the apps (1 + 1) and beside the later init container
        // (1 + 1): 2. Without it, the init container (1) is below the apps (1): 1.
        let p = pod(json!({
            "initContainers": [
                container("side", json!({"limits": {GPU: "1"}})),
                container("i", json!({"limits": {GPU: "1"}})),
            ],
            "containers": [container("a", json!({"limits": {GPU: "1"}}))],
        }));
        let mut with_sidecar = p.clone();
        with_sidecar
            .spec
            .as_mut()
            .unwrap()
            .init_containers
            .as_mut()
            .unwrap()[0]
            .restart_policy = Some("Always".to_owned());
        assert_eq!(requests(&p)[GPU], 1);
        assert_eq!(requests(&with_sidecar)[GPU], 2);
    }

    #[test]
    fn the_claim_kube_scheduler_made_is_recognised_by_annotation_and_controller_owner() {
        let claim = |annotation: &str, uid: &str, controller: bool| -> Arc<ResourceClaim> {
            Arc::new(
                serde_json::from_value(json!({
                    "metadata": {
                        "name": "p-extended-resources-x",
                        "annotations": {CLAIM_ANNOTATION: annotation},
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p",
                                             "uid": uid, "controller": controller}],
                    },
                    "spec": {},
                }))
                .unwrap(),
            )
        };
        let p = pod(json!({"containers": []}));
        for (c, mine) in [
            (claim("true", "u1", true), true),
            (claim("false", "u1", true), false),
            (claim("true", "u2", true), false),
            (claim("true", "u1", false), false),
        ] {
            assert_eq!(has_claim(&p, &claim_owners(&[c])), mine);
        }
        let mut recorded = p;
        recorded.status = Some(
            serde_json::from_value(json!({"extendedResourceClaimStatus": {
                "resourceClaimName": "p-extended-resources-x", "requestMappings": []}}))
            .unwrap(),
        );
        assert!(has_claim(&recorded, &HashSet::new()));
    }
}
