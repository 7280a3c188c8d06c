//! The label that names the node a kerf claim is allocated on, so that each kubelet plugin can
//! watch just its own node's claims (a label-selected watch, which the API server's watch
//! cache filters) and prepare them without a GET.
//!
//! kerf-controller sets it: on its own claims when it picks their node (in the same write as
//! the finalizer, before the allocation exists), and on claims kube-scheduler allocated with
//! kerf devices as soon as it sees their allocation; it removes it when the allocation goes.
//! The plugin never trusts it alone: it prepares from a cached claim only when the UID the
//! kubelet sent matches and the allocation names this node's pool.

use std::hash::Hasher as _;

/// The claim label whose value is [`node_label_value`] of the node the claim is allocated on.
pub const CLAIM_NODE_LABEL: &str = "gpu.kerf.dev/node";

/// Longest label value Kubernetes accepts.
const MAX_LABEL_VALUE: usize = 63;

/// The value of [`CLAIM_NODE_LABEL`] for `node`: the node name itself when it is a valid label
/// value (at most 63 characters; node names are DNS subdomains, so their characters and ends
/// always are), else its first 46 characters, `-` and 16 hex digits of its FNV-1a hash. Two
/// long names could share a value; the plugin's check of the allocation's pool keeps another
/// node's claim out of its prepares, so a shared value only costs that node a cache miss.
pub fn node_label_value(node: &str) -> String {
    if node.len() <= MAX_LABEL_VALUE && is_label_value(node) {
        return node.to_owned();
    }
    let mut hasher = fnv::FnvHasher::default();
    hasher.write(node.as_bytes());
    let prefix: String = node
        .chars()
        .take(MAX_LABEL_VALUE - 17)
        .map(|c| if is_label_char(c) { c } else { '-' })
        .collect();
    let prefix = prefix.trim_start_matches(|c: char| !c.is_ascii_alphanumeric());
    let hash = format!("{:016x}", hasher.finish());
    if prefix.is_empty() {
        hash
    } else {
        format!("{prefix}-{hash}")
    }
}

/// The label selector of one node's claims.
pub fn node_label_selector(node: &str) -> String {
    format!("{CLAIM_NODE_LABEL}={}", node_label_value(node))
}

fn is_label_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')
}

fn is_label_value(value: &str) -> bool {
    value.is_empty()
        || (value.chars().all(is_label_char)
            && value.starts_with(|c: char| c.is_ascii_alphanumeric())
            && value.ends_with(|c: char| c.is_ascii_alphanumeric()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_node_names_are_their_own_label_value() {
        assert_eq!(node_label_value("gpu-node-7"), "gpu-node-7");
        assert_eq!(
            node_label_selector("ip-10-0-1-2.ec2.internal"),
            "gpu.kerf.dev/node=ip-10-0-1-2.ec2.internal"
        );
    }

    #[test]
    fn long_node_names_get_a_valid_stable_distinct_value() {
        let a = format!("{}.example.com", "a".repeat(70));
        let b = format!("{}.example.org", "a".repeat(70));
        let (va, vb) = (node_label_value(&a), node_label_value(&b));
        for v in [&va, &vb] {
            assert!(v.len() <= MAX_LABEL_VALUE, "{v}");
            assert!(is_label_value(v), "{v}");
        }
        assert_ne!(va, vb);
        assert_eq!(va, node_label_value(&a));
        assert!(va.starts_with("aaaa"), "{va}");
    }
}
