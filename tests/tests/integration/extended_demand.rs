//! Pods asking for GPUs by extended resource name count as kube-scheduler's demand:
//! with every GPU of the node recorded as the controller's, a pod with only
//! `resources.limits: {gpu.kerf.dev/gpu: N}` of a Scheduler class gets N GPUs lent to the
//! scheduler (the Node's ownership record `gpu.kerf.dev/allocators`), as a claim of that class
//! asking for N would. kube-scheduler makes such a pod's claim only at PreBind, already
//! allocated (kubernetes/kubernetes `pkg/scheduler/framework/plugins/dynamicresources/
//! extendeddynamicresources.go`), so before it the pod's requests are the only sign of demand.
//!
//! kerf-controller runs with its own identity (`Identity::kerf_controller`); the test writes
//! what users, kube-scheduler and the kubelet plugin would.
#![allow(
    clippy::needless_pass_by_value,
    reason = "fixtures take JSON values as the tests write them inline"
)]

use crate::common::claim_cluster;

use std::time::Duration;

use claim_cluster::{Controller, NS, device_class_of, node, settings, slices};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::DeviceClass;
use kerf_api::ownership::{Owner, OwnershipRecord};
use kerf_api::params::{Allocator, GpuSelector};
use kerf_api::{GpuClassSpec, Slicing};
use kerf_controller::claims;
use kerf_tests::fake_api::FakeApi;
use kerf_tests::wait::eventually;
use serde_json::{Value, json};

const NODE: &str = "node-0";
const GPUS: usize = 8;
/// The extended resource name of the whole-GPU Scheduler class.
const WHOLE_GPU: &str = "gpu.kerf.dev/gpu";
/// The extended resource name of the sliced Scheduler class.
const SHARED_GPU: &str = "gpu.kerf.dev/shared";
const DEADLINE: Duration = Duration::from_secs(20);

/// The DeviceClass the GpuClass reconciler writes for a class named `name` with `spec` on a
/// 1.36 cluster (extendedResourceName served).
fn device_class(fake: &FakeApi, name: &str, spec: GpuClassSpec) {
    let extended = spec.extended_resource_name.clone();
    let mut dc = device_class_of(name, spec);
    dc.spec.extended_resource_name = extended;
    fake.insert_resource::<DeviceClass>(&dc);
}

fn scheduler_spec(extended: &str, sliced: bool) -> GpuClassSpec {
    GpuClassSpec {
        allocator: Allocator::Scheduler,
        selector: GpuSelector::default(),
        slicing: sliced.then(|| Slicing {
            memory_granularity: k8s_openapi::apimachinery::pkg::api::resource::Quantity(
                "1Gi".to_owned(),
            ),
            max_slices_per_gpu: None,
            default_compute: None,
        }),
        extended_resource_name: Some(extended.to_owned()),
        ..GpuClassSpec::default()
    }
}

/// One node of 8 × H100 with no allocator label (its devices move by demand), the Scheduler
/// classes `whole` (named [`WHOLE_GPU`]) and `shared` (sliced, named [`SHARED_GPU`]) and the
/// Controller class `slices`.
fn cluster() -> FakeApi {
    let fake = FakeApi::new();
    node(&fake, NODE, json!({}), json!([]), true);
    slices(&fake, NODE);
    device_class(&fake, "whole", scheduler_spec(WHOLE_GPU, false));
    device_class(&fake, "shared", scheduler_spec(SHARED_GPU, true));
    claim_cluster::device_class(
        &fake,
        "slices",
        Allocator::Controller,
        kerf_api::params::PlacementPolicy::BinPack,
    );
    fake
}

/// kerf-controller's claim controller (with the ownership tick) as `claim_cluster` runs it,
/// lending for 60 s: long enough that a loan never goes back while a test looks at it.
fn start_controller(fake: &FakeApi) -> Controller {
    let settings = claims::ClaimSettings {
        ownership: claims::ownership::OwnershipTiming {
            settle: Duration::from_millis(50),
            linger: Duration::from_secs(60),
        },
        ..settings()
    };
    Controller::start_with(fake, settings)
}

/// The node's ownership record as kerf-controller wrote it.
fn record(fake: &FakeApi) -> OwnershipRecord {
    let node: Node = fake.get_resource(None, NODE).unwrap();
    OwnershipRecord::from_annotations(node.metadata.annotations.as_ref()).unwrap()
}

/// The devices the record gives `owner`.
fn owned_by(fake: &FakeApi, owner: Owner) -> Vec<String> {
    let record = record(fake);
    (0..GPUS)
        .map(|i| format!("gpu-{i}"))
        .filter(|d| record.owner(d) == Some(owner))
        .collect()
}

/// Waits until every GPU is recorded as the controller's: a cluster whose GPUs are all the
/// controller's when extended-resource pods arrive.
async fn all_controllers(fake: &FakeApi) {
    eventually(
        "every GPU recorded as the controller's",
        DEADLINE,
        || async { (owned_by(fake, Owner::Controller).len() == GPUS).then_some(()) },
    )
    .await;
}

/// Waits until `n` or more GPUs are the scheduler's and returns them.
async fn lent(fake: &FakeApi, n: usize, why: &str) -> Vec<String> {
    eventually(
        &format!("{n} GPU(s) lent to the scheduler for {why}"),
        DEADLINE,
        || async {
            let lent = owned_by(fake, Owner::Scheduler);
            (lent.len() >= n).then_some(lent)
        },
    )
    .await
}

