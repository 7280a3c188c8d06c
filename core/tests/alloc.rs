//! The controller's allocator: placement rules, scoring, topology, the index's incremental
//! updates, and the explanations given when nothing fits.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Test helpers may fail loudly.

use kerf_core::alloc::{
    ClaimRequest, DeviceRequest, DeviceUse, GpuInfo, GpuSelector, GpuUsage, Index, NodeGpus,
    PodPlacement, PodRequest, Policy, SliceSize, TopologyScope, UnplaceableReason, place,
};
use kerf_core::inventory::ComputeCapability;
use kerf_core::mock;
use kerf_core::sharing::Sharing;

const GI: u64 = 1 << 30;
const H100: &str = "NVIDIA H100 80GB HBM3";

fn gpu(minor: u32, nvlink: Option<&str>, pcie: Option<&str>) -> GpuInfo {
    GpuInfo {
        device: format!("gpu-{minor}"),
        uuid: format!("GPU-{minor:04}"),
        product: H100.to_owned(),
        memory_bytes: 80 * GI,
        multiprocessors: 132,
        compute_capability: ComputeCapability { major: 9, minor: 0 },
        nvlink_domain: nvlink.map(str::to_owned),
        pcie_root: pcie.map(str::to_owned),
        numa: None,
        taints: Vec::new(),
    }
}

/// `n` GPUs in one NVLink domain, two per PCIe root.
fn nvlink_node(name: &str, n: u32) -> NodeGpus {
    NodeGpus {
        node: name.to_owned(),
        gpus: (0..n)
            .map(|m| gpu(m, Some("nvl-0"), Some(&format!("pci000{}:00", m / 2))))
            .collect(),
    }
}

/// `n` GPUs without NVLink, two per PCIe root.
fn pcie_node(name: &str, n: u32) -> NodeGpus {
    NodeGpus {
        node: name.to_owned(),
        gpus: (0..n)
            .map(|m| gpu(m, None, Some(&format!("pci000{}:00", m / 2))))
            .collect(),
    }
}

fn index(nodes: Vec<NodeGpus>) -> Index {
    let mut index = Index::new();
    for node in nodes {
        index.upsert_node(node);
    }
    index
}

fn slice(memory_gi: u64, compute: u8) -> SliceSize {
    SliceSize {
        memory_bytes: memory_gi * GI,
        compute_percent: compute,
    }
}

fn pod(key: &str, requests: Vec<DeviceRequest>) -> PodRequest {
    PodRequest {
        claims: vec![ClaimRequest {
            key: key.to_owned(),
            requests,
        }],
    }
}

fn with_policy(mut req: DeviceRequest, policy: Policy) -> DeviceRequest {
    req.policy = policy;
    req
}

fn with_topology(mut req: DeviceRequest, topology: TopologyScope) -> DeviceRequest {
    req.topology = topology;
    req
}

/// (node, device) of every device of the placement.
fn where_(placement: &PodPlacement) -> Vec<(String, String)> {
    placement
        .claims
        .iter()
        .flat_map(|c| c.devices.iter())
        .map(|d| (placement.node.clone(), d.device.clone()))
        .collect()
}

fn place_and_apply(index: &mut Index, pod: &PodRequest, nodes: &[&str]) -> PodPlacement {
    let placement = place(index, pod, nodes).expect("fits");
    index.apply(&placement);
    placement
}

#[test]
fn whole_gpu_is_placed_with_its_uuid_and_sharing() {
    let index = index(vec![nvlink_node("node-1", 2)]);
    let placement = place(
        &index,
        &pod("c1", vec![DeviceRequest::whole("gpu", 1)]),
        &["node-1"],
    )
    .unwrap();
    assert_eq!(placement.node, "node-1");
    assert_eq!(placement.claims.len(), 1);
    let device = &placement.claims[0].devices[0];
    assert_eq!(device.request, "gpu");
    assert_eq!(device.device, "gpu-0");
    assert_eq!(device.gpu_uuid, "GPU-0000");
    assert_eq!(device.slice, None);
    assert_eq!(device.sharing, Sharing::Exclusive);
}

