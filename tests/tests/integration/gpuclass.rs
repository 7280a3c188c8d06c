//! The GpuClass reconciler against the in-memory API server: DeviceClass creation and update,
//! the never-matching selector of Controller classes, status from seeded ResourceSlices and
//! allocated claims, unusable classes, and per-object back-off.
#![allow(
    clippy::needless_pass_by_value,
    reason = "fixtures take JSON values as the tests write them inline"
)]

use std::sync::Arc;
use std::time::Duration;

use crate::common::controller::{RunningController, Watched, metrics_text};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kerf_api::params::{Allocator, GpuSelector, GpuSliceAllocation, OpaqueKind, SliceDevice};
use kerf_api::quantity::parse_bytes;
use kerf_api::{GpuClass, GpuClassSpec, decode_opaque, params::OpaqueConfig};
use kerf_controller::cache::Caches;
use kerf_controller::gpuclass::{self, ClassContext, RETRY, reconcile};
use kerf_controller::{Config, Context, ControllerConfig, Metrics, Process};
use kerf_tests::fake_api::{FakeApi, Identity};
use kerf_tests::wait::eventually;
use kube::api::ObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use kerf_tests::fixtures::DRIVER;
const H100: &str = "NVIDIA H100 80GB HBM3";
const L4: &str = "NVIDIA L4";
const GIB: u64 = 1 << 30;
/// NVML's memory of the mock H100 and L4.
const H100_BYTES: u64 = 81559 << 20;
const L4_BYTES: u64 = 23034 << 20;
const DEVICE_CLASSES: &str = "/apis/resource.k8s.io/v1/deviceclasses";
const GPU_CLASSES: &str = "/apis/gpu.kerf.dev/v1alpha1/gpuclasses";
/// How long a test waits for the controller.
const DEADLINE: Duration = Duration::from_secs(20);

/// Publishes a mock node's ResourceSlices as the kubelet plugin would, at `generation`.
fn seed_node(fake: &FakeApi, node: &str, profile: &str, generation: i64) {
    let inventory = kerf_core::mock::from_spec(profile).unwrap();
    let specs = kerf_api::resource_slices(&inventory, DRIVER, node).unwrap();
    for (i, mut spec) in specs.into_iter().enumerate() {
        spec.pool.generation = generation;
        fake.insert_resource(&ResourceSlice {
            metadata: ObjectMeta {
                name: Some(format!(
                    "{}-g{generation}",
                    kerf_api::slice_name(node, DRIVER, i)
                )),
                ..ObjectMeta::default()
            },
            spec,
        });
    }
}

fn gpu_class(fake: &FakeApi, name: &str, spec: GpuClassSpec) -> GpuClass {
    fake.insert_resource(&GpuClass::new(name, spec))
}

fn h100_class() -> GpuClassSpec {
    GpuClassSpec {
        selector: GpuSelector {
            product_names: vec![H100.to_owned()],
            min_memory: Some(k8s_openapi::apimachinery::pkg::api::resource::Quantity(
                "40Gi".to_owned(),
            )),
            min_compute_capability: Some("9.0".to_owned()),
            mig_profile: None,
        },
        ..GpuClassSpec::default()
    }
}

/// A claim allocated `results` (and `config`) by someone.
fn allocated_claim(fake: &FakeApi, name: &str, results: Value, config: Value) {
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
        "status": {"allocation": {"devices": {"results": results, "config": config}}},
    }));
}

fn result(node: &str, device: &str) -> Value {
    json!({"request": "gpu", "driver": DRIVER, "pool": node, "device": device})
}

/// A context whose caches watch `fake`.
struct Harness {
    fake: FakeApi,
    ctx: Arc<Context>,
    registry: Registry,
}

impl Harness {
    async fn new(fake: &FakeApi) -> Self {
        let Watched { context, registry } =
            Watched::start(fake, ControllerConfig::new(DRIVER)).await;
        Self {
            fake: fake.clone(),
            ctx: Arc::new(context),
            registry,
        }
    }

    /// Reconciles the stored GpuClass `name` once.
    async fn reconcile(&self, name: &str) -> kerf_controller::Result<Action> {
        let class: GpuClass = self.fake.get_resource(None, name).unwrap();
        let ctx = ClassContext::new(self.ctx.clone());
        reconcile(Arc::new(class), Arc::new(ctx)).await
    }

    fn class(&self, name: &str) -> GpuClass {
        self.fake.get_resource(None, name).unwrap()
    }

    fn device_class(&self, name: &str) -> Option<DeviceClass> {
        self.fake.get_resource(None, name)
    }

