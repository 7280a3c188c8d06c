//! Unit tests of the admission every cluster has: TaintNodesByCondition with the node
//! lifecycle controller's NoSchedule taints, and kerf's ValidatingAdmissionPolicy.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::admission_policy::Policies;
use super::{FakeApi, Identity};

fn taints(node: &Value) -> Vec<(String, String)> {
    node.pointer("/spec/taints")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|t| {
            (
                t["key"].as_str().unwrap_or("").to_owned(),
                t["effect"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

fn not_ready() -> (String, String) {
    (
        "node.kubernetes.io/not-ready".to_owned(),
        "NoSchedule".to_owned(),
    )
}

#[tokio::test]
async fn a_new_node_is_not_ready_until_its_ready_condition_is_true() {
    let fake = FakeApi::new();
    let nodes: Api<Node> = Api::all(fake.client());
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": "n1"},
        "spec": {"taints": [{"key": "gpu", "value": "yes", "effect": "NoSchedule"}]},
    }))
    .unwrap();
    nodes.create(&PostParams::default(), &node).await.unwrap();
    let stored = fake.get("/api/v1/nodes/n1").unwrap();
    assert_eq!(
        taints(&stored),
        vec![("gpu".to_owned(), "NoSchedule".to_owned()), not_ready()],
        "admission adds not-ready, the node's own taints stay"
    );

    let ready =
        |status: &str| json!({"status": {"conditions": [{"type": "Ready", "status": status}]}});
    let params = PatchParams::default();
    nodes
        .patch_status("n1", &params, &Patch::Merge(ready("True")))
        .await
        .unwrap();
    let stored = fake.get("/api/v1/nodes/n1").unwrap();
    assert_eq!(
        taints(&stored),
        vec![("gpu".to_owned(), "NoSchedule".to_owned())]
    );

    nodes
        .patch_status("n1", &params, &Patch::Merge(ready("False")))
        .await
        .unwrap();
    assert!(taints(&fake.get("/api/v1/nodes/n1").unwrap()).contains(&not_ready()));
    nodes
        .patch_status("n1", &params, &Patch::Merge(ready("Unknown")))
        .await
        .unwrap();
    let stored = fake.get("/api/v1/nodes/n1").unwrap();
    assert!(!taints(&stored).contains(&not_ready()));
    assert!(taints(&stored).contains(&(
        "node.kubernetes.io/unreachable".to_owned(),
        "NoSchedule".to_owned()
    )));
}

#[test]
fn fixture_nodes_go_through_the_same_admission() {
    let fake = FakeApi::new();
    let stored = fake.insert(json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"},
    }));
    assert_eq!(taints(&stored), vec![not_ready()]);
    let stored = fake.insert(json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": "n2"},
        "spec": {"unschedulable": true},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }));
    assert_eq!(
        taints(&stored),
        vec![(
            "node.kubernetes.io/unschedulable".to_owned(),
            "NoSchedule".to_owned()
        )]
    );
}

fn slice(name: &str, node: Option<&str>, driver: &str) -> ResourceSlice {
    let mut spec = json!({
        "driver": driver,
        "pool": {"name": "pool", "generation": 1, "resourceSliceCount": 1},
    });
    match node {
        Some(node) => spec["nodeName"] = json!(node),
        None => spec["allNodes"] = json!(true),
    }
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
}

fn denial(err: kube::Error) -> (u16, String, String) {
    match err {
        kube::Error::Api(status) => (status.code, status.reason.clone(), status.message.clone()),
        other => panic!("not an API error: {other}"),
    }
}

const PREFIX: &str = "resourceslices.resource.k8s.io";
const POLICY: &str = "ValidatingAdmissionPolicy 'kerf-kubelet-plugin-resourceslices' with binding 'kerf-kubelet-plugin-resourceslices' denied request";

#[tokio::test]
async fn the_kubelet_plugin_may_write_only_its_own_nodes_slices() {
    let fake = FakeApi::new();
    let plugin: Api<ResourceSlice> =
        Api::all(fake.client_as(Identity::kerf_kubelet_plugin("node-a")));
    let pp = PostParams::default();
    plugin
        .create(&pp, &slice("own", Some("node-a"), "gpu.kerf.dev"))
        .await
        .unwrap();

    let err = plugin
        .create(&pp, &slice("theirs", Some("node-b"), "gpu.kerf.dev"))
        .await
        .unwrap_err();
    assert_eq!(
        denial(err),
        (
            422,
            "Invalid".to_owned(),
            format!(
                "{PREFIX} \"theirs\" is forbidden: {POLICY}: the kubelet plugin on node 'node-a' may not modify ResourceSlices of node 'node-b'"
            )
        )
    );
    let err = plugin
        .create(&pp, &slice("everywhere", None, "gpu.kerf.dev"))
        .await
        .unwrap_err();
    assert!(
        denial(err)
            .2
            .ends_with("may not modify ResourceSlices that are not node-local")
    );
    let err = plugin
        .create(&pp, &slice("other-driver", Some("node-a"), "other.dev"))
        .await
        .unwrap_err();
    assert!(denial(err).2.ends_with(
        "the kubelet plugin may only modify ResourceSlices of driver gpu.kerf.dev, not other.dev"
    ));

    // The admin is not the plugin: the match condition leaves it alone.
    let admin: Api<ResourceSlice> = Api::all(fake.client());
    admin
        .create(&pp, &slice("theirs", Some("node-b"), "gpu.kerf.dev"))
        .await
        .unwrap();
    let err = plugin
        .delete("theirs", &DeleteParams::default())
        .await
        .unwrap_err();
    assert!(
        denial(err)
            .2
            .contains("may not modify ResourceSlices of node 'node-b'")
    );
    plugin
        .delete("own", &DeleteParams::default())
        .await
        .unwrap();

    // A token not bound to a pod carries no node.
    let unbound: Api<ResourceSlice> = Api::all(fake.client_as(Identity::service_account(
        "kerf-system",
        "kerf-kubelet-plugin",
    )));
    let err = unbound
        .create(&pp, &slice("own", Some("node-a"), "gpu.kerf.dev"))
        .await
        .unwrap_err();
    assert!(
        denial(err)
            .2
            .contains("no node is associated with this user")
    );
}

#[test]
fn the_shipped_policy_loads() {
    assert_eq!(Policies::kerf().load_error(), None);
    let broken = Policies::from_manifests(
        "kind: ValidatingAdmissionPolicyBinding\nspec:\n  policyName: nope\n  validationActions: [Deny]\n",
    );
    assert!(broken.load_error().is_some());
}
