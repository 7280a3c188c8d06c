//! Scheduler slices: GPUs named in the Node's shared publication and recorded as the
//! scheduler's are published shareable (consumable capacity) when the API server keeps it.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use kerf_api::ownership::RECORD_ANNOTATION;
use kerf_api::resourceslice::limits::{check_request_policy, check_slice};
use kerf_api::shared_publication::{
    SHARED_PUBLICATION_ANNOTATION, SharedPublication, SharedSlicing,
};
use kerf_core::inventory::{DeviceRef, Inventory};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::{NODE, Setup, setup};

const GI: u64 = 1 << 30;

/// The whole GPUs of `inventory` by published name, with memory and SMs.
fn whole_gpus(inventory: &Inventory) -> Vec<(String, u64, u32)> {
    inventory
        .devices()
        .filter_map(|d| match d {
            DeviceRef::Gpu(gpu) => Some((d.name(), gpu.memory_bytes, gpu.multiprocessors)),
            DeviceRef::Mig { .. } => None,
        })
        .collect()
}

/// Writes the ownership record and the shared publication as kerf-controller does.
async fn annotate(s: &Setup, record: &serde_json::Value, publication: &SharedPublication) {
    let nodes: Api<Node> = Api::all(s.fake.client());
    let patch = json!({ "metadata": { "annotations": {
        RECORD_ANNOTATION: record.to_string(),
        SHARED_PUBLICATION_ANNOTATION: publication.to_annotation_value(),
    } } });
    nodes
        .patch(NODE, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
}

fn slicing(max_slices: Option<u32>) -> SharedSlicing {
    SharedSlicing {
        memory_granularity_bytes: GI,
        default_compute_percent: Some(25),
        max_slices_per_gpu: max_slices,
        sharing: None,
    }
}

fn devices(slices: &[ResourceSlice]) -> Vec<Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .collect()
}

fn capacity(device: &Device, name: &str) -> serde_json::Value {
    serde_json::to_value(&device.capacity.as_ref().unwrap()[name]).unwrap()
}

#[tokio::test]
async fn every_mock_profile_publishes_its_gpus_shareable_within_the_api_rules() {
    for profile in kerf_core::mock::profile_names() {
        let s = setup();
        let inventory = kerf_core::mock::from_spec(profile).unwrap();
        let gpus = whole_gpus(&inventory);
        let record: serde_json::Map<String, serde_json::Value> = gpus
            .iter()
            .map(|(name, ..)| (name.clone(), json!("scheduler")))
            .collect();
        let mut publication = SharedPublication::default();
        for (i, (name, ..)) in gpus.iter().enumerate() {
            // Every other GPU with maxSlicesPerGpu, so both shapes are checked.
            let max = (i % 2 == 0).then_some(8);
            publication.0.insert(name.clone(), slicing(max));
        }
        annotate(&s, &json!(record), &publication).await;
        s.publisher().publish(&inventory).await.unwrap();

        let slices = s.slices();
        for slice in &slices {
            check_slice(&slice.spec).unwrap();
        }
        let published = devices(&slices);
        for (i, (name, memory, sms)) in gpus.iter().enumerate() {
            let device = published.iter().find(|d| &d.name == name).unwrap();
            assert_eq!(
                device.allow_multiple_allocations,
                Some(true),
                "{profile} {name}"
            );
            for (capacity_name, c) in device.capacity.as_ref().unwrap() {
                check_request_policy(capacity_name, true, c).unwrap();
            }
            let grid = format!("{}Gi", memory / GI);
            let memory_value = kerf_api::quantity::bytes_quantity(*memory).0;
            assert_eq!(
                capacity(device, "memory"),
                json!({ "value": memory_value, "requestPolicy": { "default": grid,
                    "validRange": { "min": "1Gi", "max": grid, "step": "1Gi" } } }),
                "{profile} {name}"
            );
            assert_eq!(
                capacity(device, "compute"),
                json!({ "value": "100", "requestPolicy": { "default": "25",
                    "validRange": { "min": "1", "max": "100", "step": "1" } } })
            );
            assert_eq!(
                capacity(device, "multiprocessors"),
                json!({ "value": sms.to_string(), "requestPolicy": { "default": "0",
                    "validValues": ["0"] } })
            );
            let slices_capacity = device.capacity.as_ref().unwrap().get("slices");
            if i % 2 == 0 {
                assert_eq!(
                    capacity(device, "slices"),
                    json!({ "value": "8", "requestPolicy": { "default": "1", "validValues": ["1"] } })
                );
            } else {
                assert!(slices_capacity.is_none());
            }
            let attributes = device.attributes.as_ref().unwrap();
            assert_eq!(attributes["allocator"].string.as_deref(), Some("scheduler"));
            assert_eq!(attributes["type"].string.as_deref(), Some("gpu"));
        }
        // MIG devices are never shareable.
        for device in published.iter().filter(|d| d.name.contains("-mig-")) {
            assert_eq!(device.allow_multiple_allocations, None, "{}", device.name);
        }
    }
}

#[tokio::test]
async fn only_the_schedulers_gpus_named_in_the_publication_are_shareable() {
    let s = setup();
    let inventory = kerf_core::mock::from_spec("h100-sxm-80gb").unwrap();
    let mut publication = SharedPublication::default();
    publication.0.insert("gpu-0".into(), slicing(None));
    publication.0.insert("gpu-1".into(), slicing(None));
    annotate(
        &s,
        &json!({ "gpu-0": "scheduler", "gpu-1": "controller", "gpu-2": "scheduler" }),
        &publication,
    )
    .await;
    s.publisher().publish(&inventory).await.unwrap();
    let shareable: Vec<String> = devices(&s.slices())
        .into_iter()
        .filter(|d| d.allow_multiple_allocations == Some(true))
        .map(|d| d.name)
        .collect();
    assert_eq!(shareable, ["gpu-0"]);
}

#[tokio::test]
async fn a_server_without_consumable_capacity_gets_whole_gpus() {
    let s = setup();
    // Kubernetes 1.34/1.35 (gate off): dropDisabledDRAConsumableCapacityFields.
    s.fake
        .drop_field("resourceslices", "spec.devices[].allowMultipleAllocations");
    let inventory = kerf_core::mock::from_spec("h100-sxm-80gb").unwrap();
    let mut publication = SharedPublication::default();
    publication.0.insert("gpu-0".into(), slicing(Some(4)));
    annotate(&s, &json!({ "gpu-0": "scheduler" }), &publication).await;
    let dry_runs_before = s.fake.count("POST", super::SLICES);
    s.publisher().publish(&inventory).await.unwrap();
    assert_eq!(
        s.fake.count("POST", super::SLICES),
        dry_runs_before + 1,
        "one probe"
    );
    let published = devices(&s.slices());
    let gpu0 = published.iter().find(|d| d.name == "gpu-0").unwrap();
    assert_eq!(gpu0.allow_multiple_allocations, None);
    let capacities = gpu0.capacity.as_ref().unwrap();
    assert!(capacities.values().all(|c| c.request_policy.is_none()));
    assert_eq!(
        capacities.keys().collect::<Vec<_>>(),
        ["memory", "multiprocessors"]
    );
}

#[tokio::test]
async fn no_probe_while_no_gpu_is_shared() {
    let s = setup();
    s.publisher()
        .publish(&kerf_core::mock::from_spec("h100-sxm-80gb").unwrap())
        .await
        .unwrap();
    assert_eq!(s.fake.count("POST", super::SLICES), 0);
}
