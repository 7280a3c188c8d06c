//! `kerf status` with GpuQuotas against the fake API server: per namespace the use against
//! each cap, in total and per class, as kerf-controller's recount left it in the status; a
//! quota not counted yet and one kerf does not enforce say so; the JSON document carries the
//! numbers; saved YAML gives the same; a cluster without the GpuQuota CRD shows none.
//!
//! The command's code is kerf-cli's [`kerf_cli::status`].

// Fixture helpers panic on a broken fixture, which is a bug in this file.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kerf_cli::status;
use kerf_tests::fake_api::FakeApi;
use serde_json::{Value, json};

const DRIVER: &str = "gpu.kerf.dev";
const GIB: u64 = 1 << 30;

/// team-a as the recount leaves it: 20Gi of slices and one H100 of 80Gi; team-b not counted
/// yet; team-c with a spec kerf does not enforce.
fn quotas() -> Vec<Value> {
    vec![
        json!({
            "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuQuota",
            "metadata": {"name": "team-a", "namespace": "team-a"},
            "spec": {
                "hard": {"memory": "160Gi", "compute": 300, "gpus": 2},
                "classes": [{"name": "h100-slice", "hard": {"memory": "40Gi"}}],
            },
            "status": {
                "hard": {"memory": "160Gi", "compute": 300, "gpus": 2},
                "used": {"memory": "100Gi", "compute": 150, "gpus": 1},
                "classes": [{"name": "h100-slice", "hard": {"memory": "40Gi"},
                             "used": {"memory": "20Gi", "compute": 50, "gpus": 0}}],
                "admitted": [{"name": "c", "uid": "u", "time": "2026-01-01T00:00:00Z",
                              "charge": {"memory": "20Gi", "compute": 50, "gpus": 0}}],
                "conditions": [{"type": "Ready", "status": "True", "reason": "Enforced",
                                "message": "m", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
            },
        }),
        json!({
            "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuQuota",
            "metadata": {"name": "small", "namespace": "team-b"},
            "spec": {"hard": {"gpus": 1}},
        }),
        json!({
            "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuQuota",
            "metadata": {"name": "twice", "namespace": "team-c"},
            "spec": {"hard": {"gpus": 1}, "classes": [{"name": "a", "hard": {}}, {"name": "a", "hard": {}}]},
            "status": {
                "used": {"memory": "0", "compute": 0, "gpus": 0},
                "conditions": [{"type": "Ready", "status": "False", "reason": "InvalidSpec",
                                "message": "spec.classes[1].name: \"a\" is listed twice",
                                "lastTransitionTime": "2026-01-01T00:00:00Z"}],
            },
        }),
    ]
}

fn fixture() -> FakeApi {
    let api = FakeApi::new();
    for quota in quotas() {
        api.insert(quota);
    }
    api
}

async fn current_status(api: &FakeApi) -> status::Status {
    let snapshot = status::fetch(&api.client(), DRIVER).await.unwrap();
    status::Status::new(&snapshot, DRIVER)
}

/// The table's lines from the quota header on, each with its cells single-spaced.
fn quota_lines(table: &str) -> Vec<String> {
    table
        .lines()
        .skip_while(|l| *l != "GPU quotas")
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect()
}

#[tokio::test]
async fn the_table_shows_each_quota_per_namespace_and_class() {
    let api = fixture();
    let table = status::table(&current_status(&api).await);
    println!("{table}");
    assert_eq!(
        quota_lines(&table),
        [
            "GPU quotas",
            "NAMESPACE QUOTA CLASS MEMORY COMPUTE GPUS PENDING",
            "team-a team-a (all) 100/160Gi 150/300 1/2 1",
            "h100-slice 20/40Gi 50 0",
            "team-b small (all) ?Gi ? ?/1 0",
            "team-c twice (all) 0Gi 0 0/1 0",
            "a ?Gi ? ?",
            "a ?Gi ? ?",
            "team-b/small has not been counted yet (is kerf-controller running?)",
            "team-c/twice is not enforced: spec.classes[1].name: \"a\" is listed twice",
        ]
    );
}

#[tokio::test]
async fn the_json_document_carries_the_numbers() {
    let api = fixture();
    let doc: Value =
        serde_json::from_str(&status::json(&current_status(&api).await).unwrap()).unwrap();
    let quotas = doc["quotas"].as_array().unwrap();
    assert_eq!(quotas.len(), 3);
    assert_eq!(
        quotas[0],
        json!({
            "namespace": "team-a", "name": "team-a", "ready": true, "problem": null,
            "total": {
                "used": {"memoryBytes": 100 * GIB, "compute": 150, "gpus": 1},
                "hard": {"memoryBytes": 160 * GIB, "compute": 300, "gpus": 2},
            },
            "classes": [{
                "class": "h100-slice",
                "used": {"memoryBytes": 20 * GIB, "compute": 50, "gpus": 0},
                "hard": {"memoryBytes": 40 * GIB, "compute": null, "gpus": null},
            }],
            "pendingAdmissions": 1,
        })
    );
    assert_eq!(quotas[1]["ready"], Value::Null);
    assert_eq!(quotas[1]["total"]["used"], Value::Null);
    assert_eq!(quotas[2]["ready"], false);
}

#[tokio::test]
async fn saved_yaml_gives_the_same_quotas_as_the_cluster() {
    let api = fixture();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("quotas.yaml");
    let list = json!({"apiVersion": "v1", "kind": "List", "items": quotas()});
    std::fs::write(&file, serde_saphyr::to_string(&list).unwrap()).unwrap();
    let from_file = status::files::read(&[&file]).unwrap();
    assert_eq!(
        status::Status::new(&from_file, DRIVER).quotas,
        current_status(&api).await.quotas
    );
}

#[tokio::test]
async fn a_status_without_quotas_shows_no_quota_section() {
    let api = FakeApi::new();
    let table = status::table(&current_status(&api).await);
    assert!(!table.contains("GPU quotas"), "{table}");
}

#[tokio::test]
async fn a_cluster_without_the_gpu_quota_crd_shows_no_quotas() {
    let api = fixture();
    // kube-apiserver answers 404 for a resource path no API group serves.
    api.fail_next("list", "/apis/gpu.kerf.dev/v1alpha1/gpuquotas", 404, 1);
    let status = current_status(&api).await;
    assert!(status.quotas.is_empty());
}
