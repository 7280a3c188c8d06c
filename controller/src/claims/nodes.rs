//! Which nodes may run a pod: the node filters of kube-scheduler that read only the pod and the
//! Node, in the order of its default plugins (`pkg/scheduler/apis/config/v1/default_plugins.go`),
//! each worded as the plugin words it ([`NodeRejection`]'s `Display`). Readiness comes first:
//! kerf's own check (upstream leaves NotReady nodes to their `node.kubernetes.io/not-ready`
//! taint). The filters that need the node's other pods (host ports, resources) are
//! `node_usage`'s.

use k8s_openapi::api::core::v1::{Node, Pod, Taint};
use kerf_api::node_selection::{node_selector_matches, untolerated_blocking_taint};
use kerf_core::alloc::node_fit::{
    NODE_AFFINITY_REASON, NODE_NAME_REASON, TAINT_REASON, UNSCHEDULABLE_REASON,
};

/// The taint kube-scheduler treats `spec.unschedulable` as (`v1.TaintNodeUnschedulable`).
const UNSCHEDULABLE_TAINT: &str = "node.kubernetes.io/unschedulable";

/// Why a node cannot run a pod; `Display` gives kube-scheduler's reason (kerf's own for
/// readiness).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NodeRejection {
    /// The node is not Ready.
    NotReady,
    /// The node is cordoned and the pod does not tolerate it (`nodeunschedulable`).
    Unschedulable,
    /// The pod's `spec.nodeName` names another node (`nodename`).
    NodeName,
    /// A NoSchedule/NoExecute taint is not tolerated (`tainttoleration`).
    Taint,
    /// `spec.nodeSelector` does not match (`nodeaffinity`).
    NodeSelector,
    /// Required node affinity does not match (`nodeaffinity`).
    NodeAffinity,
}

impl std::fmt::Display for NodeRejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NodeRejection::NotReady => NOT_READY_REASON,
            NodeRejection::Unschedulable => UNSCHEDULABLE_REASON,
            NodeRejection::NodeName => NODE_NAME_REASON,
            NodeRejection::Taint => TAINT_REASON,
            NodeRejection::NodeSelector | NodeRejection::NodeAffinity => NODE_AFFINITY_REASON,
        })
    }
}

/// kerf's words for a node that is not Ready.
pub(crate) const NOT_READY_REASON: &str = "node(s) were not Ready";

/// Checks whether `node` may run `pod`.
///
/// # Errors
/// The first filter that rejects the node.
pub(crate) fn node_fits(pod: &Pod, node: &Node) -> Result<(), NodeRejection> {
    if !is_ready(node) {
        return Err(NodeRejection::NotReady);
    }
    let spec = pod.spec.as_ref();
    let tolerations = spec
        .and_then(|s| s.tolerations.as_deref())
        .unwrap_or_default();
    if is_cordoned(node) && !tolerates_unschedulable(tolerations) {
        return Err(NodeRejection::Unschedulable);
    }
    let name = node.metadata.name.as_deref().unwrap_or_default();
    if spec
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|wanted| !wanted.is_empty() && wanted != name)
    {
        return Err(NodeRejection::NodeName);
    }
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default();
    if untolerated_blocking_taint(taints, tolerations).is_some() {
        return Err(NodeRejection::Taint);
    }
    node_affinity(pod, node, name)
}

/// The `nodeaffinity` filter: `spec.nodeSelector`, then the required node affinity.
fn node_affinity(pod: &Pod, node: &Node, name: &str) -> Result<(), NodeRejection> {
    let no_labels = std::collections::BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&no_labels);
    let spec = pod.spec.as_ref();
    if let Some(selector) = spec.and_then(|s| s.node_selector.as_ref())
        && !selector.iter().all(|(k, v)| labels.get(k) == Some(v))
    {
        return Err(NodeRejection::NodeSelector);
    }
    let required = spec
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    if let Some(required) = required
        && !node_selector_matches(required, labels, name)
    {
        return Err(NodeRejection::NodeAffinity);
    }
    Ok(())
}

fn is_cordoned(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
}

/// A pod that tolerates `node.kubernetes.io/unschedulable:NoSchedule` also tolerates
/// `spec.unschedulable` (kubernetes/kubernetes
/// `pkg/scheduler/framework/plugins/nodeunschedulable/node_unschedulable.go`, `Filter`).
fn tolerates_unschedulable(tolerations: &[k8s_openapi::api::core::v1::Toleration]) -> bool {
    let taint = Taint {
        key: UNSCHEDULABLE_TAINT.to_owned(),
        effect: "NoSchedule".to_owned(),
        ..Taint::default()
    };
    untolerated_blocking_taint(std::slice::from_ref(&taint), tolerations).is_none()
}