#[test]
fn binpack_puts_slices_on_the_same_gpu_and_spread_does_not() {
    for (policy, expected) in [
        (Policy::BinPack, ["gpu-0", "gpu-0", "gpu-0"]),
        (Policy::Spread, ["gpu-0", "gpu-1", "gpu-2"]),
    ] {
        let mut index = index(vec![nvlink_node("node-1", 4)]);
        let devices: Vec<String> = (0..3)
            .map(|i| {
                let req = with_policy(DeviceRequest::slices("s", 1, slice(20, 25)), policy);
                let placement =
                    place_and_apply(&mut index, &pod(&format!("c{i}"), vec![req]), &["node-1"]);
                placement.claims[0].devices[0].device.clone()
            })
            .collect();
        assert_eq!(devices, expected, "{policy:?}");
    }
}

#[test]
fn binpack_prefers_a_used_node_and_spread_an_idle_one() {
    let mut index = index(vec![nvlink_node("node-a", 2), nvlink_node("node-b", 2)]);
    index.set_claim_usage(
        "other",
        vec![DeviceUse::slice("node-b", "gpu-1", 10 * GI, 10)],
    );
    let nodes = ["node-a", "node-b"];
    let binpack = place(
        &index,
        &pod("c", vec![DeviceRequest::slices("s", 1, slice(10, 10))]),
        &nodes,
    )
    .unwrap();
    assert_eq!(where_(&binpack), [("node-b".into(), "gpu-1".into())]);
    let spread_req = with_policy(DeviceRequest::slices("s", 1, slice(10, 10)), Policy::Spread);
    let spread = place(&index, &pod("c", vec![spread_req]), &nodes).unwrap();
    assert_eq!(where_(&spread), [("node-a".into(), "gpu-0".into())]);
}

#[test]
fn binpack_takes_the_tightest_fitting_gpu() {
    let mut index = index(vec![nvlink_node("node-1", 3)]);
    index.set_claim_usage("a", vec![DeviceUse::slice("node-1", "gpu-0", 40 * GI, 0)]);
    index.set_claim_usage("b", vec![DeviceUse::slice("node-1", "gpu-1", 60 * GI, 0)]);
    let placement = place(
        &index,
        &pod("c", vec![DeviceRequest::slices("s", 1, slice(20, 0))]),
        &["node-1"],
    )
    .unwrap();
    assert_eq!(placement.claims[0].devices[0].device, "gpu-1");
}

#[test]
fn whole_gpu_requests_avoid_gpus_with_slices_and_slices_avoid_whole_gpus() {
    let mut index = index(vec![nvlink_node("node-1", 2)]);
    index.set_claim_usage("slice", vec![DeviceUse::slice("node-1", "gpu-0", GI, 1)]);
    let whole = place(
        &index,
        &pod("w", vec![DeviceRequest::whole("g", 1)]),
        &["node-1"],
    )
    .unwrap();
    assert_eq!(whole.claims[0].devices[0].device, "gpu-1");

    let mut index = index_with_whole_gpu0();
    let spread = with_policy(DeviceRequest::slices("s", 1, slice(1, 1)), Policy::Spread);
    let placement = place_and_apply(&mut index, &pod("s", vec![spread]), &["node-1"]);
    assert_eq!(placement.claims[0].devices[0].device, "gpu-1");
    // A compute-only slice reserves no memory but still keeps off the held GPU.
    let compute_only = DeviceRequest::slices(
        "s",
        1,
        SliceSize {
            memory_bytes: 0,
            compute_percent: 10,
        },
    );
    let placement = place(&index, &pod("t", vec![compute_only]), &["node-1"]).unwrap();
    assert_eq!(placement.claims[0].devices[0].device, "gpu-1");
}

fn index_with_whole_gpu0() -> Index {
    let mut index = index(vec![nvlink_node("node-1", 2)]);
    index.set_claim_usage("sched", vec![DeviceUse::whole("node-1", "gpu-0")]);
    index
}

#[test]
fn a_pods_claims_go_to_one_node_without_over_committing_a_gpu_together() {
    let index = index(vec![nvlink_node("node-1", 1), nvlink_node("node-2", 2)]);
    let pod = PodRequest {
        claims: vec![
            ClaimRequest {
                key: "a".into(),
                requests: vec![DeviceRequest::slices("s", 1, slice(50, 50))],
            },
            ClaimRequest {
                key: "b".into(),
                requests: vec![DeviceRequest::slices("s", 1, slice(50, 50))],
            },
        ],
    };
    let placement = place(&index, &pod, &["node-1", "node-2"]).unwrap();
    assert_eq!(placement.node, "node-2");
    let devices: Vec<&str> = placement
        .claims
        .iter()
        .map(|c| c.devices[0].device.as_str())
        .collect();
    assert_eq!(devices, ["gpu-0", "gpu-1"]);
    assert_eq!(placement.claims[0].key, "a");
    assert_eq!(placement.claims[1].key, "b");
}

