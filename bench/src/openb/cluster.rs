//! The openb cluster and tasks in kerf's terms: nodes as [`NodeGpus`] with their CPU and
//! memory as [`NodeResources`], tasks as a [`PodRequest`] with the pod's CPU and memory as
//! [`Resources`].
//!
//! - A GPU is a [`GpuInfo`] whose product is the trace's model (`V100M16`, `T4`, `G2`, …) and
//!   whose memory is the model's ([`model_memory`]).
//! - A task that shares a GPU (`num_gpu` = 1, `gpu_milli` < 1000) asks for one slice of
//!   `gpu_milli`/10 percent of the compute and the same share of the memory of the smallest
//!   GPU it may use; on larger GPUs its memory share is smaller, so compute decides what fits,
//!   as `gpu_milli` alone decides in the paper's simulator.
//! - A task with `num_gpu` ≥ 1 whole GPUs asks for that many whole GPUs on one node.
//! - `gpu_spec` becomes the request's selector on product names.
//! - A node's allocatable pods are 1001, as in the simulator's node list.

use kerf_core::alloc::node_fit::{NodeResources, Resources};
use kerf_core::alloc::{
    ClaimRequest, DeviceRequest, GpuInfo, GpuSelector, NodeGpus, PodRequest, Policy, SliceSize,
};
use kerf_core::inventory::ComputeCapability;

use super::data::{NodeRow, TaskRow};
use super::inflate::{MILLI, milli_per_gpu};

const GIB: u64 = 1 << 30;
const MIB: i64 = 1 << 20;
/// `pods` allocatable of every node in the simulator's `openb_node_list_gpu_node.yaml`.
pub(crate) const ALLOWED_PODS: i64 = 1001;

/// Memory of a GPU of `model`, in bytes: the public figure for the named models; G1–G3 are
/// undisclosed and get plausible data-center sizes (they do not change what fits: compute
/// decides, see the module docs).
pub(crate) fn model_memory(model: &str) -> u64 {
    GIB * match model {
        "A10" => 24,
        "V100M32" => 32,
        "G2" => 40,
        "G3" => 80,
        // V100M16, P100, T4, G1 and anything else.
        _ => 16,
    }
}

fn compute_capability(model: &str) -> ComputeCapability {
    let (major, minor) = match model {
        "P100" => (6, 0),
        "V100M16" | "V100M32" => (7, 0),
        "T4" => (7, 5),
        "A10" => (8, 6),
        _ => (8, 0),
    };
    ComputeCapability { major, minor }
}

/// The cluster of one replay.
#[derive(Debug, Clone)]
pub(crate) struct Cluster {
    pub(crate) nodes: Vec<NodeRow>,
    /// GPUs of all nodes.
    pub(crate) gpus: u64,
    /// Memory of the smallest GPU model of the cluster.
    min_gpu_memory: u64,
}

impl Cluster {
    /// The cluster of `nodes` (nodes without GPUs included, as given).
    pub(crate) fn new(nodes: Vec<NodeRow>) -> Self {
        let gpus = nodes.iter().map(|n| u64::from(n.gpus)).sum();
        let min_gpu_memory = nodes
            .iter()
            .filter(|n| n.gpus > 0)
            .map(|n| model_memory(&n.model))
            .min()
            .unwrap_or(16 * GIB);
        Cluster {
            nodes,
            gpus,
            min_gpu_memory,
        }
    }

    /// GPU milli of all nodes.
    pub(crate) fn milli(&self) -> u64 {
        self.gpus * MILLI
    }

    /// Node `at`'s GPUs, named `gpu-0` …, the node named by its slot `at` (so that a
    /// replay finds a node's CPU and memory without a lookup by name).
    pub(crate) fn node_gpus(&self, at: usize) -> NodeGpus {
        let node = &self.nodes[at];
        let gpus = (0..node.gpus)
            .map(|i| GpuInfo {
                device: format!("gpu-{i}"),
                uuid: format!("GPU-{}-{i}", node.name),
                product: node.model.clone(),
                memory_bytes: model_memory(&node.model),
                multiprocessors: 80,
                compute_capability: compute_capability(&node.model),
                nvlink_domain: None,
                pcie_root: None,
                numa: None,
                taints: Vec::new(),
            })
            .collect();
        NodeGpus {
            node: at.to_string(),
            gpus,
        }
    }

    /// Node `at`'s CPU, memory and pods, nothing requested yet.
    pub(crate) fn node_resources(&self, at: usize) -> NodeResources {
        let node = &self.nodes[at];
        NodeResources {
            allocatable: Resources::cpu_memory(node.milli_cpu, node.memory_mib * MIB),
            allowed_pods: ALLOWED_PODS,
            ..NodeResources::default()
        }
    }

