//! Properties of the controller's allocator over random clusters and random sequences of
//! placements, releases and scheduler allocations: no over-commit, counts and topology
//! honoured, determinism, an incrementally updated index equal to a rebuilt one, and
//! BinPack leaving fewer partially used GPUs than Spread.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Test helpers may fail loudly.

use std::collections::{BTreeMap, BTreeSet};

use kerf_core::alloc::{
    ClaimRequest, DeviceRequest, DeviceUse, GpuInfo, GpuSelector, GpuView, Index, NodeGpus,
    PodPlacement, PodRequest, Policy, SliceSize, TopologyScope, UseKind, place, place_where,
};
use kerf_core::enforcement::Enforcement;
use kerf_core::inventory::ComputeCapability;
use kerf_core::sharing::Sharing;
use proptest::prelude::*;

const GI: u64 = 1 << 30;
const PRODUCTS: [&str; 2] = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"];

fn node_strategy(name: String) -> impl Strategy<Value = NodeGpus> {
    prop::collection::vec(
        (
            0..2usize,
            prop::option::of(0..2u8),
            prop::option::of(0..3u8),
        ),
        1..=8,
    )
    .prop_map(move |gpus| NodeGpus {
        node: name.clone(),
        gpus: gpus
            .into_iter()
            .enumerate()
            .map(|(minor, (product, nvlink, pcie))| GpuInfo {
                device: format!("gpu-{minor}"),
                uuid: format!("GPU-{name}-{minor}"),
                product: PRODUCTS[product].to_owned(),
                memory_bytes: if product == 0 { 80 * GI } else { 40 * GI },
                multiprocessors: 108,
                compute_capability: ComputeCapability {
                    major: if product == 0 { 9 } else { 8 },
                    minor: 0,
                },
                nvlink_domain: nvlink.map(|d| format!("nvl-{d}")),
                pcie_root: pcie.map(|r| format!("pci{r}")),
                numa: None,
                taints: Vec::new(),
            })
            .collect(),
    })
}

fn cluster_strategy() -> impl Strategy<Value = Vec<NodeGpus>> {
    (1..=4usize).prop_flat_map(|n| {
        (0..n)
            .map(|i| node_strategy(format!("node-{i}")))
            .collect::<Vec<_>>()
    })
}

fn request_strategy() -> impl Strategy<Value = DeviceRequest> {
    (
        1..=3u32,
        prop::option::of((0..=6u64, 0..=60u8)),
        0..3u8,
        any::<bool>(),
        prop::option::of(1..=4u32),
        prop::option::of(0..2usize),
    )
        .prop_map(|(count, slice, topology, spread, max_slices, product)| {
            let slice = slice.map(|(memory_tenths, compute)| SliceSize {
                memory_bytes: memory_tenths * 8 * GI,
                compute_percent: if memory_tenths == 0 {
                    compute.max(1)
                } else {
                    compute
                },
            });
            DeviceRequest {
                name: "r".to_owned(),
                count,
                slice,
                selector: GpuSelector {
                    product_names: product
                        .map(|p| vec![PRODUCTS[p].to_owned()])
                        .unwrap_or_default(),
                    ..GpuSelector::default()
                },
                topology: [
                    TopologyScope::Any,
                    TopologyScope::PcieRoot,
                    TopologyScope::NvLink,
                ][usize::from(topology)],
                policy: if spread {
                    Policy::Spread
                } else {
                    Policy::BinPack
                },
                max_slices_per_gpu: max_slices,
                sharing: Sharing::default(),
                time_slice_interval: None,
                enforcement: Enforcement::default(),
                tolerations: Vec::new(),
                admin_access: false,
                first_available: Vec::new(),
            }
        })
}

fn pod_strategy() -> impl Strategy<Value = Vec<Vec<DeviceRequest>>> {
    prop::collection::vec(prop::collection::vec(request_strategy(), 1..=2), 1..=2)
}

