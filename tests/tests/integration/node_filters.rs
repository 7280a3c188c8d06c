//! kerf-controller places a pod's claims only on a node the pod fits as kube-scheduler filters
//! nodes: its CPU, memory, ephemeral storage, pod slot, scalar resources and host ports against
//! the node's allocatable minus what the bound, nominated and assumed pods there take, its
//! `spec.nodeName`, and cordons (unless tolerated). And when no node fits, it says why in
//! kube-scheduler's words.
//!
//! Each test is built so that it fails when its filter is missing: an anchor pod pinned to
//! node-0 holds a GPU slice there, so BinPack prefers node-0 for the probe's slice; the probe
//! must land on node-1 because of the filter (or, for the cases the filter admits, on node-0).
//!
//! Among the nodes and GPUs that fit, the LeastFragmentation policy keeps room for the pod
//! kinds the controller has seen, and the fragmentation of each node pool is a metric.
#![allow(
    clippy::needless_pass_by_value,
    reason = "fixtures take JSON values as the tests write them inline"
)]

use crate::common::claim_cluster;
use crate::common::controller::{ClaimController, Watched, metrics_text};

use std::sync::Arc;
use std::time::Duration;

use claim_cluster::{
    Controller, DRIVER, NS, SLICES, allocation, classes, condition, device_class, get_claim,
    settings, slices,
};
use kerf_api::params::{Allocator, PlacementPolicy};
use kerf_controller::{Context, ControllerConfig, claims};
use kerf_tests::fake_api::FakeApi;
use kerf_tests::fixtures::SliceClaim;
use kerf_tests::wait::eventually;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(10);
const EVENTS: &str = "/apis/events.k8s.io/v1/events";

/// A Ready node with 8 × H100 published and this allocatable.
fn gpu_node(fake: &FakeApi, name: &str, allocatable: Value) {
    fake.insert(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": {},
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "allocatable": allocatable,
        },
    }));
    slices(fake, name);
}

fn allocatable() -> Value {
    json!({"cpu": "32", "memory": "128Gi", "ephemeral-storage": "100Gi", "pods": "110",
           "example.com/fpga": "1"})
}

/// A 5Gi / 10 % slice claim of the BinPack controller class.
fn slice_claim(fake: &FakeApi, name: &str) {
    sized_claim(fake, name, SLICES, "5Gi");
}

/// A slice claim of `class` asking `memory` and 10 % compute.
fn sized_claim(fake: &FakeApi, name: &str, class: &str, memory: &str) {
    fake.insert(
        SliceClaim::new(name, class, memory)
            .in_namespace(NS)
            .compute(10)
            .json(),
    );
}

/// A pod of one container asking `cpu` (nothing when empty), with `extra` merged into its
/// spec and `status` as its status.
fn pod_value(name: &str, cpu: &str, extra: Value, status: Value) -> Value {
    let resources = if cpu.is_empty() {
        json!({})
    } else {
        json!({"requests": {"cpu": cpu}})
    };
    let mut spec =
        json!({"containers": [{"name": "main", "image": "busybox", "resources": resources}]});
    if let (Some(spec), Value::Object(extra)) = (spec.as_object_mut(), extra) {
        spec.extend(extra);
    }
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
           "spec": spec, "status": status})
}

/// A pod bound to `node` and running, using no claim: it only takes node resources.
fn bound_pod(fake: &FakeApi, name: &str, node: &str, cpu: &str, extra: Value) {
    let mut extra = extra;
    extra["nodeName"] = json!(node);
    fake.insert(pod_value(name, cpu, extra, json!({"phase": "Running"})));
}

/// A gated pod using slice claim `name` (made here), as the admission webhook leaves it.
fn gpu_pod(fake: &FakeApi, name: &str, cpu: &str, extra: Value) {
    slice_claim(fake, name);
    let mut extra = extra;
    extra["resourceClaims"] = json!([{"name": "gpu", "resourceClaimName": name}]);
    extra["schedulingGates"] = json!([{"name": kerf_api::controller_claims::SCHEDULING_GATE}]);
    fake.insert(pod_value(name, cpu, extra, json!({"phase": "Pending"})));
}

