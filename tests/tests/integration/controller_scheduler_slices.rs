//! Scheduler slices, the controller's half: the DeviceClass CEL of sliced and whole
//! Scheduler classes, their Ready condition, the shared publication the ownership tick writes
//! on each Node (`gpu.kerf.dev/shared-publication`), the inventory view of shareable and
//! dynamic-MIG devices, and seeded interleavings of class, ownership and share changes.
#![allow(
    clippy::needless_pass_by_value,
    reason = "fixtures take JSON values as the tests write them inline"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use claim_cluster::{Controller, DRIVER, NS, device_class_of, node, slices};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    CounterSet, Device, DeviceClass, DeviceCounterConsumption, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_api::features::Probed;
use kerf_api::ownership::OwnershipRecord;
use kerf_api::params::{Allocator, GpuSelector};
use kerf_api::shared_publication::{SHARED_PUBLICATION_ANNOTATION, SharedPublication};
use kerf_api::{GpuClass, GpuClassSpec, Slicing};
use kerf_controller::ControllerConfig;
use kerf_controller::features::ApiSupport;
use kerf_controller::gpuclass::{ClassContext, reasons, reconcile};
use kerf_tests::fake_api::FakeApi;
use kube::api::{ObjectMeta, Patch, PatchParams};
use serde_json::json;

use crate::common::claim_cluster;
use crate::common::controller::Watched;

const H100: &str = "NVIDIA H100 80GB HBM3";
const GPUS: usize = 8;

fn sliced_spec(default_compute: u8, product: bool) -> GpuClassSpec {
    GpuClassSpec {
        allocator: Allocator::Scheduler,
        selector: GpuSelector {
            product_names: if product {
                vec![H100.to_owned()]
            } else {
                Vec::new()
            },
            ..GpuSelector::default()
        },
        slicing: Some(Slicing {
            memory_granularity: Quantity("1Gi".to_owned()),
            max_slices_per_gpu: None,
            default_compute: Some(default_compute),
        }),
        ..GpuClassSpec::default()
    }
}

fn expression(dc: &DeviceClass) -> String {
    dc.spec.selectors.as_ref().unwrap()[0]
        .cel
        .as_ref()
        .unwrap()
        .expression
        .clone()
}

/// A GpuClass reconciler context over `fake`, with `support`.
async fn class_context(fake: &FakeApi, support: ApiSupport) -> Arc<ClassContext> {
    let watched = Watched::start(fake, ControllerConfig::new(DRIVER)).await;
    let core = Arc::new(watched.context.with_api_support(support));
    Arc::new(ClassContext::new(core))
}

