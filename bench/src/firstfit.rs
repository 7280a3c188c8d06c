//! The baseline allocator: what kube-scheduler's structured-parameters allocator does with
//! the same devices, written here over the same [`Index`] so that the packing comparison
//! differs only in the choices made.
//!
//! Within a node the structured allocator takes the first devices in inventory order that
//! satisfy the request (for a `matchAttribute` constraint such as one NVLink domain, the
//! first combination in that order, found by backtracking), with no scoring. Which node the
//! pod lands on is the scheduler framework's choice, modelled by [`NodeChoice`].

use kerf_core::alloc::{DeviceRequest, DeviceUse, GpuView, Index, NodeView, TopologyScope};

use crate::rng::Rng;

/// How the baseline chooses among nodes where the request fits.
#[derive(Debug, Clone)]
pub enum NodeChoice {
    /// The first node by name: plain first-fit over the whole cluster.
    InOrder,
    /// As kube-scheduler: search feasible nodes from a start index that rotates from one
    /// pod to the next, stop after `numFeasibleNodesToFind` of them (42 % of 1,000 nodes),
    /// and pick one at random, because no DRA plugin scores devices and every feasible node
    /// scores the same (ties are broken at random).
    Scheduler(Rng),
}

/// Where the baseline put one claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FitPlacement {
    /// The node.
    pub node: String,
    /// The devices, in inventory order.
    pub devices: Vec<String>,
}

impl FitPlacement {
    /// The usage this placement puts on the index for `request`.
    pub fn device_uses(&self, request: &DeviceRequest) -> Vec<DeviceUse> {
        self.devices
            .iter()
            .map(|device| match request.slice {
                None => DeviceUse::whole(&self.node, device),
                Some(size) => {
                    DeviceUse::slice(&self.node, device, size.memory_bytes, size.compute_percent)
                }
            })
            .collect()
    }
}

/// The first-fit baseline allocator.
#[derive(Debug, Clone)]
pub struct FirstFit {
    /// Node names in inventory (name) order.
    nodes: Vec<String>,
    choice: NodeChoice,
    next_start: usize,
    feasible: Vec<(usize, Vec<usize>)>,
}

impl FirstFit {
    /// A baseline over the nodes `index` knows now.
    pub fn new(index: &Index, choice: NodeChoice) -> Self {
        let mut nodes: Vec<String> = index.nodes().map(|n| n.name().to_owned()).collect();
        nodes.sort();
        FirstFit {
            nodes,
            choice,
            next_start: 0,
            feasible: Vec::new(),
        }
    }

    /// Where `request` goes, or `None` when it fits nowhere.
    pub fn place(&mut self, index: &Index, request: &DeviceRequest) -> Option<FitPlacement> {
        let n = self.nodes.len();
        let chosen = match &mut self.choice {
            NodeChoice::InOrder => self.nodes.iter().enumerate().find_map(|(at, name)| {
                let node = index.node(name)?;
                fit_on_node(node, request).map(|picks| (at, picks))
            }),
            NodeChoice::Scheduler(rng) => {
                let wanted = feasible_nodes_to_find(n);
                self.feasible.clear();
                let mut processed = 0;
                for offset in 0..n {
                    let at = (self.next_start + offset) % n;
                    processed += 1;
                    let Some(node) = index.node(&self.nodes[at]) else {
                        continue;
                    };
                    if let Some(picks) = fit_on_node(node, request) {
                        self.feasible.push((at, picks));
                        if self.feasible.len() >= wanted {
                            break;
                        }
                    }
                }
                self.next_start = (self.next_start + processed) % n.max(1);
                let pick = rng.index(self.feasible.len());
                (!self.feasible.is_empty()).then(|| self.feasible.swap_remove(pick))
            }
        };
        let (at, picks) = chosen?;
        let node = index.node(&self.nodes[at])?;
        let gpus: Vec<GpuView<'_>> = node.gpus().collect();
        Some(FitPlacement {
            node: node.name().to_owned(),
            devices: picks
                .into_iter()
                .map(|p| gpus[p].info().device.clone())
                .collect(),
        })
    }
}

/// kube-scheduler's `numFeasibleNodesToFind` with the default `percentageOfNodesToScore`:
/// every node below 100 nodes, else `50 - nodes/125` percent (at least 5 %), at least 100.
pub fn feasible_nodes_to_find(nodes: usize) -> usize {
    const MIN_FEASIBLE: usize = 100;
    if nodes < MIN_FEASIBLE {
        return nodes;
    }
    let percent = 50usize.saturating_sub(nodes / 125).max(5);
    (nodes * percent / 100).max(MIN_FEASIBLE)
}

