//! Where kube-scheduler will put the pods without GPUs, and what they cost there: the part of
//! the LeastFragmentation policy that looks past the pod being placed.
//!
//! kerf places the pods with GPUs; kube-scheduler places the others, and with its default
//! scoring (NodeResourcesFit `LeastAllocated` on CPU and memory, plus
//! `NodeResourcesBalancedAllocation`) it puts each on the least allocated node: an idle node
//! beats any used one. Such a pod on a node whose CPU its GPUs need strands those GPUs. So
//! when kerf uses one of the nodes kube-scheduler would pick next, it prefers those where a
//! pod without GPUs would strand the most, leaving the ones with CPU to spare as the least
//! allocated.

use super::frag::{Distribution, FreeGpu, HostAmounts, HostState};
use super::hash::FastMap;
use super::index::{Index, NodeEntry};

/// Weight of the stranding a pod without GPUs would cause on a node, against the
/// fragmentation the pod being placed causes (both in GPUs; measured on the openb trace).
const STEER_WEIGHT: f64 = 5.0;
const MAX_NODE_SCORE: i64 = 100;

/// kube-scheduler's default score of a pod asking `pod` on a node: `LeastAllocated` over CPU
/// and memory (weights 1) plus `BalancedAllocation`, 0–200, as
/// kubernetes/kubernetes `pkg/scheduler/framework/plugins/noderesources`
/// (`least_allocated.go` `leastResourceScorer`, `balanced_allocation.go`
/// `balancedResourceScorer`) compute them. Unlike kube-scheduler, requests of zero are not
/// raised to its non-zero defaults.
pub fn default_score(pod: HostAmounts, node: &HostState) -> i64 {
    let pairs = [
        (
            node.requested.milli_cpu + pod.milli_cpu,
            node.allocatable.milli_cpu,
        ),
        (node.requested.memory + pod.memory, node.allocatable.memory),
    ];
    let mut least = 0;
    let mut weights = 0;
    let mut fractions = [0.0; 2];
    let mut counted = 0;
    for (requested, capacity) in pairs {
        if capacity <= 0 {
            continue;
        }
        if requested <= capacity {
            least += (capacity - requested) * MAX_NODE_SCORE / capacity;
        }
        weights += 1;
        #[allow(clippy::cast_precision_loss)]
        let fraction = (requested as f64 / capacity as f64).min(1.0);
        fractions[counted] = fraction;
        counted += 1;
    }
    let least = if weights == 0 { 0 } else { least / weights };
    let std = if counted == 2 {
        ((fractions[0] - fractions[1]) / 2.0).abs()
    } else {
        0.0
    };
    #[allow(clippy::cast_possible_truncation)]
    let balanced = ((1.0 - std) * 100.0) as i64;
    least + balanced
}

/// The nodes kube-scheduler would pick next for the mean pod without GPUs, with the
/// stranding that pod would cause on each.
pub(super) struct Steering {
    /// Node order → stranding, for the nodes of the top score.
    top: FastMap<u64, f64>,
    mean: f64,
}

impl Steering {
    /// The steering for the index's nodes whose host state `hosts` knows; `None` when the
    /// distribution has no pods without GPUs or no node qualifies.
    pub(super) fn new(
        index: &Index,
        dist: &Distribution,
        hosts: &dyn Fn(&str) -> Option<HostState>,
    ) -> Option<Steering> {
        let pod = dist.no_gpu_host?;
        dist.per_gpu?;
        let mut best = i64::MIN;
        let mut top: Vec<(&NodeEntry, HostAmounts)> = Vec::new();
        for node in index.entries() {
            let Some(host) = hosts(&node.name) else {
                continue;
            };
            let free = host.free();
            if free.milli_cpu < pod.milli_cpu || free.memory < pod.memory {
                continue;
            }
            let score = default_score(pod, &host);
            if score > best {
                best = score;
                top.clear();
            }
            if score == best {
                top.push((node, free));
            }
        }
        if top.len() < 2 {
            return None;
        }
        let mut stranding = FastMap::default();
        let mut sum = 0.0;
        for (node, free) in &top {
            let gpus: f64 = node
                .gpus
                .iter()
                .map(|g| FreeGpu::new(&g.free, g.info.memory_bytes).share)
                .sum();
            let after = HostAmounts {
                milli_cpu: free.milli_cpu - pod.milli_cpu,
                memory: free.memory - pod.memory,
            };
            let cost = dist.stranded(gpus, after) - dist.stranded(gpus, *free);
            sum += cost;
            stranding.insert(node.order, cost);
        }
        #[allow(clippy::cast_precision_loss)]
        let mean = sum / top.len() as f64;
        Some(Steering {
            top: stranding,
            mean,
        })
    }

    /// What using `node` saves (in GPUs, weighted): positive for a node kube-scheduler would
    /// pick next where a pod without GPUs would strand more than on the others it would pick.
    pub(super) fn bonus(&self, node: &NodeEntry) -> f64 {
        self.top
            .get(&node.order)
            .map_or(0.0, |cost| STEER_WEIGHT * (cost - self.mean))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: i64 = 1 << 30;

    #[test]
    fn the_default_score_is_least_allocated_plus_balanced() {
        let node = HostState {
            allocatable: HostAmounts {
                milli_cpu: 32_000,
                memory: 128 * GI,
            },
            requested: HostAmounts::default(),
        };
        let pod = HostAmounts {
            milli_cpu: 8000,
            memory: 16 * GI,
        };
        // cpu 75, memory 87 -> 81; fractions 0.25 and 0.125 -> 93.
        assert_eq!(default_score(pod, &node), 81 + 93);
        let idle = default_score(HostAmounts::default(), &node);
        assert_eq!(idle, 200);
    }
}
