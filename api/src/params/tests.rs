use kerf_core::enforcement::Enforcement;
use proptest::prelude::*;
use serde_json::json;

use super::*;

const AT: &str = "spec.devices.config[1].opaque.parameters";

fn claim(fields: Value) -> Value {
    with_kind("GpuClaimParameters", fields)
}

fn class(fields: Value) -> Value {
    with_kind("GpuClassParameters", fields)
}

fn slice(fields: Value) -> Value {
    with_kind("GpuSliceAllocation", fields)
}

fn with_kind(kind: &str, fields: Value) -> Value {
    let mut object = json!({ "apiVersion": API_VERSION, "kind": kind });
    if let (Some(target), Value::Object(fields)) = (object.as_object_mut(), fields) {
        target.extend(fields);
    }
    object
}

/// Decodes and returns the error message, failing the test if decoding succeeds.
fn error(parameters: &Value) -> String {
    match decode_opaque(parameters, AT) {
        Ok(decoded) => panic!("expected an error for {parameters}, decoded {decoded:?}"),
        Err(e) => {
            assert_eq!(e.reason(), "invalid_config", "{e}");
            e.to_string()
        }
    }
}

fn assert_mentions(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(
            message.contains(part),
            "{message:?} should mention {part:?}"
        );
    }
}

#[test]
fn decodes_claim_parameters() {
    let decoded = decode_opaque(
        &claim(
            json!({ "memory": "20Gi", "compute": 50, "sharing": "MPS", "topology": { "scope": "NVLink" } }),
        ),
        AT,
    );
    let expected = GpuClaimParameters {
        memory: Some(Quantity("20Gi".into())),
        compute: Some(50),
        sharing: Some(Sharing::Mps),
        topology: Some(Topology {
            scope: TopologyScope::NvLink,
        }),
    };
    assert_eq!(decoded.ok(), Some(OpaqueConfig::Claim(expected.clone())));
    assert_eq!(
        expected.limits(AT).ok(),
        Some(SliceLimits {
            memory_bytes: Some(20 << 30),
            compute_percent: Some(50)
        })
    );
}

#[test]
fn empty_claim_parameters_mean_a_whole_gpu() {
    let Ok(OpaqueConfig::Claim(params)) = decode_opaque(&claim(json!({})), AT) else {
        panic!("empty claim parameters should decode");
    };
    assert!(params.is_whole());
    assert!(params.limits(AT).is_ok_and(|l| l.is_whole()));
}

#[test]
fn memory_may_be_a_plain_number() {
    let decoded = decode_opaque(&claim(json!({ "memory": 1_073_741_824 })), AT);
    let Ok(OpaqueConfig::Claim(params)) = decoded else {
        panic!("{decoded:?}")
    };
    assert_eq!(
        params.limits(AT).ok().and_then(|l| l.memory_bytes),
        Some(1 << 30)
    );
}

#[test]
fn compute_out_of_range_names_path_and_value() {
    assert_eq!(
        error(&claim(json!({ "compute": 150 }))),
        format!("{AT}.compute: 150 is out of range 1-100")
    );
    assert_eq!(
        error(&claim(json!({ "compute": 0 }))),
        format!("{AT}.compute: 0 is out of range 1-100")
    );
    assert_eq!(
        error(&claim(json!({ "compute": 300 }))),
        format!("{AT}.compute: 300 is out of range 1-100")
    );
    assert_eq!(
        error(&claim(json!({ "compute": -5 }))),
        format!("{AT}.compute: -5 is out of range 1-100")
    );
    assert_mentions(
        &error(&claim(json!({ "compute": 50.5 }))),
        &[&format!("{AT}.compute"), "50.5", "whole percent"],
    );
    assert_mentions(
        &error(&claim(json!({ "compute": "50" }))),
        &[&format!("{AT}.compute"), "\"50\""],
    );
}

