//! Device health as the kubelet sees it: the plugin's `NodeWatchResources` stream read by the
//! fake kubelet (which keeps it as upstream kubelet's health cache does), fed by the mock
//! fault file and the Node annotation.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::{DRIVER, NODE, TestNode};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kerf_kubelet_plugin::health::HealthConfig;
use kerf_kubelet_plugin::health::mock::MOCK_FAULTS_ANNOTATION;
use kerf_proto::health::v1alpha1::HealthStatus;
use kerf_tests::fake_kubelet::FakeKubelet;
use kerf_tests::wait::until;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

/// Mock health read from `fault_file` every 50 ms, a 3 s timeout and a resend every second.
fn health_config(fault_file: Option<PathBuf>) -> HealthConfig {
    HealthConfig {
        check_timeout: Duration::from_secs(3),
        resend_interval: Duration::from_secs(1),
        mock_fault_file: fault_file,
        mock_fault_file_poll: Duration::from_millis(50),
        ..HealthConfig::defaults(true)
    }
}

fn status(kubelet: &FakeKubelet, device: &str) -> HealthStatus {
    kubelet.health().device(DRIVER, NODE, device).health
}

async fn wait_for_statuses(kubelet: &FakeKubelet, want: &[(&str, HealthStatus)]) {
    let result = kubelet
        .health()
        .wait_for(WAIT, |_| {
            want.iter()
                .all(|(device, health)| status(kubelet, device) == *health)
        })
        .await;
    let seen: Vec<_> = want
        .iter()
        .map(|(device, _)| (*device, status(kubelet, device)))
        .collect();
    assert!(result.is_ok(), "wanted {want:?}, the kubelet sees {seen:?}");
}

fn write_faults(path: &Path, text: &str) {
    // Written aside and renamed, as an editor or a ConfigMap update does, so the plugin never
    // reads half a file.
    let aside = path.with_extension("tmp");
    std::fs::write(&aside, text).unwrap();
    std::fs::rename(&aside, path).unwrap();
}

#[tokio::test]
async fn the_kubelet_sees_every_device_then_a_fault_and_the_recovery() {
    let node = TestNode::new("h100-sxm-80gb:2");
    let faults = node.root.join("faults.yaml");
    let plugin = node
        .start_plugin_with_health(&health_config(Some(faults.clone())), false)
        .await;
    let kubelet = FakeKubelet::start(node.kubelet_config());
    wait_for_statuses(
        &kubelet,
        &[
            ("gpu-0", HealthStatus::Healthy),
            ("gpu-1", HealthStatus::Healthy),
        ],
    )
    .await;
    assert_eq!(kubelet.health().device_count(DRIVER), 2);
    assert_eq!(kubelet.health().device(DRIVER, NODE, "gpu-0").message, "");

    write_faults(&faults, "gpu-1:\n  - kind: xid\n    code: 79\n");
    wait_for_statuses(
        &kubelet,
        &[
            ("gpu-0", HealthStatus::Healthy),
            ("gpu-1", HealthStatus::Unhealthy),
        ],
    )
    .await;
    let message = kubelet.health().device(DRIVER, NODE, "gpu-1").message;
    assert!(message.starts_with("XID 79 (fatal"), "{message}");

    // A bad edit keeps the last good state.
    write_faults(&faults, "gpu-1:\n  - kind: meltdown\n");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(status(&kubelet, "gpu-1"), HealthStatus::Unhealthy);

    std::fs::remove_file(&faults).unwrap();
    wait_for_statuses(
        &kubelet,
        &[
            ("gpu-0", HealthStatus::Healthy),
            ("gpu-1", HealthStatus::Healthy),
        ],
    )
    .await;
    assert_eq!(kubelet.health().device(DRIVER, NODE, "gpu-1").message, "");
    plugin.shutdown().await.unwrap();
}

