//! The GpuClass status counts of scheduler slices: which GPUs a class counts (a sliced
//! Scheduler class only those published shareable, a whole-GPU Scheduler class only the
//! others, as their DeviceClasses select) and what shares of a shareable GPU use (their
//! consumed memory and compute, all of the GPU for a share of its whole memory).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a failed unwrap is a failed test"
)]

use std::sync::Arc;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_api::params::{Allocator, GpuClassParameters, GpuSelector};
use kerf_api::resourceslice::scheduler_slices::publish_shared;
use kerf_api::shared_publication::{SharedPublication, SharedSlicing};
use kerf_api::{GpuClassSpec, Slicing};
use kerf_controller::cache::CompactResourceSlice;
use kerf_controller::capacity::{
    ClassScope, MemoryUse, Shareable, class_capacity, current_devices, free_compute_gpus,
    memory_in_use,
};
use kerf_controller::selector::DeviceSelector;
use kube::api::ObjectMeta;
use serde_json::json;

const DRIVER: &str = "gpu.kerf.dev";
const NODE: &str = "n";
const GIB: u64 = 1 << 30;

/// Four mock H100s on one node, `gpu-0` and `gpu-1` published shareable as the plugin
/// publishes the GPUs of the Node's shared publication that the scheduler owns.
fn slices() -> Vec<Arc<CompactResourceSlice>> {
    let inventory = kerf_core::mock::from_spec("h100-sxm-80gb:4").unwrap();
    let mut specs = kerf_api::resource_slices(&inventory, DRIVER, NODE).unwrap();
    let record = kerf_api::ownership::OwnershipRecord::parse(
        &json!({"gpu-0": "scheduler", "gpu-1": "scheduler", "gpu-2": "scheduler", "gpu-3": "scheduler"})
            .to_string(),
    )
    .unwrap();
    let mut publication = SharedPublication::default();
    for gpu in ["gpu-0", "gpu-1"] {
        publication.0.insert(
            gpu.to_owned(),
            SharedSlicing {
                memory_granularity_bytes: GIB,
                default_compute_percent: Some(25),
                max_slices_per_gpu: None,
                sharing: None,
            },
        );
    }
    let errors = publish_shared(&mut specs, &record, &publication);
    assert!(errors.is_empty(), "{errors:?}");
    specs
        .into_iter()
        .map(|spec| {
            Arc::new(CompactResourceSlice::from(ResourceSlice {
                metadata: ObjectMeta::default(),
                spec,
            }))
        })
        .collect()
}

fn params(allocator: Allocator, sliced: bool) -> GpuClassParameters {
    GpuClassSpec {
        allocator,
        selector: GpuSelector::default(),
        slicing: sliced.then(|| Slicing {
            memory_granularity: Quantity("1Gi".to_owned()),
            max_slices_per_gpu: None,
            default_compute: Some(25),
        }),
        ..GpuClassSpec::default()
    }
    .parameters()
}

fn share_claim(device: &str, share: &str, memory: &str, compute: &str) -> Arc<ResourceClaim> {
    Arc::new(
        serde_json::from_value(json!({
            "metadata": {"name": share, "namespace": "ns"},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": [{
                "request": "gpu", "driver": DRIVER, "pool": NODE, "device": device,
                "shareID": share,
                "consumedCapacity": {"memory": memory, "compute": compute, "multiprocessors": "0"},
            }]}}},
        }))
        .unwrap(),
    )
}

#[test]
fn a_class_counts_the_gpus_its_device_class_selects() {
    let all = slices();
    let devices = current_devices(&all, DRIVER);
    let count = |allocator, sliced, consumable| {
        let params = params(allocator, sliced);
        let selector = DeviceSelector::new(&params, "spec").unwrap();
        let scope = ClassScope::of_class(&selector, &params, consumable);
        let counted = class_capacity(&scope, &devices, &MemoryUse::default(), DRIVER);
        (scope.shareable, counted.matching_devices)
    };
    assert_eq!(
        count(Allocator::Scheduler, true, true),
        (Shareable::Only, 2)
    );
    assert_eq!(
        count(Allocator::Scheduler, false, true),
        (Shareable::Excluded, 2)
    );
    assert_eq!(
        count(Allocator::Scheduler, true, false),
        (Shareable::Nothing, 0)
    );
    assert_eq!(
        count(Allocator::Scheduler, false, false),
        (Shareable::Any, 4)
    );
    assert_eq!(
        count(Allocator::Controller, false, true),
        (Shareable::Any, 4)
    );
}

#[test]
fn shares_use_their_consumed_memory_and_compute_and_a_whole_memory_share_all_of_the_gpu() {
    let all = slices();
    let devices = current_devices(&all, DRIVER);
    let memory = kerf_api::resourceslice::device_memory_bytes(devices[0].device, DRIVER).unwrap();
    let grid = format!("{}Gi", memory / GIB);
    let claims = vec![
        share_claim("gpu-0", "s1", "10Gi", "30"),
        share_claim("gpu-0", "s2", "20Gi", "20"),
        // What a request without capacity.requests consumes: the memory policy's default.
        share_claim("gpu-1", "s3", &grid, "25"),
    ];
    let params = params(Allocator::Scheduler, true);
    let selector = DeviceSelector::new(&params, "spec").unwrap();
    let scope = ClassScope::of_class(&selector, &params, true);
    let usage = memory_in_use(&devices, &claims, DRIVER);
    assert_eq!(usage.used(NODE, "gpu-0"), 30 * GIB);
    assert_eq!(usage.used(NODE, "gpu-1"), memory);
    let capacity = class_capacity(&scope, &devices, &usage, DRIVER);
    assert_eq!(capacity.matching_devices, 2);
    assert_eq!(capacity.total_memory_bytes, 2 * memory);
    assert_eq!(capacity.free_memory_bytes, memory - 30 * GIB);
    let free = free_compute_gpus(&scope, &devices, &claims, DRIVER);
    assert!((free - 0.5).abs() < 1e-9, "{free}");
}
