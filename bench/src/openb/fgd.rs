//! FGD, the paper's policy, ported as the reference kerf's policies are measured against.
//!
//! Imitates hkust-adsl/kubernetes-scheduler-simulator with the run scripts' settings
//! (`-FGD 1000 -gpusel FGD -dimext share -norm max`, typical pods: CPU pods included,
//! popularity threshold 95 %, step 1):
//!
//! - Typical pods: `GetTypicalPods` (`pkg/utils/frag.go`): the trace's task shapes (CPU,
//!   GPU milli, GPU count, GPU model list), most frequent first, until they cover 95 % of
//!   the tasks, with frequencies normalized over those.
//! - A node's fragmentation: `NodeGpuShareFragAmountScore` (`pkg/utils/frag.go`): for each
//!   typical pod, weighted by its frequency, the node's free GPU milli that pod could not use:
//!   all of it when the pod needs no GPU, may not use the node's model, or does not fit (GPUs
//!   or CPU); when it fits, the free milli of the GPUs with less free than it asks for.
//! - Score: `calculateGpuShareFragExtendScore` (`pkg/simulator/plugin/fgd_score.go`):
//!   `int64(sigmoid((frag before − frag after) / 1000) × 100)`; a GPU-sharing pod tries each
//!   GPU it fits and keeps the first with the highest score (that GPU is also the one
//!   `allocateGpuIdBasedOnFGDScore` reserves); other pods take the node's fully free GPUs
//!   (`NodeResource.Sub`, `AllocateExclusiveGpuId`: lowest device numbers).
//! - Node choice: the highest score (weight 1000, no other score plugin); ties go to the
//!   lowest node name (`selectHost`, modified in the simulator's vendored kube-scheduler),
//!   and node names carry a random prefix (`syncClusterResourceList`: `rand.Perm`), so ties
//!   go to a random but fixed node order per seed.
//! - Pods without GPUs are scored the same way: the node where taking their CPU raises the
//!   fragmentation least.

use std::collections::HashMap;

use kerf_core::alloc::node_fit::Resources;

use crate::rng::Rng;

use super::data::TaskRow;
use super::inflate::{milli_per_gpu, permutation};
use super::replay::{Hosts, TraceInput};

/// Most GPUs of one node.
pub(crate) const MAX_GPUS: usize = 8;

/// A task shape as the simulator's `PodResource`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PodShape {
    /// CPU request, at least 100 (`GetNonzeroRequests`).
    pub(crate) milli_cpu: i64,
    /// GPU milli per GPU.
    pub(crate) milli_gpu: i64,
    /// GPUs.
    pub(crate) gpus: u32,
    /// `gpu_spec`, `|`-joined; empty for any.
    pub(crate) gpu_type: String,
}

impl PodShape {
    /// The shape of `task`.
    pub(crate) fn of(task: &TaskRow) -> Self {
        PodShape {
            milli_cpu: if task.milli_cpu == 0 {
                100
            } else {
                task.milli_cpu
            },
            milli_gpu: i64::try_from(milli_per_gpu(task)).unwrap_or(0),
            gpus: task.num_gpu,
            gpu_type: task.gpu_spec.join("|"),
        }
    }
}

/// One typical pod: a shape and its frequency.
#[derive(Debug, Clone)]
struct Typical {
    milli_cpu: i64,
    milli_gpu: i64,
    gpus: usize,
    /// Per model of the cluster: whether the pod may use it.
    access: Vec<bool>,
    freq: f64,
}

/// The typical pods, and the cluster's models they were resolved against.
#[derive(Debug, Clone)]
pub(crate) struct TypicalPods {
    shapes: Vec<Typical>,
}

/// Whether a pod of GPU type `gpu_type` may use a node of `model`
/// (`IsNodeAccessibleToPodByType`, `pkg/utils/utils.go`).
pub(crate) fn accessible(gpu_type: &str, model: &str) -> bool {
    let mut named = gpu_type.split('|').filter(|t| !t.is_empty()).peekable();
    if named.peek().is_none() {
        return true;
    }
    !model.is_empty() && named.any(|t| t == model)
}

