//! The ValidatingAdmissionPolicy of `deploy/helm/kerf/templates/mps-daemon-pod-policy.yaml`, as FakeApi
//! evaluates it: the kubelet plugin may create the MPS control daemon pod it really builds
//! (from its own pod of `deploy/kerf-mock.yaml`) and delete it, but no pod on another node, as
//! another ServiceAccount, with a token, in the host's namespaces, with another kind of volume,
//! without the daemon label or with more containers; the cluster admin is not limited.

use std::path::Path;
use std::time::Duration;

use crate::common::NODE;
use crate::common::plugin_pod::plugin_pod_from_manifest;
use k8s_openapi::api::core::v1::Pod;
use kerf_core::mps::MpsDirectories;
use kerf_kubelet_plugin::mps_daemons::DaemonPodTemplate;
use kerf_tests::fake_api::{FakeApi, Identity, KERF_NAMESPACE};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::{Value, json};

const GPU: &str = "GPU-8f2d3c4e-1a2b-4c5d-9e8f-0123456789ab";
const POLICY: &str = "ValidatingAdmissionPolicy 'kerf-kubelet-plugin-mps-daemon-pods' with \
                      binding 'kerf-kubelet-plugin-mps-daemon-pods' denied request: ";

/// The daemon pod of [`GPU`] the plugin on [`NODE`] builds from its pod of `deploy/kerf-mock.yaml`,
/// as JSON.
fn daemon_pod() -> Value {
    let plugin = plugin_pod_from_manifest(NODE);
    let tools = Path::new("/opt/kerf/mock-driver");
    let template = DaemonPodTemplate::from_plugin_pod(&plugin, tools, None).unwrap();
    let dirs = MpsDirectories::new(Path::new("/var/run/kerf/mps"), GPU).unwrap();
    let pod = template.pod(NODE, &dirs, tools, Duration::from_secs(10));
    serde_json::to_value(pod).unwrap()
}

fn pods_as(fake: &FakeApi, identity: Identity) -> Api<Pod> {
    Api::namespaced(fake.client_as(identity), KERF_NAMESPACE)
}

fn plugin_pods(fake: &FakeApi) -> Api<Pod> {
    pods_as(fake, Identity::kerf_kubelet_plugin(NODE))
}

async fn create(pods: &Api<Pod>, pod: &Value) -> Result<Pod, kube::Error> {
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(pod.clone()).unwrap(),
    )
    .await
}

/// The policy's message for a refused request, after checking that it is the policy's
/// refusal (422 Invalid).
fn refusal(result: Result<impl std::fmt::Debug, kube::Error>) -> String {
    match result {
        Err(kube::Error::Api(status)) => {
            assert_eq!(
                (status.code, status.reason.as_str()),
                (422, "Invalid"),
                "{status:?}"
            );
            let (_, message) = status
                .message
                .split_once(POLICY)
                .unwrap_or_else(|| panic!("not the policy's denial: {}", status.message));
            message.to_owned()
        }
        other => panic!("not refused by the policy: {other:?}"),
    }
}

#[tokio::test]
async fn the_plugin_creates_and_deletes_the_daemon_pod_it_builds() {
    let fake = FakeApi::new();
    let pods = plugin_pods(&fake);
    let pod = daemon_pod();
    let created = create(&pods, &pod).await.unwrap();
    let name = created.metadata.name.unwrap();
    assert!(
        fake.get(&format!("/api/v1/namespaces/{KERF_NAMESPACE}/pods/{name}"))
            .is_some()
    );
    pods.delete(&name, &DeleteParams::default()).await.unwrap();
    assert!(
        fake.get(&format!("/api/v1/namespaces/{KERF_NAMESPACE}/pods/{name}"))
            .is_none()
    );
}

/// [`daemon_pod`] changed by `change`.
fn changed(change: impl FnOnce(&mut Value)) -> Value {
    let mut pod = daemon_pod();
    change(&mut pod);
    pod
}

/// A refused create: what differs, the pod, the policy's message.
type Case = (&'static str, Value, &'static str);

/// Pods on another node, of another identity or without the daemon label.
fn elsewhere_or_as_another() -> Vec<Case> {
    vec![
        (
            "another node",
            changed(|p| p["spec"]["nodeName"] = json!("node-2")),
            "the kubelet plugin on node 'node-1' may not create pods of spec.nodeName 'node-2'",
        ),
        (
            "no node: left to the scheduler",
            changed(|p| drop(p["spec"].as_object_mut().unwrap().remove("nodeName"))),
            "the kubelet plugin on node 'node-1' may not create pods without spec.nodeName",
        ),
        (
            "another ServiceAccount",
            changed(|p| p["spec"]["serviceAccountName"] = json!("kerf-controller")),
            "spec.serviceAccountName must be 'kerf-mps-control-daemon', not 'kerf-controller'",
        ),
        (
            "a token automounted",
            changed(|p| p["spec"]["automountServiceAccountToken"] = json!(true)),
            "spec.automountServiceAccountToken must be false, not true",
        ),
        (
            "automounting left to the ServiceAccount",
            changed(|p| {
                drop(
                    p["spec"]
                        .as_object_mut()
                        .unwrap()
                        .remove("automountServiceAccountToken"),
                );
            }),
            "spec.automountServiceAccountToken must be false, not unset",
        ),
        (
            "no component label",
            changed(|p| {
                let labels = p["metadata"]["labels"].as_object_mut().unwrap();
                labels.remove("app.kubernetes.io/component");
            }),
            "the kubelet plugin may only create MPS control daemon pods: label \
             app.kubernetes.io/component must be 'mps-control-daemon', not ''",
        ),
        (
            "another component",
            changed(|p| {
                p["metadata"]["labels"]["app.kubernetes.io/component"] = json!("controller");
            }),
            "the kubelet plugin may only create MPS control daemon pods: label \
             app.kubernetes.io/component must be 'mps-control-daemon', not 'controller'",
        ),
    ]
}

