//! The checkpoint format: round trip, tolerant decoding (unknown and missing fields, older
//! and newer versions, entries that do not decode) and the handling of corrupt files.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Test helpers may fail loudly.

use std::fs;

use kerf_core::cdi::MigCaps;
use kerf_core::checkpoint::{
    self, CURRENT_VERSION, Checkpoint, ClaimEntry, ClaimState, DeviceRecord, GpuSharingEntry,
    LoadOutcome,
};
use kerf_core::enforcement::ServerLimits;
use kerf_core::mps::TimeSliceInterval;
use kerf_core::sharing::{Sharing, SliceLimits};
use proptest::prelude::*;
use serde_json::json;

fn record(device: &str) -> DeviceRecord {
    DeviceRecord {
        request_names: vec!["gpu".into()],
        request_refs: vec!["gpu".into()],
        pool_name: "node-1".into(),
        device_name: device.into(),
        cdi_device_ids: vec![format!("k8s.gpu.kerf.dev/gpu=u-{device}")],
        share_id: None,
        admin_access: false,
        uuid: "GPU-1".into(),
        gpu_minor: 0,
        mig: None,
        mig_instance: None,
        limits: SliceLimits::default(),
        sharing: Sharing::Exclusive,
        time_slice_interval: TimeSliceInterval::Default,
    }
}

fn sample() -> Checkpoint {
    let mut cp = Checkpoint {
        boot_id: "boot-1".into(),
        ..Checkpoint::default()
    };
    cp.claims.insert(
        "uid-1".into(),
        ClaimEntry {
            namespace: "ns".into(),
            name: "claim".into(),
            pod_claim_name: None,
            state: ClaimState::PrepareCompleted,
            devices: vec![
                record("gpu-0"),
                DeviceRecord {
                    share_id: Some("share-1".into()),
                    mig: Some(MigCaps {
                        caps_major: None,
                        gi_cap_minor: 12,
                        ci_cap_minor: 13,
                    }),
                    limits: SliceLimits {
                        memory_bytes: Some(1 << 30),
                        compute_percent: Some(20),
                    },
                    sharing: Sharing::Mps,
                    request_names: vec!["big".into()],
                    request_refs: vec!["big/mig".into()],
                    ..record("gpu-1-mig-1g-10gb-0")
                },
            ],
        },
    );
    cp
}

fn decode_json(v: &serde_json::Value) -> Checkpoint {
    checkpoint::decode(&serde_json::to_vec(v).unwrap()).unwrap()
}

fn arb_text() -> impl Strategy<Value = String> {
    "[a-z0-9./=-]{0,16}"
}

fn arb_record() -> impl Strategy<Value = DeviceRecord> {
    (
        (
            proptest::collection::vec(arb_text(), 0..3),
            proptest::collection::vec(arb_text(), 0..3),
            arb_text(),
            arb_text(),
            proptest::collection::vec(arb_text(), 0..3),
        ),
        (
            proptest::option::of(arb_text()),
            any::<bool>(),
            arb_text(),
            any::<u32>(),
        ),
        (
            proptest::option::of((any::<u32>(), any::<u32>())),
            proptest::option::of(any::<u64>()),
            proptest::option::of(1u8..=100),
            prop_oneof![
                Just(Sharing::Exclusive),
                Just(Sharing::Mps),
                Just(Sharing::TimeSlicing)
            ],
        ),
    )
        .prop_map(
            |(
                (request_names, request_refs, pool_name, device_name, cdi_device_ids),
                (share_id, admin_access, uuid, gpu_minor),
                (mig, memory_bytes, compute_percent, sharing),
            )| {
                DeviceRecord {
                    request_names,
                    request_refs,
                    pool_name,
                    device_name,
                    cdi_device_ids,
                    share_id,
                    admin_access,
                    uuid,
                    gpu_minor,
                    mig: mig.map(|(gi_cap_minor, ci_cap_minor)| MigCaps {
                        caps_major: None,
                        gi_cap_minor,
                        ci_cap_minor,
                    }),
                    mig_instance: None,
                    limits: SliceLimits {
                        memory_bytes,
                        compute_percent,
                    },
                    sharing,
                    time_slice_interval: TimeSliceInterval::Default,
                }
            },
        )
}

fn arb_checkpoint() -> impl Strategy<Value = Checkpoint> {
    let entry = (
        arb_text(),
        arb_text(),
        proptest::option::of(arb_text()),
        any::<bool>(),
        proptest::collection::vec(arb_record(), 0..4),
    )
        .prop_map(
            |(namespace, name, pod_claim_name, done, devices)| ClaimEntry {
                namespace,
                name,
                pod_claim_name,
                state: if done {
                    ClaimState::PrepareCompleted
                } else {
                    ClaimState::PrepareStarted
                },
                devices,
            },
        );
    (
        arb_text(),
        proptest::collection::btree_map(arb_text(), entry, 0..6),
    )
        .prop_map(|(boot_id, claims)| Checkpoint {
            boot_id,
            claims,
            ..Checkpoint::default()
        })
}

