//! The kubelet plugin tells the user about writes the API server will not take: the plugin
//! runs as its ServiceAccount against the in-memory API server, which answers chosen writes
//! as kube-apiserver does when RBAC denies them (403) or validation fails (422). A refused
//! ResourceSlice write becomes a Warning Event on the Node, a refused claim status write one
//! on the claim, and both count in `kerf_api_write_failures_total{component="kubelet-plugin"}`.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{DRIVER, NODE, TestNode};
use kerf_api::device_status::PreparedDeviceFacts;
use kerf_core::checkpoint::DeviceRecord;
use kerf_kubelet_plugin::claim_events::KubeClaimEvents;
use kerf_kubelet_plugin::metrics::Metrics;
use kerf_kubelet_plugin::preparer::ClaimRef;
use kerf_kubelet_plugin::preparer::device_status::{
    DeviceStatusConfig, DeviceStatusWriter, RetryPolicy,
};
use kerf_kubelet_plugin::publish::Publisher;
use kerf_kubelet_plugin::write_failures::WriteFailureReports;
use kerf_tests::fake_api::FakeApi;
use kerf_tests::wait::until;
use prometheus_client::registry::Registry;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
const CLAIMS: &str = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims";
const WAIT: Duration = Duration::from_secs(10);

/// The plugin's write-failure reports as `plugin::start` wires them: Events through the API
/// as the plugin's ServiceAccount, counted in the plugin's metrics.
fn reports(node: &TestNode, metrics: &Metrics) -> WriteFailureReports {
    let events = Arc::new(KubeClaimEvents::new(node.plugin_client(), NODE));
    WriteFailureReports::new(events, metrics.api_write_failures().clone(), NODE)
}

/// Warning Events with `reason` regarding the `kind` object `name`.
fn warnings(api: &FakeApi, kind: &str, name: &str, reason: &str) -> Vec<Value> {
    api.warning_events(kind, name)
        .into_iter()
        .filter(|e| e["reason"] == reason)
        .collect()
}

#[tokio::test]
async fn a_slice_write_refused_by_rbac_is_a_warning_on_the_node_and_counted() {
    let node = TestNode::new("a100-40gb-mig");
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let publisher = Publisher::new(
        node.plugin_client(),
        DRIVER.to_owned(),
        NODE.to_owned(),
        metrics.clone(),
    )
    .with_write_failure_reports(reports(&node, &metrics));
    // kube-apiserver's RBAC denial (`forbiddenMessage` in apiserver's
    // endpoints/handlers/responsewriters/errors.go).
    let denied = format!(
        r#"resourceslices.resource.k8s.io "{NODE}-gpu.kerf.dev-0" is forbidden: User "system:serviceaccount:kerf-system:kerf-kubelet-plugin" cannot patch resource "resourceslices" in API group "resource.k8s.io" at the cluster scope"#
    );
    node.api
        .fail_next_with("PATCH", SLICES, 403, "Forbidden", &denied, usize::MAX);
    let inventory = node.inventory();

    assert!(publisher.publish(&inventory).await.is_err());
    assert!(publisher.publish(&inventory).await.is_err());

    let told = warnings(&node.api, "Node", NODE, "WriteRefused");
    assert_eq!(
        told.len(),
        1,
        "one Warning for the failure, not one per retry: {told:?}"
    );
    let event = &told[0];
    assert_eq!(event["metadata"]["namespace"], "default", "{event}");
    let note = event["note"].as_str().unwrap();
    assert!(note.contains(&denied), "the API's words: {note}");
    assert!(
        note.contains("kerf-kubelet-plugin's ServiceAccount lacks `patch` on `resourceslices`"),
        "what to do: {note}"
    );
    assert_eq!(
        metrics
            .api_write_failures()
            .count("resourceslices", "Forbidden"),
        2,
        "every refused publish is counted"
    );
}

#[tokio::test]
async fn a_claim_status_write_refused_as_invalid_is_a_warning_on_the_claim_and_counted() {
    let node = TestNode::new("a100-40gb-mig");
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let shutdown = CancellationToken::new();
    let mut config = DeviceStatusConfig::new(DRIVER, NODE);
    config.retry = RetryPolicy {
        attempts: 3,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(40),
    };
    let (writer, _task) = DeviceStatusWriter::start_with_reports(
        node.plugin_client(),
        config,
        &mut registry,
        shutdown.clone(),
        Some(reports(&node, &metrics)),
    );
    let invalid = r#"ResourceClaim.resource.k8s.io "refused" is invalid: status.devices[0].data: Too long: may not be more than 10240 bytes"#;
    node.api.fail_next_with(
        "PATCH",
        &format!("{CLAIMS}/refused/status"),
        422,
        "Invalid",
        invalid,
        usize::MAX,
    );
    let claim = ClaimRef {
        namespace: "default".to_owned(),
        uid: "uid-refused".to_owned(),
        name: "refused".to_owned(),
    };
    let record = DeviceRecord {
        pool_name: NODE.to_owned(),
        device_name: "gpu-0".to_owned(),
        uuid: "GPU-0".to_owned(),
        ..DeviceRecord::default()
    };
    writer.publish(&claim, vec![PreparedDeviceFacts::of_record(record)]);

    until("a Warning on the claim", WAIT, || {
        !warnings(&node.api, "ResourceClaim", "refused", "WriteRefused").is_empty()
    })
    .await;
    let event = &warnings(&node.api, "ResourceClaim", "refused", "WriteRefused")[0];
    assert_eq!(event["regarding"]["uid"], "uid-refused", "{event}");
    let note = event["note"].as_str().unwrap();
    assert!(note.contains(invalid), "the API's words: {note}");
    assert!(
        note.contains("patch resourceclaims/status default/refused"),
        "the write: {note}"
    );
    assert_eq!(
        metrics
            .api_write_failures()
            .count("resourceclaims/status", "Invalid"),
        1
    );
    shutdown.cancel();
}
