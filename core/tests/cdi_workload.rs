//! Names a workload can use: per-request variables (`KERF_<REQ>_*`, `KERF_<CLAIM>_<REQ>_*`),
//! the read-only mounts of the claim's KEP-5304 metadata files, the files' JSON, and their
//! host directory (write, remove, orphans).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Test helpers may fail loudly.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{KIND, UID_DIGIT, mig, slice, whole_gpu};
use kerf_core::cdi::{
    self, ClaimSpec, ClaimSpecRequest, ClaimWorkload, CommonEdits, DeviceNodePolicy, Mount,
    PreparedDevice, SpecEncoder,
};
use kerf_core::sharing::Sharing;
use serde_json::{Value, json};

const DRIVER: &str = "gpu.kerf.dev";
const NODE: &str = "node-a";

fn requests(names: &[&[&str]]) -> Vec<Vec<String>> {
    names
        .iter()
        .map(|r| r.iter().map(|&n| n.to_owned()).collect())
        .collect()
}

fn workload(requests: &[Vec<String>]) -> ClaimWorkload<'_> {
    ClaimWorkload {
        driver: DRIVER,
        pool: NODE,
        requests,
        request_refs: &[],
        pod_claim_name: None,
        metadata_dir: Path::new("/var/lib/kubelet/plugins/gpu.kerf.dev/dra-device-metadata"),
    }
}

fn generate(
    claim_name: &str,
    devices: &[PreparedDevice],
    requests: &[Vec<String>],
) -> kerf_core::Result<cdi::GeneratedSpec> {
    let common = CommonEdits::nvidia(common::driver_mounts());
    cdi::generate_for_workload(
        &ClaimSpecRequest {
            kind: KIND,
            claim_uid: UID_DIGIT,
            claim_namespace: "team-a",
            claim_name,
            devices,
            common: &common,
        },
        &DeviceNodePolicy::mock("/dev/null"),
        &workload(requests),
    )
}