#[test]
fn unknown_field_names_path_and_field() {
    let message = error(&claim(json!({ "memroy": "1Gi" })));
    assert_mentions(
        &message,
        &[&format!("{AT}.memroy:"), "unknown field", "memroy"],
    );
    let message = error(&claim(
        json!({ "topology": { "scope": "Any", "level": 2 } }),
    ));
    assert_mentions(
        &message,
        &[&format!("{AT}.topology.level:"), "unknown field", "level"],
    );
}

#[test]
fn bad_memory_names_path_and_value() {
    for (memory, why) in [
        (json!("-1Gi"), "negative"),
        (json!("0"), "greater than zero"),
        (json!("1.5"), "whole number of bytes"),
        (json!("lots"), "malformed"),
        (json!("16GB"), "unknown suffix"),
        (json!("9Ei"), "2^63-1"),
    ] {
        let message = error(&claim(json!({ "memory": memory })));
        let shown = memory.as_str().unwrap_or_default();
        assert_mentions(
            &message,
            &[&format!("{AT}.memory:"), &format!("{shown:?}"), why],
        );
    }
    assert_mentions(
        &error(&claim(json!({ "memory": -3 }))),
        &[&format!("{AT}.memory:"), "\"-3\"", "negative"],
    );
    assert_mentions(
        &error(&claim(json!({ "memory": true }))),
        &[&format!("{AT}.memory:"), "boolean `true`"],
    );
}

#[test]
fn bad_enum_values_name_path_and_value() {
    assert_mentions(
        &error(&claim(json!({ "topology": { "scope": "Ring" } }))),
        &[&format!("{AT}.topology.scope:"), "Ring", "NVLink"],
    );
    assert_mentions(
        &error(&claim(json!({ "sharing": "Shared" }))),
        &[&format!("{AT}.sharing:"), "Shared", "MPS"],
    );
    assert_mentions(
        &error(&claim(json!({ "sharing": 3 }))),
        &[&format!("{AT}.sharing:"), "3"],
    );
}

#[test]
fn wrong_api_version_names_value() {
    let mut params = claim(json!({}));
    params["apiVersion"] = json!("gpu.kerf.dev/v1");
    assert_eq!(
        error(&params),
        format!(
            "{AT}.apiVersion: \"gpu.kerf.dev/v1\" is not supported; expected \"gpu.kerf.dev/v1alpha1\""
        )
    );
    params["apiVersion"] = json!(1);
    assert_mentions(
        &error(&params),
        &[&format!("{AT}.apiVersion:"), "expected a string", "1"],
    );
    let missing = json!({ "kind": "GpuClaimParameters" });
    assert_mentions(
        &error(&missing),
        &[&format!("{AT}.apiVersion:"), "missing", API_VERSION],
    );
}

#[test]
fn unknown_or_missing_kind_names_value() {
    assert_mentions(
        &error(&with_kind("GpuFancyParameters", json!({}))),
        &[
            &format!("{AT}.kind:"),
            "\"GpuFancyParameters\"",
            "GpuClaimParameters",
        ],
    );
    assert_mentions(
        &error(&json!({ "apiVersion": API_VERSION })),
        &[&format!("{AT}.kind:"), "missing"],
    );
}

#[test]
fn parameters_must_be_an_object() {
    assert_mentions(
        &error(&json!("memory=1Gi")),
        &[&format!("{AT}:"), "object", "memory=1Gi"],
    );
    assert_mentions(&error(&json!(null)), &[&format!("{AT}:"), "null"]);
}

