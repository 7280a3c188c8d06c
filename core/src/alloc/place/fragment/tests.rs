use super::*;
use crate::alloc::frag::TaskShape;
use crate::alloc::request::{ClaimRequest, DeviceRequest, PodRequest, Policy, SliceSize};
use crate::alloc::{DeviceUse, GpuInfo, NodeGpus, place};
use crate::inventory::ComputeCapability;

const GI: u64 = 1 << 30;
const GIB: i64 = 1 << 30;

fn node(name: &str, gpus: usize) -> NodeGpus {
    NodeGpus {
        node: name.into(),
        gpus: (0..gpus)
            .map(|g| GpuInfo {
                device: format!("gpu-{g}"),
                uuid: format!("GPU-{name}-{g}"),
                product: "H100".into(),
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

fn slice(percent: u8) -> SliceSize {
    SliceSize {
        memory_bytes: u64::from(percent) * 80 * GI / 100,
        compute_percent: percent,
    }
}

fn kind(gpus: u32, percent: u8, cpu: i64) -> TaskShape {
    TaskShape {
        gpus,
        slice: (percent < 100).then(|| slice(percent)),
        host: HostAmounts {
            milli_cpu: cpu,
            memory: GIB,
        },
        ..TaskShape::default()
    }
}

fn pod(request: DeviceRequest) -> PodRequest {
    PodRequest {
        claims: vec![ClaimRequest {
            key: "c".into(),
            requests: vec![request],
        }],
    }
}

fn host(cpu: i64, requested: i64) -> HostState {
    HostState {
        allocatable: HostAmounts {
            milli_cpu: cpu,
            memory: 512 * GIB,
        },
        requested: HostAmounts {
            milli_cpu: requested,
            memory: 0,
        },
    }
}

fn ctx<'a>(
    workload: &'a Distribution,
    hosts: &'a dyn Fn(&str) -> Option<HostState>,
) -> PlacementContext<'a> {
    PlacementContext {
        workload,
        pod: HostAmounts {
            milli_cpu: 1000,
            memory: GIB,
        },
        hosts,
        steer_pods_without_gpus: false,
    }
}

fn unknown(_: &str) -> Option<HostState> {
    None
}

#[test]
fn without_a_workload_it_places_as_bin_pack() {
    let mut index = Index::new();
    for n in ["a", "b", "c"] {
        index.upsert_node(node(n, 4));
    }
    index.set_claim_usage("x", vec![DeviceUse::slice("b", "gpu-2", 20 * GI, 30)]);
    let empty = Distribution::default();
    for size in [10, 60, 100] {
        let mut request = DeviceRequest::slices("s", 1, slice(size));
        if size == 100 {
            request = DeviceRequest::whole("w", 2);
        }
        assert_eq!(request.policy, Policy::LeastFragmentation);
        let with = place_with(
            &index,
            &pod(request.clone()),
            &["a", "b", "c"],
            &ctx(&empty, &unknown),
        );
        let binpack = place(
            &index,
            &pod(DeviceRequest {
                policy: Policy::BinPack,
                ..request
            }),
            &["a", "b", "c"],
        );
        assert_eq!(with, binpack);
    }
}

#[test]
fn a_slice_goes_where_the_rest_stays_usable() {
    // Half slices are common: 40 % on the 60 %-free GPU would leave 20 %, a fragment to
    // them; on the idle GPU it leaves 60 % and 60 %, both usable. BinPack takes the used GPU.
    let mut index = Index::new();
    index.upsert_node(node("n", 2));
    index.set_claim_usage("x", vec![DeviceUse::slice("n", "gpu-1", 32 * GI, 40)]);
    let workload = Distribution::new([(kind(1, 50, 0), 1.0)], 1);
    let request = DeviceRequest::slices("s", 1, slice(40));
    let placed = place_with(
        &index,
        &pod(request.clone()),
        &["n"],
        &ctx(&workload, &unknown),
    )
    .unwrap();
    assert_eq!(placed.claims[0].devices[0].device, "gpu-0");
    let binpack = place(
        &index,
        &pod(DeviceRequest {
            policy: Policy::BinPack,
            ..request
        }),
        &["n"],
    )
    .unwrap();
    assert_eq!(binpack.claims[0].devices[0].device, "gpu-1");
}

#[test]
fn one_gpu_pods_keep_off_the_idle_node_eight_gpu_pods_need() {
    let mut index = Index::new();
    index.upsert_node(node("idle", 8));
    index.upsert_node(node("used", 8));
    index.set_claim_usage("x", vec![DeviceUse::whole("used", "gpu-0")]);
    let workload = Distribution::new([(kind(1, 100, 0), 4.0), (kind(8, 100, 0), 1.0)], 1);
    let placed = place_with(
        &index,
        &pod(DeviceRequest::whole("w", 1)),
        &["idle", "used"],
        &ctx(&workload, &unknown),
    )
    .unwrap();
    assert_eq!(placed.node, "used");
}

#[test]
fn a_node_whose_cpu_its_gpus_need_is_spared() {
    // Two idle 2-GPU nodes; pods ask 8 CPUs per GPU. The pod's 8 CPUs on the 16-CPU node
    // would strand a GPU there; the 64-CPU node has CPU to spare.
    let mut index = Index::new();
    index.upsert_node(node("lean", 2));
    index.upsert_node(node("rich", 2));
    let workload = Distribution::new([(kind(1, 100, 8000), 1.0)], 1);
    let hosts = |name: &str| Some(host(if name == "lean" { 16_000 } else { 64_000 }, 0));
    let mut context = ctx(&workload, &hosts);
    context.pod.milli_cpu = 12_000;
    let placed = place_with(
        &index,
        &pod(DeviceRequest::whole("w", 1)),
        &["lean", "rich"],
        &context,
    )
    .unwrap();
    assert_eq!(placed.node, "rich");
}

#[test]
fn steering_uses_the_idle_node_kube_scheduler_would_strand() {
    // Pods without GPUs (12 CPUs) go to the least allocated node: both idle nodes tie.
    // There they would strand a GPU of the lean node, none of the rich one; so kerf takes
    // the lean one and leaves the rich one idle for them.
    let mut index = Index::new();
    index.upsert_node(node("lean", 2));
    index.upsert_node(node("rich", 2));
    let workload = Distribution::new([(kind(1, 100, 8000), 1.0), (kind(0, 100, 12_000), 1.0)], 1);
    let hosts = |name: &str| Some(host(if name == "lean" { 20_000 } else { 64_000 }, 0));
    let mut context = ctx(&workload, &hosts);
    context.pod.milli_cpu = 2000;
    let request = pod(DeviceRequest::whole("w", 1));
    let calm = place_with(&index, &request, &["lean", "rich"], &context).unwrap();
    context.steer_pods_without_gpus = true;
    let steered = place_with(&index, &request, &["lean", "rich"], &context).unwrap();
    assert_eq!(steered.node, "lean", "unsteered: {}", calm.node);
    // Deterministic: the same question, the same answer.
    assert_eq!(
        place_with(&index, &request, &["lean", "rich"], &context).unwrap(),
        steered
    );
}

#[test]
fn pods_without_gpus_go_where_their_cpu_is_spare() {
    let mut index = Index::new();
    index.upsert_node(node("lean", 2));
    index.upsert_node(node("rich", 2));
    let workload = Distribution::new([(kind(1, 100, 8000), 1.0)], 1);
    let hosts = |name: &str| Some(host(if name == "lean" { 16_000 } else { 64_000 }, 0));
    let mut context = ctx(&workload, &hosts);
    context.pod.milli_cpu = 8000;
    let chosen = place_without_gpus(&index, |_| true, &context);
    assert_eq!(chosen.as_deref(), Some("rich"));
    context.pod.milli_cpu = 100_000;
    assert_eq!(place_without_gpus(&index, |_| true, &context), None);
}

#[test]
fn identical_nodes_are_evaluated_once_and_placed_alike() {
    let mut index = Index::new();
    for n in 0..50 {
        index.upsert_node(node(&format!("n{n:02}"), 4));
    }
    let workload = Distribution::new([(kind(1, 50, 0), 1.0)], 1);
    let names: Vec<String> = (0..50).map(|n| format!("n{n:02}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let request = pod(DeviceRequest::slices("s", 1, slice(50)));
    let placed = place_with(&index, &request, &names, &ctx(&workload, &unknown)).unwrap();
    // Every node scores alike: the tie goes to the highest name hash.
    let expected = names.iter().max_by_key(|n| name_hash(n)).unwrap();
    assert_eq!(placed.node, *expected);
    assert_eq!(placed.claims[0].devices[0].device, "gpu-0");
}
