//! The baseline allocator: kube-scheduler's structured allocator
//! ([`kerf_scheduler_standin::Allocator`], the one the tests and `kerf demo` use) over the same
//! cluster, so that the packing comparison differs only in the choices made.
//!
//! The cluster is published as kerf publishes GPUs for scheduler slices on 1.36: every GPU of
//! the [`Index`] is one shareable device (`allowMultipleAllocations`) with the capacities
//! `memory` and `compute` (100) and its NVLink domain as an attribute, in inventory order. A
//! slice asks for its memory and compute (`capacity.requests`); a whole GPU asks for none
//! and so consumes every capacity (`fillEmptyRequest`), which fits only an idle GPU; two or
//! four GPUs ask for one NVLink domain (`matchAttribute`). Within a node the allocator takes
//! the first devices in ResourceSlice order that satisfy the request (for the NVLink set, the
//! first combination in that order, by its backtracking search), with no scoring. Which node
//! the pod lands on is the scheduler framework's choice, modelled by [`NodeChoice`].

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{
    CapacityRequirements, DeviceAttribute, DeviceCapacity, DeviceClaim, DeviceClass,
    DeviceConstraint, DeviceRequest, ExactDeviceRequest, ResourceClaim, ResourceClaimSpec,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kerf_core::alloc::{DeviceUse, Index};
use kerf_scheduler_standin::{AllocatedState, Allocator, Snapshot};

use crate::rng::Rng;
use crate::workload::Shape;

/// The driver name of the baseline's devices.
use kerf_tests::fixtures::DRIVER;
/// The DeviceClass every request uses: no selectors, every GPU.
const CLASS: &str = "gpu";
/// The attribute two or four GPUs must share.
const NVLINK: &str = "nvlinkDomain";

/// How the baseline chooses among nodes where the request fits.
#[derive(Debug, Clone)]
pub(crate) enum NodeChoice {
    /// The first node by name: plain first-fit over the whole cluster
    /// ([`Allocator::first_fit`]).
    InOrder,
    /// As kube-scheduler ([`Allocator::filter`]): feasible nodes from a start that rotates
    /// from one pod to the next, at most `numFeasibleNodesToFind` of them (42 % of 1,000
    /// nodes), and one picked at random, because no DRA plugin scores devices and every
    /// feasible node scores the same (ties are broken at random).
    Scheduler(Rng),
}

/// Where the baseline put one claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FitPlacement {
    /// The node.
    pub node: String,
    /// The devices, in inventory order.
    pub devices: Vec<String>,
}

impl FitPlacement {
    /// The usage this placement puts on kerf's index for a claim of `shape`.
    pub(crate) fn device_uses(&self, shape: Shape) -> Vec<DeviceUse> {
        self.devices
            .iter()
            .map(|device| match shape {
                Shape::Whole { .. } => DeviceUse::whole(&self.node, device),
                Shape::Slice(size) => {
                    DeviceUse::slice(&self.node, device, size.memory_bytes, size.compute_percent)
                }
            })
            .collect()
    }
}

/// The baseline allocator over one cluster: its slices, what is allocated, and the
/// allocator's state (compiled selectors, where Filter starts next).
#[derive(Debug)]
pub(crate) struct Baseline {
    snapshot: Snapshot,
    state: AllocatedState,
    allocator: Allocator,
    choice: NodeChoice,
    pod: Pod,
}

impl Baseline {
    /// A baseline over the nodes and GPUs `index` knows now, nothing allocated.
    pub(crate) fn new(index: &Index, choice: NodeChoice) -> Self {
        let mut nodes = Vec::new();
        let mut slices = Vec::new();
        for node in index.nodes() {
            let name = node.name().to_owned();
            let devices = node.gpus().map(|gpu| device(gpu.info())).collect();
            nodes.push(Arc::new(Node {
                metadata: named(&name),
                ..Node::default()
            }));
            slices.push(Arc::new(ResourceSlice {
                metadata: named(&name),
                spec: ResourceSliceSpec {
                    driver: DRIVER.to_owned(),
                    node_name: Some(name.clone()),
                    pool: ResourcePool {
                        name,
                        generation: 1,
                        resource_slice_count: 1,
                    },
                    devices: Some(devices),
                    ..ResourceSliceSpec::default()
                },
            }));
        }
        let class = Arc::new(DeviceClass {
            metadata: named(CLASS),
            ..DeviceClass::default()
        });
        Baseline {
            snapshot: Snapshot::new(nodes, slices, vec![class], Vec::new(), Vec::new()),
            state: AllocatedState::default(),
            allocator: Allocator::default(),
            choice,
            pod: Pod {
                metadata: named("pod"),
                ..Pod::default()
            },
        }
    }