#[test]
fn decodes_class_parameters_with_defaults() {
    let decoded = decode_opaque(
        &class(json!({
            "allocator": "Controller",
            "selector": { "productNames": ["NVIDIA H100 80GB HBM3"], "minMemory": "40Gi", "minComputeCapability": "9.0" },
            "slicing": { "maxSlicesPerGpu": 7 },
            "placement": { "policy": "Spread" },
            "sharing": { "strategy": "MPS" },
        })),
        AT,
    );
    let Ok(OpaqueConfig::Class(params)) = decoded else {
        panic!("{decoded:?}")
    };
    assert_eq!(params.allocator, Allocator::Controller);
    assert_eq!(
        params.memory_granularity_bytes(AT).ok(),
        Some(Some(1 << 30)),
        "granularity defaults to 1Gi"
    );
    assert_eq!(
        params.slicing.as_ref().and_then(|s| s.max_slices_per_gpu),
        Some(7)
    );
    assert_eq!(
        params.placement.map(|p| p.policy),
        Some(PlacementPolicy::Spread)
    );
    assert_eq!(params.sharing.map(|s| s.strategy), Some(Sharing::Mps));
    assert_eq!(
        params.selector.min_memory_bytes(AT).ok(),
        Some(Some(40 << 30))
    );
    assert_eq!(
        params.selector.min_compute_capability(AT).ok(),
        Some(Some(ComputeCapability { major: 9, minor: 0 }))
    );

    let Ok(OpaqueConfig::Class(defaults)) = decode_opaque(&class(json!({})), AT) else {
        panic!("empty class parameters should decode");
    };
    assert_eq!(defaults, GpuClassParameters::default());
    assert_eq!(defaults.allocator, Allocator::Scheduler);
}

#[test]
fn class_parameter_errors_name_path_and_value() {
    assert_mentions(
        &error(&class(json!({ "slicing": { "granularity": "1Gi" } }))),
        &[&format!("{AT}.slicing.granularity:"), "unknown field"],
    );
    assert_eq!(
        error(&class(json!({ "slicing": { "defaultCompute": 101 } }))),
        format!("{AT}.slicing.defaultCompute: 101 is out of range 1-100")
    );
    assert_mentions(
        &error(&class(json!({ "slicing": { "maxSlicesPerGpu": 0 } }))),
        &[&format!("{AT}.slicing.maxSlicesPerGpu:"), "0"],
    );
    assert_mentions(
        &error(&class(json!({ "slicing": { "memoryGranularity": "0.5" } }))),
        &[
            &format!("{AT}.slicing.memoryGranularity:"),
            "\"0.5\"",
            "whole number",
        ],
    );
    assert_mentions(
        &error(&class(
            json!({ "allocator": "Controller", "selector": { "migProfile": "1g.10gb" } }),
        )),
        &[
            &format!("{AT}.selector.migProfile:"),
            "1g.10gb",
            "Scheduler",
        ],
    );
    assert_mentions(
        &error(&class(
            json!({ "selector": { "minComputeCapability": "9" } }),
        )),
        &[&format!("{AT}.selector.minComputeCapability:"), "\"9\""],
    );
    assert_mentions(
        &error(&class(
            json!({ "selector": { "productNames": ["ok", ""] } }),
        )),
        &[&format!("{AT}.selector.productNames[1]:"), "empty"],
    );
    assert_mentions(
        &error(&class(json!({ "allocator": "Kubelet" }))),
        &[&format!("{AT}.allocator:"), "Kubelet", "Controller"],
    );
    assert_mentions(
        &error(&class(json!({ "placement": { "policy": "Random" } }))),
        &[&format!("{AT}.placement.policy:"), "Random"],
    );
}

#[test]
fn decodes_time_slice_intervals() {
    for (name, interval) in [
        ("Default", TimeSliceInterval::Default),
        ("Short", TimeSliceInterval::Short),
        ("Medium", TimeSliceInterval::Medium),
        ("Long", TimeSliceInterval::Long),
    ] {
        let decoded = decode_opaque(
            &class(json!({ "sharing": { "strategy": "TimeSlicing", "timeSliceInterval": name } })),
            AT,
        );
        let Ok(OpaqueConfig::Class(params)) = decoded else {
            panic!("{name}: {decoded:?}")
        };
        assert_eq!(
            params.sharing,
            Some(SharingConfig {
                strategy: Sharing::TimeSlicing,
                time_slice_interval: Some(interval),
                ..SharingConfig::default()
            })
        );
        let encoded = params.to_parameters().expect("encodes");
        assert_eq!(encoded["sharing"]["timeSliceInterval"], name);
    }
    let Ok(OpaqueConfig::Class(without)) = decode_opaque(
        &class(json!({ "sharing": { "strategy": "TimeSlicing" } })),
        AT,
    ) else {
        panic!("a class without an interval should decode");
    };
    let sharing = without.sharing.expect("sharing");
    assert_eq!(sharing.time_slice_interval, None);
    assert!(
        without.to_parameters().expect("encodes")["sharing"]
            .get("timeSliceInterval")
            .is_none(),
        "an unset interval is left out"
    );
}

