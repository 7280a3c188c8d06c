//! CDI naming rules: kinds, device names, env entries, paths, qualified and file names.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Test helpers may fail loudly.

mod common;

use std::collections::BTreeMap;

use kerf_core::Error;
use kerf_core::cdi::{self, CdiVersion, ContainerEdits, Device, DeviceNode, Hook, Mount, Spec};

fn spec_with(kind: &str, names: &[&str], edits: ContainerEdits) -> Spec {
    Spec {
        cdi_version: CdiVersion::V1_1_0,
        kind: kind.into(),
        annotations: BTreeMap::default(),
        devices: names
            .iter()
            .map(|n| Device {
                name: (*n).into(),
                annotations: BTreeMap::default(),
                container_edits: ContainerEdits::default(),
            })
            .collect(),
        container_edits: edits,
    }
}

fn message(result: kerf_core::Result<()>) -> String {
    match result {
        Err(Error::InvalidCdiSpec(m)) => m,
        other => panic!("expected InvalidCdiSpec, got {other:?}"),
    }
}

#[test]
fn kinds() {
    for good in [
        "a/b",
        "nvidia.com/gpu",
        "k8s.gpu.kerf.dev/gpu",
        "vendor_x-y.z/class_1-2.3",
        "A9/Z9",
    ] {
        cdi::validate_kind(good).unwrap_or_else(|e| panic!("{good}: {e}"));
    }
    for bad in [
        "", "a", "/b", "a/", "a/b/c", "1a/b", "a/1b", "-a/b", "a-/b", "a/b-", "a/b.", "a b/c",
        "a/b c", "é/b", "a//b",
    ] {
        let m = message(cdi::validate_kind(bad));
        assert!(
            m.contains(&format!("{bad:?}")),
            "{bad}: message {m:?} must name the kind"
        );
    }
    assert_eq!(
        cdi::parse_kind("k8s.gpu.kerf.dev/gpu").unwrap(),
        ("k8s.gpu.kerf.dev", "gpu")
    );
}

#[test]
fn device_names() {
    for good in [
        "a",
        "0",
        "gpu-0",
        "gpu_0.mig:1g",
        "7f3c9a2e-5b1d-4c8e-9f0a-1b2c3d4e5f60-gpu-3",
        "A.B",
    ] {
        cdi::validate_device_name(good).unwrap_or_else(|e| panic!("{good}: {e}"));
    }
    for bad in [
        "", "-a", "a-", "_a", "a_", ".a", "a.", ":a", "a:", "a/b", "a b", "a=b", "gpü",
    ] {
        let m = message(cdi::validate_device_name(bad));
        assert!(
            bad.is_empty() || m.contains(&format!("{bad:?}")),
            "{bad}: {m}"
        );
    }
}

#[test]
fn env_entries() {
    for good in [
        "A=1",
        "_A=",
        "a_b9=x=y",
        "PATH=/usr/bin:/bin",
        "X=with space",
    ] {
        cdi::validate_env(good).unwrap_or_else(|e| panic!("{good}: {e}"));
    }
    for bad in ["A", "=1", "1A=x", "A-B=1", "A B=1", "É=1", "A=\0"] {
        let m = message(cdi::validate_env(bad));
        assert!(m.contains(&format!("{bad:?}")), "{bad}: {m}");
    }
}

