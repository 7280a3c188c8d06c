use k8s_openapi::api::resource::v1::{AllocationResult, ResourceClaim};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kerf_core::alloc::{self, ClaimPlacement, ClaimRequest, DeviceRequest, DeviceUse, SliceSize};
use kerf_core::alloc::{PlacedDevice, Policy};
use kerf_core::enforcement::Enforcement;
use kerf_core::inventory::ComputeCapability;
use kerf_core::mps::TimeSliceInterval;
use kerf_core::sharing::Sharing;
use kerf_core::sharing::SliceLimits;
use serde_json::{Value, json};

use super::*;
use crate::claim::resolve_allocation;
use crate::error::Result;
use crate::params::{
    Allocator, ControllerPlacement, GpuClassParameters, GpuSelector, PlacementPolicy,
    SharingConfig, Slicing, TopologyScope,
};
use crate::{API_VERSION, AllocatedDevice};

const DRIVER: &str = "gpu.kerf.dev";
const GI: u64 = 1 << 30;

fn claim(value: &Value) -> ResourceClaim {
    serde_json::from_value(value.clone()).unwrap()
}

fn allocated(results: &Value, config: &Value) -> ResourceClaim {
    claim(&json!({
        "metadata": { "namespace": "ns", "name": "c", "uid": "uid-1" },
        "spec": { "devices": {} },
        "status": { "allocation": { "devices": { "results": results, "config": config } } },
    }))
}

fn time() -> Time {
    Time(Timestamp::from_second(1_800_000_000).unwrap())
}

fn placed(request: &str, device: &str, slice: Option<SliceSize>) -> PlacedDevice {
    PlacedDevice {
        request: request.to_owned(),
        device: device.to_owned(),
        gpu_uuid: format!("GPU-{device}"),
        slice,
        sharing: Sharing::Mps,
        time_slice_interval: None,
        enforcement: Enforcement::default(),
    }
}

fn size(memory_gi: u64, compute: u8) -> SliceSize {
    SliceSize {
        memory_bytes: memory_gi * GI,
        compute_percent: compute,
    }
}

fn mixed_placement() -> ClaimPlacement {
    ClaimPlacement {
        key: "uid-1".into(),
        devices: vec![
            placed("a", "gpu-0", Some(size(20, 25))),
            placed("a", "gpu-1", Some(size(20, 0))),
            placed("b", "gpu-3", None),
        ],
    }
}

fn with_allocation(allocation: &AllocationResult) -> ResourceClaim {
    let mut claim = allocated(&json!([]), &json!([]));
    claim.status.as_mut().unwrap().allocation = Some(allocation.clone());
    claim
}

// ---- allocation_status ----

#[test]
fn allocation_status_has_results_config_node_selector_and_timestamp() {
    let allocation = allocation_status(&mixed_placement(), "node-7", DRIVER, time()).unwrap();
    let expected = json!({
        "allocationTimestamp": "2027-01-15T08:00:00Z",
        "devices": {
            "results": [
                { "request": "a", "driver": DRIVER, "pool": "node-7", "device": "gpu-0" },
                { "request": "a", "driver": DRIVER, "pool": "node-7", "device": "gpu-1" },
                { "request": "b", "driver": DRIVER, "pool": "node-7", "device": "gpu-3" },
            ],
            "config": [{
                "source": "FromClaim",
                "requests": ["a", "b"],
                "opaque": {
                    "driver": DRIVER,
                    "parameters": {
                        "apiVersion": API_VERSION,
                        "kind": "GpuSliceAllocation",
                        "devices": [
                            { "pool": "node-7", "device": "gpu-0", "gpuUUID": "GPU-gpu-0",
                              "memoryBytes": 20 * GI, "computePercent": 25, "sharing": "MPS" },
                            { "pool": "node-7", "device": "gpu-1", "gpuUUID": "GPU-gpu-1",
                              "memoryBytes": 20 * GI, "sharing": "MPS" },
                            { "pool": "node-7", "device": "gpu-3", "gpuUUID": "GPU-gpu-3",
                              "sharing": "MPS" },
                        ],
                    },
                },
            }],
        },
        "nodeSelector": { "nodeSelectorTerms": [
            { "matchFields": [{ "key": "metadata.name", "operator": "In", "values": ["node-7"] }] },
        ]},
    });
    assert_eq!(serde_json::to_value(&allocation).unwrap(), expected);
}