#[test]
fn two_claims_of_a_pod_may_share_a_gpu_but_one_claim_never_names_a_gpu_twice() {
    let index = index(vec![nvlink_node("node-1", 2)]);
    let shared = PodRequest {
        claims: vec![
            ClaimRequest {
                key: "a".into(),
                requests: vec![DeviceRequest::slices("s", 1, slice(10, 10))],
            },
            ClaimRequest {
                key: "b".into(),
                requests: vec![DeviceRequest::slices("s", 1, slice(10, 10))],
            },
        ],
    };
    let placement = place(&index, &shared, &["node-1"]).unwrap();
    assert_eq!(placement.claims[0].devices[0].device, "gpu-0");
    assert_eq!(placement.claims[1].devices[0].device, "gpu-0");

    let one_claim = pod(
        "a",
        vec![
            DeviceRequest::slices("x", 1, slice(10, 10)),
            DeviceRequest::slices("y", 1, slice(10, 10)),
        ],
    );
    let placement = place(&index, &one_claim, &["node-1"]).unwrap();
    let devices: Vec<&str> = placement.claims[0]
        .devices
        .iter()
        .map(|d| d.device.as_str())
        .collect();
    assert_eq!(devices, ["gpu-0", "gpu-1"]);
    assert_eq!(placement.claims[0].devices[0].request, "x");
    assert_eq!(placement.claims[0].devices[1].request, "y");
}

#[test]
fn nvlink_scope_keeps_a_request_in_one_domain() {
    let node = NodeGpus {
        node: "node-1".into(),
        gpus: vec![
            gpu(0, Some("a"), None),
            gpu(1, Some("b"), None),
            gpu(2, Some("b"), None),
            gpu(3, None, None),
        ],
    };
    let index = index(vec![node]);
    let req = with_topology(
        DeviceRequest::slices("s", 2, slice(20, 0)),
        TopologyScope::NvLink,
    );
    let placement = place(&index, &pod("c", vec![req]), &["node-1"]).unwrap();
    let devices: Vec<&str> = placement.claims[0]
        .devices
        .iter()
        .map(|d| d.device.as_str())
        .collect();
    assert_eq!(devices, ["gpu-1", "gpu-2"]);
}

#[test]
fn any_scope_prefers_an_nvlink_node_then_a_pcie_root() {
    // node-a: 4 GPUs without NVLink, each on its own root; node-b: PCIe pairs; node-c: NVLink.
    let scattered = NodeGpus {
        node: "node-a".into(),
        gpus: (0..4)
            .map(|m| gpu(m, None, Some(&format!("pci{m}"))))
            .collect(),
    };
    let mut idx = index(vec![
        scattered,
        pcie_node("node-b", 4),
        nvlink_node("node-c", 4),
    ]);
    let nodes = ["node-a", "node-b", "node-c"];
    let req = || DeviceRequest::whole("g", 2);
    assert_eq!(
        place(&idx, &pod("c", vec![req()]), &nodes).unwrap().node,
        "node-c"
    );
    idx.remove_node("node-c");
    let placement = place(&idx, &pod("c", vec![req()]), &nodes).unwrap();
    assert_eq!(placement.node, "node-b");
    let devices: Vec<&str> = placement.claims[0]
        .devices
        .iter()
        .map(|d| d.device.as_str())
        .collect();
    assert_eq!(devices, ["gpu-0", "gpu-1"], "one PCIe root");
    idx.remove_node("node-b");
    assert_eq!(
        place(&idx, &pod("c", vec![req()]), &nodes).unwrap().node,
        "node-a"
    );
}

#[test]
fn pcie_scope_keeps_a_request_behind_one_root() {
    let mut index = index(vec![pcie_node("node-1", 4)]);
    index.set_claim_usage("x", vec![DeviceUse::whole("node-1", "gpu-0")]);
    let req = with_topology(DeviceRequest::whole("g", 2), TopologyScope::PcieRoot);
    let placement = place(&index, &pod("c", vec![req]), &["node-1"]).unwrap();
    let devices: Vec<&str> = placement.claims[0]
        .devices
        .iter()
        .map(|d| d.device.as_str())
        .collect();
    assert_eq!(devices, ["gpu-2", "gpu-3"]);
}

