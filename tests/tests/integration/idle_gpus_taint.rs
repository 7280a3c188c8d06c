//! kerf-controller's `PreferNoSchedule` taint `gpu.kerf.dev/idle-gpus` against the in-memory
//! API server, with the controller's own RBAC identity: on every node with an idle GPU, off a
//! node whose GPUs are all in use, other writers' taints kept, and taken off everywhere when
//! the controller runs with the taint switched off.

use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::alloc::{IDLE_GPUS_TAINT_EFFECT, IDLE_GPUS_TAINT_KEY};
use kerf_tests::fake_api::FakeApi;
use kerf_tests::wait::eventually;
use kube::Api;
use kube::api::DeleteParams;
use serde_json::{Value, json};

use crate::common::claim_cluster::{
    Controller, NS, SLICES, allocation, classes, get_claim, gpu_nodes, node, settings, slices,
};

const DEADLINE: Duration = Duration::from_secs(10);

/// Another writer's taint, which kerf must keep.
fn admins_taint() -> Value {
    json!({"key": "team", "value": "vision", "effect": "PreferNoSchedule"})
}

fn kerfs_taint() -> Value {
    json!({"key": IDLE_GPUS_TAINT_KEY, "effect": IDLE_GPUS_TAINT_EFFECT})
}

fn taints(fake: &FakeApi, node: &str) -> Vec<Value> {
    fake.get(&format!("/api/v1/nodes/{node}"))
        .and_then(|n| n.pointer("/spec/taints").cloned())
        .and_then(|t| t.as_array().cloned())
        .unwrap_or_default()
}

fn has_kerfs_taint(fake: &FakeApi, node: &str) -> bool {
    taints(fake, node).contains(&kerfs_taint())
}

async fn kerfs_taint_becomes(fake: &FakeApi, node: &str, present: bool) {
    eventually(
        &format!("kerf's taint on {node}: {present}"),
        DEADLINE,
        || async { (has_kerfs_taint(fake, node) == present).then_some(()) },
    )
    .await;
}

/// Adds `taint` to the node as another writer would (the whole list, as kubectl does).
fn add_taint(fake: &FakeApi, name: &str, taint: Value) {
    let mut node = fake.get(&format!("/api/v1/nodes/{name}")).unwrap();
    let mut list = taints(fake, name);
    list.push(taint);
    node["spec"]["taints"] = Value::Array(list);
    fake.insert(node);
}

/// A claim of all 8 GPUs of one node, and the pod that uses it.
fn whole_node_claim(fake: &FakeApi, name: &str) {
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": SLICES, "count": 8, "allocationMode": "ExactCount"
        }}]}},
    }));
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": format!("{name}-pod"), "namespace": NS},
        "spec": {
            "containers": [{"name": "main", "image": "busybox"}],
            "resourceClaims": [{"name": "gpus", "resourceClaimName": name}],
        },
        "status": {"phase": "Pending"},
    }));
}

#[tokio::test]
async fn nodes_with_an_idle_gpu_carry_the_taint_until_their_gpus_are_used() {
    let fake = FakeApi::new();
    gpu_nodes(&fake, &["node-0"]);
    node(&fake, "node-1", json!({}), json!([admins_taint()]), true);
    slices(&fake, "node-1");
    node(&fake, "cpu-only", json!({}), json!([]), true);
    classes(&fake);
    let controller = Controller::start(&fake);

    kerfs_taint_becomes(&fake, "node-0", true).await;
    kerfs_taint_becomes(&fake, "node-1", true).await;
    assert_eq!(
        taints(&fake, "node-1"),
        vec![admins_taint(), kerfs_taint()],
        "the other writer's taint is kept, kerf's added after it"
    );
    // Written after kerf's, with the list as it stood: kerf's later write must keep it.
    add_taint(
        &fake,
        "node-0",
        json!({"key": "maintenance", "effect": "NoExecute"}),
    );

    whole_node_claim(&fake, "all-eight");
    let claim = eventually("the claim allocated", DEADLINE, || async {
        get_claim(&fake, "all-eight").filter(|c| allocation(c).is_some())
    })
    .await;
    let used = allocation(&claim).unwrap()["devices"]["results"][0]["pool"]
        .as_str()
        .unwrap()
        .to_owned();
    let (used, idle) = if used == "node-0" {
        ("node-0", "node-1")
    } else {
        ("node-1", "node-0")
    };
    kerfs_taint_becomes(&fake, used, false).await;
    assert!(has_kerfs_taint(&fake, idle), "{idle}'s GPUs are all idle");
    assert!(
        taints(&fake, "node-0")
            .iter()
            .any(|t| t["key"] == "maintenance"),
        "a taint written after kerf's is kept: {:?}",
        taints(&fake, "node-0")
    );
    assert!(taints(&fake, "node-1").contains(&admins_taint()));
    assert!(
        taints(&fake, "cpu-only").is_empty(),
        "a node without kerf GPUs is left alone"
    );

    // The claim deleted before its pod was scheduled: its GPUs are idle again.
    let claims: Api<ResourceClaim> = Api::namespaced(fake.client(), NS);
    claims
        .delete("all-eight", &DeleteParams::default())
        .await
        .unwrap();
    kerfs_taint_becomes(&fake, used, true).await;
    controller.stop().await;
}

#[tokio::test]
async fn switched_off_the_controller_takes_its_taint_off() {
    let fake = FakeApi::new();
    for name in ["node-0", "node-1"] {
        node(
            &fake,
            name,
            json!({}),
            json!([admins_taint(), kerfs_taint()]),
            true,
        );
        slices(&fake, name);
    }
    classes(&fake);
    let controller = Controller::start_with(
        &fake,
        kerf_controller::claims::ClaimSettings {
            idle_gpus_taint: false,
            ..settings()
        },
    );
    for name in ["node-0", "node-1"] {
        kerfs_taint_becomes(&fake, name, false).await;
        assert_eq!(taints(&fake, name), vec![admins_taint()]);
    }
    controller.stop().await;
}
