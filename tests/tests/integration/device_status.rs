//! Per-device claim status against the in-memory API server: the preparer's status writer
//! applies kerf's `status.devices` entries after a prepare, writes nothing at the unprepare
//! (the deallocation drops the entries, as kube-apiserver's status strategy does) and cancels
//! a write still waiting, leaves the allocation alone, shrugs off a claim deleted before the
//! write, and stops after one attempt and one log line when the server drops the field or
//! refuses the permission.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{DRIVER, GIB, NAMESPACE, NODE, TestNode, uid};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::cdi::{CommonEdits, DeviceNodePolicy};
use kerf_kubelet_plugin::checkpoint_store::CheckpointStore;
use kerf_kubelet_plugin::gpu_sharing::GpuSharing;
use kerf_kubelet_plugin::metrics::Metrics;
use kerf_kubelet_plugin::preparer::device_status::{
    DeviceStatusConfig, DeviceStatusWriter, FIELD_MANAGER, RetryPolicy,
};
use kerf_kubelet_plugin::preparer::{ClaimRef, Preparer, PreparerConfig};
use kerf_proto::client::Claim;
use kerf_tests::fake_api::RecordedRequest;
use kerf_tests::fixtures;
use kerf_tests::logs::CapturedLogs;
use kerf_tests::wait::until;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(10);

/// A preparer of `node` whose status writer applies through the node's fake API server.
struct StatusNode {
    node: TestNode,
    preparer: Arc<Preparer>,
    writer: DeviceStatusWriter,
    registry: Registry,
    shutdown: CancellationToken,
}

impl StatusNode {
    async fn new(profile: &str) -> Self {
        let node = TestNode::new(profile);
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        let shutdown = CancellationToken::new();
        let mut config = DeviceStatusConfig::new(DRIVER, NODE);
        config.retry = RetryPolicy {
            attempts: 4,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(40),
        };
        let (writer, _task) = DeviceStatusWriter::start(
            node.plugin_client(),
            config,
            &mut registry,
            shutdown.clone(),
        );
        std::fs::create_dir_all(node.plugin_dir()).unwrap();
        std::fs::create_dir_all(node.cdi_dir()).unwrap();
        let (checkpoint, _) = CheckpointStore::open(&node.checkpoint_file(), "boot-1")
            .await
            .unwrap();
        let preparer = Preparer::new(
            PreparerConfig {
                driver_name: DRIVER.to_owned(),
                node_name: NODE.to_owned(),
                cdi_dir: node.cdi_dir(),
                cdi_kind: PreparerConfig::cdi_kind_for(DRIVER),
                common_edits: CommonEdits::default(),
                device_nodes: DeviceNodePolicy {
                    host_path_override: Some("/dev/null".into()),
                },
            },
            Arc::new(node.inventory()),
            Arc::new(kerf_kubelet_plugin::claim_reader::ApiClaimReader::new(
                node.plugin_client(),
            )),
            checkpoint,
            GpuSharing::new(None),
            metrics,
        )
        .unwrap()
        .with_device_status(writer.clone());
        StatusNode {
            node,
            preparer: Arc::new(preparer),
            writer,
            registry,
            shutdown,
        }
    }

    async fn prepare(&self, claim: &Claim) {
        let answers = self.preparer.prepare(&[claim_ref(claim)]).await;
        for (uid, answer) in answers {
            answer.unwrap_or_else(|e| panic!("prepare of {uid}: {e}"));
        }
    }

    async fn unprepare(&self, claim: &Claim) {
        for (uid, answer) in self.preparer.unprepare(&[claim_ref(claim)]).await {
            answer.unwrap_or_else(|e| panic!("unprepare of {uid}: {e}"));
        }
    }

    fn claim(&self, name: &str) -> Value {
        self.node
            .api
            .get(&fixtures::claim_path(NAMESPACE, name))
            .unwrap_or_else(|| panic!("claim {name} is gone"))
    }