#[test]
fn max_slices_per_gpu_counts_every_writers_slices() {
    let mut index = index(vec![nvlink_node("node-1", 1)]);
    index.set_claim_usage("a", vec![DeviceUse::slice("node-1", "gpu-0", GI, 1)]);
    index.set_claim_usage("b", vec![DeviceUse::slice("node-1", "gpu-0", GI, 1)]);
    let mut req = DeviceRequest::slices("s", 1, slice(1, 1));
    req.max_slices_per_gpu = Some(3);
    assert!(place(&index, &pod("c", vec![req.clone()]), &["node-1"]).is_ok());
    req.max_slices_per_gpu = Some(2);
    let err = place(&index, &pod("c", vec![req]), &["node-1"]).unwrap_err();
    assert_eq!(err.reason(), "max_slices");
    assert_eq!(
        err.to_string(),
        "request \"s\": no node has 1 GPU with 1Gi memory and 1% compute free; best: node-1 has 0 (of its matching GPUs, 1 at the limit of 2 slices)"
    );
}

#[test]
fn explains_an_nvlink_shortfall_with_the_best_node() {
    let nodes = vec![
        NodeGpus {
            node: "node-1".into(),
            gpus: vec![gpu(0, Some("a"), None)],
        },
        NodeGpus {
            node: "node-2".into(),
            gpus: vec![gpu(0, Some("a"), None), gpu(1, Some("b"), None)],
        },
        NodeGpus {
            node: "node-3".into(),
            gpus: vec![gpu(0, Some("a"), None), gpu(1, Some("a"), None)],
        },
    ];
    let mut index = index(nodes);
    index.set_claim_usage("x", vec![DeviceUse::slice("node-2", "gpu-1", 70 * GI, 0)]);
    index.set_claim_usage("y", vec![DeviceUse::slice("node-3", "gpu-1", 70 * GI, 0)]);
    let req = with_topology(
        DeviceRequest::slices("gpu", 2, slice(20, 0)),
        TopologyScope::NvLink,
    );
    let err = place(
        &index,
        &pod("c", vec![req]),
        &["node-1", "node-2", "node-3"],
    )
    .unwrap_err();
    assert_eq!(err.kind(), UnplaceableReason::InsufficientMemory);
    assert_eq!(err.reason(), "insufficient_memory");
    // node-1 has too few GPUs, node-2 and node-3 have one that fits each: the tie goes to
    // the lower name.
    assert_eq!(
        err.message(),
        "request \"gpu\": no node has 2 GPUs with 20Gi memory free on one NVLink domain; best: node-2 has 1 (of its matching GPUs, 1 with too little memory free)"
    );
    assert_eq!(err.best().unwrap().node, "node-2");
    assert_eq!(err.best().unwrap().found, 1);
    assert_eq!(err.claim(), Some("c"));
    assert_eq!(err.request(), Some("gpu"));
    assert_eq!(err.needed(), 2);
}

#[test]
fn explains_a_topology_failure() {
    let node = NodeGpus {
        node: "node-1".into(),
        gpus: vec![
            gpu(0, Some("a"), None),
            gpu(1, Some("b"), None),
            gpu(2, None, None),
        ],
    };
    let index = index(vec![node]);
    let req = with_topology(DeviceRequest::whole("gpu", 2), TopologyScope::NvLink);
    let err = place(&index, &pod("c", vec![req]), &["node-1"]).unwrap_err();
    assert_eq!(err.reason(), "topology");
    assert_eq!(
        err.to_string(),
        "request \"gpu\": no node has 2 free whole GPUs on one NVLink domain; best: node-1 has 1 (3 fit, but spread over NVLink domains or without one)"
    );
}

#[test]
fn explains_gpus_in_use_and_compute_shortage() {
    let mut index = index(vec![nvlink_node("node-1", 2)]);
    index.set_claim_usage("x", vec![DeviceUse::slice("node-1", "gpu-0", GI, 1)]);
    index.set_claim_usage("y", vec![DeviceUse::whole("node-1", "gpu-1")]);
    let err = place(
        &index,
        &pod("c", vec![DeviceRequest::whole("g", 1)]),
        &["node-1"],
    )
    .unwrap_err();
    assert_eq!(err.reason(), "in_use");
    assert_eq!(
        err.to_string(),
        "request \"g\": no node has 1 free whole GPU; best: node-1 has 0 (of its matching GPUs, 2 in use)"
    );

    index.set_claim_usage("x", vec![DeviceUse::slice("node-1", "gpu-0", GI, 90)]);
    index.set_claim_usage("y", vec![DeviceUse::slice("node-1", "gpu-1", GI, 85)]);
    let err = place(
        &index,
        &pod("c", vec![DeviceRequest::slices("s", 1, slice(1, 20))]),
        &["node-1"],
    )
    .unwrap_err();
    assert_eq!(err.reason(), "insufficient_compute");
    assert!(
        err.to_string().contains("2 with too little compute free"),
        "{err}"
    );
}