fn is_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(value: serde_json::Value) -> Node {
        let mut base = json!({
            "metadata": {"name": "n1", "labels": {"zone": "a", "gpus": "8"}},
            "spec": {},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        });
        merge(&mut base, value);
        serde_json::from_value(base).unwrap()
    }

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(
            json!({"metadata": {"name": "p"}, "spec": merge_into(json!({"containers": []}), spec)}),
        )
        .unwrap()
    }

    fn merge_into(mut base: serde_json::Value, patch: serde_json::Value) -> serde_json::Value {
        merge(&mut base, patch);
        base
    }

    fn merge(base: &mut serde_json::Value, patch: serde_json::Value) {
        if let (Some(b), serde_json::Value::Object(p)) = (base.as_object_mut(), patch) {
            for (k, v) in p {
                match b.get_mut(&k) {
                    Some(existing) if existing.is_object() && v.is_object() => merge(existing, v),
                    _ => {
                        b.insert(k, v);
                    }
                }
            }
        }
    }

    #[test]
    fn ready_untainted_node_fits_a_plain_pod() {
        assert_eq!(node_fits(&pod(json!({})), &node(json!({}))), Ok(()));
    }

    #[test]
    fn not_ready_and_cordoned_nodes_do_not_fit() {
        let not_ready =
            node(json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}));
        assert_eq!(
            node_fits(&pod(json!({})), &not_ready),
            Err(NodeRejection::NotReady)
        );
        let cordoned = node(json!({"spec": {"unschedulable": true}}));
        assert_eq!(
            node_fits(&pod(json!({})), &cordoned),
            Err(NodeRejection::Unschedulable)
        );
        assert_eq!(
            NodeRejection::Unschedulable.to_string(),
            "node(s) were unschedulable"
        );
    }

    #[test]
    fn a_pod_tolerating_the_unschedulable_taint_may_use_a_cordoned_node() {
        let cordoned = node(json!({"spec": {"unschedulable": true}}));
        let tolerant = pod(json!({"tolerations": [
            {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}
        ]}));
        assert_eq!(node_fits(&tolerant, &cordoned), Ok(()));
        let everything = pod(json!({"tolerations": [{"operator": "Exists"}]}));
        assert_eq!(node_fits(&everything, &cordoned), Ok(()));
        let no_execute = pod(json!({"tolerations": [
            {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoExecute"}
        ]}));
        assert_eq!(
            node_fits(&no_execute, &cordoned),
            Err(NodeRejection::Unschedulable)
        );
    }

    #[test]
    fn a_node_name_admits_that_node_only() {
        assert_eq!(
            node_fits(&pod(json!({"nodeName": "n1"})), &node(json!({}))),
            Ok(())
        );
        let elsewhere = pod(json!({"nodeName": "n2"}));
        assert_eq!(
            node_fits(&elsewhere, &node(json!({}))),
            Err(NodeRejection::NodeName)
        );
        assert_eq!(
            NodeRejection::NodeName.to_string(),
            "node(s) didn't match the requested node name"
        );
    }

    #[test]
    fn node_selector_must_match_every_label() {
        assert!(
            node_fits(
                &pod(json!({"nodeSelector": {"zone": "a"}})),
                &node(json!({}))
            )
            .is_ok()
        );
        assert_eq!(
            node_fits(
                &pod(json!({"nodeSelector": {"zone": "b"}})),
                &node(json!({}))
            ),
            Err(NodeRejection::NodeSelector)
        );
    }

    #[test]
    fn required_affinity_terms_are_ored_and_requirements_anded() {
        let affinity = |terms: serde_json::Value| {
            pod(
                json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}}),
            )
        };
        let n = node(json!({}));
        assert!(node_fits(&affinity(json!([{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}])), &n).is_ok());
        assert!(node_fits(&affinity(json!([{"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["4"]}]}])), &n).is_ok());
        assert!(node_fits(&affinity(json!([{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}])), &n).is_ok());
        assert!(
            node_fits(
                &affinity(json!([
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z"]}]},
                    {"matchExpressions": [{"key": "missing", "operator": "DoesNotExist"}]}
                ])),
                &n
            )
            .is_ok()
        );
        assert_eq!(
            node_fits(
                &affinity(
                    json!([{"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}])
                ),
                &n
            ),
            Err(NodeRejection::NodeAffinity)
        );
        assert_eq!(
            node_fits(&affinity(json!([{}])), &n),
            Err(NodeRejection::NodeAffinity)
        );
    }

    #[test]
    fn taints_need_tolerations() {
        let tainted = node(
            json!({"spec": {"taints": [{"key": "gpu", "value": "h100", "effect": "NoSchedule"}]}}),
        );
        assert!(matches!(
            node_fits(&pod(json!({})), &tainted),
            Err(NodeRejection::Taint)
        ));
        let equal = pod(
            json!({"tolerations": [{"key": "gpu", "operator": "Equal", "value": "h100", "effect": "NoSchedule"}]}),
        );
        assert!(node_fits(&equal, &tainted).is_ok());
        let exists_all = pod(json!({"tolerations": [{"operator": "Exists"}]}));
        assert!(node_fits(&exists_all, &tainted).is_ok());
        let wrong_effect = pod(
            json!({"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoExecute"}]}),
        );
        assert!(node_fits(&wrong_effect, &tainted).is_err());
        let prefer =
            node(json!({"spec": {"taints": [{"key": "x", "effect": "PreferNoSchedule"}]}}));
        assert!(
            node_fits(&pod(json!({})), &prefer).is_ok(),
            "PreferNoSchedule does not filter"
        );
    }
}