    /// Waits until the caches hold `claims` claims and `slices` slices.
    async fn caches_hold(&self, slices: usize, claims: usize) {
        let caches = &self.ctx.caches;
        eventually("the caches", DEADLINE, || async {
            (caches.slices.len() == slices && caches.claims.len() == claims).then_some(())
        })
        .await;
    }

    fn metrics_text(&self) -> String {
        metrics_text(&self.registry)
    }
}

fn ready(class: &GpuClass) -> (String, String, String) {
    let condition = class.status.as_ref().and_then(|s| s.ready()).unwrap();
    (
        condition.status.clone(),
        condition.reason.clone(),
        condition.message.clone(),
    )
}

fn expression(device_class: &DeviceClass) -> &str {
    &device_class.spec.selectors.as_ref().unwrap()[0]
        .cel
        .as_ref()
        .unwrap()
        .expression
}

#[tokio::test]
async fn a_gpu_class_becomes_an_owned_device_class() {
    let fake = FakeApi::new();
    seed_node(&fake, "node-a", "h100-sxm-80gb:2", 1);
    let class = gpu_class(&fake, "h100", h100_class());
    let h = Harness::new(&fake).await;

    let action = h.reconcile("h100").await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(600)));

    let dc = h.device_class("h100").expect("DeviceClass created");
    assert_eq!(
        expression(&dc),
        r#"device.driver == "gpu.kerf.dev" && device.attributes["gpu.kerf.dev"].type == "gpu" && device.attributes["gpu.kerf.dev"].productName in ["NVIDIA H100 80GB HBM3"] && device.capacity["gpu.kerf.dev"].memory.compareTo(quantity("40Gi")) >= 0 && device.attributes["gpu.kerf.dev"].cudaComputeCapability.compareTo(semver("9.0.0")) >= 0 && "allocator" in device.attributes["gpu.kerf.dev"] && device.attributes["gpu.kerf.dev"].allocator == "scheduler" && !device.allowMultipleAllocations"#
    );
    let config = dc.spec.config.as_ref().unwrap();
    assert_eq!(config.len(), 1);
    let opaque = config[0].opaque.as_ref().unwrap();
    assert_eq!(opaque.driver, DRIVER);
    assert_eq!(
        decode_opaque(&opaque.parameters.0, "parameters").unwrap(),
        OpaqueConfig::Class(class.spec.parameters())
    );
    let owners = dc.metadata.owner_references.as_ref().unwrap();
    assert_eq!(owners.len(), 1);
    assert_eq!(owners[0].kind, "GpuClass");
    assert_eq!(owners[0].name, "h100");
    assert_eq!(Some(&owners[0].uid), class.metadata.uid.as_ref());
    assert_eq!(owners[0].controller, Some(true));
    assert_eq!(
        dc.metadata.labels.as_ref().unwrap()["app.kubernetes.io/managed-by"],
        "kerf-controller"
    );
    // Written by server-side apply with kerf's field manager.
    let apply = h
        .fake
        .requests()
        .into_iter()
        .find(|r| r.matches("patch", &format!("{DEVICE_CLASSES}/h100")))
        .unwrap();
    assert_eq!(
        apply.content_type.as_deref(),
        Some("application/apply-patch+yaml")
    );
    assert!(
        apply.query.contains("fieldManager=kerf-controller"),
        "{}",
        apply.query
    );

    let class = h.class("h100");
    let status = class.status.as_ref().unwrap();
    assert_eq!(status.device_class_name.as_deref(), Some("h100"));
    assert_eq!(status.matching_devices, Some(2));
    assert_eq!(status.observed_generation, class.metadata.generation);
    let (ready_status, reason, _) = ready(&class);
    assert_eq!(
        (ready_status.as_str(), reason.as_str()),
        ("True", "DeviceClassApplied")
    );
    assert!(
        h.fake
            .requests()
            .iter()
            .any(|r| r.matches("patch", &format!("{GPU_CLASSES}/h100/status"))),
        "status goes through the status subresource"
    );
}

#[tokio::test]
async fn an_unchanged_class_costs_no_writes() {
    let fake = FakeApi::new();
    seed_node(&fake, "node-a", "l4", 1);
    gpu_class(&fake, "any", GpuClassSpec::default());
    let h = Harness::new(&fake).await;
    h.reconcile("any").await.unwrap();
    eventually("the DeviceClass in the cache", DEADLINE, || async {
        h.ctx
            .caches
            .device_classes
            .get(&ObjectRef::new("any"))
            .map(|_| ())
    })
    .await;
    fake.clear_requests();
    h.reconcile("any").await.unwrap();
    let writes: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| !matches!(r.verb, "get" | "list" | "watch"))
        .collect();
    assert!(writes.is_empty(), "{writes:?}");
}

