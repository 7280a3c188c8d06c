//! Dynamic MIG: GPUs in MIG mode that kerf partitions on demand are published as a counter set
//! each and one device per MIG placement, when the API server keeps partitionable devices;
//! not at all otherwise (a GPU in MIG mode runs no CUDA work as a whole GPU).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{Counter, Device, ResourceSlice, ResourceSliceSpec};
use kerf_api::ownership::RECORD_ANNOTATION;
use kerf_api::quantity::quantity_bytes;
use kerf_api::resourceslice::limits::{
    MAX_OBJECT_BYTES, check_pool, check_slice, slice_json_bytes,
};
use kerf_api::resourceslice::{ResourceSliceFeatures, node_slices};
use kerf_core::inventory::{Gpu, Inventory, MigDevice};
use kerf_core::mig_catalog::{
    CatalogPlacement, counter_set_name, gpu_counters, placement_consumption,
};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::{DRIVER, NODE, SLICES, Setup, setup};

/// The dynamic-MIG profiles at 8 GPUs, the size figures' machines.
const PROFILES: [&str; 3] = [
    "a100-40gb-dynmig:8",
    "a100-80gb-dynmig",
    "h100-sxm-80gb-dynmig",
];

fn devices(slices: &[ResourceSlice]) -> Vec<Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .collect()
}

fn values(counters: &BTreeMap<String, Counter>) -> BTreeMap<String, u64> {
    counters
        .iter()
        // kerf's quantity parser refuses 0, which a counter may be (no encoders on A100).
        .map(|(name, c)| {
            let value = if c.value.0 == "0" {
                0
            } else {
                quantity_bytes(&c.value).unwrap()
            };
            (name.clone(), value)
        })
        .collect()
}

fn string<'a>(device: &'a Device, name: &str) -> Option<&'a str> {
    device.attributes.as_ref()?.get(name)?.string.as_deref()
}

fn int(device: &Device, name: &str) -> Option<i64> {
    device.attributes.as_ref()?.get(name)?.int
}

