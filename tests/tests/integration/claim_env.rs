//! Names a workload can use, end to end through the plugin: the per-request variables and
//! the read-only mounts of the claim's KEP-5304 metadata files in the CDI spec the plugin
//! writes, the files' JSON on the host, their removal at unprepare and their restoration at
//! start-up (after a reboot emptied the CDI directory); claims made from a
//! ResourceClaimTemplate under their pod claim name, full `parent/sub` request names, a bad
//! pod claim name annotation, and checkpoints from before either was kept.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::common;
use crate::common::{DRIVER, GIB, NAMESPACE, NODE, TestNode, uid};
use kerf_proto::client::Claim;
use kerf_tests::fake_kubelet::{FakeKubelet, Pod};
use serde_json::{Value, json};

const KEP_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes/resourceclaims";

/// Every env entry of the spec (spec-wide and per device), as a map.
fn spec_env(spec: &Value) -> BTreeMap<String, String> {
    std::iter::once(&spec["containerEdits"])
        .chain(
            spec["devices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| &d["containerEdits"]),
        )
        .flat_map(|e| e["env"].as_array().cloned().unwrap_or_default())
        .map(|v| {
            let (k, v) = v.as_str().unwrap().split_once('=').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

/// The device mounts of the spec: container path → (host path, options).
fn device_mounts(spec: &Value) -> BTreeMap<String, (PathBuf, Vec<String>)> {
    spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| {
            d["containerEdits"]["mounts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|m| {
            let options = m["options"]
                .as_array()
                .unwrap()
                .iter()
                .map(|o| o.as_str().unwrap().to_owned())
                .collect();
            (
                m["containerPath"].as_str().unwrap().to_owned(),
                (PathBuf::from(m["hostPath"].as_str().unwrap()), options),
            )
        })
        .collect()
}

fn read_json(path: &PathBuf) -> Value {
    serde_json::from_slice(
        &std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

#[tokio::test]
async fn the_spec_carries_request_env_and_metadata_mounts_removed_at_unprepare_restored_at_start() {
    let node = TestNode::new("a100-40gb-mig");
    let (whole_minor, _, _) = node.whole_gpu_and_mig();
    let slice_minor = node.another_whole_gpu(whole_minor);
    let whole = node.device_claim("whole-one", &uid(1), &format!("gpu-{whole_minor}"));
    let slice = node.slice_claim("small", &uid(2), slice_minor, 10 * GIB, 25);
    let mut plugin = node.start_plugin().await;
    let kubelet = FakeKubelet::start(node.kubelet_config());
    kubelet
        .wait_for_registration(1, Duration::from_secs(10))
        .await
        .unwrap();
    let pod = Pod::new("pod-1")
        .with_claim(DRIVER, whole.clone())
        .with_claim(DRIVER, slice.clone());
    kubelet.prepare_pod(&pod).await.unwrap();

    let whole_spec = node.cdi_spec(&uid(1));
    let env = spec_env(&whole_spec);
    let whole_uuid = node
        .inventory()
        .gpu_by_minor(whole_minor)
        .unwrap()
        .uuid
        .clone();
    // Both claims name their request "gpu": the claim-named variables tell them apart.
    assert_eq!(env["KERF_GPU_UUIDS"], whole_uuid);
    assert_eq!(env["KERF_WHOLE_ONE_GPU_UUIDS"], whole_uuid);
    assert_eq!(env["KERF_GPU_COUNT"], "1");
    let slice_env = spec_env(&node.cdi_spec(&uid(2)));
    assert_eq!(
        slice_env["KERF_SMALL_GPU_MEMORY_BYTES"],
        (10 * GIB).to_string()
    );
    assert_eq!(slice_env["KERF_SMALL_GPU_COMPUTE_PERCENT"], "25");

    let mounts = device_mounts(&whole_spec);
    let kep_path = format!("{KEP_DIR}/whole-one/gpu/{DRIVER}-metadata.json");
    let claim_path = "/var/run/kerf/claims/whole-one.json".to_owned();
    assert_eq!(
        mounts.keys().collect::<Vec<_>>(),
        [&claim_path, &kep_path],
        "{mounts:?}"
    );
    let (kep_host, options) = &mounts[&kep_path];
    assert!(options.contains(&"ro".to_owned()), "{options:?}");
    assert!(
        kep_host.starts_with(node.plugin_dir()),
        "{}",
        kep_host.display()
    );
    let metadata = read_json(kep_host);
    assert_eq!(metadata["kind"], "DeviceMetadata");
    assert_eq!(metadata["apiVersion"], "metadata.resource.k8s.io/v1alpha1");
    assert_eq!(metadata["metadata"]["name"], "whole-one");
    assert_eq!(metadata["metadata"]["namespace"], NAMESPACE);
    assert_eq!(metadata["metadata"]["uid"], uid(1));
    let device = &metadata["requests"][0]["devices"][0];
    assert_eq!(metadata["requests"][0]["name"], "gpu");
    assert_eq!(device["driver"], DRIVER);
    assert_eq!(device["pool"], NODE);
    assert_eq!(device["name"], format!("gpu-{whole_minor}"));
    assert_eq!(device["attributes"]["uuid"]["string"], whole_uuid.as_str());
    let claim_file = &mounts[&claim_path].0;
    assert_eq!(read_json(claim_file)["requests"], metadata["requests"]);

    // A reboot empties the CDI directory (a tmpfs) and the files may be gone too; start-up
    // rebuilds specs and files, and drops the files of a claim no checkpoint entry owns.
    plugin.shutdown().await.unwrap();
    let metadata_dir = node.plugin_dir().join("dra-device-metadata");
    std::fs::remove_dir_all(node.cdi_dir()).unwrap();
    std::fs::remove_dir_all(&metadata_dir).unwrap();
    let orphan = metadata_dir.join(uid(9));
    std::fs::create_dir_all(&orphan).unwrap();
    plugin = node.start_plugin().await;
    assert_eq!(node.cdi_spec(&uid(1)), whole_spec);
    assert_eq!(read_json(kep_host), metadata);
    assert!(!orphan.exists(), "orphan metadata removed at start-up");

    kubelet.unprepare_pod(&pod).await.unwrap();
    assert!(!kep_host.exists(), "{}", kep_host.display());
    assert!(!claim_file.exists());
    assert!(!metadata_dir.join(uid(2)).exists());
    assert!(
        !metadata_dir.join(uid(1)).exists(),
        "{}",
        metadata_dir.display()
    );
    plugin.shutdown().await.unwrap();
}

/// A claim kube-controller-manager generated from a ResourceClaimTemplate for the pod claim
/// `gpus`, allocated one whole GPU through the `firstAvailable` subrequest `big/whole`.
fn template_claim(node: &TestNode, name: &str, uid: &str, device: &str, pod_claim: &str) -> Claim {
    let mut claim = common::allocated_claim(
        name,
        uid,
        &json!({"devices": {"results": [
            {"request": "big/whole", "driver": DRIVER, "pool": NODE, "device": device}
        ]}}),
    );
    claim["metadata"]["annotations"] = json!({"resource.kubernetes.io/pod-claim-name": pod_claim});
    claim["spec"] = json!({"devices": {"requests": [{"name": "big", "firstAvailable": [
        {"name": "whole", "deviceClassName": DRIVER}
    ]}]}});
    node.add_claim(claim)
}

#[tokio::test]
async fn a_template_claim_is_found_under_its_pod_claim_name_with_full_request_names() {
    let node = TestNode::new("a100-40gb-mig");
    let (whole_minor, _, _) = node.whole_gpu_and_mig();
    let device = format!("gpu-{whole_minor}");
    let generated = "pod-1-gpus-x7k2p";
    let claim = template_claim(&node, generated, &uid(3), &device, "gpus");
    let mut plugin = node.start_plugin().await;
    let kubelet = FakeKubelet::start(node.kubelet_config());
    kubelet
        .wait_for_registration(1, Duration::from_secs(10))
        .await
        .unwrap();
    let pod = Pod::new("pod-1").with_claim(DRIVER, claim.clone());
    kubelet.prepare_pod(&pod).await.unwrap();

    let spec = node.cdi_spec(&uid(3));
    let mounts = device_mounts(&spec);
    let kep_path = format!(
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus/big/{DRIVER}-metadata.json"
    );
    let claim_path = "/var/run/kerf/claimtemplates/gpus.json".to_owned();
    assert_eq!(
        mounts.keys().collect::<Vec<_>>(),
        [&claim_path, &kep_path],
        "{mounts:?}"
    );
    let uuid = node
        .inventory()
        .gpu_by_minor(whole_minor)
        .unwrap()
        .uuid
        .clone();
    let env = spec_env(&spec);
    assert_eq!(env["KERF_GPUS_BIG_UUIDS"], uuid);
    assert_eq!(env["KERF_BIG_UUIDS"], uuid);
    assert!(
        !env.keys().any(|k| k.starts_with("KERF_POD_1_GPUS_X7K2P_")),
        "{env:?}"
    );
    let metadata = read_json(&mounts[&kep_path].0);
    assert_eq!(metadata["metadata"]["name"], generated);
    assert_eq!(metadata["podClaimName"], "gpus");
    assert_eq!(metadata["requests"][0]["name"], "big/whole");
    assert_eq!(metadata["requests"][0]["devices"][0]["name"], device);

    // Start-up rebuilds the same spec and files from the checkpoint alone.
    plugin.shutdown().await.unwrap();
    std::fs::remove_dir_all(node.cdi_dir()).unwrap();
    std::fs::remove_dir_all(node.plugin_dir().join("dra-device-metadata")).unwrap();
    plugin = node.start_plugin().await;
    assert_eq!(node.cdi_spec(&uid(3)), spec);
    assert_eq!(read_json(&mounts[&kep_path].0), metadata);
    // A repeated prepare answers from the checkpoint and writes the same again.
    kubelet.prepare_pod(&pod).await.unwrap();
    assert_eq!(node.cdi_spec(&uid(3)), spec);
    kubelet.unprepare_pod(&pod).await.unwrap();
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_bad_pod_claim_name_annotation_fails_only_its_claim() {
    let node = TestNode::new("a100-40gb-mig");
    let (whole_minor, _, _) = node.whole_gpu_and_mig();
    let other_minor = node.another_whole_gpu(whole_minor);
    let bad = template_claim(
        &node,
        "pod-1-x-abcde",
        &uid(4),
        &format!("gpu-{whole_minor}"),
        "../escape",
    );
    let good = node.device_claim("fine", &uid(5), &format!("gpu-{other_minor}"));
    let plugin = node.start_plugin().await;
    let kubelet = FakeKubelet::start(node.kubelet_config());
    kubelet
        .wait_for_registration(1, Duration::from_secs(10))
        .await
        .unwrap();
    let pod = Pod::new("pod-1")
        .with_claim(DRIVER, bad.clone())
        .with_claim(DRIVER, good.clone());
    let err = kubelet.prepare_pod(&pod).await.unwrap_err().to_string();
    assert!(
        err.contains("resource.kubernetes.io/pod-claim-name") && err.contains("\"../escape\""),
        "{err}"
    );
    assert!(
        !node.cdi_dir().join(common::cdi_spec_file(&uid(4))).exists(),
        "nothing prepared for the bad claim"
    );
    assert!(
        node.cdi_dir().join(common::cdi_spec_file(&uid(5))).exists(),
        "the other claim of the batch is prepared"
    );
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_checkpoint_from_before_pod_claim_names_restores_the_paths_it_had() {
    let node = TestNode::new("a100-40gb-mig");
    let (whole_minor, _, _) = node.whole_gpu_and_mig();
    let generated = "pod-1-gpus-x7k2p";
    let claim = template_claim(
        &node,
        generated,
        &uid(6),
        &format!("gpu-{whole_minor}"),
        "gpus",
    );
    let mut plugin = node.start_plugin().await;
    let kubelet = FakeKubelet::start(node.kubelet_config());
    kubelet
        .wait_for_registration(1, Duration::from_secs(10))
        .await
        .unwrap();
    let pod = Pod::new("pod-1").with_claim(DRIVER, claim.clone());
    kubelet.prepare_pod(&pod).await.unwrap();
    plugin.shutdown().await.unwrap();

    // What the plugin wrote before it kept the pod claim name and the full request names.
    let mut checkpoint = node.checkpoint();
    let entry = &mut checkpoint["claims"][uid(6)];
    assert_eq!(entry["podClaimName"], "gpus");
    assert_eq!(entry["devices"][0]["requestRefs"], json!(["big/whole"]));
    entry.as_object_mut().unwrap().remove("podClaimName");
    entry["devices"][0]
        .as_object_mut()
        .unwrap()
        .remove("requestRefs");
    std::fs::write(
        node.checkpoint_file(),
        serde_json::to_vec(&checkpoint).unwrap(),
    )
    .unwrap();
    std::fs::remove_dir_all(node.cdi_dir()).unwrap();
    std::fs::remove_dir_all(node.plugin_dir().join("dra-device-metadata")).unwrap();

    plugin = node.start_plugin().await;
    let spec = node.cdi_spec(&uid(6));
    let mounts = device_mounts(&spec);
    let kep_path = format!("{KEP_DIR}/{generated}/big/{DRIVER}-metadata.json");
    let claim_path = format!("/var/run/kerf/claims/{generated}.json");
    assert_eq!(
        mounts.keys().collect::<Vec<_>>(),
        [&claim_path, &kep_path],
        "{mounts:?}"
    );
    let metadata = read_json(&mounts[&kep_path].0);
    assert_eq!(metadata["requests"][0]["name"], "big");
    assert!(metadata.get("podClaimName").is_none(), "{metadata}");
    assert!(spec_env(&spec).contains_key("KERF_POD_1_GPUS_X7K2P_BIG_UUIDS"));
    kubelet.unprepare_pod(&pod).await.unwrap();
    plugin.shutdown().await.unwrap();
}