    /// Where a claim of `shape` goes, or `None` when it fits nowhere; the allocation is
    /// counted for the claims that follow.
    ///
    /// # Errors
    ///
    /// The allocator's error (a quantity that does not parse, a search that took too long).
    pub(crate) fn place(&mut self, shape: Shape) -> Result<Option<FitPlacement>, String> {
        let claims = [claim(shape)];
        let feasible = match &mut self.choice {
            NodeChoice::InOrder => {
                self.allocator
                    .first_fit(&self.pod, &claims, &[0], &self.snapshot, &self.state)?
            }
            NodeChoice::Scheduler(rng) => {
                let mut filtered =
                    self.allocator
                        .filter(&self.pod, &claims, &[0], &self.snapshot, &self.state)?;
                let pick = rng.index(filtered.feasible.len());
                (!filtered.feasible.is_empty()).then(|| filtered.feasible.swap_remove(pick))
            }
        };
        let Some(feasible) = feasible else {
            return Ok(None);
        };
        let allocations = self.allocator.allocate_feasible(
            &feasible,
            &claims,
            &[0],
            &self.snapshot,
            &self.state,
        )?;
        let mut devices = Vec::new();
        for allocation in &allocations {
            self.state.add(allocation)?;
            devices.extend(
                allocation
                    .devices
                    .iter()
                    .flat_map(|d| d.results.iter().flatten())
                    .map(|r| r.device.clone()),
            );
        }
        Ok(Some(FitPlacement {
            node: feasible.node,
            devices,
        }))
    }
}

fn named(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        ..ObjectMeta::default()
    }
}

/// One GPU as a shareable device with its memory and compute.
fn device(gpu: &kerf_core::alloc::GpuInfo) -> k8s_openapi::api::resource::v1::Device {
    let capacity = |value: String| DeviceCapacity {
        value: Quantity(value),
        ..DeviceCapacity::default()
    };
    let attributes = gpu.nvlink_domain.as_ref().map(|domain| {
        BTreeMap::from([(
            NVLINK.to_owned(),
            DeviceAttribute {
                string: Some(domain.clone()),
                ..DeviceAttribute::default()
            },
        )])
    });
    k8s_openapi::api::resource::v1::Device {
        name: gpu.device.clone(),
        allow_multiple_allocations: Some(true),
        attributes,
        capacity: Some(BTreeMap::from([
            ("memory".to_owned(), capacity(gpu.memory_bytes.to_string())),
            ("compute".to_owned(), capacity("100".to_owned())),
        ])),
        ..k8s_openapi::api::resource::v1::Device::default()
    }
}

