use super::*;
use crate::cache::CompactResourceSlice;
use crate::capacity::current_devices;
use k8s_openapi::api::resource::v1::{ResourceSlice, ResourceSliceSpec};
use kerf_api::params::{GpuSliceAllocation, OpaqueKind as _, SliceDevice};
use serde_json::json;

const DRIVER: &str = "gpu.kerf.dev";
const GIB: u64 = 1 << 30;

fn slices() -> Vec<Arc<CompactResourceSlice>> {
    let inventory = kerf_core::mock::from_spec("h100-sxm-80gb:2").unwrap();
    kerf_api::resource_slices(&inventory, DRIVER, "n1")
        .unwrap()
        .into_iter()
        .map(|spec: ResourceSliceSpec| {
            Arc::new(CompactResourceSlice::from(ResourceSlice {
                metadata: kube::api::ObjectMeta::default(),
                spec,
            }))
        })
        .collect()
}

/// A claim of `namespace` whose request `gpu` names `class`, allocated `device` of node `n1`,
/// as a slice of `memory_gib` and `percent` when given.
fn claim(
    namespace: &str,
    class: &str,
    device: &str,
    slice: Option<(u64, u8, &str)>,
) -> Arc<ResourceClaim> {
    let mut devices = json!({"results": [
        {"request": "gpu", "driver": DRIVER, "pool": "n1", "device": device}
    ]});
    if let Some((memory_gib, percent, uuid)) = slice {
        let slice = GpuSliceAllocation {
            devices: vec![SliceDevice {
                pool: "n1".into(),
                device: device.into(),
                share_id: None,
                gpu_uuid: uuid.into(),
                memory_bytes: Some(memory_gib * GIB),
                compute_percent: Some(percent),
                sharing: kerf_core::sharing::Sharing::Mps,
                time_slice_interval: None,
                enforcement: kerf_core::enforcement::Enforcement::default(),
            }],
        };
        devices["config"] = json!([{"source": "FromClaim", "opaque": {
            "driver": DRIVER, "parameters": slice.to_parameters().unwrap()
        }}]);
    }
    Arc::new(
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": namespace},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": class}}
            ]}},
            "status": {"allocation": {"devices": devices}},
        }))
        .unwrap(),
    )
}

#[test]
fn devices_classes_and_namespaces_hold_what_their_allocations_take() {
    let all = slices();
    let devices = current_devices(&all, DRIVER);
    let uuid = |name: &str| {
        let d = devices
            .iter()
            .find(|d| d.device.device_name() == name)
            .unwrap();
        device_attribute(d.device, DRIVER, attributes::UUID)
            .and_then(|a| a.string.clone())
            .unwrap()
    };
    let gpu1 = uuid("gpu-1");
    let claims = [
        claim("a", "h100", "gpu-0", None),
        claim("b", "h100-slice", "gpu-1", Some((10, 30, &gpu1))),
        claim("b", "h100-slice", "gpu-1", Some((5, 20, &gpu1))),
    ];
    let held = holdings(&devices, &claims, DRIVER);
    let size = held.devices[0].memory_bytes;
    assert!(size > 15 * GIB);
    let fill: Vec<_> = held
        .devices
        .iter()
        .map(|d| {
            (
                d.device.as_str(),
                d.memory_allocated_bytes,
                d.compute_allocated_percent,
                d.slices,
            )
        })
        .collect();
    assert_eq!(fill, [("gpu-0", size, 100, 1), ("gpu-1", 15 * GIB, 50, 2)]);
    assert_eq!(held.devices[1].uuid, gpu1);
    assert!(
        held.devices[1].product.contains("H100"),
        "{:?}",
        held.devices[1]
    );
    assert_eq!(held.devices[1].node, "n1");
    assert_eq!(
        held.classes["h100-slice"],
        Held {
            memory_bytes: 15 * GIB,
            compute_percent: 50,
            slices: 2
        }
    );
    assert_eq!(
        held.namespaces["a"],
        Held {
            memory_bytes: size,
            compute_percent: 100,
            slices: 1
        }
    );
    assert_eq!(held.namespaces.len(), 2);
}

#[test]
fn a_subrequest_names_its_own_class_and_a_missing_one_is_unknown() {
    let mut claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "c", "namespace": "a"},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "firstAvailable": [
                {"name": "big", "deviceClassName": "h100"},
                {"name": "small", "deviceClassName": "l4"}
            ]}
        ]}},
    }))
    .unwrap();
    assert_eq!(request_class(&claim, "gpu/small"), Some("l4"));
    assert_eq!(request_class(&claim, "gpu"), None);
    assert_eq!(request_class(&claim, "other"), None);
    claim.spec.devices = None;
    assert_eq!(request_class(&claim, "gpu/small"), None);
}