/// One step of a random history.
#[derive(Debug, Clone)]
enum Op {
    /// Place a pod (claims of requests) and record the placement.
    Place(Vec<Vec<DeviceRequest>>),
    /// Release the n-th live claim (modulo).
    Release(usize),
    /// The scheduler allocates the n-th idle GPU of the cluster whole.
    Scheduler(usize),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => pod_strategy().prop_map(Op::Place),
        2 => any::<usize>().prop_map(Op::Release),
        1 => any::<usize>().prop_map(Op::Scheduler),
    ]
}

fn pod_request(pod_id: usize, claims: &[Vec<DeviceRequest>]) -> PodRequest {
    PodRequest {
        claims: claims
            .iter()
            .enumerate()
            .map(|(c, requests)| ClaimRequest {
                key: format!("pod{pod_id}-claim{c}"),
                requests: requests
                    .iter()
                    .enumerate()
                    .map(|(r, req)| DeviceRequest {
                        name: format!("r{r}"),
                        ..req.clone()
                    })
                    .collect(),
            })
            .collect(),
    }
}

fn build(nodes: &[NodeGpus]) -> Index {
    let mut index = Index::new();
    for node in nodes {
        index.upsert_node(node.clone());
    }
    index
}

fn names(nodes: &[NodeGpus]) -> Vec<&str> {
    nodes.iter().map(|n| n.node.as_str()).collect()
}

fn gpu_info<'a>(nodes: &'a [NodeGpus], node: &str, device: &str) -> &'a GpuInfo {
    nodes
        .iter()
        .find(|n| n.node == node)
        .and_then(|n| n.gpus.iter().find(|g| g.device == device))
        .expect("placed device exists")
}

/// Checks that the sum of all uses fits every GPU, from the uses alone.
fn assert_no_overcommit(nodes: &[NodeGpus], claims: &BTreeMap<String, Vec<DeviceUse>>) {
    #[derive(Default)]
    struct Sum {
        whole: u32,
        slices: u32,
        memory: u64,
        compute: u32,
    }
    let mut sums: BTreeMap<(&str, &str), Sum> = BTreeMap::new();
    for uses in claims.values() {
        for u in uses {
            let sum = sums.entry((&u.node, &u.device)).or_default();
            match u.kind {
                UseKind::Whole => sum.whole += 1,
                UseKind::Slice {
                    memory_bytes,
                    compute_percent,
                    ..
                } => {
                    sum.slices += 1;
                    sum.memory += memory_bytes;
                    sum.compute += u32::from(compute_percent);
                }
            }
        }
    }
    for ((node, device), sum) in sums {
        let gpu = gpu_info(nodes, node, device);
        assert!(
            sum.whole <= 1,
            "{node}/{device} held whole {} times",
            sum.whole
        );
        assert!(
            sum.whole == 0 || sum.slices == 0,
            "{node}/{device} held whole and sliced"
        );
        assert!(
            sum.memory <= gpu.memory_bytes,
            "{node}/{device} memory over-committed"
        );
        assert!(
            sum.compute <= 100,
            "{node}/{device} compute over-committed: {}",
            sum.compute
        );
    }
}

