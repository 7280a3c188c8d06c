use serde_json::{Value, json};

use super::*;
use crate::API_VERSION;

const DRIVER: &str = "gpu.kerf.dev";

fn result(request: &str, driver: &str, device: &str) -> Value {
    json!({ "request": request, "driver": driver, "pool": "node-1", "device": device })
}

fn config(source: &str, driver: &str, requests: &[&str], kind: &str, fields: Value) -> Value {
    let mut parameters = json!({ "apiVersion": API_VERSION, "kind": kind });
    if let (Some(target), Value::Object(fields)) = (parameters.as_object_mut(), fields) {
        target.extend(fields);
    }
    let mut entry =
        json!({ "source": source, "opaque": { "driver": driver, "parameters": parameters } });
    if !requests.is_empty() {
        entry["requests"] = json!(requests);
    }
    entry
}

fn claim_config(requests: &[&str], fields: Value) -> Value {
    config("FromClaim", DRIVER, requests, "GpuClaimParameters", fields)
}

fn class_config(requests: &[&str], fields: Value) -> Value {
    config("FromClass", DRIVER, requests, "GpuClassParameters", fields)
}

fn allocated(results: &[Value], configs: &[Value]) -> ResourceClaim {
    let claim = json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": { "namespace": "team-a", "name": "train", "uid": "1234" },
        "spec": { "devices": {} },
        "status": { "allocation": { "devices": { "results": results, "config": configs } } },
    });
    serde_json::from_value(claim).expect("valid ResourceClaim")
}

fn resolve(results: &[Value], configs: &[Value]) -> Result<Vec<AllocatedDevice>> {
    resolve_allocation(&allocated(results, configs), DRIVER)
}

fn only(devices: Result<Vec<AllocatedDevice>>) -> AllocatedDevice {
    let mut devices = devices.expect("resolves");
    assert_eq!(devices.len(), 1, "{devices:?}");
    devices.remove(0)
}

#[test]
fn whole_gpu_without_config() {
    let device = only(resolve(&[result("gpu", DRIVER, "gpu-0")], &[]));
    assert_eq!(
        device,
        AllocatedDevice {
            request: "gpu".into(),
            pool: "node-1".into(),
            device: "gpu-0".into(),
            share_id: None,
            admin_access: false,
            limits: SliceLimits::default(),
            sharing: Sharing::Exclusive,
            time_slice_interval: TimeSliceInterval::Default,
            expected_gpu_uuid: None,
            enforcement: Enforcement::default(),
            share: None,
        }
    );
}

#[test]
fn results_of_other_drivers_are_ignored_and_order_is_kept() {
    let devices = resolve(
        &[
            result("nic", "net.example.com", "eth0"),
            result("gpu", DRIVER, "gpu-1"),
            result("gpu", DRIVER, "gpu-0"),
        ],
        &[],
    )
    .expect("resolves");
    let names: Vec<&str> = devices.iter().map(|d| d.device.as_str()).collect();
    assert_eq!(names, ["gpu-1", "gpu-0"]);
}

#[test]
fn share_id_and_admin_access_are_carried() {
    let mut shared = result("gpu", DRIVER, "gpu-0");
    shared["shareID"] = json!("7e6c1f5a-0000-4000-8000-000000000001");
    shared["consumedCapacity"] = json!({ "memory": "10Gi", "compute": "100" });
    shared["adminAccess"] = json!(true);
    let device = only(resolve(&[shared], &[]));
    assert_eq!(
        device.share_id.as_deref(),
        Some("7e6c1f5a-0000-4000-8000-000000000001")
    );
    assert!(device.admin_access);
}

#[test]
fn unallocated_claim_is_a_clear_error() {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": { "namespace": "team-a", "name": "train" },
        "spec": { "devices": {} },
    }))
    .expect("valid ResourceClaim");
    let error = resolve_allocation(&claim, DRIVER).expect_err("not allocated");
    assert_eq!(error.reason(), "claim_not_allocated");
    assert!(error.to_string().contains("team-a/train"), "{error}");
    assert!(error.to_string().contains("status.allocation"), "{error}");
}