proptest! {
    #[test]
    fn round_trip(cp in arb_checkpoint()) {
        let bytes = checkpoint::encode(&cp).unwrap();
        prop_assert_eq!(checkpoint::decode(&bytes).unwrap(), cp);
    }
}

#[test]
fn encoding_is_versioned_camel_case_and_sparse() {
    let v: serde_json::Value =
        serde_json::from_slice(&checkpoint::encode(&sample()).unwrap()).unwrap();
    assert_eq!(v["version"], CURRENT_VERSION);
    assert_eq!(v["bootId"], "boot-1");
    let devices = &v["claims"]["uid-1"]["devices"];
    assert_eq!(v["claims"]["uid-1"]["state"], "PrepareCompleted");
    assert_eq!(
        devices[1]["mig"],
        json!({"giCapMinor": 12, "ciCapMinor": 13})
    );
    assert_eq!(
        devices[1]["limits"],
        json!({"memoryBytes": 1u64 << 30, "computePercent": 20})
    );
    assert_eq!(devices[1]["sharing"], "MPS");
    assert_eq!(devices[1]["shareId"], "share-1");
    assert_eq!(devices[1]["requestNames"], json!(["big"]));
    assert_eq!(devices[1]["requestRefs"], json!(["big/mig"]));
    assert!(
        v["claims"]["uid-1"].get("podClaimName").is_none(),
        "podClaimName written though unset"
    );
    for absent in ["shareId", "mig", "adminAccess"] {
        assert!(
            devices[0].get(absent).is_none(),
            "{absent} written though unset"
        );
    }
}

#[test]
fn a_template_claim_keeps_its_pod_claim_name() {
    let mut cp = sample();
    cp.claims.get_mut("uid-1").unwrap().pod_claim_name = Some("gpu".into());
    let v: serde_json::Value = serde_json::from_slice(&checkpoint::encode(&cp).unwrap()).unwrap();
    assert_eq!(v["claims"]["uid-1"]["podClaimName"], "gpu");
    assert_eq!(decode_json(&v), cp);
}

#[test]
fn entries_from_before_pod_claim_names_and_request_refs_decode_without_them() {
    // What a plugin wrote before the fields existed: a direct claim and full names unknown.
    let v = json!({"version": 1, "bootId": "b", "claims": {"u": {
        "namespace": "ns", "name": "claim-x", "state": "PrepareCompleted",
        "devices": [{"requestNames": ["gpu"], "poolName": "node-1", "deviceName": "gpu-0",
            "cdiDeviceIds": ["k8s.gpu.kerf.dev/gpu=u-gpu-0"], "uuid": "GPU-1", "gpuMinor": 0,
            "limits": {}, "sharing": "Exclusive"}]}}});
    let cp = decode_json(&v);
    let entry = &cp.claims["u"];
    assert_eq!(entry.pod_claim_name, None);
    assert_eq!(entry.devices[0].request_names, ["gpu"]);
    assert!(entry.devices[0].request_refs.is_empty());
    assert!(cp.warnings().is_empty());
}

#[test]
fn unknown_fields_are_ignored_everywhere() {
    let mut v: serde_json::Value =
        serde_json::from_slice(&checkpoint::encode(&sample()).unwrap()).unwrap();
    v["future"] = json!({"x": 1});
    v["claims"]["uid-1"]["preparedAt"] = json!("2030-01-01T00:00:00Z");
    v["claims"]["uid-1"]["devices"][0]["vgpuProfile"] = json!("A100-4C");
    v["claims"]["uid-1"]["devices"][1]["limits"]["bandwidthPercent"] = json!(5);
    v["claims"]["uid-1"]["devices"][1]["mig"]["placement"] = json!(3);
    let cp = decode_json(&v);
    assert_eq!(cp, sample());
    assert!(cp.warnings().is_empty());
}

#[test]
fn missing_fields_take_defaults() {
    let cp = decode_json(&json!({}));
    assert_eq!(
        (cp.version, cp.boot_id.as_str(), cp.claims.len()),
        (0, "", 0)
    );
    let cp = decode_json(&json!({"claims": {"u": {}}}));
    assert_eq!(cp.claims["u"], ClaimEntry::default());
    assert_eq!(cp.claims["u"].state, ClaimState::PrepareStarted);
    let cp = decode_json(
        &json!({"version": 1, "claims": {"u": {"namespace": "ns", "devices": [{"deviceName": "gpu-0", "mig": {}}]}}}),
    );
    let d = &cp.claims["u"].devices[0];
    assert_eq!(d.device_name, "gpu-0");
    assert_eq!(d.mig, Some(MigCaps::default()));
    assert_eq!(d.sharing, Sharing::Exclusive);
    assert!(d.limits.is_whole());
}