#[test]
fn explains_a_selector_mismatch() {
    let index = index(vec![nvlink_node("node-1", 2)]);
    let mut req = DeviceRequest::whole("g", 1);
    req.selector = GpuSelector {
        product_names: vec!["NVIDIA L4".into()],
        min_memory_bytes: Some(16 * GI),
        min_compute_capability: Some(ComputeCapability { major: 8, minor: 9 }),
    };
    let err = place(&index, &pod("c", vec![req.clone()]), &["node-1"]).unwrap_err();
    assert_eq!(err.reason(), "selector");
    assert_eq!(
        err.to_string(),
        "request \"g\": no node has 1 GPU (product \"NVIDIA L4\", at least 16Gi memory, compute capability 8.9 or newer); best: node-1 has 0"
    );
    req.selector.product_names = vec![H100.into()];
    assert!(place(&index, &pod("c", vec![req.clone()]), &["node-1"]).is_ok());
    req.selector.min_compute_capability = Some(ComputeCapability {
        major: 10,
        minor: 0,
    });
    assert_eq!(
        place(&index, &pod("c", vec![req]), &["node-1"])
            .unwrap_err()
            .reason(),
        "selector"
    );
}

#[test]
fn the_best_node_is_the_one_that_got_furthest() {
    let mut index = index(vec![
        nvlink_node("node-1", 1),
        nvlink_node("node-2", 2),
        nvlink_node("node-3", 4),
    ]);
    index.set_claim_usage(
        "x",
        vec![
            DeviceUse::whole("node-3", "gpu-0"),
            DeviceUse::whole("node-3", "gpu-1"),
        ],
    );
    let err = place(
        &index,
        &pod("c", vec![DeviceRequest::whole("g", 3)]),
        &["node-1", "node-2", "node-3"],
    )
    .unwrap_err();
    // node-3 has enough matching GPUs (stage beyond the selector) and two of them free.
    assert_eq!(err.best().unwrap().node, "node-3");
    assert_eq!(err.best().unwrap().found, 2);
    assert_eq!(err.reason(), "in_use");
}

#[test]
fn no_candidate_nodes() {
    let index = index(vec![nvlink_node("node-1", 1)]);
    let req = pod("c", vec![DeviceRequest::whole("g", 1)]);
    let err = place(&index, &req, &[]).unwrap_err();
    assert_eq!(err.reason(), "no_candidate_nodes");
    assert!(err.best().is_none());
    let err = place(&index, &req, &["node-9", "node-8"]).unwrap_err();
    assert_eq!(err.reason(), "no_candidate_nodes");
    assert_eq!(
        err.to_string(),
        "none of the 2 candidate nodes has GPUs of this driver"
    );
}

#[test]
fn invalid_requests_are_refused_before_looking_at_nodes() {
    let index = index(vec![nvlink_node("node-1", 1)]);
    let cases = [
        (
            DeviceRequest::whole("g", 0),
            "request \"g\": count must be at least 1",
        ),
        (
            DeviceRequest::slices("g", 1, slice(1, 150)),
            "request \"g\": compute 150% is more than 100%",
        ),
        (
            DeviceRequest::slices("g", 1, SliceSize::default()),
            "request \"g\": a slice must reserve memory or compute",
        ),
        (
            DeviceRequest::whole("g", 5000),
            "request \"g\": count 5000 is more than 1024",
        ),
    ];
    for (req, message) in cases {
        let err = place(&index, &pod("c", vec![req]), &["node-1"]).unwrap_err();
        assert_eq!(err.reason(), "invalid_request");
        assert_eq!(err.to_string(), message);
    }
    let err = place(&index, &PodRequest::default(), &["node-1"]).unwrap_err();
    assert_eq!(err.reason(), "invalid_request");
}

