//! Start-up feature detection of the kubelet plugin against API servers with and without
//! device taints (`FakeApi::drop_field` acts as a 1.34/1.35 server whose `DRADeviceTaints`
//! gate is off: the field silently vanishes from every write).

use std::time::Duration;

use crate::common;
use crate::common::{NODE, TestNode};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kerf_api::features::Probed;
use kerf_kubelet_plugin::health::HealthConfig;
use kerf_proto::health::v1alpha1::HealthStatus;
use kerf_tests::fake_kubelet::FakeKubelet;
use kerf_tests::logs::CapturedLogs;
use kerf_tests::wait::until;
use serde_json::json;

const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
const WAIT: Duration = Duration::from_secs(10);

fn node_with_faults() -> (TestNode, HealthConfig) {
    let node = TestNode::new("h100-sxm-80gb:2");
    node.api.insert(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": NODE },
    }));
    let faults = node.root.join("faults.yaml");
    std::fs::write(&faults, "gpu-1:\n  - kind: xid\n    code: 79\n").unwrap();
    let health = HealthConfig {
        check_timeout: Duration::from_secs(3),
        resend_interval: Duration::from_secs(1),
        mock_fault_file: Some(faults),
        mock_fault_file_poll: Duration::from_millis(50),
        ..HealthConfig::defaults(true)
    };
    (node, health)
}

fn slices(node: &TestNode) -> Vec<ResourceSlice> {
    node.api.list_resources::<ResourceSlice>(None)
}

#[tokio::test]
async fn without_device_taints_the_plugin_says_so_once_and_publishes_plain_slices() {
    let logs = CapturedLogs::default();
    let _capture = logs.capture(tracing::Level::INFO);
    let (node, health) = node_with_faults();
    node.api
        .drop_field("resourceslices", "spec.devices[].taints");
    let plugin = node.start_plugin_with_health(&health, true).await;
    assert_eq!(plugin.device_taints(), Some(&Probed::Dropped));
    let kubelet = FakeKubelet::start(node.kubelet_config());

    // Health still reaches the kubelet.
    kubelet
        .health()
        .wait_for(WAIT, |h| {
            h.device(common::DRIVER, NODE, "gpu-1").health == HealthStatus::Unhealthy
        })
        .await
        .unwrap();
    until("the slice is published", WAIT, || slices(&node).len() == 1).await;
    assert!(
        slices(&node)
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .all(|d| d.taints.is_none())
    );
    // Health changes do not make the publisher write again, let alone loop.
    let writes = node.api.count("PATCH", SLICES);
    std::fs::write(node.root.join("faults.yaml"), "gpu-0:\n  - kind: gpuLost\n").unwrap();
    kubelet
        .health()
        .wait_for(WAIT, |h| {
            h.device(common::DRIVER, NODE, "gpu-0").health == HealthStatus::Unhealthy
        })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(node.api.count("PATCH", SLICES), writes);
    assert_eq!(node.api.count("POST", SLICES), 1, "one probe");

    let degraded = logs.lines_containing("drops ResourceSlice spec.devices[].taints");
    assert_eq!(degraded.len(), 1, "{degraded:#?}");
    assert!(degraded[0].contains("WARN"), "{}", degraded[0]);
    assert!(logs.lines_containing("ERROR").is_empty());

    // Publishing goes on as usual: a lost slice comes back.
    let name = slices(&node)[0].metadata.name.clone().unwrap();
    node.api
        .remove(&format!("{SLICES}/{name}"))
        .expect("the slice");
    until("the slice is back", WAIT, || slices(&node).len() == 1).await;
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn with_device_taints_the_probe_says_served_and_the_faulty_device_is_tainted() {
    let logs = CapturedLogs::default();
    let _capture = logs.capture(tracing::Level::INFO);
    let (node, health) = node_with_faults();
    let plugin = node.start_plugin_with_health(&health, true).await;
    assert_eq!(plugin.device_taints(), Some(&Probed::Served));
    until("gpu-1 is tainted", WAIT, || {
        slices(&node)
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .any(|d| d.name == "gpu-1" && d.taints.is_some())
    })
    .await;
    assert!(
        logs.lines_containing("drops ResourceSlice").is_empty(),
        "no degraded line"
    );
    // The probe was a dry run: nothing of it is stored.
    assert!(slices(&node).iter().all(|s| {
        !s.spec
            .pool
            .name
            .starts_with(kerf_api::features::PROBE_NAME_PREFIX)
    }));
    plugin.shutdown().await.unwrap();
}