/// Checks counts, distinctness, selector, topology and slice limits of one placement.
fn assert_honours(
    nodes: &[NodeGpus],
    pod: &PodRequest,
    placement: &PodPlacement,
    index_after: &Index,
) {
    assert_eq!(placement.claims.len(), pod.claims.len());
    for (claim, placed) in pod.claims.iter().zip(&placement.claims) {
        assert_eq!(claim.key, placed.key);
        let devices: BTreeSet<&str> = placed.devices.iter().map(|d| d.device.as_str()).collect();
        assert_eq!(
            devices.len(),
            placed.devices.len(),
            "a claim names a device twice"
        );
        for req in &claim.requests {
            let mine: Vec<_> = placed
                .devices
                .iter()
                .filter(|d| d.request == req.name)
                .collect();
            assert_eq!(mine.len(), req.count as usize, "count of {}", req.name);
            let infos: Vec<&GpuInfo> = mine
                .iter()
                .map(|d| gpu_info(nodes, &placement.node, &d.device))
                .collect();
            for (device, info) in mine.iter().zip(&infos) {
                assert!(req.selector.matches(info));
                assert_eq!(device.slice, req.slice);
                assert_eq!(device.gpu_uuid, info.uuid);
                if let (Some(_), Some(max)) = (req.slice, req.max_slices_per_gpu) {
                    let slices = index_after
                        .gpu_usage(&placement.node, &device.device)
                        .slices;
                    // Later requests of the same pod may add slices after this one was placed,
                    // but never beyond their own limits; the pod's own slices count for all.
                    let pod_slices_after = placement
                        .claims
                        .iter()
                        .flat_map(|c| &c.devices)
                        .filter(|d| d.device == device.device && d.slice.is_some())
                        .count();
                    let pod_slices_after = u32::try_from(pod_slices_after).unwrap();
                    assert!(slices - pod_slices_after < max, "max slices broken");
                }
            }
            if req.count > 1 {
                let domains: BTreeSet<Option<&str>> = match req.topology {
                    TopologyScope::NvLink => {
                        infos.iter().map(|i| i.nvlink_domain.as_deref()).collect()
                    }
                    TopologyScope::PcieRoot => {
                        infos.iter().map(|i| i.pcie_root.as_deref()).collect()
                    }
                    TopologyScope::Any => BTreeSet::from([Some("any")]),
                };
                assert_eq!(domains.len(), 1, "{:?} broken: {domains:?}", req.topology);
                assert!(
                    !domains.contains(&None),
                    "{:?} on GPUs without one",
                    req.topology
                );
            }
        }
    }
}

/// Final claims and every placement decision (or its failure message) of a history.
type History = (
    BTreeMap<String, Vec<DeviceUse>>,
    Vec<Result<PodPlacement, String>>,
);

/// Runs a history; returns the final claims and every placement decision (or failure reason).
fn run(nodes: &[NodeGpus], ops: &[Op], check: bool) -> History {
    let mut index = build(nodes);
    let candidates = names(nodes);
    let mut claims: BTreeMap<String, Vec<DeviceUse>> = BTreeMap::new();
    let mut decisions = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Place(requests) => {
                let pod = pod_request(step, requests);
                let outcome = place(&index, &pod, &candidates);
                if let Ok(placement) = &outcome {
                    index.apply(placement);
                    for claim in &placement.claims {
                        claims.insert(claim.key.clone(), claim.device_uses(&placement.node));
                    }
                    if check {
                        assert_honours(nodes, &pod, placement, &index);
                    }
                }
                decisions.push(outcome.map_err(|e| e.to_string()));
            }
            Op::Release(n) => {
                if let Some(key) = claims.keys().nth(n % claims.len().max(1)).cloned() {
                    claims.remove(&key);
                    assert!(index.remove_claim(&key));
                }
            }
            Op::Scheduler(n) => {
                let idle: Vec<(String, String)> = index
                    .nodes()
                    .flat_map(|node| {
                        node.gpus()
                            .filter(GpuView::is_idle)
                            .map(|g| (node.name().to_owned(), g.info().device.clone()))
                            .collect::<Vec<_>>()
                    })
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect();
                if let Some((node, device)) = idle.get(n % idle.len().max(1)) {
                    let uses = vec![DeviceUse::whole(node.clone(), device.clone())];
                    let key = format!("sched-{step}");
                    index.set_claim_usage(&key, uses.clone());
                    claims.insert(key, uses);
                }
            }
        }
        if check {
            assert_no_overcommit(nodes, &claims);
            assert_index_matches_rebuild(nodes, &index, &claims);
        }
    }
    (claims, decisions)
}