#[test]
fn the_kubelet_plugin_resolves_what_the_controller_writes() {
    let allocation = allocation_status(&mixed_placement(), "node-7", DRIVER, time()).unwrap();
    let devices = resolve_allocation(&with_allocation(&allocation), DRIVER).unwrap();
    let device = |device: &str, memory: Option<u64>, compute: Option<u8>| AllocatedDevice {
        request: if device == "gpu-3" { "b" } else { "a" }.to_owned(),
        pool: "node-7".into(),
        device: device.into(),
        share_id: None,
        admin_access: false,
        limits: SliceLimits {
            memory_bytes: memory,
            compute_percent: compute,
        },
        sharing: Sharing::Mps,
        time_slice_interval: TimeSliceInterval::Default,
        expected_gpu_uuid: Some(format!("GPU-{device}")),
        enforcement: Enforcement::default(),
        share: None,
    };
    assert_eq!(
        devices,
        [
            device("gpu-0", Some(20 * GI), Some(25)),
            device("gpu-1", Some(20 * GI), None),
            device("gpu-3", None, None),
        ]
    );
}

fn time_sliced_placement() -> ClaimPlacement {
    let time_sliced = |device: &str, interval| PlacedDevice {
        sharing: Sharing::TimeSlicing,
        time_slice_interval: interval,
        ..placed("a", device, Some(size(10, 0)))
    };
    ClaimPlacement {
        key: "uid-1".into(),
        devices: vec![
            time_sliced("gpu-0", Some(TimeSliceInterval::Long)),
            time_sliced("gpu-1", None),
            // Not time-sliced: an interval here would make the node refuse the entry.
            PlacedDevice {
                time_slice_interval: Some(TimeSliceInterval::Short),
                ..placed("a", "gpu-2", Some(size(10, 0)))
            },
        ],
    }
}

#[test]
fn allocation_status_writes_the_interval_of_time_sliced_devices() {
    let allocation = allocation_status(&time_sliced_placement(), "node-7", DRIVER, time()).unwrap();
    let value = serde_json::to_value(&allocation).unwrap();
    let devices = &value["devices"]["config"][0]["opaque"]["parameters"]["devices"];
    assert_eq!(
        devices,
        &json!([
            { "pool": "node-7", "device": "gpu-0", "gpuUUID": "GPU-gpu-0",
              "memoryBytes": 10 * GI, "sharing": "TimeSlicing", "timeSliceInterval": "Long" },
            { "pool": "node-7", "device": "gpu-1", "gpuUUID": "GPU-gpu-1",
              "memoryBytes": 10 * GI, "sharing": "TimeSlicing" },
            { "pool": "node-7", "device": "gpu-2", "gpuUUID": "GPU-gpu-2",
              "memoryBytes": 10 * GI, "sharing": "MPS" },
        ])
    );
}

#[test]
fn the_kubelet_plugin_reads_back_the_interval_the_controller_writes() {
    let allocation = allocation_status(&time_sliced_placement(), "node-7", DRIVER, time()).unwrap();
    let devices = resolve_allocation(&with_allocation(&allocation), DRIVER).unwrap();
    let intervals: Vec<_> = devices
        .iter()
        .map(|d| (d.device.as_str(), d.sharing, d.time_slice_interval))
        .collect();
    assert_eq!(
        intervals,
        [
            ("gpu-0", Sharing::TimeSlicing, TimeSliceInterval::Long),
            ("gpu-1", Sharing::TimeSlicing, TimeSliceInterval::Default),
            ("gpu-2", Sharing::Mps, TimeSliceInterval::Default),
        ]
    );
}

