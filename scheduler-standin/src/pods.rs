//! Pod and claim helpers shared by the stand-in's phases: keys, reservation lookups and the
//! node filters that run before DynamicResources' Filter, and device taint tolerations.

use k8s_openapi::api::core::v1::{Node, NodeSelector, Pod};
use k8s_openapi::api::resource::v1::{Device, DeviceTaint, DeviceToleration, ResourceClaim};
use kerf_api::node_selection;
use kube::ResourceExt;

pub(super) fn key(namespace: Option<&str>, name: &str) -> String {
    format!("{}/{name}", namespace.unwrap_or_default())
}

pub(super) fn pod_key(pod: &Pod) -> String {
    key(pod.metadata.namespace.as_deref(), &pod.name_any())
}

pub(super) fn claim_key(claim: &ResourceClaim) -> String {
    key(claim.metadata.namespace.as_deref(), &claim.name_any())
}

pub(super) fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

pub(super) fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 404)
}

/// Whether `selector` selects `node` (`v1helper.NodeSelectorRequirementsAsSelector` and
/// `MatchNodeSelectorTerms`: terms are ORed, requirements of a term ANDed; `matchFields`
/// supports `metadata.name`).
pub fn node_selector_matches(selector: &NodeSelector, node: &Node) -> bool {
    node_selection::node_selector_matches(selector, node.labels(), &node.name_any())
}

/// The node filters the stand-in runs before DynamicResources' Filter (upstream plugins
/// NodeUnschedulable, TaintToleration and NodeAffinity's `spec.nodeSelector` part).
pub(super) fn node_fits(pod: &Pod, node: &Node) -> bool {
    let spec = pod.spec.as_ref();
    let node_spec = node.spec.as_ref();
    if node_spec.and_then(|s| s.unschedulable) == Some(true) {
        return false;
    }
    let tolerations = spec
        .and_then(|s| s.tolerations.as_deref())
        .unwrap_or_default();
    let taints = node_spec
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default();
    if node_selection::untolerated_blocking_taint(taints, tolerations).is_some() {
        return false;
    }
    let labels = node.labels();
    spec.and_then(|s| s.node_selector.as_ref())
        .is_none_or(|selector| selector.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

/// Whether a pod is waiting for a scheduler: no node, no gates, not deleted, not finished.
/// Upstream: the scheduler's informer queues only unassigned pods (`assignedPod` in
/// `pkg/scheduler/eventhandlers.go`), and SchedulingGates' `PreEnqueue`
/// (`pkg/scheduler/framework/plugins/schedulinggates/scheduling_gates.go`) keeps a pod with
/// any `spec.schedulingGates` out of the active queue.
pub(super) fn wants_scheduling(pod: &Pod) -> bool {
    let spec = pod.spec.as_ref();
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    spec.and_then(|s| s.node_name.as_deref())
        .is_none_or(str::is_empty)
        && spec
            .and_then(|s| s.scheduling_gates.as_ref())
            .is_none_or(Vec::is_empty)
        && pod.metadata.deletion_timestamp.is_none()
        && !matches!(phase, Some("Succeeded" | "Failed"))
}

/// `isPodDone` of `pkg/controller/resourceclaim/controller.go`: terminal phase, or deleted
/// and never scheduled.
pub(super) fn is_pod_done(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed"))
        || (pod.metadata.deletion_timestamp.is_some()
            && pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .is_none_or(str::is_empty))
}

/// The claim names a pod refers to, in `spec.resourceClaims` order; `None` for a template
/// claim whose generated name is not in `status.resourceClaimStatuses` yet.
pub fn pod_claim_names(pod: &Pod) -> Vec<(String, Option<String>)> {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_deref())
        .unwrap_or_default();
    pod.spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_deref())
        .unwrap_or_default()
        .iter()
        .map(|c| {
            let name = c.resource_claim_name.clone().or_else(|| {
                statuses
                    .iter()
                    .find(|s| s.name == c.name)
                    .and_then(|s| s.resource_claim_name.clone())
            });
            (c.name.clone(), name)
        })
        .collect()
}

/// Upstream `ToleratesTaint` (kubernetes/kubernetes
/// `staging/src/k8s.io/dynamic-resource-allocation/resourceclaim/devicetoleration.go`): an
/// empty effect or key matches all, `Exists` any value, `Equal` (or empty) an equal value.
fn tolerates_taint(toleration: &DeviceToleration, taint: &DeviceTaint) -> bool {
    let effect = toleration.effect.as_deref().unwrap_or_default();
    let key = toleration.key.as_deref().unwrap_or_default();
    if (!effect.is_empty() && effect != taint.effect) || (!key.is_empty() && key != taint.key) {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or_default() {
        "" | "Equal" => {
            toleration.value.as_deref().unwrap_or_default()
                == taint.value.as_deref().unwrap_or_default()
        }
        "Exists" => true,
        _ => false,
    }
}

/// `taintPreventsAllocation`: only NoSchedule and NoExecute taints count.
pub(super) fn tainted(device: &Device, tolerations: &[DeviceToleration]) -> bool {
    device.taints.iter().flatten().any(|t| {
        (t.effect == "NoSchedule" || t.effect == "NoExecute")
            && !tolerations.iter().any(|tol| tolerates_taint(tol, t))
    })
}
