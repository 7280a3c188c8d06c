//! Where kube-scheduler puts a pod without GPUs: its default score plugins that tell nodes
//! apart for such a pod, over the nodes whose CPU, memory and pod count fit.
//!
//! Imitates kubernetes/kubernetes `pkg/scheduler/framework/plugins/noderesources`:
//! `NodeResourcesFit` with the `LeastAllocated` strategy (`least_allocated.go`,
//! `leastResourceScorer`: per resource `(allocatable − requested) × 100 / allocatable`, cpu
//! and memory weight 1, requests with the non-zero defaults of 100m CPU and 200Mi memory) plus
//! `NodeResourcesBalancedAllocation` (`balanced_allocation.go`, `balancedResourceScorer`:
//! `(1 − |cpu fraction − memory fraction| / 2) × 100` over the actual requests), weight 1
//! each; then `selectHost`: uniformly at random among the nodes with the highest total (here
//! from the replay's seeded sequence). `TaintToleration` counts too where kerf's replay
//! taints nodes ([`taint_toleration`], weight 3). The other default score plugins (affinity,
//! topology spread, image locality) score every node alike for these pods.

use kerf_core::alloc::node_fit::{NodeResources, Resources};

use crate::rng::Rng;

/// `DefaultMilliCPURequest` and `DefaultMemoryRequest` (`pkg/scheduler/util/pod_resources.go`).
const DEFAULT_MILLI_CPU: i64 = 100;
const DEFAULT_MEMORY: i64 = 200 << 20;
const MAX_NODE_SCORE: i64 = 100;

/// Weight of `TaintToleration` in the default profile, against 1 for `NodeResourcesFit` and
/// `NodeResourcesBalancedAllocation` (`pkg/scheduler/apis/config/v1/default_plugins.go`,
/// `getDefaultPlugins`).
pub(crate) const TAINT_TOLERATION_WEIGHT: i64 = 3;

/// `TaintToleration`'s normalized score (0–100, before its weight) of a node with `count`
/// `PreferNoSchedule` taints the pod does not tolerate, when `most` is the highest count
/// among the nodes scored (those that passed the filters).
///
/// `pkg/scheduler/framework/plugins/tainttoleration/taint_toleration.go`: `Score` is
/// `countIntolerableTaintsPreferNoSchedule`, `NormalizeScore` is
/// `helper.DefaultNormalizeScore(MaxNodeScore, true, scores)`
/// (`pkg/scheduler/framework/plugins/helper/normalize_score.go`): every node 100 when no node
/// has such a taint, else `100 − 100 × count / most` in integer arithmetic.
pub(crate) fn taint_toleration(count: u32, most: u32) -> i64 {
    if most == 0 {
        return MAX_NODE_SCORE;
    }
    MAX_NODE_SCORE - MAX_NODE_SCORE * i64::from(count) / i64::from(most)
}

/// The non-zero requests of a pod (`GetNonzeroRequests`).
pub(crate) fn non_zero(request: &Resources) -> (i64, i64) {
    let cpu = if request.milli_cpu == 0 {
        DEFAULT_MILLI_CPU
    } else {
        request.milli_cpu
    };
    let memory = if request.memory == 0 {
        DEFAULT_MEMORY
    } else {
        request.memory
    };
    (cpu, memory)
}

fn least_requested(requested: i64, capacity: i64) -> i64 {
    if capacity == 0 || requested > capacity {
        return 0;
    }
    (capacity - requested) * MAX_NODE_SCORE / capacity
}

/// The sum of both plugins' scores of `pod` on `node`; `non_zero_requested` is the non-zero
/// requests of the node's pods (CPU, memory).
pub(crate) fn score(pod: &Resources, node: &NodeResources, non_zero_requested: (i64, i64)) -> i64 {
    let alloc = &node.allocatable;
    let (pod_cpu, pod_memory) = non_zero(pod);
    let mut least = 0;
    let mut weights = 0;
    for (requested, capacity) in [
        (non_zero_requested.0 + pod_cpu, alloc.milli_cpu),
        (non_zero_requested.1 + pod_memory, alloc.memory),
    ] {
        if capacity != 0 {
            least += least_requested(requested, capacity);
            weights += 1;
        }
    }
    let least = if weights == 0 { 0 } else { least / weights };
    #[allow(clippy::cast_precision_loss)]
    let fraction = |requested: i64, capacity: i64| (requested as f64 / capacity as f64).min(1.0);
    let fractions: Vec<f64> = [
        (node.requested.milli_cpu + pod.milli_cpu, alloc.milli_cpu),
        (node.requested.memory + pod.memory, alloc.memory),
    ]
    .into_iter()
    .filter(|(_, capacity)| *capacity != 0)
    .map(|(requested, capacity)| fraction(requested, capacity))
    .collect();
    let std = match fractions.as_slice() {
        [a, b] => ((a - b) / 2.0).abs(),
        _ => 0.0,
    };
    #[allow(clippy::cast_possible_truncation)]
    let balanced = ((1.0 - std) * 100.0) as i64;
    least + balanced
}