impl TypicalPods {
    /// `GetTypicalPods` over `tasks`; `models` are the cluster's models, by model id.
    pub(crate) fn new(tasks: &[TaskRow], models: &[String]) -> Self {
        let mut counts: HashMap<PodShape, f64> = HashMap::new();
        for task in tasks {
            *counts.entry(PodShape::of(task)).or_default() += 1.0;
        }
        let mut sorted: Vec<(PodShape, f64)> = counts.into_iter().collect();
        // sort.Reverse of (count, then PodResource.Less): most frequent first, ties by the
        // larger shape.
        sorted.sort_by(|(a, ca), (b, cb)| cb.total_cmp(ca).then_with(|| b.cmp(a)));
        #[allow(clippy::cast_precision_loss)]
        let expected = 95.0 * tasks.len() as f64 / 100.0;
        let mut covered = 0.0;
        let mut taken = 0;
        while covered < expected && taken < sorted.len() {
            covered += sorted[taken].1;
            taken += 1;
        }
        sorted.truncate(taken);
        let shapes = sorted
            .into_iter()
            .map(|(shape, count)| Typical {
                milli_cpu: shape.milli_cpu,
                milli_gpu: shape.milli_gpu,
                gpus: shape.gpus as usize,
                access: models
                    .iter()
                    .map(|m| accessible(&shape.gpu_type, m))
                    .collect(),
                freq: count / covered,
            })
            .collect();
        TypicalPods { shapes }
    }

    /// How many shapes.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shapes.len()
    }

    /// `NodeGpuShareFragAmountScore` of a node of model `model` with `cpu_left` milli CPU and
    /// `left` milli free on each GPU.
    pub(crate) fn frag(&self, model: usize, cpu_left: i64, left: &[i64]) -> f64 {
        let total: i64 = left.iter().sum();
        #[allow(clippy::cast_precision_loss)]
        let total_f = total as f64;
        let mut frag = 0.0;
        for shape in &self.shapes {
            let all = shape.milli_gpu == 0
                || !shape.access.get(model).copied().unwrap_or(false)
                || cpu_left < shape.milli_cpu
                || left.iter().filter(|&&l| l >= shape.milli_gpu).count() < shape.gpus;
            if all {
                frag += shape.freq * total_f;
            } else {
                let unusable: i64 = left.iter().filter(|&&l| l < shape.milli_gpu).sum();
                #[allow(clippy::cast_precision_loss)]
                let unusable = unusable as f64;
                frag += shape.freq * unusable;
            }
        }
        frag
    }
}

/// `int64(sigmoid((before − after) / 1000) × MaxNodeScore)`.
#[allow(clippy::cast_possible_truncation)]
pub(crate) fn score(removed: f64) -> i64 {
    let sigmoid = 1.0 / (1.0 + (-removed / 1000.0).exp());
    (sigmoid * 100.0) as i64
}

/// A node as FGD sees it.
#[derive(Debug, Clone)]
pub(crate) struct FgdNode {
    /// Model id (index into the cluster's models); nodes without GPUs have one too.
    pub(crate) model: usize,
    pub(crate) cpu_left: i64,
    /// Free milli per GPU, by device number.
    pub(crate) left: Vec<i64>,
    /// Scores already computed for this state: (shape id, score, first GPU).
    cache: Vec<(u32, i64, u8)>,
    /// `frag` of this state, once computed.
    frag: Option<f64>,
}

impl FgdNode {
    /// An idle node.
    pub(crate) fn new(model: usize, milli_cpu: i64, gpus: usize) -> Self {
        FgdNode {
            model,
            cpu_left: milli_cpu,
            left: vec![1000; gpus],
            cache: Vec::new(),
            frag: None,
        }
    }

    fn frag(&mut self, typical: &TypicalPods) -> f64 {
        *self
            .frag
            .get_or_insert_with(|| typical.frag(self.model, self.cpu_left, &self.left))
    }

    /// Whether the GPUs fit `shape` (the Open-Gpu-Share filter; model access apart).
    pub(crate) fn gpus_fit(&self, shape: &PodShape) -> bool {
        shape.milli_gpu == 0
            || self.left.iter().filter(|&&l| l >= shape.milli_gpu).count() >= shape.gpus as usize
    }