#[test]
fn usage_read_back_equals_the_placement() {
    let placement = mixed_placement();
    let allocation = allocation_status(&placement, "node-7", DRIVER, time()).unwrap();
    assert_eq!(
        device_uses(&with_allocation(&allocation), DRIVER),
        placement.device_uses("node-7")
    );
}

#[test]
fn allocation_status_refuses_too_many_devices_and_bad_entries() {
    let many = ClaimPlacement {
        key: "k".into(),
        devices: (0..33)
            .map(|i| placed("a", &format!("gpu-{i}"), None))
            .collect(),
    };
    let err = allocation_status(&many, "n", DRIVER, time()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "status.allocation.devices.results: 33 devices; an allocation holds at most 32"
    );
    let mut bad = mixed_placement();
    bad.devices[0].gpu_uuid.clear();
    let err = allocation_status(&bad, "n", DRIVER, time()).unwrap_err();
    assert!(
        err.to_string().contains("gpuUUID: must not be empty"),
        "{err}"
    );
    let empty = ClaimPlacement {
        key: "k".into(),
        devices: Vec::new(),
    };
    let allocation = allocation_status(&empty, "n", DRIVER, time()).unwrap();
    assert_eq!(allocation.devices.unwrap().config, None);
}

// ---- device_uses ----

#[test]
fn an_unallocated_claim_holds_nothing() {
    let claim = claim(&json!({ "metadata": { "name": "c" }, "spec": {} }));
    assert_eq!(device_uses(&claim, DRIVER), []);
}

#[test]
fn scheduler_results_hold_whole_devices_and_admin_access_holds_nothing() {
    let claim = allocated(
        &json!([
            { "request": "g", "driver": DRIVER, "pool": "node-1", "device": "gpu-0" },
            { "request": "n", "driver": "net.example.com", "pool": "node-1", "device": "eth0" },
            { "request": "m", "driver": DRIVER, "pool": "node-1", "device": "gpu-1", "adminAccess": true },
        ]),
        &json!([]),
    );
    assert_eq!(
        device_uses(&claim, DRIVER),
        [DeviceUse::whole("node-1", "gpu-0")]
    );
}

#[test]
fn consumed_capacity_and_shares_are_slices() {
    let claim = allocated(
        &json!([
            { "request": "a", "driver": DRIVER, "pool": "n", "device": "gpu-0", "shareID": "s1",
              "consumedCapacity": { "memory": "30Gi", "compute": "40" } },
            { "request": "a", "driver": DRIVER, "pool": "n", "device": "gpu-1", "shareID": "s2",
              "consumedCapacity": { "gpu.kerf.dev/memory": "10Gi", "compute": "0", "multiprocessors": "12" } },
            { "request": "a", "driver": DRIVER, "pool": "n", "device": "gpu-2", "shareID": "s3" },
            { "request": "a", "driver": DRIVER, "pool": "n", "device": "gpu-3",
              "consumedCapacity": { "memory": "lots" } },
        ]),
        &json!([]),
    );
    // Shared by MPS as prepared without a config naming a sharing.
    assert_eq!(
        device_uses(&claim, DRIVER),
        [
            shared("gpu-0", 30 * GI, 40, Sharing::Mps),
            shared("gpu-1", 10 * GI, 0, Sharing::Mps),
            shared("gpu-2", 0, 0, Sharing::Mps),
            DeviceUse::whole("n", "gpu-3"),
        ]
    );
}

fn shared(device: &str, memory_bytes: u64, compute_percent: u8, sharing: Sharing) -> DeviceUse {
    DeviceUse {
        node: "n".to_owned(),
        device: device.to_owned(),
        kind: alloc::UseKind::Slice {
            memory_bytes,
            compute_percent,
            sharing,
        },
        enforcement: Enforcement::default(),
    }
}