#[test]
fn bad_time_slice_intervals_name_path_and_value() {
    assert_mentions(
        &error(&class(
            json!({ "sharing": { "strategy": "TimeSlicing", "timeSliceInterval": "Longest" } }),
        )),
        &[
            &format!("{AT}.sharing.timeSliceInterval:"),
            "Longest",
            "Medium",
        ],
    );
    for strategy in ["MPS", "Exclusive"] {
        assert_eq!(
            error(&class(
                json!({ "sharing": { "strategy": strategy, "timeSliceInterval": "Long" } }),
            )),
            format!(
                "{AT}.sharing.timeSliceInterval: Long applies to time-sliced GPUs only; strategy is {strategy}, not TimeSlicing"
            )
        );
    }
    // Without a strategy the class is Exclusive, so an interval alone is refused too.
    assert_mentions(
        &error(&class(
            json!({ "sharing": { "timeSliceInterval": "Short" } }),
        )),
        &[
            &format!("{AT}.sharing.timeSliceInterval:"),
            "Short",
            "Exclusive",
        ],
    );
}

#[test]
fn the_class_interval_applies_to_time_sliced_devices_only() {
    let sharing = SharingConfig {
        strategy: Sharing::TimeSlicing,
        time_slice_interval: Some(TimeSliceInterval::Medium),
        ..SharingConfig::default()
    };
    assert_eq!(
        sharing.time_slice_interval_for(Sharing::TimeSlicing),
        Some(TimeSliceInterval::Medium)
    );
    assert_eq!(sharing.time_slice_interval_for(Sharing::Mps), None);
    assert_eq!(sharing.time_slice_interval_for(Sharing::Exclusive), None);
}

#[test]
fn mig_profile_is_fine_for_scheduler_classes() {
    assert!(
        decode_opaque(
            &class(json!({ "selector": { "migProfile": "1g.10gb" } })),
            AT
        )
        .is_ok()
    );
}

fn slice_device() -> Value {
    json!({
        "pool": "node-1",
        "device": "gpu-3",
        "gpuUUID": "GPU-3",
        "memoryBytes": 21_474_836_480_u64,
        "computePercent": 25,
        "sharing": "MPS",
    })
}

#[test]
fn decodes_slice_allocation() {
    let decoded = decode_opaque(&slice(json!({ "devices": [slice_device()] })), AT);
    let Ok(OpaqueConfig::Slice(allocation)) = decoded else {
        panic!("{decoded:?}")
    };
    let device = allocation
        .find("node-1", "gpu-3", None)
        .expect("entry for gpu-3");
    assert_eq!(device.gpu_uuid, "GPU-3");
    assert_eq!(
        device.limits(),
        SliceLimits {
            memory_bytes: Some(20 << 30),
            compute_percent: Some(25)
        }
    );
    assert_eq!(device.sharing, Sharing::Mps);
    assert!(allocation.find("node-1", "gpu-4", None).is_none());
    assert!(allocation.find("node-2", "gpu-3", None).is_none());
}