#[tokio::test]
async fn status_counts_devices_and_memory_from_slices_and_claims() {
    let fake = FakeApi::new();
    seed_node(&fake, "node-a", "h100-sxm-80gb:2", 1);
    seed_node(&fake, "node-b", "h100-sxm-80gb:2", 3);
    // An older generation of node-b's pool, with more GPUs: consumers ignore it.
    seed_node(&fake, "node-b", "h100-sxm-80gb:8", 2);
    seed_node(&fake, "node-c", "l4", 1);
    let gpu_uuid = |node: &str| {
        let slices: Vec<ResourceSlice> = fake.list_resources(None);
        let slice = slices
            .iter()
            .find(|s| s.spec.pool.name == node && s.spec.pool.generation == 3)
            .unwrap();
        let device = &slice.spec.devices.as_ref().unwrap()[1];
        device.attributes.as_ref().unwrap()["uuid"]
            .string
            .clone()
            .unwrap()
    };
    // A whole GPU allocated by the scheduler, a 10Gi slice written by the controller, and an
    // L4 that the class does not select.
    allocated_claim(
        &fake,
        "whole",
        json!([result("node-a", "gpu-0")]),
        json!([]),
    );
    let slice = GpuSliceAllocation {
        devices: vec![SliceDevice {
            pool: "node-b".to_owned(),
            device: "gpu-1".to_owned(),
            share_id: None,
            gpu_uuid: gpu_uuid("node-b"),
            memory_bytes: Some(10 * GIB),
            compute_percent: Some(20),
            sharing: kerf_core::sharing::Sharing::default(),
            time_slice_interval: None,
            enforcement: kerf_core::enforcement::Enforcement::default(),
        }],
    };
    allocated_claim(
        &fake,
        "slice",
        json!([result("node-b", "gpu-1")]),
        json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": slice.to_parameters().unwrap()}}]),
    );
    allocated_claim(&fake, "l4", json!([result("node-c", "gpu-0")]), json!([]));
    gpu_class(&fake, "h100", h100_class());
    let h = Harness::new(&fake).await;

    h.reconcile("h100").await.unwrap();
    let status = h.class("h100").status.unwrap();
    assert_eq!(status.matching_devices, Some(4));
    let total = parse_bytes(&status.total_memory.unwrap().0).unwrap();
    let free = parse_bytes(&status.free_memory.unwrap().0).unwrap();
    assert_eq!(total, 4 * H100_BYTES);
    assert_eq!(free, 4 * H100_BYTES - H100_BYTES - 10 * GIB);
    let text = h.metrics_text();
    assert!(
        text.contains(&format!(
            r#"kerf_controller_class_free_memory_bytes{{class="h100"}} {free}"#
        )),
        "{text}"
    );
    assert!(
        text.contains(
            r#"kerf_controller_reconcile_total{controller="gpuclass",result="ok",reason=""} 1"#
        ),
        "{text}"
    );

    // A class of every whole GPU sees the L4s too, one of them taken.
    gpu_class(&fake, "all", GpuClassSpec::default());
    h.reconcile("all").await.unwrap();
    let status = h.class("all").status.unwrap();
    assert_eq!(status.matching_devices, Some(6));
    assert_eq!(
        parse_bytes(&status.free_memory.unwrap().0).unwrap(),
        4 * H100_BYTES + 2 * L4_BYTES - H100_BYTES - 10 * GIB - L4_BYTES
    );

    // The slice's claim is deleted: its memory is free again.
    fake.remove("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/slice");
    h.caches_hold(h.ctx.caches.slices.len(), 2).await;
    h.reconcile("h100").await.unwrap();
    let status = h.class("h100").status.unwrap();
    assert_eq!(
        parse_bytes(&status.free_memory.unwrap().0).unwrap(),
        3 * H100_BYTES
    );
}

