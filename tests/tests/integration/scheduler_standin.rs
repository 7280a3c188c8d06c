//! The kube-scheduler stand-in (`kerf_scheduler_standin`) against the in-memory API server, on
//! nodes with kerf's mock 8 × H100 ResourceSlices and DeviceClasses exactly as kerf's GpuClass
//! reconciler generates them (real CEL with `quantity()` and `semver()`). No kerf-controller
//! runs here: allocations "by kerf" are written by the tests.
#![allow(
    clippy::needless_pass_by_value,
    reason = "fixtures take JSON values as the tests write them inline"
)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_api::ownership;
use kerf_api::params::{Allocator, ControllerPlacement, GpuSelector, PlacementPolicy};
use kerf_api::{GpuClass, GpuClassSpec, Slicing};
use kerf_scheduler_standin::{
    BUILTIN_FINALIZER, BindOutcome, CycleOutcome, SchedulerStandIn, SeededRng, SpawnConfig,
    StandInConfig,
};
use kerf_tests::fake_api::FakeApi;
use kube::Api;
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams};
use serde_json::{Value, json};

use kerf_tests::fixtures::DRIVER;
const NS: &str = "default";
/// A scheduler class: whole H100s of at least 40Gi and compute capability 9.0.
const WHOLE: &str = "whole";
/// A controller class (its selector matches no published device).
const SLICES: &str = "slices";
const KERF_FINALIZER: &str = "gpu.kerf.dev/allocation";

// ---- cluster fixtures ----

fn node(fake: &FakeApi, name: &str, taints: Value) {
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": {"taints": taints},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }));
}

/// Publishes the node's 8 × H100 as the kubelet plugin would, every device recorded as the
/// scheduler's.
fn slices(fake: &FakeApi, node: &str) {
    let inventory = kerf_core::mock::from_spec("h100-sxm-80gb").unwrap();
    let mut specs = kerf_api::resource_slices(&inventory, DRIVER, node).unwrap();
    let record = ownership::OwnershipRecord(
        specs
            .iter()
            .flat_map(|s| s.devices.iter().flatten())
            .map(|d| (d.name.clone(), ownership::Owner::Scheduler))
            .collect(),
    );
    ownership::publish_owners(&mut specs, &record);
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

/// The DeviceClass kerf's GpuClass reconciler makes of `selector` with this allocator.
fn device_class(fake: &FakeApi, name: &str, allocator: Allocator, selector: GpuSelector) {
    let controller = allocator == Allocator::Controller;
    let mut class = GpuClass::new(
        name,
        GpuClassSpec {
            allocator,
            selector,
            slicing: controller.then(|| Slicing {
                memory_granularity: Quantity("1Gi".to_owned()),
                max_slices_per_gpu: Some(7),
                default_compute: None,
            }),
            placement: controller.then_some(ControllerPlacement {
                policy: PlacementPolicy::BinPack,
            }),
            sharing: None,
            extended_resource_name: None,
        },
    );
    class.metadata.uid = Some(format!("uid-{name}"));
    let dc = kerf_controller::deviceclass::device_class(&class, DRIVER, "kerf-controller", false)
        .unwrap();
    fake.insert_resource::<DeviceClass>(&dc);
}

fn h100_selector(min_memory: &str) -> GpuSelector {
    GpuSelector {
        product_names: vec!["NVIDIA H100 80GB HBM3".to_owned()],
        min_memory: Some(Quantity(min_memory.to_owned())),
        min_compute_capability: Some("9.0".to_owned()),
        mig_profile: None,
    }
}

/// Ready nodes with kerf slices, the `whole` scheduler class and the `slices` controller class.
fn cluster(nodes: &[&str]) -> FakeApi {
    let fake = FakeApi::new();
    for name in nodes {
        node(&fake, name, json!([]));
        slices(&fake, name);
    }
    device_class(&fake, WHOLE, Allocator::Scheduler, h100_selector("40Gi"));
    device_class(&fake, SLICES, Allocator::Controller, h100_selector("1Gi"));
    fake
}

/// A claim of one device of `class`.
fn claim(fake: &FakeApi, name: &str, class: &str) {
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": class, "count": 1, "allocationMode": "ExactCount"}}],
        }},
    }));
}

