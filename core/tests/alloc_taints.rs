//! The allocator's device taints and tolerations, `firstAvailable` subrequests and admin
//! access.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Test helpers may fail loudly.

use kerf_core::alloc::{
    ClaimRequest, DeviceRequest, DeviceTaint, DeviceUse, GpuInfo, Index, NodeGpus, PodPlacement,
    PodRequest, SliceSize, TaintEffect, Toleration, TolerationOperator, UnplaceableReason, place,
};
use kerf_core::inventory::ComputeCapability;

const GI: u64 = 1 << 30;
const KEY: &str = "gpu.kerf.dev/unhealthy";

fn gpu(minor: u32, taints: Vec<DeviceTaint>) -> GpuInfo {
    GpuInfo {
        device: format!("gpu-{minor}"),
        uuid: format!("GPU-{minor:04}"),
        product: "NVIDIA H100 80GB HBM3".to_owned(),
        memory_bytes: 80 * GI,
        multiprocessors: 132,
        compute_capability: ComputeCapability { major: 9, minor: 0 },
        nvlink_domain: Some("nvl-0".to_owned()),
        pcie_root: None,
        numa: None,
        taints,
    }
}

fn taint(value: &str, effect: TaintEffect) -> DeviceTaint {
    DeviceTaint {
        key: KEY.to_owned(),
        value: value.to_owned(),
        effect,
    }
}

/// node-1 with gpu-0 carrying `taints` and gpu-1 clean.
fn index_with(taints: Vec<DeviceTaint>) -> Index {
    let mut index = Index::new();
    index.upsert_node(NodeGpus {
        node: "node-1".to_owned(),
        gpus: vec![gpu(0, taints), gpu(1, Vec::new())],
    });
    index
}

fn pod(key: &str, requests: Vec<DeviceRequest>) -> PodRequest {
    PodRequest {
        claims: vec![ClaimRequest {
            key: key.to_owned(),
            requests,
        }],
    }
}

fn tolerating(mut req: DeviceRequest, tolerations: Vec<Toleration>) -> DeviceRequest {
    req.tolerations = tolerations;
    req
}

fn devices(placement: &PodPlacement) -> Vec<(String, String)> {
    placement
        .claims
        .iter()
        .flat_map(|c| &c.devices)
        .map(|d| (d.request.clone(), d.device.clone()))
        .collect()
}

fn two_gpus(req: DeviceRequest) -> DeviceRequest {
    DeviceRequest { count: 2, ..req }
}

#[test]
fn no_schedule_taint_keeps_the_gpu_from_an_intolerant_request() {
    let index = index_with(vec![taint("xid-79", TaintEffect::NoSchedule)]);
    let placement = place(
        &index,
        &pod("c", vec![DeviceRequest::whole("gpu", 1)]),
        &["node-1"],
    )
    .unwrap();
    assert_eq!(devices(&placement), [("gpu".into(), "gpu-1".into())]);

    let err = place(
        &index,
        &pod("c", vec![two_gpus(DeviceRequest::whole("gpu", 1))]),
        &["node-1"],
    )
    .unwrap_err();
    assert_eq!(err.kind(), UnplaceableReason::Tainted);
    assert_eq!(err.reason(), "tainted");
    assert!(
        err.message().contains(
            "gpu-0 is tainted gpu.kerf.dev/unhealthy=xid-79:NoSchedule and the request does not tolerate it"
        ),
        "{}",
        err.message()
    );
}

#[test]
fn no_execute_taint_blocks_slices_too() {
    let index = index_with(vec![taint("xid-48", TaintEffect::NoExecute)]);
    let slice = DeviceRequest::slices(
        "s",
        2,
        SliceSize {
            memory_bytes: 10 * GI,
            compute_percent: 0,
        },
    );
    let err = place(&index, &pod("c", vec![slice]), &["node-1"]).unwrap_err();
    assert_eq!(err.kind(), UnplaceableReason::Tainted);
    assert!(err.message().contains(":NoExecute"), "{}", err.message());
}

#[test]
fn none_effect_never_blocks() {
    let index = index_with(vec![taint("throttled", TaintEffect::None)]);
    let placement = place(
        &index,
        &pod("c", vec![two_gpus(DeviceRequest::whole("gpu", 1))]),
        &["node-1"],
    )
    .unwrap();
    assert_eq!(placement.claims[0].devices.len(), 2);
}