#[test]
fn a_share_counts_with_the_sharing_its_class_config_names() {
    let share = |device: &str, id: &str, request: &str| {
        json!({ "request": request, "driver": DRIVER, "pool": "n", "device": device,
            "shareID": id, "consumedCapacity": { "memory": "8Gi", "compute": "20" } })
    };
    let claim = allocated(
        &json!([share("gpu-0", "s1", "a"), share("gpu-0", "s2", "b")]),
        &json!([{ "source": "FromClass", "requests": ["b"], "opaque": { "driver": DRIVER,
            "parameters": { "apiVersion": API_VERSION, "kind": "GpuClassParameters",
                "sharing": { "strategy": "TimeSlicing" } } } }]),
    );
    assert_eq!(
        device_uses(&claim, DRIVER),
        [
            shared("gpu-0", 8 * GI, 20, Sharing::Mps),
            shared("gpu-0", 8 * GI, 20, Sharing::TimeSlicing),
        ]
    );
}

#[test]
fn a_slice_config_that_does_not_decode_counts_as_whole() {
    let claim = allocated(
        &json!([{ "request": "a", "driver": DRIVER, "pool": "n", "device": "gpu-0" }]),
        &json!([{ "source": "FromClaim", "opaque": { "driver": DRIVER, "parameters": {
            "apiVersion": API_VERSION, "kind": "GpuSliceAllocation", "devices": [], "extra": 1,
        }}}]),
    );
    assert_eq!(
        device_uses(&claim, DRIVER),
        [DeviceUse::whole("n", "gpu-0")]
    );
}

// ---- claim_request ----

fn controller_class() -> GpuClassParameters {
    GpuClassParameters {
        allocator: Allocator::Controller,
        selector: GpuSelector {
            product_names: vec!["NVIDIA H100 80GB HBM3".into()],
            min_memory: Some(Quantity("40Gi".into())),
            min_compute_capability: Some("9.0".into()),
            mig_profile: None,
        },
        slicing: Some(Slicing {
            memory_granularity: Quantity("2Gi".into()),
            max_slices_per_gpu: Some(7),
            default_compute: Some(15),
        }),
        placement: Some(ControllerPlacement {
            policy: PlacementPolicy::Spread,
        }),
        sharing: Some(SharingConfig {
            strategy: Sharing::TimeSlicing,
            time_slice_interval: Some(TimeSliceInterval::Long),
            ..SharingConfig::default()
        }),
    }
}

fn classes(name: &str) -> Option<GpuClassParameters> {
    match name {
        "slices" => Some(controller_class()),
        "plain" => Some(GpuClassParameters {
            allocator: Allocator::Controller,
            ..GpuClassParameters::default()
        }),
        "held" => Some(GpuClassParameters {
            sharing: Some(SharingConfig {
                strategy: Sharing::Mps,
                enforcement: Enforcement::Server,
                ..SharingConfig::default()
            }),
            ..controller_class()
        }),
        "scheduler" => Some(GpuClassParameters::default()),
        "mig" => Some(GpuClassParameters {
            allocator: Allocator::Controller,
            selector: GpuSelector {
                mig_profile: Some("1g.10gb".into()),
                ..GpuSelector::default()
            },
            ..GpuClassParameters::default()
        }),
        _ => None,
    }
}

fn params(fields: &Value) -> Value {
    let mut parameters = json!({ "apiVersion": API_VERSION, "kind": "GpuClaimParameters" });
    if let (Some(target), Value::Object(fields)) = (parameters.as_object_mut(), fields) {
        target.extend(fields.clone());
    }
    parameters
}

fn config(requests: &[&str], fields: &Value) -> Value {
    let mut entry = json!({ "opaque": { "driver": DRIVER, "parameters": params(fields) } });
    if !requests.is_empty() {
        entry["requests"] = json!(requests);
    }
    entry
}

