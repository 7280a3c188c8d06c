//! The cluster of the node label tests: four nodes of 8 × H100 with kerf's ResourceSlices, a
//! controller class and a scheduler class, the claim controller as `kerf-controller` runs it,
//! and claims written as kube-scheduler and kube-controller-manager write them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_api::ownership;
use kerf_api::params::{Allocator, GpuSelector, Placement, PlacementPolicy};
use kerf_api::{GpuClass, GpuClassSpec, Slicing};
use kerf_controller::{BackoffConfig, Config, ControllerConfig, ControllerTask, claims};
use kerf_tests::fake_api::FakeApi;
use kube::Api;
use kube::api::ObjectMeta;
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const DRIVER: &str = "gpu.kerf.dev";
pub const NS: &str = "default";
pub const NODES: [&str; 4] = ["node-0", "node-1", "node-2", "node-3"];
/// A BinPack controller class with 1Gi granularity.
pub const SLICES: &str = "slices";
/// A scheduler class (whole GPUs, allocated by kube-scheduler).
pub const WHOLE: &str = "whole";
pub const CLAIMS: &str = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims";
pub const PODS: &str = "/api/v1/namespaces/default/pods";
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Four Ready nodes with kerf slices, the `slices` controller class and the `whole` scheduler
/// class.
pub fn cluster() -> FakeApi {
    let fake = FakeApi::new();
    let inventory = kerf_core::mock::from_spec("h100-sxm-80gb").unwrap();
    for node in NODES {
        fake.insert(json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }));
        let specs = kerf_api::resource_slices(&inventory, DRIVER, node).unwrap();
        for (i, spec) in specs.into_iter().enumerate() {
            fake.insert_resource(&ResourceSlice {
                metadata: ObjectMeta {
                    name: Some(kerf_api::slice_name(node, DRIVER, i)),
                    ..ObjectMeta::default()
                },
                spec,
            });
        }
    }
    device_class(&fake, SLICES, Allocator::Controller);
    device_class(&fake, WHOLE, Allocator::Scheduler);
    fake
}

/// The DeviceClass the GpuClass reconciler makes of a class with this allocator.
fn device_class(fake: &FakeApi, name: &str, allocator: Allocator) {
    let controller = allocator == Allocator::Controller;
    let mut class = GpuClass::new(
        name,
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
            placement: controller.then_some(Placement {
                policy: PlacementPolicy::BinPack,
            }),
            sharing: None,
            extended_resource_name: None,
        },
    );
    class.metadata.uid = Some(format!("uid-{name}"));
    let dc = kerf_controller::deviceclass::device_class(&class, DRIVER, "kerf-controller").unwrap();
    fake.insert_resource::<DeviceClass>(&dc);
}

/// A claim for a 10Gi slice of the controller class.
pub fn controller_claim(fake: &FakeApi, name: &str) {
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": SLICES, "count": 1, "allocationMode": "ExactCount"}}],
            "config": [{"opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters",
                "memory": "10Gi", "compute": 10,
            }}}],
        }},
    }));
}

/// An unscheduled pod using claim `claim`.
pub fn pod(fake: &FakeApi, name: &str, claim: &str) {
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "containers": [{"name": "main", "image": "busybox"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        },
        "status": {"phase": "Pending"},
    }));
}

/// The allocation kube-scheduler writes for a claim of `driver`'s device `device` in `pool`
/// (kubernetes/kubernetes `pkg/scheduler/framework/plugins/dynamicresources`,
/// `DynamicResources.bindClaim`: results and a node selector for the node).
pub fn scheduler_allocation(driver: &str, pool: &str, device: &str) -> Value {
    json!({
        "devices": {"results": [{"request": "gpu", "driver": driver, "pool": pool, "device": device}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [pool]}]}]},
    })
}

/// Creates claim `name` of the scheduler class, allocated as [`scheduler_allocation`] says
/// (an extended-resource or scheduler-class claim as kube-scheduler leaves it).
pub fn scheduler_claim(fake: &FakeApi, name: &str, allocation: Option<Value>) {
    let mut claim = json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": WHOLE}}]}},
    });
    if let Some(allocation) = allocation {
        claim["status"] = json!({"allocation": allocation});
    }
    fake.insert(claim);
}