/// Waits for claim `name` to be allocated and returns its node.
async fn placed_on(fake: &FakeApi, name: &str) -> String {
    let claim = eventually(&format!("claim {name} allocated"), DEADLINE, || async {
        get_claim(fake, name).filter(|c| allocation(c).is_some())
    })
    .await;
    claim["status"]["allocation"]["devices"]["results"][0]["pool"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// node-0 and node-1 (see [`allocatable`]), the classes, `setup`, and the controller; the
/// anchor's slice is placed on node-0 (its node selector; it tolerates every taint and cordon)
/// before the caller creates its probes.
async fn cluster_with_anchor(setup: impl FnOnce(&FakeApi)) -> (FakeApi, Controller) {
    let fake = FakeApi::new();
    gpu_node(&fake, "node-0", allocatable());
    gpu_node(&fake, "node-1", allocatable());
    classes(&fake);
    let pinned = json!({"nodeSelector": {"kubernetes.io/hostname": "node-0"},
                        "tolerations": [{"operator": "Exists"}]});
    gpu_pod(&fake, "anchor", "", pinned);
    setup(&fake);
    let controller = Controller::start(&fake);
    assert_eq!(placed_on(&fake, "anchor").await, "node-0");
    (fake, controller)
}

/// Where the probe pod (`cpu`, `extra`) goes on the anchored cluster after `setup`.
async fn probe(setup: impl FnOnce(&FakeApi), cpu: &str, extra: Value) -> String {
    let (fake, controller) = cluster_with_anchor(setup).await;
    gpu_pod(&fake, "probe", cpu, extra);
    let node = placed_on(&fake, "probe").await;
    controller.stop().await;
    node
}

fn hog(cpu: &str, extra: Value) -> impl FnOnce(&FakeApi) {
    let cpu = cpu.to_owned();
    move |fake: &FakeApi| bound_pod(fake, "hog", "node-0", &cpu, extra)
}

fn requests(resources: Value) -> Value {
    json!({"containers": [{"name": "main", "image": "busybox", "resources": {"requests": resources}}]})
}

#[tokio::test]
async fn cpu_taken_by_a_bound_pod_sends_the_pod_elsewhere() {
    assert_eq!(probe(hog("20", json!({})), "20", json!({})).await, "node-1");
    assert_eq!(probe(hog("20", json!({})), "12", json!({})).await, "node-0");
}

#[tokio::test]
async fn a_terminated_pod_takes_nothing() {
    let done = |fake: &FakeApi| {
        let finished = json!({"phase": "Succeeded"});
        fake.insert(pod_value(
            "done",
            "30",
            json!({"nodeName": "node-0"}),
            finished,
        ));
    };
    assert_eq!(probe(done, "20", json!({})).await, "node-0");
}

#[tokio::test]
async fn memory_ephemeral_storage_and_scalar_resources_are_checked() {
    let cases = [
        (json!({"memory": "100Gi"}), json!({"memory": "64Gi"})),
        (
            json!({"ephemeral-storage": "80Gi"}),
            json!({"ephemeral-storage": "30Gi"}),
        ),
        (
            json!({"example.com/fpga": "1"}),
            json!({"example.com/fpga": "1"}),
        ),
    ];
    for (taken, asked) in cases {
        let node = probe(hog("", requests(taken.clone())), "", requests(asked)).await;
        assert_eq!(node, "node-1", "{taken} taken on node-0");
    }
}

#[tokio::test]
async fn the_pod_count_counts_bound_and_assumed_pods() {
    // node-0 allows 2 pods: the hog (bound) and the anchor (placed, not bound yet).
    let setup = |fake: &FakeApi| {
        let mut small = allocatable();
        small["pods"] = json!("2");
        gpu_node(fake, "node-0", small);
        bound_pod(fake, "hog", "node-0", "", json!({}));
    };
    assert_eq!(probe(setup, "", json!({})).await, "node-1");
}

#[tokio::test]
async fn a_taken_host_port_sends_the_pod_elsewhere() {
    let port = |port: u16, protocol: &str| {
        json!({"containers": [{"name": "main", "image": "busybox",
               "ports": [{"containerPort": 80, "hostPort": port, "protocol": protocol}]}]})
    };
    let taken = port(8080, "TCP");
    assert_eq!(
        probe(hog("", taken.clone()), "", taken.clone()).await,
        "node-1"
    );
    assert_eq!(probe(hog("", taken), "", port(8080, "UDP")).await, "node-0");
}

#[tokio::test]
async fn a_node_name_admits_only_that_node() {
    let node = probe(|_: &FakeApi| {}, "", json!({"nodeName": "node-1"})).await;
    assert_eq!(node, "node-1");
}

/// A cordon as a real cluster shows it: `spec.unschedulable` and the node lifecycle
/// controller's `node.kubernetes.io/unschedulable:NoSchedule` taint (the fake adds it in the
/// same write), so both NodeUnschedulable and TaintToleration refuse it; a pod tolerating that
/// taint passes both. (NodeUnschedulable alone, as on a cluster without the lifecycle
/// controller, is unit-tested in `controller/src/claims/nodes.rs`.)
#[tokio::test]
async fn a_cordoned_node_takes_only_pods_tolerating_it() {
    let cordon = |fake: &FakeApi| {
        let mut node = fake.get("/api/v1/nodes/node-0").unwrap();
        node["spec"]["unschedulable"] = json!(true);
        fake.insert(node);
    };
    assert_eq!(probe(cordon, "", json!({})).await, "node-1");
    let tolerant = json!({"tolerations": [
        {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}
    ]});
    assert_eq!(probe(cordon, "", tolerant).await, "node-0");
}

fn init(name: &str, cpu: &str, restart_policy: Option<&str>) -> Value {
    let mut container = json!({"name": name, "image": "busybox",
                               "resources": {"requests": {"cpu": cpu}}});
    if let Some(policy) = restart_policy {
        container["restartPolicy"] = json!(policy);
    }
    container
}

#[tokio::test]
async fn init_containers_count_by_their_largest_not_their_sum() {
    let (fake, controller) = cluster_with_anchor(hog("20", json!({}))).await;
    // Two init containers of 8 CPUs run one after the other: 8, and 20 + 8 fit node-0.
    let two = json!({"initContainers": [init("a", "8", None), init("b", "8", None)]});
    gpu_pod(&fake, "max", "1", two);
    assert_eq!(placed_on(&fake, "max").await, "node-0");
    // One of 16 needs 16 at the pod's start: 28 + 16 does not fit.
    gpu_pod(
        &fake,
        "big",
        "1",
        json!({"initContainers": [init("a", "16", None)]}),
    );
    assert_eq!(placed_on(&fake, "big").await, "node-1");
    controller.stop().await;
}

#[tokio::test]
async fn restartable_sidecars_add_to_the_containers() {
    // 4 + a sidecar of 10 = 14, beside the hog's 20: 34 > 32. (As a plain init container,
    // max(4, 10) = 10 would fit.)
    let sidecar = json!({"initContainers": [init("side", "10", Some("Always"))]});
    assert_eq!(probe(hog("20", json!({})), "4", sidecar).await, "node-1");
}

#[tokio::test]
async fn the_pod_overhead_is_added() {
    let overhead = json!({"overhead": {"cpu": "4"}});
    assert_eq!(probe(hog("20", json!({})), "10", overhead).await, "node-1");
}

#[tokio::test]
async fn a_pod_nominated_to_a_node_holds_its_room() {
    let nominee = |fake: &FakeApi| {
        fake.insert(pod_value(
            "nominee",
            "20",
            json!({}),
            json!({"phase": "Pending", "nominatedNodeName": "node-0"}),
        ));
    };
    assert_eq!(probe(nominee, "20", json!({})).await, "node-1");
}

#[tokio::test]
async fn two_pods_placed_back_to_back_never_share_a_node_that_fits_one() {
    let (fake, controller) = cluster_with_anchor(|_: &FakeApi| {}).await;
    // Neither is bound (no scheduler here): each counts where it was placed.
    gpu_pod(&fake, "first", "20", json!({}));
    gpu_pod(&fake, "second", "20", json!({}));
    let first = placed_on(&fake, "first").await;
    let second = placed_on(&fake, "second").await;
    assert_ne!(first, second);
    controller.stop().await;
}

/// Events about `name` with `reason`.
fn events(fake: &FakeApi, name: &str, reason: &str) -> Vec<Value> {
    fake.list(EVENTS)
        .into_iter()
        .filter(|e| e["regarding"]["name"] == name && e["reason"] == reason)
        .collect()
}

#[tokio::test]
async fn no_fitting_node_is_explained_in_kube_schedulers_words() {
    let setup = |fake: &FakeApi| {
        gpu_node(fake, "node-2", allocatable());
        let mut tainted = fake.get("/api/v1/nodes/node-2").unwrap();
        tainted["spec"]["taints"] =
            json!([{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]);
        fake.insert(tainted);
        // A node without kerf GPUs counts among all nodes, as kube-scheduler counts it.
        fake.insert(
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-only"},
                           "status": {"conditions": [{"type": "Ready", "status": "True"}],
                                      "allocatable": allocatable()}}),
        );
    };
    let (fake, controller) = cluster_with_anchor(setup).await;
    gpu_pod(&fake, "huge", "40", json!({}));
    let warning = eventually("an Unplaceable Event", DEADLINE, || async {
        events(&fake, "huge", "Unplaceable").into_iter().next()
    })
    .await;
    let expected = "0/4 nodes are available: 1 node(s) had no GPUs kerf-controller allocates, \
                    1 node(s) had untolerated taint(s), 2 Insufficient cpu.";
    assert_eq!(warning["note"], expected);
    assert_eq!(warning["type"], "Warning");
    let condition = eventually("the pod condition", DEADLINE, || async {
        condition(&fake, "huge").filter(|c| c["status"] == "False")
    })
    .await;
    assert_eq!(condition["message"], expected);
    assert!(allocation(&get_claim(&fake, "huge").unwrap()).is_none());
    controller.stop().await;
}

fn clear_allocation(fake: &FakeApi, name: &str) {
    let mut claim = get_claim(fake, name).unwrap();
    claim["status"]
        .as_object_mut()
        .unwrap()
        .remove("allocation");
    fake.insert(claim);
}

#[tokio::test]
async fn the_rejection_walk_stops_after_max_node_rejections() {
    let fake = FakeApi::new();
    for name in ["node-0", "node-1", "node-2"] {
        gpu_node(&fake, name, allocatable());
    }
    classes(&fake);
    gpu_pod(&fake, "walker", "", json!({}));
    let controller = Controller::start_with(
        &fake,
        claims::ClaimSettings {
            max_node_rejections: 2,
            ..settings()
        },
    );
    // kube-scheduler clears the allocation twice, for a filter kerf does not model.
    for _ in 0..2 {
        let node = placed_on(&fake, "walker").await;
        clear_allocation(&fake, "walker");
        eventually("the claim placed elsewhere or held", DEADLINE, || async {
            let claim = get_claim(&fake, "walker")?;
            let pool = claim["status"]["allocation"]["devices"]["results"][0]["pool"].as_str();
            (pool != Some(node.as_str())).then_some(())
        })
        .await;
    }
    let warning = eventually("a TooManyRejections Event", DEADLINE, || async {
        events(&fake, "walker", "TooManyRejections")
            .into_iter()
            .next()
    })
    .await;
    let note = warning["note"].as_str().unwrap();
    assert!(note.contains("rejected 2 placements"), "{note}");
    assert!(note.contains("--max-node-rejections 2"), "{note}");
    let condition = condition(&fake, "walker").unwrap();
    assert_eq!(condition["reason"], "TooManyRejections");
    // Not placed a third time.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(allocation(&get_claim(&fake, "walker").unwrap()).is_none());
    assert_eq!(events(&fake, "walker", "NodeRejected").len(), 2);
    controller.stop().await;
}

// ---- the LeastFragmentation policy on the pod kinds seen, and the pool metrics ----

/// The LeastFragmentation controller class.
const LEAST_FRAGMENTATION: &str = "least-fragmentation";

/// A claim of `class` asking `memory` and 10 % compute, and a gated pod using it, pinned to
/// node-0 by its node selector.
fn sized_gpu_pod(fake: &FakeApi, name: &str, class: &str, memory: &str) {
    sized_claim(fake, name, class, memory);
    let extra = json!({
        "nodeSelector": {"kubernetes.io/hostname": "node-0"},
        "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
        "schedulingGates": [{"name": kerf_api::controller_claims::SCHEDULING_GATE}],
    });
    fake.insert(pod_value(name, "", extra, json!({"phase": "Pending"})));
}

/// Waits for claim `name` to be allocated and returns its device.
async fn device_of(fake: &FakeApi, name: &str) -> String {
    placed_on(fake, name).await;
    let claim = get_claim(fake, name).unwrap();
    claim["status"]["allocation"]["devices"]["results"][0]["device"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// node-0 and node-1 in node pools `a` and `b`, the classes and the LeastFragmentation
/// class, and the claim controller measuring the pools every 50 ms.
async fn pools_cluster() -> (FakeApi, Arc<Context>, Registry, ClaimController) {
    let fake = FakeApi::new();
    for (node, pool) in [("node-0", "a"), ("node-1", "b")] {
        gpu_node(&fake, node, allocatable());
        let mut labelled = fake.get(&format!("/api/v1/nodes/{node}")).unwrap();
        labelled["metadata"]["labels"]["node.kubernetes.io/instance-type"] = json!(pool);
        fake.insert(labelled);
    }
    classes(&fake);
    device_class(
        &fake,
        LEAST_FRAGMENTATION,
        Allocator::Controller,
        PlacementPolicy::LeastFragmentation,
    );
    let config = ControllerConfig {
        claims: claims::ClaimSettings {
            fragmentation_interval: Duration::from_millis(50),
            ..settings()
        },
        ..ControllerConfig::new(DRIVER)
    };
    let Watched { context, registry } = Watched::start(&fake, config).await;
    let ctx = Arc::new(context);
    let controller = ClaimController::start(&fake, Arc::clone(&ctx));
    (fake, ctx, registry, controller)
}

/// The value of the series `name{pool="<pool>"}`, if it is there.
fn pool_gauge(registry: &Registry, name: &str, pool: &str) -> Option<f64> {
    let series = format!(r#"{name}{{pool="{pool}"}} "#);
    metrics_text(registry)
        .lines()
        .find_map(|line| line.strip_prefix(&series))
        .map(|value| value.parse().unwrap())
}

#[tokio::test]
async fn least_fragmentation_keeps_room_for_the_pod_kinds_seen() {
    let (fake, _ctx, _registry, controller) = pools_cluster().await;
    sized_gpu_pod(&fake, "first", LEAST_FRAGMENTATION, "30Gi");
    let first = device_of(&fake, "first").await;
    // A second 30Gi slice beside the first would leave that H100 (79.6GiB) less than 20GiB,
    // too little for the kind seen; on an idle GPU both keep room for another 30Gi.
    sized_gpu_pod(&fake, "second", LEAST_FRAGMENTATION, "30Gi");
    let second = device_of(&fake, "second").await;
    assert_ne!(second, first);
    // BinPack, by contrast, fills a used GPU.
    sized_gpu_pod(&fake, "packed", SLICES, "30Gi");
    let packed = device_of(&fake, "packed").await;
    assert!(packed == first || packed == second, "{packed}");
    controller.stop().await;
}

#[tokio::test]
async fn each_node_pool_reports_its_free_and_fragmented_gpus() {
    let (fake, _ctx, registry, controller) = pools_cluster().await;
    // 75Gi of an H100's 79.6GiB: what is left is free but too small for the only kind seen.
    sized_gpu_pod(&fake, "big", LEAST_FRAGMENTATION, "75Gi");
    device_of(&fake, "big").await;
    let fragmented = "kerf_controller_pool_fragmented_gpus";
    eventually("the pools measured", DEADLINE, || async {
        pool_gauge(&registry, fragmented, "a")
            .filter(|gpus| *gpus > 0.0)
            .map(|_| ())
    })
    .await;
    let gauge = |name: &str, pool: &str| pool_gauge(&registry, name, pool).unwrap();
    let free = "kerf_controller_pool_free_gpus";
    // Seven idle GPUs and what the slice left of the eighth, all of it fragment.
    let left = gauge(free, "a") - 7.0;
    assert!(left > 0.05 && left < 0.07, "{left}");
    assert!((gauge(fragmented, "a") - left).abs() < 1e-9);
    assert!(gauge(fragmented, "b").abs() < 1e-9);
    assert!((gauge(free, "b") - 8.0).abs() < 1e-9);
    assert!((gauge("kerf_controller_pool_nodes", "a") - 1.0).abs() < 1e-9);
    controller.stop().await;
}