/// An unscheduled pod using `claims`; `spec` is merged into its spec.
fn pod(fake: &FakeApi, name: &str, claims: &[&str], spec: Value) -> Value {
    let refs: Vec<Value> = claims
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"name": format!("c{i}"), "resourceClaimName": c}))
        .collect();
    let mut pod_spec =
        json!({"containers": [{"name": "main", "image": "busybox"}], "resourceClaims": refs});
    if let (Some(target), Value::Object(extra)) = (pod_spec.as_object_mut(), spec) {
        target.extend(extra);
    }
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": pod_spec,
        "status": {"phase": "Pending"},
    }))
}

/// Writes an allocation of `device` on `node` into the claim's status, as kerf-controller
/// does (its finalizer, `nodeSelector`, optionally `allocationTimestamp`).
fn allocate_as_kerf(fake: &FakeApi, name: &str, node: &str, device: &str, timestamp: bool) {
    let path = format!("/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{name}");
    let mut claim = fake.get(&path).unwrap();
    claim["metadata"]["finalizers"] = json!([KERF_FINALIZER]);
    let mut allocation = json!({
        "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": device}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]},
    });
    if timestamp {
        allocation["allocationTimestamp"] = json!("2026-11-24T00:00:00Z");
    }
    claim["status"] = json!({"allocation": allocation});
    fake.insert(claim);
}

fn get_claim(fake: &FakeApi, name: &str) -> ResourceClaim {
    fake.get_resource::<ResourceClaim>(Some(NS), name).unwrap()
}

fn node_of(fake: &FakeApi, pod: &str) -> Option<String> {
    fake.get_resource::<Pod>(Some(NS), pod)
        .unwrap()
        .spec
        .unwrap()
        .node_name
}

fn devices_of(claim: &ResourceClaim) -> Vec<(String, String)> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|r| (r.pool, r.device))
        .collect()
}

fn reserved_uids(claim: &ResourceClaim) -> Vec<String> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|r| r.uid)
        .collect()
}

fn stand_in(fake: &FakeApi) -> SchedulerStandIn {
    SchedulerStandIn::new(fake.client(), DRIVER)
}

fn reserved(pod: &str, node: &str) -> CycleOutcome {
    CycleOutcome::Reserved {
        pod: format!("{NS}/{pod}"),
        node: node.to_owned(),
    }
}

fn bound(pod: &str, node: &str) -> BindOutcome {
    BindOutcome::Bound {
        pod: format!("{NS}/{pod}"),
        node: node.to_owned(),
    }
}

// ---- tests ----

#[tokio::test]
async fn allocates_a_whole_gpu_and_binds_the_pod() {
    let fake = cluster(&["node-0"]);
    claim(&fake, "c0", WHOLE);
    let p0 = pod(&fake, "p0", &["c0"], json!({}));
    let mut scheduler = stand_in(&fake);
    let mut rng = SeededRng::new(1);

    assert_eq!(
        scheduler.schedule_one(&mut rng).await.unwrap(),
        reserved("p0", "node-0")
    );
    assert_eq!(
        scheduler.flush_prebinds().await,
        vec![bound("p0", "node-0")]
    );

    let c0 = get_claim(&fake, "c0");
    assert_eq!(
        devices_of(&c0),
        vec![("node-0".to_owned(), "gpu-0".to_owned())]
    );
    let allocation = c0.status.as_ref().unwrap().allocation.as_ref().unwrap();
    assert!(allocation.allocation_timestamp.is_some());
    let selector = serde_json::to_value(allocation.node_selector.as_ref().unwrap()).unwrap();
    assert_eq!(
        selector,
        json!({"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-0"]}]}]})
    );
    // The class's opaque parameters travel with the allocation, as upstream copies them.
    let config = allocation
        .devices
        .as_ref()
        .unwrap()
        .config
        .as_ref()
        .unwrap();
    assert_eq!(config[0].source, "FromClass");
    assert_eq!(config[0].opaque.as_ref().unwrap().driver, DRIVER);
    assert_eq!(
        reserved_uids(&c0),
        vec![p0["metadata"]["uid"].as_str().unwrap().to_owned()]
    );
    assert_eq!(
        c0.metadata.finalizers,
        Some(vec![BUILTIN_FINALIZER.to_owned()])
    );
    assert_eq!(node_of(&fake, "p0").as_deref(), Some("node-0"));

    // Nothing left to do.
    assert_eq!(
        scheduler.schedule_one(&mut rng).await.unwrap(),
        CycleOutcome::Idle
    );
}