/// The incrementally updated index agrees with one built from scratch.
fn assert_index_matches_rebuild(
    nodes: &[NodeGpus],
    index: &Index,
    claims: &BTreeMap<String, Vec<DeviceUse>>,
) {
    let mut fresh = Index::new();
    for (key, uses) in claims {
        fresh.set_claim_usage(key, uses.clone());
    }
    for node in nodes {
        fresh.upsert_node(node.clone());
    }
    for node in nodes {
        let a: Vec<_> = index
            .node(&node.node)
            .unwrap()
            .gpus()
            .map(|g| (g.free_memory_bytes(), g.free_compute_percent(), g.usage()))
            .collect();
        let b: Vec<_> = fresh
            .node(&node.node)
            .unwrap()
            .gpus()
            .map(|g| (g.free_memory_bytes(), g.free_compute_percent(), g.usage()))
            .collect();
        assert_eq!(a, b, "{}", node.node);
    }
    assert_eq!(index.claim_count(), claims.len());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn never_over_commits_and_honours_counts_and_topology(
        nodes in cluster_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..40),
    ) {
        run(&nodes, &ops, true);
    }

    #[test]
    fn deterministic_for_the_same_input(
        nodes in cluster_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..30),
    ) {
        let (claims_a, decisions_a) = run(&nodes, &ops, false);
        let mut reversed = nodes.clone();
        reversed.reverse();
        for node in &mut reversed {
            node.gpus.reverse();
        }
        let (claims_b, decisions_b) = run(&reversed, &ops, false);
        prop_assert_eq!(decisions_a, decisions_b);
        prop_assert_eq!(claims_a, claims_b);
    }

    #[test]
    fn one_decision_with_shuffled_candidates_is_the_same(
        nodes in cluster_strategy(),
        pod in pod_strategy(),
        rotate in 0..4usize,
    ) {
        let index = build(&nodes);
        let mut candidates = names(&nodes);
        let pod = pod_request(0, &pod);
        let first = place(&index, &pod, &candidates).map_err(|e| e.to_string());
        let len = candidates.len();
        candidates.rotate_left(rotate % len);
        candidates.reverse();
        let second = place(&index, &pod, &candidates).map_err(|e| e.to_string());
        prop_assert_eq!(&first, &second);
        let walked = place_where(&index, &pod, |_| true).map_err(|e| e.to_string());
        prop_assert_eq!(first, walked);
    }

}

/// Places the same slices one by one under both policies in lockstep on one node, stopping
/// at the first slice that either cannot place; returns per policy (GPUs used, GPUs used but
/// not full).
fn lockstep(gpus: u32, sizes: &[SliceSize]) -> [(usize, usize); 2] {
    let nodes = [uniform_node("node-0", gpus)];
    let mut indexes = [build(&nodes), build(&nodes)];
    for (i, size) in sizes.iter().enumerate() {
        let pods = [Policy::BinPack, Policy::Spread].map(|policy| PodRequest {
            claims: vec![ClaimRequest {
                key: format!("c{i}"),
                requests: vec![DeviceRequest {
                    policy,
                    ..DeviceRequest::slices("s", 1, *size)
                }],
            }],
        });
        let placements: Vec<_> = indexes
            .iter()
            .zip(&pods)
            .map(|(index, pod)| place(index, pod, &["node-0"]))
            .collect();
        if placements.iter().any(Result::is_err) {
            break;
        }
        for (index, placement) in indexes.iter_mut().zip(placements) {
            index.apply(&placement.unwrap());
        }
    }
    indexes.map(|index| {
        let node = index.node("node-0").unwrap();
        let used: Vec<_> = node.gpus().filter(|g| !g.is_idle()).collect();
        let partial = used
            .iter()
            .filter(|g| g.free_memory_bytes() > 0 && g.free_compute_percent() > 0)
            .count();
        (used.len(), partial)
    })
}

proptest! {
    /// Spread opens an idle GPU whenever there is one; BinPack only when no used GPU fits.
    #[test]
    fn binpack_uses_no_more_gpus_than_spread(
        gpus in 1..=8u32,
        sizes in prop::collection::vec((1..=8u64, 0..=80u8), 1..40),
    ) {
        let sizes: Vec<SliceSize> = sizes
            .into_iter()
            .map(|(tenths, compute)| SliceSize { memory_bytes: tenths * 8 * GI, compute_percent: compute })
            .collect();
        let [binpack, spread] = lockstep(gpus, &sizes);
        prop_assert!(binpack.0 <= spread.0, "BinPack {binpack:?} vs Spread {spread:?}");
    }

    /// With one slice size that divides the GPU, BinPack fills GPU after GPU: at most one is
    /// left partly used, and never more than under Spread.
    #[test]
    fn binpack_leaves_no_more_partially_used_gpus_than_spread(
        gpus in 1..=8u32,
        size in 0..4u32,
        count in 1..40usize,
    ) {
        let size = SliceSize { memory_bytes: (10 * GI) << size, compute_percent: 10 << size };
        let [binpack, spread] = lockstep(gpus, &vec![size; count]);
        prop_assert!(binpack.1 <= 1, "BinPack {binpack:?}");
        prop_assert!(binpack.1 <= spread.1, "BinPack {binpack:?} vs Spread {spread:?}");
    }
}