fn request(name: &str, class: &str) -> Value {
    json!({ "name": name, "exactly": { "deviceClassName": class } })
}

fn spec_claim(requests: &Value, configs: &Value) -> ResourceClaim {
    claim(&json!({
        "metadata": { "namespace": "ns", "name": "c", "uid": "uid-1" },
        "spec": { "devices": { "requests": requests, "config": configs } },
    }))
}

fn request_of(requests: &Value, configs: &Value) -> Result<ClaimRequest> {
    claim_request(&spec_claim(requests, configs), classes, DRIVER)
}

fn error_of(requests: &Value, configs: &Value) -> String {
    request_of(requests, configs).unwrap_err().to_string()
}

#[test]
fn a_whole_gpu_request_takes_the_class_settings() {
    let claim = request_of(&json!([request("gpu", "slices")]), &json!([])).unwrap();
    assert_eq!(claim.key, "uid-1");
    assert_eq!(
        claim.requests,
        [DeviceRequest {
            name: "gpu".into(),
            count: 1,
            slice: None,
            selector: alloc::GpuSelector {
                product_names: vec!["NVIDIA H100 80GB HBM3".into()],
                min_memory_bytes: Some(40 * GI),
                min_compute_capability: Some(ComputeCapability { major: 9, minor: 0 }),
            },
            topology: alloc::TopologyScope::Any,
            policy: Policy::Spread,
            max_slices_per_gpu: Some(7),
            sharing: Sharing::TimeSlicing,
            time_slice_interval: Some(TimeSliceInterval::Long),
            enforcement: Enforcement::default(),
            tolerations: Vec::new(),
            admin_access: false,
            first_available: Vec::new(),
        }]
    );
}

#[test]
fn the_class_interval_follows_only_time_sliced_requests() {
    let requests = json!([
        request("a", "slices"),
        request("b", "slices"),
        request("c", "plain")
    ]);
    let configs = json!([
        config(&["a"], &json!({ "sharing": "MPS" })),
        config(&["c"], &json!({ "sharing": "TimeSlicing" })),
    ]);
    let claim = request_of(&requests, &configs).unwrap();
    let intervals: Vec<_> = claim
        .requests
        .iter()
        .map(|r| (r.name.as_str(), r.sharing, r.time_slice_interval))
        .collect();
    assert_eq!(
        intervals,
        [
            // The claim overrides the class's TimeSlicing: no interval.
            ("a", Sharing::Mps, None),
            ("b", Sharing::TimeSlicing, Some(TimeSliceInterval::Long)),
            // Time-sliced by the claim, but the class names no interval.
            ("c", Sharing::TimeSlicing, None),
        ]
    );
}