/// Each toleration form against gpu-0's `NoSchedule` taint `xid-79`: whether the request for
/// both GPUs fits.
#[test]
fn tolerations_match_as_kube_scheduler_matches_them() {
    let index = index_with(vec![taint("xid-79", TaintEffect::NoSchedule)]);
    let cases = [
        (
            "Equal, same value",
            Toleration {
                key: KEY.into(),
                value: "xid-79".into(),
                ..Toleration::default()
            },
            true,
        ),
        (
            "Equal, other value",
            Toleration {
                key: KEY.into(),
                value: "xid-48".into(),
                ..Toleration::default()
            },
            false,
        ),
        (
            "Exists on the key",
            Toleration {
                key: KEY.into(),
                operator: TolerationOperator::Exists,
                ..Toleration::default()
            },
            true,
        ),
        (
            "Exists on another key",
            Toleration {
                key: "other".into(),
                operator: TolerationOperator::Exists,
                ..Toleration::default()
            },
            false,
        ),
        (
            "empty key with Exists",
            Toleration {
                operator: TolerationOperator::Exists,
                ..Toleration::default()
            },
            true,
        ),
        (
            "effect-less toleration",
            Toleration {
                key: KEY.into(),
                operator: TolerationOperator::Exists,
                effect: None,
                ..Toleration::default()
            },
            true,
        ),
        (
            "effect NoSchedule",
            Toleration {
                key: KEY.into(),
                operator: TolerationOperator::Exists,
                effect: Some(TaintEffect::NoSchedule),
                ..Toleration::default()
            },
            true,
        ),
        (
            "effect NoExecute",
            Toleration {
                key: KEY.into(),
                operator: TolerationOperator::Exists,
                effect: Some(TaintEffect::NoExecute),
                ..Toleration::default()
            },
            false,
        ),
    ];
    for (name, toleration, fits) in cases {
        let req = tolerating(two_gpus(DeviceRequest::whole("gpu", 1)), vec![toleration]);
        let result = place(&index, &pod("c", vec![req]), &["node-1"]);
        assert_eq!(result.is_ok(), fits, "{name}: {result:?}");
    }
}

#[test]
fn every_blocking_taint_must_be_tolerated() {
    let index = index_with(vec![
        taint("xid-79", TaintEffect::NoSchedule),
        DeviceTaint {
            key: "other".into(),
            value: String::new(),
            effect: TaintEffect::NoExecute,
        },
    ]);
    let one = Toleration {
        key: KEY.into(),
        operator: TolerationOperator::Exists,
        ..Toleration::default()
    };
    let req = tolerating(two_gpus(DeviceRequest::whole("gpu", 1)), vec![one.clone()]);
    let err = place(&index, &pod("c", vec![req]), &["node-1"]).unwrap_err();
    assert!(
        err.message().contains("gpu-0 is tainted other:NoExecute"),
        "{}",
        err.message()
    );
    let both = vec![
        one,
        Toleration {
            key: "other".into(),
            operator: TolerationOperator::Exists,
            ..Toleration::default()
        },
    ];
    let req = tolerating(two_gpus(DeviceRequest::whole("gpu", 1)), both);
    assert!(place(&index, &pod("c", vec![req]), &["node-1"]).is_ok());
}

fn slice_of(name: &str, gi: u64) -> DeviceRequest {
    DeviceRequest::slices(
        name,
        1,
        SliceSize {
            memory_bytes: gi * GI,
            compute_percent: 0,
        },
    )
}

fn first_available(name: &str, subs: Vec<DeviceRequest>) -> DeviceRequest {
    DeviceRequest {
        first_available: subs,
        ..DeviceRequest::whole(name, 1)
    }
}

/// One GPU with `used_gi` of its 80Gi held by another claim's slice.
fn one_gpu_using(used_gi: u64) -> Index {
    let mut index = Index::new();
    index.upsert_node(NodeGpus {
        node: "node-1".to_owned(),
        gpus: vec![gpu(0, Vec::new())],
    });
    index.set_claim_usage(
        "other",
        vec![DeviceUse::slice("node-1", "gpu-0", used_gi * GI, 0)],
    );
    index
}

#[test]
fn first_available_takes_the_first_subrequest_that_fits() {
    let index = one_gpu_using(10);
    let req = first_available(
        "gpu",
        vec![slice_of("gpu/big", 20), slice_of("gpu/small", 10)],
    );
    let placement = place(&index, &pod("c", vec![req]), &["node-1"]).unwrap();
    assert_eq!(devices(&placement), [("gpu/big".into(), "gpu-0".into())]);
}

#[test]
fn first_available_falls_back_to_the_next_subrequest() {
    let index = one_gpu_using(65);
    let req = first_available(
        "gpu",
        vec![slice_of("gpu/big", 20), slice_of("gpu/small", 10)],
    );
    let placement = place(&index, &pod("c", vec![req]), &["node-1"]).unwrap();
    assert_eq!(devices(&placement), [("gpu/small".into(), "gpu-0".into())]);
    assert_eq!(
        placement.claims[0].devices[0].slice.unwrap().memory_bytes,
        10 * GI
    );
}