    /// FGD's score of `shape` (id `id`) here and the first GPU it takes (0 for a pod
    /// without GPUs).
    pub(crate) fn score(&mut self, id: u32, shape: &PodShape, typical: &TypicalPods) -> (i64, u8) {
        if let Some(&(_, score, gpu)) = self.cache.iter().find(|(s, _, _)| *s == id) {
            return (score, gpu);
        }
        let before = self.frag(typical);
        let cpu = self.cpu_left - shape.milli_cpu;
        let mut after = [0i64; MAX_GPUS];
        let gpus = self.left.len().min(MAX_GPUS);
        after[..gpus].copy_from_slice(&self.left[..gpus]);
        let (score, gpu) = if shape.gpus == 1 && shape.milli_gpu < 1000 {
            let mut best: Option<(i64, u8)> = None;
            for i in 0..gpus {
                if self.left[i] < shape.milli_gpu {
                    continue;
                }
                after[i] -= shape.milli_gpu;
                let s = score(before - typical.frag(self.model, cpu, &after[..gpus]));
                after[i] += shape.milli_gpu;
                if best.is_none_or(|(b, _)| s > b) {
                    best = Some((s, u8::try_from(i).unwrap_or(0)));
                }
            }
            best.unwrap_or((0, 0))
        } else {
            take_free(&mut after[..gpus], shape);
            (
                score(before - typical.frag(self.model, cpu, &after[..gpus])),
                0,
            )
        };
        self.cache.push((id, score, gpu));
        (score, gpu)
    }

    /// Places `shape` with its first GPU `gpu` (see [`FgdNode::score`]).
    pub(crate) fn take(&mut self, shape: &PodShape, gpu: u8) {
        self.cpu_left -= shape.milli_cpu;
        if shape.gpus == 1 && shape.milli_gpu < 1000 {
            self.left[usize::from(gpu)] -= shape.milli_gpu;
        } else if shape.milli_gpu > 0 {
            let mut need = shape.gpus;
            for left in &mut self.left {
                if need > 0 && *left == 1000 {
                    *left = 0;
                    need -= 1;
                }
            }
        }
        self.cache.clear();
        self.frag = None;
    }

    /// The node's CPU changed by a placement FGD did not make.
    pub(crate) fn take_cpu(&mut self, milli_cpu: i64) {
        self.cpu_left -= milli_cpu;
        self.cache.clear();
        self.frag = None;
    }
}

/// `NodeResource.Sub`'s GPUs: the least free GPUs that fit, one per GPU asked.
fn take_free(left: &mut [i64], shape: &PodShape) {
    let mut order: Vec<usize> = (0..left.len()).collect();
    order.sort_by_key(|&i| left[i]);
    let mut need = shape.gpus;
    for i in order {
        if need == 0 || shape.milli_gpu == 0 {
            break;
        }
        if left[i] >= shape.milli_gpu {
            left[i] -= shape.milli_gpu;
            need -= 1;
        }
    }
}

/// The FGD port's nodes and its tie order.
pub(crate) struct FgdState {
    nodes: Vec<FgdNode>,
    /// Rank of each node among equal scores (lower wins).
    rank: Vec<usize>,
}

impl FgdState {
    /// The cluster of `input`, idle, with node ranks drawn from `seed`.
    pub(crate) fn new(input: &TraceInput, seed: u64) -> Self {
        let nodes = input
            .cluster
            .nodes
            .iter()
            .zip(&input.node_model)
            .map(|(n, &model)| FgdNode::new(model, n.milli_cpu, n.gpus as usize))
            .collect();
        let mut rng = Rng::new(seed ^ 0x6e6f_6465);
        FgdState {
            nodes,
            rank: permutation(input.cluster.nodes.len(), &mut rng),
        }
    }