#[tokio::test]
async fn a_controller_class_gets_a_selector_no_device_matches() {
    let fake = FakeApi::new();
    seed_node(&fake, "node-a", "h100-sxm-80gb:2", 1);
    let spec = GpuClassSpec {
        allocator: Allocator::Controller,
        slicing: Some(kerf_api::Slicing::default()),
        placement: Some(kerf_api::ControllerPlacement {
            policy: kerf_api::PlacementPolicy::Spread,
        }),
        ..h100_class()
    };
    let class = gpu_class(&fake, "slices", spec);
    let h = Harness::new(&fake).await;
    h.reconcile("slices").await.unwrap();

    let dc = h.device_class("slices").unwrap();
    assert_eq!(
        expression(&dc),
        r#"device.driver == "gpu.kerf.dev" && device.attributes["gpu.kerf.dev"].type == "slice""#
    );
    let opaque = dc.spec.config.as_ref().unwrap()[0].opaque.as_ref().unwrap();
    let OpaqueConfig::Class(params) = decode_opaque(&opaque.parameters.0, "parameters").unwrap()
    else {
        panic!("not GpuClassParameters");
    };
    assert_eq!(params.allocator, Allocator::Controller);
    assert_eq!(
        params,
        class.spec.parameters(),
        "the controller reads the selector from here"
    );
    // The status counts the GPUs the controller slices.
    let status = h.class("slices").status.unwrap();
    assert_eq!(status.matching_devices, Some(2));
    assert_eq!(ready(&h.class("slices")).1, "DeviceClassApplied");
}

#[tokio::test]
async fn a_class_matching_nothing_is_not_ready_and_says_why() {
    let fake = FakeApi::new();
    seed_node(&fake, "node-a", "l4", 1);
    gpu_class(&fake, "h100", h100_class());
    let h = Harness::new(&fake).await;
    h.reconcile("h100").await.unwrap();

    let class = h.class("h100");
    let (status, reason, message) = ready(&class);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "NoMatchingDevices")
    );
    assert!(message.contains("no published device matches"), "{message}");
    let class_status = class.status.as_ref().unwrap();
    assert_eq!(class_status.matching_devices, Some(0));
    assert_eq!(class_status.free_memory.as_ref().unwrap().0, "0");
    assert!(
        h.device_class("h100").is_some(),
        "the DeviceClass exists anyway"
    );

    let events = eventually("a Warning event", DEADLINE, || async {
        let events = fake.list("/apis/events.k8s.io/v1/events");
        (!events.is_empty()).then_some(events)
    })
    .await;
    assert_eq!(events[0]["type"], "Warning");
    assert_eq!(events[0]["reason"], "NoMatchingDevices");
    assert_eq!(events[0]["regarding"]["kind"], "GpuClass");

    // Devices appear: the class becomes ready.
    seed_node(&fake, "node-b", "h100-sxm-80gb:1", 1);
    h.caches_hold(2, 0).await;
    h.reconcile("h100").await.unwrap();
    let (status, reason, _) = ready(&h.class("h100"));
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "DeviceClassApplied")
    );
}

#[tokio::test]
async fn an_invalid_spec_is_reported_and_writes_no_device_class() {
    let fake = FakeApi::new();
    let mut spec = h100_class();
    spec.selector.min_memory = Some(k8s_openapi::apimachinery::pkg::api::resource::Quantity(
        "1.5".to_owned(),
    ));
    gpu_class(&fake, "bad", spec);
    let h = Harness::new(&fake).await;
    let action = h.reconcile("bad").await.unwrap();
    assert_eq!(action, Action::await_change(), "retrying cannot fix a spec");
    let (status, reason, message) = ready(&h.class("bad"));
    assert_eq!((status.as_str(), reason.as_str()), ("False", "InvalidSpec"));
    assert!(message.contains("spec.selector.minMemory"), "{message}");
    assert!(h.device_class("bad").is_none());
}

#[tokio::test]
async fn a_device_class_it_does_not_own_is_left_alone() {
    let fake = FakeApi::new();
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "h100"},
        "spec": {"selectors": [{"cel": {"expression": "true"}}]},
    }));
    gpu_class(&fake, "h100", h100_class());
    let h = Harness::new(&fake).await;
    h.reconcile("h100").await.unwrap();
    let (status, reason, message) = ready(&h.class("h100"));
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "DeviceClassConflict")
    );
    assert!(
        message.contains("not controlled by this GpuClass"),
        "{message}"
    );
    assert_eq!(expression(&h.device_class("h100").unwrap()), "true");
    assert_eq!(fake.count("patch", DEVICE_CLASSES), 0);
}

