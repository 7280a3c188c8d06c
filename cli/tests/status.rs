//! `kerf status` against the fake API server: one A100 node in MIG-mixed mode (two GPUs split
//! into MIG devices, two whole GPUs), with a whole-GPU claim of kube-scheduler on a tainted
//! GPU, two MPS slices of kerf-controller on one GPU, a claim on a MIG device, and an older
//! pool generation that must not show.
//!
//! The command's code is kerf-cli's [`kerf_cli::status`].

// Fixture helpers panic on a broken fixture, which is a bug in this file.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceTaint, ResourceClaim, ResourceSlice};
use kerf_api::ownership::{Owner, OwnershipRecord, publish_owners};
use kerf_cli::status;
use kerf_tests::fake_api::FakeApi;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

const DRIVER: &str = "gpu.kerf.dev";
const NODE: &str = "node-1";
const MIG: &str = "gpu-0-mig-1g-5gb-6";

/// The node's slices as the kubelet plugin publishes them, at `generation`, with owners and a
/// NoExecute taint on gpu-2.
fn slices(generation: i64) -> Vec<ResourceSlice> {
    let inventory = kerf_core::mock::from_spec("a100-40gb-mig").unwrap();
    let mut specs = kerf_api::resource_slices(&inventory, DRIVER, NODE).unwrap();
    let mut record = OwnershipRecord(BTreeMap::from([
        ("gpu-2".to_owned(), Owner::Scheduler),
        ("gpu-3".to_owned(), Owner::Controller),
    ]));
    for device in specs.iter().flat_map(|s| s.devices.iter().flatten()) {
        if device.name.contains("-mig-") {
            record.0.insert(device.name.clone(), Owner::Scheduler);
        }
    }
    publish_owners(&mut specs, &record);
    for device in specs
        .iter_mut()
        .flat_map(|s| s.devices.iter_mut().flatten())
    {
        if device.name == "gpu-2" {
            device.taints = Some(vec![DeviceTaint {
                key: "gpu.kerf.dev/unhealthy".into(),
                value: Some("xid-79".into()),
                effect: "NoExecute".into(),
                time_added: None,
            }]);
        }
    }
    specs
        .into_iter()
        .enumerate()
        .map(|(i, mut spec)| {
            spec.pool.generation = generation;
            let name = format!("{}-g{generation}", kerf_api::slice_name(NODE, DRIVER, i));
            serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": serde_json::to_value(spec).unwrap(),
            }))
            .unwrap()
        })
        .collect()
}

fn uuid(slices: &[ResourceSlice], device: &str) -> String {
    let device = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == device)
        .unwrap();
    device.attributes.as_ref().unwrap()["uuid"]
        .string
        .clone()
        .unwrap()
}

/// A claim allocated on `devices` of node-1, reserved for `pod` when given; `slices` are
/// kerf-controller's `GpuSliceAllocation` entries (which also mark it as the controller's).
fn claim(
    namespace: &str,
    name: &str,
    devices: &[&str],
    pod: Option<&str>,
    slices: &[Value],
) -> ResourceClaim {
    let results: Vec<Value> = devices
        .iter()
        .map(|d| json!({"request": "gpu", "driver": DRIVER, "pool": NODE, "device": d}))
        .collect();
    let mut value = json!({
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.kerf.dev"}}]}},
        "status": {"allocation": {"devices": {"results": results}}},
    });
    if let Some(pod) = pod {
        value["status"]["reservedFor"] =
            json!([{"resource": "pods", "name": pod, "uid": format!("uid-{pod}")}]);
    }
    if !slices.is_empty() {
        value["metadata"]["annotations"] = json!({"gpu.kerf.dev/allocated-node": NODE});
        value["status"]["allocation"]["devices"]["config"] = json!([{
            "source": "FromClaim",
            "requests": ["gpu"],
            "opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": "gpu.kerf.dev/v1alpha1",
                "kind": "GpuSliceAllocation",
                "devices": slices,
            }},
        }]);
    }
    serde_json::from_value(value).unwrap()
}

/// `claim` with the status entry the kubelet plugin writes at prepare for its `gpu-3`, saying
/// who holds the slice's limits.
fn prepared(mut claim: ResourceClaim, memory: &str, compute: &str) -> ResourceClaim {
    let entry = json!({"driver": DRIVER, "pool": NODE, "device": "gpu-3",
        "data": {"limitsHeldBy": {"memory": memory, "compute": compute}}});
    claim.status.as_mut().unwrap().devices = Some(vec![serde_json::from_value(entry).unwrap()]);
    claim
}

