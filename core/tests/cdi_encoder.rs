//! The reusable spec encoder against the reference, `encode_spec(&generate(..)?.spec)`: the
//! same bytes and device ids for fixed scenarios and arbitrary claims, the same errors for
//! bad claims, and specs that decode back to what `generate` builds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Test helpers may fail loudly.

mod common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use common::{KIND, UID_DIGIT, UID_LETTER, mig, slice, whole_gpu};
use kerf_core::cdi::{
    self, CdiVersion, ClaimSpec, ClaimSpecRequest, CommonEdits, DeviceNode, DeviceNodePolicy,
    MigCaps, Mount, PreparedDevice, SpecEncoder,
};
use kerf_core::mps::MpsClient;
use kerf_core::sharing::{Sharing, SliceLimits};
use proptest::prelude::*;

/// A node's configuration: what a [`SpecEncoder`] is built from.
struct Node {
    kind: &'static str,
    common: CommonEdits,
    policy: DeviceNodePolicy,
}

fn claim<'a>(uid: &'a str, devices: &'a [PreparedDevice]) -> ClaimSpec<'a> {
    ClaimSpec {
        claim_uid: uid,
        claim_namespace: "team-a",
        claim_name: "train",
        devices,
    }
}

fn request<'a>(node: &'a Node, claim: &ClaimSpec<'a>) -> ClaimSpecRequest<'a> {
    ClaimSpecRequest {
        kind: node.kind,
        claim_uid: claim.claim_uid,
        claim_namespace: claim.claim_namespace,
        claim_name: claim.claim_name,
        devices: claim.devices,
        common: &node.common,
    }
}

/// The reference bytes and ids, or its error message.
fn reference(node: &Node, claim: &ClaimSpec<'_>) -> Result<(Vec<u8>, Vec<String>), String> {
    let generated =
        cdi::generate(&request(node, claim), &node.policy).map_err(|e| e.to_string())?;
    let bytes = cdi::encode_spec(&generated.spec).map_err(|e| e.to_string())?;
    Ok((bytes, generated.device_ids))
}

/// The encoder's bytes and ids, or its error message (from `new` or `encode`).
fn encoded(node: &Node, claim: &ClaimSpec<'_>) -> Result<(Vec<u8>, Vec<String>), String> {
    let encoder =
        SpecEncoder::new(node.kind, &node.common, &node.policy).map_err(|e| e.to_string())?;
    let out = encoder.encode(claim).map_err(|e| e.to_string())?;
    Ok((out.bytes, out.device_ids))
}

/// Asserts the encoder and the reference agree on `claim`, and that a successful spec
/// decodes to exactly what `generate` builds. Returns the decoded version, if any.
fn assert_same(node: &Node, claim: &ClaimSpec<'_>, what: &str) -> Option<CdiVersion> {
    let want = reference(node, claim);
    let got = encoded(node, claim);
    match (&want, &got) {
        (Ok((want_bytes, want_ids)), Ok((got_bytes, got_ids))) => {
            assert_eq!(
                String::from_utf8_lossy(got_bytes),
                String::from_utf8_lossy(want_bytes),
                "{what}: bytes differ"
            );
            assert_eq!(got_ids, want_ids, "{what}: device ids differ");
            let decoded = cdi::decode_spec(got_bytes).unwrap_or_else(|e| panic!("{what}: {e}"));
            let generated = cdi::generate(&request(node, claim), &node.policy).unwrap();
            assert_eq!(decoded, generated.spec, "{what}: decoded spec differs");
            Some(decoded.cdi_version)
        }
        (Err(want_err), Err(got_err)) => {
            assert_eq!(got_err, want_err, "{what}: errors differ");
            None
        }
        _ => panic!("{what}: reference {want:?}, encoder {got:?}"),
    }
}

fn mounts_with_type() -> Vec<Mount> {
    vec![Mount {
        host_path: "tmpfs".into(),
        container_path: "/run/kerf".into(),
        options: vec!["nosuid".into()],
        fs_type: Some("tmpfs".into()),
    }]
}

