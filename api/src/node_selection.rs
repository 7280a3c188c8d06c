//! Kubernetes' node selection rules that kerf-controller and the tests' kube-scheduler
//! stand-in both apply: node selector terms and taints against tolerations.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Taint, Toleration,
};

/// A NodeSelector matches when any of its terms matches (terms are ORed, requirements
/// ANDed; `matchFields` supports only `metadata.name`), as the scheduler's
/// `MatchNodeSelectorTerms` (`component-helpers/scheduling/corev1/nodeaffinity`).
pub fn node_selector_matches(
    selector: &NodeSelector,
    labels: &BTreeMap<String, String>,
    node_name: &str,
) -> bool {
    selector
        .node_selector_terms
        .iter()
        .any(|term| term_matches(term, labels, node_name))
}

fn term_matches(
    term: &NodeSelectorTerm,
    labels: &BTreeMap<String, String>,
    node_name: &str,
) -> bool {
    let expressions = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    // An empty term matches nothing, as in the scheduler.
    if expressions.is_empty() && fields.is_empty() {
        return false;
    }
    expressions
        .iter()
        .all(|r| requirement_matches(r, labels.get(&r.key).map(String::as_str)))
        && fields
            .iter()
            .all(|r| r.key == "metadata.name" && requirement_matches(r, Some(node_name)))
}

fn requirement_matches(requirement: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = requirement.values.as_deref().unwrap_or_default();
    match requirement.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| values.iter().all(|x| x != v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(actual), Some(bound)) = (
                value.and_then(|v| v.parse::<i64>().ok()),
                values.first().and_then(|v| v.parse::<i64>().ok()),
            ) else {
                return false;
            };
            if requirement.operator == "Gt" {
                actual > bound
            } else {
                actual < bound
            }
        }
        _ => false,
    }
}

/// The first taint of `taints` that keeps a pod with `tolerations` off the node: a
/// NoSchedule or NoExecute taint none of the tolerations tolerates (`TaintToleration`
/// Filter, `v1helper.FindMatchingUntoleratedTaint`).
pub fn untolerated_blocking_taint<'a>(
    taints: &'a [Taint],
    tolerations: &[Toleration],
) -> Option<&'a Taint> {
    taints
        .iter()
        .find(|t| blocks_scheduling(t) && !tolerated(t, tolerations))
}

fn blocks_scheduling(taint: &Taint) -> bool {
    taint.effect == "NoSchedule" || taint.effect == "NoExecute"
}

fn tolerated(taint: &Taint, tolerations: &[Toleration]) -> bool {
    tolerations.iter().any(|t| tolerates(t, taint))
}

fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = toleration.effect.as_deref()
        && !effect.is_empty()
        && effect != taint.effect
    {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or_default();
    // An empty key with Exists tolerates everything.
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "Equal" => {
            !key.is_empty()
                && toleration.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
        _ => false,
    }
}
