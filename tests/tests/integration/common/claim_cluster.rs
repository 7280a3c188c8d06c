//! The cluster of the claim controller tests: four Ready nodes of 8 × H100 with kerf's
//! ResourceSlices, controller-class and scheduler-class DeviceClasses as the GpuClass
//! reconciler writes them, and the claim controller running as `kerf-controller` runs it.
//! Shared by the claim controller's tests; each uses a part.
#![allow(dead_code, reason = "each test binary uses a part of the fixture")]
#![allow(
    clippy::needless_pass_by_value,
    reason = "fixtures take JSON values as the tests write them"
)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_api::ownership;
use kerf_api::params::{Allocator, ControllerPlacement, GpuSelector, PlacementPolicy};
use kerf_api::resourceslice::{ResourceSliceFeatures, node_slices};
use kerf_api::{GpuClass, GpuClassSpec, Slicing};
use kerf_controller::claims;
use kerf_controller::{BackoffConfig, Config, ControllerConfig, ControllerTask, Metrics, Process};
use kerf_tests::fake_api::{FakeApi, Identity};
use kube::api::ObjectMeta;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use kerf_tests::fixtures::DRIVER;
pub const NS: &str = "default";
pub const NODES: [&str; 4] = ["node-0", "node-1", "node-2", "node-3"];
/// A BinPack controller class with 1Gi granularity.
pub const SLICES: &str = "slices";
/// A scheduler class (whole GPUs, allocated by kube-scheduler).
pub const WHOLE: &str = "whole";
pub const CLAIMS: &str = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims";
pub const PODS: &str = "/api/v1/namespaces/default/pods";

/// A Node: Ready unless `ready` is false, with `labels` and `taints`.
pub fn node(fake: &FakeApi, name: &str, labels: Value, taints: Value, ready: bool) {
    let mut all_labels = json!({"kubernetes.io/hostname": name});
    if let (Some(all), Value::Object(extra)) = (all_labels.as_object_mut(), labels) {
        all.extend(extra);
    }
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels},
        "spec": {"taints": taints},
        "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    }));
}

/// Publishes the node's 8 × H100 as the kubelet plugin would.
pub fn slices(fake: &FakeApi, node: &str) {
    publish_slices(
        fake,
        node,
        "h100-sxm-80gb",
        ResourceSliceFeatures::default(),
    );
}

/// Publishes the GPUs of mock spec `gpus` (`kerf_core::mock::from_spec`) on `node` as the
/// kubelet plugin would when the API server serves `features`; returns how many devices the
/// pool has.
pub fn publish_slices(
    fake: &FakeApi,
    node: &str,
    gpus: &str,
    features: ResourceSliceFeatures,
) -> usize {
    let inventory = kerf_core::mock::from_spec(gpus).unwrap();
    let specs = node_slices(&inventory, DRIVER, node, features).unwrap();
    let devices = specs
        .iter()
        .flat_map(|s| s.devices.iter().flatten())
        .count();
    for (i, spec) in specs.into_iter().enumerate() {
        fake.insert_resource(&ResourceSlice {
            metadata: ObjectMeta {
                name: Some(kerf_api::slice_name(node, DRIVER, i)),
                ..ObjectMeta::default()
            },
            spec,
        });
    }
    devices
}

/// Ready nodes named `names`, each with 8 × H100 published.
pub fn gpu_nodes(fake: &FakeApi, names: &[&str]) {
    for &name in names {
        node(fake, name, json!({}), json!([]), true);
        slices(fake, name);
    }
}

/// The DeviceClass the GpuClass reconciler makes of GpuClass `name` with `spec` on a 1.36
/// cluster (the class's uid is `uid-<name>`).
pub fn device_class_of(name: &str, spec: GpuClassSpec) -> DeviceClass {
    let mut class = GpuClass::new(name, spec);
    class.metadata.uid = Some(format!("uid-{name}"));
    kerf_controller::deviceclass::device_class(&class, DRIVER, "kerf-controller", true).unwrap()
}

/// An H100 class with this allocator and policy (a controller class slices in 1Gi steps, at
/// most 7 per GPU).
pub fn device_class_spec(allocator: Allocator, policy: PlacementPolicy) -> GpuClassSpec {
    let controller = allocator == Allocator::Controller;
    GpuClassSpec {
        allocator,
        selector: GpuSelector {
            product_names: vec!["NVIDIA H100 80GB HBM3".to_owned()],
            ..GpuSelector::default()
        },
        slicing: controller.then(|| Slicing {
            memory_granularity: Quantity("1Gi".to_owned()),
            max_slices_per_gpu: Some(7),
            default_compute: None,
        }),
        placement: controller.then_some(ControllerPlacement { policy }),
        sharing: None,
        extended_resource_name: None,
    }
}

/// Stores the DeviceClass the GpuClass reconciler makes of [`device_class_spec`].
pub fn device_class(fake: &FakeApi, name: &str, allocator: Allocator, policy: PlacementPolicy) {
    let dc = device_class_of(name, device_class_spec(allocator, policy));
    fake.insert_resource::<DeviceClass>(&dc);
}

/// Four Ready nodes with kerf slices, the `slices` (BinPack) and `spread` controller classes
/// and the `whole` scheduler class.
pub fn cluster() -> FakeApi {
    let fake = FakeApi::new();
    gpu_nodes(&fake, &NODES);
    classes(&fake);
    fake
}