fn common_edits_cases() -> Vec<(&'static str, CommonEdits)> {
    vec![
        ("empty common edits", CommonEdits::default()),
        ("control nodes only", CommonEdits::nvidia(Vec::new())),
        (
            "driver mounts",
            CommonEdits::nvidia(common::driver_mounts()),
        ),
        (
            "common env",
            CommonEdits {
                env: vec![
                    "LD_LIBRARY_PATH=/usr/local/nvidia/lib64".into(),
                    "KERF_NOTE=\"quoted\" \\ tab\t é".into(),
                ],
                ..CommonEdits::nvidia(common::driver_mounts())
            },
        ),
        (
            "env but no nodes or mounts",
            CommonEdits {
                env: vec!["A=1".into()],
                ..CommonEdits::default()
            },
        ),
        ("mounts but no nodes", {
            CommonEdits {
                mounts: common::driver_mounts(),
                ..CommonEdits::default()
            }
        }),
        ("typed mount", CommonEdits::nvidia(mounts_with_type())),
    ]
}

fn policies() -> [(&'static str, DeviceNodePolicy); 2] {
    [
        ("real", DeviceNodePolicy::real()),
        ("mock", DeviceNodePolicy::mock("/dev/null")),
    ]
}

#[test]
fn fixed_scenarios_match_the_reference_byte_for_byte() {
    let mut checked = 0;
    for (set_name, devices) in common::device_sets() {
        for (common_name, common) in common_edits_cases() {
            for (policy_name, policy) in policies() {
                for kind in [KIND, "kerf.dev/gpu.v2"] {
                    let node = Node {
                        kind,
                        common: common.clone(),
                        policy: policy.clone(),
                    };
                    for uid in [UID_DIGIT, UID_LETTER] {
                        let what =
                            format!("{set_name}, {common_name}, {policy_name}, {kind}, {uid}");
                        assert!(assert_same(&node, &claim(uid, &devices), &what).is_some());
                        checked += 1;
                    }
                }
            }
        }
    }
    assert_eq!(checked, common::device_sets().len() * 7 * 2 * 2 * 2);
}

/// The version is the highest of what the claim part and the common part need.
#[test]
fn version_is_the_minimum_of_the_whole_spec() {
    let node = |common: CommonEdits, policy: DeviceNodePolicy, kind: &'static str| Node {
        kind,
        common,
        policy,
    };
    let real = DeviceNodePolicy::real;
    let mock = || DeviceNodePolicy::mock("/dev/null");
    let nvidia = || CommonEdits::nvidia(common::driver_mounts());
    let typed = || CommonEdits::nvidia(mounts_with_type());
    let devices = [whole_gpu(0)];
    let cases = [
        (
            "letter uid, real",
            node(nvidia(), real(), KIND),
            UID_LETTER,
            CdiVersion::V0_3_0,
        ),
        (
            "digit uid (claim part)",
            node(nvidia(), real(), KIND),
            UID_DIGIT,
            CdiVersion::V0_5_0,
        ),
        (
            "mock host paths",
            node(nvidia(), mock(), KIND),
            UID_LETTER,
            CdiVersion::V0_5_0,
        ),
        (
            "mock, no common nodes (claim part)",
            node(CommonEdits::default(), mock(), KIND),
            UID_LETTER,
            CdiVersion::V0_5_0,
        ),
        (
            "typed mount (common part)",
            node(typed(), real(), KIND),
            UID_LETTER,
            CdiVersion::V0_4_0,
        ),
        (
            "typed mount and digit uid",
            node(typed(), real(), KIND),
            UID_DIGIT,
            CdiVersion::V0_5_0,
        ),
        (
            "dotted class (kind)",
            node(nvidia(), real(), "kerf.dev/gpu.v2"),
            UID_LETTER,
            CdiVersion::V0_6_0,
        ),
    ];
    for (what, node, uid, want) in cases {
        assert_eq!(
            assert_same(&node, &claim(uid, &devices), what),
            Some(want),
            "{what}"
        );
    }
}

