//! Hand-written ResourceSlices for scheduler slices and dynamic MIG in the shape kerf publishes
//! them (not the plugin's publication itself; the dynamic-MIG GPU also has the full-GPU device
//! NVIDIA's driver publishes), the DeviceClasses kerf's GpuClass reconciler
//! makes on a cluster with DRAConsumableCapacity, claims with capacity requests and
//! constraints, and the independent checks of what the claims in the API hold.

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_api::params::{Allocator, GpuSelector};
use kerf_api::{GpuClass, GpuClassSpec, Slicing};
use kerf_scheduler_standin::cel::CelQuantity;
use kerf_tests::fake_api::FakeApi;
use serde_json::{Value, json};

use super::{DRIVER, NS};

/// A sliced Scheduler class: shares of shareable GPUs.
pub const SHARED: &str = "shared";
/// A whole-GPU Scheduler class: GPUs that are not shareable.
pub const WHOLE_GPU: &str = "whole-gpu";
/// A Scheduler class for MIG profile 1g.5gb.
pub const MIG_1G: &str = "mig-1g";
/// A Scheduler class for MIG profile 3g.20gb.
pub const MIG_3G: &str = "mig-3g";

/// The DeviceClass kerf's GpuClass reconciler makes of a Scheduler class on a cluster that
/// serves DRAConsumableCapacity.
pub fn scheduler_class(fake: &FakeApi, name: &str, selector: GpuSelector, sliced: bool) {
    let mut class = GpuClass::new(
        name,
        GpuClassSpec {
            allocator: Allocator::Scheduler,
            selector,
            slicing: sliced.then(|| Slicing {
                memory_granularity: Quantity("1Gi".to_owned()),
                max_slices_per_gpu: None,
                default_compute: None,
            }),
            placement: None,
            sharing: None,
            extended_resource_name: None,
        },
    );
    class.metadata.uid = Some(format!("uid-{name}"));
    let dc = kerf_controller::deviceclass::device_class(&class, DRIVER, "kerf-controller", true)
        .unwrap();
    fake.insert_resource::<DeviceClass>(&dc);
}

/// All four classes.
pub fn classes(fake: &FakeApi) {
    scheduler_class(fake, SHARED, GpuSelector::default(), true);
    scheduler_class(fake, WHOLE_GPU, GpuSelector::default(), false);
    for (name, profile) in [(MIG_1G, "1g.5gb"), (MIG_3G, "3g.20gb")] {
        let selector = GpuSelector {
            mig_profile: Some(profile.to_owned()),
            ..GpuSelector::default()
        };
        scheduler_class(fake, name, selector, false);
    }
}

fn string(value: &str) -> Value {
    json!({"string": value})
}

/// A GPU published for scheduler slices: memory defaults to all of it,
/// compute to 100 %, multiprocessors are visible but never consumed.
pub fn shareable_gpu(minor: u32, memory_gi: u32) -> Value {
    let memory = format!("{memory_gi}Gi");
    json!({
        "name": format!("gpu-{minor}"),
        "allowMultipleAllocations": true,
        "attributes": {
            "type": string("gpu"),
            "uuid": string(&format!("GPU-{minor}")),
            "allocator": string("scheduler"),
        },
        "capacity": {
            "memory": {"value": memory, "requestPolicy": {"default": memory,
                "validRange": {"min": "1Gi", "max": memory, "step": "1Gi"}}},
            "compute": {"value": "100", "requestPolicy": {"default": "100",
                "validRange": {"min": "1", "max": "100", "step": "1"}}},
            "multiprocessors": {"value": "132", "requestPolicy": {"default": "0", "validValues": ["0"]}},
        },
    })
}

/// MIG placements of the stand-in's dynamic-MIG GPU: (profile, sanitized name, size in
/// memory slices, compute slices, starts), A100-40GB shaped (NVIDIA MIG user guide,
/// "Supported MIG Profiles").
pub const PLACEMENTS: [(&str, &str, u32, u32, &[u32]); 3] = [
    ("1g.5gb", "1g-5gb", 1, 1, &[0, 1, 2, 3, 4, 5, 6]),
    ("2g.10gb", "2g-10gb", 2, 2, &[0, 2, 4]),
    ("3g.20gb", "3g-20gb", 4, 3, &[0, 4]),
];

/// The counter set of a dynamic-MIG GPU: one counter per memory slice and the compute
/// slices.
pub fn counter_set(minor: u32) -> Value {
    let mut counters = serde_json::Map::new();
    for slice in 0..8 {
        counters.insert(format!("memory-slice-{slice}"), json!({"value": "1"}));
    }
    counters.insert("compute-slices".to_owned(), json!({"value": "7"}));
    json!({"name": format!("gpu-{minor}"), "counters": counters})
}

/// The full GPU (consumes every counter) and one device per placement of a dynamic-MIG
/// GPU.
pub fn dynamic_mig_devices(minor: u32) -> Vec<Value> {
    let set = format!("gpu-{minor}");
    let mut all = serde_json::Map::new();
    for slice in 0..8 {
        all.insert(format!("memory-slice-{slice}"), json!({"value": "1"}));
    }
    all.insert("compute-slices".to_owned(), json!({"value": "7"}));
    let mut devices = vec![json!({
        "name": format!("gpu-{minor}"),
        "attributes": {"type": string("gpu"), "uuid": string(&format!("GPU-{minor}")),
                       "allocator": string("scheduler")},
        "consumesCounters": [{"counterSet": set, "counters": all}],
    })];
    for (profile, sanitized, size, compute, starts) in PLACEMENTS {
        for start in starts {
            let mut counters = serde_json::Map::new();
            for slice in *start..start + size {
                counters.insert(format!("memory-slice-{slice}"), json!({"value": "1"}));
            }
            counters.insert(
                "compute-slices".to_owned(),
                json!({"value": compute.to_string()}),
            );
            devices.push(json!({
                "name": format!("gpu-{minor}-mig-{sanitized}-{start}"),
                "attributes": {
                    "type": string("mig"), "profile": string(profile),
                    "parentUUID": string(&format!("GPU-{minor}")), "allocator": string("scheduler"),
                    "placementStart": {"int": start}, "placementSize": {"int": size},
                },
                "consumesCounters": [{"counterSet": set, "counters": counters}],
            }));
        }
    }
    devices
}

