use proptest::prelude::*;

use super::diagnose::Diagnosis;
use super::*;
use crate::alloc::{ClaimRequest, DeviceUse, GpuInfo, MpsSizes, NodeGpus};
use crate::enforcement::Enforcement;
use crate::inventory::ComputeCapability;
use crate::mps::TimeSliceInterval;
use crate::sharing::Sharing;

const GI: u64 = 1 << 30;

fn node(name: String, gpus: usize) -> NodeGpus {
    let gpus = (0..gpus)
        .map(|g| GpuInfo {
            device: format!("gpu-{g}"),
            uuid: format!("GPU-{name}-{g}"),
            product: if g % 3 == 2 { "L4" } else { "H100" }.into(),
            memory_bytes: 80 * GI,
            multiprocessors: 132,
            compute_capability: ComputeCapability { major: 9, minor: 0 },
            nvlink_domain: (g % 4 != 3).then(|| format!("d{}", g / 4)),
            pcie_root: Some(format!("p{}", g / 2)),
            numa: None,
            taints: Vec::new(),
        })
        .collect();
    NodeGpus { node: name, gpus }
}

fn request_strategy() -> impl Strategy<Value = DeviceRequest> {
    (
        1u32..4,
        prop::option::of((0u64..81, 0u8..101)),
        0usize..3,
        any::<bool>(),
        prop::option::of(1u32..4),
    )
        .prop_map(|(count, slice, topology, l4, max_slices)| {
            let mut r = match slice {
                Some((gi, compute)) => DeviceRequest::slices(
                    "s",
                    count,
                    SliceSize {
                        memory_bytes: gi * GI,
                        compute_percent: compute.max(u8::from(gi == 0)),
                    },
                ),
                None => DeviceRequest::whole("w", count),
            };
            r.topology = [
                TopologyScope::Any,
                TopologyScope::NvLink,
                TopologyScope::PcieRoot,
            ][topology];
            if l4 {
                r.selector.product_names = vec!["L4".into()];
            }
            r.max_slices_per_gpu = max_slices;
            r
        })
}

/// Claims that disagree on the interval still share a GPU (the node keeps the first
/// one's); each placed device carries its own request's.
#[test]
fn placed_devices_carry_their_request_interval() {
    let mut index = Index::new();
    index.upsert_node(node("n00".into(), 1));
    for (key, interval) in [
        ("a", Some(TimeSliceInterval::Long)),
        ("b", Some(TimeSliceInterval::Short)),
        ("c", None),
    ] {
        let mut request = DeviceRequest::slices(
            "s",
            1,
            SliceSize {
                memory_bytes: 10 * GI,
                compute_percent: 0,
            },
        );
        request.sharing = Sharing::TimeSlicing;
        request.time_slice_interval = interval;
        let pod = PodRequest {
            claims: vec![ClaimRequest {
                key: key.into(),
                requests: vec![request],
            }],
        };
        let placement = place(&index, &pod, &["n00"]).expect("fits");
        let device = &placement.claims[0].devices[0];
        assert_eq!(
            (
                device.device.as_str(),
                device.sharing,
                device.time_slice_interval
            ),
            ("gpu-0", Sharing::TimeSlicing, interval)
        );
        index.apply(&placement);
    }
}

fn mps_slice(key: &str, gib: u64, compute: u8, enforcement: Enforcement) -> PodRequest {
    let mut request = DeviceRequest::slices(
        "s",
        1,
        SliceSize {
            memory_bytes: gib * GI,
            compute_percent: compute,
        },
    );
    request.sharing = Sharing::Mps;
    request.enforcement = enforcement;
    PodRequest {
        claims: vec![ClaimRequest {
            key: key.into(),
            requests: vec![request],
        }],
    }
}

