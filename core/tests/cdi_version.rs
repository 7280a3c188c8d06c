//! The CDI version table: each versioned field raises `Spec::minimum_version` to exactly its
//! version, fields that need no version raise nothing, and the generator writes specs that
//! podman 4.3 (which stops at 0.5.0) can read.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Test helpers may fail loudly.

mod common;

use std::collections::BTreeMap;

use kerf_core::cdi::{
    CdiVersion, ContainerEdits, Device, DeviceNode, Hook, IntelRdt, Mount, NetDevice, Spec,
};
use kerf_core::sharing::Sharing;
use proptest::prelude::*;

/// A field that needs a CDI version, and where it sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feature {
    MountType { on_device: bool },
    HostPath { on_device: bool },
    DigitDeviceName,
    SpecAnnotation,
    DeviceAnnotation,
    DottedClass,
    IntelRdt { on_device: bool },
    AdditionalGids { on_device: bool },
    NetDevices { on_device: bool },
    RdtSchemata,
    RdtMonitoring,
}

impl Feature {
    fn version(self) -> CdiVersion {
        match self {
            Feature::MountType { .. } => CdiVersion::V0_4_0,
            Feature::HostPath { .. } | Feature::DigitDeviceName => CdiVersion::V0_5_0,
            Feature::SpecAnnotation | Feature::DeviceAnnotation | Feature::DottedClass => {
                CdiVersion::V0_6_0
            }
            Feature::IntelRdt { .. } | Feature::AdditionalGids { .. } => CdiVersion::V0_7_0,
            Feature::NetDevices { .. } | Feature::RdtSchemata | Feature::RdtMonitoring => {
                CdiVersion::V1_1_0
            }
        }
    }

    fn apply(self, spec: &mut Spec) {
        match self {
            Feature::MountType { on_device } => {
                pick(spec, on_device).mounts.push(Mount {
                    fs_type: Some("tmpfs".into()),
                    ..mount()
                });
            }
            Feature::HostPath { on_device } => {
                pick(spec, on_device).device_nodes.push(DeviceNode {
                    host_path: Some("/dev/null".into()),
                    ..DeviceNode::at("/dev/x")
                });
            }
            Feature::DigitDeviceName => spec.devices[0].name = format!("0{}", spec.devices[0].name),
            Feature::SpecAnnotation => {
                spec.annotations.insert("kerf.dev/a".into(), "1".into());
            }
            Feature::DeviceAnnotation => {
                spec.devices[0]
                    .annotations
                    .insert("kerf.dev/b".into(), "2".into());
            }
            Feature::DottedClass => spec.kind = "k8s.gpu.kerf.dev/gpu.slice".into(),
            Feature::IntelRdt { on_device } => {
                pick(spec, on_device)
                    .intel_rdt
                    .get_or_insert_with(IntelRdt::default)
                    .clos_id = Some("c".into());
            }
            Feature::AdditionalGids { on_device } => pick(spec, on_device).additional_gids.push(44),
            Feature::NetDevices { on_device } => {
                pick(spec, on_device).net_devices.push(NetDevice {
                    host_interface_name: "eth1".into(),
                    name: "net0".into(),
                });
            }
            Feature::RdtSchemata => {
                spec.container_edits
                    .intel_rdt
                    .get_or_insert_with(IntelRdt::default)
                    .schemata
                    .push("L3:0=f".into());
            }
            Feature::RdtMonitoring => {
                spec.container_edits
                    .intel_rdt
                    .get_or_insert_with(IntelRdt::default)
                    .enable_monitoring = true;
            }
        }
    }
}

fn pick(spec: &mut Spec, on_device: bool) -> &mut ContainerEdits {
    if on_device {
        &mut spec.devices[0].container_edits
    } else {
        &mut spec.container_edits
    }
}

fn mount() -> Mount {
    Mount {
        host_path: "/usr/lib/libcuda.so.1".into(),
        container_path: "/usr/lib/libcuda.so.1".into(),
        options: vec!["ro".into(), "bind".into()],
        fs_type: None,
    }
}

/// A spec using every field that needs no version bump, in both edit locations; dots in the
/// vendor part of the kind do not need one either.
fn baseline() -> Spec {
    let edits = ContainerEdits {
        env: vec!["A=1".into()],
        device_nodes: vec![DeviceNode {
            node_type: Some("c".into()),
            major: Some(195),
            minor: Some(0),
            file_mode: Some(0o666),
            permissions: Some("rw".into()),
            uid: Some(0),
            gid: Some(0),
            ..DeviceNode::at("/dev/nvidia0")
        }],
        mounts: vec![mount()],
        hooks: vec![Hook {
            hook_name: "createContainer".into(),
            path: "/usr/bin/true".into(),
            args: vec!["true".into()],
            env: vec!["B=2".into()],
            timeout: Some(5),
        }],
        ..ContainerEdits::default()
    };
    Spec {
        cdi_version: CdiVersion::V0_3_0,
        kind: "k8s.gpu.kerf.dev/gpu".into(),
        annotations: BTreeMap::new(),
        devices: vec![
            Device {
                name: "gpu-0".into(),
                annotations: BTreeMap::new(),
                container_edits: edits.clone(),
            },
            Device {
                name: "gpu-1".into(),
                annotations: BTreeMap::new(),
                container_edits: ContainerEdits::default(),
            },
        ],
        container_edits: edits,
    }
}