/// The devices (positions in the node's inventory order) the structured allocator would
/// give `request` on `node`: the first `count` that fit, and for a topology constraint the
/// first combination in inventory order whose devices share the domain.
pub fn fit_on_node(node: NodeView<'_>, request: &DeviceRequest) -> Option<Vec<usize>> {
    let count = request.count as usize;
    let gpus: Vec<GpuView<'_>> = node.gpus().collect();
    let fitting: Vec<usize> = gpus
        .iter()
        .enumerate()
        .filter(|(_, gpu)| fits(**gpu, request))
        .map(|(at, _)| at)
        .collect();
    if fitting.len() < count || count == 0 {
        return None;
    }
    let domain = |at: usize| -> Option<&str> {
        let info = gpus[at].info();
        match request.topology {
            TopologyScope::NvLink => info.nvlink_domain.as_deref(),
            TopologyScope::PcieRoot => info.pcie_root.as_deref(),
            TopologyScope::Any => Some(""),
        }
    };
    if count == 1 || request.topology == TopologyScope::Any {
        return Some(fitting[..count].to_vec());
    }
    // Backtracking in inventory order finds, for the first device that can start a full
    // set, the next devices of its domain.
    fitting.iter().enumerate().find_map(|(i, &first)| {
        let wanted = domain(first)?;
        let set: Vec<usize> = fitting[i..]
            .iter()
            .copied()
            .filter(|&at| domain(at) == Some(wanted))
            .take(count)
            .collect();
        (set.len() == count).then_some(set)
    })
}