#[test]
fn claim_parameters_make_slices_per_request_later_configs_winning() {
    let requests = json!([
        { "name": "a", "exactly": { "deviceClassName": "slices", "count": 2, "allocationMode": "ExactCount" } },
        request("b", "slices"),
        request("c", "plain"),
    ]);
    let configs = json!([
        config(&[], &json!({ "memory": "10Gi", "topology": { "scope": "NVLink" } })),
        config(&["a"], &json!({ "memory": "20Gi", "compute": 30, "sharing": "MPS" })),
        config(&["c"], &json!({ "compute": 50 })),
        { "opaque": { "driver": "other.example.com", "parameters": { "anything": true } } },
    ]);
    let claim = request_of(&requests, &configs).unwrap();
    let summary: Vec<_> = claim
        .requests
        .iter()
        .map(|r| {
            (
                r.name.as_str(),
                r.count,
                r.slice,
                r.topology,
                r.sharing,
                r.policy,
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (
                "a",
                2,
                Some(size(20, 30)),
                alloc::TopologyScope::NvLink,
                Sharing::Mps,
                Policy::Spread
            ),
            // Memory only: the class's default compute applies.
            (
                "b",
                1,
                Some(size(10, 15)),
                alloc::TopologyScope::NvLink,
                Sharing::TimeSlicing,
                Policy::Spread
            ),
            // The memory of the first config also applies to c; no class default compute;
            // no class placement: the default policy.
            (
                "c",
                1,
                Some(size(10, 50)),
                alloc::TopologyScope::NvLink,
                Sharing::Exclusive,
                Policy::LeastFragmentation
            ),
        ]
    );
    let compute_only = request_of(
        &json!([request("c", "plain")]),
        &json!([config(&[], &json!({ "compute": 20 }))]),
    )
    .unwrap();
    assert_eq!(
        compute_only.requests[0].slice,
        Some(SliceSize {
            memory_bytes: 0,
            compute_percent: 20
        })
    );
}

#[test]
fn memory_must_be_a_multiple_of_the_class_granularity() {
    let err = error_of(
        &json!([request("a", "slices")]),
        &json!([config(&[], &json!({ "memory": "7Gi" }))]),
    );
    assert_eq!(
        err,
        "spec.devices.config[0].opaque.parameters.memory: 7Gi is not a multiple of the class granularity 2Gi"
    );
    // A class without slicing has no granularity.
    assert!(
        request_of(
            &json!([request("a", "plain")]),
            &json!([config(&[], &json!({ "memory": "7Gi" }))])
        )
        .is_ok()
    );
}

#[test]
fn claim_parameters_are_decoded_strictly() {
    let cases = [
        (
            json!([config(&[], &json!({ "memory": "10Gi", "colour": "red" }))]),
            "spec.devices.config[0].opaque.parameters.colour: unknown field `colour`",
        ),
        (
            json!([config(&[], &json!({ "compute": 150 }))]),
            "spec.devices.config[0].opaque.parameters.compute: 150 is out of range 1-100",
        ),
        (
            json!([config(&[], &json!({ "memory": "-1Gi" }))]),
            "spec.devices.config[0].opaque.parameters.memory: \"-1Gi\" is not a valid byte quantity: must not be negative",
        ),
        (
            json!([{ "opaque": { "driver": DRIVER, "parameters": {
                "apiVersion": API_VERSION, "kind": "GpuClassParameters" } } }]),
            "spec.devices.config[0].opaque.parameters.kind: GpuClassParameters does not belong in a ResourceClaim; expected GpuClaimParameters",
        ),
    ];
    for (configs, message) in cases {
        let err = error_of(&json!([request("a", "slices")]), &configs);
        assert!(err.starts_with(message), "{err}\n  expected {message}");
    }
}

#[test]
fn unsupported_request_forms_are_refused_with_the_field() {
    let exactly = |extra: Value| {
        let mut r = request("a", "slices");
        if let (Some(target), Value::Object(extra)) = (r["exactly"].as_object_mut(), extra) {
            target.extend(extra);
        }
        json!([r])
    };
    let cases = [
        (
            json!([{ "name": "a", "firstAvailable": [
                { "name": "x", "deviceClassName": "slices" },
                { "name": "y", "deviceClassName": "scheduler" },
            ] }]),
            "spec.devices.requests[0].firstAvailable[1].deviceClassName: \"scheduler\" uses allocator Scheduler",
        ),
        (
            exactly(json!({ "allocationMode": "All" })),
            "spec.devices.requests[0].exactly.allocationMode: \"All\" is not supported by kerf's controller; use ExactCount with a count",
        ),
        (
            exactly(json!({ "count": 0 })),
            "spec.devices.requests[0].exactly.count: 0 is out of range 1-32",
        ),
        (
            exactly(json!({ "tolerations": [{ "key": "k", "operator": "Bogus" }] })),
            "spec.devices.requests[0].exactly.tolerations[0].operator: \"Bogus\" is not a toleration operator",
        ),
        (
            exactly(json!({ "selectors": [{ "cel": { "expression": "true" } }] })),
            "spec.devices.requests[0].exactly.selectors: CEL selectors are not evaluated",
        ),
        (
            exactly(json!({ "capacity": { "requests": { "memory": "10Gi" } } })),
            "spec.devices.requests[0].exactly.capacity.requests: consumable capacity is not supported",
        ),
        (
            json!([request("a", "nvidia")]),
            "spec.devices.requests[0].exactly.deviceClassName: \"nvidia\" has no GpuClassParameters of driver gpu.kerf.dev",
        ),
        (
            json!([request("a", "scheduler")]),
            "spec.devices.requests[0].exactly.deviceClassName: \"scheduler\" uses allocator Scheduler",
        ),
        (
            json!([request("a", "mig")]),
            "DeviceClass \"mig\" parameters.selector.migProfile: \"1g.10gb\": MIG devices are allocated by the Scheduler allocator",
        ),
        (
            json!([]),
            "spec.devices.requests: the claim requests no devices",
        ),
        (
            json!([{ "name": "a", "exactly": { "deviceClassName": "slices", "count": 20 } },
                   { "name": "b", "exactly": { "deviceClassName": "slices", "count": 20 } }]),
            "spec.devices.requests: 40 devices in total; an allocation holds at most 32",
        ),
    ];
    for (requests, message) in cases {
        let err = error_of(&requests, &json!([]));
        assert!(err.starts_with(message), "{err}\n  expected {message}");
    }
}

#[test]
fn constraints_and_a_missing_uid_are_refused() {
    let mut with_constraints = spec_claim(&json!([request("a", "slices")]), &json!([]));
    with_constraints.spec.devices.as_mut().unwrap().constraints = serde_json::from_value(json!([
        { "requests": ["a"], "matchAttribute": "resource.kubernetes.io/pcieRoot" }
    ]))
    .unwrap();
    let err = claim_request(&with_constraints, classes, DRIVER).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("spec.devices.constraints[0]: 1 constraint(s) are not supported"),
        "{err}"
    );

    let mut no_uid = spec_claim(&json!([request("a", "slices")]), &json!([]));
    no_uid.metadata.uid = None;
    let err = claim_request(&no_uid, classes, DRIVER).unwrap_err();
    assert_eq!(
        err.to_string(),
        "metadata.uid: must be set: claims are keyed by UID"
    );
    assert_eq!(err.reason(), "invalid_config");
}

