//! Which pods consume which claims: by name in `spec.resourceClaims[].resourceClaimName`, or
//! through a template, whose generated claim name the kube-controller-manager records in
//! `status.resourceClaimStatuses`.

use k8s_openapi::api::core::v1::Pod;

/// The claim names a pod uses (all in the pod's namespace), and whether every template claim
/// has been created yet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodClaims {
    /// Names of the ResourceClaims the pod references, in pod order.
    pub names: Vec<String>,
    /// Template claims whose generated claim is not known yet (pod claim names).
    pub pending_templates: Vec<String>,
}

/// Resolves the ResourceClaims of `pod`.
pub fn pod_claims(pod: &Pod) -> PodClaims {
    let mut out = PodClaims::default();
    let Some(spec) = pod.spec.as_ref() else {
        return out;
    };
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_deref())
        .unwrap_or_default();
    for claim in spec.resource_claims.as_deref().unwrap_or_default() {
        if let Some(name) = &claim.resource_claim_name {
            out.names.push(name.clone());
        } else if claim.resource_claim_template_name.is_some() {
            // The status entry's claim name is empty when the template generated no claim.
            match statuses.iter().find(|s| s.name == claim.name) {
                Some(status) => {
                    if let Some(name) = status
                        .resource_claim_name
                        .as_ref()
                        .filter(|n| !n.is_empty())
                    {
                        out.names.push(name.clone());
                    }
                }
                None => out.pending_templates.push(claim.name.clone()),
            }
        }
    }
    out
}

/// True when the pod uses the claim named `claim` (in its own namespace).
pub(crate) fn uses_claim(pod: &Pod, claim: &str) -> bool {
    pod_claims(pod).names.iter().any(|n| n == claim)
}

/// A pod that may still run containers: not finished and not being deleted.
pub fn is_live(pod: &Pod) -> bool {
    let finished = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed");
    !finished && pod.metadata.deletion_timestamp.is_none()
}

/// A pod the scheduler has not yet bound to a node.
pub(crate) fn is_unscheduled(pod: &Pod) -> bool {
    assigned_node(pod).is_none()
}

/// The node a pod is bound to (by the scheduler, or at creation).
pub fn assigned_node(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
}

/// A pod whose claims the controller should still allocate: not bound yet, or created with
/// `spec.nodeName` and not started (the kubelet waits for the claims' allocations;
/// kube-controller-manager's resourceclaim controller then reserves them for the pod).
pub(crate) fn awaits_allocation(pod: &Pod) -> bool {
    let pending = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_none_or(|phase| phase == "Pending");
    is_unscheduled(pod) || pending
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn direct_and_template_claims_are_resolved() {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [], "resourceClaims": [
                {"name": "a", "resourceClaimName": "shared"},
                {"name": "b", "resourceClaimTemplateName": "tpl"},
                {"name": "c", "resourceClaimTemplateName": "tpl2"}
            ]},
            "status": {"resourceClaimStatuses": [{"name": "b", "resourceClaimName": "p-b-x7k"}]}
        }));
        let claims = pod_claims(&p);
        assert_eq!(claims.names, ["shared", "p-b-x7k"]);
        assert_eq!(claims.pending_templates, ["c"]);
        assert!(uses_claim(&p, "p-b-x7k"));
        assert!(!uses_claim(&p, "other"));
    }

    #[test]
    fn finished_or_deleted_pods_are_not_live() {
        let running = pod(json!({"metadata": {"name": "p"}, "status": {"phase": "Running"}}));
        assert!(is_live(&running));
        let done = pod(json!({"metadata": {"name": "p"}, "status": {"phase": "Succeeded"}}));
        assert!(!is_live(&done));
        let deleting =
            pod(json!({"metadata": {"name": "p", "deletionTimestamp": "2026-01-01T00:00:00Z"}}));
        assert!(!is_live(&deleting));
    }

    #[test]
    fn unscheduled_means_no_node_name() {
        assert!(is_unscheduled(&pod(
            json!({"metadata": {"name": "p"}, "spec": {"containers": []}})
        )));
        assert!(!is_unscheduled(&pod(
            json!({"metadata": {"name": "p"}, "spec": {"containers": [], "nodeName": "n1"}})
        )));
    }
}
