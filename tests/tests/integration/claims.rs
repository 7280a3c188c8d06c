//! The ResourceClaim allocation controller against the in-memory API server: the real
//! controller (`claims::run` under `Process::run`, leader election off) on four nodes of
//! 8 × H100 each, with kerf's ResourceSlices and controller-class DeviceClasses as the GpuClass
//! reconciler writes them. Tests poll the fake for outcomes with a deadline; nothing is timed.
#![allow(
    clippy::needless_pass_by_value,
    reason = "fixtures take JSON values as the tests write them inline"
)]

use crate::common::claim_cluster;

use std::collections::BTreeMap;
use std::time::Duration;

use claim_cluster::{
    CLAIMS, Controller, DRIVER, NODES, NS, PODS, SLICES, WHOLE, allocation, classes, cluster,
    condition, get_claim, node, settings, slices,
};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kerf_api::controller_claims::ALLOCATED_DEVICES_ANNOTATION;
use kerf_api::decode_opaque;
use kerf_api::params::{Allocator, OpaqueConfig, PlacementPolicy, SharingConfig};
use kerf_controller::claims::{self, ALLOCATED_NODE_ANNOTATION, FINALIZER};
use kerf_core::enforcement::Enforcement;
use kerf_core::sharing::Sharing;
use kerf_tests::fake_api::FakeApi;
use kerf_tests::wait::eventually;
use kube::Api;
use kube::api::DeleteParams;
use serde_json::{Value, json};

const GIB: u64 = 1 << 30;
/// NVML's memory of the mock H100.
const H100_BYTES: u64 = 81559 << 20;
const EVENTS: &str = "/apis/events.k8s.io/v1/events";
const DEADLINE: Duration = Duration::from_secs(10);

// ---- cluster fixtures ----

/// A claim of `count` GPUs of `class`, with GpuClaimParameters `params` when given.
fn claim(fake: &FakeApi, name: &str, class: &str, count: u32, params: Option<Value>) {
    let config = params.map_or_else(Vec::new, |fields| {
        let mut parameters =
            json!({"apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters"});
        if let (Some(target), Value::Object(fields)) = (parameters.as_object_mut(), fields) {
            target.extend(fields);
        }
        vec![json!({"opaque": {"driver": DRIVER, "parameters": parameters}})]
    });
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": class, "count": count, "allocationMode": "ExactCount"}}],
            "config": config,
        }},
    }));
}

/// How a pod refers to a claim.
enum Uses<'a> {
    /// `resourceClaimName`.
    Claim(&'a str),
    /// `resourceClaimTemplateName`, with the claim the kube-controller-manager generated.
    Template(&'a str, &'a str),
}

/// An unscheduled pod using `claims`; `spec` is merged into its spec.
fn pod(fake: &FakeApi, name: &str, claims: &[Uses<'_>], spec: Value) {
    let mut refs = Vec::new();
    let mut statuses = Vec::new();
    for (i, uses) in claims.iter().enumerate() {
        let ref_name = format!("c{i}");
        match uses {
            Uses::Claim(claim) => refs.push(json!({"name": ref_name, "resourceClaimName": claim})),
            Uses::Template(template, generated) => {
                refs.push(json!({"name": ref_name, "resourceClaimTemplateName": template}));
                statuses.push(json!({"name": ref_name, "resourceClaimName": generated}));
            }
        }
    }
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
        "status": {"phase": "Pending", "resourceClaimStatuses": statuses},
    }));
}

// ---- observing the fake ----