fn ready_of(fake: &FakeApi, name: &str) -> (String, String, String) {
    let class: GpuClass = fake.get_resource(None, name).unwrap();
    let c = class.status.as_ref().and_then(|s| s.ready()).unwrap();
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

#[tokio::test]
async fn device_classes_of_sliced_and_whole_scheduler_classes() {
    let sliced = expression(&device_class_of("sliced", sliced_spec(25, true)));
    assert!(
        sliced.ends_with(r#".allocator == "scheduler" && device.allowMultipleAllocations"#),
        "{sliced}"
    );
    let whole = expression(&device_class_of(
        "whole",
        GpuClassSpec {
            slicing: None,
            ..sliced_spec(25, true)
        },
    ));
    assert!(
        whole.ends_with(r#".allocator == "scheduler" && !device.allowMultipleAllocations"#),
        "{whole}"
    );

    // Through the reconciler: on 1.36 the class is ready and says what it needs; without the
    // feature it is not ready and its DeviceClass selects nothing.
    // The class counts only GPUs published shareable, as its DeviceClass selects.
    let fake = FakeApi::new();
    shareable_slices(&fake, "node-0");
    fake.insert_resource(&GpuClass::new("sliced", sliced_spec(25, true)));
    let ctx = class_context(&fake, ApiSupport::all_served()).await;
    let class: GpuClass = fake.get_resource(None, "sliced").unwrap();
    reconcile(Arc::new(class), ctx).await.unwrap();
    let (status, reason, message) = ready_of(&fake, "sliced");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", reasons::DEVICE_CLASS_APPLIED)
    );
    assert!(message.contains("DRAConsumableCapacity"), "{message}");
    let dc: DeviceClass = fake.get_resource(None, "sliced").unwrap();
    assert!(expression(&dc).ends_with("&& device.allowMultipleAllocations"));

    let old = FakeApi::new();
    slices(&old, "node-0");
    old.insert_resource(&GpuClass::new("sliced", sliced_spec(25, true)));
    let support = ApiSupport {
        consumable_capacity: Probed::Dropped,
        ..ApiSupport::all_served()
    };
    let ctx = class_context(&old, support).await;
    let class: GpuClass = old.get_resource(None, "sliced").unwrap();
    reconcile(Arc::new(class), ctx).await.unwrap();
    let (status, reason, message) = ready_of(&old, "sliced");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", reasons::CONSUMABLE_CAPACITY_UNAVAILABLE)
    );
    assert!(
        message.contains("1.36") && message.contains("DRAConsumableCapacity"),
        "{message}"
    );
    let dc: DeviceClass = old.get_resource(None, "sliced").unwrap();
    assert_eq!(
        expression(&dc),
        kerf_controller::selector::unavailable_cel(DRIVER)
    );
}

/// [`slices`] with every device published shareable, as the plugin publishes GPUs the
/// Node's shared publication names.
fn shareable_slices(fake: &FakeApi, node: &str) {
    let inventory = kerf_core::mock::from_spec("h100-sxm-80gb").unwrap();
    let specs = kerf_api::resource_slices(&inventory, DRIVER, node).unwrap();
    for (i, mut spec) in specs.into_iter().enumerate() {
        for device in spec.devices.iter_mut().flatten() {
            device.allow_multiple_allocations = Some(true);
        }
        fake.insert_resource(&ResourceSlice {
            metadata: ObjectMeta {
                name: Some(kerf_api::slice_name(node, DRIVER, i)),
                ..ObjectMeta::default()
            },
            spec,
        });
    }
}

#[tokio::test]
async fn conflicting_sliced_classes_are_not_ready_and_name_the_gpu() {
    let fake = FakeApi::new();
    slices(&fake, "node-0");
    for (name, compute) in [("a", 25), ("b", 50)] {
        let spec = sliced_spec(compute, name == "a");
        let class = fake.insert_resource(&GpuClass::new(name, spec));
        // The DeviceClass as the reconciler wrote it, owned by the stored class.
        let dc =
            kerf_controller::deviceclass::device_class(&class, DRIVER, "kerf-controller", true)
                .unwrap();
        fake.insert_resource(&dc);
    }
    let ctx = class_context(&fake, ApiSupport::all_served()).await;
    for name in ["a", "b"] {
        let class: GpuClass = fake.get_resource(None, name).unwrap();
        reconcile(Arc::new(class), ctx.clone()).await.unwrap();
        let (status, reason, message) = ready_of(&fake, name);
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("False", reasons::CONFLICTING_SLICING)
        );
        assert!(
            message.contains("node-0/gpu-0") && message.contains("node-0/gpu-7"),
            "{message}"
        );
    }
}

fn scheduler_sliced_cluster(label: &str) -> FakeApi {
    let fake = FakeApi::new();
    node(
        &fake,
        "node-0",
        json!({"gpu.kerf.dev/allocator": label}),
        json!([]),
        true,
    );
    slices(&fake, "node-0");
    fake
}

fn node_of(fake: &FakeApi) -> Node {
    fake.get_resource(None, "node-0").unwrap()
}

fn publication(fake: &FakeApi) -> SharedPublication {
    SharedPublication::from_annotations(node_of(fake).metadata.annotations.as_ref()).unwrap()
}

fn record(fake: &FakeApi) -> OwnershipRecord {
    OwnershipRecord::from_annotations(node_of(fake).metadata.annotations.as_ref()).unwrap()
}

async fn eventually_publication(fake: &FakeApi, what: &str, want: &BTreeSet<String>) {
    kerf_tests::wait::eventually(what, Duration::from_secs(20), || async {
        let names: BTreeSet<String> = publication(fake).0.keys().cloned().collect();
        (&names == want && record(fake).0.len() == GPUS).then_some(())
    })
    .await;
}

fn all_gpus() -> BTreeSet<String> {
    (0..GPUS).map(|i| format!("gpu-{i}")).collect()
}