#[test]
fn one_encoder_serves_many_claims() {
    let node = Node {
        kind: KIND,
        common: CommonEdits::nvidia(common::driver_mounts()),
        policy: DeviceNodePolicy::mock("/dev/null"),
    };
    let encoder = SpecEncoder::new(node.kind, &node.common, &node.policy).unwrap();
    assert_eq!(encoder.kind(), KIND);
    let sets = common::device_sets();
    for uid in [UID_LETTER, UID_DIGIT] {
        for (name, devices) in &sets {
            let claim = claim(uid, devices);
            let (want, ids) = reference(&node, &claim).unwrap();
            let got = encoder.encode(&claim).unwrap();
            assert_eq!(got.bytes, want, "{name}, {uid}");
            assert_eq!(got.device_ids, ids, "{name}, {uid}");
        }
    }
}

#[test]
fn request_claim_holds_the_claim_fields() {
    let devices = [whole_gpu(0)];
    let common = CommonEdits::default();
    let request = ClaimSpecRequest {
        kind: KIND,
        claim_uid: UID_LETTER,
        claim_namespace: "ns",
        claim_name: "n",
        devices: &devices,
        common: &common,
    };
    let claim = request.claim();
    assert_eq!(
        (claim.claim_uid, claim.claim_namespace, claim.claim_name),
        (UID_LETTER, "ns", "n")
    );
    assert_eq!(claim.devices, &devices);
}

fn named(name: &str, minor: u32) -> PreparedDevice {
    PreparedDevice {
        name: name.into(),
        ..whole_gpu(minor)
    }
}

#[test]
fn bad_claims_fail_with_the_reference_errors() {
    let node = Node {
        kind: KIND,
        common: CommonEdits::nvidia(common::driver_mounts()),
        policy: DeviceNodePolicy::real(),
    };
    let uuid_with_nul = PreparedDevice {
        uuid: "GPU-\0".into(),
        ..whole_gpu(0)
    };
    let cases: Vec<(&str, &str, Vec<PreparedDevice>, &str)> = vec![
        ("no devices", UID_LETTER, vec![], "no devices"),
        (
            "duplicate names",
            UID_LETTER,
            vec![whole_gpu(0), whole_gpu(0)],
            "more than once",
        ),
        (
            "env key collision",
            UID_LETTER,
            vec![whole_gpu(0), named("gpu.0", 1)],
            "environment key",
        ),
        ("uid with a space", "bad uid", vec![whole_gpu(0)], "bad uid"),
        (
            "name with a slash",
            UID_LETTER,
            vec![named("gpu-0/..", 0)],
            "gpu-0/..",
        ),
        (
            "name ending in a dash",
            UID_LETTER,
            vec![named("gpu-", 0)],
            "must end",
        ),
        (
            "uid starting with a dash",
            "-abc",
            vec![whole_gpu(0)],
            "must start",
        ),
        (
            "NUL in a device env value",
            UID_LETTER,
            vec![uuid_with_nul],
            "NUL",
        ),
    ];
    for (what, uid, devices, needle) in cases {
        let got = encoded(&node, &claim(uid, &devices)).unwrap_err();
        assert!(got.contains(needle), "{what}: {got}");
        assert_eq!(
            Err(got),
            reference(&node, &claim(uid, &devices)).map(|_| ()),
            "{what}"
        );
    }
    let devices = [whole_gpu(0)];
    let nul_namespace = ClaimSpec {
        claim_namespace: "team\0a",
        ..claim(UID_LETTER, &devices)
    };
    let got = encoded(&node, &nul_namespace).unwrap_err();
    assert!(
        got.contains("KERF_CLAIM_NAMESPACE") && got.contains("NUL"),
        "{got}"
    );
    assert_eq!(Err(got), reference(&node, &nul_namespace).map(|_| ()));
}