/// The `(pool, device)` of each result of the claim's allocation.
fn devices(claim: &Value) -> Vec<(String, String)> {
    allocation(claim)
        .and_then(|a| a.pointer("/devices/results"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r["pool"].as_str().unwrap().to_owned(),
                r["device"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// The node all of the claim's devices are on.
fn node_of(claim: &Value) -> String {
    let nodes: Vec<String> = devices(claim).into_iter().map(|(pool, _)| pool).collect();
    assert!(!nodes.is_empty(), "not allocated: {claim}");
    assert!(nodes.iter().all(|n| *n == nodes[0]), "{nodes:?}");
    nodes[0].clone()
}

/// Waits until claim `name` is allocated and returns it.
async fn allocated(fake: &FakeApi, name: &str) -> Value {
    eventually(&format!("claim {name} allocated"), DEADLINE, || async {
        get_claim(fake, name).filter(|c| allocation(c).is_some())
    })
    .await
}

fn finalizers(claim: &Value) -> Vec<String> {
    claim
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|f| f.as_str().unwrap().to_owned())
        .collect()
}

/// Events about object `name` with `reason`.
fn events(fake: &FakeApi, name: &str, reason: &str) -> Vec<Value> {
    fake.list(EVENTS)
        .into_iter()
        .filter(|e| e["regarding"]["name"] == name && e["reason"] == reason)
        .collect()
}

async fn event(fake: &FakeApi, name: &str, reason: &str) -> Value {
    eventually(
        &format!("a {reason} Event about {name}"),
        DEADLINE,
        || async { events(fake, name, reason).into_iter().next() },
    )
    .await
}

async fn condition_is(fake: &FakeApi, pod: &str, status: &str, reason: &str) -> Value {
    eventually(
        &format!("condition {status}/{reason} on pod {pod}"),
        DEADLINE,
        || async {
            condition(fake, pod).filter(|c| c["status"] == status && c["reason"] == reason)
        },
    )
    .await
}

/// Writes (PATCH/PUT/POST) to claim `name` or its status so far.
fn writes_to(fake: &FakeApi, name: &str) -> Vec<String> {
    let path = format!("{CLAIMS}/{name}");
    fake.requests()
        .into_iter()
        .filter(|r| r.path == path || r.path == format!("{path}/status"))
        .filter(|r| !matches!(r.verb, "get" | "list" | "watch"))
        .map(|r| format!("{} {}", r.method, r.path))
        .collect()
}

/// Asserts that no GPU is over-committed by the allocations in the fake: a GPU held whole
/// has no other holder, and the slices on a GPU fit its memory and compute.
fn assert_no_overcommit(fake: &FakeApi) {
    let claims: Vec<ResourceClaim> = fake.list_resources(None);
    let mut whole: BTreeMap<(String, String), u32> = BTreeMap::new();
    let mut sliced: BTreeMap<(String, String), (u64, u32, u32)> = BTreeMap::new();
    for claim in &claims {
        for device in kerf_api::allocation::device_uses(claim, DRIVER) {
            let key = (device.node.clone(), device.device.clone());
            match device.kind {
                kerf_core::alloc::UseKind::Whole => *whole.entry(key).or_default() += 1,
                kerf_core::alloc::UseKind::Slice {
                    memory_bytes,
                    compute_percent,
                    ..
                } => {
                    let entry = sliced.entry(key).or_default();
                    entry.0 += memory_bytes;
                    entry.1 += u32::from(compute_percent);
                    entry.2 += 1;
                }
            }
        }
    }
    for (device, holders) in &whole {
        assert_eq!(*holders, 1, "{device:?} held whole {holders} times");
        assert!(
            !sliced.contains_key(device),
            "{device:?} held whole and sliced"
        );
    }
    for (device, (memory, compute, count)) in &sliced {
        assert!(*memory <= H100_BYTES, "{device:?}: {memory} bytes");
        assert!(*compute <= 100, "{device:?}: {compute}%");
        assert!(*count <= 7, "{device:?}: {count} slices");
    }
}

fn slice_params(memory: &str, compute: u8) -> Value {
    json!({"memory": memory, "compute": compute})
}

// ---- scenarios ----

#[tokio::test]
async fn a_pods_two_claims_are_allocated_together_on_one_node() {
    let fake = cluster();
    claim(&fake, "train", SLICES, 1, Some(slice_params("20Gi", 25)));
    // Generated from a template by the kube-controller-manager.
    claim(&fake, "p1-gpu-x7k2q", SLICES, 1, None);
    pod(
        &fake,
        "p1",
        &[
            Uses::Claim("train"),
            Uses::Template("whole-gpu", "p1-gpu-x7k2q"),
        ],
        json!({}),
    );
    let controller = Controller::start(&fake);

    let first = allocated(&fake, "train").await;
    let second = allocated(&fake, "p1-gpu-x7k2q").await;
    let node = node_of(&first);
    assert_eq!(node_of(&second), node, "one node for the pod");
    let (_, sliced_gpu) = devices(&first)[0].clone();
    let (_, whole_gpu) = devices(&second)[0].clone();
    assert_ne!(sliced_gpu, whole_gpu, "a whole GPU is not shared");

    for (claim, name) in [(&first, "train"), (&second, "p1-gpu-x7k2q")] {
        let allocation = allocation(claim).unwrap();
        let results = allocation["devices"]["results"].as_array().unwrap();
        assert_eq!(results.len(), 1);
        assert_eq!(results[0]["driver"], DRIVER);
        assert_eq!(results[0]["pool"], node.as_str());
        assert_eq!(results[0]["request"], "gpu");
        let config = &allocation["devices"]["config"][0];
        assert_eq!(config["source"], "FromClaim");
        assert_eq!(config["opaque"]["driver"], DRIVER);
        let OpaqueConfig::Slice(slice) =
            decode_opaque(&config["opaque"]["parameters"], "parameters").unwrap()
        else {
            panic!("not a GpuSliceAllocation: {config}");
        };
        assert_eq!(slice.devices.len(), 1);
        assert_eq!(slice.devices[0].pool, node);
        assert!(slice.devices[0].gpu_uuid.starts_with("GPU-"));
        if name == "train" {
            assert_eq!(slice.devices[0].memory_bytes, Some(20 * GIB));
            assert_eq!(slice.devices[0].compute_percent, Some(25));
        } else {
            assert!(slice.devices[0].memory_bytes.is_none(), "whole GPU");
        }
        assert_eq!(
            allocation["nodeSelector"],
            json!({"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}
            ]}]})
        );
        assert!(
            allocation["allocationTimestamp"].is_string(),
            "allocationTimestamp is required by 1.36+ schedulers: {allocation}"
        );
        assert_eq!(finalizers(claim), [FINALIZER]);
        assert_eq!(
            claim["metadata"]["annotations"][ALLOCATED_NODE_ANNOTATION],
            node.as_str()
        );
        // The finalizer is written before the allocation.
        let writes = writes_to(&fake, name);
        let marked = writes.iter().position(|w| !w.ends_with("/status"));
        let allocated = writes.iter().position(|w| w.ends_with("/status"));
        assert!(marked < allocated, "{writes:?}");
        assert_eq!(writes.len(), 2, "one mark, one allocation: {writes:?}");

        // What was allocated, in words, in the mark patch: no Event write per claim.
        let note = claim["metadata"]["annotations"][ALLOCATED_DEVICES_ANNOTATION]
            .as_str()
            .unwrap();
        assert!(
            note.contains(&format!("allocated on node {node}")),
            "{note}"
        );
        assert!(events(&fake, name, "Allocated").is_empty());
    }
    assert!(
        get_claim(&fake, "train").unwrap()["metadata"]["annotations"][ALLOCATED_DEVICES_ANNOTATION]
            .as_str()
            .unwrap()
            .contains("20480 MiB, 25% compute")
    );
    // The happy path writes no pod condition: the claims' Events and the allocation say it.
    assert_eq!(condition(&fake, "p1"), None);
    assert_no_overcommit(&fake);
    controller.stop().await;
}

#[tokio::test]
async fn nothing_fits_is_explained_and_nothing_is_written_to_the_claim() {
    let fake = cluster();
    claim(&fake, "huge", SLICES, 9, None);
    pod(&fake, "p", &[Uses::Claim("huge")], json!({}));
    let controller = Controller::start(&fake);

    let warning = event(&fake, "huge", "Unplaceable").await;
    assert_eq!(warning["type"], "Warning");
    let note = warning["note"].as_str().unwrap().to_owned();
    assert!(
        note.starts_with(
            "0/4 nodes are available: 4 cannot allocate all claims. \
             claim huge: request \"gpu\": no node has 9 GPUs"
        ),
        "{note}"
    );
    assert!(note.contains("; best: node-0 has 8"), "{note}");
    assert!(
        fake.count("post", "/apis/events.k8s.io/v1/namespaces/default/events") >= 1,
        "events.k8s.io/v1 Events"
    );
    let condition = condition_is(&fake, "p", "False", "Unplaceable").await;
    assert_eq!(condition["message"], note.as_str());
    let pod_warning = event(&fake, "p", "Unplaceable").await;
    assert_eq!(pod_warning["regarding"]["kind"], "Pod");

    // It tries again (unplaceable_retry) and still writes nothing to the claim.
    eventually("a retry", DEADLINE, || async {
        (fake.count("post", "/apis/events.k8s.io") + fake.count("patch", "/apis/events.k8s.io")
            >= 3)
            .then_some(())
    })
    .await;
    assert_eq!(writes_to(&fake, "huge"), Vec::<String>::new());
    let claim = get_claim(&fake, "huge").unwrap();
    assert!(finalizers(&claim).is_empty());
    assert!(allocation(&claim).is_none());
    controller.stop().await;
}