#[tokio::test]
async fn its_allocation_is_invisible_until_prebind() {
    let fake = cluster(&["node-0"]);
    claim(&fake, "c0", WHOLE);
    claim(&fake, "c1", WHOLE);
    pod(&fake, "p0", &["c0"], json!({}));
    pod(&fake, "p1", &["c1"], json!({}));
    let mut a = SchedulerStandIn::with_config(
        fake.client(),
        DRIVER,
        StandInConfig {
            prebind_delay_cycles: 2,
            ..StandInConfig::default()
        },
    );
    let mut rng = SeededRng::new(7);

    let first = a.step(&mut rng).await.unwrap();
    assert!(first.bound.is_empty());
    let CycleOutcome::Reserved { pod: first_pod, .. } = first.cycle else {
        panic!("{first:?}");
    };
    // Reserved, but nothing written: no allocation, no finalizer, no node.
    for name in ["c0", "c1"] {
        let claim = get_claim(&fake, name);
        assert!(devices_of(&claim).is_empty());
        assert!(claim.metadata.finalizers.is_none());
    }
    assert_eq!(node_of(&fake, "p0"), None);

    // A second allocator deciding now sees gpu-0 free and takes it too: the race kerf's
    // one-owner-per-device rule exists for.
    let mut b = stand_in(&fake);
    let other = b.schedule_one(&mut SeededRng::new(7)).await.unwrap();
    assert!(matches!(other, CycleOutcome::Reserved { .. }), "{other:?}");

    // Its own next cycle counts the in-flight allocation; PreBind runs one cycle later.
    let second = a.step(&mut rng).await.unwrap();
    assert!(second.bound.is_empty(), "{second:?}");
    assert!(
        matches!(second.cycle, CycleOutcome::Reserved { .. }),
        "{second:?}"
    );
    let third = a.step(&mut rng).await.unwrap();
    assert_eq!(third.bound.len(), 1, "{third:?}");
    assert!(matches!(&third.bound[0], BindOutcome::Bound { pod, .. } if *pod == first_pod));
    a.flush_prebinds().await;
    let mut a_devices: Vec<_> = ["c0", "c1"]
        .iter()
        .flat_map(|c| devices_of(&get_claim(&fake, c)))
        .collect();
    a_devices.sort();
    assert_eq!(
        a_devices,
        vec![
            ("node-0".to_owned(), "gpu-0".to_owned()),
            ("node-0".to_owned(), "gpu-1".to_owned())
        ]
    );
    // b's PreBind now finds its claim allocated by a: "allocated elsewhere", Unreserve.
    let outcomes = b.flush_prebinds().await;
    assert!(
        matches!(&outcomes[..], [BindOutcome::Failed { reason, .. }] if reason.contains("got allocated elsewhere in the meantime")),
        "{outcomes:?}"
    );
}

/// Runs `steps` steps, then flushes, then more steps and a flush, and returns the log.
async fn race(fake: &FakeApi, seed: u64, steps: usize) -> Vec<String> {
    let mut scheduler = SchedulerStandIn::with_config(
        fake.client(),
        DRIVER,
        StandInConfig {
            prebind_delay_cycles: 3,
            ..StandInConfig::default()
        },
    );
    let mut rng = SeededRng::new(seed);
    let mut log = Vec::new();
    for _ in 0..steps {
        let report = scheduler.step(&mut rng).await.unwrap();
        log.push(format!("{report:?}"));
    }
    for outcome in scheduler.flush_prebinds().await {
        log.push(format!("{outcome:?}"));
    }
    log
}