/// Edits that break one rule each, and a string the error must contain.
fn bad_edits() -> Vec<(ContainerEdits, &'static str)> {
    vec![
        (
            ContainerEdits {
                env: vec!["NOPE".into()],
                ..Default::default()
            },
            "NOPE",
        ),
        (
            ContainerEdits {
                device_nodes: vec![DeviceNode::at("dev/nvidia0")],
                ..Default::default()
            },
            "dev/nvidia0",
        ),
        (
            ContainerEdits {
                device_nodes: vec![DeviceNode {
                    host_path: Some("null".into()),
                    ..DeviceNode::at("/dev/x")
                }],
                ..Default::default()
            },
            "null",
        ),
        (
            ContainerEdits {
                device_nodes: vec![DeviceNode {
                    node_type: Some("x".into()),
                    ..DeviceNode::at("/dev/x")
                }],
                ..Default::default()
            },
            "\"x\"",
        ),
        (
            ContainerEdits {
                device_nodes: vec![DeviceNode {
                    permissions: Some("rwx".into()),
                    ..DeviceNode::at("/dev/x")
                }],
                ..Default::default()
            },
            "rwx",
        ),
        (
            ContainerEdits {
                mounts: vec![Mount {
                    host_path: "/a".into(),
                    container_path: "b".into(),
                    ..Default::default()
                }],
                ..Default::default()
            },
            "\"b\"",
        ),
        (
            ContainerEdits {
                mounts: vec![Mount {
                    host_path: String::new(),
                    container_path: "/b".into(),
                    ..Default::default()
                }],
                ..Default::default()
            },
            "empty hostPath",
        ),
        (
            ContainerEdits {
                hooks: vec![Hook {
                    hook_name: "preStart".into(),
                    path: "/bin/true".into(),
                    ..Default::default()
                }],
                ..Default::default()
            },
            "preStart",
        ),
        (
            ContainerEdits {
                hooks: vec![Hook {
                    hook_name: "createContainer".into(),
                    path: "/bin/true".into(),
                    env: vec!["1=x".into()],
                    ..Default::default()
                }],
                ..Default::default()
            },
            "1=x",
        ),
    ]
}

#[test]
fn spec_level_rules() {
    let ok = spec_with("a/b", &["x", "y"], ContainerEdits::default());
    ok.validate().unwrap();

    let m = message(spec_with("a/b", &["x", "x"], ContainerEdits::default()).validate());
    assert!(m.contains("\"x\"") && m.contains("more than once"), "{m}");
    let m = message(spec_with("a/b", &[], ContainerEdits::default()).validate());
    assert!(m.contains("no devices"), "{m}");
    let m = message(spec_with("a/b", &["bad name"], ContainerEdits::default()).validate());
    assert!(m.contains("bad name"), "{m}");

    for (edits, needle) in bad_edits() {
        let spec_level = message(spec_with("a/b", &["x"], edits.clone()).validate());
        assert!(
            spec_level.contains(needle),
            "spec edits: {spec_level} should name {needle}"
        );
        let mut on_device = spec_with("a/b", &["x"], ContainerEdits::default());
        on_device.devices[0].container_edits = edits;
        let device_level = message(on_device.validate());
        assert!(
            device_level.contains(needle) && device_level.contains("\"x\""),
            "{device_level}"
        );
    }
}

#[test]
fn qualified_and_file_names() {
    assert_eq!(
        cdi::qualified_name(common::KIND, "u-gpu-0"),
        "k8s.gpu.kerf.dev/gpu=u-gpu-0"
    );
    assert_eq!(cdi::claim_device_name("u", "gpu-0"), "u-gpu-0");
    assert_eq!(
        cdi::transient_spec_file_name(common::KIND, common::UID_DIGIT).unwrap(),
        format!("k8s.gpu.kerf.dev-gpu_{}.json", common::UID_DIGIT)
    );
    assert_eq!(
        cdi::transient_spec_file_name("a/b", "x/y").unwrap(),
        "a-b_x_y.json"
    );
    for bad_id in ["", "..", ".hidden", "a b", "a\0b", "a\\b"] {
        assert!(
            cdi::transient_spec_file_name("a/b", bad_id).is_err(),
            "{bad_id:?}"
        );
    }
    assert!(cdi::transient_spec_file_name("nokind", "x").is_err());
}

#[test]
fn env_keys_are_env_safe() {
    assert_eq!(cdi::env_key("7f3c-gpu-0.mig:1"), "7F3C_GPU_0_MIG_1");
    cdi::validate_env(&format!(
        "KERF_DEVICE_{}_UUID=x",
        cdi::env_key(common::UID_DIGIT)
    ))
    .unwrap();
}