fn mps_slice(gpu_uuid: &str, memory_gib: u64, compute_percent: u8) -> Value {
    json!({"pool": NODE, "device": "gpu-3", "gpuUUID": gpu_uuid,
           "memoryBytes": memory_gib << 30, "computePercent": compute_percent, "sharing": "MPS"})
}

fn fixture() -> FakeApi {
    let api = FakeApi::new();
    let current = slices(3);
    for slice in slices(2).iter().chain(&current) {
        api.insert_resource(slice);
    }
    let gpu3 = uuid(&current, "gpu-3");
    for claim in [
        claim("default", "whole", &["gpu-2"], Some("pod-whole"), &[]),
        prepared(
            claim(
                "ml",
                "train-a",
                &["gpu-3"],
                Some("train-a-0"),
                &[mps_slice(&gpu3, 20, 25)],
            ),
            "server",
            "client environment",
        ),
        prepared(
            claim(
                "ml",
                "train-b",
                &["gpu-3"],
                Some("train-b-0"),
                &[mps_slice(&gpu3, 10, 50)],
            ),
            "server",
            "server",
        ),
        claim("default", "mig", &[MIG], None, &[]),
    ] {
        api.insert_resource(&claim);
    }
    // Another driver's claim on a device of the same name: not kerf's.
    let mut foreign = claim("default", "foreign", &["gpu-3"], Some("other"), &[]);
    let results = foreign
        .status
        .as_mut()
        .unwrap()
        .allocation
        .as_mut()
        .unwrap();
    results.devices.as_mut().unwrap().results.as_mut().unwrap()[0].driver =
        "other.example.com".into();
    api.insert_resource(&foreign);
    api
}

async fn current_status(api: &FakeApi) -> status::Status {
    let snapshot = status::fetch(&api.client(), DRIVER).await.unwrap();
    status::Status::new(&snapshot, DRIVER)
}