/// The env a runtime gives a container that gets `devices` (by index): spec-wide edits, then
/// each device's, a later entry replacing an earlier one of the same name (CDI's
/// `AddMultipleProcessEnv`).
fn container_env(spec: &cdi::Spec, devices: &[usize]) -> BTreeMap<String, String> {
    std::iter::once(&spec.container_edits)
        .chain(devices.iter().map(|&i| &spec.devices[i].container_edits))
        .flat_map(|e| e.env.iter())
        .map(|entry| {
            let (k, v) = entry.split_once('=').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

fn mounts_of(spec: &cdi::Spec, device: usize) -> Vec<&Mount> {
    spec.devices[device].container_edits.mounts.iter().collect()
}

#[test]
fn per_request_variables_under_the_request_and_the_claim_name() {
    let devices = [
        whole_gpu(0),
        whole_gpu(1),
        slice(2, 10 << 30, 25, Sharing::Mps),
    ];
    let reqs = requests(&[&["gpus"], &["gpus"], &["small-slice"]]);
    let spec = generate("train-job", &devices, &reqs).unwrap().spec;
    let env = container_env(&spec, &[0, 1, 2]);
    let uuids = format!("{},{}", devices[0].uuid, devices[1].uuid);
    for prefix in ["KERF_GPUS_", "KERF_TRAIN_JOB_GPUS_"] {
        assert_eq!(env[&format!("{prefix}UUIDS")], uuids, "{prefix}");
        assert_eq!(env[&format!("{prefix}DEVICES")], "gpu-0,gpu-1");
        assert_eq!(env[&format!("{prefix}COUNT")], "2");
        assert_eq!(env[&format!("{prefix}SHARING")], "Exclusive");
        assert!(
            !env.contains_key(&format!("{prefix}MEMORY_BYTES")),
            "whole GPUs"
        );
    }
    for prefix in ["KERF_SMALL_SLICE_", "KERF_TRAIN_JOB_SMALL_SLICE_"] {
        assert_eq!(env[&format!("{prefix}UUIDS")], devices[2].uuid);
        assert_eq!(env[&format!("{prefix}COUNT")], "1");
        assert_eq!(
            env[&format!("{prefix}MEMORY_BYTES")],
            (10u64 << 30).to_string()
        );
        assert_eq!(env[&format!("{prefix}COMPUTE_PERCENT")], "25");
        assert_eq!(env[&format!("{prefix}SHARING")], "MPS");
    }
    // The per-device variables stay.
    let key = cdi::env_key(&cdi::claim_device_name(UID_DIGIT, "gpu-0"));
    assert_eq!(env[&format!("KERF_DEVICE_{key}_UUID")], devices[0].uuid);
}

#[test]
fn a_container_sees_only_the_requests_it_was_given() {
    let devices = [whole_gpu(0), mig(3, 0, 30, 31)];
    let reqs = requests(&[&["a"], &["b"]]);
    let spec = generate("c", &devices, &reqs).unwrap().spec;
    let env = container_env(&spec, &[1]);
    assert_eq!(env["KERF_B_UUIDS"], devices[1].uuid);
    assert!(!env.contains_key("KERF_A_UUIDS"), "{env:?}");
    let paths: Vec<&str> = mounts_of(&spec, 1)
        .iter()
        .map(|m| m.container_path.as_str())
        .collect();
    assert_eq!(
        paths,
        [
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/c/b/gpu.kerf.dev-metadata.json",
            "/var/run/kerf/claims/c.json",
        ]
    );
}

#[test]
fn mixed_slices_of_a_request_leave_out_the_slice_summary() {
    let devices = [
        slice(0, 8 << 30, 25, Sharing::Mps),
        slice(1, 4 << 30, 50, Sharing::Mps),
    ];
    let reqs = requests(&[&["gpu"], &["gpu"]]);
    let env = container_env(&generate("c", &devices, &reqs).unwrap().spec, &[0, 1]);
    assert_eq!(env["KERF_GPU_COUNT"], "2");
    assert!(!env.contains_key("KERF_GPU_MEMORY_BYTES"));
    assert!(!env.contains_key("KERF_GPU_SHARING"));
}

#[test]
fn short_names_that_are_claim_level_variables_are_left_out() {
    // Requests named "device" and "slice" would make KERF_DEVICE_UUIDS and
    // KERF_SLICE_MEMORY_BYTES, which describe the whole claim.
    let devices = [whole_gpu(0), slice(1, 4 << 30, 50, Sharing::Mps)];
    let reqs = requests(&[&["device"], &["slice"]]);
    let spec = generate("c", &devices, &reqs).unwrap().spec;
    for device in &spec.devices {
        for entry in &device.container_edits.env {
            let name = entry.split_once('=').unwrap().0;
            assert!(
                !matches!(
                    name,
                    "KERF_DEVICE_UUIDS" | "KERF_SLICE_MEMORY_BYTES" | "KERF_SLICE_COMPUTE_PERCENT"
                ),
                "{entry}"
            );
        }
    }
    let env = container_env(&spec, &[0, 1]);
    assert_eq!(
        env["KERF_DEVICE_UUIDS"],
        format!("{},{}", devices[0].uuid, devices[1].uuid)
    );
    assert_eq!(env["KERF_C_SLICE_MEMORY_BYTES"], (4u64 << 30).to_string());
    assert_eq!(env["KERF_DEVICE_DEVICES"], "gpu-0", "not claim-level: kept");
}

#[test]
fn two_claims_with_one_request_name_differ_under_their_claim_names() {
    let a = [whole_gpu(0)];
    let b = [whole_gpu(1)];
    let reqs = requests(&[&["gpu"]]);
    let spec_a = generate("first", &a, &reqs).unwrap().spec;
    let spec_b = generate("second", &b, &reqs).unwrap().spec;
    // The runtime applies the claims in the kubelet's order: the later one wins the short
    // names, the claim-named ones stay exact.
    let mut env = container_env(&spec_a, &[0]);
    env.extend(container_env(&spec_b, &[0]));
    assert_eq!(env["KERF_GPU_UUIDS"], b[0].uuid);
    assert_eq!(env["KERF_FIRST_GPU_UUIDS"], a[0].uuid);
    assert_eq!(env["KERF_SECOND_GPU_UUIDS"], b[0].uuid);
}

#[test]
fn a_device_of_two_requests_mounts_both_files_read_only() {
    let devices = [whole_gpu(0)];
    let reqs = requests(&[&["x", "y"]]);
    let spec = generate("c", &devices, &reqs).unwrap().spec;
    let mounts = mounts_of(&spec, 0);
    let host = format!("/var/lib/kubelet/plugins/gpu.kerf.dev/dra-device-metadata/{UID_DIGIT}");
    let got: Vec<(&str, &str)> = mounts
        .iter()
        .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
        .collect();
    let x = format!("{host}/x.json");
    let y = format!("{host}/y.json");
    let claim = format!("{host}/claim.json");
    assert_eq!(
        got,
        [
            (
                x.as_str(),
                "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/c/x/gpu.kerf.dev-metadata.json"
            ),
            (
                y.as_str(),
                "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/c/y/gpu.kerf.dev-metadata.json"
            ),
            (claim.as_str(), "/var/run/kerf/claims/c.json"),
        ]
    );
    for m in mounts {
        assert!(m.options.contains(&"ro".to_owned()), "{m:?}");
        assert!(m.options.contains(&"bind".to_owned()), "{m:?}");
    }
    let env = container_env(&spec, &[0]);
    assert_eq!(env["KERF_X_COUNT"], "1");
    assert_eq!(env["KERF_Y_COUNT"], "1");
}

#[test]
fn bad_request_lists_are_errors_naming_the_problem() {
    let devices = [whole_gpu(0)];
    let err = generate("c", &devices, &requests(&[]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("0 request lists for 1 devices"), "{err}");
    let err = generate("c", &devices, &requests(&[&[]]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"gpu-0\" serves no request"), "{err}");
    let err = generate("c", &devices, &requests(&[&["../x"]]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"../x\"") && err.contains("DNS label"),
        "{err}"
    );
}

#[test]
fn the_encoder_writes_the_generated_bytes() {
    let devices = [
        whole_gpu(0),
        slice(2, 10 << 30, 25, Sharing::Mps),
        mig(3, 0, 30, 31),
    ];
    let reqs = requests(&[&["a"], &["b"], &["a", "b"]]);
    let generated = generate("claim.with.dots", &devices, &reqs).unwrap();
    let common = CommonEdits::nvidia(common::driver_mounts());
    let encoder = SpecEncoder::new(KIND, &common, &DeviceNodePolicy::mock("/dev/null")).unwrap();
    let encoded = encoder
        .encode_for_workload(
            &ClaimSpec {
                claim_uid: UID_DIGIT,
                claim_namespace: "team-a",
                claim_name: "claim.with.dots",
                devices: &devices,
            },
            &workload(&reqs),
        )
        .unwrap();
    assert_eq!(
        String::from_utf8(encoded.bytes.clone()).unwrap(),
        String::from_utf8(cdi::encode_spec(&generated.spec).unwrap()).unwrap()
    );
    assert_eq!(encoded.device_ids, generated.device_ids);
    cdi::decode_spec(&encoded.bytes).unwrap();
}

fn files(devices: &[PreparedDevice], reqs: &[Vec<String>]) -> BTreeMap<String, Value> {
    let claim = ClaimSpec {
        claim_uid: UID_DIGIT,
        claim_namespace: "team-a",
        claim_name: "train",
        devices,
    };
    cdi::metadata_files(&claim, &workload(reqs))
        .unwrap()
        .into_iter()
        .map(|f| (f.name, serde_json::from_slice(&f.contents).unwrap()))
        .collect()
}

#[test]
fn metadata_files_follow_the_kep_5304_schema() {
    let devices = [whole_gpu(0), slice(2, 10 << 30, 25, Sharing::Mps)];
    let reqs = requests(&[&["gpu"], &["small"]]);
    let files = files(&devices, &reqs);
    assert_eq!(
        files.keys().collect::<Vec<_>>(),
        ["claim.json", "gpu.json", "small.json"]
    );
    let small = json!({
        "name": "small",
        "devices": [{
            "driver": "gpu.kerf.dev",
            "pool": "node-a",
            "name": "gpu-2",
            "attributes": {
                "uuid": {"string": devices[1].uuid},
                "minor": {"int": 2},
                "sharing": {"string": "MPS"},
                "memoryBytes": {"int": 10u64 << 30},
                "computePercent": {"int": 25},
            },
        }],
    });
    let meta = json!({
        "name": "train",
        "namespace": "team-a",
        "uid": UID_DIGIT,
        "generation": 1,
    });
    assert_eq!(
        files["small.json"],
        json!({
            "kind": "DeviceMetadata",
            "apiVersion": "metadata.resource.k8s.io/v1alpha1",
            "metadata": meta,
            "requests": [small],
        })
    );
    let claim = &files["claim.json"];
    assert_eq!(claim["metadata"], meta);
    let names: Vec<&str> = claim["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["gpu", "small"]);
    assert_eq!(claim["requests"][1], small);
    assert_eq!(
        claim["requests"][0]["devices"][0]["attributes"],
        json!({
            "uuid": {"string": devices[0].uuid},
            "minor": {"int": 0},
            "sharing": {"string": "Exclusive"},
        })
    );
}

#[test]
fn metadata_files_are_written_removed_and_orphans_cleaned() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("dra-device-metadata");
    let devices = [whole_gpu(0)];
    let reqs = requests(&[&["gpu"]]);
    let claim = |uid| ClaimSpec {
        claim_uid: uid,
        claim_namespace: "ns",
        claim_name: "c",
        devices: &devices,
    };
    for uid in ["uid-a", "uid-b"] {
        let files = cdi::metadata_files(&claim(uid), &workload(&reqs)).unwrap();
        let written = cdi::write_metadata_files(&dir, uid, &files).unwrap();
        assert_eq!(written, dir.join(uid));
        let mut names: Vec<String> = std::fs::read_dir(&written)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["claim.json", "gpu.json"], "no temporary files left");
    }
    assert!(cdi::remove_metadata_files(&dir, "uid-a").unwrap());
    assert!(!cdi::remove_metadata_files(&dir, "uid-a").unwrap());
    std::fs::create_dir_all(dir.join("uid-c")).unwrap();
    let removed = cdi::remove_orphan_metadata(&dir, &["uid-b".to_owned()]).unwrap();
    assert_eq!(removed, 1);
    assert!(dir.join("uid-b/claim.json").exists());
    assert!(!dir.join("uid-c").exists());
    assert_eq!(
        cdi::remove_orphan_metadata(&root.path().join("missing"), &[]).unwrap(),
        0
    );
    let err = cdi::write_metadata_files(&dir, "../x", &[]).unwrap_err();
    assert!(err.to_string().contains("\"../x\""), "{err}");
}

const TEMPLATE_KEP: &str = "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates";

fn spec_for(
    claim_name: &str,
    devices: &[PreparedDevice],
    workload: &ClaimWorkload<'_>,
) -> kerf_core::Result<cdi::GeneratedSpec> {
    let common = CommonEdits::nvidia(common::driver_mounts());
    cdi::generate_for_workload(
        &ClaimSpecRequest {
            kind: KIND,
            claim_uid: UID_DIGIT,
            claim_namespace: "team-a",
            claim_name,
            devices,
            common: &common,
        },
        &DeviceNodePolicy::mock("/dev/null"),
        workload,
    )
}

fn claim_files(
    claim_name: &str,
    devices: &[PreparedDevice],
    workload: &ClaimWorkload<'_>,
) -> kerf_core::Result<BTreeMap<String, Value>> {
    let claim = ClaimSpec {
        claim_uid: UID_DIGIT,
        claim_namespace: "team-a",
        claim_name,
        devices,
    };
    Ok(cdi::metadata_files(&claim, workload)?
        .into_iter()
        .map(|f| (f.name, serde_json::from_slice(&f.contents).unwrap()))
        .collect())
}

#[test]
fn a_template_claim_is_found_under_its_pod_claim_name() {
    let devices = [whole_gpu(0)];
    let reqs = requests(&[&["gpu"]]);
    let generated_name = "pod-1-gpus-x7k2p";
    let template = ClaimWorkload {
        pod_claim_name: Some("gpus"),
        ..workload(&reqs)
    };
    let spec = spec_for(generated_name, &devices, &template).unwrap().spec;
    let paths: Vec<&str> = mounts_of(&spec, 0)
        .iter()
        .map(|m| m.container_path.as_str())
        .collect();
    assert_eq!(
        paths,
        [
            format!("{TEMPLATE_KEP}/gpus/gpu/gpu.kerf.dev-metadata.json").as_str(),
            "/var/run/kerf/claimtemplates/gpus.json",
        ]
    );
    let env = container_env(&spec, &[0]);
    assert_eq!(env["KERF_GPUS_GPU_UUIDS"], devices[0].uuid);
    assert_eq!(env["KERF_GPU_UUIDS"], devices[0].uuid);
    assert!(
        !env.keys().any(|k| k.starts_with("KERF_POD_1_GPUS_X7K2P_")),
        "the generated name is not a variable name: {env:?}"
    );
    // The claim-wide variable still names the claim itself.
    assert_eq!(env["KERF_CLAIM_NAME"], generated_name);

    let files = claim_files(generated_name, &devices, &template).unwrap();
    for file in ["gpu.json", "claim.json"] {
        assert_eq!(files[file]["podClaimName"], "gpus", "{file}");
        assert_eq!(files[file]["metadata"]["name"], generated_name, "{file}");
    }
}

#[test]
fn a_direct_claim_keeps_its_claim_name_and_no_pod_claim_name() {
    let devices = [whole_gpu(0)];
    let reqs = requests(&[&["gpu"]]);
    let spec = generate("shared", &devices, &reqs).unwrap().spec;
    let paths: Vec<&str> = mounts_of(&spec, 0)
        .iter()
        .map(|m| m.container_path.as_str())
        .collect();
    assert_eq!(
        paths,
        [
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/shared/gpu/gpu.kerf.dev-metadata.json",
            "/var/run/kerf/claims/shared.json",
        ]
    );
    let files = claim_files("shared", &devices, &workload(&reqs)).unwrap();
    assert!(files["gpu.json"].get("podClaimName").is_none());
}

#[test]
fn a_direct_and_a_template_claim_of_one_name_mount_different_files() {
    let devices = [whole_gpu(0)];
    let reqs = requests(&[&["gpu"]]);
    let direct = generate("gpus", &devices, &reqs).unwrap().spec;
    let template = ClaimWorkload {
        pod_claim_name: Some("gpus"),
        ..workload(&reqs)
    };
    let generated = spec_for("pod-gpus-abcde", &devices, &template)
        .unwrap()
        .spec;
    let paths = |spec: &cdi::Spec| -> Vec<String> {
        mounts_of(spec, 0)
            .iter()
            .map(|m| m.container_path.clone())
            .collect()
    };
    let direct_paths = paths(&direct);
    for path in paths(&generated) {
        assert!(!direct_paths.contains(&path), "{path} in both");
    }
}

#[test]
fn a_bad_pod_claim_name_is_an_error_naming_the_annotation_and_value() {
    let devices = [whole_gpu(0)];
    let reqs = requests(&[&["gpu"]]);
    for bad in ["../etc", "Gpus", "a/b", ""] {
        let template = ClaimWorkload {
            pod_claim_name: Some(bad),
            ..workload(&reqs)
        };
        let err = spec_for("c", &devices, &template).unwrap_err().to_string();
        assert!(
            err.contains("resource.kubernetes.io/pod-claim-name")
                && err.contains(&format!("{bad:?}")),
            "{err}"
        );
        let err = claim_files("c", &devices, &template)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("resource.kubernetes.io/pod-claim-name"),
            "{err}"
        );
    }
    let err = cdi::check_pod_claim_name("x_y").unwrap_err().to_string();
    assert!(err.contains("\"x_y\""), "{err}");
}

#[test]
fn a_first_available_result_is_named_in_full_under_its_parent_directory() {
    let devices = [mig(3, 0, 30, 31), whole_gpu(1)];
    let reqs = requests(&[&["big"], &["other"]]);
    let refs = requests(&[&["big/mig-1g"], &["other"]]);
    let with_refs = ClaimWorkload {
        request_refs: &refs,
        ..workload(&reqs)
    };
    let files = claim_files("train", &devices, &with_refs).unwrap();
    assert_eq!(
        files.keys().collect::<Vec<_>>(),
        ["big.json", "claim.json", "other.json"],
        "one file per top-level request"
    );
    assert_eq!(files["big.json"]["requests"][0]["name"], "big/mig-1g");
    assert_eq!(files["other.json"]["requests"][0]["name"], "other");
    let names: Vec<&str> = files["claim.json"]["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["big/mig-1g", "other"]);
    let spec = spec_for("train", &devices, &with_refs).unwrap().spec;
    assert_eq!(
        mounts_of(&spec, 0)[0].container_path,
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/train/big/gpu.kerf.dev-metadata.json"
    );
    let env = container_env(&spec, &[0]);
    assert_eq!(env["KERF_BIG_UUIDS"], devices[0].uuid);
    // Without the full names (a checkpoint from before they were kept) the parent stands in.
    let files = claim_files("train", &devices, &workload(&reqs)).unwrap();
    assert_eq!(files["big.json"]["requests"][0]["name"], "big");
    let per_device_fallback = requests(&[&[], &["other"]]);
    let partial = ClaimWorkload {
        request_refs: &per_device_fallback,
        ..workload(&reqs)
    };
    let files = claim_files("train", &devices, &partial).unwrap();
    assert_eq!(files["big.json"]["requests"][0]["name"], "big");
}

#[test]
fn bad_request_references_are_errors() {
    let devices = [whole_gpu(0)];
    let reqs = requests(&[&["gpu"]]);
    let misaligned = requests(&[&["gpu"], &["gpu"]]);
    let err = claim_files(
        "c",
        &devices,
        &ClaimWorkload {
            request_refs: &misaligned,
            ..workload(&reqs)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("2 request reference lists for 1 devices"),
        "{err}"
    );
    let bad = requests(&[&["gpu/../x"]]);
    let err = claim_files(
        "c",
        &devices,
        &ClaimWorkload {
            request_refs: &bad,
            ..workload(&reqs)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("DNS label"), "{err}");
}