#[test]
fn older_version_decodes() {
    let mut v: serde_json::Value =
        serde_json::from_slice(&checkpoint::encode(&sample()).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("version");
    let cp = decode_json(&v);
    assert_eq!(cp.version, 0);
    assert!(!cp.is_newer_format());
    assert_eq!(cp.claims, sample().claims);
    // Saving it upgrades the format.
    let again: serde_json::Value =
        serde_json::from_slice(&checkpoint::encode(&cp).unwrap()).unwrap();
    assert_eq!(again["version"], CURRENT_VERSION);
}

#[test]
fn newer_version_decodes_what_it_can_and_keeps_the_rest() {
    let strange = json!({"namespace": "ns", "name": "b", "state": "PrepareCompleted",
        "devices": [{"deviceName": "gpu-1", "sharing": "VirtualGPU"}]});
    let v = json!({
        "version": CURRENT_VERSION + 1,
        "bootId": "boot-2",
        "claims": {
            "good": {"namespace": "ns", "name": "a", "state": "PrepareCompleted", "devices": [{"deviceName": "gpu-0"}]},
            "strange": strange,
            "odd-state": {"state": "PrepareRolledBack"},
        },
    });
    let mut cp = decode_json(&v);
    assert!(cp.is_newer_format());
    assert_eq!(cp.boot_id, "boot-2");
    assert_eq!(cp.claims["good"].devices[0].device_name, "gpu-0");
    assert_eq!(
        cp.claims["odd-state"].state,
        ClaimState::PrepareStarted,
        "unknown states read as unfinished"
    );
    assert_eq!(cp.undecodable.len(), 1);
    assert!(
        cp.undecodable["strange"].reason.contains("VirtualGPU"),
        "{}",
        cp.undecodable["strange"].reason
    );
    let warnings = cp.warnings().join("\n");
    assert!(
        warnings.contains("newer") && warnings.contains("strange"),
        "{warnings}"
    );

    // The undecodable entry is written back verbatim and survives another round.
    let written: serde_json::Value =
        serde_json::from_slice(&checkpoint::encode(&cp).unwrap()).unwrap();
    assert_eq!(written["claims"]["strange"], strange);
    let again = decode_json(&written);
    assert_eq!(again.undecodable, cp.undecodable);
    assert_eq!(again.claims, cp.claims);

    assert!(cp.remove_claim("strange"));
    assert!(cp.remove_claim("good"));
    assert!(!cp.remove_claim("good"));
    assert!(cp.undecodable.is_empty());
}

fn corrupt(outcome: LoadOutcome) -> (std::path::PathBuf, String) {
    match outcome {
        LoadOutcome::Corrupt { moved_to, reason } => (moved_to, reason),
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

#[test]
fn save_then_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.json");
    assert_eq!(checkpoint::load(&path).unwrap(), LoadOutcome::Missing);
    checkpoint::save(&path, &sample()).unwrap();
    assert_eq!(
        checkpoint::load(&path).unwrap(),
        LoadOutcome::Loaded(sample())
    );
    let names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    assert!(checkpoint::save(&dir.path().join("missing/checkpoint.json"), &sample()).is_err());
}

#[test]
fn corrupt_files_are_moved_aside_and_kept() {
    let full = checkpoint::encode(&sample()).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("truncated", full[..full.len() / 2].to_vec()),
        ("not json", b"\x00\x01garbage".to_vec()),
        ("array", b"[]".to_vec()),
        ("string", b"\"checkpoint\"".to_vec()),
        ("claims is a list", br#"{"version":1,"claims":[]}"#.to_vec()),
        (
            "version is text",
            br#"{"version":"one","claims":{}}"#.to_vec(),
        ),
    ];
    for (what, bytes) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        fs::write(&path, &bytes).unwrap();
        let (moved_to, reason) = corrupt(checkpoint::load(&path).unwrap());
        assert!(!reason.is_empty(), "{what}");
        assert!(!path.exists(), "{what}: original must be moved");
        assert_eq!(
            fs::read(&moved_to).unwrap(),
            bytes,
            "{what}: kept for inspection"
        );
        let name = moved_to.file_name().unwrap().to_str().unwrap();
        assert!(
            name.starts_with("checkpoint.json.corrupt-"),
            "{what}: {name}"
        );
        assert_eq!(moved_to.parent(), Some(dir.path()));
        if what == "empty" {
            assert!(reason.contains("empty"), "{reason}");
        }
        assert_eq!(
            checkpoint::load(&path).unwrap(),
            LoadOutcome::Missing,
            "{what}: start empty next time"
        );
    }
}

#[test]
fn repeated_corruption_never_overwrites_an_earlier_copy() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cp.json");
    let mut kept = Vec::new();
    for i in 0..3 {
        fs::write(&path, format!("broken {i}")).unwrap();
        kept.push(corrupt(checkpoint::load(&path).unwrap()).0);
    }
    kept.sort();
    kept.dedup();
    assert_eq!(kept.len(), 3);
    let mut contents: Vec<String> = kept
        .iter()
        .map(|p| fs::read_to_string(p).unwrap())
        .collect();
    contents.sort();
    assert_eq!(contents, ["broken 0", "broken 1", "broken 2"]);
}

