//! Every write of kerf-kubelet-plugin names its field manager, `kerf-kubelet-plugin`, so
//! `managedFields` shows who wrote what (without a field manager a write shows up as manager `unknown`).
//!
//! A plugin with all its API connections (`Connections::kube`) runs against the in-memory API
//! server: it probes device taints, publishes its ResourceSlices, prepares a claim (which
//! writes the claim's per-device status) and reports a claim Event. Every create, update and
//! patch it sent must carry `fieldManager=kerf-kubelet-plugin` (DeleteOptions have no field
//! manager, so deletes are not checked).

use std::time::Duration;

use crate::common;
use crate::common::{NODE, TestNode, uid};
use kerf_kubelet_plugin::claim_events::{ClaimEvents as _, ClaimWarning, KubeClaimEvents};
use kerf_kubelet_plugin::plugin::{self, Connections};
use kerf_kubelet_plugin::preparer::ClaimRef;
use kerf_proto::client::{KNOWN_SERVICES, KubeletClient};
use kerf_tests::wait::until;

const FIELD_MANAGER: &str = "fieldManager=kerf-kubelet-plugin";
const WAIT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn every_write_of_the_plugin_names_kerf_kubelet_plugin() {
    let node = TestNode::new("h100-sxm-80gb:2");
    let claim_uid = uid(1);
    node.device_claim("whole", &claim_uid, "gpu-0");
    let mut config = node.config();
    config.publish_resources = true;
    let connections = Connections::kube(node.plugin_client(), &config);
    let running = plugin::start(&config, node.inventory(), connections)
        .await
        .unwrap();

    let kubelet = KubeletClient::new()
        .knowing(&KNOWN_SERVICES)
        .register(&config.registration_socket)
        .await
        .unwrap();
    let answers = kubelet
        .prepare(&[kerf_proto::client::Claim::new(
            common::NAMESPACE,
            "whole",
            &claim_uid,
        )])
        .await
        .unwrap();
    assert!(answers[&claim_uid].is_ok(), "{answers:?}");
    let claim_path = format!(
        "/apis/resource.k8s.io/v1/namespaces/{}/resourceclaims/whole",
        common::NAMESPACE
    );
    until("the claim's device status", WAIT, || {
        node.api.get(&claim_path).is_some_and(|c| {
            c["status"]["devices"]
                .as_array()
                .is_some_and(|d| !d.is_empty())
        })
    })
    .await;
    until("the slices are published", WAIT, || {
        !node
            .api
            .list("/apis/resource.k8s.io/v1/resourceslices")
            .is_empty()
    })
    .await;
    KubeClaimEvents::new(node.plugin_client(), NODE)
        .warn(ClaimWarning {
            claim: ClaimRef {
                uid: claim_uid.clone(),
                namespace: common::NAMESPACE.to_owned(),
                name: "whole".to_owned(),
            },
            reason: "FieldManagerCheck",
            note: "an Event the test sends".to_owned(),
        })
        .await;
    running.shutdown().await.unwrap();

    let writes: Vec<_> = node
        .api
        .requests()
        .into_iter()
        .filter(|r| matches!(r.verb, "create" | "update" | "patch"))
        .collect();
    for kind in ["resourceslices", "resourceclaims", "events"] {
        assert!(
            writes.iter().any(|r| r.path.contains(kind)),
            "no write of {kind}: {writes:#?}"
        );
    }
    let unnamed: Vec<_> = writes
        .iter()
        .filter(|r| !r.query.split('&').any(|p| p == FIELD_MANAGER))
        .collect();
    assert!(
        unnamed.is_empty(),
        "writes without {FIELD_MANAGER}: {unnamed:#?}"
    );
}