/// `selectHost` over `(node, score)`: the highest score, ties uniformly at random.
pub(crate) fn select(scores: impl Iterator<Item = (usize, i64)>, rng: &mut Rng) -> Option<usize> {
    let mut best: Option<(usize, i64)> = None;
    let mut ties = 0u64;
    for (node, score) in scores {
        match best {
            Some((_, top)) if score < top => {}
            Some((_, top)) if score == top => {
                ties += 1;
                if rng.below(ties) == 0 {
                    best = Some((node, score));
                }
            }
            _ => {
                best = Some((node, score));
                ties = 1;
            }
        }
    }
    best.map(|(node, _)| node)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: i64 = 1 << 30;

    #[test]
    fn the_least_allocated_balanced_node_wins() {
        let node = |cpu: i64, memory: i64| NodeResources {
            allocatable: Resources::cpu_memory(cpu, memory),
            allowed_pods: 110,
            ..NodeResources::default()
        };
        let pod = Resources::cpu_memory(8000, 16 * GI);
        let idle = node(32_000, 128 * GI);
        // 75 cpu, 87 memory -> 81; fractions 0.25 and 0.125 -> 93.
        assert_eq!(score(&pod, &idle, (0, 0)), 81 + 93);
        let mut busy = node(32_000, 128 * GI);
        busy.add_pod(&Resources::cpu_memory(16_000, 16 * GI));
        // 25 cpu, 75 memory -> 50; fractions 0.75, 0.25 -> 75.
        assert_eq!(score(&pod, &busy, (16_000, 16 * GI)), 50 + 75);
        let mut rng = Rng::new(1);
        assert_eq!(
            select([(0, 5), (1, 9), (2, 7)].into_iter(), &mut rng),
            Some(1)
        );
        let mut seen = [false; 3];
        for _ in 0..100 {
            let at = select([(0, 9), (1, 9), (2, 9)].into_iter(), &mut rng).unwrap();
            seen[at] = true;
        }
        assert!(seen.iter().all(|s| *s));
        assert_eq!(non_zero(&Resources::default()), (100, 200 << 20));
    }

    #[test]
    fn taint_toleration_reverses_the_count_over_the_most() {
        // DefaultNormalizeScore(100, true, [0, 1, 2, 3]): 100 − 100·c/3 in integers.
        let normalized: Vec<i64> = (0..=3).map(|c| taint_toleration(c, 3)).collect();
        assert_eq!(normalized, [100, 67, 34, 0]);
        assert_eq!(taint_toleration(0, 0), 100, "no taint anywhere: all alike");
        assert_eq!(taint_toleration(1, 1), 0);
        assert_eq!(taint_toleration(0, 1), 100);
    }

    #[test]
    fn one_taint_outweighs_the_resource_scores() {
        let node = |requested_cpu: i64| {
            let mut node = NodeResources {
                allocatable: Resources::cpu_memory(32_000, 128 * GI),
                allowed_pods: 110,
                ..NodeResources::default()
            };
            node.add_pod(&Resources::cpu_memory(requested_cpu, 0));
            node
        };
        let pod = Resources::cpu_memory(1000, GI);
        let idle = score(&pod, &node(0), (0, 0));
        let busy = score(&pod, &node(30_000), (30_000, 0));
        assert!(idle > busy, "{idle} vs {busy}");
        // The idle node carries the taint, the busy one not: weight 3 × 100 decides.
        let tainted = idle + TAINT_TOLERATION_WEIGHT * taint_toleration(1, 1);
        let clean = busy + TAINT_TOLERATION_WEIGHT * taint_toleration(0, 1);
        assert!(clean > tainted, "{clean} vs {tainted}");
    }
}