/// One ResourceSlice of `node`'s pool: `index` of `count`, with `devices` or counter sets.
pub fn slice(fake: &FakeApi, node: &str, index: usize, count: usize, content: Value) {
    let mut spec = json!({
        "driver": DRIVER,
        "nodeName": node,
        "pool": {"name": node, "generation": 1, "resourceSliceCount": count},
    });
    if let (Some(spec), Value::Object(content)) = (spec.as_object_mut(), content) {
        spec.extend(content);
    }
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": format!("{node}-{DRIVER}-{index}")},
        "spec": spec,
    }));
}

/// A claim with `requests` (each `{"name", "exactly"}`) and `constraints`.
pub fn claim_with(fake: &FakeApi, name: &str, requests: Value, constraints: Value) {
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": requests, "constraints": constraints}},
    }));
}

/// One request of `class`; `capacity` (e.g. `{"memory": "10Gi"}`) if not null.
pub fn request(name: &str, class: &str, capacity: Value) -> Value {
    let mut exactly = json!({"deviceClassName": class, "allocationMode": "ExactCount", "count": 1});
    if !capacity.is_null() {
        exactly["capacity"] = json!({"requests": capacity});
    }
    json!({"name": name, "exactly": exactly})
}

/// A claim of one device of `class` with `capacity` requests.
pub fn share_claim(fake: &FakeApi, name: &str, class: &str, capacity: Value) {
    claim_with(
        fake,
        name,
        json!([request("gpu", class, capacity)]),
        json!([]),
    );
}

fn nanos(quantity: &Quantity) -> i128 {
    CelQuantity::parse(&quantity.0).unwrap().nanos()
}

/// The results of a claim's allocation: (device, shareID, consumedCapacity as text).
pub fn results_of(
    claim: &ResourceClaim,
) -> Vec<(String, Option<String>, BTreeMap<String, String>)> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|r| {
            let consumed = r
                .consumed_capacity
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.0))
                .collect();
            (r.device, r.share_id, consumed)
        })
        .collect()
}

/// Checks, independently of the stand-in, that the allocations of all claims in the API
/// respect every device's exclusivity, capacity and counters; panics naming the breach.
pub fn check_allocations(fake: &FakeApi) {
    type Key = (String, String);
    let slices: Vec<ResourceSlice> = fake.list_resources::<ResourceSlice>(None);
    let claims: Vec<ResourceClaim> = fake.list_resources::<ResourceClaim>(Some(NS));
    let mut devices = HashMap::new();
    let mut available: HashMap<(String, String, String), i128> = HashMap::new();
    for slice in &slices {
        let pool = &slice.spec.pool.name;
        for set in slice.spec.shared_counters.iter().flatten() {
            for (name, counter) in &set.counters {
                let key = (pool.clone(), set.name.clone(), name.clone());
                available.insert(key, nanos(&counter.value));
            }
        }
        for device in slice.spec.devices.iter().flatten() {
            devices.insert((pool.clone(), device.name.clone()), device.clone());
        }
    }
    let mut exclusive: HashSet<Key> = HashSet::new();
    let mut shared: HashMap<Key, HashMap<String, i128>> = HashMap::new();
    let mut holders: HashMap<Key, usize> = HashMap::new();
    let results = claims
        .iter()
        .filter_map(|c| c.status.as_ref()?.allocation.as_ref()?.devices.as_ref())
        .flat_map(|d| d.results.iter().flatten());
    for result in results {
        let key = (result.pool.clone(), result.device.clone());
        *holders.entry(key.clone()).or_default() += 1;
        if result.share_id.is_none() {
            assert!(
                exclusive.insert(key.clone()),
                "{key:?} held exclusively twice"
            );
            continue;
        }
        let spec = &devices[&key];
        assert_eq!(
            spec.allow_multiple_allocations,
            Some(true),
            "share of {key:?}"
        );
        let sum = shared.entry(key).or_default();
        for (name, amount) in result.consumed_capacity.iter().flatten() {
            *sum.entry(name.clone()).or_default() += nanos(amount);
        }
    }
    for key in &exclusive {
        assert_eq!(holders[key], 1, "{key:?} exclusive and shared");
    }
    for (key, sum) in &shared {
        for (name, capacity) in devices[key].capacity.iter().flatten() {
            let used = sum.get(name).copied().unwrap_or(0);
            assert!(
                used <= nanos(&capacity.value),
                "{key:?} {name}: {used} > {capacity:?}"
            );
        }
    }
    // Each allocated device consumes its counters once, however many shares it has.
    for key in holders.keys() {
        for consumption in devices[key].consumes_counters.iter().flatten() {
            for (name, counter) in &consumption.counters {
                let counter_key = (key.0.clone(), consumption.counter_set.clone(), name.clone());
                *available.get_mut(&counter_key).unwrap() -= nanos(&counter.value);
            }
        }
    }
    for (key, left) in &available {
        assert!(*left >= 0, "counter {key:?} overdrawn by {}", -left);
    }
}