#[test]
fn bad_node_configuration_fails_in_new_with_the_reference_errors() {
    let devices = [whole_gpu(0)];
    let claim = claim(UID_LETTER, &devices);
    let nvidia = || CommonEdits::nvidia(common::driver_mounts());
    let relative_mount = Mount {
        container_path: "usr/lib/libcuda.so".into(),
        ..common::driver_mounts()[0].clone()
    };
    let cases = [
        (
            "no slash in kind",
            "nokind",
            nvidia(),
            DeviceNodePolicy::real(),
            "nokind",
        ),
        (
            "bad vendor",
            "-x/gpu",
            nvidia(),
            DeviceNodePolicy::real(),
            "vendor",
        ),
        (
            "bad common env",
            KIND,
            CommonEdits {
                env: vec!["not env".into()],
                ..nvidia()
            },
            DeviceNodePolicy::real(),
            "not env",
        ),
        (
            "relative mount",
            KIND,
            CommonEdits {
                mounts: vec![relative_mount],
                ..nvidia()
            },
            DeviceNodePolicy::real(),
            "usr/lib/libcuda.so",
        ),
        (
            "relative common node",
            KIND,
            CommonEdits {
                device_nodes: vec![DeviceNode::at("dev/nvidiactl")],
                ..nvidia()
            },
            DeviceNodePolicy::real(),
            "dev/nvidiactl",
        ),
        (
            "non-UTF-8 host path",
            KIND,
            nvidia(),
            DeviceNodePolicy::mock(PathBuf::from(OsStr::from_bytes(b"/dev/\xff"))),
            "UTF-8",
        ),
    ];
    for (what, kind, common, policy, needle) in cases {
        let node = Node {
            kind,
            common,
            policy,
        };
        let err = SpecEncoder::new(node.kind, &node.common, &node.policy)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{what}: {err}");
        assert_eq!(Err(err), reference(&node, &claim).map(|_| ()), "{what}");
    }
}

/// A relative host path is caught by `new` when there are common nodes to carry it, and
/// otherwise per claim with the reference's message.
#[test]
fn relative_host_path_is_refused() {
    let policy = DeviceNodePolicy::mock("dev/null");
    let err = SpecEncoder::new(KIND, &CommonEdits::nvidia(Vec::new()), &policy).unwrap_err();
    assert!(err.to_string().contains("\"dev/null\""), "{err}");

    let node = Node {
        kind: KIND,
        common: CommonEdits::default(),
        policy,
    };
    let devices = [whole_gpu(0)];
    let got = encoded(&node, &claim(UID_LETTER, &devices)).unwrap_err();
    assert!(got.contains("\"dev/null\""), "{got}");
    assert_eq!(
        Err(got),
        reference(&node, &claim(UID_LETTER, &devices)).map(|_| ())
    );
}

#[test]
fn spec_files_written_from_encoder_bytes_decode() {
    let node = Node {
        kind: KIND,
        common: CommonEdits::nvidia(common::driver_mounts()),
        policy: DeviceNodePolicy::real(),
    };
    let devices = [slice(0, 4 << 30, 50, Sharing::Mps), mig(1, 0, 12, 13)];
    let (bytes, ids) = encoded(&node, &claim(UID_DIGIT, &devices)).unwrap();
    let spec = cdi::decode_spec(&bytes).unwrap();
    assert_eq!(spec.cdi_version, CdiVersion::V0_5_0);
    let names: Vec<String> = spec
        .devices
        .iter()
        .map(|d| cdi::qualified_name(KIND, &d.name))
        .collect();
    assert_eq!(names, ids);
    assert_eq!(spec.container_edits.mounts, common::driver_mounts());
}

fn arb_sharing() -> impl Strategy<Value = Sharing> {
    prop_oneof![
        Just(Sharing::Exclusive),
        Just(Sharing::Mps),
        Just(Sharing::TimeSlicing)
    ]
}