/// A claim `name` of the scheduler class that kube-scheduler allocated `gpu` of `node` to
/// (whole, no finalizer of kerf's).
fn scheduler_allocated(fake: &FakeApi, name: &str, node: &str, gpu: &str) {
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": WHOLE}}]}},
        "status": {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": gpu}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]},
        }},
    }));
}

#[tokio::test]
async fn a_claim_yields_a_gpu_the_scheduler_allocated_and_is_placed_again() {
    let fake = cluster();
    claim(&fake, "mine", SLICES, 1, None);
    pod(&fake, "p", &[Uses::Claim("mine")], json!({}));
    let controller = Controller::start(&fake);
    let before = allocated(&fake, "mine").await;
    let (node, gpu) = devices(&before)[0].clone();

    // The scheduler, not yet seeing our allocation, gives the same GPU to another claim.
    scheduler_allocated(&fake, "theirs", &node, &gpu);

    let yielded = event(&fake, "mine", "Deallocated").await;
    let note = yielded["note"].as_str().unwrap();
    assert!(
        note.contains(&format!(
            "the scheduler allocated {node}/{gpu} exclusively to claim default/theirs"
        )),
        "{note}"
    );
    let after = eventually("the claim placed again", DEADLINE, || async {
        get_claim(&fake, "mine").filter(|c| {
            let placed = devices(c);
            !placed.is_empty() && placed[0] != (node.clone(), gpu.clone())
        })
    })
    .await;
    assert_eq!(finalizers(&after), [FINALIZER]);
    let theirs = get_claim(&fake, "theirs").unwrap();
    assert!(
        finalizers(&theirs).is_empty(),
        "the scheduler's claim is left alone"
    );
    assert_eq!(devices(&theirs), [(node, gpu)]);
    assert_no_overcommit(&fake);
    controller.stop().await;
}

/// What the scheduler does when an allocation's node does not fit the pod.
fn clear_allocation_behind_our_back(fake: &FakeApi, name: &str) {
    let mut claim = get_claim(fake, name).unwrap();
    claim["status"]
        .as_object_mut()
        .unwrap()
        .remove("allocation");
    fake.insert(claim);
}

#[tokio::test]
async fn a_node_the_scheduler_rejected_is_avoided_for_the_pod() {
    let fake = cluster();
    claim(&fake, "c", SLICES, 1, Some(slice_params("10Gi", 10)));
    pod(&fake, "p", &[Uses::Claim("c")], json!({}));
    let controller = Controller::start(&fake);
    let first = allocated(&fake, "c").await;
    let rejected = node_of(&first);

    clear_allocation_behind_our_back(&fake, "c");

    let warning = event(&fake, "c", "NodeRejected").await;
    assert_eq!(warning["type"], "Warning");
    assert!(
        warning["note"]
            .as_str()
            .unwrap()
            .contains(&format!("on node {rejected}")),
        "{warning}"
    );
    // BinPack on otherwise empty nodes would pick the same node again.
    let again = allocated(&fake, "c").await;
    let node = node_of(&again);
    assert_ne!(node, rejected);
    assert_eq!(
        again["metadata"]["annotations"][ALLOCATED_NODE_ANNOTATION],
        node.as_str()
    );
    assert_eq!(finalizers(&again), [FINALIZER]);
    controller.stop().await;
}

#[tokio::test]
async fn a_rejected_claim_takes_the_pods_other_claims_along_to_the_new_node() {
    let fake = cluster();
    claim(&fake, "a", SLICES, 1, Some(slice_params("10Gi", 10)));
    claim(&fake, "b", SLICES, 2, None);
    pod(&fake, "p", &[Uses::Claim("a"), Uses::Claim("b")], json!({}));
    let controller = Controller::start(&fake);
    allocated(&fake, "a").await;
    let rejected = node_of(&allocated(&fake, "b").await);

    // The scheduler clears only one of them.
    clear_allocation_behind_our_back(&fake, "a");

    let (a, b) = eventually("both claims on another node", DEADLINE, || async {
        let a = get_claim(&fake, "a")?;
        let b = get_claim(&fake, "b")?;
        let moved = |c: &Value| {
            let placed = devices(c);
            !placed.is_empty() && placed.iter().all(|(pool, _)| *pool != rejected)
        };
        (moved(&a) && moved(&b)).then_some((a, b))
    })
    .await;
    assert_eq!(node_of(&a), node_of(&b));
    assert_no_overcommit(&fake);
    controller.stop().await;
}

#[tokio::test]
async fn a_deleted_claim_is_let_go_and_its_gpus_are_reused() {
    let fake = cluster();
    let on_node_0 = json!({"nodeSelector": {"kubernetes.io/hostname": "node-0"}});
    claim(&fake, "all-eight", SLICES, 8, None);
    pod(
        &fake,
        "first",
        &[Uses::Claim("all-eight")],
        on_node_0.clone(),
    );
    // No periodic retry within the test: the freed capacity itself must wake the waiting pod.
    let controller = Controller::start_with(
        &fake,
        claims::ClaimSettings {
            unplaceable_retry: Duration::from_secs(3600),
            ..settings()
        },
    );
    assert_eq!(node_of(&allocated(&fake, "all-eight").await), "node-0");

    claim(&fake, "one-more", SLICES, 1, None);
    pod(&fake, "second", &[Uses::Claim("one-more")], on_node_0);
    let warning = event(&fake, "one-more", "Unplaceable").await;
    assert!(
        warning["note"].as_str().unwrap().starts_with(
            "0/4 nodes are available: 1 cannot allocate all claims, \
             3 node(s) didn't match Pod's node affinity/selector. claim one-more: "
        ),
        "{warning}"
    );

    // The claim is deleted before the pod was scheduled.
    let claims: Api<ResourceClaim> = Api::namespaced(fake.client(), NS);
    claims
        .delete("all-eight", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the deleted claim gone", DEADLINE, || async {
        get_claim(&fake, "all-eight").is_none().then_some(())
    })
    .await;
    let reused = allocated(&fake, "one-more").await;
    assert_eq!(node_of(&reused), "node-0");
    // The False condition the wait left is turned True, not left behind.
    let flipped = condition_is(&fake, "second", "True", "Allocated").await;
    assert!(
        flipped["message"]
            .as_str()
            .unwrap()
            .contains("on node node-0"),
        "{flipped}"
    );
    assert_eq!(
        condition(&fake, "first"),
        None,
        "a pod allocated at the first attempt gets no condition"
    );
    assert_no_overcommit(&fake);
    controller.stop().await;
}