#[test]
fn no_results_for_this_driver_names_the_drivers_present() {
    let error = resolve(
        &[
            result("nic", "net.example.com", "eth0"),
            result("fpga", "fpga.example.com", "f0"),
        ],
        &[claim_config(&[], json!({ "compute": 500 }))],
    )
    .expect_err("no results for kerf");
    assert_eq!(error.reason(), "no_results_for_driver");
    let message = error.to_string();
    for part in ["team-a/train", DRIVER, "fpga.example.com, net.example.com"] {
        assert!(message.contains(part), "{message} should mention {part}");
    }
    let none = resolve(&[], &[]).expect_err("no results at all");
    assert!(none.to_string().ends_with(": none"), "{none}");
}

#[test]
fn claim_config_sets_limits() {
    let device = only(resolve(
        &[result("gpu", DRIVER, "gpu-0")],
        &[claim_config(
            &[],
            json!({ "memory": "10Gi", "compute": 30, "sharing": "MPS" }),
        )],
    ));
    assert_eq!(
        device.limits,
        SliceLimits {
            memory_bytes: Some(10 << 30),
            compute_percent: Some(30)
        }
    );
    assert_eq!(device.sharing, Sharing::Mps);
}

#[test]
fn claim_overrides_class_and_later_overrides_earlier_field_by_field() {
    let device = only(resolve(
        &[result("gpu", DRIVER, "gpu-0")],
        &[
            // Listed first, but claim configs always come after class configs.
            claim_config(&[], json!({ "memory": "8Gi", "compute": 40 })),
            class_config(&[], json!({ "sharing": { "strategy": "TimeSlicing" } })),
            claim_config(&[], json!({ "compute": 60 })),
        ],
    ));
    assert_eq!(
        device.limits,
        SliceLimits {
            memory_bytes: Some(8 << 30),
            compute_percent: Some(60)
        }
    );
    assert_eq!(
        device.sharing,
        Sharing::TimeSlicing,
        "class sharing stays when no claim config sets it"
    );

    let device = only(resolve(
        &[result("gpu", DRIVER, "gpu-0")],
        &[
            claim_config(&[], json!({ "sharing": "MPS" })),
            class_config(&[], json!({ "sharing": { "strategy": "TimeSlicing" } })),
        ],
    ));
    assert_eq!(
        device.sharing,
        Sharing::Mps,
        "claim sharing overrides class sharing"
    );
}

#[test]
fn configs_apply_only_to_the_requests_they_name() {
    let devices = resolve(
        &[
            result("small", DRIVER, "gpu-0"),
            result("big/h100", DRIVER, "gpu-1"),
            result("other", DRIVER, "gpu-2"),
        ],
        &[
            claim_config(&["small"], json!({ "compute": 10 })),
            claim_config(&["big"], json!({ "compute": 90 })),
        ],
    )
    .expect("resolves");
    let compute: Vec<Option<u8>> = devices.iter().map(|d| d.limits.compute_percent).collect();
    assert_eq!(compute, [Some(10), Some(90), None]);
    assert_eq!(
        devices[1].request, "big/h100",
        "the subrequest is reported as written"
    );

    let exact = resolve(
        &[
            result("big/h100", DRIVER, "gpu-1"),
            result("big/a100", DRIVER, "gpu-2"),
        ],
        &[claim_config(&["big/h100"], json!({ "compute": 70 }))],
    )
    .expect("resolves");
    assert_eq!(exact[0].limits.compute_percent, Some(70));
    assert_eq!(exact[1].limits.compute_percent, None);
}

#[test]
fn configs_of_other_drivers_are_never_decoded() {
    let device = only(resolve(
        &[result("gpu", DRIVER, "gpu-0")],
        &[
            config(
                "FromClaim",
                "other.example.com",
                &[],
                "Whatever",
                json!({ "compute": 500, "bogus": true }),
            ),
            json!({ "source": "FromClaim", "opaque": { "driver": "other.example.com", "parameters": "not even an object" } }),
            json!({ "source": "SomethingNew", "opaque": { "driver": "other.example.com", "parameters": {} } }),
        ],
    ));
    assert!(device.limits.is_whole());
}

