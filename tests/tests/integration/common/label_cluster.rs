//! The node label tests' part of the claim controller cluster ([`super::claim_cluster`]):
//! controller claims and their pods, claims written as kube-scheduler and
//! kube-controller-manager write them, and a record of every version of every claim.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_controller::claims;
use kerf_tests::fake_api::FakeApi;
use kerf_tests::fixtures::SliceClaim;
use kube::Api;
use kube::runtime::watcher;
use serde_json::{Value, json};

use super::claim_cluster::{DRIVER, NS, SLICES, WHOLE, allocation, get_claim};

pub const DEADLINE: Duration = Duration::from_secs(20);

/// A claim for a 10Gi slice of the controller class.
pub fn controller_claim(fake: &FakeApi, name: &str) {
    fake.insert(
        SliceClaim::new(name, SLICES, "10Gi")
            .in_namespace(NS)
            .compute(10)
            .json(),
    );
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