/// A slice whose class requires its MPS server to hold it shares a GPU only with MPS slices
/// of its size, and keeps slices of other sizes (of any class) off its GPU; slices of
/// classes that do not require it mix sizes freely.
#[test]
fn server_held_slices_keep_their_gpu_to_one_size() {
    use Enforcement::{ClientEnvironment, Server};
    let mut index = Index::new();
    index.upsert_node(node("n00".into(), 2));
    let place_one = |index: &mut Index, pod: &PodRequest| {
        let placement = place(index, pod, &["n00"]).expect("fits");
        index.apply(&placement);
        placement.claims[0].devices[0].device.clone()
    };
    // Bin-packing puts the first two on gpu-0, sizes mixed.
    assert_eq!(
        place_one(&mut index, &mps_slice("a", 10, 20, ClientEnvironment)),
        "gpu-0"
    );
    assert_eq!(
        place_one(&mut index, &mps_slice("b", 20, 30, ClientEnvironment)),
        "gpu-0"
    );
    // gpu-0 is mixed: a server-held slice goes to the idle GPU.
    let held = place_one(&mut index, &mps_slice("c", 10, 25, Server));
    assert_eq!(held, "gpu-1");
    assert_eq!(
        place_one(&mut index, &mps_slice("d", 10, 25, Server)),
        "gpu-1"
    );
    // Another size fits gpu-1's memory and compute but not its server's limit: gpu-0 takes
    // it, though bin-packing prefers gpu-1 for it.
    assert_eq!(
        place_one(&mut index, &mps_slice("e", 5, 10, ClientEnvironment)),
        "gpu-0"
    );
    // Nowhere for a server-held slice of a third size: gpu-0 is mixed, gpu-1 another size.
    let error = place(&index, &mps_slice("g", 5, 10, Server), &["n00"]).unwrap_err();
    assert_eq!(error.kind(), UnplaceableReason::SharingConflict);
    assert!(
        error.message().contains("another size"),
        "{}",
        error.message()
    );
    // Once gpu-1's server-held slices are gone, it takes other sizes again (gpu-0 has too
    // little compute left for this one).
    for key in ["c", "d"] {
        index.set_claim_usage(key, Vec::new());
    }
    assert_eq!(index.gpu_usage("n00", "gpu-1").mps_sizes, MpsSizes::None);
    assert_eq!(
        place_one(&mut index, &mps_slice("h", 30, 50, ClientEnvironment)),
        "gpu-1"
    );
}

proptest! {
    /// The pruned search for the closest node finds the same diagnosis as diagnosing
    /// every node.
    #[test]
    fn closest_agrees_with_diagnosing_every_node(
        gpus in prop::collection::vec(1usize..9, 1..12),
        uses in prop::collection::vec((0usize..12, 0usize..9, prop::option::of((1u64..60, 1u8..80))), 0..60),
        pod in prop::collection::vec(prop::collection::vec(request_strategy(), 1..3), 1..3),
    ) {
        let mut index = Index::new();
        for (n, &count) in gpus.iter().enumerate() {
            index.upsert_node(node(format!("n{n:02}"), count));
        }
        for (i, (n, g, slice)) in uses.into_iter().enumerate() {
            let (name, device) = (format!("n{:02}", n % gpus.len()), format!("gpu-{g}"));
            let u = match slice {
                Some((gi, compute)) => DeviceUse::slice(name, device, gi * GI, compute),
                None => DeviceUse::whole(name, device),
            };
            index.set_claim_usage(&format!("c{i}"), vec![u]);
        }
        let pod = PodRequest {
            claims: pod
                .into_iter()
                .enumerate()
                .map(|(c, requests)| ClaimRequest { key: format!("k{c}"), requests })
                .collect(),
        };
        let Ok(plan) = Plan::new(&pod) else { return Ok(()) };
        let mut nodes: Vec<&NodeEntry> = index.entries().collect();
        nodes.sort_by_key(|n| n.order);
        let fast = plan.closest(nodes.clone());
        let slow = plan.closest_exhaustive(nodes);
        let key = |d: &Diagnosis<'_>| (d.node.to_owned(), d.rank(), d.flat, d.found, d.kind);
        prop_assert_eq!(fast.as_ref().map(key), slow.as_ref().map(key));
    }
}