    /// Places task `t` (its pod `pod`) on the node of the highest score; `None` when none
    /// fits.
    pub(crate) fn place(
        &mut self,
        input: &TraceInput,
        t: usize,
        pod: &Resources,
        hosts: &Hosts,
    ) -> Option<usize> {
        let id = input.shape_ids[t];
        let shape = &input.shapes[id as usize];
        let mut best: Option<(i64, usize, usize, u8)> = None;
        for at in 0..self.nodes.len() {
            let node = &mut self.nodes[at];
            let model = &input.models[node.model];
            if !hosts.fits(at, pod)
                || (shape.milli_gpu > 0 && !accessible(&shape.gpu_type, model))
                || !node.gpus_fit(shape)
            {
                continue;
            }
            let (score, gpu) = node.score(id, shape, &input.typical);
            let rank = self.rank[at];
            if best.is_none_or(|(s, r, _, _)| score > s || (score == s && rank < r)) {
                best = Some((score, rank, at, gpu));
            }
        }
        let (_, _, at, gpu) = best?;
        self.nodes[at].take(shape, gpu);
        Some(at)
    }

    /// Node `at`'s CPU was taken by a pod FGD did not place.
    pub(crate) fn take_cpu(&mut self, at: usize, milli_cpu: i64) {
        self.nodes[at].take_cpu(milli_cpu);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(cpu: i64, num_gpu: u32, gpu_milli: u32) -> TaskRow {
        TaskRow {
            name: "t".into(),
            milli_cpu: cpu,
            memory_mib: 1024,
            num_gpu,
            gpu_milli,
            gpu_spec: Vec::new(),
        }
    }

    #[test]
    fn typical_pods_are_the_frequent_shapes_and_fragmentation_follows_frag_go() {
        let mut tasks = vec![task(1000, 1, 500); 10];
        tasks.extend(vec![task(2000, 1, 1000); 9]);
        tasks.push(task(4000, 0, 0));
        let typical = TypicalPods::new(&tasks, &["G2".to_owned()]);
        // 95 % of 20 tasks: the two GPU shapes (19 tasks), not the CPU one.
        assert_eq!(typical.len(), 2);
        // Free milli 1000 and 300: both shapes fit the first GPU; 300 is fragment to both.
        let frag = typical.frag(0, 8000, &[1000, 300]);
        assert!((frag - 300.0).abs() < 1e-9, "{frag}");
        // With 1.5 CPUs free the whole-GPU shape (2 CPUs) fits nowhere: all 1300 for it.
        let frag = typical.frag(0, 1500, &[1000, 300]);
        let expected = 10.0 / 19.0 * 300.0 + 9.0 / 19.0 * 1300.0;
        assert!((frag - expected).abs() < 1e-9, "{frag} vs {expected}");
    }

    #[test]
    fn scores_are_fgds_sigmoid_percent_and_models_match_by_name() {
        assert_eq!(score(0.0), 50);
        assert_eq!(score(1000.0), 73);
        assert_eq!(score(-1000.0), 26);
        assert!(accessible("", "T4"));
        assert!(accessible("V100M16|T4", "T4"));
        assert!(!accessible("V100M16|V100M32", "T4"));
        assert!(!accessible("T4", ""));
    }

    #[test]
    fn a_share_takes_the_gpu_of_the_best_score_and_whole_gpus_the_first_free() {
        let tasks = vec![task(1000, 1, 500), task(1000, 1, 500), task(1000, 1, 1000)];
        let typical = TypicalPods::new(&tasks, &["G2".to_owned()]);
        let mut node = FgdNode::new(0, 64_000, 3);
        node.left = vec![1000, 600, 500];
        // 500 milli on the GPU with 500 left leaves 1000 and 600, both usable.
        let share = PodShape::of(&task(1000, 1, 500));
        let (_, gpu) = node.score(0, &share, &typical);
        assert_eq!(gpu, 2);
        node.take(&share, gpu);
        assert_eq!(node.left, [1000, 600, 0]);
        assert_eq!(node.cpu_left, 63_000);
        let whole = PodShape::of(&task(1000, 1, 1000));
        assert!(node.gpus_fit(&whole));
        node.take(&whole, 0);
        assert_eq!(node.left, [0, 600, 0]);
        assert!(!node.gpus_fit(&whole));
    }
}
