//! Fixtures shared by the integration tests: prepared devices and the claim spec scenarios
//! the generator must get right.

#![allow(dead_code)] // Each test binary uses its own subset.
#![allow(clippy::unwrap_used, clippy::panic)] // Fixture failures should fail the test loudly.

use kerf_core::cdi::{
    self, ClaimSpecRequest, CommonEdits, DeviceNodePolicy, GeneratedSpec, MigCaps, PreparedDevice,
};
use kerf_core::sharing::{Sharing, SliceLimits};

/// The CDI kind the kubelet plugin uses for driver `gpu.kerf.dev`.
pub const KIND: &str = "k8s.gpu.kerf.dev/gpu";
/// A Kubernetes-style claim UID that starts with a digit (needs CDI 0.5.0).
pub const UID_DIGIT: &str = "7f3c9a2e-5b1d-4c8e-9f0a-1b2c3d4e5f60";
/// A claim UID that starts with a letter.
pub const UID_LETTER: &str = "c0ffee00-5b1d-4c8e-9f0a-1b2c3d4e5f60";

pub fn whole_gpu(minor: u32) -> PreparedDevice {
    PreparedDevice {
        name: format!("gpu-{minor}"),
        uuid: format!("GPU-00000000-0000-0000-0000-00000000000{minor}"),
        gpu_minor: minor,
        mig: None,
        limits: SliceLimits::default(),
        sharing: Sharing::Exclusive,
        mps: None,
    }
}

pub fn slice(
    minor: u32,
    memory_bytes: u64,
    compute_percent: u8,
    sharing: Sharing,
) -> PreparedDevice {
    PreparedDevice {
        limits: SliceLimits {
            memory_bytes: Some(memory_bytes),
            compute_percent: Some(compute_percent),
        },
        sharing,
        mps: None,
        ..whole_gpu(minor)
    }
}

pub fn mig(parent_minor: u32, start: u32, gi_cap_minor: u32, ci_cap_minor: u32) -> PreparedDevice {
    PreparedDevice {
        name: format!("gpu-{parent_minor}-mig-1g-10gb-{start}"),
        uuid: format!("MIG-11111111-2222-3333-4444-55555555555{start}"),
        gpu_minor: parent_minor,
        mig: Some(MigCaps {
            caps_major: None,
            gi_cap_minor,
            ci_cap_minor,
        }),
        limits: SliceLimits::default(),
        sharing: Sharing::Exclusive,
        mps: None,
    }
}

pub fn driver_mounts() -> Vec<cdi::Mount> {
    [
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "/usr/bin/nvidia-smi",
    ]
    .into_iter()
    .map(|p| cdi::Mount {
        host_path: format!("/run/nvidia/driver{p}"),
        container_path: p.to_owned(),
        options: cdi::READ_ONLY_BIND.iter().map(|&o| o.to_owned()).collect(),
        fs_type: None,
    })
    .collect()
}

/// Named device sets of one claim.
pub fn device_sets() -> Vec<(&'static str, Vec<PreparedDevice>)> {
    vec![
        ("whole GPU", vec![whole_gpu(0)]),
        ("MPS slice", vec![slice(1, 10 << 30, 30, Sharing::Mps)]),
        (
            "time-sliced slice",
            vec![slice(2, 5 << 30, 50, Sharing::TimeSlicing)],
        ),
        ("MIG device", vec![mig(3, 0, 30, 31)]),
        ("MIG device with the caps major", {
            let mut d = mig(3, 0, 30, 31);
            d.mig = d.mig.map(|m| MigCaps {
                caps_major: Some(237),
                ..m
            });
            vec![d]
        }),
        (
            "two MIG devices of one GPU",
            vec![mig(3, 0, 30, 31), mig(3, 4, 66, 67)],
        ),
        ("four whole GPUs", (4..8).map(whole_gpu).collect()),
        (
            "mixed slices",
            vec![
                slice(0, 8 << 30, 25, Sharing::Mps),
                slice(1, 4 << 30, 50, Sharing::Mps),
            ],
        ),
        (
            "slice with memory only",
            vec![PreparedDevice {
                limits: SliceLimits {
                    memory_bytes: Some(3 << 29),
                    compute_percent: None,
                },
                sharing: Sharing::Mps,
                mps: None,
                ..whole_gpu(5)
            }],
        ),
    ]
}

/// Every combination of device set, node policy (mock or real), mounts (with or without)
/// and claim UID shape, generated.
pub fn scenarios() -> Vec<(String, GeneratedSpec)> {
    let mut out = Vec::new();
    for (set_name, devices) in device_sets() {
        for (policy_name, policy) in [
            ("real", DeviceNodePolicy::real()),
            ("mock", DeviceNodePolicy::mock("/dev/null")),
        ] {
            for (mounts_name, mounts) in [
                ("no mounts", Vec::new()),
                ("driver mounts", driver_mounts()),
            ] {
                for uid in [UID_DIGIT, UID_LETTER] {
                    let common = CommonEdits::nvidia(mounts.clone());
                    let request = ClaimSpecRequest {
                        kind: KIND,
                        claim_uid: uid,
                        claim_namespace: "team-a",
                        claim_name: "train",
                        devices: &devices,
                        common: &common,
                    };
                    let generated = cdi::generate(&request, &policy).unwrap_or_else(|e| {
                        panic!("{set_name}, {policy_name}, {mounts_name}, {uid}: {e}")
                    });
                    out.push((
                        format!("{set_name}, {policy_name}, {mounts_name}, uid {uid}"),
                        generated,
                    ));
                }
            }
        }
    }
    out
}

/// Generates the spec of a claim with `devices` on a real node without mounts.
pub fn generate(uid: &str, devices: &[PreparedDevice]) -> GeneratedSpec {
    let common = CommonEdits::nvidia(Vec::new());
    let request = ClaimSpecRequest {
        kind: KIND,
        claim_uid: uid,
        claim_namespace: "team-a",
        claim_name: "train",
        devices,
        common: &common,
    };
    cdi::generate(&request, &DeviceNodePolicy::real()).unwrap()
}