#[tokio::test]
async fn the_table_shows_owners_usage_health_claims_and_mig_devices() {
    let api = fixture();
    let table = status::table(&current_status(&api).await);
    println!("{table}");
    let line = |prefix: &str| -> String {
        table
            .lines()
            .find(|l| l.trim_start().starts_with(prefix))
            .unwrap_or_else(|| panic!("no line starting with {prefix:?} in\n{table}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(line("node "), "node node-1 pool node-1 generation 3");
    assert_eq!(
        line("gpu-2 "),
        "gpu-2 NVIDIA A100-SXM4-40GB scheduler [##########] 40/40Gi [##########] 100/100% \
         unhealthy (xid-79 NoExecute) default/whole (pod-whole) whole, kube-scheduler"
    );
    assert_eq!(
        line("gpu-3 "),
        "gpu-3 NVIDIA A100-SXM4-40GB controller [########--] 30/40Gi [########--] 75/100% \
         ok ml/train-a (train-a-0) 20Gi 25% MPS, kerf-controller, memory held by server, \
         compute by client environment"
    );
    assert_eq!(
        line("ml/train-b"),
        "ml/train-b (train-b-0) 10Gi 50% MPS, kerf-controller, held by server"
    );
    assert_eq!(
        line(MIG),
        format!(
            "{MIG} 1g.5gb {} scheduler [##########] 4.8/4.8Gi ok default/mig (no pod) whole, \
             kube-scheduler",
            parent_uuid(MIG)
        )
    );
    assert!(!table.contains("foreign"), "{table}");
    assert!(!table.contains("-g2"), "{table}");
    assert_eq!(table.matches("gpu-0-mig-").count(), 3, "{table}");
}

fn parent_uuid(mig: &str) -> String {
    let slices = slices(3);
    let device = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == mig)
        .unwrap();
    device.attributes.as_ref().unwrap()["parentUUID"]
        .string
        .clone()
        .unwrap()
}

#[tokio::test]
async fn json_has_the_documented_shape() {
    let api = fixture();
    let status = current_status(&api).await;
    let doc: Value = serde_json::from_str(&status::json(&status).unwrap()).unwrap();
    let keys = |v: &Value| -> Vec<String> { v.as_object().unwrap().keys().cloned().collect() };
    assert_eq!(
        keys(&doc),
        [
            "driver",
            "nodes",
            "poolLabel",
            "pools",
            "poolsProblem",
            "quotas",
            "unmatchedClaims",
            "version"
        ]
    );
    assert_eq!(doc["version"], 1);
    assert_eq!(doc["driver"], DRIVER);
    let node = &doc["nodes"][0];
    assert_eq!(
        keys(node),
        ["gpus", "migDevices", "node", "pool", "unreadable"]
    );
    assert_eq!(
        node["pool"],
        json!({"name": NODE, "generation": 3, "slices": 1, "expectedSlices": 1})
    );
    let gpus = node["gpus"].as_array().unwrap();
    let names: Vec<&str> = gpus.iter().map(|g| g["device"].as_str().unwrap()).collect();
    assert_eq!(names, ["gpu-2", "gpu-3"]);
    let current = slices(3);
    assert_eq!(
        gpus[1],
        json!({
            "device": "gpu-3",
            "uuid": uuid(&current, "gpu-3"),
            "product": "NVIDIA A100-SXM4-40GB",
            "owner": "controller",
            "memory": {"totalBytes": 40u64 << 30, "usedBytes": 30u64 << 30, "freeBytes": 10u64 << 30},
            "compute": {"usedPercent": 75, "freePercent": 25},
            "health": {"healthy": true, "taints": []},
            "claims": [
                {"namespace": "ml", "name": "train-a", "pods": ["train-a-0"],
                 "size": {"kind": "slice", "memoryBytes": 20u64 << 30, "computePercent": 25, "sharing": "MPS"},
                 "allocator": "kerf-controller",
                 "limitsHeldBy": {"memory": "server", "compute": "client environment"}},
                {"namespace": "ml", "name": "train-b", "pods": ["train-b-0"],
                 "size": {"kind": "slice", "memoryBytes": 10u64 << 30, "computePercent": 50, "sharing": "MPS"},
                 "allocator": "kerf-controller",
                 "limitsHeldBy": {"memory": "server", "compute": "server"}},
            ],
        })
    );
    assert_eq!(
        gpus[0]["health"],
        json!({"healthy": false, "taints": [{"key": "gpu.kerf.dev/unhealthy", "value": "xid-79", "effect": "NoExecute"}]})
    );
    assert_eq!(gpus[0]["claims"][0]["size"], json!({"kind": "whole"}));
    assert_eq!(gpus[0]["claims"][0]["allocator"], "kube-scheduler");
    let mig = node["migDevices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["device"] == MIG)
        .unwrap();
    assert_eq!(
        keys(mig),
        [
            "claims",
            "device",
            "health",
            "memory",
            "owner",
            "parentUuid",
            "product",
            "profile",
            "uuid"
        ]
    );
    assert_eq!(mig["profile"], "1g.5gb");
    assert_eq!(mig["parentUuid"], parent_uuid(MIG));
    assert_eq!(mig["memory"]["freeBytes"], 0);
    assert_eq!(doc["unmatchedClaims"], json!([]));
}

#[tokio::test]
async fn a_claim_on_an_unpublished_device_is_reported_not_dropped() {
    let api = fixture();
    api.insert_resource(&claim("default", "stale", &["gpu-9"], Some("p"), &[]));
    let status = current_status(&api).await;
    let doc = serde_json::to_value(&status).unwrap();
    assert_eq!(doc["unmatchedClaims"][0]["device"], "gpu-9");
    assert_eq!(doc["unmatchedClaims"][0]["claim"]["name"], "stale");
    assert!(status::table(&status).contains("node-1/gpu-9 on default/stale"));
}

/// node-1's Node, in pool `p4d.24xlarge` of the default pool label.
fn labelled_node() -> Node {
    serde_json::from_value(json!({"metadata": {
        "name": NODE,
        "labels": {"node.kubernetes.io/instance-type": "p4d.24xlarge"},
    }}))
    .unwrap()
}

#[tokio::test]
async fn pools_show_the_fragmentation_of_each_node_pool() {
    let api = fixture();
    api.insert_resource(&labelled_node());
    let status = current_status(&api).await;
    // Free: a quarter of gpu-3 (10 of 40Gi, 25 %); gpu-2 is held whole, gpu-0 and gpu-1 are
    // in MIG mode. None of the claims' kinds (a whole GPU, 20Gi 25 %, 10Gi 50 %) fits it.
    assert_eq!(
        serde_json::to_value(&status).unwrap()["pools"],
        json!([{"pool": "p4d.24xlarge", "nodes": 1, "freeGpus": 0.25, "fragmentedGpus": 0.25,
                "ratio": 1.0}])
    );
    let table = status::table(&status);
    assert!(
        table.contains(
            "GPU fragmentation per node pool (label node.kubernetes.io/instance-type)\n  \
             POOL          NODES  FREE GPUS  FRAGMENTED  RATIO\n  \
             p4d.24xlarge  1      0.25       0.25        1\n"
        ),
        "{table}"
    );
}

#[tokio::test]
async fn without_access_to_nodes_the_pools_are_left_out_with_the_reason() {
    let api = fixture();
    api.fail_next("list", "/api/v1/nodes", 403, 1);
    let status = current_status(&api).await;
    assert_eq!(status.pools, None);
    let problem = status.pools_problem.as_deref().unwrap();
    assert!(
        problem.starts_with("not allowed to list Nodes"),
        "{problem}"
    );
    // Everything else is shown.
    assert_eq!(status.nodes.len(), 1);
    let table = status::table(&status);
    assert!(
        table.contains(&format!(
            "GPU fragmentation per node pool (label node.kubernetes.io/instance-type): \
             not shown, {problem}\n"
        )),
        "{table}"
    );
}

#[tokio::test]
async fn watch_renders_again_after_a_change_and_stops_on_shutdown() {
    let api = fixture();
    let (renders, mut rendered) = mpsc::unbounded_channel();
    let (stop, stopped) = oneshot::channel::<()>();
    let client = api.client();
    let task = tokio::spawn(async move {
        status::watch(
            client,
            DRIVER,
            kerf_api::node_pool::DEFAULT_NODE_POOL_LABEL,
            async {
                let _ = stopped.await;
            },
            move |s| {
                let _ = renders.send(status::table(s));
            },
            |error| panic!("watch failed: {error}"),
        )
        .await
    });
    let first = rendered.recv().await.unwrap();
    assert!(first.contains("ml/train-b"), "{first}");
    assert!(!first.contains("ml/train-c"), "{first}");

    let gpu3 = uuid(&slices(3), "gpu-3");
    api.insert_resource(&claim(
        "ml",
        "train-c",
        &["gpu-3"],
        Some("train-c-0"),
        &[mps_slice(&gpu3, 10, 25)],
    ));
    let second = rendered.recv().await.unwrap();
    assert!(
        second.contains("ml/train-c (train-c-0) 10Gi 25% MPS"),
        "{second}"
    );
    assert!(
        second.contains("[##########] 40/40Gi  [##########] 100/100%"),
        "{second}"
    );
    assert!(second.contains("\n  unlabeled "), "{second}");

    // Nodes are watched for their pool label.
    api.insert_resource(&labelled_node());
    let third = rendered.recv().await.unwrap();
    assert!(third.contains("\n  p4d.24xlarge "), "{third}");

    // A change kerf status does not show (another driver's slice) renders nothing new.
    let mut other = slices(1).remove(0);
    other.metadata.name = Some("other-driver".into());
    other.spec.driver = "other.example.com".into();
    api.insert_resource(&other);

    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    assert!(
        rendered.recv().await.is_none(),
        "no render after the last change"
    );
}

#[tokio::test]
async fn saved_yaml_gives_the_same_status_as_the_cluster() {
    let api = fixture();
    api.insert_resource(&labelled_node());
    let snapshot = status::fetch(&api.client(), DRIVER).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let slices_file = dir.path().join("slices.yaml");
    let mut yaml = String::new();
    for slice in &snapshot.slices {
        yaml.push_str("---\n");
        yaml.push_str(&serde_saphyr::to_string(slice).unwrap());
    }
    std::fs::write(&slices_file, yaml).unwrap();
    // As `kubectl get resourceclaims -A -o yaml` saves them, next to a kind that is skipped.
    let claims_file = dir.path().join("claims.yaml");
    let mut items = serde_json::to_value(&snapshot.claims).unwrap();
    let nodes = serde_json::to_value(&snapshot.nodes).unwrap();
    items
        .as_array_mut()
        .unwrap()
        .extend(nodes.as_array().unwrap().iter().cloned());
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}});
    std::fs::write(
        &claims_file,
        format!(
            "{}---\n{}",
            serde_saphyr::to_string(&list).unwrap(),
            serde_saphyr::to_string(&pod).unwrap()
        ),
    )
    .unwrap();
    let from_files = status::files::read(&[&slices_file, &claims_file]).unwrap();
    assert_eq!(from_files.claims.len(), snapshot.claims.len());
    assert_eq!(from_files.nodes.len(), 1);
    assert_eq!(
        status::Status::new(&from_files, DRIVER),
        status::Status::new(&snapshot, DRIVER)
    );

    std::fs::write(
        &claims_file,
        "kind: ResourceClaim\nmetadata: {name: bad}\nspec: 3\n",
    )
    .unwrap();
    let err = format!("{:#}", status::files::read(&[&claims_file]).unwrap_err());
    assert!(err.contains("ResourceClaim \"bad\""), "{err}");
}