fn uniform_node(name: &str, gpus: u32) -> NodeGpus {
    NodeGpus {
        node: name.to_owned(),
        gpus: (0..gpus)
            .map(|m| GpuInfo {
                device: format!("gpu-{m}"),
                uuid: format!("GPU-{name}-{m}"),
                product: PRODUCTS[0].to_owned(),
                memory_bytes: 80 * GI,
                multiprocessors: 132,
                compute_capability: ComputeCapability { major: 9, minor: 0 },
                nvlink_domain: None,
                pcie_root: None,
                numa: None,
                taints: Vec::new(),
            })
            .collect(),
    }
}

proptest! {
    /// The policy rule itself, decision by decision: BinPack takes an idle GPU only when no
    /// used GPU of the node fits, and otherwise the used GPU left with the least free memory;
    /// Spread takes the GPU left with the most.
    #[test]
    fn each_decision_follows_its_policy(
        gpus in 1..=6u32,
        node_count in 1..=3usize,
        steps in prop::collection::vec((1..=8u64, any::<bool>()), 1..30),
    ) {
        let nodes: Vec<NodeGpus> = (0..node_count).map(|n| uniform_node(&format!("node-{n}"), gpus)).collect();
        let mut index = build(&nodes);
        let candidates = names(&nodes);
        for (i, (tens, spread)) in steps.into_iter().enumerate() {
            let memory = tens * 10 * GI;
            let policy = if spread { Policy::Spread } else { Policy::BinPack };
            let req = DeviceRequest { policy, ..DeviceRequest::slices("s", 1, SliceSize { memory_bytes: memory, compute_percent: 0 }) };
            let pod = PodRequest { claims: vec![ClaimRequest { key: format!("c{i}"), requests: vec![req] }] };
            let Ok(placement) = place(&index, &pod, &candidates) else { continue };
            let node = index.node(&placement.node).unwrap();
            let fitting: Vec<_> = node.gpus().filter(|g| g.free_memory_bytes() >= memory).collect();
            let chosen = fitting.iter().find(|g| g.info().device == placement.claims[0].devices[0].device).unwrap();
            match policy {
                // Without a workload, LeastFragmentation places as BinPack.
                Policy::BinPack | Policy::LeastFragmentation => {
                    let used: Vec<_> = fitting.iter().filter(|g| !g.is_idle()).collect();
                    if chosen.is_idle() {
                        prop_assert!(used.is_empty(), "BinPack took an idle GPU while a used one fits");
                    } else {
                        let least = used.iter().map(|g| g.free_memory_bytes()).min().unwrap();
                        prop_assert_eq!(chosen.free_memory_bytes(), least);
                    }
                }
                Policy::Spread => {
                    let most = fitting.iter().map(GpuView::free_memory_bytes).max().unwrap();
                    prop_assert_eq!(chosen.free_memory_bytes(), most);
                }
            }
            index.apply(&placement);
        }
    }
}

#[test]
fn binpack_leaves_fewer_partially_used_gpus_than_spread_on_a_fixed_workload() {
    let nodes = [uniform_node("node-0", 4)];
    let sizes = [20, 10, 40, 20, 10];
    let mut partial = Vec::new();
    for policy in [Policy::BinPack, Policy::Spread] {
        let mut index = build(&nodes);
        for (i, gi) in sizes.iter().enumerate() {
            let size = SliceSize {
                memory_bytes: gi * GI,
                compute_percent: 10,
            };
            let req = DeviceRequest {
                policy,
                ..DeviceRequest::slices("s", 1, size)
            };
            let pod = PodRequest {
                claims: vec![ClaimRequest {
                    key: format!("c{i}"),
                    requests: vec![req],
                }],
            };
            let placement = place(&index, &pod, &["node-0"]).unwrap();
            index.apply(&placement);
        }
        let node = index.node("node-0").unwrap();
        partial.push(
            node.gpus()
                .filter(|g| {
                    !g.is_idle() && g.free_memory_bytes() > 0 && g.free_compute_percent() > 0
                })
                .count(),
        );
    }
    assert_eq!(
        partial,
        [1, 4],
        "BinPack fills gpu-0 and starts gpu-1; Spread touches all four"
    );
}