#[test]
fn first_available_that_never_fits_names_every_subrequest() {
    let index = one_gpu_using(75);
    let req = first_available(
        "gpu",
        vec![slice_of("gpu/big", 20), slice_of("gpu/small", 10)],
    );
    let err = place(&index, &pod("c", vec![req]), &["node-1"]).unwrap_err();
    assert_eq!(err.kind(), UnplaceableReason::InsufficientMemory);
    let message = err.message();
    assert!(message.contains("\"gpu/big\""), "{message}");
    assert!(message.contains("\"gpu/small\""), "{message}");
}

/// The pod's other request decides: the preferred subrequest leaves no room for it on the
/// only node, so the whole pod takes the fallback (as the scheduler backtracks).
#[test]
fn first_available_backtracks_for_the_whole_pod() {
    let index = one_gpu_using(40);
    let req = first_available(
        "gpu",
        vec![slice_of("gpu/big", 20), slice_of("gpu/small", 10)],
    );
    let other = PodRequest {
        claims: vec![
            ClaimRequest {
                key: "c1".into(),
                requests: vec![req],
            },
            ClaimRequest {
                key: "c2".into(),
                requests: vec![slice_of("fixed", 25)],
            },
        ],
    };
    let placement = place(&index, &other, &["node-1"]).unwrap();
    assert_eq!(
        devices(&placement),
        [
            ("gpu/small".into(), "gpu-0".into()),
            ("fixed".into(), "gpu-0".into())
        ]
    );
}

#[test]
fn more_than_eight_subrequests_are_invalid() {
    let index = one_gpu_using(0);
    let subs = (0..9).map(|i| slice_of(&format!("gpu/s{i}"), 1)).collect();
    let err = place(
        &index,
        &pod("c", vec![first_available("gpu", subs)]),
        &["node-1"],
    )
    .unwrap_err();
    assert_eq!(err.kind(), UnplaceableReason::InvalidRequest);
    assert!(err.message().contains("at most 8"), "{}", err.message());
}

fn admin(count: u32) -> DeviceRequest {
    DeviceRequest {
        admin_access: true,
        ..DeviceRequest::whole("monitor", count)
    }
}

#[test]
fn admin_access_gets_a_fully_used_gpu_without_consuming_it() {
    let mut index = Index::new();
    index.upsert_node(NodeGpus {
        node: "node-1".to_owned(),
        gpus: vec![gpu(0, Vec::new())],
    });
    index.set_claim_usage("holder", vec![DeviceUse::whole("node-1", "gpu-0")]);
    let placement = place(&index, &pod("admin", vec![admin(1)]), &["node-1"]).unwrap();
    assert_eq!(devices(&placement), [("monitor".into(), "gpu-0".into())]);
    assert!(placement.is_admin("admin", "monitor"));
    assert!(placement.claim_uses(&placement.claims[0]).is_empty());
    index.apply(&placement);
    assert_eq!(index.gpu_usage("node-1", "gpu-0").whole_holders, 1);
    // A second admin claim gets it too; nobody else does.
    assert!(place(&index, &pod("admin-2", vec![admin(1)]), &["node-1"]).is_ok());
    assert!(
        place(
            &index,
            &pod("x", vec![DeviceRequest::whole("gpu", 1)]),
            &["node-1"]
        )
        .is_err()
    );
}

#[test]
fn admin_access_keeps_the_claims_devices_distinct_and_honours_taints() {
    let index = index_with(vec![taint("xid-79", TaintEffect::NoSchedule)]);
    let err = place(&index, &pod("a", vec![admin(2)]), &["node-1"]).unwrap_err();
    assert_eq!(err.kind(), UnplaceableReason::Tainted);
    let mut index = index_with(Vec::new());
    index.set_claim_usage("holder", vec![DeviceUse::whole("node-1", "gpu-0")]);
    let placement = place(&index, &pod("a", vec![admin(2)]), &["node-1"]).unwrap();
    assert_eq!(
        devices(&placement),
        [
            ("monitor".into(), "gpu-0".into()),
            ("monitor".into(), "gpu-1".into())
        ]
    );
    assert!(place(&index, &pod("a", vec![admin(3)]), &["node-1"]).is_err());
}

#[test]
fn admin_access_with_a_slice_is_invalid() {
    let index = one_gpu_using(0);
    let req = DeviceRequest {
        admin_access: true,
        ..slice_of("monitor", 10)
    };
    let err = place(&index, &pod("a", vec![req]), &["node-1"]).unwrap_err();
    assert_eq!(err.kind(), UnplaceableReason::InvalidRequest);
}
