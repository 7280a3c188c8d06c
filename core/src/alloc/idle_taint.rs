//! The `PreferNoSchedule` node taint that keeps pods without GPUs off nodes with idle GPUs.
//!
//! kerf places the pods with GPUs; kube-scheduler places the others, and its default
//! `NodeResourcesFit` (`LeastAllocated`) puts each on the node with the most free CPU and
//! memory, which is most often a node whose GPUs are all idle. Each such pod takes CPU an
//! idle GPU node's future multi-GPU pods need, and once the idle nodes with spare CPU are
//! gone, whole 8-GPU nodes are stranded by pods that use none of their GPUs.
//!
//! kube-scheduler's default profile has a way to steer such pods without filtering any node:
//! its `TaintToleration` plugin (kubernetes/kubernetes
//! `pkg/scheduler/framework/plugins/tainttoleration/taint_toleration.go`) scores a node by
//! the count of its `PreferNoSchedule` taints the pod does not tolerate
//! (`countIntolerableTaintsPreferNoSchedule`), `NormalizeScore` reverses that with
//! `helper.DefaultNormalizeScore(MaxNodeScore, true, …)`
//! (`pkg/scheduler/framework/plugins/helper/normalize_score.go`: 100 − 100 × count / the
//! highest count among the scored nodes; 100 everywhere when no node has one), and the
//! plugin weighs 3 in the default profile (`pkg/scheduler/apis/config/v1/default_plugins.go`,
//! `getDefaultPlugins`) against 1 each for `NodeResourcesFit` and
//! `NodeResourcesBalancedAllocation` (0–100 each). So one taint on the nodes with an idle
//! GPU, which pods without GPUs do not tolerate, weighs 300 against at most 200 for the
//! resource scores: such a pod goes to a node whose GPUs are all in use whenever one fits,
//! and to a tainted node only when none does. A `PreferNoSchedule` taint never filters, so
//! no pod is kept from running, and pods with GPUs are placed on the node kerf chose (the
//! controller's allocation decides their node), taint or not. When every node carries the
//! taint, every node scores the same for it and kube-scheduler places as without it.
//!
//! Measured on the openb trace (`kerf-bench openb`, 10 traces × 10 seeds): with this taint,
//! kerf's default reaches or beats the paper's FGD on every trace (it missed `cpu250`,
//! `multigpu20` and `multigpu30` by 0.8–2.4 pp without it). Tried and dropped (3 seeds,
//! against this taint): the taint on fully idle nodes only (−6.6 pp on `cpu250`: pods
//! without GPUs then fill the partly used nodes, whose idle GPUs need that CPU), one taint
//! per idle GPU (normalized, the resource scores can then outweigh the difference between
//! nodes with a few and many idle GPUs: −1.0 pp on `cpu250`), and the taint only where, or
//! only while, the learned workload has multi-GPU kinds that the idle GPUs fit (−1.0 to
//! −1.2 pp on `cpu250`, up to −0.9 pp on `multigpu20`).

use super::index::NodeView;
use super::taint::{DeviceTaint, untolerated};

/// Key of the node taint, with [`IDLE_GPUS_TAINT_EFFECT`] and no value.
pub const IDLE_GPUS_TAINT_KEY: &str = "gpu.kerf.dev/idle-gpus";

/// Effect of the node taint, as the Node API spells it (`spec.taints[].effect`).
pub const IDLE_GPUS_TAINT_EFFECT: &str = "PreferNoSchedule";

/// Whether `node` should carry the [`IDLE_GPUS_TAINT_KEY`] taint: some GPU of it is used by
/// no claim and [`idle_gpu_counts`]. O(GPUs of the node).
pub fn wants_idle_gpus_taint(node: NodeView<'_>) -> bool {
    node.idle_gpus() > 0
        && node
            .gpus()
            .any(|gpu| gpu.is_idle() && idle_gpu_counts(&gpu.info().taints))
}

/// Whether an idle GPU with device `taints` makes its node want the taint: none of them keeps
/// it from a request without tolerations (an idle GPU marked unhealthy is not worth keeping
/// CPU free for).
pub fn idle_gpu_counts(taints: &[DeviceTaint]) -> bool {
    untolerated(taints, &[]).is_none()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::{DeviceUse, GpuInfo, Index, NodeGpus, TaintEffect};
    use crate::inventory::ComputeCapability;

    const GI: u64 = 1 << 30;

    fn gpu(device: &str, taints: Vec<DeviceTaint>) -> GpuInfo {
        GpuInfo {
            device: device.into(),
            uuid: format!("GPU-{device}"),
            product: "H100".into(),
            memory_bytes: 80 * GI,
            multiprocessors: 132,
            compute_capability: ComputeCapability { major: 9, minor: 0 },
            nvlink_domain: None,
            pcie_root: None,
            numa: None,
            taints,
        }
    }

    fn tainted(effect: TaintEffect) -> Vec<DeviceTaint> {
        vec![DeviceTaint {
            key: "gpu.kerf.dev/unhealthy".into(),
            value: "xid-79".into(),
            effect,
        }]
    }

    fn wants(index: &Index, node: &str) -> bool {
        wants_idle_gpus_taint(index.node(node).unwrap())
    }

    #[test]
    fn nodes_with_an_idle_usable_gpu_are_tainted() {
        let mut index = Index::new();
        for node in ["idle", "half", "sliced", "full", "none", "sick", "marked"] {
            let taints = match node {
                "sick" => tainted(TaintEffect::NoExecute),
                "marked" => tainted(TaintEffect::None),
                _ => Vec::new(),
            };
            let gpus = if node == "none" {
                Vec::new()
            } else {
                vec![gpu("gpu-0", Vec::new()), gpu("gpu-1", taints)]
            };
            index.upsert_node(NodeGpus {
                node: node.into(),
                gpus,
            });
        }
        index.set_claim_usage("a", vec![DeviceUse::whole("half", "gpu-0")]);
        index.set_claim_usage("b", vec![DeviceUse::slice("sliced", "gpu-0", 8 * GI, 10)]);
        let both = vec![
            DeviceUse::whole("full", "gpu-0"),
            DeviceUse::slice("full", "gpu-1", 8 * GI, 10),
        ];
        index.set_claim_usage("c", both);
        for node in ["sick", "marked"] {
            index.set_claim_usage(node, vec![DeviceUse::whole(node, "gpu-0")]);
        }
        assert!(wants(&index, "idle"));
        assert!(wants(&index, "half"));
        assert!(wants(&index, "sliced"), "gpu-1 is still idle");
        assert!(!wants(&index, "full"), "a slice of a GPU is a use of it");
        assert!(!wants(&index, "none"));
        assert!(
            !wants(&index, "sick"),
            "its only idle GPU is tainted NoExecute"
        );
        assert!(
            wants(&index, "marked"),
            "a taint of effect None keeps nothing off"
        );
    }
}