#[test]
fn slice_devices_carry_an_optional_interval() {
    // Written before classes could name an interval: no field at all.
    let Ok(OpaqueConfig::Slice(old)) =
        decode_opaque(&slice(json!({ "devices": [slice_device()] })), AT)
    else {
        panic!("an entry without timeSliceInterval should decode");
    };
    assert_eq!(old.devices[0].time_slice_interval, None);

    let mut device = slice_device();
    device["sharing"] = json!("TimeSlicing");
    device["timeSliceInterval"] = json!("Long");
    let decoded = decode_opaque(&slice(json!({ "devices": [device] })), AT);
    let Ok(OpaqueConfig::Slice(allocation)) = decoded else {
        panic!("{decoded:?}")
    };
    assert_eq!(
        allocation.devices[0].time_slice_interval,
        Some(TimeSliceInterval::Long)
    );
    let encoded = allocation.to_parameters().expect("encodes");
    assert_eq!(encoded["devices"][0]["timeSliceInterval"], "Long");
    assert_eq!(
        decode_opaque(&encoded, AT).ok(),
        Some(OpaqueConfig::Slice(allocation))
    );
    let encoded_old = old.to_parameters().expect("encodes");
    assert!(encoded_old["devices"][0].get("timeSliceInterval").is_none());
}

#[test]
fn slice_device_interval_errors_name_path_and_value() {
    let mut unknown = slice_device();
    unknown["sharing"] = json!("TimeSlicing");
    unknown["timeSliceInterval"] = json!(3);
    assert_mentions(
        &error(&slice(json!({ "devices": [unknown] }))),
        &[&format!("{AT}.devices[0].timeSliceInterval:"), "3"],
    );
    let mut mps = slice_device();
    mps["timeSliceInterval"] = json!("Short");
    assert_eq!(
        error(&slice(json!({ "devices": [mps] }))),
        format!(
            "{AT}.devices[0].timeSliceInterval: Short applies to time-sliced GPUs only; sharing is MPS, not TimeSlicing"
        )
    );
}

#[test]
fn slice_allocation_errors_name_path_and_value() {
    assert_mentions(
        &error(&slice(json!({ "devices": [] }))),
        &[&format!("{AT}.devices:"), "at least one"],
    );
    let mut zero = slice_device();
    zero["memoryBytes"] = json!(0);
    assert_mentions(
        &error(&slice(json!({ "devices": [zero] }))),
        &[&format!("{AT}.devices[0].memoryBytes:"), "0"],
    );
    let mut negative = slice_device();
    negative["memoryBytes"] = json!(-1);
    assert_mentions(
        &error(&slice(json!({ "devices": [negative] }))),
        &[&format!("{AT}.devices[0].memoryBytes:"), "-1"],
    );
    let mut compute = slice_device();
    compute["computePercent"] = json!(120);
    assert_eq!(
        error(&slice(json!({ "devices": [slice_device(), compute] }))),
        format!("{AT}.devices[1].computePercent: 120 is out of range 1-100")
    );
    let mut missing = slice_device();
    missing.as_object_mut().map(|o| o.remove("gpuUUID"));
    assert_mentions(
        &error(&slice(json!({ "devices": [missing] }))),
        &[&format!("{AT}.devices[0]"), "gpuUUID"],
    );
    assert_mentions(
        &error(&slice(
            json!({ "devices": [slice_device(), slice_device()] }),
        )),
        &[&format!("{AT}.devices[1]:"), "gpu-3", "twice"],
    );
    let mut typo = slice_device();
    typo["gpuUuid"] = json!("GPU-3");
    assert_mentions(
        &error(&slice(json!({ "devices": [typo] }))),
        &[&format!("{AT}.devices[0].gpuUuid:"), "unknown field"],
    );
}

#[test]
fn slice_entries_with_share_ids_match_only_their_share() {
    let mut first = slice_device();
    first["shareID"] = json!("a");
    let mut second = slice_device();
    second["shareID"] = json!("b");
    second["memoryBytes"] = json!(1024);
    let Ok(OpaqueConfig::Slice(allocation)) =
        decode_opaque(&slice(json!({ "devices": [first, second] })), AT)
    else {
        panic!("two shares of one device should decode");
    };
    assert_eq!(
        allocation
            .find("node-1", "gpu-3", Some("b"))
            .and_then(|d| d.memory_bytes),
        Some(1024)
    );
    assert_eq!(
        allocation
            .find("node-1", "gpu-3", Some("a"))
            .and_then(|d| d.memory_bytes),
        Some(20 << 30)
    );
    assert!(allocation.find("node-1", "gpu-3", Some("c")).is_none());
}