#[test]
fn bad_config_of_this_driver_names_its_path() {
    let error = resolve(
        &[result("gpu", DRIVER, "gpu-0")],
        &[
            class_config(&[], json!({})),
            config("FromClaim", "other.example.com", &[], "X", json!({})),
            claim_config(&[], json!({ "compute": 150 })),
        ],
    )
    .expect_err("compute out of range");
    assert_eq!(error.reason(), "invalid_config");
    assert_eq!(
        error.to_string(),
        "status.allocation.devices.config[2].opaque.parameters.compute: 150 is out of range 1-100"
    );

    let error = resolve(
        &[result("gpu", DRIVER, "gpu-0")],
        &[claim_config(&[], json!({ "memroy": "1Gi" }))],
    )
    .expect_err("unknown field");
    assert!(
        error.to_string().starts_with(
            "status.allocation.devices.config[0].opaque.parameters.memroy: unknown field"
        ),
        "{error}"
    );
}

#[test]
fn bad_config_is_an_error_even_when_it_names_another_request() {
    let error = resolve(
        &[result("gpu", DRIVER, "gpu-0")],
        &[claim_config(&["elsewhere"], json!({ "compute": 0 }))],
    )
    .expect_err("strict decoding of every config of this driver");
    assert!(
        error
            .to_string()
            .contains("config[0].opaque.parameters.compute: 0"),
        "{error}"
    );
}

#[test]
fn unknown_source_is_an_error() {
    let mut entry = claim_config(&[], json!({}));
    entry["source"] = json!("FromPod");
    let error = resolve(&[result("gpu", DRIVER, "gpu-0")], &[entry]).expect_err("unknown source");
    assert_eq!(error.reason(), "invalid_allocation");
    assert!(
        error
            .to_string()
            .contains("status.allocation.devices.config[0].source: \"FromPod\""),
        "{error}"
    );
}

fn slice_config(devices: &Value) -> Value {
    config(
        "FromClaim",
        DRIVER,
        &[],
        "GpuSliceAllocation",
        json!({ "devices": devices }),
    )
}

#[test]
fn slice_allocation_wins_for_its_device() {
    let devices = resolve(
        &[
            result("gpu", DRIVER, "gpu-0"),
            result("gpu", DRIVER, "gpu-1"),
        ],
        &[
            class_config(&[], json!({ "sharing": { "strategy": "TimeSlicing" } })),
            slice_config(&json!([{
                "pool": "node-1", "device": "gpu-0", "gpuUUID": "GPU-0",
                "memoryBytes": 5_368_709_120_u64, "computePercent": 25, "sharing": "MPS",
            }])),
            // Listed after the slice allocation, and still loses to it.
            claim_config(&[], json!({ "memory": "10Gi", "compute": 50 })),
        ],
    )
    .expect("resolves");
    assert_eq!(
        devices[0].limits,
        SliceLimits {
            memory_bytes: Some(5 << 30),
            compute_percent: Some(25)
        }
    );
    assert_eq!(devices[0].sharing, Sharing::Mps);
    // gpu-1 has no slice entry: it gets the merged class and claim settings.
    assert_eq!(
        devices[1].limits,
        SliceLimits {
            memory_bytes: Some(10 << 30),
            compute_percent: Some(50)
        }
    );
    assert_eq!(devices[1].sharing, Sharing::TimeSlicing);
}

fn time_sliced_class(interval: &str) -> Value {
    class_config(
        &[],
        json!({ "sharing": { "strategy": "TimeSlicing", "timeSliceInterval": interval } }),
    )
}