#[test]
fn candidate_order_and_duplicates_do_not_change_the_result() {
    let mut index = index(
        (0..6)
            .map(|i| nvlink_node(&format!("node-{i}"), 4))
            .collect(),
    );
    index.set_claim_usage("x", vec![DeviceUse::slice("node-4", "gpu-2", 30 * GI, 30)]);
    index.set_claim_usage("y", vec![DeviceUse::slice("node-1", "gpu-2", 30 * GI, 30)]);
    let req = pod("c", vec![DeviceRequest::slices("s", 2, slice(10, 10))]);
    let forward = ["node-0", "node-1", "node-2", "node-3", "node-4", "node-5"];
    let backward = [
        "node-5", "node-4", "node-4", "node-3", "node-2", "node-1", "node-0",
    ];
    let a = place(&index, &req, &forward).unwrap();
    let b = place(&index, &req, &backward).unwrap();
    assert_eq!(a, b);
    assert_eq!(
        a.node, "node-1",
        "equal scores tie-break to the lower node name"
    );
}

#[test]
fn usage_before_inventory_applies_when_the_node_arrives_and_survives_its_removal() {
    let mut index = Index::new();
    index.set_claim_usage("x", vec![DeviceUse::whole("node-1", "gpu-0")]);
    index.upsert_node(nvlink_node("node-1", 1));
    let node = index.node("node-1").unwrap();
    let gpu0 = node.gpus().next().unwrap();
    assert!(gpu0.is_held_whole());
    assert_eq!(gpu0.free_memory_bytes(), 0);
    assert!(index.remove_node("node-1"));
    assert!(!index.remove_node("node-1"));
    assert!(index.node("node-1").is_none());
    index.upsert_node(nvlink_node("node-1", 1));
    assert!(
        index
            .node("node-1")
            .unwrap()
            .gpus()
            .next()
            .unwrap()
            .is_held_whole()
    );
    assert_eq!(
        index.claims_using("node-1", "gpu-0").collect::<Vec<_>>(),
        ["x"]
    );
}

#[test]
fn claim_updates_replace_and_remove_usage() {
    let mut index = index(vec![nvlink_node("node-1", 2)]);
    index.set_claim_usage("c", vec![DeviceUse::slice("node-1", "gpu-0", 30 * GI, 40)]);
    index.set_claim_usage("c", vec![DeviceUse::slice("node-1", "gpu-0", 30 * GI, 40)]);
    let free = |index: &Index, device: &str| {
        let node = index.node("node-1").unwrap();
        let gpu = node.gpus().find(|g| g.info().device == device).unwrap();
        (
            gpu.free_memory_bytes(),
            gpu.free_compute_percent(),
            gpu.usage().slices,
        )
    };
    assert_eq!(
        free(&index, "gpu-0"),
        (50 * GI, 60, 1),
        "setting the same usage twice counts once"
    );
    index.set_claim_usage("c", vec![DeviceUse::slice("node-1", "gpu-1", 10 * GI, 10)]);
    assert_eq!(free(&index, "gpu-0"), (80 * GI, 100, 0));
    assert_eq!(free(&index, "gpu-1"), (70 * GI, 90, 1));
    assert_eq!(index.claim_count(), 1);
    assert!(index.remove_claim("c"));
    assert!(!index.remove_claim("c"));
    assert_eq!(free(&index, "gpu-1"), (80 * GI, 100, 0));
    assert_eq!(index.claim_count(), 0);
    assert_eq!(index.gpu_usage("node-1", "gpu-1"), GpuUsage::default());
}

#[test]
fn a_placement_applied_to_the_index_is_seen_by_the_next_decision() {
    let mut index = index(vec![nvlink_node("node-1", 1)]);
    let req = pod("c1", vec![DeviceRequest::slices("s", 1, slice(60, 0))]);
    let placement = place_and_apply(&mut index, &req, &["node-1"]);
    assert_eq!(
        index.claim_uses("c1").unwrap(),
        placement.claims[0].device_uses("node-1").as_slice()
    );
    let err = place(
        &index,
        &pod("c2", vec![DeviceRequest::slices("s", 1, slice(60, 0))]),
        &["node-1"],
    )
    .unwrap_err();
    assert_eq!(err.reason(), "insufficient_memory");
}

#[test]
fn node_gpus_from_a_mock_inventory() {
    let inventory = mock::from_spec("a100-40gb-mig").unwrap();
    let node = NodeGpus::from_inventory("node-1", &inventory);
    let devices: Vec<&str> = node.gpus.iter().map(|g| g.device.as_str()).collect();
    assert_eq!(
        devices,
        ["gpu-2", "gpu-3"],
        "GPUs in MIG mode are the scheduler's"
    );
    let h100 = NodeGpus::from_inventory("node-1", &mock::from_spec("h100-sxm-80gb").unwrap());
    assert_eq!(h100.gpus.len(), 8);
    assert!(
        h100.gpus
            .iter()
            .all(|g| g.nvlink_domain.is_some() && g.nvlink_domain == h100.gpus[0].nvlink_domain)
    );
}

