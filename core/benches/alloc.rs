//! Benchmarks of the controller's allocator at cluster scale: 1,000 nodes of 8 H100s, empty,
//! half used and nearly full, for the kinds of pods the controller places. The target is
//! 10,000 decisions per second with a p99 under 1 ms.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)] // A benchmark that cannot set up has nothing to measure.

use divan::{Bencher, black_box};
use kerf_core::alloc::{
    ClaimRequest, DeviceRequest, DeviceUse, Distribution, HostAmounts, HostState, Index, NodeGpus,
    PlacementContext, PodRequest, Policy, SliceSize, TaskShape, TopologyScope, place, place_where,
    place_with,
};
use kerf_core::mock;

fn main() {
    divan::main();
}

const NODES: usize = 1000;
const GI: u64 = 1 << 30;

/// Fill levels: share of GPUs (in eighths) that carry slices or are held whole.
const FILLS: [u32; 3] = [0, 4, 7];

fn cluster(fill: u32) -> (Index, Vec<String>) {
    let inventory = mock::from_spec(mock::H100_SXM_80GB).unwrap();
    let mut index = Index::new();
    let names: Vec<String> = (0..NODES).map(|n| format!("node-{n:04}")).collect();
    for (n, name) in names.iter().enumerate() {
        index.upsert_node(NodeGpus::from_inventory(name, &inventory));
        for m in 0..fill {
            let device = format!("gpu-{m}");
            let uses = if (n + m as usize).is_multiple_of(3) {
                vec![DeviceUse::whole(name, &device)]
            } else {
                vec![DeviceUse::slice(
                    name,
                    &device,
                    (10 + 10 * (n as u64 % 5)) * GI,
                    30,
                )]
            };
            index.set_claim_usage(&format!("{name}-{device}"), uses);
        }
    }
    (index, names)
}

fn pods() -> [(&'static str, PodRequest); 4] {
    let one = |req: DeviceRequest| PodRequest {
        claims: vec![ClaimRequest {
            key: "bench".into(),
            requests: vec![req],
        }],
    };
    let slice = SliceSize {
        memory_bytes: 20 * GI,
        compute_percent: 25,
    };
    let mut nvlink = DeviceRequest::whole("g", 2);
    nvlink.topology = TopologyScope::NvLink;
    let mut spread = DeviceRequest::slices("s", 1, slice);
    spread.policy = Policy::Spread;
    [
        ("slice_binpack", one(DeviceRequest::slices("s", 1, slice))),
        ("slice_spread", one(spread)),
        ("whole_2_nvlink", one(nvlink)),
        (
            "two_claims",
            PodRequest {
                claims: vec![
                    ClaimRequest {
                        key: "a".into(),
                        requests: vec![DeviceRequest::slices("s", 2, slice)],
                    },
                    ClaimRequest {
                        key: "b".into(),
                        requests: vec![DeviceRequest::whole("g", 1)],
                    },
                ],
            },
        ),
    ]
}

#[divan::bench(args = FILLS)]
fn place_pods(bencher: Bencher, fill: u32) {
    let (index, names) = cluster(fill);
    let candidates: Vec<&str> = names.iter().map(String::as_str).collect();
    let pods = pods();
    bencher.bench_local(|| {
        for (_, pod) in &pods {
            let _ = black_box(place(&index, black_box(pod), &candidates));
        }
    });
}

#[divan::bench(args = FILLS)]
fn place_where_pods(bencher: Bencher, fill: u32) {
    let (index, _) = cluster(fill);
    let pods = pods();
    bencher.bench_local(|| {
        for (_, pod) in &pods {
            let _ = black_box(place_where(&index, black_box(pod), |_| true));
        }
    });
}

#[divan::bench(args = FILLS)]
fn place_apply_release(bencher: Bencher, fill: u32) {
    let (mut index, names) = cluster(fill);
    let candidates: Vec<&str> = names.iter().map(String::as_str).collect();
    let (_, pod) = &pods()[0];
    bencher.bench_local(|| {
        if let Ok(placement) = place(&index, pod, &candidates) {
            index.apply(&placement);
            index.remove_claim("bench");
        }
    });
}

#[divan::bench]
fn unplaceable_explained(bencher: Bencher) {
    let (index, names) = cluster(8);
    let candidates: Vec<&str> = names.iter().map(String::as_str).collect();
    let pod = &pods()[2].1;
    bencher.bench_local(|| black_box(place(&index, pod, &candidates)).is_err());
}

/// A slice that fits nowhere on a nearly full cluster: the decision includes the
/// explanation (which node came closest and why), the controller's cost per unplaceable
/// claim.
#[divan::bench]
fn unplaceable_slice_explained(bencher: Bencher) {
    let (index, _) = cluster(7);
    let size = SliceSize {
        memory_bytes: 75 * GI,
        compute_percent: 80,
    };
    let pod = PodRequest {
        claims: vec![ClaimRequest {
            key: "bench".into(),
            requests: vec![DeviceRequest::slices("s", 2, size)],
        }],
    };
    bencher.bench_local(|| black_box(place_where(&index, &pod, |_| true)).is_err());
}

/// The pod kinds of the LeastFragmentation benches: slices of 25 and 50 %, one, two and eight
/// whole GPUs, and pods without GPUs, with CPU and memory.
fn workload() -> Distribution {
    let kind = |gpus: u32, percent: u8, cpu: i64, weight: f64| {
        let shape = TaskShape {
            gpus,
            slice: (percent < 100).then_some(SliceSize {
                memory_bytes: u64::from(percent) * 80 * GI / 100,
                compute_percent: percent,
            }),
            host: HostAmounts {
                milli_cpu: cpu,
                memory: (cpu * 4) << 20,
            },
            ..TaskShape::default()
        };
        (shape, weight)
    };
    Distribution::new(
        [
            kind(1, 25, 4000, 3.0),
            kind(1, 50, 8000, 3.0),
            kind(1, 100, 12_000, 4.0),
            kind(2, 100, 24_000, 1.0),
            kind(8, 100, 96_000, 0.5),
            kind(0, 100, 16_000, 1.5),
        ],
        1,
    )
}

/// Every node has 224 CPUs and 2 TiB, with a different share of them requested, so that few
/// nodes are alike (the policy evaluates each distinct node state once).
fn host(name: &str) -> Option<HostState> {
    let n: i64 = name.trim_start_matches("node-").parse().ok()?;
    Some(HostState {
        allocatable: HostAmounts {
            milli_cpu: 224_000,
            memory: 2 << 40,
        },
        requested: HostAmounts {
            milli_cpu: (n % 13) * 8000,
            memory: (n % 11) << 36,
        },
    })
}

/// The default policy, LeastFragmentation, with a workload and every node's CPU and memory
/// known, kube-scheduler steering on: the controller's decision once it feeds the policy.
#[divan::bench(args = FILLS)]
fn least_fragmentation_pods(bencher: Bencher, fill: u32) {
    let (index, names) = cluster(fill);
    let candidates: Vec<&str> = names.iter().map(String::as_str).collect();
    let pods = pods();
    let workload = workload();
    let ctx = PlacementContext {
        workload: &workload,
        pod: HostAmounts {
            milli_cpu: 8000,
            memory: 32 << 30,
        },
        hosts: &host,
        steer_pods_without_gpus: true,
    };
    bencher.bench_local(|| {
        for (_, pod) in &pods {
            let _ = black_box(place_with(&index, black_box(pod), &candidates, &ctx));
        }
    });
}