#[tokio::test]
async fn racing_pods_never_share_a_gpu() {
    for seed in 0..4 {
        let fake = cluster(&["node-0"]);
        for i in 0..10 {
            claim(&fake, &format!("c{i}"), WHOLE);
            pod(&fake, &format!("p{i}"), &[&format!("c{i}")], json!({}));
        }
        race(&fake, seed, 30).await;
        let mut seen = HashSet::new();
        let mut bound_pods = 0;
        for i in 0..10 {
            let claim = get_claim(&fake, &format!("c{i}"));
            let devices = devices_of(&claim);
            for device in &devices {
                assert!(seen.insert(device.clone()), "seed {seed}: {device:?} twice");
            }
            if node_of(&fake, &format!("p{i}")).is_some() {
                bound_pods += 1;
                assert_eq!(devices.len(), 1);
            }
        }
        assert_eq!(bound_pods, 8, "seed {seed}: eight GPUs, eight pods");
        assert_eq!(seen.len(), 8);
    }
}

#[tokio::test]
async fn the_same_seed_makes_the_same_choices() {
    let run = |seed| async move {
        let fake = cluster(&["node-0", "node-1"]);
        for i in 0..12 {
            claim(&fake, &format!("c{i}"), WHOLE);
            pod(&fake, &format!("p{i}"), &[&format!("c{i}")], json!({}));
        }
        race(&fake, seed, 20).await
    };
    assert_eq!(run(3).await, run(3).await);
    assert_ne!(run(3).await, run(4).await);
}

#[tokio::test]
async fn it_honours_a_prewritten_allocation_with_a_node_selector() {
    let fake = cluster(&["node-0", "node-1"]);
    claim(&fake, "c0", SLICES);
    allocate_as_kerf(&fake, "c0", "node-1", "gpu-3", true);
    let p0 = pod(&fake, "p0", &["c0"], json!({}));
    let before = get_claim(&fake, "c0");
    // Whatever the seed, only node-1 is ever chosen.
    for seed in 0..4 {
        let outcome = stand_in(&fake)
            .schedule_one(&mut SeededRng::new(seed))
            .await
            .unwrap();
        assert_eq!(outcome, reserved("p0", "node-1"));
    }
    let mut scheduler = stand_in(&fake);
    assert_eq!(
        scheduler
            .schedule_one(&mut SeededRng::new(0))
            .await
            .unwrap(),
        reserved("p0", "node-1")
    );
    assert_eq!(
        scheduler.flush_prebinds().await,
        vec![bound("p0", "node-1")]
    );
    let after = get_claim(&fake, "c0");
    assert_eq!(
        after.status.as_ref().unwrap().allocation,
        before.status.as_ref().unwrap().allocation,
        "an allocation is never rewritten"
    );
    assert_eq!(
        after.metadata.finalizers,
        Some(vec![KERF_FINALIZER.to_owned()])
    );
    assert_eq!(
        reserved_uids(&after),
        vec![p0["metadata"]["uid"].as_str().unwrap().to_owned()]
    );
    assert_eq!(node_of(&fake, "p0").as_deref(), Some("node-1"));

    // gpu-3 of node-1 counts as in use for the scheduler's own claims.
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "whole-gpus", "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": WHOLE, "allocationMode": "All"}}]}},
    }));
    pod(
        &fake,
        "p1",
        &["whole-gpus"],
        json!({"nodeSelector": {"kubernetes.io/hostname": "node-1"}}),
    );
    let outcome = scheduler
        .schedule_one(&mut SeededRng::new(0))
        .await
        .unwrap();
    assert!(
        matches!(&outcome, CycleOutcome::Unschedulable { reason, .. } if reason == "cannot allocate all claims"),
        "allocationMode All needs every matching device free: {outcome:?}"
    );
}

#[tokio::test]
async fn an_allocation_without_timestamp_fails_prebind_as_on_1_36() {
    let fake = cluster(&["node-0"]);
    claim(&fake, "c0", SLICES);
    allocate_as_kerf(&fake, "c0", "node-0", "gpu-0", false);
    pod(&fake, "p0", &["c0"], json!({}));
    let mut scheduler = stand_in(&fake);
    assert_eq!(
        scheduler
            .schedule_one(&mut SeededRng::new(0))
            .await
            .unwrap(),
        reserved("p0", "node-0")
    );
    let outcomes = scheduler.flush_prebinds().await;
    assert!(
        matches!(&outcomes[..], [BindOutcome::Failed { reason, .. }] if reason.contains("field is immutable")),
        "{outcomes:?}"
    );
    assert!(reserved_uids(&get_claim(&fake, "c0")).is_empty());
    assert_eq!(node_of(&fake, "p0"), None);
}

