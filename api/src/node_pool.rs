//! Node pools: the groups of nodes whose GPU fragmentation kerf reports together
//! (kerf-controller's `kerf_pool_*_gpus` metrics, `kerf status`).
//!
//! A pool is the value of one node label. The default, `node.kubernetes.io/instance-type`, is
//! the well-known label that cloud providers' node controllers set on every node: nodes of one
//! machine type, whatever the provider calls its groups of them. Admins whose pools are named
//! by another label (`cloud.google.com/gke-nodepool`, `eks.amazonaws.com/nodegroup`,
//! `karpenter.sh/nodepool`, …) pass that label instead.

use std::collections::BTreeMap;

/// The node label that names a node's pool unless configured otherwise.
pub const DEFAULT_NODE_POOL_LABEL: &str = "node.kubernetes.io/instance-type";

/// The pool of nodes without the pool label.
pub const UNLABELED_POOL: &str = "unlabeled";

/// The pool of a node with `labels`: the value of `pool_label`, or [`UNLABELED_POOL`] when the
/// node has no such label or its value is empty.
pub fn pool_of<'a>(labels: Option<&'a BTreeMap<String, String>>, pool_label: &str) -> &'a str {
    labels
        .and_then(|labels| labels.get(pool_label))
        .map(String::as_str)
        .filter(|value| !value.is_empty())
        .unwrap_or(UNLABELED_POOL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_label_names_the_pool_and_its_absence_is_unlabeled() {
        let labels = BTreeMap::from([
            (
                DEFAULT_NODE_POOL_LABEL.to_owned(),
                "p4d.24xlarge".to_owned(),
            ),
            ("empty".to_owned(), String::new()),
        ]);
        assert_eq!(
            pool_of(Some(&labels), DEFAULT_NODE_POOL_LABEL),
            "p4d.24xlarge"
        );
        assert_eq!(pool_of(Some(&labels), "empty"), UNLABELED_POOL);
        assert_eq!(pool_of(Some(&labels), "other"), UNLABELED_POOL);
        assert_eq!(pool_of(None, DEFAULT_NODE_POOL_LABEL), UNLABELED_POOL);
    }
}