pub fn classes(fake: &FakeApi) {
    device_class(
        fake,
        SLICES,
        Allocator::Controller,
        PlacementPolicy::BinPack,
    );
    device_class(
        fake,
        "spread",
        Allocator::Controller,
        PlacementPolicy::Spread,
    );
    device_class(fake, WHOLE, Allocator::Scheduler, PlacementPolicy::BinPack);
}

pub fn settings() -> claims::ClaimSettings {
    claims::ClaimSettings {
        rejection_backoff: Duration::from_secs(60),
        unplaceable_retry: Duration::from_millis(200),
        pending_retry: Duration::from_millis(100),
        ownership: claims::ownership::OwnershipTiming {
            settle: Duration::from_millis(50),
            linger: Duration::from_secs(1),
        },
        ownership_tick: Duration::from_millis(20),
        ..claims::ClaimSettings::default()
    }
}

/// What each node's kubelet plugin does with the ownership record kerf-controller writes on
/// its Node (`kubelet-plugin/src/publish.rs`): publish every device with the `allocator`
/// attribute the record names. Polls instead of watching; a few milliseconds of delay is
/// what the real plugin's debounce adds too.
pub async fn mirror_ownership_records(fake: FakeApi, shutdown: CancellationToken) {
    while !shutdown.is_cancelled() {
        for node in fake.list_resources::<k8s_openapi::api::core::v1::Node>(None) {
            let record =
                ownership::OwnershipRecord::from_annotations(node.metadata.annotations.as_ref())
                    .expect("the controller writes valid records");
            let name = node.metadata.name.clone().unwrap_or_default();
            for slice in fake.list_resources::<ResourceSlice>(None) {
                if slice.spec.node_name.as_deref() != Some(name.as_str()) {
                    continue;
                }
                let mut updated = slice.clone();
                ownership::publish_owners(std::slice::from_mut(&mut updated.spec), &record);
                if updated.spec != slice.spec {
                    fake.insert_resource(&updated);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The claim controller, running as `kerf-controller` runs it, and the metrics it counts in.
pub struct Controller {
    shutdown: CancellationToken,
    task: JoinHandle<kerf_controller::Result<()>>,
    metrics: Arc<Mutex<Option<Metrics>>>,
}

impl Controller {
    pub fn start(fake: &FakeApi) -> Self {
        Self::start_with(fake, settings())
    }

    pub fn start_with(fake: &FakeApi, settings: claims::ClaimSettings) -> Self {
        Self::start_config(
            fake,
            ControllerConfig {
                backoff: BackoffConfig {
                    base: Duration::from_millis(50),
                    max: Duration::from_secs(1),
                },
                claims: settings,
                ..ControllerConfig::new(DRIVER)
            },
        )
    }

    /// The claim controller alone, configured by `config`, with each node's kubelet plugin
    /// mirroring the ownership records ([`mirror_ownership_records`]).
    pub fn start_config(fake: &FakeApi, config: ControllerConfig) -> Self {
        let shutdown = CancellationToken::new();
        let config = Config {
            controller: config,
            leader_election: None,
            metrics_address: None,
        };
        let metrics = Arc::new(Mutex::new(None));
        let seen = Arc::clone(&metrics);
        let task = ControllerTask::new("resourceclaim", move |ctx, stop| {
            *seen.lock().unwrap() = Some(ctx.metrics.clone());
            claims::run(ctx, stop)
        });
        tokio::spawn(mirror_ownership_records(fake.clone(), shutdown.clone()));
        let client = fake.client_as(Identity::kerf_controller());
        let process = Process {
            controllers: vec![task],
            ..Process::new(config, client, shutdown.clone())
        };
        let task = tokio::spawn(process.run());
        Self {
            shutdown,
            task,
            metrics,
        }
    }

    /// Failed writes of `resource` counted with `reason`.
    pub fn write_failures(&self, resource: &'static str, reason: &'static str) -> u64 {
        let metrics = self.metrics.lock().unwrap();
        metrics
            .as_ref()
            .expect("the controller started")
            .api_write_failures()
            .count(resource, reason)
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("the controller stops on shutdown")
            .unwrap()
            .unwrap();
    }
}

pub fn get_claim(fake: &FakeApi, name: &str) -> Option<Value> {
    fake.get(&format!("{CLAIMS}/{name}"))
}

pub fn allocation(claim: &Value) -> Option<&Value> {
    claim.pointer("/status/allocation").filter(|a| !a.is_null())
}

/// An unscheduled pod using claim `claim`, held by kerf's scheduling gate as the admission
/// webhook leaves it.
pub fn gated_pod(fake: &FakeApi, name: &str, claim: &str) {
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "containers": [{"name": "main", "image": "busybox"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "schedulingGates": [{"name": kerf_api::controller_claims::SCHEDULING_GATE}],
        },
        "status": {"phase": "Pending"},
    }));
}

/// The pod's `gpu.kerf.dev/GpuAllocation` condition.
pub fn condition(fake: &FakeApi, pod: &str) -> Option<Value> {
    let pod = fake.get(&format!("{PODS}/{pod}"))?;
    pod.pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == claims::POD_CONDITION_TYPE)
        .cloned()
}