/// Writes the ownership record as kerf-controller does for dynamic-MIG GPUs: every device the
/// scheduler's.
async fn record_scheduler(s: &Setup, inventory: &Inventory) {
    let record: serde_json::Map<String, serde_json::Value> = inventory
        .gpus
        .iter()
        .map(|g| (g.device_name(), json!("scheduler")))
        .collect();
    let nodes: Api<Node> = Api::all(s.fake.client());
    let patch = json!({ "metadata": { "annotations": {
        RECORD_ANNOTATION: serde_json::Value::Object(record).to_string(),
    } } });
    nodes
        .patch(NODE, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
}

/// The attributes and capacities of one published placement of `gpu`.
fn check_placement_attributes(device: &Device, gpu: &Gpu, placement: CatalogPlacement<'_>) {
    assert_eq!(string(device, "type"), Some("mig"));
    assert_eq!(
        string(device, "profile"),
        Some(placement.profile.name.as_str())
    );
    assert_eq!(string(device, "parentUUID"), Some(gpu.uuid.as_str()));
    assert_eq!(int(device, "parentMinor"), Some(i64::from(gpu.minor)));
    assert_eq!(
        int(device, "placementStart"),
        Some(i64::from(placement.placement.start))
    );
    assert_eq!(
        int(device, "placementSize"),
        Some(i64::from(placement.placement.size))
    );
    assert_eq!(
        int(device, "giProfileId"),
        Some(i64::from(placement.profile.gi_profile_id))
    );
    assert_eq!(string(device, "uuid"), None, "not created yet");
    assert_eq!(
        string(device, "allocator"),
        Some("scheduler"),
        "{}",
        device.name
    );
    let capacity = device.capacity.as_ref().unwrap();
    assert_eq!(
        quantity_bytes(&capacity["memory"].value).unwrap(),
        placement.profile.memory_bytes()
    );
    assert_eq!(
        capacity["multiprocessors"].value.0,
        placement.profile.multiprocessors.to_string()
    );
}

#[tokio::test]
async fn every_dynamic_profile_publishes_counters_and_every_placement() {
    for profile in PROFILES {
        let s = setup();
        let inventory = kerf_core::mock::from_spec(profile).unwrap();
        record_scheduler(&s, &inventory).await;
        s.publisher().publish(&inventory).await.unwrap();
        let slices = s.slices();
        let specs: Vec<ResourceSliceSpec> = slices.iter().map(|s| s.spec.clone()).collect();
        for spec in &specs {
            check_slice(spec).unwrap();
            assert_eq!(spec.pool.resource_slice_count, 5, "{profile}");
            assert_eq!(spec.node_name.as_deref(), Some(NODE));
        }
        check_pool(&specs).unwrap();
        // 8 counter sets fit one slice; 25 placements per GPU, two GPUs per 64-device slice.
        let counter_slices: Vec<_> = specs
            .iter()
            .filter(|s| s.shared_counters.is_some())
            .collect();
        assert_eq!(counter_slices.len(), 1, "{profile}");
        assert!(counter_slices[0].devices.is_none());
        let sets: BTreeMap<String, BTreeMap<String, u64>> = counter_slices[0]
            .shared_counters
            .iter()
            .flatten()
            .map(|set| (set.name.clone(), values(&set.counters)))
            .collect();
        let published = devices(&slices);
        assert_eq!(published.len(), 8 * 25, "{profile}");
        for gpu in &inventory.gpus {
            let catalog = gpu.mig_catalog.as_ref().unwrap();
            let set_name = counter_set_name(gpu.minor);
            assert_eq!(sets[&set_name], gpu_counters(catalog), "{profile}");
            let consumption = |device: &Device| {
                let entries = device.consumes_counters.as_ref().unwrap();
                assert_eq!(entries.len(), 1);
                assert_eq!(entries[0].counter_set, set_name);
                values(&entries[0].counters)
            };
            assert!(
                published.iter().all(|d| d.name != gpu.device_name()),
                "{profile}: a GPU in MIG mode is not published whole"
            );
            for placement in catalog.placements() {
                let name = placement.device_name(gpu.minor);
                let device = published.iter().find(|d| d.name == name).unwrap();
                let consumed = consumption(device);
                assert_eq!(
                    consumed,
                    placement_consumption(placement.profile, placement.placement),
                    "{profile} {name}"
                );
                assert!(
                    consumed.iter().all(|(c, v)| *v <= sets[&set_name][c]),
                    "{name} fits its GPU alone"
                );
                check_placement_attributes(device, gpu, placement);
            }
        }
        // No GPU's devices are split across slices.
        for spec in specs.iter().filter(|s| s.devices.is_some()) {
            let devices = spec.devices.as_ref().unwrap();
            assert_eq!(devices.len(), 50, "{profile}");
            let sets: std::collections::BTreeSet<&str> = devices
                .iter()
                .flat_map(|d| d.consumes_counters.iter().flatten())
                .map(|c| c.counter_set.as_str())
                .collect();
            assert_eq!(sets.len(), 2);
        }
    }
}

#[tokio::test]
async fn placements_take_their_gpus_owner_whatever_the_record_says_of_them() {
    let s = setup();
    let inventory = kerf_core::mock::from_spec("a100-40gb-dynmig").unwrap();
    let nodes: Api<Node> = Api::all(s.fake.client());
    let record = json!({ "gpu-0": "scheduler", "gpu-0-mig-1g-5gb-0": "controller",
        "gpu-1": "controller" });
    let patch = json!({ "metadata": { "annotations": { RECORD_ANNOTATION: record.to_string() } } });
    nodes
        .patch(NODE, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
    s.publisher().publish(&inventory).await.unwrap();
    let published = devices(&s.slices());
    let owner = |name: &str| {
        let device = published.iter().find(|d| d.name == name).unwrap();
        string(device, "allocator").map(str::to_owned)
    };
    assert_eq!(owner("gpu-0-mig-1g-5gb-0").as_deref(), Some("scheduler"));
    assert_eq!(owner("gpu-0-mig-7g-40gb-0").as_deref(), Some("scheduler"));
    assert_eq!(owner("gpu-1-mig-3g-20gb-4").as_deref(), Some("controller"));
    assert_eq!(owner("gpu-2-mig-3g-20gb-4"), None, "gpu-2 is not recorded");
}

#[test]
fn created_instances_are_not_published_again_as_static_mig_devices() {
    let mut inventory = kerf_core::mock::from_spec("a100-40gb-dynmig").unwrap();
    let features = ResourceSliceFeatures {
        device_taints: false,
        partitionable_devices: true,
    };
    let before = node_slices(&inventory, DRIVER, NODE, features).unwrap();
    // kerf created 3g.20gb at 4 and 1g.5gb at 0 on GPU 0; discovery now lists them.
    let gpu = &mut inventory.gpus[0];
    for (profile, start, size, gi) in [("3g.20gb", 4, 4, 2), ("1g.5gb", 0, 1, 9)] {
        gpu.mig_devices.push(MigDevice {
            profile: profile.to_owned(),
            placement: kerf_core::inventory::MigPlacement { start, size },
            gi_id: gi,
            ci_id: 0,
            uuid: format!("MIG-{gi}"),
            memory_bytes: 1 << 30,
            multiprocessors: 14,
            gi_cap_minor: 30 + gi,
            ci_cap_minor: 31 + gi,
        });
    }
    let after = node_slices(&inventory, DRIVER, NODE, features).unwrap();
    assert_eq!(
        after, before,
        "the placements stay as they were, no duplicates"
    );
    // Without partitionable devices the GPUs, in MIG mode, are not published, and neither
    // are their instances.
    let plain = node_slices(&inventory, DRIVER, NODE, ResourceSliceFeatures::default()).unwrap();
    let names: Vec<String> = plain
        .iter()
        .flat_map(|s| s.devices.iter().flatten())
        .map(|d| d.name.clone())
        .collect();
    assert_eq!(names, Vec::<String>::new());
}

#[tokio::test]
async fn a_server_without_partitionable_devices_gets_no_dynamic_gpu_after_one_probe() {
    let s = setup();
    // Kubernetes 1.34/1.35 with the gate off: dropDisabledDRAPartitionableDevicesFields.
    s.fake.drop_field("resourceslices", "spec.sharedCounters");
    s.fake
        .drop_field("resourceslices", "spec.devices[].consumesCounters");
    let inventory = kerf_core::mock::from_spec("h100-sxm-80gb-dynmig").unwrap();
    let publisher = s.publisher();
    publisher.publish(&inventory).await.unwrap();
    assert_eq!(s.fake.count("POST", SLICES), 2, "one probe of two dry runs");
    let slices = s.slices();
    assert_eq!(slices.len(), 1);
    assert!(slices[0].spec.shared_counters.is_none());
    assert_eq!(
        devices(&slices).len(),
        0,
        "GPUs in MIG mode without instances offer nothing without partitionable devices"
    );
    publisher.publish(&inventory).await.unwrap();
    assert_eq!(s.fake.count("POST", SLICES), 2, "probed once");
}

#[tokio::test]
async fn no_probe_without_a_dynamic_mig_gpu() {
    let s = setup();
    for profile in ["h100-sxm-80gb", "a100-40gb-mig", "l4"] {
        s.publisher()
            .publish(&kerf_core::mock::from_spec(profile).unwrap())
            .await
            .unwrap();
    }
    assert_eq!(s.fake.count("POST", SLICES), 0);
}

/// The JSON size of each published slice of 8 dynamic-MIG GPUs, with the `allocator`
/// attribute the plugin adds (`--nocapture` prints the table).
#[test]
fn slices_of_eight_dynamic_mig_gpus_stay_far_below_the_object_limit() {
    let features = ResourceSliceFeatures {
        device_taints: false,
        partitionable_devices: true,
    };
    for profile in PROFILES {
        let inventory = kerf_core::mock::from_spec(profile).unwrap();
        let mut specs = node_slices(&inventory, DRIVER, NODE, features).unwrap();
        let record = kerf_api::ownership::OwnershipRecord(
            inventory
                .gpus
                .iter()
                .map(|g| (g.device_name(), kerf_api::ownership::Owner::Scheduler))
                .collect(),
        );
        kerf_api::ownership::publish_owners(&mut specs, &record);
        let mut total = 0;
        for (i, spec) in specs.iter().enumerate() {
            let bytes = slice_json_bytes(spec);
            total += bytes;
            let devices = spec.devices.as_ref().map_or(0, Vec::len);
            let sets = spec.shared_counters.as_ref().map_or(0, Vec::len);
            let counters: usize = spec
                .shared_counters
                .iter()
                .flatten()
                .map(|s| s.counters.len())
                .sum();
            let consumed: usize = spec
                .devices
                .iter()
                .flatten()
                .flat_map(|d| d.consumes_counters.iter().flatten())
                .map(|c| c.counters.len())
                .sum();
            println!(
                "{profile} slice {i}: {bytes} bytes, {devices} devices, {sets} counter sets of {counters} counters, {consumed} counter consumptions"
            );
            assert!(
                bytes < MAX_OBJECT_BYTES,
                "{profile} slice {i}: {bytes} bytes"
            );
        }
        println!("{profile}: {} slices, {total} bytes in all", specs.len());
    }
}