#[tokio::test]
async fn gated_and_assigned_pods_are_skipped() {
    let fake = cluster(&["node-0"]);
    claim(&fake, "c0", WHOLE);
    claim(&fake, "c1", WHOLE);
    pod(
        &fake,
        "gated",
        &["c0"],
        json!({"schedulingGates": [{"name": "gpu.kerf.dev/allocation"}]}),
    );
    pod(&fake, "assigned", &["c1"], json!({"nodeName": "node-0"}));
    let mut scheduler = stand_in(&fake);
    let mut rng = SeededRng::new(0);
    for _ in 0..3 {
        assert_eq!(
            scheduler.step(&mut rng).await.unwrap().cycle,
            CycleOutcome::Idle
        );
    }
    assert!(devices_of(&get_claim(&fake, "c0")).is_empty());
    assert!(devices_of(&get_claim(&fake, "c1")).is_empty());

    Api::<Pod>::namespaced(fake.client(), NS)
        .patch(
            "gated",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"schedulingGates": null}})),
        )
        .await
        .unwrap();
    assert_eq!(
        scheduler.step(&mut rng).await.unwrap().cycle,
        reserved("gated", "node-0")
    );
}

#[tokio::test]
async fn post_filter_clears_an_unreserved_allocated_claim_of_an_unschedulable_pod() {
    // c0 is pinned to node-1, which the pod cannot use (an untolerated taint); node-0 fits
    // everything else, so Filter records c0 as unavailable there and PostFilter frees it.
    let fake = FakeApi::new();
    node(&fake, "node-0", json!([]));
    node(
        &fake,
        "node-1",
        json!([{"key": "maintenance", "value": "true", "effect": "NoSchedule"}]),
    );
    slices(&fake, "node-0");
    slices(&fake, "node-1");
    device_class(&fake, SLICES, Allocator::Controller, h100_selector("1Gi"));
    claim(&fake, "c0", SLICES);
    allocate_as_kerf(&fake, "c0", "node-1", "gpu-0", true);
    pod(&fake, "p0", &["c0"], json!({}));

    let outcome = stand_in(&fake)
        .schedule_one(&mut SeededRng::new(0))
        .await
        .unwrap();
    assert_eq!(
        outcome,
        CycleOutcome::Unschedulable {
            pod: format!("{NS}/p0"),
            reason: "deallocation of ResourceClaim completed".to_owned(),
            deallocated: Some(format!("{NS}/c0")),
        }
    );
    let c0 = get_claim(&fake, "c0");
    let status = c0.status.unwrap_or_default();
    assert!(
        status.allocation.is_none() && status.reserved_for.is_none() && status.devices.is_none()
    );
    // kerf's finalizer is kerf's to remove.
    assert_eq!(
        c0.metadata.finalizers,
        Some(vec![KERF_FINALIZER.to_owned()])
    );
}