/// Replaces the allocation of the stored claim `name` (metadata kept, as a status update does):
/// `None` clears it, as kube-controller-manager's resourceclaim controller does once the last
/// `reservedFor` entry is gone (kubernetes/kubernetes `pkg/controller/resourceclaim/controller.go`,
/// `Controller.syncClaim`) and kube-scheduler's `PostFilter` does to a claim whose node fits no
/// pod (`dynamicresources.go`).
pub fn set_allocation(fake: &FakeApi, name: &str, allocation: Option<Value>) {
    let mut claim = get_claim(fake, name).unwrap();
    let status = claim["status"].as_object_mut().unwrap();
    match allocation {
        Some(allocation) => status.insert("allocation".to_owned(), allocation),
        None => status.remove("allocation"),
    };
    fake.insert(claim);
}

/// Updates the stored claim `name` in a way the label does not depend on.
pub fn touch(fake: &FakeApi, name: &str, n: usize) {
    let mut claim = get_claim(fake, name).unwrap();
    claim["metadata"]["annotations"]["example.com/touched"] = json!(n.to_string());
    fake.insert(claim);
}

pub fn get_claim(fake: &FakeApi, name: &str) -> Option<Value> {
    fake.get(&format!("{CLAIMS}/{name}"))
}

pub fn allocation(claim: &Value) -> Option<&Value> {
    claim.pointer("/status/allocation").filter(|a| !a.is_null())
}

/// The claim's node label.
pub fn label(claim: &Value) -> Option<&str> {
    claim
        .pointer("/metadata/labels")
        .and_then(|l| l.get(kerf_api::claim_node_label::CLAIM_NODE_LABEL))
        .and_then(Value::as_str)
}

/// The pool of the claim's first result of kerf's driver.
pub fn kerf_pool(claim: &Value) -> Option<&str> {
    allocation(claim)?
        .pointer("/devices/results")?
        .as_array()?
        .iter()
        .find(|r| r["driver"] == DRIVER)?["pool"]
        .as_str()
}

pub fn annotated(claim: &Value) -> Option<&str> {
    claim
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(claims::ALLOCATED_NODE_ANNOTATION))
        .and_then(Value::as_str)
}

fn settings() -> claims::ClaimSettings {
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
/// attribute the record names. Polls instead of watching.
async fn mirror_ownership_records(fake: FakeApi, shutdown: CancellationToken) {
    while !shutdown.is_cancelled() {
        for node in fake.list_resources::<Node>(None) {
            let record =
                ownership::Record::from_annotations(node.metadata.annotations.as_ref()).unwrap();
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

/// The claim controller (with its node label reconciler), running as `kerf-controller` runs it.
pub struct Controller {
    shutdown: CancellationToken,
    task: JoinHandle<kerf_controller::Result<()>>,
}

impl Controller {
    pub fn start(fake: &FakeApi) -> Self {
        let shutdown = CancellationToken::new();
        let config = Config {
            controller: ControllerConfig {
                backoff: BackoffConfig {
                    base: Duration::from_millis(50),
                    max: Duration::from_secs(1),
                },
                ..ControllerConfig::new(DRIVER)
            },
            leader_election: None,
            metrics_address: None,
        };
        let task = ControllerTask::new("resourceclaim", move |ctx, stop| {
            claims::run(ctx, stop, settings())
        });
        tokio::spawn(mirror_ownership_records(fake.clone(), shutdown.clone()));
        let task = tokio::spawn(kerf_controller::run_controllers(
            config,
            fake.client(),
            shutdown.clone(),
            vec![task],
        ));
        Self { shutdown, task }
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

/// Every version of every claim a watch delivers, in order, from the moment
/// [`Versions::record`] returns.
#[derive(Clone, Default)]
pub struct Versions(Arc<Mutex<Vec<Value>>>);

impl Versions {
    /// Starts watching the claims of `fake`; returns once the initial list is done.
    pub async fn record(fake: &FakeApi) -> Self {
        let versions = Versions::default();
        let (ready, is_ready) = tokio::sync::oneshot::channel();
        let mut ready = Some(ready);
        let sink = versions.clone();
        let api: Api<ResourceClaim> = Api::all(fake.client());
        tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default()).boxed();
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::InitDone) => {
                        if let Some(ready) = ready.take() {
                            let _ = ready.send(());
                        }
                    }
                    Ok(watcher::Event::Apply(claim)) => {
                        sink.0
                            .lock()
                            .unwrap()
                            .push(serde_json::to_value(claim).unwrap());
                    }
                    _ => {}
                }
            }
        });
        is_ready.await.unwrap();
        versions
    }

    /// The recorded versions of claim `name`.
    pub fn of(&self, name: &str) -> Vec<Value> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c["metadata"]["name"] == name)
            .cloned()
            .collect()
    }
}