/// The claim of one workload shape (see the module documentation).
fn claim(shape: Shape) -> ResourceClaim {
    let (count, capacity, constraints) = match shape {
        Shape::Slice(size) => (
            1,
            Some(CapacityRequirements {
                requests: Some(BTreeMap::from([
                    ("memory".to_owned(), Quantity(size.memory_bytes.to_string())),
                    (
                        "compute".to_owned(),
                        Quantity(size.compute_percent.to_string()),
                    ),
                ])),
            }),
            None,
        ),
        Shape::Whole { count } => (
            i64::from(count),
            None,
            (count > 1).then(|| {
                vec![DeviceConstraint {
                    match_attribute: Some(format!("{DRIVER}/{NVLINK}")),
                    ..DeviceConstraint::default()
                }]
            }),
        ),
    };
    ResourceClaim {
        metadata: named("claim"),
        spec: ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(vec![DeviceRequest {
                    name: "gpu".to_owned(),
                    exactly: Some(ExactDeviceRequest {
                        device_class_name: CLASS.to_owned(),
                        count: Some(count),
                        capacity,
                        ..ExactDeviceRequest::default()
                    }),
                    ..DeviceRequest::default()
                }]),
                constraints,
                ..DeviceClaim::default()
            }),
        },
        ..ResourceClaim::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use crate::workload::{Mix, Workload};
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

    fn slice(gi: u64, compute: u8) -> Shape {
        Shape::Slice(SliceSize {
            memory_bytes: gi * GI,
            compute_percent: compute,
        })
    }

    fn place(
        baseline: &mut Baseline,
        index: &mut Index,
        key: &str,
        shape: Shape,
    ) -> Option<FitPlacement> {
        let placed = baseline.place(shape).unwrap()?;
        index.set_claim_usage(key, placed.device_uses(shape));
        Some(placed)
    }

    #[test]
    fn slices_go_to_the_first_device_with_room_and_whole_gpus_to_the_first_idle_one() {
        let mut index = two_domain_index(2);
        let mut b = Baseline::new(&index, NodeChoice::InOrder);
        let first = place(&mut b, &mut index, "a", slice(40, 50)).unwrap();
        assert_eq!(
            (first.node.as_str(), first.devices.as_slice()),
            ("n0", &["gpu-0".to_owned()][..])
        );
        // Still room on gpu-0: the allocator takes it again.
        assert_eq!(
            place(&mut b, &mut index, "b", slice(40, 50))
                .unwrap()
                .devices,
            ["gpu-0"]
        );
        // gpu-0 is full now.
        assert_eq!(
            place(&mut b, &mut index, "c", slice(5, 10))
                .unwrap()
                .devices,
            ["gpu-1"]
        );
        let whole = Shape::Whole { count: 1 };
        assert_eq!(
            place(&mut b, &mut index, "d", whole).unwrap().devices,
            ["gpu-2"]
        );
        // A slice never lands on a GPU held whole: gpu-1 still has room.
        assert_eq!(
            place(&mut b, &mut index, "e", slice(70, 10))
                .unwrap()
                .devices,
            ["gpu-1"]
        );
    }

    #[test]
    fn an_nvlink_set_is_the_first_combination_in_inventory_order_within_one_domain() {
        let mut index = two_domain_index(1);
        let mut b = Baseline::new(&index, NodeChoice::InOrder);
        place(&mut b, &mut index, "s", slice(5, 10)).unwrap(); // gpu-0
        // gpu-1 is idle but alone in domain a now: the pair comes from domain b.
        let pair = place(&mut b, &mut index, "p", Shape::Whole { count: 2 }).unwrap();
        assert_eq!(pair.devices, ["gpu-2", "gpu-3"]);
        let single = place(&mut b, &mut index, "w", Shape::Whole { count: 1 }).unwrap();
        assert_eq!(single.devices, ["gpu-1"]);
        // Two idle GPUs left (gpu-4, gpu-5), both in b: a four-set does not fit.
        assert!(b.place(Shape::Whole { count: 4 }).unwrap().is_none());
        let last = place(&mut b, &mut index, "l", Shape::Whole { count: 2 }).unwrap();
        assert_eq!(last.devices, ["gpu-4", "gpu-5"]);
        assert!(b.place(Shape::Whole { count: 1 }).unwrap().is_none());
    }

    #[test]
    fn the_scheduler_choice_spreads_where_in_order_packs() {
        let mut index = two_domain_index(150);
        let mut in_order = Baseline::new(&index, NodeChoice::InOrder);
        let mut sched = Baseline::new(&index, NodeChoice::Scheduler(Rng::new(3)));
        let mut nodes = std::collections::BTreeSet::new();
        for i in 0..20 {
            assert_eq!(in_order.place(slice(5, 10)).unwrap().unwrap().node, "n0");
            let p = place(&mut sched, &mut index, &format!("c{i}"), slice(5, 10)).unwrap();
            nodes.insert(p.node);
        }
        assert!(nodes.len() > 10, "{nodes:?}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Same feasibility rules as kerf's allocator: on the same state, the baseline finds
        /// a place exactly when kerf does, and never over-commits a GPU.
        #[test]
        fn fits_exactly_when_kerf_fits_and_never_overcommits(seed in 0u64..1000, scheduler in any::<bool>()) {
            let mut index = two_domain_index(3);
            let choice = if scheduler { NodeChoice::Scheduler(Rng::new(seed)) } else { NodeChoice::InOrder };
            let mut b = Baseline::new(&index, choice);
            let mut workload = Workload::new(seed, Mix::default());
            for i in 0..60 {
                let shape = workload.next_shape();
                let kerf = place_where(&index, &shape.pod(format!("k{i}"), Policy::BinPack), |_| true);
                let ours = place(&mut b, &mut index, &format!("c{i}"), shape);
                prop_assert_eq!(kerf.is_ok(), ours.is_some());
                if let (Some(p), Shape::Whole { count }) = (&ours, shape) {
                    prop_assert_eq!(p.devices.len(), count as usize);
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