    /// Deallocates claim `name` as its allocator does once no pod uses it: one `/status`
    /// write clearing `allocation` and `reservedFor`.
    async fn deallocate(&self, name: &str) {
        let claims: kube::Api<ResourceClaim> =
            kube::Api::namespaced(self.node.api.client(), NAMESPACE);
        claims
            .patch_status(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(
                    json!({"status": {"allocation": null, "reservedFor": null}}),
                ),
            )
            .await
            .unwrap();
    }

    fn devices(&self, name: &str) -> Vec<Value> {
        self.claim(name)["status"]["devices"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Status writes (PATCH of a claim's status) so far.
    fn status_writes(&self) -> Vec<RecordedRequest> {
        self.node
            .api
            .requests()
            .into_iter()
            .filter(|r| r.method == "PATCH" && r.path.ends_with("/status"))
            .collect()
    }

    /// The writer's count of `outcome`.
    fn outcomes(&self, outcome: &str) -> u64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        let series =
            format!("kerf_plugin_claim_device_status_writes_total{{outcome=\"{outcome}\"}} ");
        text.lines()
            .find_map(|line| line.strip_prefix(&series))
            .map_or(0, |n| n.trim().parse().unwrap())
    }
}

impl Drop for StatusNode {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn claim_ref(claim: &Claim) -> ClaimRef {
    ClaimRef {
        namespace: claim.namespace.clone(),
        uid: claim.uid.clone(),
        name: claim.name.clone(),
    }
}

fn ready(entry: &Value) -> &Value {
    let conditions = entry["conditions"].as_array().unwrap();
    conditions
        .iter()
        .find(|c| c["type"] == "Ready")
        .unwrap_or_else(|| panic!("no Ready condition in {entry}"))
}

#[tokio::test]
async fn prepare_writes_ready_entries_that_the_deallocation_drops() {
    let status = StatusNode::new("a100-40gb-mig").await;
    let (whole, parent, mig) = status.node.whole_gpu_and_mig();
    let inventory = status.node.inventory();
    let gpu = inventory.gpu_by_minor(whole).unwrap().clone();
    let parent_gpu = inventory.gpu_by_minor(parent).unwrap().clone();

    let whole_claim = status
        .node
        .device_claim("whole", &uid(1), &gpu.device_name());
    let mig_claim = status
        .node
        .device_claim("mig", &uid(2), &mig.device_name(parent));
    let allocation_before = status.claim("whole")["status"]["allocation"].clone();
    // The scheduler's reservation, which the plugin must leave alone.
    let mut reserved = status.claim("whole");
    reserved["status"]["reservedFor"] = json!([{"resource": "pods", "name": "p", "uid": "pod-1"}]);
    status.node.api.insert(reserved);

    status.prepare(&whole_claim).await;
    status.prepare(&mig_claim).await;
    until("both claims have their device status", WAIT, || {
        status.devices("whole").len() == 1 && status.devices("mig").len() == 1
    })
    .await;

    let entry = &status.devices("whole")[0];
    assert_eq!(entry["driver"], json!(DRIVER));
    assert_eq!(entry["pool"], json!(NODE));
    assert_eq!(entry["device"], json!(gpu.device_name()));
    assert_eq!(ready(entry)["status"], json!("True"));
    assert_eq!(ready(entry)["reason"], json!("Prepared"));
    assert_eq!(entry["data"]["gpuUUID"], json!(gpu.uuid));
    assert_eq!(entry["data"]["wholeDevice"], json!(true));
    assert_eq!(entry["data"]["sharing"], json!("Exclusive"));
    assert_eq!(
        entry["data"]["cdiDeviceIDs"],
        json!([format!("k8s.{DRIVER}/gpu={}-{}", uid(1), gpu.device_name())])
    );
    let mig_entry = &status.devices("mig")[0];
    assert_eq!(mig_entry["data"]["gpuUUID"], json!(parent_gpu.uuid));
    assert_eq!(mig_entry["data"]["migUUID"], json!(mig.uuid));
    assert_eq!(mig_entry["data"]["migProfile"], json!(mig.profile));

    let claim = status.claim("whole");
    assert_eq!(claim["status"]["allocation"], allocation_before);
    assert_eq!(claim["status"]["reservedFor"][0]["uid"], json!("pod-1"));

    let writes = status.status_writes();
    assert_eq!(writes.len(), 2, "one write per claim");
    for write in &writes {
        assert_eq!(
            write.content_type.as_deref(),
            Some("application/apply-patch+yaml"),
            "server-side apply"
        );
        assert!(
            write
                .query
                .contains(&format!("fieldManager={FIELD_MANAGER}")),
            "{}",
            write.query
        );
    }

    // A repeated prepare (the kubelet retrying) writes nothing new.
    status.prepare(&whole_claim).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(status.status_writes().len(), 2);

    // The unprepare writes nothing; the deallocation that follows drops the entry.
    status.unprepare(&whole_claim).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(status.status_writes().len(), 2, "no write at unprepare");
    assert_eq!(status.devices("whole").len(), 1);
    status.deallocate("whole").await;
    assert!(
        status.devices("whole").is_empty(),
        "{:?}",
        status.claim("whole")
    );
    assert_eq!(
        status.devices("mig").len(),
        1,
        "the other claim keeps its entry"
    );
    assert_eq!(status.outcomes("written"), 2);
    assert!(status.writer.is_enabled());

    // Prepared again after its deallocation and a new allocation, the claim is written again.
    let mut allocated = status.claim("whole");
    allocated["status"]["allocation"] = allocation_before;
    status.node.api.insert(allocated);
    status.prepare(&whole_claim).await;
    until("the claim's entry is written again", WAIT, || {
        status.devices("whole").len() == 1
    })
    .await;
    assert_eq!(status.outcomes("written"), 3);
}

#[tokio::test]
async fn an_unprepare_cancels_the_claims_waiting_write() {
    let status = StatusNode::new("h100-sxm-80gb").await;
    let first = status.node.device_claim("first", &uid(8), "gpu-0");
    let second = status.node.device_claim("second", &uid(9), "gpu-1");
    status.node.api.delay_next(
        "PATCH",
        &format!("{}/status", fixtures::claim_path(NAMESPACE, "first")),
        Duration::from_millis(300),
        1,
    );
    status.prepare(&first).await;
    until("the first write is in flight", WAIT, || {
        status.status_writes().len() == 1
    })
    .await;
    // The second claim's write waits behind the first; its unprepare cancels it.
    status.prepare(&second).await;
    assert_eq!(status.writer.pending(), 1);
    status.unprepare(&second).await;
    assert_eq!(status.writer.pending(), 0);
    until("the first claim is written", WAIT, || {
        status.devices("first").len() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(status.devices("second").is_empty());
    assert_eq!(
        status.status_writes().len(),
        1,
        "nothing written for the second claim"
    );
}

#[tokio::test]
async fn a_slice_reports_its_memory_compute_and_sharing() {
    let status = StatusNode::new("h100-sxm-80gb").await;
    let claim = status.node.slice_claim("slice", &uid(3), 0, 10 * GIB, 25);
    status.prepare(&claim).await;
    until("the slice has its device status", WAIT, || {
        status.devices("slice").len() == 1
    })
    .await;
    let data = &status.devices("slice")[0]["data"];
    assert_eq!(data["memoryBytes"], json!(10 * GIB));
    assert_eq!(data["computePercent"], json!(25));
    assert_eq!(data["sharing"], json!("MPS"));
    assert_eq!(data.get("wholeDevice"), None);
}

#[tokio::test]
async fn a_claim_deleted_before_the_write_is_no_error() {
    let status = StatusNode::new("h100-sxm-80gb").await;
    let logs = CapturedLogs::default();
    let _guard = logs.capture(tracing::Level::WARN);
    let claim = status.node.device_claim("doomed", &uid(4), "gpu-0");
    status.node.api.delay_next(
        "PATCH",
        &format!("{}/status", fixtures::claim_path(NAMESPACE, "doomed")),
        Duration::from_millis(300),
        1,
    );
    status.prepare(&claim).await;
    until("the status write is in flight", WAIT, || {
        status.status_writes().len() == 1
    })
    .await;
    status
        .node
        .api
        .remove(&fixtures::claim_path(NAMESPACE, "doomed"))
        .unwrap();
    until("the write met the deleted claim", WAIT, || {
        status.outcomes("claim_gone") == 1
    })
    .await;

    status.unprepare(&claim).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(status.status_writes().len(), 1, "no retries of a 404");
    assert_eq!(status.outcomes("retried"), 0);
    assert!(status.writer.is_enabled());
    assert_eq!(logs.count("WARN"), 0, "a deleted claim is no warning");
}

#[tokio::test]
async fn transient_errors_are_retried() {
    let status = StatusNode::new("h100-sxm-80gb").await;
    let claim = status.node.device_claim("busy", &uid(5), "gpu-0");
    status.node.api.fail_next(
        "PATCH",
        &format!("{}/status", fixtures::claim_path(NAMESPACE, "busy")),
        503,
        2,
    );
    status.prepare(&claim).await;
    until(
        "the status is written after the server recovers",
        WAIT,
        || status.devices("busy").len() == 1,
    )
    .await;
    assert_eq!(status.status_writes().len(), 3);
    assert_eq!(status.outcomes("retried"), 2);
    assert_eq!(status.outcomes("written"), 1);
}

/// Prepares two claims one after the other, then unprepares both: the first write meets the
/// server's refusal, after which nothing more is sent.
async fn refused(status: &StatusNode, logs: &CapturedLogs) {
    let first = status.node.device_claim("first", &uid(6), "gpu-0");
    let second = status.node.device_claim("second", &uid(7), "gpu-1");
    status.prepare(&first).await;
    until("the writer gave up", WAIT, || !status.writer.is_enabled()).await;
    status.prepare(&second).await;
    status.unprepare(&first).await;
    status.unprepare(&second).await;
    // Give a writer that would wrongly go on the time to do so.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(status.status_writes().len(), 1, "one attempt, no loop");
    assert_eq!(
        logs.count("per-device claim status (status.devices) disabled"),
        1,
        "one log line"
    );
    assert!(status.devices("first").is_empty());
    assert!(status.devices("second").is_empty());
    assert_eq!(
        status.outcomes("disabled"),
        1,
        "the later write (the second prepare; an unprepare writes nothing) is counted, not sent"
    );
}

#[tokio::test]
async fn a_server_that_drops_the_field_gets_one_attempt_and_one_log_line() {
    let status = StatusNode::new("h100-sxm-80gb").await;
    status
        .node
        .api
        .drop_field("resourceclaims", "status.devices");
    let logs = CapturedLogs::default();
    let _guard = logs.capture(tracing::Level::WARN);
    refused(&status, &logs).await;
    assert_eq!(status.outcomes("field_dropped"), 1);
    assert_eq!(logs.count("DRAResourceClaimDeviceStatus"), 1);
}

#[tokio::test]
async fn forbidden_gets_one_attempt_and_one_log_line() {
    let status = StatusNode::new("h100-sxm-80gb").await;
    status.node.api.fail_next(
        "PATCH",
        "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/",
        403,
        100,
    );
    let logs = CapturedLogs::default();
    let _guard = logs.capture(tracing::Level::WARN);
    refused(&status, &logs).await;
    assert_eq!(status.outcomes("forbidden"), 1);
    assert_eq!(logs.count("RBAC denies patch on resourceclaims/status"), 1);
}
