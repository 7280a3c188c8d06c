//! Scheduler slices at prepare: results kube-scheduler allocated as shares of a shareable GPU
//! (`shareID` + `consumedCapacity`, DRAConsumableCapacity) against the in-memory API server and
//! the fake kubelet, as tests/tests/integration/plugin.rs does for whole GPUs and controller slices.
#![allow(
    clippy::needless_pass_by_value,
    reason = "fixtures take JSON values as the tests write them inline"
)]

use crate::plugin_node::{
    DRIVER, NODE, Node, UID_A, UID_B, UID_C, allocated_claim, claim, mock_uuid, slice_allocation,
    whole_gpu_claim,
};
use kerf_kubelet_plugin::plugin;
use kerf_proto::client::{Claim, DraVersion, KNOWN_SERVICES};
use serde_json::{Value, json};

const SHARE_A: &str = "aaaaaaaa-0000-4000-8000-000000000001";
const SHARE_B: &str = "aaaaaaaa-0000-4000-8000-000000000002";
const GIB: u64 = 1 << 30;

/// A claim whose results are shares: (request, device, shareID, consumedCapacity).
fn share_claim(name: &str, uid: &str, shares: &[(&str, &str, &str, Value)]) -> Value {
    let mut claim = allocated_claim(name, uid, &[], json!([]));
    let results: Vec<Value> = shares
        .iter()
        .map(|(request, device, share, consumed)| {
            json!({"request": request, "driver": DRIVER,
            "pool": NODE, "device": device, "shareID": share, "consumedCapacity": consumed})
        })
        .collect();
    claim["status"]["allocation"]["devices"]["results"] = json!(results);
    claim
}

fn consumed(memory: &str, compute: &str) -> Value {
    json!({"memory": memory, "compute": compute, "multiprocessors": "0"})
}

/// The entries of a CDI spec's environment that carry the slice's limits and sharing.
fn limit_env(spec: &Value) -> Vec<String> {
    let mut env = Vec::new();
    collect_env(spec, &mut env);
    env.retain(|e| {
        e.starts_with("CUDA_MPS_ACTIVE")
            || e.starts_with("CUDA_MPS_PINNED")
            || e.starts_with("KERF_SHARING")
    });
    env.sort();
    env.dedup();
    env
}

/// Every `env` entry anywhere in the spec (spec-wide and per-device container edits).
fn collect_env(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                if key == "env" {
                    out.extend(
                        child
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter_map(|e| e.as_str().map(str::to_owned)),
                    );
                } else {
                    collect_env(child, out);
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|i| collect_env(i, out)),
        _ => {}
    }
}

#[tokio::test]
async fn shares_of_one_gpu_in_two_claims_are_prepared_with_their_limits_and_share_ids() {
    let node = Node::new();
    node.add_claim(share_claim(
        "small",
        UID_A,
        &[("gpu", "gpu-0", SHARE_A, consumed("10Gi", "25"))],
    ));
    node.add_claim(share_claim(
        "large",
        UID_B,
        &[("gpu", "gpu-0", SHARE_B, consumed("40Gi", "50"))],
    ));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let answers = kubelet
        .prepare(&[claim("small", UID_A), claim("large", UID_B)])
        .await
        .unwrap();
    let small = answers[UID_A].clone().unwrap();
    let large = answers[UID_B].clone().unwrap();
    assert_eq!(small[0].share_id.as_deref(), Some(SHARE_A));
    assert_eq!(large[0].share_id.as_deref(), Some(SHARE_B));
    assert_eq!(
        limit_env(&node.cdi_spec(UID_A)),
        [
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M",
            "KERF_SHARING=MPS"
        ]
    );
    assert_eq!(
        limit_env(&node.cdi_spec(UID_B)),
        [
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40960M",
            "KERF_SHARING=MPS"
        ]
    );
    let checkpoint = node.checkpoint();
    assert_eq!(
        checkpoint["claims"][UID_A]["devices"][0]["shareId"],
        SHARE_A
    );

    // A whole GPU cannot join a GPU with shares.
    node.add_claim(whole_gpu_claim("whole", UID_C, "gpu-0"));
    let error = kubelet.prepare(&[claim("whole", UID_C)]).await.unwrap()[UID_C]
        .clone()
        .unwrap_err();
    assert!(error.contains("gpu-0"), "{error}");
    plugin.shutdown().await.unwrap();
}