#[tokio::test]
async fn a_claim_no_pod_uses_any_more_is_deallocated_and_released() {
    let fake = cluster();
    claim(&fake, "c", SLICES, 1, Some(slice_params("8Gi", 10)));
    pod(&fake, "p", &[Uses::Claim("c")], json!({}));
    let controller = Controller::start(&fake);
    allocated(&fake, "c").await;

    fake.remove(&format!("{PODS}/p"));
    let released = eventually("the claim deallocated and released", DEADLINE, || async {
        get_claim(&fake, "c").filter(|c| allocation(c).is_none() && finalizers(c).is_empty())
    })
    .await;
    assert!(
        released["metadata"]["annotations"]
            .get(ALLOCATED_NODE_ANNOTATION)
            .is_none(),
        "{released}"
    );
    let note = event(&fake, "c", "Deallocated").await;
    assert!(
        note["note"]
            .as_str()
            .unwrap()
            .contains("no pod uses the claim")
    );

    // Released claims stay released: the controller does not loop on them. A new pod is the
    // barrier: once it is served, the released claim's reconciles are long done.
    let settled = writes_to(&fake, "c").len();
    claim(&fake, "barrier", SLICES, 1, None);
    pod(&fake, "barrier", &[Uses::Claim("barrier")], json!({}));
    allocated(&fake, "barrier").await;
    assert_eq!(
        writes_to(&fake, "c").len(),
        settled,
        "{:?}",
        writes_to(&fake, "c")
    );
    controller.stop().await;
}

#[tokio::test]
async fn a_conflicting_write_is_retried_and_nothing_is_allocated_twice() {
    let fake = cluster();
    // A first status write of "contested" fails as if someone changed the claim meanwhile.
    fake.fail_next("PATCH", &format!("{CLAIMS}/contested/status"), 409, 1);
    claim(&fake, "contested", SLICES, 2, None);
    pod(&fake, "p-contested", &[Uses::Claim("contested")], json!({}));
    // Many pods at once, whole GPUs and slices, on BinPack and Spread classes.
    let mut names = vec!["contested".to_owned()];
    for i in 0..8 {
        let name = format!("whole-{i}");
        claim(
            &fake,
            &name,
            if i % 2 == 0 { SLICES } else { "spread" },
            2,
            None,
        );
        pod(
            &fake,
            &format!("p-{name}"),
            &[Uses::Claim(&name)],
            json!({}),
        );
        names.push(name);
    }
    for i in 0..12 {
        let name = format!("slice-{i}");
        claim(&fake, &name, SLICES, 1, Some(slice_params("30Gi", 30)));
        pod(
            &fake,
            &format!("p-{name}"),
            &[Uses::Claim(&name)],
            json!({}),
        );
        names.push(name);
    }
    let controller = Controller::start(&fake);
    for name in &names {
        allocated(&fake, name).await;
    }
    assert_no_overcommit(&fake);

    let status_writes = writes_to(&fake, "contested")
        .into_iter()
        .filter(|w| w.ends_with("/status"))
        .count();
    assert_eq!(status_writes, 2, "one refused, one that landed");
    let contested = get_claim(&fake, "contested").unwrap();
    assert!(
        contested["metadata"]["annotations"][ALLOCATED_DEVICES_ANNOTATION]
            .as_str()
            .is_some_and(|note| note.starts_with("allocated on node")),
        "{contested}"
    );
    assert_eq!(devices(&contested).len(), 2);
    assert_eq!(finalizers(&contested), [FINALIZER]);
    controller.stop().await;
}

#[tokio::test]
async fn invalid_parameters_are_reported_with_the_field_and_nothing_is_allocated() {
    let fake = cluster();
    claim(
        &fake,
        "bad",
        SLICES,
        1,
        Some(json!({"memory": "10Gi", "colour": "red"})),
    );
    pod(&fake, "p", &[Uses::Claim("bad")], json!({}));
    let controller = Controller::start(&fake);

    let warning = event(&fake, "bad", "InvalidParameters").await;
    assert_eq!(warning["type"], "Warning");
    let note = warning["note"].as_str().unwrap();
    assert!(
        note.starts_with("spec.devices.config[0].opaque.parameters.colour: unknown field `colour`"),
        "{note}"
    );
    let condition = condition_is(&fake, "p", "False", "InvalidParameters").await;
    assert!(
        condition["message"]
            .as_str()
            .unwrap()
            .contains("claim bad: "),
        "{condition}"
    );
    // A barrier pod: once it is allocated, the invalid claim had every chance to be touched.
    claim(&fake, "good", SLICES, 1, None);
    pod(&fake, "q", &[Uses::Claim("good")], json!({}));
    allocated(&fake, "good").await;
    assert_eq!(writes_to(&fake, "bad"), Vec::<String>::new());
    let bad = get_claim(&fake, "bad").unwrap();
    assert!(allocation(&bad).is_none());
    assert!(finalizers(&bad).is_empty());
    controller.stop().await;
}