#[tokio::test]
async fn the_publication_names_selected_scheduler_gpus_and_is_written_once() {
    let fake = scheduler_sliced_cluster("scheduler");
    fake.insert_resource(&device_class_of("sliced", sliced_spec(25, true)));
    let controller = Controller::start(&fake);
    eventually_publication(&fake, "all eight GPUs shared", &all_gpus()).await;
    let entry = &publication(&fake).0["gpu-3"];
    assert_eq!(entry.memory_granularity_bytes, 1 << 30);
    assert_eq!(entry.default_compute_percent, Some(25));
    // The node's other write: kerf's taint, its GPUs being idle.
    kerf_tests::wait::eventually("kerf's idle-GPU taint", Duration::from_secs(20), || async {
        let node = node_of(&fake);
        let taints = node.spec.and_then(|spec| spec.taints).unwrap_or_default();
        taints
            .iter()
            .any(|taint| taint.key == kerf_core::alloc::IDLE_GPUS_TAINT_KEY)
            .then_some(())
    })
    .await;
    let patches = fake.count("PATCH", "/api/v1/nodes/node-0");
    // Many ticks later (20 ms each) nothing was written again: nothing changed.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(fake.count("PATCH", "/api/v1/nodes/node-0"), patches);
    // A second class slicing alike changes nothing; one slicing differently shares nothing.
    fake.insert_resource(&device_class_of("alike", sliced_spec(25, false)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(publication(&fake).0.len(), GPUS);
    fake.insert_resource(&device_class_of("other", sliced_spec(50, false)));
    eventually_publication(&fake, "conflicting GPUs published whole", &BTreeSet::new()).await;
    controller.stop().await;
}

#[tokio::test]
async fn controller_gpus_are_never_shared() {
    let fake = scheduler_sliced_cluster("controller");
    fake.insert_resource(&device_class_of("sliced", sliced_spec(25, true)));
    let controller = Controller::start(&fake);
    kerf_tests::wait::eventually("the record", Duration::from_secs(20), || async {
        (record(&fake).0.len() == GPUS).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(publication(&fake).0.is_empty());
    let annotations = node_of(&fake).metadata.annotations.unwrap_or_default();
    assert!(
        !annotations.contains_key(SHARED_PUBLICATION_ANNOTATION),
        "{annotations:?}"
    );
    controller.stop().await;
}

fn share_claim(fake: &FakeApi, name: &str, gpu: &str) {
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}")},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "sliced"}}]}},
        "status": {"allocation": {"devices": {"results": [{
            "request": "gpu", "driver": DRIVER, "pool": "node-0", "device": gpu,
            "shareID": format!("00000000-0000-4000-8000-{:012}", name.len()),
            "consumedCapacity": {"memory": "10Gi", "compute": "30"},
        }]}}},
    }));
}