/// Whether one device can serve one device of `request` now.
fn fits(gpu: GpuView<'_>, request: &DeviceRequest) -> bool {
    if !request.selector.matches(gpu.info()) {
        return false;
    }
    match request.slice {
        None => gpu.is_idle(),
        Some(size) => {
            !gpu.is_held_whole()
                && gpu.free_memory_bytes() >= size.memory_bytes
                && gpu.free_compute_percent() >= size.compute_percent
                && request
                    .max_slices_per_gpu
                    .is_none_or(|max| gpu.usage().slices < max)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use crate::workload::{Mix, Shape, Workload};
    use kerf_core::alloc::{GpuInfo, NodeGpus, Policy, SliceSize, place_where};
    use kerf_core::inventory::ComputeCapability;
    use proptest::prelude::*;

    const GI: u64 = 1 << 30;

    fn gpu(device: &str, nvlink: &str) -> GpuInfo {
        GpuInfo {
            device: device.into(),
            uuid: format!("GPU-{device}"),
            product: "H100".into(),
            memory_bytes: 80 * GI,
            multiprocessors: 132,
            compute_capability: ComputeCapability { major: 9, minor: 0 },
            nvlink_domain: Some(nvlink.into()),
            pcie_root: None,
            numa: None,
            taints: Vec::new(),
        }
    }

    /// gpu-0, gpu-1 in domain a; gpu-2..gpu-5 in domain b.
    fn two_domain_index(nodes: usize) -> Index {
        let mut index = Index::new();
        for n in 0..nodes {
            let gpus = (0..6)
                .map(|g| gpu(&format!("gpu-{g}"), if g < 2 { "a" } else { "b" }))
                .collect();
            index.upsert_node(NodeGpus {
                node: format!("n{n}"),
                gpus,
            });
        }
        index
    }

    fn slice(gi: u64, compute: u8) -> DeviceRequest {
        Shape::Slice(SliceSize {
            memory_bytes: gi * GI,
            compute_percent: compute,
        })
        .request(Policy::BinPack)
    }

    fn whole(count: u32) -> DeviceRequest {
        Shape::Whole { count }.request(Policy::BinPack)
    }

    fn place_and_apply(
        ff: &mut FirstFit,
        index: &mut Index,
        key: &str,
        req: &DeviceRequest,
    ) -> Option<FitPlacement> {
        let placed = ff.place(index, req)?;
        index.set_claim_usage(key, placed.device_uses(req));
        Some(placed)
    }

    #[test]
    fn slices_go_to_the_first_device_with_room_and_whole_gpus_to_the_first_idle_one() {
        let mut index = two_domain_index(2);
        let mut ff = FirstFit::new(&index, NodeChoice::InOrder);
        let first = place_and_apply(&mut ff, &mut index, "a", &slice(40, 50)).unwrap();
        assert_eq!(
            (first.node.as_str(), first.devices.as_slice()),
            ("n0", &["gpu-0".to_owned()][..])
        );
        // Still room on gpu-0: first fit takes it again.
        let second = place_and_apply(&mut ff, &mut index, "b", &slice(40, 50)).unwrap();
        assert_eq!(second.devices, ["gpu-0"]);
        // gpu-0 is full now.
        let third = place_and_apply(&mut ff, &mut index, "c", &slice(5, 10)).unwrap();
        assert_eq!(third.devices, ["gpu-1"]);
        let fourth = place_and_apply(&mut ff, &mut index, "d", &whole(1)).unwrap();
        assert_eq!(fourth.devices, ["gpu-2"]);
        // A slice never lands on a GPU held whole: gpu-1 still has room.
        let fifth = place_and_apply(&mut ff, &mut index, "e", &slice(70, 10)).unwrap();
        assert_eq!(fifth.devices, ["gpu-1"]);
    }

    #[test]
    fn an_nvlink_set_is_the_first_combination_in_inventory_order_within_one_domain() {
        let mut index = two_domain_index(1);
        let mut ff = FirstFit::new(&index, NodeChoice::InOrder);
        place_and_apply(&mut ff, &mut index, "s", &slice(5, 10)).unwrap(); // gpu-0
        // gpu-1 is idle but alone in domain a now: the pair comes from domain b.
        let pair = place_and_apply(&mut ff, &mut index, "p", &whole(2)).unwrap();
        assert_eq!(pair.devices, ["gpu-2", "gpu-3"]);
        let single = place_and_apply(&mut ff, &mut index, "w", &whole(1)).unwrap();
        assert_eq!(single.devices, ["gpu-1"]);
        // Two idle GPUs left (gpu-4, gpu-5), both in b: a four-set does not fit.
        assert!(ff.place(&index, &whole(4)).is_none());
        let last = place_and_apply(&mut ff, &mut index, "l", &whole(2)).unwrap();
        assert_eq!(last.devices, ["gpu-4", "gpu-5"]);
        assert!(ff.place(&index, &whole(1)).is_none());
    }

    #[test]
    fn the_scheduler_search_size_follows_kube_scheduler() {
        assert_eq!(feasible_nodes_to_find(50), 50);
        assert_eq!(feasible_nodes_to_find(100), 100);
        assert_eq!(feasible_nodes_to_find(200), 100);
        assert_eq!(feasible_nodes_to_find(1000), 420);
        assert_eq!(feasible_nodes_to_find(5000), 500);
        assert_eq!(feasible_nodes_to_find(100_000), 5000);
    }

    #[test]
    fn the_scheduler_choice_spreads_where_in_order_packs() {
        let mut index = two_domain_index(150);
        let mut in_order = FirstFit::new(&index, NodeChoice::InOrder);
        let mut sched = FirstFit::new(&index, NodeChoice::Scheduler(Rng::new(3)));
        let req = slice(5, 10);
        let mut nodes = std::collections::BTreeSet::new();
        for i in 0..20 {
            assert_eq!(in_order.place(&index, &req).unwrap().node, "n0");
            let p = place_and_apply(&mut sched, &mut index, &format!("c{i}"), &req).unwrap();
            nodes.insert(p.node);
        }
        assert!(nodes.len() > 10, "{nodes:?}");
    }

    proptest! {
        /// Same feasibility rules as kerf's allocator: on the same state, the baseline finds
        /// a place exactly when kerf does, and never over-commits a GPU.
        #[test]
        fn fits_exactly_when_kerf_fits_and_never_overcommits(seed in 0u64..1000, scheduler in any::<bool>()) {
            let mut index = two_domain_index(3);
            let choice = if scheduler { NodeChoice::Scheduler(Rng::new(seed)) } else { NodeChoice::InOrder };
            let mut ff = FirstFit::new(&index, choice);
            let mut workload = Workload::new(seed, Mix::default());
            for i in 0..60 {
                let shape = workload.next_shape();
                let req = shape.request(Policy::BinPack);
                let kerf = place_where(&index, &shape.pod(format!("k{i}"), Policy::BinPack), |_| true);
                let ours = place_and_apply(&mut ff, &mut index, &format!("c{i}"), &req);
                prop_assert_eq!(kerf.is_ok(), ours.is_some());
                if let Some(p) = ours {
                    prop_assert_eq!(p.devices.len(), req.count as usize);
                }
            }
            for node in index.nodes() {
                for gpu in node.gpus() {
                    let usage = gpu.usage();
                    prop_assert!(usage.whole_holders <= 1);
                    prop_assert!(usage.whole_holders == 0 || usage.slices == 0);
                    prop_assert!(usage.slice_memory_bytes <= gpu.info().memory_bytes);
                    prop_assert!(usage.slice_compute_percent <= 100);
                }
            }
        }
    }
}
