//! `kerf inventory` with the Kubernetes 1.36 features, for every mock profile: the slices stay
//! inside the API limits ([`limits::check_slice`]), the features show in them, and the YAML it
//! prints reads back into k8s-openapi's `ResourceSlice` with nothing lost (a field k8s-openapi
//! does not know would be dropped on the way, and so would be unknown to the API server's
//! schema too).
//!
//! The command's code is kerf-cli's [`kerf_cli::inventory`]; `.ci/validate-manifests` checks
//! the same output against the Kubernetes schemas.

// Fixture helpers panic on a broken fixture, which is a bug in this file.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use kerf_api::resourceslice::limits;
use kerf_api::shared_publication::SharedSlicing;
use kerf_cli::inventory::{Features, default_slicing, published_slices, resource_slices, to_yaml};
use serde_json::Value;

const DRIVER: &str = "gpu.kerf.dev";
const NODE: &str = "node-1";

fn consumable() -> Features {
    Features {
        consumable_capacity: Some(default_slicing()),
        partitionable_devices: false,
    }
}

/// The feature sets `.ci/validate-manifests` prints: each of the two, and both.
fn feature_sets() -> [(&'static str, Features); 3] {
    let partitionable = Features {
        consumable_capacity: None,
        partitionable_devices: true,
    };
    let both = Features {
        partitionable_devices: true,
        ..consumable()
    };
    [
        ("consumable-capacity", consumable()),
        ("partitionable-devices", partitionable),
        ("all", both),
    ]
}

fn slices(profile: &str, features: &Features) -> Vec<ResourceSlice> {
    let inventory = kerf_core::mock::from_spec(profile).unwrap();
    published_slices(&inventory, DRIVER, NODE, features)
        .unwrap_or_else(|e| panic!("profile {profile}: {e}"))
}

fn devices(slices: &[ResourceSlice]) -> impl Iterator<Item = &Device> {
    slices.iter().flat_map(|s| s.spec.devices.iter().flatten())
}

fn string_attribute<'a>(device: &'a Device, name: &str) -> Option<&'a str> {
    device.attributes.as_ref()?.get(name)?.string.as_deref()
}

/// The printed YAML read as plain data and as `ResourceSlice`s: both must be the slices, with
/// no field the typed read drops.
fn assert_round_trips(what: &str, slices: &[ResourceSlice]) {
    let yaml = to_yaml(slices).unwrap();
    let raw: Vec<Value> = serde_saphyr::from_multiple(&yaml).unwrap();
    let typed: Vec<ResourceSlice> = serde_saphyr::from_multiple(&yaml).unwrap();
    assert_eq!(typed, slices, "{what}: the YAML reads back different");
    assert_eq!(raw.len(), typed.len(), "{what}");
    for (raw, typed) in raw.iter().zip(&typed) {
        assert_eq!(
            &serde_json::to_value(typed).unwrap(),
            raw,
            "{what}: k8s-openapi's ResourceSlice drops or changes a printed field"
        );
    }
}

/// A shareable device is a whole GPU of the scheduler's with the default slicing's policies.
fn assert_shareable(what: &str, gpu: &Device) {
    let what = format!("{what} {}", gpu.name);
    assert_eq!(string_attribute(gpu, "type"), Some("gpu"), "{what}");
    assert!(gpu.consumes_counters.is_none(), "{what}");
    assert_eq!(
        string_attribute(gpu, "allocator"),
        Some("scheduler"),
        "{what}"
    );
    let capacity = gpu.capacity.as_ref().unwrap();
    let memory = capacity["memory"].request_policy.as_ref().unwrap();
    let range = memory.valid_range.as_ref().unwrap();
    assert_eq!(range.min.0, "1Gi", "{what}");
    assert_eq!(range.step.as_ref().unwrap().0, "1Gi", "{what}");
    // Without capacity requests a claim takes all the memory on the grid: the whole GPU.
    assert_eq!(memory.default, range.max, "{what}");
    let compute = capacity["compute"].request_policy.as_ref().unwrap();
    assert_eq!(compute.default.as_ref().unwrap().0, "100", "{what}");
    assert!(
        !capacity.contains_key("slices"),
        "{what}: no max slices by default"
    );
}