    /// Memory of the smallest GPU `task` may use.
    fn smallest_memory(&self, task: &TaskRow) -> u64 {
        task.gpu_spec
            .iter()
            .map(|m| model_memory(m))
            .min()
            .unwrap_or(self.min_gpu_memory)
    }

    /// The task's GPU request as one claim (`key`) of one request, or `None` for a task
    /// without GPUs.
    pub(crate) fn pod_request(
        &self,
        task: &TaskRow,
        key: String,
        policy: Policy,
    ) -> Option<PodRequest> {
        let milli = milli_per_gpu(task);
        if milli == 0 {
            return None;
        }
        let mut request = if milli < MILLI {
            let memory = self.smallest_memory(task) * milli / MILLI;
            DeviceRequest::slices("gpu", 1, slice_size(milli, memory))
        } else {
            DeviceRequest::whole("gpu", task.num_gpu)
        };
        request.policy = policy;
        request.selector = GpuSelector {
            product_names: task.gpu_spec.clone(),
            ..GpuSelector::default()
        };
        Some(PodRequest {
            claims: vec![ClaimRequest {
                key,
                requests: vec![request],
            }],
        })
    }
}

/// A slice of `milli` thousandths of compute (rounded up to a whole percent) and `memory`
/// bytes.
fn slice_size(milli: u64, memory: u64) -> SliceSize {
    SliceSize {
        memory_bytes: memory,
        compute_percent: u8::try_from(milli.div_ceil(10)).unwrap_or(100),
    }
}

/// What the task's pod requests of its node: CPU and memory.
pub(crate) fn host_request(task: &TaskRow) -> Resources {
    Resources::cpu_memory(task.milli_cpu, task.memory_mib * MIB)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, gpus: u32, model: &str) -> NodeRow {
        NodeRow {
            name: name.into(),
            milli_cpu: 96_000,
            memory_mib: 393_216,
            gpus,
            model: model.into(),
        }
    }

    fn task(num_gpu: u32, gpu_milli: u32, spec: &[&str]) -> TaskRow {
        TaskRow {
            name: "t".into(),
            milli_cpu: 4000,
            memory_mib: 15_258,
            num_gpu,
            gpu_milli,
            gpu_spec: spec.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn shares_whole_gpus_and_models_map_to_requests() {
        let cluster = Cluster::new(vec![node("a", 8, "G2"), node("b", 2, "T4")]);
        assert_eq!(cluster.milli(), 10_000);
        let gpus = cluster.node_gpus(1);
        assert_eq!(gpus.gpus.len(), 2);
        assert_eq!(gpus.gpus[1].device, "gpu-1");
        assert_eq!(gpus.gpus[1].product, "T4");
        assert_eq!(gpus.gpus[1].memory_bytes, 16 * GIB);

        let share = cluster
            .pod_request(&task(1, 470, &[]), "k".into(), Policy::Spread)
            .unwrap();
        let request = &share.claims[0].requests[0];
        assert_eq!(request.count, 1);
        assert_eq!(request.policy, Policy::Spread);
        // 47 % of the compute, 47 % of the smallest GPU's (T4) memory.
        assert_eq!(
            request.slice,
            Some(SliceSize {
                memory_bytes: 16 * GIB * 470 / 1000,
                compute_percent: 47
            })
        );
        let whole = cluster
            .pod_request(
                &task(4, 1000, &["V100M32", "A10"]),
                "k".into(),
                Policy::BinPack,
            )
            .unwrap();
        let request = &whole.claims[0].requests[0];
        assert_eq!((request.count, request.slice), (4, None));
        assert_eq!(request.selector.product_names, ["V100M32", "A10"]);
        // A typed share takes the share of its smallest allowed model.
        let typed = cluster
            .pod_request(
                &task(1, 500, &["V100M32", "A10"]),
                "k".into(),
                Policy::BinPack,
            )
            .unwrap();
        assert_eq!(
            typed.claims[0].requests[0].slice.unwrap().memory_bytes,
            24 * GIB / 2
        );
        assert!(
            cluster
                .pod_request(&task(0, 0, &[]), "k".into(), Policy::BinPack)
                .is_none()
        );
        let host = host_request(&task(1, 470, &[]));
        assert_eq!((host.milli_cpu, host.memory), (4000, 15_258 * MIB));
        assert_eq!(cluster.node_resources(0).allowed_pods, ALLOWED_PODS);
    }
}