#[test]
fn read_errors_other_than_missing_are_returned() {
    let dir = tempfile::tempdir().unwrap();
    // A directory where the file should be: reading fails with something other than NotFound.
    let path = dir.path().join("checkpoint.json");
    fs::create_dir(&path).unwrap();
    assert!(matches!(
        checkpoint::load(&path),
        Err(kerf_core::Error::Io { .. })
    ));
    assert!(path.is_dir(), "left alone");
}

#[test]
fn device_record_feeds_the_spec_generator() {
    let cp = sample();
    let d = &cp.claims["uid-1"].devices[1];
    let p = d.prepared_device();
    assert_eq!(
        (p.name.as_str(), p.uuid.as_str(), p.gpu_minor),
        ("gpu-1-mig-1g-10gb-0", "GPU-1", 0)
    );
    assert_eq!((p.mig, p.limits, p.sharing), (d.mig, d.limits, d.sharing));
}

#[test]
fn gpu_sharing_and_time_slices_round_trip_and_a_bad_record_is_dropped_alone() {
    let mut cp = sample();
    cp.gpu_sharing.insert(
        "GPU-1".into(),
        GpuSharingEntry {
            mps_root: Some("/var/run/kerf/mps".into()),
            mps_daemon: Some("pod 8d3e… restarts 2".into()),
            time_slice: None,
            mps_server_limits: Some(ServerLimits {
                pinned_mib: Some(10_240),
                thread_percentage: Some(25),
            }),
        },
    );
    cp.gpu_sharing.insert(
        "GPU-2".into(),
        GpuSharingEntry {
            mps_root: None,
            mps_daemon: None,
            time_slice: Some(TimeSliceInterval::Long),
            mps_server_limits: None,
        },
    );
    if let Some(entry) = cp.claims.get_mut("uid-1") {
        entry.devices[0].sharing = Sharing::TimeSlicing;
        entry.devices[0].time_slice_interval = TimeSliceInterval::Short;
    }
    let bytes = checkpoint::encode(&cp).unwrap();
    assert_eq!(checkpoint::decode(&bytes).unwrap(), cp);

    let mut value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    value["gpuSharing"] = json!("not a map");
    let decoded = checkpoint::decode(&serde_json::to_vec(&value).unwrap()).unwrap();
    assert!(decoded.gpu_sharing.is_empty());
    assert_eq!(
        decoded.claims, cp.claims,
        "claims survive a bad sharing record"
    );
}

/// A checkpoint written before dynamic MIG decodes (no `migInstance`, no `capsMajor`), and a
/// record with an instance round-trips.
#[test]
fn dynamic_mig_fields_are_optional_and_round_trip() {
    let old = serde_json::json!({"version": 1, "bootId": "b", "claims": {"u": {
        "namespace": "n", "name": "c", "state": "PrepareCompleted",
        "devices": [{"deviceName": "gpu-0-mig-1g-5gb-0", "uuid": "MIG-1", "gpuMinor": 0,
                     "mig": {"giCapMinor": 12, "ciCapMinor": 13}}]}}});
    let cp = decode_json(&old);
    let device = &cp.claims["u"].devices[0];
    assert_eq!(device.mig_instance, None);
    assert_eq!(device.mig.unwrap().caps_major, None);
    let mut cp = cp;
    let device = &mut cp.claims.get_mut("u").unwrap().devices[0];
    device.mig_instance = Some(checkpoint::MigInstanceRecord {
        parent_minor: 0,
        gi_id: Some(7),
        ..Default::default()
    });
    device.mig = device.mig.map(|m| MigCaps {
        caps_major: Some(237),
        ..m
    });
    let back = checkpoint::decode(&checkpoint::encode(&cp).unwrap()).unwrap();
    assert_eq!(back.claims, cp.claims);
}
