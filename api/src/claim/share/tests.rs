use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::mps::TimeSliceInterval;
use kerf_core::sharing::{Sharing, SliceLimits};
use serde_json::{Value, json};

use crate::claim::{AllocatedDevice, resolve_allocation};
use crate::params::SharingConfig;
use crate::shared_publication::SharedSlicing;

const DRIVER: &str = "gpu.kerf.dev";
const GI: u64 = 1 << 30;
/// An H100's memory: 81559 MiB, not a multiple of 1 GiB.
const H100: u64 = 81559 << 20;

fn share(device: &str, id: &str, consumed: &Value) -> Value {
    json!({ "request": "gpu", "driver": DRIVER, "pool": "node-1", "device": device,
            "shareID": id, "consumedCapacity": consumed.clone() })
}

fn claim(results: &[Value], configs: &[Value]) -> ResourceClaim {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": { "namespace": "team-a", "name": "infer", "uid": "1234" },
        "spec": { "devices": {} },
        "status": { "allocation": { "devices": { "results": results, "config": configs } } },
    }))
    .unwrap()
}

fn resolve(results: &[Value], configs: &[Value]) -> crate::Result<Vec<AllocatedDevice>> {
    resolve_allocation(&claim(results, configs), DRIVER)
}

fn slicing(sharing: Option<SharingConfig>) -> SharedSlicing {
    SharedSlicing {
        memory_granularity_bytes: GI,
        default_compute_percent: Some(25),
        max_slices_per_gpu: None,
        sharing,
    }
}

#[test]
fn a_share_is_a_slice_of_what_it_consumed_shared_by_mps() {
    let mut devices = resolve(
        &[share(
            "gpu-0",
            "a",
            &json!({ "memory": "10Gi", "compute": "30", "multiprocessors": "0" }),
        )],
        &[],
    )
    .unwrap();
    let mut device = devices.remove(0);
    let limits = SliceLimits {
        memory_bytes: Some(10 * GI),
        compute_percent: Some(30),
    };
    assert_eq!(device.limits, limits);
    assert_eq!(device.sharing, Sharing::Mps);
    assert_eq!(device.share_id.as_deref(), Some("a"));
    device.finish_share(H100, Some(&slicing(None))).unwrap();
    assert_eq!(device.limits, limits);
    assert_eq!(device.sharing, Sharing::Mps);
    assert!(device.share.is_none());
}

#[test]
fn full_compute_is_no_compute_limit() {
    let device = resolve(
        &[share(
            "gpu-0",
            "a",
            &json!({ "memory": "4Gi", "compute": "100" }),
        )],
        &[],
    )
    .unwrap()
    .remove(0);
    assert_eq!(device.limits.compute_percent, None);
    assert_eq!(device.limits.memory_bytes, Some(4 * GI));
}

#[test]
fn the_publication_gives_the_sharing_unless_a_config_names_one() {
    let time_sliced = slicing(Some(SharingConfig {
        strategy: Sharing::TimeSlicing,
        time_slice_interval: Some(TimeSliceInterval::Long),
        ..SharingConfig::default()
    }));
    let mut device = resolve(&[share("gpu-0", "a", &json!({ "memory": "4Gi" }))], &[])
        .unwrap()
        .remove(0);
    device.finish_share(H100, Some(&time_sliced)).unwrap();
    assert_eq!(device.sharing, Sharing::TimeSlicing);
    assert_eq!(device.time_slice_interval, TimeSliceInterval::Long);

    let class = json!({ "source": "FromClass", "opaque": { "driver": DRIVER, "parameters": {
        "apiVersion": crate::API_VERSION, "kind": "GpuClassParameters",
        "sharing": { "strategy": "MPS" } } } });
    let mut device = resolve(
        &[share("gpu-0", "a", &json!({ "memory": "4Gi" }))],
        &[class],
    )
    .unwrap()
    .remove(0);
    device.finish_share(H100, Some(&time_sliced)).unwrap();
    assert_eq!(device.sharing, Sharing::Mps);
    assert_eq!(device.time_slice_interval, TimeSliceInterval::Default);
}

#[test]
fn all_memory_on_the_grid_is_the_whole_gpu() {
    // 81559 MiB on a 1 GiB grid: the published default is 79 GiB.
    for (memory, whole) in [("79Gi", true), ("78Gi", false), ("81559Mi", true)] {
        let mut device = resolve(
            &[share(
                "gpu-0",
                "a",
                &json!({ "memory": memory, "compute": "25" }),
            )],
            &[],
        )
        .unwrap()
        .remove(0);
        device.finish_share(H100, Some(&slicing(None))).unwrap();
        assert_eq!(device.limits.is_whole(), whole, "{memory}");
        assert_eq!(device.sharing == Sharing::Exclusive, whole, "{memory}");
        assert_eq!(device.share_id.as_deref(), Some("a"));
    }
    // Without a granularity only the exact size is whole.
    let mut device = resolve(&[share("gpu-0", "a", &json!({ "memory": "79Gi" }))], &[])
        .unwrap()
        .remove(0);
    device.finish_share(H100, None).unwrap();
    assert!(!device.limits.is_whole());
}

#[test]
fn bad_consumed_memory_names_the_field_and_value() {
    let error = |consumed: Value, index_of_ours: usize| {
        let mut results = vec![
            json!({ "request": "nic", "driver": "net.example.com", "pool": "p", "device": "eth0" });
            index_of_ours
        ];
        results.push(share("gpu-0", "a", &consumed));
        resolve(&results, &[]).unwrap_err().to_string()
    };
    let e = error(json!({ "compute": "10" }), 1);
    assert!(
        e.contains("team-a/infer")
            && e.contains("status.allocation.devices.results[1].consumedCapacity.memory")
            && e.contains("missing"),
        "{e}"
    );
    let e = error(json!({ "memory": "0" }), 0);
    assert!(
        e.contains("results[0].consumedCapacity.memory") && e.contains("\"0\""),
        "{e}"
    );
    let e = error(json!({ "memory": "lots" }), 0);
    assert!(
        e.contains("consumedCapacity.memory") && e.contains("lots"),
        "{e}"
    );
    let e = error(json!({ "memory": "1Gi", "compute": "150" }), 0);
    assert!(
        e.contains("consumedCapacity.compute") && e.contains("150"),
        "{e}"
    );

    let mut device = resolve(&[share("gpu-0", "a", &json!({ "memory": "100Gi" }))], &[])
        .unwrap()
        .remove(0);
    let e = device.finish_share(H100, None).unwrap_err().to_string();
    assert!(
        e.contains("results[0].consumedCapacity.memory")
            && e.contains("100Gi")
            && e.contains("more than"),
        "{e}"
    );
}