#[test]
fn encoding_adds_api_version_and_kind() {
    let params = GpuClaimParameters {
        compute: Some(30),
        ..GpuClaimParameters::default()
    };
    let encoded = params.to_parameters().expect("encodes");
    assert_eq!(
        encoded,
        json!({ "apiVersion": API_VERSION, "kind": "GpuClaimParameters", "compute": 30 })
    );
    assert_eq!(OpaqueConfig::Claim(params).kind(), "GpuClaimParameters");
}

#[test]
fn compute_capabilities_parse() {
    assert_eq!(
        parse_compute_capability("8.6"),
        Some(ComputeCapability { major: 8, minor: 6 })
    );
    assert_eq!(
        parse_compute_capability("10.0"),
        Some(ComputeCapability {
            major: 10,
            minor: 0
        })
    );
    for bad in ["8", "8.", ".6", "8.6.1", "a.b", "+8.6", ""] {
        assert_eq!(parse_compute_capability(bad), None, "{bad}");
    }
}

#[test]
fn paths_join() {
    assert_eq!(join("a", "b"), "a.b");
    assert_eq!(join("a", "[0].b"), "a[0].b");
    assert_eq!(join("a", "."), "a");
    assert_eq!(join("", "b"), "b");
}

fn sharing_strategy() -> impl Strategy<Value = Sharing> {
    prop_oneof![
        Just(Sharing::Exclusive),
        Just(Sharing::Mps),
        Just(Sharing::TimeSlicing)
    ]
}

fn interval() -> impl Strategy<Value = TimeSliceInterval> {
    prop_oneof![
        Just(TimeSliceInterval::Default),
        Just(TimeSliceInterval::Short),
        Just(TimeSliceInterval::Medium),
        Just(TimeSliceInterval::Long)
    ]
}

fn scope() -> impl Strategy<Value = TopologyScope> {
    prop_oneof![
        Just(TopologyScope::Any),
        Just(TopologyScope::PcieRoot),
        Just(TopologyScope::NvLink)
    ]
}

proptest! {
    #[test]
    fn claim_parameters_round_trip(
        memory in proptest::option::of(1u64..(1 << 44)),
        compute in proptest::option::of(1u8..=100),
        sharing in proptest::option::of(sharing_strategy()),
        topology in proptest::option::of(scope()),
    ) {
        let params = GpuClaimParameters {
            memory: memory.map(quantity::bytes_quantity),
            compute,
            sharing,
            topology: topology.map(|scope| Topology { scope }),
        };
        let encoded = params.to_parameters().expect("encodes");
        prop_assert_eq!(decode_opaque(&encoded, AT).ok(), Some(OpaqueConfig::Claim(params.clone())));
        prop_assert_eq!(params.limits(AT).ok().and_then(|l| l.memory_bytes), memory);
    }

    #[test]
    fn slice_allocations_round_trip(
        memory in proptest::option::of(1u64..(1 << 40)),
        compute in proptest::option::of(1u8..=100),
        sharing in sharing_strategy(),
        interval in proptest::option::of(interval()),
        minor in 0u32..64,
    ) {
        let allocation = GpuSliceAllocation {
            devices: vec![SliceDevice {
                pool: "node-a".into(),
                device: format!("gpu-{minor}"),
                share_id: None,
                gpu_uuid: format!("GPU-{minor}"),
                memory_bytes: memory,
                compute_percent: compute,
                sharing,
                time_slice_interval: interval.filter(|_| sharing == Sharing::TimeSlicing),
                enforcement: Enforcement::default(),
            }],
        };
        let encoded = allocation.to_parameters().expect("encodes");
        prop_assert_eq!(decode_opaque(&encoded, AT).ok(), Some(OpaqueConfig::Slice(allocation)));
    }

    #[test]
    fn any_compute_outside_1_to_100_is_rejected(compute in any::<i64>().prop_filter("out of range", |c| !(1..=100).contains(c))) {
        let message = decode_opaque(&claim(json!({ "compute": compute })), AT).err().map(|e| e.to_string());
        prop_assert_eq!(message, Some(format!("{AT}.compute: {compute} is out of range 1-100")));
    }

    #[test]
    fn unknown_fields_are_always_rejected(field in "[a-z][a-zA-Z]{0,12}") {
        prop_assume!(!["memory", "compute", "sharing", "topology"].contains(&field.as_str()));
        let mut fields = Map::new();
        fields.insert(field.clone(), json!(1));
        let message = decode_opaque(&claim(Value::Object(fields)), AT).err().map(|e| e.to_string()).unwrap_or_default();
        prop_assert!(message.starts_with(&format!("{AT}.{field}: unknown field")), "{}", message);
    }
}