/// `spec` with the claim's identity (UID and name, also as they appear in env keys and
/// paths; `name` must occur nowhere else) replaced by placeholders, so that two claims' specs compare by what their containers get.
fn anonymous(spec: &Value, uid: &str, name: &str) -> Value {
    let key = uid.to_ascii_uppercase().replace('-', "_");
    let text = spec
        .to_string()
        .replace(uid, "UID")
        .replace(&key, "UID")
        .replace(name, "NAME")
        .replace(&name.to_ascii_uppercase().replace('-', "_"), "NAME");
    serde_json::from_str(&text).unwrap()
}

/// A scheduler share and a controller slice (GpuSliceAllocation) of the same GPU, memory,
/// compute and sharing give their containers the same CDI edits: env, device nodes and mounts
/// alike, apart from the claims' names and UIDs.
#[tokio::test]
async fn a_share_gets_the_same_cdi_edits_as_a_controller_slice_of_its_size() {
    let node = Node::new();
    let uuid = mock_uuid(&node, 0);
    node.add_claim(share_claim(
        "share-claim",
        UID_A,
        &[("gpu", "gpu-0", SHARE_A, consumed("10Gi", "30"))],
    ));
    node.add_claim(allocated_claim(
        "slice-claim",
        UID_B,
        &[("gpu", DRIVER, NODE, "gpu-0")],
        slice_allocation("gpu-0", &uuid, 10 * GIB, 30),
    ));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let answers = kubelet
        .prepare(&[claim("share-claim", UID_A), claim("slice-claim", UID_B)])
        .await
        .unwrap();
    assert!(answers.values().all(Result::is_ok), "{answers:?}");
    let share = node.cdi_spec(UID_A);
    assert!(
        limit_env(&share).contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M".to_owned()),
        "{share}"
    );
    assert_eq!(
        anonymous(&share, UID_A, "share-claim"),
        anonymous(&node.cdi_spec(UID_B), UID_B, "slice-claim")
    );
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_share_of_all_memory_is_the_whole_gpu_and_excludes_other_shares() {
    let node = Node::new();
    let memory = plugin::discover(&node.config())
        .unwrap()
        .gpu_by_minor(0)
        .unwrap()
        .memory_bytes;
    node.add_claim(share_claim(
        "all",
        UID_A,
        &[("gpu", "gpu-0", SHARE_A, consumed(&memory.to_string(), "25"))],
    ));
    node.add_claim(share_claim(
        "small",
        UID_B,
        &[("gpu", "gpu-0", SHARE_B, consumed("1Gi", "10"))],
    ));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let all = kubelet.prepare(&[claim("all", UID_A)]).await.unwrap();
    assert_eq!(
        all[UID_A].clone().unwrap()[0].share_id.as_deref(),
        Some(SHARE_A)
    );
    assert!(
        limit_env(&node.cdi_spec(UID_A))
            .iter()
            .all(|e| !e.starts_with("CUDA_MPS"))
    );
    let small = kubelet.prepare(&[claim("small", UID_B)]).await.unwrap();
    let error = small[UID_B].clone().unwrap_err();
    assert!(error.contains("gpu-0"), "{error}");
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn v1beta1_answers_carry_no_share_id() {
    let node = Node::new();
    node.add_claim(share_claim(
        "a",
        UID_A,
        &[("gpu", "gpu-0", SHARE_A, consumed("10Gi", "25"))],
    ));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&["v1beta1.DRAPlugin"]).await;
    assert_eq!(kubelet.version, DraVersion::V1beta1);
    let answers = kubelet.prepare(&[claim("a", UID_A)]).await.unwrap();
    let devices = answers[UID_A].clone().unwrap();
    assert_eq!(devices[0].device_name, "gpu-0");
    assert_eq!(devices[0].share_id, None);
    // The checkpoint still knows the share.
    assert_eq!(
        node.checkpoint()["claims"][UID_A]["devices"][0]["shareId"],
        SHARE_A
    );
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn bad_consumed_capacity_is_a_per_claim_error_naming_the_field() {
    let node = Node::new();
    let cases = [
        ("missing", json!({"compute": "10"}), "missing"),
        ("zero", json!({"memory": "0"}), "\"0\""),
        ("text", json!({"memory": "plenty"}), "plenty"),
    ];
    let uids = [UID_A, UID_B, UID_C];
    for ((name, consumed, _), uid) in cases.iter().zip(uids) {
        node.add_claim(share_claim(
            name,
            uid,
            &[("gpu", "gpu-0", SHARE_A, consumed.clone())],
        ));
    }
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let claims: Vec<Claim> = cases
        .iter()
        .zip(uids)
        .map(|((name, ..), uid)| claim(name, uid))
        .collect();
    let answers = kubelet.prepare(&claims).await.unwrap();
    for ((name, _, value), uid) in cases.iter().zip(uids) {
        let error = answers[uid].clone().unwrap_err();
        assert!(
            error.contains("status.allocation.devices.results[0].consumedCapacity.memory")
                && error.contains(value),
            "{name}: {error}"
        );
    }
    assert!(node.cdi_files().is_empty(), "{:?}", node.cdi_files());
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_nodes_shared_publication_gives_a_share_its_sharing_and_a_share_larger_than_the_gpu_is_refused()
 {
    let node = Node::new();
    node.add_claim(share_claim(
        "sliced",
        UID_A,
        &[("gpu", "gpu-0", SHARE_A, consumed("10Gi", "25"))],
    ));
    node.add_claim(share_claim(
        "huge",
        UID_B,
        &[("gpu", "gpu-1", SHARE_B, consumed("1Ti", "25"))],
    ));
    let publication = json!({"gpu-0": {"memoryGranularityBytes": GIB,
        "sharing": {"strategy": "TimeSlicing"}}});
    let plugin = node
        .start_publishing(json!({
            kerf_api::shared_publication::SHARED_PUBLICATION_ANNOTATION: publication.to_string()
        }))
        .await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let answers = kubelet
        .prepare(&[claim("sliced", UID_A), claim("huge", UID_B)])
        .await
        .unwrap();
    let sliced = answers[UID_A].clone().unwrap();
    assert_eq!(sliced[0].share_id.as_deref(), Some(SHARE_A));
    assert_eq!(
        node.checkpoint()["claims"][UID_A]["devices"][0]["sharing"],
        "TimeSlicing"
    );
    let env = limit_env(&node.cdi_spec(UID_A));
    assert!(
        env.contains(&"KERF_SHARING=TimeSlicing".to_owned()),
        "{env:?}"
    );

    let error = answers[UID_B].clone().unwrap_err();
    assert!(
        error.contains("status.allocation.devices.results[0].consumedCapacity.memory")
            && error.contains("1Ti"),
        "{error}"
    );
    assert!(
        node.checkpoint()["claims"].get(UID_B).is_none(),
        "{}",
        node.checkpoint()
    );
    plugin.shutdown().await.unwrap();
}

/// A claim of two requests, `a` and `b`.
fn two_request_claim(name: &str, uid: &str, results: Vec<Value>) -> Value {
    let mut claim = allocated_claim(name, uid, &[], json!([]));
    claim["spec"]["devices"]["requests"] = json!([
        {"name": "a", "exactly": {"deviceClassName": DRIVER}},
        {"name": "b", "exactly": {"deviceClassName": DRIVER}},
    ]);
    claim["status"]["allocation"]["devices"]["results"] = json!(results);
    claim
}

fn share_result(request: &str, device: &str, share: &str, consumed: Value) -> Value {
    json!({"request": request, "driver": DRIVER, "pool": NODE, "device": device,
        "shareID": share, "consumedCapacity": consumed})
}

/// The per-device `KERF_DEVICE_*_MEMORY_BYTES` value of each device of a CDI spec, by name.
fn device_memory(spec: &Value) -> Vec<(String, String)> {
    spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            let memory = d["containerEdits"]["env"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(Value::as_str)
                .find_map(|e| e.split_once("_MEMORY_BYTES=").map(|(_, v)| v.to_owned()))
                .unwrap_or_default();
            (d["name"].as_str().unwrap().to_owned(), memory)
        })
        .collect()
}

/// A device of a prepare answer: requests, device, CDI IDs, share ID.
type Answered<'a> = (Vec<String>, &'a str, Vec<String>, Option<&'a str>);

const SHARE_C: &str = "cccccccc-0000-4000-8000-000000000003";

fn pair_claim() -> Value {
    two_request_claim(
        "pair",
        UID_A,
        vec![
            share_result("a", "gpu-0", SHARE_A, consumed("10Gi", "25")),
            share_result("b", "gpu-0", SHARE_C, consumed("20Gi", "50")),
        ],
    )
}

#[tokio::test]
async fn two_shares_of_one_gpu_in_one_claim_are_two_devices_with_their_own_limits() {
    let node = Node::new();
    node.add_claim(pair_claim());
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let devices = kubelet.prepare(&[claim("pair", UID_A)]).await.unwrap()[UID_A]
        .clone()
        .unwrap();
    let kind = format!("k8s.{DRIVER}/gpu");
    let answered: Vec<Answered<'_>> = devices
        .iter()
        .map(|d| {
            (
                d.request_names.clone(),
                d.device_name.as_str(),
                d.cdi_device_ids.clone(),
                d.share_id.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        answered,
        [
            (
                vec!["a".to_owned()],
                "gpu-0",
                vec![format!("{kind}={UID_A}-gpu-0-aaaaaaaa")],
                Some(SHARE_A)
            ),
            (
                vec!["b".to_owned()],
                "gpu-0",
                vec![format!("{kind}={UID_A}-gpu-0-cccccccc")],
                Some(SHARE_C)
            ),
        ]
    );
    let spec = node.cdi_spec(UID_A);
    let mut memory = device_memory(&spec);
    memory.sort();
    assert_eq!(
        memory,
        [
            (format!("{UID_A}-gpu-0-aaaaaaaa"), (10 * GIB).to_string()),
            (format!("{UID_A}-gpu-0-cccccccc"), (20 * GIB).to_string()),
        ]
    );
    let recorded = node.checkpoint()["claims"][UID_A]["devices"].clone();
    assert_eq!(recorded.as_array().unwrap().len(), 2, "{recorded}");

    // A repeat prepare (the kubelet's retry, or after a reboot emptied the CDI directory)
    // answers the same IDs from the checkpoint and writes the same spec.
    std::fs::remove_file(
        node.root
            .join("cdi")
            .join(format!("k8s.{DRIVER}-gpu_{UID_A}.json")),
    )
    .unwrap();
    let again = kubelet.prepare(&[claim("pair", UID_A)]).await.unwrap()[UID_A]
        .clone()
        .unwrap();
    assert_eq!(again, devices);
    assert_eq!(node.cdi_spec(UID_A), spec);

    kubelet.unprepare(&[claim("pair", UID_A)]).await.unwrap()[UID_A]
        .clone()
        .unwrap();
    assert!(node.cdi_files().is_empty(), "{:?}", node.cdi_files());
    assert!(node.checkpoint()["claims"].get(UID_A).is_none());
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn two_shares_of_one_gpu_in_one_claim_over_v1beta1_carry_no_share_id() {
    let node = Node::new();
    node.add_claim(pair_claim());
    let plugin = node.start().await;
    let kubelet = node.kubelet(&["v1beta1.DRAPlugin"]).await;
    assert_eq!(kubelet.version, DraVersion::V1beta1);
    let devices = kubelet.prepare(&[claim("pair", UID_A)]).await.unwrap()[UID_A]
        .clone()
        .unwrap();
    assert_eq!(devices.len(), 2, "{devices:?}");
    assert!(devices.iter().all(|d| d.share_id.is_none()), "{devices:?}");
    assert_ne!(devices[0].cdi_device_ids, devices[1].cdi_device_ids);
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_whole_gpu_and_a_share_of_it_in_one_claim_are_refused() {
    let node = Node::new();
    node.add_claim(two_request_claim(
        "mixed",
        UID_A,
        vec![
            json!({"request": "a", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}),
            share_result("b", "gpu-0", SHARE_A, consumed("10Gi", "25")),
        ],
    ));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let error = kubelet.prepare(&[claim("mixed", UID_A)]).await.unwrap()[UID_A]
        .clone()
        .unwrap_err();
    assert!(
        error.contains("status.allocation.devices.results[1]")
            && error.contains("\"gpu-0\"")
            && error.contains("whole")
            && error.contains(SHARE_A),
        "{error}"
    );
    assert!(node.cdi_files().is_empty(), "{:?}", node.cdi_files());
    plugin.shutdown().await.unwrap();
}