const TAINT_KEYS: [&str; 2] = ["gpu.kerf.dev/unhealthy", "example.com/other"];

fn taint_strategy() -> impl Strategy<Value = kerf_core::alloc::DeviceTaint> {
    (0..2usize, 0..2u8, 0..3u8).prop_map(|(key, value, effect)| kerf_core::alloc::DeviceTaint {
        key: TAINT_KEYS[key].to_owned(),
        value: format!("v{value}"),
        effect: [
            kerf_core::alloc::TaintEffect::None,
            kerf_core::alloc::TaintEffect::NoSchedule,
            kerf_core::alloc::TaintEffect::NoExecute,
        ][usize::from(effect)],
    })
}

fn toleration_strategy() -> impl Strategy<Value = kerf_core::alloc::Toleration> {
    (0..3usize, any::<bool>(), 0..2u8, 0..3u8).prop_map(|(key, exists, value, effect)| {
        use kerf_core::alloc::{TaintEffect, Toleration, TolerationOperator};
        Toleration {
            // Key index 2 is the empty key, which the API allows only with Exists.
            key: TAINT_KEYS.get(key).copied().unwrap_or_default().to_owned(),
            operator: if exists || key == 2 {
                TolerationOperator::Exists
            } else {
                TolerationOperator::Equal
            },
            value: format!("v{value}"),
            effect: [
                None,
                Some(TaintEffect::NoSchedule),
                Some(TaintEffect::NoExecute),
            ][usize::from(effect)],
        }
    })
}

proptest! {
    /// Whatever the taints, tolerations and admin access, no device is placed for a request
    /// that does not tolerate one of the GPU's `NoSchedule`/`NoExecute` taints.
    #[test]
    fn never_placed_on_an_untolerated_taint(
        nodes in prop::collection::vec(node_strategy(String::new()), 1..4),
        taints in prop::collection::vec(prop::collection::vec(taint_strategy(), 0..3), 32),
        pod in pod_strategy(),
        tolerations in prop::collection::vec(prop::collection::vec(toleration_strategy(), 0..3), 4),
        admin in prop::collection::vec(any::<bool>(), 4),
    ) {
        let mut at = 0;
        let nodes: Vec<NodeGpus> = nodes
            .into_iter()
            .enumerate()
            .map(|(n, mut node)| {
                node.node = format!("node-{n}");
                for gpu in &mut node.gpus {
                    gpu.taints.clone_from(&taints[at % taints.len()]);
                    at += 1;
                }
                node
            })
            .collect();
        let index = build(&nodes);
        let mut flat = 0;
        let mut pod = pod_request(0, &pod);
        for claim in &mut pod.claims {
            for req in &mut claim.requests {
                req.tolerations.clone_from(&tolerations[flat % tolerations.len()]);
                req.admin_access = admin[flat % admin.len()] && req.slice.is_none();
                flat += 1;
            }
        }
        let names: Vec<&str> = nodes.iter().map(|n| n.node.as_str()).collect();
        if let Ok(placement) = place(&index, &pod, &names) {
            for (claim, placed) in pod.claims.iter().zip(&placement.claims) {
                for device in &placed.devices {
                    let req = claim.requests.iter().find(|r| r.name == device.request).unwrap();
                    let info = gpu_info(&nodes, &placement.node, &device.device);
                    prop_assert!(
                        kerf_core::alloc::taint::untolerated(&info.taints, &req.tolerations).is_none(),
                        "{} on {} {} with taints {:?}, tolerations {:?}",
                        device.request, placement.node, device.device, info.taints, req.tolerations
                    );
                }
            }
        }
    }
}