#[test]
fn scheduler_allocations_take_the_interval_from_the_class_config() {
    let device = only(resolve(
        &[result("gpu", DRIVER, "gpu-0")],
        &[time_sliced_class("Long")],
    ));
    assert_eq!(device.sharing, Sharing::TimeSlicing);
    assert_eq!(device.time_slice_interval, TimeSliceInterval::Long);

    // Merged like sharing: a later class config without an interval keeps the earlier one's,
    // one with an interval replaces it.
    let interval = |configs: &[Value]| {
        only(resolve(&[result("gpu", DRIVER, "gpu-0")], configs)).time_slice_interval
    };
    assert_eq!(
        interval(&[
            time_sliced_class("Short"),
            class_config(&[], json!({ "sharing": { "strategy": "TimeSlicing" } })),
        ]),
        TimeSliceInterval::Short
    );
    assert_eq!(
        interval(&[time_sliced_class("Short"), time_sliced_class("Medium")]),
        TimeSliceInterval::Medium
    );
    assert_eq!(
        interval(&[class_config(
            &[],
            json!({ "sharing": { "strategy": "TimeSlicing" } })
        )]),
        TimeSliceInterval::Default,
        "a class without an interval leaves the driver's default"
    );
    assert_eq!(
        interval(&[
            time_sliced_class("Long"),
            claim_config(&[], json!({ "sharing": "MPS" })),
        ]),
        TimeSliceInterval::Default,
        "a claim that is not time-sliced has no use for the class's interval"
    );
}

#[test]
fn the_slice_allocation_interval_wins_over_the_class_config() {
    let devices = resolve(
        &[
            result("gpu", DRIVER, "gpu-0"),
            result("gpu", DRIVER, "gpu-1"),
        ],
        &[
            time_sliced_class("Short"),
            slice_config(&json!([
                { "pool": "node-1", "device": "gpu-0", "gpuUUID": "GPU-0",
                  "sharing": "TimeSlicing", "timeSliceInterval": "Long" },
                { "pool": "node-1", "device": "gpu-1", "gpuUUID": "GPU-1",
                  "sharing": "TimeSlicing" },
            ])),
        ],
    )
    .expect("resolves");
    assert_eq!(devices[0].time_slice_interval, TimeSliceInterval::Long);
    // An entry without one (written before classes could name one) falls back to the class.
    assert_eq!(devices[1].time_slice_interval, TimeSliceInterval::Short);
}

#[test]
fn slice_allocation_matches_pool_and_share() {
    let mut shared = result("gpu", DRIVER, "gpu-0");
    shared["shareID"] = json!("b");
    let device = only(resolve(
        &[shared],
        &[slice_config(&json!([
            { "pool": "node-2", "device": "gpu-0", "gpuUUID": "GPU-X", "computePercent": 10 },
            { "pool": "node-1", "device": "gpu-0", "shareID": "a", "gpuUUID": "GPU-0", "computePercent": 20 },
            { "pool": "node-1", "device": "gpu-0", "shareID": "b", "gpuUUID": "GPU-0", "computePercent": 30 },
        ]))],
    ));
    assert_eq!(device.limits.compute_percent, Some(30));
}

#[test]
fn memory_must_be_a_multiple_of_the_class_granularity() {
    let error = resolve(
        &[result("gpu", DRIVER, "gpu-0")],
        &[
            class_config(
                &[],
                json!({ "allocator": "Controller", "slicing": { "memoryGranularity": "2Gi" } }),
            ),
            claim_config(&[], json!({ "memory": "3Gi" })),
        ],
    )
    .expect_err("3Gi is not a multiple of 2Gi");
    let message = error.to_string();
    for part in [
        "status.allocation.devices.config[1].opaque.parameters.memory",
        "\"3Gi\"",
        "2Gi",
    ] {
        assert!(message.contains(part), "{message} should mention {part}");
    }

    let fine = resolve(
        &[result("gpu", DRIVER, "gpu-0")],
        &[
            class_config(&[], json!({ "allocator": "Controller", "slicing": {} })),
            claim_config(&[], json!({ "memory": "3Gi" })),
        ],
    );
    assert!(fine.is_ok(), "the default granularity is 1Gi: {fine:?}");
}

#[test]
fn parent_requests() {
    assert_eq!(parent_request("req"), "req");
    assert_eq!(parent_request("req/sub"), "req");
}