#[test]
fn api_enums_convert_into_the_allocators() {
    assert_eq!(
        alloc::TopologyScope::from(TopologyScope::PcieRoot),
        alloc::TopologyScope::PcieRoot
    );
    assert_eq!(
        alloc::TopologyScope::from(TopologyScope::NvLink),
        alloc::TopologyScope::NvLink
    );
    assert_eq!(Policy::from(PlacementPolicy::Spread), Policy::Spread);
    assert_eq!(Policy::from(PlacementPolicy::BinPack), Policy::BinPack);
    assert_eq!(
        Policy::from(PlacementPolicy::LeastFragmentation),
        Policy::LeastFragmentation
    );
    assert_eq!(Policy::from(PlacementPolicy::default()), Policy::default());
}

mod prioritized;

#[test]
fn a_server_held_class_passes_its_enforcement_and_keeps_claims_on_mps() {
    let memory = json!({ "memory": "10Gi" });
    let claim = request_of(
        &json!([request("gpu", "held")]),
        &json!([config(&[], &memory)]),
    );
    let held = &claim.unwrap().requests[0];
    assert_eq!(
        (held.sharing, held.enforcement),
        (Sharing::Mps, Enforcement::Server)
    );
    let time_sliced = json!({ "memory": "10Gi", "sharing": "TimeSlicing" });
    let message = error_of(
        &json!([request("gpu", "held")]),
        &json!([config(&[], &time_sliced)]),
    );
    assert!(
        message.contains("sharing")
            && message.contains("TimeSlicing")
            && message.contains("\"held\""),
        "{message}"
    );
}