/// A mixed workload on four DGX H100 mock nodes, placed under each policy. Prints the
/// placement table (run with `--nocapture`) and checks what distinguishes the policies.
#[test]
fn mixed_workload_on_four_h100_nodes() {
    let inventory = mock::from_spec("h100-sxm-80gb").unwrap();
    let names = ["node-1", "node-2", "node-3", "node-4"];
    let workload: Vec<(&str, DeviceRequest)> = vec![
        (
            "train-a",
            with_topology(DeviceRequest::whole("gpus", 4), TopologyScope::NvLink),
        ),
        ("infer-1", DeviceRequest::slices("gpu", 1, slice(20, 25))),
        ("infer-2", DeviceRequest::slices("gpu", 1, slice(20, 25))),
        ("infer-3", DeviceRequest::slices("gpu", 1, slice(40, 50))),
        ("notebook-1", DeviceRequest::slices("gpu", 1, slice(10, 10))),
        ("notebook-2", DeviceRequest::slices("gpu", 1, slice(10, 10))),
        (
            "train-b",
            with_topology(
                DeviceRequest::slices("gpus", 2, slice(40, 50)),
                TopologyScope::NvLink,
            ),
        ),
        ("infer-4", DeviceRequest::slices("gpu", 1, slice(20, 25))),
        ("whole-1", DeviceRequest::whole("gpu", 1)),
    ];
    let mut partial = Vec::new();
    for policy in [Policy::BinPack, Policy::Spread] {
        let mut index = Index::new();
        for name in names {
            index.upsert_node(NodeGpus::from_inventory(name, &inventory));
        }
        println!("\n{policy:?}\n| claim | request | node | devices |\n|---|---|---|---|");
        for (claim, req) in &workload {
            let req = with_policy(req.clone(), policy);
            let placement = place_and_apply(&mut index, &pod(claim, vec![req.clone()]), &names);
            let devices: Vec<&str> = placement.claims[0]
                .devices
                .iter()
                .map(|d| d.device.as_str())
                .collect();
            let size = req.slice.map_or("whole".to_owned(), |s| {
                format!("{}Gi/{}%", s.memory_bytes / GI, s.compute_percent)
            });
            println!(
                "| {claim} | {}×{size} | {} | {} |",
                req.count,
                placement.node,
                devices.join(", ")
            );
        }
        let (used_nodes, partial_gpus) = usage_summary(&index);
        println!("nodes used: {used_nodes}, partially used GPUs: {partial_gpus}");
        partial.push((used_nodes, partial_gpus));
    }
    let (binpack, spread) = (partial[0], partial[1]);
    assert!(
        binpack.0 < spread.0,
        "BinPack uses fewer nodes: {binpack:?} vs {spread:?}"
    );
    assert!(
        binpack.1 < spread.1,
        "BinPack leaves fewer partial GPUs: {binpack:?} vs {spread:?}"
    );
}

fn usage_summary(index: &Index) -> (usize, usize) {
    let mut nodes = 0;
    let mut partial = 0;
    for node in index.nodes() {
        let gpus: Vec<_> = node.gpus().collect();
        nodes += usize::from(gpus.iter().any(|g| !g.is_idle()));
        partial += gpus
            .iter()
            .filter(|g| {
                !g.is_idle()
                    && !g.is_held_whole()
                    && (g.free_memory_bytes() > 0 || g.free_compute_percent() > 0)
            })
            .count();
    }
    (nodes, partial)
}

#[test]
fn ties_go_to_the_lowest_node_name_whatever_the_insertion_order() {
    // Descending and interleaved insertions exhaust the gaps between the index's internal
    // order keys and force renumbering.
    let mut index = Index::new();
    let mut names: Vec<String> = (0..300).rev().map(|i| format!("n-{i:03}")).collect();
    names.extend((0..300).map(|i| format!("n-{i:03}-b")));
    for name in &names {
        index.upsert_node(nvlink_node(name, 1));
    }
    let all: Vec<&str> = names.iter().map(String::as_str).collect();
    let whole = pod("c", vec![DeviceRequest::whole("g", 1)]);
    assert_eq!(place(&index, &whole, &all).unwrap().node, "n-000");
    index.remove_node("n-000");
    assert_eq!(place(&index, &whole, &all).unwrap().node, "n-000-b");
    index.upsert_node(nvlink_node("n-000", 1));
    assert_eq!(place(&index, &whole, &all).unwrap().node, "n-000");
    let spread = with_policy(DeviceRequest::whole("g", 1), Policy::Spread);
    assert_eq!(
        place(&index, &pod("c", vec![spread]), &all).unwrap().node,
        "n-000"
    );
    let last_half: Vec<&str> = all.iter().copied().filter(|n| n.ends_with("-b")).collect();
    assert_eq!(place(&index, &whole, &last_half).unwrap().node, "n-000-b");
    assert_eq!(
        kerf_core::alloc::place_where(&index, &whole, |n| n.ends_with("-b"))
            .unwrap()
            .node,
        "n-000-b"
    );
}

