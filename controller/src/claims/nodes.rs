//! Which nodes may run a pod: the subset of the scheduler's node filters that decides where
//! the controller may place the pod's GPU slices (node selector, required node affinity,
//! taints, readiness, cordon).

use k8s_openapi::api::core::v1::{Node, Pod};
use kerf_api::node_selection::{node_selector_matches, untolerated_blocking_taint};

/// Why a node cannot run a pod, in words fit for an Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NodeRejection {
    /// The node is not Ready.
    NotReady,
    /// The node is cordoned.
    Unschedulable,
    /// `spec.nodeSelector` does not match.
    NodeSelector,
    /// Required node affinity does not match.
    NodeAffinity,
    /// A NoSchedule/NoExecute taint is not tolerated.
    Taint(String),
}

impl std::fmt::Display for NodeRejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeRejection::NotReady => f.write_str("not Ready"),
            NodeRejection::Unschedulable => f.write_str("cordoned"),
            NodeRejection::NodeSelector => f.write_str("does not match the pod's nodeSelector"),
            NodeRejection::NodeAffinity => {
                f.write_str("does not match the pod's required node affinity")
            }
            NodeRejection::Taint(key) => write!(f, "has taint {key} the pod does not tolerate"),
        }
    }
}

/// Checks whether `node` may run `pod`.
///
/// # Errors
/// The first reason the node is unsuitable.
pub(crate) fn node_fits(pod: &Pod, node: &Node) -> Result<(), NodeRejection> {
    if !is_ready(node) {
        return Err(NodeRejection::NotReady);
    }
    if node
        .spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
    {
        return Err(NodeRejection::Unschedulable);
    }
    let labels = node.metadata.labels.clone().unwrap_or_default();
    let name = node.metadata.name.as_deref().unwrap_or_default();
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
        && !node_selector_matches(required, &labels, name)
    {
        return Err(NodeRejection::NodeAffinity);
    }
    let tolerations = spec
        .and_then(|s| s.tolerations.as_deref())
        .unwrap_or_default();
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default();
    if let Some(taint) = untolerated_blocking_taint(taints, tolerations) {
        return Err(NodeRejection::Taint(format!(
            "{}={}:{}",
            taint.key,
            taint.value.as_deref().unwrap_or(""),
            taint.effect
        )));
    }
    Ok(())
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
            Err(NodeRejection::Taint(_))
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