#[tokio::test]
async fn claims_of_other_classes_and_idle_claims_are_left_alone() {
    let fake = cluster();
    // A pod with a scheduler-class claim next to a controller claim, a pod with only
    // scheduler-class claims, and a controller claim that no pod uses.
    claim(&fake, "sched-1", WHOLE, 1, None);
    claim(&fake, "sched-2", WHOLE, 1, None);
    claim(&fake, "other-driver", "nvidia-gpus", 1, None);
    claim(&fake, "idle", SLICES, 1, None);
    claim(&fake, "mine", SLICES, 1, None);
    pod(
        &fake,
        "mixed",
        &[Uses::Claim("mine"), Uses::Claim("sched-1")],
        json!({}),
    );
    pod(
        &fake,
        "theirs",
        &[Uses::Claim("sched-2"), Uses::Claim("other-driver")],
        json!({}),
    );
    let controller = Controller::start(&fake);
    allocated(&fake, "mine").await;
    // A second round as a barrier.
    claim(&fake, "barrier", SLICES, 1, None);
    pod(&fake, "barrier", &[Uses::Claim("barrier")], json!({}));
    allocated(&fake, "barrier").await;

    for name in ["sched-1", "sched-2", "other-driver", "idle"] {
        assert_eq!(writes_to(&fake, name), Vec::<String>::new(), "{name}");
        let claim = get_claim(&fake, name).unwrap();
        assert!(finalizers(&claim).is_empty(), "{name}");
    }
    assert!(condition(&fake, "theirs").is_none());
    controller.stop().await;
}

#[tokio::test]
async fn placement_honours_node_selector_taints_and_readiness() {
    let fake = FakeApi::new();
    node(&fake, "node-0", json!({"zone": "a"}), json!([]), true);
    node(&fake, "node-1", json!({"zone": "b"}), json!([]), true);
    node(
        &fake,
        "node-2",
        json!({"zone": "b"}),
        json!([{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]),
        true,
    );
    node(&fake, "node-3", json!({"zone": "b"}), json!([]), false);
    for name in NODES {
        slices(&fake, name);
    }
    classes(&fake);
    let zone_b = json!({"nodeSelector": {"zone": "b"}});
    for name in ["four-a", "four-b", "four-c"] {
        claim(&fake, name, "spread", 4, None);
    }
    pod(&fake, "p-a", &[Uses::Claim("four-a")], zone_b.clone());
    pod(&fake, "p-b", &[Uses::Claim("four-b")], zone_b.clone());
    let controller = Controller::start(&fake);

    // Spread would use idle nodes first; only node-1 qualifies.
    assert_eq!(node_of(&allocated(&fake, "four-a").await), "node-1");
    assert_eq!(node_of(&allocated(&fake, "four-b").await), "node-1");

    pod(&fake, "p-c", &[Uses::Claim("four-c")], zone_b.clone());
    let warning = event(&fake, "four-c", "Unplaceable").await;
    let note = warning["note"].as_str().unwrap();
    // kube-scheduler's words (`FitError`), counted and sorted; kerf's allocator follows.
    assert!(
        note.starts_with(
            "0/4 nodes are available: 1 cannot allocate all claims, \
             1 node(s) didn't match Pod's node affinity/selector, \
             1 node(s) had untolerated taint(s), 1 node(s) were not Ready. claim four-c: "
        ),
        "{note}"
    );

    // A pod that tolerates the taint goes to node-2.
    claim(&fake, "tolerant", "spread", 4, None);
    let mut tolerant = zone_b;
    tolerant["tolerations"] =
        json!([{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]);
    pod(&fake, "p-tolerant", &[Uses::Claim("tolerant")], tolerant);
    assert_eq!(node_of(&allocated(&fake, "tolerant").await), "node-2");
    assert!(allocation(&get_claim(&fake, "four-c").unwrap()).is_none());
    assert_no_overcommit(&fake);
    controller.stop().await;
}

#[tokio::test]
async fn a_claim_reserved_by_a_pod_is_released_only_after_the_reservation_ends() {
    let fake = cluster();
    claim(&fake, "c", SLICES, 1, None);
    pod(&fake, "p", &[Uses::Claim("c")], json!({}));
    let controller = Controller::start(&fake);
    let mut reserved = allocated(&fake, "c").await;
    let node = node_of(&reserved);
    // The scheduler reserves the claim for the pod and binds the pod.
    let pod_uid = fake.get(&format!("{PODS}/p")).unwrap()["metadata"]["uid"].clone();
    reserved["status"]["reservedFor"] = json!([{"resource": "pods", "name": "p", "uid": pod_uid}]);
    fake.insert(reserved);
    let mut bound = fake.get(&format!("{PODS}/p")).unwrap();
    bound["spec"]["nodeName"] = json!(node);
    bound["status"]["phase"] = json!("Running");
    fake.insert(bound);

    let claims: Api<ResourceClaim> = Api::namespaced(fake.client(), NS);
    claims.delete("c", &DeleteParams::default()).await.unwrap();
    // A barrier pod: once it is served, the deleted claim has been reconciled.
    claim(&fake, "barrier", SLICES, 1, None);
    pod(&fake, "barrier", &[Uses::Claim("barrier")], json!({}));
    allocated(&fake, "barrier").await;
    let deleting = get_claim(&fake, "c").expect("kept while reserved");
    assert!(deleting["metadata"]["deletionTimestamp"].is_string());
    assert_eq!(finalizers(&deleting), [FINALIZER]);
    assert!(
        allocation(&deleting).is_some(),
        "the running pod keeps its GPU"
    );

    // The pod finishes and the kube-controller-manager drops the reservation.
    let mut done = fake.get(&format!("{PODS}/p")).unwrap();
    done["status"]["phase"] = json!("Succeeded");
    fake.insert(done);
    let mut unreserved = get_claim(&fake, "c").unwrap();
    unreserved["status"]
        .as_object_mut()
        .unwrap()
        .remove("reservedFor");
    fake.insert(unreserved);
    eventually("the claim gone", DEADLINE, || async {
        get_claim(&fake, "c").is_none().then_some(())
    })
    .await;
    controller.stop().await;
}

#[tokio::test]
async fn a_template_claim_is_allocated_once_the_pod_names_it() {
    let fake = cluster();
    // The pod exists before the kube-controller-manager created its template claim.
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": NS},
        "spec": {"containers": [{"name": "main", "image": "busybox"}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "tpl"}]},
        "status": {"phase": "Pending"},
    }));
    let controller = Controller::start(&fake);
    claim(
        &fake,
        "p-gpu-abcde",
        SLICES,
        1,
        Some(slice_params("4Gi", 5)),
    );
    let mut named = fake.get(&format!("{PODS}/p")).unwrap();
    named["status"]["resourceClaimStatuses"] =
        json!([{"name": "gpu", "resourceClaimName": "p-gpu-abcde"}]);
    fake.insert(named);
    let claim = allocated(&fake, "p-gpu-abcde").await;
    assert_eq!(devices(&claim).len(), 1);
    assert_eq!(condition(&fake, "p"), None);
    controller.stop().await;
}