#[test]
fn sliced_scheduler_classes_share_whole_gpus_without_exclusive_sharing() {
    let ok = class(json!({ "allocator": "Scheduler", "slicing": { "defaultCompute": 25 } }));
    match decode_opaque(&ok, AT) {
        Ok(OpaqueConfig::Class(params)) => assert!(params.is_scheduler_sliced()),
        other => panic!("{other:?}"),
    }
    let controller = class(
        json!({ "allocator": "Controller", "slicing": {}, "sharing": { "strategy": "Exclusive" } }),
    );
    match decode_opaque(&controller, AT) {
        Ok(OpaqueConfig::Class(params)) => assert!(!params.is_scheduler_sliced()),
        other => panic!("{other:?}"),
    }
    let exclusive = class(
        json!({ "allocator": "Scheduler", "slicing": {}, "sharing": { "strategy": "Exclusive" } }),
    );
    assert_mentions(
        &error(&exclusive),
        &[&format!("{AT}.sharing.strategy"), "Exclusive", "MPS"],
    );
    let mig = class(
        json!({ "allocator": "Scheduler", "slicing": {}, "selector": { "migProfile": "1g.10gb" } }),
    );
    assert_mentions(&error(&mig), &[&format!("{AT}.slicing"), "\"1g.10gb\""]);
}

#[test]
fn server_enforcement_needs_mps_slices_of_the_controller() {
    let held = class(json!({
        "allocator": "Controller", "slicing": {},
        "sharing": { "strategy": "MPS", "enforcement": "Server" },
    }));
    match decode_opaque(&held, AT) {
        Ok(OpaqueConfig::Class(params)) => assert_eq!(
            params.sharing.map(|s| s.enforcement),
            Some(Enforcement::Server)
        ),
        other => panic!("{other:?}"),
    }
    let whole = class(json!({ "sharing": { "enforcement": "Server" } }));
    assert!(
        decode_opaque(&whole, AT).is_ok(),
        "the hardware holds whole GPUs"
    );
    let path = format!("{AT}.sharing.enforcement");
    for (spec, named) in [
        (
            json!({ "allocator": "Controller", "slicing": {}, "sharing": { "strategy": "TimeSlicing", "enforcement": "Server" } }),
            "TimeSlicing",
        ),
        (
            json!({ "allocator": "Controller", "slicing": {}, "sharing": { "enforcement": "Server" } }),
            "Exclusive",
        ),
        (
            json!({ "allocator": "Scheduler", "slicing": {}, "sharing": { "strategy": "MPS", "enforcement": "Server" } }),
            "allocator Controller",
        ),
    ] {
        assert_mentions(&error(&class(spec)), &[&path, named]);
    }
    let unknown = class(json!({ "sharing": { "strategy": "MPS", "enforcement": "Kernel" } }));
    assert_mentions(&error(&unknown), &["Kernel"]);
}