#[tokio::test]
async fn post_filter_keeps_an_allocation_when_another_claim_cannot_be_allocated_anywhere() {
    // Upstream Filter returns "cannot allocate all claims" before it records unavailable
    // claims, so a pod whose other claim the scheduler cannot allocate on any node (a
    // controller class) does not lose its allocated claim.
    let fake = cluster(&["node-0", "node-1"]);
    claim(&fake, "c0", SLICES);
    allocate_as_kerf(&fake, "c0", "node-1", "gpu-0", true);
    claim(&fake, "c1", SLICES);
    pod(&fake, "p0", &["c0", "c1"], json!({}));

    let outcome = stand_in(&fake)
        .schedule_one(&mut SeededRng::new(0))
        .await
        .unwrap();
    assert_eq!(
        outcome,
        CycleOutcome::Unschedulable {
            pod: format!("{NS}/p0"),
            reason: "cannot allocate all claims".to_owned(),
            deallocated: None,
        }
    );
    assert_eq!(devices_of(&get_claim(&fake, "c0")).len(), 1);

    // But when the other claim fits on a node the allocated one does not allow, it goes.
    claim(&fake, "w", WHOLE);
    pod(
        &fake,
        "p1",
        &["c0", "w"],
        json!({"nodeSelector": {"kubernetes.io/hostname": "node-0"}}),
    );
    fake.remove(&format!("/api/v1/namespaces/{NS}/pods/p0"));
    let outcome = stand_in(&fake)
        .schedule_one(&mut SeededRng::new(0))
        .await
        .unwrap();
    assert!(
        matches!(&outcome, CycleOutcome::Unschedulable { deallocated: Some(c), .. } if *c == format!("{NS}/c0")),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn the_claim_controller_deallocates_after_the_last_consumer_is_deleted() {
    let fake = cluster(&["node-0"]);
    claim(&fake, "c0", WHOLE);
    pod(&fake, "p0", &["c0"], json!({}));
    // A kerf-controller allocation reserved for a pod that will be deleted too.
    claim(&fake, "k0", SLICES);
    allocate_as_kerf(&fake, "k0", "node-0", "gpu-5", true);
    pod(&fake, "p1", &["k0"], json!({}));
    let mut scheduler = stand_in(&fake);
    let mut rng = SeededRng::new(2);
    for _ in 0..2 {
        assert!(matches!(
            scheduler.schedule_one(&mut rng).await.unwrap(),
            CycleOutcome::Reserved { .. }
        ));
    }
    assert_eq!(scheduler.flush_prebinds().await.len(), 2);
    assert_eq!(reserved_uids(&get_claim(&fake, "c0")).len(), 1);
    assert_eq!(reserved_uids(&get_claim(&fake, "k0")).len(), 1);

    // While the pods exist, nothing changes.
    assert!(
        scheduler
            .run_claim_controller_once()
            .await
            .unwrap()
            .is_empty()
    );

    let pods = Api::<Pod>::namespaced(fake.client(), NS);
    pods.delete("p0", &DeleteParams::default()).await.unwrap();
    pods.delete("p1", &DeleteParams::default()).await.unwrap();
    let mut changed = scheduler.run_claim_controller_once().await.unwrap();
    changed.sort();
    assert_eq!(changed, vec![format!("{NS}/c0"), format!("{NS}/k0")]);

    let c0 = get_claim(&fake, "c0");
    assert!(
        devices_of(&c0).is_empty(),
        "scheduler-allocated: deallocated"
    );
    assert!(reserved_uids(&c0).is_empty());
    assert_eq!(
        c0.metadata.finalizers.unwrap_or_default(),
        Vec::<String>::new()
    );

    let k0 = get_claim(&fake, "k0");
    assert_eq!(devices_of(&k0).len(), 1, "kerf-allocated: left to kerf");
    assert!(reserved_uids(&k0).is_empty());
    assert_eq!(
        k0.metadata.finalizers,
        Some(vec![KERF_FINALIZER.to_owned()])
    );
}

#[tokio::test]
async fn finished_pods_release_their_reservation() {
    let fake = cluster(&["node-0"]);
    claim(&fake, "c0", WHOLE);
    pod(&fake, "p0", &["c0"], json!({}));
    let mut scheduler = stand_in(&fake);
    scheduler
        .schedule_one(&mut SeededRng::new(0))
        .await
        .unwrap();
    scheduler.flush_prebinds().await;
    Api::<Pod>::namespaced(fake.client(), NS)
        .patch_status(
            "p0",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
        )
        .await
        .unwrap();
    assert_eq!(
        scheduler.run_claim_controller_once().await.unwrap(),
        vec![format!("{NS}/c0")]
    );
    assert!(devices_of(&get_claim(&fake, "c0")).is_empty());
}

#[tokio::test]
async fn class_selectors_are_evaluated_as_cel() {
    let fake = cluster(&["node-0"]);
    // A class asking for more memory than an H100 has selects nothing (quantity compareTo).
    device_class(&fake, "big", Allocator::Scheduler, h100_selector("100Gi"));
    claim(&fake, "c-big", "big");
    pod(&fake, "p-big", &["c-big"], json!({}));
    // A controller class selects nothing published: its claims wait for kerf-controller.
    claim(&fake, "c-slice", SLICES);
    pod(&fake, "p-slice", &["c-slice"], json!({}));
    // A selector that fails at run time aborts the pod's cycle, as upstream's allocator.
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "broken"},
        "spec": {"selectors": [{"cel": {"expression": "device.attributes[\"gpu.kerf.dev\"].noSuchAttribute == \"x\""}}]},
    }));
    claim(&fake, "c-broken", "broken");
    pod(&fake, "p-broken", &["c-broken"], json!({}));

    let mut scheduler = stand_in(&fake);
    let mut seen = HashSet::new();
    let mut rng = SeededRng::new(5);
    for _ in 0..30 {
        match scheduler.schedule_one(&mut rng).await.unwrap() {
            CycleOutcome::Unschedulable { pod, reason, .. } => {
                assert_eq!(reason, "cannot allocate all claims");
                seen.insert(pod);
            }
            CycleOutcome::Error { pod, message } => {
                assert_eq!(pod, format!("{NS}/p-broken"));
                assert!(message.contains("CEL runtime error"), "{message}");
                seen.insert(pod);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(seen.len(), 3, "{seen:?}");
}

#[tokio::test]
async fn spawned_in_the_background_it_binds_pods() {
    let fake = cluster(&["node-0", "node-1"]);
    for i in 0..4 {
        claim(&fake, &format!("c{i}"), WHOLE);
        pod(&fake, &format!("p{i}"), &[&format!("c{i}")], json!({}));
    }
    let handle = stand_in(&fake).spawn(SpawnConfig {
        seed: 9,
        interval: Duration::from_millis(5),
        prebind_delay: Duration::from_millis(20),
        claim_controller: true,
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while (0..4).any(|i| node_of(&fake, &format!("p{i}")).is_none()) {
        assert!(Instant::now() < deadline, "pods not bound in time");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (scheduler, log) = handle.stop().await.unwrap();
    assert!(scheduler.pending_prebinds().is_empty());
    assert_eq!(
        log.iter().filter(|l| l.starts_with("Bound")).count(),
        4,
        "{log:?}"
    );
    let mut devices = HashSet::new();
    for i in 0..4 {
        for d in devices_of(&get_claim(&fake, &format!("c{i}"))) {
            assert!(devices.insert(d));
        }
    }
}

#[tokio::test]
async fn write_conflicts_are_retried_then_unreserved_and_the_pod_tried_again() {
    let fake = cluster(&["node-0"]);
    claim(&fake, "c0", WHOLE);
    pod(&fake, "p0", &["c0"], json!({}));
    let status = format!("/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/c0/status");
    let mut scheduler = stand_in(&fake);
    let mut rng = SeededRng::new(0);

    // One conflict: bindClaim reads the claim again and succeeds.
    scheduler.schedule_one(&mut rng).await.unwrap();
    fake.fail_next("PUT", &status, 409, 1);
    assert_eq!(
        scheduler.flush_prebinds().await,
        vec![bound("p0", "node-0")]
    );
    assert_eq!(devices_of(&get_claim(&fake, "c0")).len(), 1);

    // Conflicts on every attempt (retry.DefaultRetry: 5): PreBind fails, nothing is
    // reserved, and the pod is a candidate again in a later cycle.
    claim(&fake, "c1", WHOLE);
    pod(&fake, "p1", &["c1"], json!({}));
    let status1 = format!("/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/c1/status");
    assert_eq!(
        scheduler.schedule_one(&mut rng).await.unwrap(),
        reserved("p1", "node-0")
    );
    fake.fail_next("PUT", &status1, 409, 5);
    let outcomes = scheduler.flush_prebinds().await;
    assert!(
        matches!(&outcomes[..], [BindOutcome::Failed { reason, .. }] if reason.contains("add allocation and reservation to claim default/c1")),
        "{outcomes:?}"
    );
    let c1 = get_claim(&fake, "c1");
    assert!(devices_of(&c1).is_empty());
    assert!(reserved_uids(&c1).is_empty());
    // The finalizer from the first attempt stays, as upstream leaves it ("if we were
    // interrupted in the past, it might already be set").
    assert_eq!(
        c1.metadata.finalizers,
        Some(vec![BUILTIN_FINALIZER.to_owned()])
    );
    assert_eq!(
        scheduler.schedule_one(&mut rng).await.unwrap(),
        reserved("p1", "node-0")
    );
    assert_eq!(
        scheduler.flush_prebinds().await,
        vec![bound("p1", "node-0")]
    );
}

mod fixtures;
mod partitions;
mod random;
mod shares;