#[tokio::test]
async fn a_claim_changed_while_it_is_being_marked_is_not_overwritten() {
    let fake = cluster();
    let path = format!("{CLAIMS}/raced");
    // Hold the first write (the finalizer and node) long enough to change the claim under it.
    fake.delay_next("PATCH", &path, Duration::from_millis(500), 1);
    claim(&fake, "raced", SLICES, 1, None);
    pod(&fake, "p", &[Uses::Claim("raced")], json!({}));
    let controller = Controller::start(&fake);
    eventually("the first write in flight", DEADLINE, || async {
        (fake.count("patch", &path) >= 1).then_some(())
    })
    .await;
    let mut changed = get_claim(&fake, "raced").unwrap();
    changed["metadata"]["labels"] = json!({"touched": "yes"});
    fake.insert(changed);

    let claim = allocated(&fake, "raced").await;
    assert_eq!(claim["metadata"]["labels"]["touched"], "yes");
    let writes = writes_to(&fake, "raced");
    let marks = writes.iter().filter(|w| !w.ends_with("/status")).count();
    let allocations = writes.iter().filter(|w| w.ends_with("/status")).count();
    assert!(
        marks >= 2,
        "the stale write was refused and redone: {writes:?}"
    );
    assert_eq!(allocations, 1, "{writes:?}");
    assert_eq!(finalizers(&claim), [FINALIZER]);
    controller.stop().await;
}

#[tokio::test]
async fn the_scheduling_gate_is_removed_once_every_controller_claim_is_allocated() {
    let fake = cluster();
    claim(&fake, "a", SLICES, 1, Some(slice_params("10Gi", 10)));
    claim(&fake, "b", SLICES, 1, Some(slice_params("10Gi", 10)));
    let gates = json!({"schedulingGates": [
        {"name": "example.com/other"},
        {"name": kerf_api::controller_claims::SCHEDULING_GATE},
    ]});
    pod(&fake, "p", &[Uses::Claim("a"), Uses::Claim("b")], gates);
    let controller = Controller::start(&fake);

    let a = allocated(&fake, "a").await;
    let b = allocated(&fake, "b").await;
    assert_eq!(node_of(&a), node_of(&b));
    let pod = eventually("the kerf gate removed", DEADLINE, || async {
        let pod = fake.get(&format!("{PODS}/p"))?;
        let gates = pod["spec"]["schedulingGates"].as_array()?.clone();
        (gates.len() == 1).then_some(pod)
    })
    .await;
    assert_eq!(
        pod["spec"]["schedulingGates"],
        json!([{"name": "example.com/other"}]),
        "only kerf's gate is removed"
    );
    controller.stop().await;
}

#[tokio::test]
async fn a_pod_created_with_a_node_name_is_allocated_on_that_node() {
    let fake = cluster();
    claim(&fake, "pinned", SLICES, 1, Some(slice_params("10Gi", 10)));
    pod(
        &fake,
        "p",
        &[Uses::Claim("pinned")],
        json!({"nodeName": "node-2"}),
    );
    let controller = Controller::start(&fake);

    let claim = allocated(&fake, "pinned").await;
    assert_eq!(node_of(&claim), "node-2");
    controller.stop().await;
}

#[tokio::test]
async fn a_device_in_two_exclusive_allocations_is_reported_on_both_claims_and_pods() {
    let fake = cluster();
    claim(&fake, "mine", SLICES, 1, None);
    pod(&fake, "p", &[Uses::Claim("mine")], json!({}));
    let controller = Controller::start(&fake);
    let before = allocated(&fake, "mine").await;
    let (node, gpu) = devices(&before)[0].clone();
    // The pod has the claim reserved (it may be prepared already): the controller must not
    // take the allocation away, only report.
    let mut reserved = get_claim(&fake, "mine").unwrap();
    let pod_uid = fake.get(&format!("{PODS}/p")).unwrap()["metadata"]["uid"].clone();
    reserved["status"]["reservedFor"] = json!([{"resource": "pods", "name": "p", "uid": pod_uid}]);
    fake.insert(reserved);
    scheduler_allocated(&fake, "theirs", &node, &gpu);

    let on_mine = event(&fake, "mine", "AllocationConflict").await;
    assert_eq!(on_mine["type"], "Warning");
    let note = on_mine["note"].as_str().unwrap();
    assert!(
        note.contains(&format!(
            "device {node}/{gpu} is also allocated to claim default/theirs (by kube-scheduler)"
        )),
        "{note}"
    );
    let on_theirs = event(&fake, "theirs", "AllocationConflict").await;
    assert!(
        on_theirs["note"]
            .as_str()
            .unwrap()
            .contains("default/mine (by kerf-controller)"),
        "{on_theirs}"
    );
    event(&fake, "p", "AllocationConflict").await;
    assert_eq!(
        devices(&get_claim(&fake, "mine").unwrap()),
        [(node, gpu)],
        "a reserved claim keeps its allocation"
    );
    controller.stop().await;
}

// ---- firstAvailable, adminAccess and device taints ----

/// A claim with the raw `requests` and `config` of `spec.devices`.
fn raw_claim(fake: &FakeApi, name: &str, requests: Value, config: Value) {
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": requests, "config": config}},
    }));
}

fn claim_config(requests: &[&str], memory: &str) -> Value {
    json!({"requests": requests, "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters", "memory": memory,
    }}})
}

