//! Why no node fits a pod, in kube-scheduler's words: `0/N nodes are available: 3 Insufficient
//! cpu, 1 node(s) had untolerated taint(s).`
//!
//! Upstream: kubernetes/kubernetes `pkg/scheduler/framework/types.go`, `FitError.Error`: each
//! node contributes the reasons of the filter that rejected it (`Diagnosis.NodeToStatus`);
//! equal reasons are counted, each count written before its reason (`"%v %v"`), the strings
//! sorted as strings (so `10 …` sorts before `3 …`), joined with `, ` and closed with a
//! period, after `0/%v nodes are available:` (`NoNodeAvailableMsg`). The reasons are the
//! filter plugins' own: the constants below quote them.

use std::collections::BTreeMap;

/// `nodeunschedulable` (`ErrReasonUnschedulable`): the node is cordoned and the pod does not
/// tolerate `node.kubernetes.io/unschedulable:NoSchedule`.
pub const UNSCHEDULABLE_REASON: &str = "node(s) were unschedulable";
/// `nodename` (`ErrReason`): the pod's `spec.nodeName` names another node.
pub const NODE_NAME_REASON: &str = "node(s) didn't match the requested node name";
/// `tainttoleration` (`Filter`): a NoSchedule or NoExecute taint the pod does not tolerate.
/// Since kubernetes#134740 (1.35, cherry-picked to 1.34) the taint is no longer named (it was
/// `node(s) had untolerated taint {key: value}`): taint keys and values may be sensitive.
pub const TAINT_REASON: &str = "node(s) had untolerated taint(s)";
/// `nodeaffinity` (`ErrReasonPod`): `spec.nodeSelector` or the required node affinity does not
/// match.
pub const NODE_AFFINITY_REASON: &str = "node(s) didn't match Pod's node affinity/selector";
/// `nodeports` (`ErrReason`): a host port the pod asks for is taken.
pub const NODE_PORTS_REASON: &str = "node(s) didn't have free ports for the requested pod ports";

/// The reasons of every node a pod was checked against, counted as `FitError` counts them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diagnosis {
    /// Nodes checked.
    nodes: usize,
    /// Reason → nodes that gave it.
    counts: BTreeMap<String, usize>,
}

impl Diagnosis {
    /// Records one node that was rejected for `reasons` (all reasons of the one filter that
    /// rejected it, such as `Insufficient cpu` and `Insufficient memory`).
    pub fn reject<S: AsRef<str>>(&mut self, reasons: &[S]) {
        self.nodes = self.nodes.saturating_add(1);
        for reason in reasons {
            let count = self.counts.entry(reason.as_ref().to_owned()).or_insert(0);
            *count = count.saturating_add(1);
        }
    }

    /// Records `count` nodes rejected for the same single `reason`.
    pub fn reject_many(&mut self, reason: &str, count: usize) {
        if count == 0 {
            return;
        }
        self.nodes = self.nodes.saturating_add(count);
        let slot = self.counts.entry(reason.to_owned()).or_insert(0);
        *slot = slot.saturating_add(count);
    }

    /// How many nodes were recorded.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// How many nodes gave `reason`.
    pub fn count(&self, reason: &str) -> usize {
        self.counts.get(reason).copied().unwrap_or(0)
    }

    /// `0/<all_nodes> nodes are available: <count> <reason>, ….` (upstream `FitError.Error`
    /// without PreFilter and PostFilter messages). With no reasons it ends after the colon.
    pub fn message(&self, all_nodes: usize) -> String {
        let mut histogram: Vec<String> = self
            .counts
            .iter()
            .map(|(reason, count)| format!("{count} {reason}"))
            .collect();
        histogram.sort();
        let mut message = format!("0/{all_nodes} nodes are available:");
        if !histogram.is_empty() {
            message.push(' ');
            message.push_str(&histogram.join(", "));
            message.push('.');
        }
        message
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_counted_and_sorted_as_strings() {
        let mut diagnosis = Diagnosis::default();
        for _ in 0..10 {
            diagnosis.reject(&["Insufficient cpu"]);
        }
        diagnosis.reject(&["Insufficient cpu", "Insufficient memory"]);
        diagnosis.reject_many(TAINT_REASON, 3);
        diagnosis.reject(&[NODE_AFFINITY_REASON]);
        assert_eq!(diagnosis.nodes(), 15);
        assert_eq!(diagnosis.count("Insufficient cpu"), 11);
        assert_eq!(
            diagnosis.message(15),
            "0/15 nodes are available: 1 Insufficient memory, \
             1 node(s) didn't match Pod's node affinity/selector, 11 Insufficient cpu, \
             3 node(s) had untolerated taint(s)."
        );
    }

    #[test]
    fn no_reason_leaves_the_histogram_out() {
        assert_eq!(Diagnosis::default().message(0), "0/0 nodes are available:");
    }
}