#[tokio::test]
async fn failures_back_off_per_object() {
    let fake = FakeApi::new();
    gpu_class(&fake, "a", GpuClassSpec::default());
    gpu_class(&fake, "b", GpuClassSpec::default());
    let h = Harness::new(&fake).await;
    fake.fail_next("patch", &format!("{DEVICE_CLASSES}/a"), 500, 2);
    for expected in [1, 2] {
        let error = h.reconcile("a").await.unwrap_err();
        assert_eq!(error.reason(), "kube_api");
        let action = RETRY.error_policy()(Arc::new(h.class("a")), &error, h.ctx.clone());
        assert_eq!(action, Action::requeue(Duration::from_secs(expected)));
    }
    // Another object starts from the base delay.
    let error = h.reconcile("b").await.map(|_| ()).err();
    assert!(error.is_none());
    h.reconcile("a").await.unwrap();
    assert_eq!(
        h.ctx.backoff.failures("gpuclass//a"),
        0,
        "a success resets the back-off"
    );
    let text = h.metrics_text();
    assert!(
        text.contains(r#"kerf_controller_reconcile_total{controller="gpuclass",result="error",reason="kube_api"} 2"#),
        "{text}"
    );
}

/// The whole process without leader election: watches drive the reconciler.
#[tokio::test]
async fn the_running_controller_follows_spec_and_claim_changes() {
    let fake = FakeApi::new();
    seed_node(&fake, "node-a", "h100-sxm-80gb:2", 1);
    seed_node(&fake, "node-b", "l4", 1);
    gpu_class(&fake, "fast", h100_class());
    let running = RunningController::start(&fake);

    let dc = eventually("the DeviceClass", DEADLINE, || async {
        fake.get_resource::<DeviceClass>(None, "fast")
    })
    .await;
    assert!(expression(&dc).contains(H100), "{}", expression(&dc));

    // Spec update: the DeviceClass follows.
    let mut class: GpuClass = fake.get_resource(None, "fast").unwrap();
    class.spec.selector = GpuSelector {
        product_names: vec![L4.to_owned()],
        ..GpuSelector::default()
    };
    fake.insert_resource(&class);
    let dc = eventually("the updated DeviceClass", DEADLINE, || async {
        fake.get_resource::<DeviceClass>(None, "fast")
            .filter(|dc| expression(dc).contains(L4))
    })
    .await;
    assert!(!expression(&dc).contains(H100));
    let opaque = dc.spec.config.as_ref().unwrap()[0].opaque.as_ref().unwrap();
    let OpaqueConfig::Class(params) = decode_opaque(&opaque.parameters.0, "parameters").unwrap()
    else {
        panic!("not GpuClassParameters");
    };
    assert_eq!(params.selector.product_names, [L4]);
    eventually("the status of the new generation", DEADLINE, || async {
        let class: GpuClass = fake.get_resource(None, "fast")?;
        let status = class.status?;
        (status.observed_generation == class.metadata.generation
            && status.matching_devices == Some(2))
        .then_some(())
    })
    .await;

    // A claim allocated on an L4: the free memory follows without any GpuClass change.
    allocated_claim(&fake, "c", json!([result("node-b", "gpu-1")]), json!([]));
    eventually("the free memory after the allocation", DEADLINE, || async {
        let class: GpuClass = fake.get_resource(None, "fast")?;
        let free = class.status?.free_memory?;
        (parse_bytes(&free.0).ok()? == L4_BYTES).then_some(())
    })
    .await;

    running.stop().await;
}

#[tokio::test]
async fn the_controller_stops_when_asked_before_the_caches_are_ready() {
    let fake = FakeApi::new();
    // Every list fails, so the caches never become ready.
    fake.fail_next("list", "/apis/resource.k8s.io", 503, usize::MAX);
    let client = fake.client_as(Identity::kerf_controller());
    let (caches, fill) = Caches::start(&client, DRIVER);
    tokio::spawn(fill);
    let mut registry = Registry::default();
    let ctx = Arc::new(Context::new(
        client,
        ControllerConfig::new(DRIVER),
        Metrics::new(&mut registry),
        caches,
    ));
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(gpuclass::run(ctx, shutdown.clone()));
    eventually("failing lists", DEADLINE, || async {
        (fake.count("list", "/apis/resource.k8s.io") >= 3).then_some(())
    })
    .await;
    assert!(!task.is_finished(), "it waits for the caches");
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn the_process_reports_a_controller_that_stops_on_its_own() {
    let fake = FakeApi::new();
    let config = Config {
        controller: ControllerConfig::new(DRIVER),
        leader_election: None,
        metrics_address: None,
    };
    let quitter = kerf_controller::ControllerTask::new("quitter", |_ctx, _stop| async { Ok(()) });
    let error = Process {
        controllers: vec![quitter],
        ..Process::new(
            config,
            fake.client_as(Identity::kerf_controller()),
            CancellationToken::new(),
        )
    }
    .run()
    .await
    .unwrap_err();
    assert_eq!(error.reason(), "controller_stopped");
    assert!(error.to_string().contains("quitter"), "{error}");
}

mod extended_resource;