fn feature() -> impl Strategy<Value = Feature> {
    prop_oneof![
        any::<bool>().prop_map(|on_device| Feature::MountType { on_device }),
        any::<bool>().prop_map(|on_device| Feature::HostPath { on_device }),
        Just(Feature::DigitDeviceName),
        Just(Feature::SpecAnnotation),
        Just(Feature::DeviceAnnotation),
        Just(Feature::DottedClass),
        any::<bool>().prop_map(|on_device| Feature::IntelRdt { on_device }),
        any::<bool>().prop_map(|on_device| Feature::AdditionalGids { on_device }),
        any::<bool>().prop_map(|on_device| Feature::NetDevices { on_device }),
        Just(Feature::RdtSchemata),
        Just(Feature::RdtMonitoring),
    ]
}

#[test]
fn baseline_needs_only_0_3_0() {
    let spec = baseline();
    assert_eq!(spec.minimum_version(), CdiVersion::V0_3_0);
    spec.validate().unwrap();
}

#[test]
fn each_field_bumps_exactly_to_its_version() {
    let all = [
        Feature::MountType { on_device: false },
        Feature::MountType { on_device: true },
        Feature::HostPath { on_device: false },
        Feature::HostPath { on_device: true },
        Feature::DigitDeviceName,
        Feature::SpecAnnotation,
        Feature::DeviceAnnotation,
        Feature::DottedClass,
        Feature::IntelRdt { on_device: false },
        Feature::IntelRdt { on_device: true },
        Feature::AdditionalGids { on_device: false },
        Feature::AdditionalGids { on_device: true },
        Feature::NetDevices { on_device: false },
        Feature::NetDevices { on_device: true },
        Feature::RdtSchemata,
        Feature::RdtMonitoring,
    ];
    let expected = [
        "0.4.0", "0.4.0", "0.5.0", "0.5.0", "0.5.0", "0.6.0", "0.6.0", "0.6.0", "0.7.0", "0.7.0",
        "0.7.0", "0.7.0", "1.1.0", "1.1.0", "1.1.0", "1.1.0",
    ];
    for (feature, want) in all.into_iter().zip(expected) {
        let mut spec = baseline();
        feature.apply(&mut spec);
        assert_eq!(spec.minimum_version().as_str(), want, "{feature:?}");
    }
}

#[test]
fn empty_strings_count_as_absent_like_the_reference_implementation() {
    let mut spec = baseline();
    spec.container_edits.mounts[0].fs_type = Some(String::new());
    assert_eq!(spec.minimum_version(), CdiVersion::V0_3_0);
}

#[test]
fn validate_rejects_a_declared_version_below_the_minimum() {
    let mut spec = baseline();
    Feature::HostPath { on_device: true }.apply(&mut spec);
    let err = spec.validate().unwrap_err().to_string();
    assert!(err.contains("0.3.0") && err.contains("0.5.0"), "{err}");
    spec.cdi_version = CdiVersion::V0_5_0;
    spec.validate().unwrap();
    spec.cdi_version = CdiVersion::V1_1_0;
    spec.validate().unwrap();
}

#[test]
fn versions_round_trip_through_their_strings_and_order() {
    for pair in CdiVersion::ALL.windows(2) {
        assert!(pair[0] < pair[1]);
    }
    for v in CdiVersion::ALL {
        assert_eq!(v.as_str().parse::<CdiVersion>().unwrap(), v);
        assert_eq!(serde_json::to_string(&v).unwrap(), format!("\"{v}\""));
    }
    for bad in ["0.2.0", "0.9.0", "1.2.0", "v0.3.0", ""] {
        assert!(bad.parse::<CdiVersion>().is_err(), "{bad}");
    }
}

#[test]
fn generator_output_suits_podman_4_3() {
    for (name, generated) in common::scenarios() {
        let v = generated.spec.minimum_version();
        assert_eq!(
            generated.spec.cdi_version, v,
            "{name}: the generator must write the minimum"
        );
        assert!(
            v <= CdiVersion::V0_5_0,
            "{name}: {v} is above podman 4.3's 0.5.0"
        );
    }
}

#[test]
fn generator_stays_at_0_3_0_when_nothing_needs_more() {
    let generated = common::generate(
        common::UID_LETTER,
        &[
            common::whole_gpu(0),
            common::slice(1, 1 << 30, 10, Sharing::Exclusive),
        ],
    );
    assert_eq!(generated.spec.cdi_version, CdiVersion::V0_3_0);
    let digit = common::generate(common::UID_DIGIT, &[common::whole_gpu(0)]);
    assert_eq!(
        digit.spec.cdi_version,
        CdiVersion::V0_5_0,
        "a claim UID starting with a digit needs 0.5.0"
    );
}

proptest! {
    /// Any combination of versioned fields needs exactly the newest of their versions.
    #[test]
    fn minimum_version_is_the_max_of_the_features_used(features in proptest::collection::vec(feature(), 0..6)) {
        let mut spec = baseline();
        for f in &features {
            f.apply(&mut spec);
        }
        let want = features.iter().map(|f| f.version()).max().unwrap_or(CdiVersion::V0_3_0);
        prop_assert_eq!(spec.minimum_version(), want);
        spec.cdi_version = want;
        prop_assert!(spec.validate().is_ok(), "{:?}", spec.validate());
    }
}