/// Without a change the full list still comes every resend interval, so the kubelet never
/// lets a device go stale (Unknown) after the 3 s timeout.
#[tokio::test]
async fn the_list_is_sent_again_within_the_timeout_without_changes() {
    let node = TestNode::new("h100-sxm-80gb:1");
    let plugin = node
        .start_plugin_with_health(&health_config(None), false)
        .await;
    let kubelet = FakeKubelet::start(node.kubelet_config());
    wait_for_statuses(&kubelet, &[("gpu-0", HealthStatus::Healthy)]).await;
    let first = kubelet.health().messages(DRIVER);
    let stamped = kubelet
        .health()
        .last_updated_time(DRIVER, NODE, "gpu-0")
        .unwrap();
    kubelet
        .health()
        .wait_for(WAIT, |h| h.messages(DRIVER) >= first + 4)
        .await
        .unwrap();
    // More than the 3 s timeout has passed since the first message.
    assert_eq!(status(&kubelet, "gpu-0"), HealthStatus::Healthy);
    let later = kubelet
        .health()
        .last_updated_time(DRIVER, NODE, "gpu-0")
        .unwrap();
    assert!(later > stamped, "{later} after {stamped}");
    assert_eq!(kubelet.health().streams(DRIVER), 1);
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn after_a_plugin_restart_the_kubelet_reconnects_and_gets_the_full_list() {
    let node = TestNode::new("h100-sxm-80gb:2");
    let faults = node.root.join("faults.yaml");
    write_faults(&faults, "gpu-0:\n  - kind: gpuLost\n");
    let config = health_config(Some(faults.clone()));
    let plugin = node.start_plugin_with_health(&config, false).await;
    let kubelet = FakeKubelet::start(node.kubelet_config());
    wait_for_statuses(
        &kubelet,
        &[
            ("gpu-0", HealthStatus::Unhealthy),
            ("gpu-1", HealthStatus::Healthy),
        ],
    )
    .await;
    plugin.shutdown().await.unwrap();
    // The stream ended with the plugin: the kubelet drops the driver's health.
    kubelet
        .health()
        .wait_for(WAIT, |h| h.device_count(DRIVER) == 0)
        .await
        .unwrap();
    assert_eq!(status(&kubelet, "gpu-1"), HealthStatus::Unknown);

    write_faults(&faults, "gpu-1:\n  - kind: eccUncorrected\n");
    let plugin = node.start_plugin_with_health(&config, false).await;
    wait_for_statuses(
        &kubelet,
        &[
            ("gpu-0", HealthStatus::Healthy),
            ("gpu-1", HealthStatus::Unhealthy),
        ],
    )
    .await;
    assert_eq!(kubelet.health().device_count(DRIVER), 2);
    assert!(kubelet.health().streams(DRIVER) >= 2);
    plugin.shutdown().await.unwrap();
}

async fn annotate(node: &TestNode, value: Option<&str>) {
    let nodes: Api<Node> = Api::all(node.api.client());
    let patch = json!({ "metadata": { "annotations": { MOCK_FAULTS_ANNOTATION: value } } });
    nodes
        .patch(NODE, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
}

fn taints(node: &TestNode, device: &str) -> Vec<(String, Option<String>, String)> {
    node.api
        .list_resources::<ResourceSlice>(None)
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter(|d| d.name == device)
        .flat_map(|d| d.taints.iter().flatten())
        .map(|t| (t.key.clone(), t.value.clone(), t.effect.clone()))
        .collect()
}

/// `kubectl annotate node` flips health in mock mode: the kubelet sees it and, on an API
/// server that keeps device taints, the device is tainted until the annotation goes.
#[tokio::test]
async fn a_node_annotation_flips_health_and_taints() {
    let node = TestNode::new("h100-sxm-80gb:2");
    node.api.insert(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": NODE },
    }));
    let plugin = node
        .start_plugin_with_health(&health_config(None), true)
        .await;
    assert!(
        plugin
            .device_taints()
            .is_some_and(kerf_api::features::Probed::is_served)
    );
    let kubelet = FakeKubelet::start(node.kubelet_config());
    wait_for_statuses(&kubelet, &[("gpu-1", HealthStatus::Healthy)]).await;

    annotate(&node, Some(r#"{"gpu-1": [{"kind": "xid", "code": 61}]}"#)).await;
    wait_for_statuses(&kubelet, &[("gpu-1", HealthStatus::Unhealthy)]).await;
    let want = vec![(
        "gpu.kerf.dev/unhealthy".to_owned(),
        Some("xid-61".to_owned()),
        "NoSchedule".to_owned(),
    )];
    until("gpu-1 tainted", WAIT, || taints(&node, "gpu-1") == want).await;
    assert!(taints(&node, "gpu-0").is_empty());

    annotate(&node, None).await;
    wait_for_statuses(&kubelet, &[("gpu-1", HealthStatus::Healthy)]).await;
    until("gpu-1 untainted", WAIT, || {
        taints(&node, "gpu-1").is_empty()
    })
    .await;
    plugin.shutdown().await.unwrap();
}