/// A pending pod whose containers are `containers` (and init containers `init`), as a user
/// creates it: no claims, not bound.
fn pod(fake: &FakeApi, name: &str, init: Value, containers: Value, status: Value) {
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}")},
        "spec": {"initContainers": init, "containers": containers},
        "status": status,
    }));
}

fn container(name: &str, limits: Value) -> Value {
    json!({"name": name, "image": "busybox", "resources": {"limits": limits}})
}

/// A claim of the `whole` class asking for `count` GPUs and a pod using it: the demand a
/// user's claim makes, used as a barrier (once its GPUs are lent, every demand before it
/// has been weighed).
fn claim_pod(fake: &FakeApi, name: &str, count: i64) {
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "whole", "allocationMode": "ExactCount", "count": count}}]}},
    }));
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}")},
        "spec": {"containers": [{"name": "main", "image": "busybox",
                                 "resources": {"claims": [{"name": "gpu"}]}}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]},
        "status": {"phase": "Pending"},
    }));
}

#[tokio::test]
async fn a_pod_asking_by_extended_resource_gets_a_gpu_lent_to_the_scheduler() {
    let fake = cluster();
    let controller = start_controller(&fake);
    all_controllers(&fake).await;

    pod(
        &fake,
        "by-limit",
        json!([]),
        json!([container("main", json!({WHOLE_GPU: "1"}))]),
        json!({"phase": "Pending"}),
    );
    let first = lent(&fake, 1, "pod by-limit").await;
    assert_eq!(first.len(), 1, "one GPU asked for, {first:?} lent");
    // A barrier: a claim asking for 2 more; once they are lent, nothing more came of by-limit.
    claim_pod(&fake, "barrier", 2);
    let all = lent(&fake, 3, "by-limit and the barrier claim").await;
    assert_eq!(all.len(), 3, "1 + 2 GPUs asked for, {all:?} lent");
    assert!(all.contains(&first[0]), "{first:?} taken back: {all:?}");
    controller.stop().await;
}

#[tokio::test]
async fn init_containers_count_by_their_peak_and_every_scheduler_class_name_counts() {
    let fake = cluster();
    let controller = start_controller(&fake);
    all_controllers(&fake).await;

    // max(init 3, apps 1 + 1) = 3 whole GPUs, plus 1 of the sliced class: 4.
    pod(
        &fake,
        "init",
        json!([container("prepare", json!({WHOLE_GPU: "3"}))]),
        json!([
            container("a", json!({WHOLE_GPU: "1"})),
            container("b", json!({WHOLE_GPU: "1", SHARED_GPU: "1"})),
        ]),
        json!({"phase": "Pending"}),
    );
    // The implicit name of a Controller class counts for nothing: kerf-controller allocates
    // its claims, never kube-scheduler.
    pod(
        &fake,
        "controller-class",
        json!([]),
        json!([container(
            "main",
            json!({"deviceclass.resource.kubernetes.io/slices": "2"})
        )]),
        json!({"phase": "Pending"}),
    );
    let all = lent(&fake, 4, "pod init").await;
    claim_pod(&fake, "barrier", 1);
    let after = lent(&fake, 5, "pod init and the barrier claim").await;
    assert_eq!(
        (all.len(), after.len()),
        (4, 5),
        "4 then 1 more asked for: lent {all:?} then {after:?}"
    );
    controller.stop().await;
}

#[tokio::test]
async fn a_pod_whose_claim_kube_scheduler_made_or_that_is_done_asks_for_nothing() {
    // Everything is written before the controller starts: its caches are complete before its
    // first tick, so no tick can see a pod without the claim written just after it.
    let fake = cluster();
    let limits = json!([container("main", json!({WHOLE_GPU: "1"}))]);
    // kube-scheduler made its claim (PreBind) but did not bind it yet.
    pod(
        &fake,
        "claimed",
        json!([]),
        limits.clone(),
        json!({"phase": "Pending"}),
    );
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": "claimed-extended-resources-abcde", "namespace": NS,
            "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "claimed",
                                 "uid": "uid-claimed", "controller": true}],
        },
        "spec": {},
    }));
    // Recorded in the pod's status only (the claim not in the cache yet).
    pod(
        &fake,
        "recorded",
        json!([]),
        limits.clone(),
        json!({"phase": "Pending", "extendedResourceClaimStatus": {
            "resourceClaimName": "recorded-extended-resources-x", "requestMappings": [
                {"containerName": "main", "resourceName": WHOLE_GPU,
                 "requestName": "container-0-request-0"}]}}),
    );
    pod(
        &fake,
        "done",
        json!([]),
        limits.clone(),
        json!({"phase": "Succeeded"}),
    );
    let mut gated = limits;
    gated[0]["name"] = json!("main");
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gated", "namespace": NS, "uid": "uid-gated"},
        "spec": {"containers": gated, "schedulingGates": [{"name": "example.com/hold"}]},
        "status": {"phase": "Pending"},
    }));
    claim_pod(&fake, "barrier", 1);
    let controller = start_controller(&fake);
    let all = lent(&fake, 1, "the barrier claim").await;
    assert_eq!(
        all.len(),
        1,
        "only the barrier asked, yet {all:?} were lent"
    );
    assert_eq!(
        owned_by(&fake, Owner::Controller).len(),
        GPUS - 1,
        "the others are the controller's"
    );
    controller.stop().await;
}