fn shared(sharing: Sharing, memory_gi: u64, compute: u8) -> DeviceRequest {
    let mut req = DeviceRequest::slices("s", 1, slice(memory_gi, compute));
    req.sharing = sharing;
    req
}

#[test]
fn a_gpu_never_carries_mps_and_time_sliced_slices_together() {
    // gpu-0 carries an MPS slice (from any writer), gpu-1 a time-sliced one.
    let mut index = index(vec![nvlink_node("node-1", 2)]);
    index.set_claim_usage(
        "mps",
        vec![DeviceUse::slice("node-1", "gpu-0", GI, 10).shared_by(Sharing::Mps)],
    );
    index.set_claim_usage(
        "ts",
        vec![DeviceUse::slice("node-1", "gpu-1", GI, 10).shared_by(Sharing::TimeSlicing)],
    );
    for (sharing, gpu) in [(Sharing::Mps, "gpu-0"), (Sharing::TimeSlicing, "gpu-1")] {
        for policy in [Policy::BinPack, Policy::Spread] {
            let req = with_policy(shared(sharing, 1, 1), policy);
            let placement = place(&index, &pod("p", vec![req]), &["node-1"]).unwrap();
            assert_eq!(
                placement.claims[0].devices[0].device, gpu,
                "{sharing:?} {policy:?}"
            );
        }
    }
    // Slices without a strategy go anywhere.
    let plain = with_policy(shared(Sharing::Exclusive, 1, 1), Policy::Spread);
    assert!(place(&index, &pod("p", vec![plain]), &["node-1"]).is_ok());

    // With gpu-1 gone to MPS too, a time-sliced slice has nowhere to go, and says why.
    index.set_claim_usage(
        "ts",
        vec![DeviceUse::slice("node-1", "gpu-1", GI, 10).shared_by(Sharing::Mps)],
    );
    let error = place(
        &index,
        &pod("p", vec![shared(Sharing::TimeSlicing, 1, 1)]),
        &["node-1"],
    )
    .unwrap_err();
    assert_eq!(error.reason(), "sharing_conflict");
    assert!(
        error.to_string().contains("2 carrying MPS slices"),
        "{error}"
    );
    // Once the last MPS slice of a GPU is gone, it takes time-sliced slices again.
    assert!(index.remove_claim("ts"));
    let placement = place(
        &index,
        &pod("p", vec![shared(Sharing::TimeSlicing, 1, 1)]),
        &["node-1"],
    )
    .unwrap();
    assert_eq!(placement.claims[0].devices[0].device, "gpu-1");
}

#[test]
fn two_claims_of_one_pod_never_mix_strategies_on_a_gpu() {
    // Two claims of a pod may share a GPU through slices (BinPack stacks them), unless their
    // strategies differ.
    let index = index(vec![nvlink_node("node-1", 2)]);
    let two_claims = |second: Sharing| PodRequest {
        claims: vec![
            ClaimRequest {
                key: "a".to_owned(),
                requests: vec![shared(Sharing::Mps, 1, 1)],
            },
            ClaimRequest {
                key: "b".to_owned(),
                requests: vec![shared(second, 1, 1)],
            },
        ],
    };
    let gpus = |placement: &PodPlacement| -> Vec<String> {
        placement
            .claims
            .iter()
            .map(|c| c.devices[0].device.clone())
            .collect()
    };
    let same = place(&index, &two_claims(Sharing::Mps), &["node-1"]).unwrap();
    assert_eq!(gpus(&same)[0], gpus(&same)[1]);
    let mixed = place(&index, &two_claims(Sharing::TimeSlicing), &["node-1"]).unwrap();
    assert_ne!(gpus(&mixed)[0], gpus(&mixed)[1]);
}