/// Pods in the host's namespaces, with other volumes or other containers.
fn with_more_than_a_daemon_needs() -> Vec<Case> {
    vec![
        (
            "the host's network",
            changed(|p| p["spec"]["hostNetwork"] = json!(true)),
            "spec.hostNetwork must not be true",
        ),
        (
            "the host's PIDs",
            changed(|p| p["spec"]["hostPID"] = json!(true)),
            "spec.hostPID must not be true",
        ),
        (
            "the host's IPC",
            changed(|p| p["spec"]["hostIPC"] = json!(true)),
            "spec.hostIPC must not be true",
        ),
        (
            "an emptyDir",
            changed(|p| {
                let volumes = p["spec"]["volumes"].as_array_mut().unwrap();
                volumes.push(json!({"name": "scratch", "emptyDir": {}}));
            }),
            "every volume must be a hostPath volume, not spec.volumes 'scratch'",
        ),
        (
            "a projected ServiceAccount token",
            changed(|p| {
                let volumes = p["spec"]["volumes"].as_array_mut().unwrap();
                volumes.insert(
                    0,
                    json!({"name": "token", "projected": {"sources": [
                        {"serviceAccountToken": {"path": "token"}}
                    ]}}),
                );
            }),
            "every volume must be a hostPath volume, not spec.volumes 'token'",
        ),
        (
            "a second container",
            changed(|p| {
                let containers = p["spec"]["containers"].as_array_mut().unwrap();
                let mut second = containers[0].clone();
                second["name"] = json!("second");
                containers.push(second);
            }),
            "exactly one container and no init containers, not 2 in spec.containers and 0 \
             in spec.initContainers",
        ),
        (
            "an init container",
            changed(|p| {
                let mut init = p["spec"]["containers"][0].clone();
                init["name"] = json!("init");
                p["spec"]["initContainers"] = json!([init]);
            }),
            "exactly one container and no init containers, not 1 in spec.containers and 1 \
             in spec.initContainers",
        ),
    ]
}

#[tokio::test]
async fn the_plugin_may_create_no_other_pod() {
    let fake = FakeApi::new();
    let pods = plugin_pods(&fake);
    let cases = elsewhere_or_as_another()
        .into_iter()
        .chain(with_more_than_a_daemon_needs());
    for (what, pod, message) in cases {
        let name = pod["metadata"]["name"].as_str().unwrap().to_owned();
        assert_eq!(refusal(create(&pods, &pod).await), message, "{what}");
        assert!(
            fake.get(&format!("/api/v1/namespaces/{KERF_NAMESPACE}/pods/{name}"))
                .is_none(),
            "{what}: stored"
        );
    }
}

#[tokio::test]
async fn the_plugin_may_delete_only_its_own_nodes_daemon_pods() {
    let fake = FakeApi::new();
    let pods = plugin_pods(&fake);
    let mut other_node = daemon_pod();
    other_node["metadata"]["name"] = json!("kerf-mps-of-node-2");
    other_node["spec"]["nodeName"] = json!("node-2");
    fake.insert(other_node);
    let mut controller = plugin_pod_from_manifest(NODE);
    controller.metadata.name = Some("kerf-controller-5d9f8".to_owned());
    let labels = controller.metadata.labels.get_or_insert_default();
    labels.insert(
        "app.kubernetes.io/component".to_owned(),
        "controller".to_owned(),
    );
    fake.insert(serde_json::to_value(controller).unwrap());

    let params = DeleteParams::default();
    let delete = |name: &'static str| pods.delete(name, &params);
    assert_eq!(
        refusal(delete("kerf-mps-of-node-2").await),
        "the kubelet plugin on node 'node-1' may not delete pods of spec.nodeName 'node-2'"
    );
    assert_eq!(
        refusal(delete("kerf-controller-5d9f8").await),
        "the kubelet plugin may only delete MPS control daemon pods: label \
         app.kubernetes.io/component must be 'mps-control-daemon', not 'controller'"
    );
    let path = |name: &str| format!("/api/v1/namespaces/{KERF_NAMESPACE}/pods/{name}");
    assert!(fake.get(&path("kerf-mps-of-node-2")).is_some());
    assert!(fake.get(&path("kerf-controller-5d9f8")).is_some());
}

#[tokio::test]
async fn a_plugin_token_bound_to_no_pod_creates_nothing() {
    let fake = FakeApi::new();
    let unbound = pods_as(
        &fake,
        Identity::service_account(KERF_NAMESPACE, "kerf-kubelet-plugin"),
    );
    assert!(
        refusal(create(&unbound, &daemon_pod()).await)
            .starts_with("no node is associated with this user")
    );
}

#[tokio::test]
async fn the_cluster_admin_is_not_limited() {
    let fake = FakeApi::new();
    let admin = pods_as(&fake, Identity::admin());
    let pod = changed(|p| {
        p["spec"]["nodeName"] = json!("node-2");
        p["spec"]["serviceAccountName"] = json!("kerf-controller");
        p["spec"]["automountServiceAccountToken"] = json!(true);
        p["spec"]["hostNetwork"] = json!(true);
        p["spec"]["volumes"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "scratch", "emptyDir": {}}));
        p["metadata"]["labels"] = json!({});
    });
    let created = create(&admin, &pod).await.unwrap();
    admin
        .delete(&created.metadata.name.unwrap(), &DeleteParams::default())
        .await
        .unwrap();
}