async fn set_label(fake: &FakeApi, value: &str) {
    let nodes: kube::Api<Node> = kube::Api::all(fake.client());
    let patch = json!({"metadata": {"labels": {"gpu.kerf.dev/allocator": value}}});
    nodes
        .patch("node-0", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// A small deterministic generator (xorshift64*), so a failing seed replays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// The state the test drives, and what the controller must make of it.
#[derive(Debug, Default)]
struct Model {
    label_scheduler: bool,
    /// Class name → default compute.
    classes: BTreeMap<&'static str, u8>,
    /// Share claim name → GPU.
    shares: BTreeMap<String, String>,
}

impl Model {
    fn owner_is_scheduler(&self, gpu: &str) -> bool {
        self.label_scheduler || self.shares.values().any(|g| g == gpu)
    }

    fn expected(&self) -> BTreeSet<String> {
        let computes: BTreeSet<u8> = self.classes.values().copied().collect();
        if computes.len() != 1 {
            return BTreeSet::new();
        }
        all_gpus()
            .into_iter()
            .filter(|g| self.owner_is_scheduler(g))
            .collect()
    }
}

#[tokio::test]
async fn seeded_interleavings_end_in_the_final_state_and_never_move_a_shared_gpu() {
    for seed in [7_u64, 1_234_567, 0x5eed_f00d] {
        let mut rng = Rng(seed);
        let fake = scheduler_sliced_cluster("scheduler");
        let mut model = Model {
            label_scheduler: true,
            ..Model::default()
        };
        let controller = Controller::start(&fake);
        let mut next_claim = 0;
        for step in 0..14 {
            match rng.below(5) {
                0 => {
                    let name = ["a", "b"][usize::try_from(rng.below(2)).unwrap()];
                    if model.classes.remove(name).is_some() {
                        fake.remove(&format!("/apis/resource.k8s.io/v1/deviceclasses/{name}"));
                    } else {
                        let compute = [25, 50][usize::try_from(rng.below(2)).unwrap()];
                        model.classes.insert(name, compute);
                        fake.insert_resource(&device_class_of(
                            name,
                            sliced_spec(compute, name == "a"),
                        ));
                    }
                }
                1 => {
                    model.label_scheduler = !model.label_scheduler;
                    let value = if model.label_scheduler {
                        "scheduler"
                    } else {
                        "controller"
                    };
                    set_label(&fake, value).await;
                }
                2 | 3 => {
                    // kube-scheduler allocates a share of a GPU published as shareable.
                    let shared: Vec<String> = publication(&fake).0.keys().cloned().collect();
                    if !shared.is_empty() {
                        let gpu = shared[usize::try_from(rng.below(shared.len() as u64)).unwrap()]
                            .clone();
                        next_claim += 1;
                        let name = format!("share-{next_claim}");
                        share_claim(&fake, &name, &gpu);
                        model.shares.insert(name, gpu);
                    }
                }
                _ => {
                    let names: Vec<String> = model.shares.keys().cloned().collect();
                    if !names.is_empty() {
                        let name =
                            names[usize::try_from(rng.below(names.len() as u64)).unwrap()].clone();
                        fake.remove(&format!("{}/{name}", claim_cluster::CLAIMS));
                        model.shares.remove(&name);
                    }
                }
            }
            let want = model.expected();
            kerf_tests::wait::eventually(
                &format!("seed {seed} step {step}: publication {want:?}"),
                Duration::from_secs(20),
                || async {
                    let names: BTreeSet<String> = publication(&fake).0.keys().cloned().collect();
                    let record = record(&fake);
                    let owners_ok = all_gpus().iter().all(|g| {
                        let scheduler =
                            record.owner(g) == Some(kerf_api::ownership::Owner::Scheduler);
                        scheduler == model.owner_is_scheduler(g)
                    });
                    (names == want && owners_ok).then_some(())
                },
            )
            .await;
            // No GPU holding a share is the controller's, whatever the label says.
            let record = record(&fake);
            for gpu in model.shares.values() {
                assert_eq!(
                    record.owner(gpu),
                    Some(kerf_api::ownership::Owner::Scheduler),
                    "seed {seed} step {step}: {gpu} holds a share"
                );
            }
        }
        controller.stop().await;
    }
}

fn gpu_device(name: &str) -> Device {
    let inventory = kerf_core::mock::from_spec("h100-sxm-80gb:1").unwrap();
    let mut spec = kerf_api::resource_slices(&inventory, DRIVER, "n")
        .unwrap()
        .remove(0);
    let mut device = spec.devices.take().unwrap().remove(0);
    name.clone_into(&mut device.name);
    device
}

#[test]
fn the_inventory_view_leaves_scheduler_devices_out_of_placement() {
    let shared = Device {
        allow_multiple_allocations: Some(true),
        ..gpu_device("gpu-1")
    };
    let parent = Device {
        consumes_counters: Some(vec![DeviceCounterConsumption {
            counter_set: "gpu-2".to_owned(),
            counters: BTreeMap::new(),
        }]),
        ..gpu_device("gpu-2")
    };
    let inventory = kerf_core::mock::from_spec("h100-sxm-80gb:1").unwrap();
    let mut spec = kerf_api::resource_slices(&inventory, DRIVER, "n")
        .unwrap()
        .remove(0);
    spec.devices = Some(vec![gpu_device("gpu-0"), shared, parent]);
    let mut counters = spec.clone();
    counters.devices = None;
    counters.shared_counters = Some(vec![CounterSet {
        name: "gpu-2".to_owned(),
        counters: BTreeMap::new(),
    }]);
    let slices: Vec<ResourceSlice> = [("n-0", spec), ("n-1", counters)]
        .into_iter()
        .map(|(name, spec)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            spec,
        })
        .collect();
    let view = kerf_api::inventory_view(&slices, DRIVER);
    assert!(view.skipped.is_empty(), "{:?}", view.skipped);
    let placeable: Vec<&str> = view.nodes["n"]
        .gpus
        .iter()
        .map(|g| g.device.as_str())
        .collect();
    assert_eq!(placeable, ["gpu-0"]);
    let shared: Vec<&str> = view.shared["n"].iter().map(|g| g.device.as_str()).collect();
    assert_eq!(shared, ["gpu-1"]);
}

#[test]
fn several_shares_of_one_gpu_are_counted_for_the_class_status() {
    let inventory = kerf_core::mock::from_spec("h100-sxm-80gb:1").unwrap();
    let mut spec = kerf_api::resource_slices(&inventory, DRIVER, "n")
        .unwrap()
        .remove(0);
    for device in spec.devices.iter_mut().flatten() {
        device.allow_multiple_allocations = Some(true);
    }
    let slice = Arc::new(kerf_controller::cache::CompactResourceSlice::from(
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some("n-0".to_owned()),
                ..ObjectMeta::default()
            },
            spec,
        },
    ));
    let claim = |name: &str, memory: &str| {
        Arc::new(
            serde_json::from_value::<k8s_openapi::api::resource::v1::ResourceClaim>(json!({
                "metadata": {"name": name, "namespace": NS},
                "spec": {"devices": {"requests": []}},
                "status": {"allocation": {"devices": {"results": [{
                    "request": "gpu", "driver": DRIVER, "pool": "n", "device": "gpu-0",
                    "shareID": format!("00000000-0000-4000-8000-00000000000{}", name.len()),
                    "consumedCapacity": {"memory": memory, "compute": "30"},
                }]}}},
            }))
            .unwrap(),
        )
    };
    let slices = vec![slice];
    let devices = kerf_controller::capacity::current_devices(&slices, DRIVER);
    let claims = vec![claim("a", "10Gi"), claim("bb", "20Gi")];
    let usage = kerf_controller::capacity::memory_in_use(&devices, &claims, DRIVER);
    assert_eq!(usage.used("n", "gpu-0"), 30 << 30);
}