/// The `request` of each result of the claim's allocation.
fn result_field(claim: &Value, field: &str) -> Vec<Value> {
    allocation(claim)
        .and_then(|a| a.pointer("/devices/results"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|r| r[field].clone())
        .collect()
}

fn on_node_0() -> Value {
    json!({"nodeSelector": {"kubernetes.io/hostname": "node-0"}})
}

#[tokio::test]
async fn a_first_available_claim_gets_the_fallback_when_the_first_choice_fits_nowhere() {
    let fake = cluster();
    // No H100 has 80Gi (81559Mi in all) free, so "big" fits nowhere; "small" does.
    raw_claim(
        &fake,
        "prioritized",
        json!([{"name": "gpu", "firstAvailable": [
            {"name": "big", "deviceClassName": SLICES},
            {"name": "small", "deviceClassName": SLICES},
        ]}]),
        json!([
            claim_config(&["gpu/big"], "80Gi"),
            claim_config(&["gpu/small"], "10Gi")
        ]),
    );
    pod(&fake, "p", &[Uses::Claim("prioritized")], json!({}));
    let controller = Controller::start(&fake);
    let claim = allocated(&fake, "prioritized").await;
    assert_eq!(result_field(&claim, "request"), [json!("gpu/small")]);
    let config = &allocation(&claim).unwrap()["devices"]["config"][0];
    assert_eq!(config["requests"], json!(["gpu/small"]));
    let slice = decode_opaque(&config["opaque"]["parameters"], "parameters").unwrap();
    let OpaqueConfig::Slice(slice) = slice else {
        panic!("{config}")
    };
    assert_eq!(slice.devices[0].memory_bytes, Some(10 * GIB));
    assert_no_overcommit(&fake);
    controller.stop().await;
}

#[tokio::test]
async fn an_admin_access_claim_gets_gpus_other_claims_hold() {
    let fake = cluster();
    claim(&fake, "holder", SLICES, 1, None);
    pod(&fake, "p-holder", &[Uses::Claim("holder")], on_node_0());
    let controller = Controller::start(&fake);
    let held = devices(&allocated(&fake, "holder").await);
    assert_eq!(held[0].0, "node-0");

    raw_claim(
        &fake,
        "monitor",
        json!([{"name": "gpu", "exactly": {"deviceClassName": SLICES, "count": 8, "adminAccess": true}}]),
        json!([]),
    );
    pod(&fake, "p-monitor", &[Uses::Claim("monitor")], on_node_0());
    let monitor = allocated(&fake, "monitor").await;
    let seen = devices(&monitor);
    assert_eq!(seen.len(), 8, "{monitor}");
    assert!(seen.contains(&held[0]), "{seen:?} lacks {held:?}");
    assert!(
        result_field(&monitor, "adminAccess")
            .iter()
            .all(|a| *a == json!(true))
    );

    // The monitor holds nothing: another claim still gets one of node-0's free GPUs.
    claim(&fake, "next", SLICES, 1, None);
    pod(&fake, "p-next", &[Uses::Claim("next")], on_node_0());
    let next = devices(&allocated(&fake, "next").await);
    assert_eq!(next[0].0, "node-0");
    assert_ne!(next[0], held[0]);
    controller.stop().await;
}

/// Taints gpu-0 to gpu-6 of node-0 in its ResourceSlices as the kubelet plugin does.
fn taint_node_0(fake: &FakeApi) {
    for mut slice in fake.list_resources::<ResourceSlice>(None) {
        if slice.spec.node_name.as_deref() != Some("node-0") {
            continue;
        }
        for device in slice.spec.devices.iter_mut().flatten() {
            if device.name != "gpu-7" {
                device.taints = Some(vec![k8s_openapi::api::resource::v1::DeviceTaint {
                    key: "gpu.kerf.dev/unhealthy".to_owned(),
                    value: Some("xid-79".to_owned()),
                    effect: "NoSchedule".to_owned(),
                    time_added: None,
                }]);
            }
        }
        fake.insert_resource(&slice);
    }
}

#[tokio::test]
async fn a_tainted_gpu_is_skipped_unless_the_request_tolerates_it() {
    let fake = cluster();
    taint_node_0(&fake);
    claim(&fake, "plain", SLICES, 1, None);
    pod(&fake, "p-plain", &[Uses::Claim("plain")], on_node_0());
    let controller = Controller::start(&fake);
    assert_eq!(
        devices(&allocated(&fake, "plain").await),
        [("node-0".to_owned(), "gpu-7".to_owned())]
    );

    claim(&fake, "two", SLICES, 2, None);
    pod(&fake, "p-two", &[Uses::Claim("two")], on_node_0());
    let warning = event(&fake, "two", "Unplaceable").await;
    let note = warning["note"].as_str().unwrap();
    assert!(
        note.contains(
            "is tainted gpu.kerf.dev/unhealthy=xid-79:NoSchedule and the request does not tolerate it"
        ),
        "{note}"
    );

    let toleration =
        json!({"key": "gpu.kerf.dev/unhealthy", "operator": "Exists", "effect": "NoSchedule"});
    raw_claim(
        &fake,
        "tolerant",
        json!([{"name": "gpu", "exactly": {"deviceClassName": SLICES, "count": 2, "tolerations": [toleration]}}]),
        json!([]),
    );
    pod(&fake, "p-tolerant", &[Uses::Claim("tolerant")], on_node_0());
    let tolerant = allocated(&fake, "tolerant").await;
    assert_eq!(devices(&tolerant).len(), 2);
    assert!(
        result_field(&tolerant, "tolerations")
            .iter()
            .all(|t| *t == json!([toleration])),
        "{tolerant}"
    );
    assert!(allocation(&get_claim(&fake, "two").unwrap()).is_none());
    controller.stop().await;
}

/// The kerf gate, as the admission webhook puts it on a pod with controller claims.
fn kerf_gate() -> Value {
    json!({"schedulingGates": [{"name": kerf_api::controller_claims::SCHEDULING_GATE}]})
}

/// The `reservedFor` entry of pod `name`.
fn reservation_of(fake: &FakeApi, name: &str) -> Value {
    let uid = fake.get(&format!("{PODS}/{name}")).unwrap()["metadata"]["uid"].clone();
    json!([{"resource": "pods", "name": name, "uid": uid}])
}

#[tokio::test]
async fn a_gated_pods_claim_is_reserved_for_it_in_the_allocation_write() {
    let fake = cluster();
    claim(&fake, "r", SLICES, 1, Some(slice_params("10Gi", 10)));
    pod(&fake, "p", &[Uses::Claim("r")], kerf_gate());
    let controller = Controller::start(&fake);

    let claim = allocated(&fake, "r").await;
    // kube-scheduler's PreBind skips a claim reserved for the pod: one write less per claim.
    assert_eq!(
        claim["status"]["reservedFor"],
        reservation_of(&fake, "p"),
        "{claim}"
    );
    eventually("the kerf gate removed", DEADLINE, || async {
        let pod = fake.get(&format!("{PODS}/p"))?;
        pod["spec"]["schedulingGates"]
            .as_array()
            .is_none_or(Vec::is_empty)
            .then_some(())
    })
    .await;
    let status_writes = writes_to(&fake, "r")
        .into_iter()
        .filter(|w| w.ends_with("/status"))
        .count();
    assert_eq!(status_writes, 1, "{:?}", writes_to(&fake, "r"));
    controller.stop().await;
}

#[tokio::test]
async fn an_ungated_pods_claim_is_left_for_the_scheduler_to_reserve() {
    let fake = cluster();
    claim(&fake, "u", SLICES, 1, Some(slice_params("10Gi", 10)));
    pod(&fake, "p", &[Uses::Claim("u")], json!({}));
    let controller = Controller::start(&fake);

    let claim = allocated(&fake, "u").await;
    assert!(claim["status"].get("reservedFor").is_none(), "{claim}");
    controller.stop().await;
}

#[tokio::test]
async fn a_reserved_allocation_the_scheduler_clears_is_a_rejection() {
    let fake = cluster();
    claim(&fake, "c", SLICES, 1, Some(slice_params("10Gi", 10)));
    pod(&fake, "p", &[Uses::Claim("c")], kerf_gate());
    let controller = Controller::start(&fake);
    let first = allocated(&fake, "c").await;
    assert_eq!(first["status"]["reservedFor"], reservation_of(&fake, "p"));
    let rejected = node_of(&first);

    // kube-scheduler's PostFilter clears a claim reserved for nobody but the pod, allocation
    // and reservation together (`dynamicresources.go`).
    let mut cleared = get_claim(&fake, "c").unwrap();
    let status = cleared["status"].as_object_mut().unwrap();
    status.remove("allocation");
    status.remove("reservedFor");
    fake.insert(cleared);

    let warning = event(&fake, "c", "NodeRejected").await;
    assert!(
        warning["note"]
            .as_str()
            .unwrap()
            .contains(&format!("on node {rejected}")),
        "{warning}"
    );
    let again = allocated(&fake, "c").await;
    assert_ne!(node_of(&again), rejected);
    // The pod is ungated now: kube-scheduler reserves the claim itself.
    assert!(again["status"].get("reservedFor").is_none(), "{again}");
    controller.stop().await;
}

#[tokio::test]
async fn a_claim_reserved_for_a_pod_still_gated_yields_a_conflicting_gpu() {
    let fake = cluster();
    claim(&fake, "mine", SLICES, 1, None);
    pod(&fake, "p", &[Uses::Claim("mine")], kerf_gate());
    // The gate stays: its removal keeps failing, so kube-scheduler never sees the pod.
    fake.fail_next("PATCH", &format!("{PODS}/p"), 500, 10_000);
    let controller = Controller::start(&fake);
    let before = allocated(&fake, "mine").await;
    assert_eq!(before["status"]["reservedFor"], reservation_of(&fake, "p"));
    let (node, gpu) = devices(&before)[0].clone();

    scheduler_allocated(&fake, "theirs", &node, &gpu);

    event(&fake, "mine", "Deallocated").await;
    let after = eventually("the claim placed again", DEADLINE, || async {
        get_claim(&fake, "mine").filter(|c| {
            let placed = devices(c);
            !placed.is_empty() && placed[0] != (node.clone(), gpu.clone())
        })
    })
    .await;
    assert_eq!(after["status"]["reservedFor"], reservation_of(&fake, "p"));
    assert_no_overcommit(&fake);
    controller.stop().await;
}

#[tokio::test]
async fn a_claim_reserved_for_an_ungated_pod_is_in_use() {
    let fake = cluster();
    claim(&fake, "mine", SLICES, 1, None);
    pod(&fake, "p", &[Uses::Claim("mine")], kerf_gate());
    let controller = Controller::start(&fake);
    let before = allocated(&fake, "mine").await;
    let (node, gpu) = devices(&before)[0].clone();
    eventually("the kerf gate removed", DEADLINE, || async {
        let pod = fake.get(&format!("{PODS}/p"))?;
        pod["spec"]["schedulingGates"]
            .as_array()
            .is_none_or(Vec::is_empty)
            .then_some(())
    })
    .await;

    // kube-scheduler may be binding the pod: kerf's allocation stays, and the conflict is
    // reported for a person to resolve.
    scheduler_allocated(&fake, "theirs", &node, &gpu);
    let warning = event(&fake, "mine", "AllocationConflict").await;
    assert!(
        warning["note"]
            .as_str()
            .unwrap()
            .contains("Delete one of the pods"),
        "{warning}"
    );
    assert_eq!(devices(&get_claim(&fake, "mine").unwrap()), [(node, gpu)]);
    assert!(events(&fake, "mine", "Deallocated").is_empty());
    controller.stop().await;
}

/// A controller class of H100 MPS slices (BinPack) that requires `enforcement`.
fn mps_class(fake: &FakeApi, name: &str, enforcement: Enforcement) {
    let mut spec =
        claim_cluster::device_class_spec(Allocator::Controller, PlacementPolicy::BinPack);
    spec.sharing = Some(SharingConfig {
        strategy: Sharing::Mps,
        enforcement,
        ..SharingConfig::default()
    });
    fake.insert_resource(&claim_cluster::device_class_of(name, spec));
}

#[tokio::test]
async fn server_held_slices_keep_their_gpu_to_one_size() {
    let fake = cluster();
    mps_class(&fake, "mps", Enforcement::ClientEnvironment);
    mps_class(&fake, "held", Enforcement::Server);
    let controller = Controller::start(&fake);
    let place = |name: &'static str, class: &'static str, memory: &'static str, compute| {
        let fake = fake.clone();
        async move {
            claim(&fake, name, class, 1, Some(slice_params(memory, compute)));
            pod(
                &fake,
                &format!("pod-{name}"),
                &[Uses::Claim(name)],
                json!({}),
            );
            devices(&allocated(&fake, name).await)[0].clone()
        }
    };
    let mixed = place("a", "mps", "10Gi", 20).await;
    let held = place("b", "held", "10Gi", 25).await;
    assert_ne!(
        held, mixed,
        "a server-held slice does not join another size"
    );
    let other_size = place("c", "mps", "20Gi", 30).await;
    assert_ne!(other_size, held, "nor does another size join it");
    let same_size = place("d", "held", "10Gi", 25).await;
    assert_eq!(same_size, held, "its own size packs onto it");

    let claim = get_claim(&fake, "b").unwrap();
    let config = &allocation(&claim).unwrap()["devices"]["config"][0];
    assert_eq!(
        config["opaque"]["parameters"]["devices"][0]["enforcement"], "Server",
        "the requirement survives a controller restart: {config}"
    );
    assert_no_overcommit(&fake);
    controller.stop().await;
}