#[test]
fn every_profile_with_the_features_is_valid_and_round_trips() {
    let (mut shareable, mut counter_sets) = (0, 0);
    for profile in kerf_core::mock::profile_names() {
        let inventory = kerf_core::mock::from_spec(profile).unwrap();
        for (mode, features) in feature_sets() {
            let what = format!("profile {profile} with {mode}");
            let slices = slices(profile, &features);
            for slice in &slices {
                limits::check_slice(&slice.spec).unwrap_or_else(|e| panic!("{what}: {e}"));
            }
            let specs: Vec<_> = slices.iter().map(|s| s.spec.clone()).collect();
            limits::check_pool(&specs).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_round_trips(&what, &slices);

            let shared: Vec<&Device> = devices(&slices)
                .filter(|d| d.allow_multiple_allocations == Some(true))
                .collect();
            if features.consumable_capacity.is_some() {
                // Every GPU outside MIG mode is shared; one in MIG mode runs nothing whole.
                let plain = inventory.gpus.iter().filter(|g| !g.mig_enabled).count();
                assert_eq!(shared.len(), plain, "{what}");
            } else {
                assert!(shared.is_empty(), "{what}");
            }
            for gpu in &shared {
                assert_shareable(&what, gpu);
            }
            shareable += shared.len();

            let sets = slices
                .iter()
                .flat_map(|s| s.spec.shared_counters.iter().flatten())
                .count();
            let partitioned = inventory.gpus.iter().filter(|g| g.dynamic_mig).count();
            if features.partitionable_devices {
                assert_eq!(
                    sets, partitioned,
                    "{what}: one counter set per dynamic-MIG GPU"
                );
            } else {
                assert_eq!(sets, 0, "{what}");
            }
            counter_sets += sets;
            // Placements and their GPUs are the scheduler's: one allocator per GPU.
            for device in devices(&slices).filter(|d| d.consumes_counters.is_some()) {
                assert_eq!(
                    string_attribute(device, "allocator"),
                    Some("scheduler"),
                    "{what} {}",
                    device.name
                );
            }
            // Static MIG devices stay as they are.
            for mig in devices(&slices).filter(|d| d.consumes_counters.is_none()) {
                if string_attribute(mig, "type") == Some("mig") {
                    assert_eq!(mig.allow_multiple_allocations, None, "{what} {}", mig.name);
                }
            }
        }
    }
    assert!(shareable > 0, "no profile has a shareable GPU");
    assert!(counter_sets > 0, "no profile has a counter set");
}

#[test]
fn the_slicing_flags_show_in_the_policies() {
    let slicing = SharedSlicing {
        memory_granularity_bytes: 512 << 20,
        default_compute_percent: Some(25),
        max_slices_per_gpu: Some(8),
        sharing: None,
    };
    let features = Features {
        consumable_capacity: Some(slicing),
        partitionable_devices: false,
    };
    let slices = slices("l4:2", &features);
    assert_round_trips("profile l4:2", &slices);
    for gpu in devices(&slices) {
        let capacity = gpu.capacity.as_ref().unwrap();
        let memory = capacity["memory"].request_policy.as_ref().unwrap();
        assert_eq!(memory.valid_range.as_ref().unwrap().min.0, "512Mi");
        let compute = capacity["compute"].request_policy.as_ref().unwrap();
        assert_eq!(compute.default.as_ref().unwrap().0, "25");
        let shares = &capacity["slices"];
        assert_eq!(shares.value.0, "8");
        assert_eq!(
            shares.request_policy.as_ref().unwrap().valid_values,
            Some(vec![
                k8s_openapi::apimachinery::pkg::api::resource::Quantity("1".to_owned())
            ])
        );
    }
}

#[test]
fn a_granularity_no_gpu_can_hold_twice_fails_naming_the_device() {
    let features = Features {
        consumable_capacity: Some(SharedSlicing {
            memory_granularity_bytes: 16 << 30,
            ..default_slicing()
        }),
        partitionable_devices: false,
    };
    let inventory = kerf_core::mock::from_spec("l4").unwrap();
    let err = published_slices(&inventory, DRIVER, NODE, &features)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("gpu-0") && err.contains("granularity"),
        "{err}"
    );
}

#[test]
fn without_features_every_profile_prints_todays_slices() {
    for profile in kerf_core::mock::profile_names() {
        let inventory = kerf_core::mock::from_spec(profile).unwrap();
        let today = resource_slices(&inventory, DRIVER, NODE).unwrap();
        let printed = slices(profile, &Features::default());
        assert_eq!(printed, today, "profile {profile}");
        assert_round_trips(profile, &printed);
        assert!(
            devices(&printed).all(|d| d.allow_multiple_allocations.is_none()
                && d.consumes_counters.is_none()
                && string_attribute(d, "allocator").is_none()),
            "profile {profile}: a 1.36 field or an owner without features"
        );
    }
}