/// Mostly valid device names, sometimes with characters CDI refuses or that collide on
/// their env key.
fn arb_device_name() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => "[a-z0-9][a-z0-9.:_-]{0,10}[a-z0-9]",
        1 => "[a-z0-9./ -]{0,6}",
    ]
}

fn arb_device() -> impl Strategy<Value = PreparedDevice> {
    (
        arb_device_name(),
        // UUIDs end up in env values: quotes, backslashes, control and non-ASCII
        // characters exercise serde_json's escaping.
        "[A-Za-z0-9\"\\\\\t\n\u{1}é€-]{0,12}",
        any::<u32>(),
        proptest::option::of((any::<u32>(), any::<u32>())),
        proptest::option::of(any::<u64>()),
        proptest::option::of(1u8..=100),
        arb_sharing(),
        proptest::option::of(("/[a-z0-9/._\"\\\\ é-]{1,20}", "/[a-z0-9/._-]{1,20}")),
    )
        .prop_map(
            |(name, uuid, gpu_minor, mig, memory_bytes, compute_percent, sharing, mps)| {
                PreparedDevice {
                    name,
                    uuid,
                    gpu_minor,
                    mig: mig.map(|(gi_cap_minor, ci_cap_minor)| MigCaps {
                        caps_major: None,
                        gi_cap_minor,
                        ci_cap_minor,
                    }),
                    limits: SliceLimits {
                        memory_bytes,
                        compute_percent,
                    },
                    sharing,
                    mps: mps.map(|(pipe_directory, container_pipe_directory)| MpsClient {
                        shm_directory: format!("{pipe_directory}/shm"),
                        pipe_directory,
                        container_pipe_directory,
                    }),
                }
            },
        )
}

fn arb_mount() -> impl Strategy<Value = Mount> {
    (
        "/[a-z0-9/._\"\\\\ é-]{1,20}",
        "/[a-z0-9/._-]{1,20}",
        proptest::collection::vec("[a-z]{1,6}", 0..4),
        proptest::option::of(prop_oneof![Just(String::new()), "[a-z]{1,6}"]),
    )
        .prop_map(|(host_path, container_path, options, fs_type)| Mount {
            host_path,
            container_path,
            options,
            fs_type,
        })
}

fn arb_common() -> impl Strategy<Value = CommonEdits> {
    (
        proptest::sample::subsequence(cdi::COMMON_DEVICE_NODES.to_vec(), 0..=3),
        proptest::collection::vec(arb_mount(), 0..6),
        proptest::collection::vec("[A-Z_][A-Z0-9_]{0,6}=[ -~é]{0,10}", 0..3),
    )
        .prop_map(|(nodes, mounts, env)| CommonEdits {
            device_nodes: nodes.into_iter().map(DeviceNode::at).collect(),
            mounts,
            env,
        })
}

fn arb_policy() -> impl Strategy<Value = DeviceNodePolicy> {
    prop_oneof![
        Just(DeviceNodePolicy::real()),
        Just(DeviceNodePolicy::mock("/dev/null")),
        Just(DeviceNodePolicy::mock("/dev/kerf \"mock\"")),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn encoder_matches_the_reference(
        kind in prop_oneof![Just(KIND), Just("kerf.dev/gpu.v2"), Just("kerf.dev/gpu")],
        uid in "[0-9a-f][0-9a-f-]{0,12}[0-9a-f]",
        namespace in "[a-z0-9\"\\\\é-]{0,10}",
        name in "[a-z0-9\"\\\\é-]{0,10}",
        devices in proptest::collection::vec(arb_device(), 0..6),
        common in arb_common(),
        policy in arb_policy(),
    ) {
        let node = Node { kind, common, policy };
        let claim = ClaimSpec {
            claim_uid: &uid,
            claim_namespace: &namespace,
            claim_name: &name,
            devices: &devices,
        };
        assert_same(&node, &claim, "arbitrary claim");
    }
}
