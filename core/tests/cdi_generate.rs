//! The per-claim spec generator and the spec files: device ids, device nodes, the env
//! conflict rule, slice limits, errors, and writing, removing and cleaning up spec files.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Test helpers may fail loudly.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{KIND, UID_DIGIT, UID_LETTER, mig, slice, whole_gpu};
use kerf_core::cdi::{
    self, ClaimSpecRequest, CommonEdits, DeviceNodePolicy, GeneratedSpec, PreparedDevice, Spec,
};
use kerf_core::sharing::{Sharing, SliceLimits};

fn env_of(generated: &GeneratedSpec) -> BTreeMap<String, String> {
    generated
        .spec
        .container_edits
        .env
        .iter()
        .filter_map(|e| e.split_once('='))
        .map(|(k, v)| (k.into(), v.into()))
        .collect()
}

/// What a runtime does when it injects `devices` (by index) of `spec`: spec-wide env once,
/// then each device's env, concatenated.
fn injected_env(spec: &Spec, devices: &[usize]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let edits = std::iter::once(&spec.container_edits)
        .chain(devices.iter().map(|&i| &spec.devices[i].container_edits));
    for e in edits {
        for entry in &e.env {
            let (k, v) = entry.split_once('=').unwrap();
            out.push((k.into(), v.into()));
        }
    }
    out
}

/// Names that appear more than once with different values.
fn conflicts(env: &[(String, String)]) -> BTreeSet<String> {
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (k, v) in env {
        if seen.insert(k, v).is_some_and(|prev| prev != v) {
            out.insert(k.clone());
        }
    }
    out
}

#[test]
fn device_ids_follow_input_order_and_name_the_spec_devices() {
    let devices = [whole_gpu(7), whole_gpu(2), mig(3, 0, 30, 31)];
    let g = common::generate(UID_DIGIT, &devices);
    assert_eq!(g.device_ids.len(), 3);
    for ((id, device), input) in g.device_ids.iter().zip(&g.spec.devices).zip(&devices) {
        assert_eq!(device.name, format!("{UID_DIGIT}-{}", input.name));
        assert_eq!(id, &format!("{KIND}={}", device.name));
    }
}

#[test]
fn device_nodes_per_device_and_common() {
    let g = common::generate(UID_LETTER, &[whole_gpu(7), mig(3, 0, 30, 31)]);
    let paths = |i: usize| {
        g.spec.devices[i]
            .container_edits
            .device_nodes
            .iter()
            .map(|n| n.path.as_str())
            .collect::<Vec<_>>()
    };
    assert_eq!(paths(0), ["/dev/nvidia7"]);
    assert_eq!(
        paths(1),
        [
            "/dev/nvidia3",
            "/dev/nvidia-caps/nvidia-cap30",
            "/dev/nvidia-caps/nvidia-cap31"
        ]
    );
    let common: Vec<_> = g
        .spec
        .container_edits
        .device_nodes
        .iter()
        .map(|n| n.path.as_str())
        .collect();
    assert_eq!(common, cdi::COMMON_DEVICE_NODES);
}

#[test]
fn mock_policy_backs_every_node_and_real_policy_none() {
    for (name, g) in common::scenarios() {
        let nodes = g.spec.container_edits.device_nodes.iter().chain(
            g.spec
                .devices
                .iter()
                .flat_map(|d| &d.container_edits.device_nodes),
        );
        for node in nodes {
            let want = name.contains("mock").then(|| "/dev/null".to_owned());
            assert_eq!(node.host_path, want, "{name}: {}", node.path);
        }
    }
}

#[test]
fn driver_mounts_are_spec_wide_and_read_only() {
    let common = CommonEdits::nvidia(common::driver_mounts());
    let devices = [whole_gpu(0)];
    let request = ClaimSpecRequest {
        kind: KIND,
        claim_uid: UID_LETTER,
        claim_namespace: "ns",
        claim_name: "c",
        devices: &devices,
        common: &common,
    };
    let g = cdi::generate(&request, &DeviceNodePolicy::real()).unwrap();
    assert_eq!(g.spec.container_edits.mounts, common::driver_mounts());
    for m in &g.spec.container_edits.mounts {
        assert_eq!(m.options, ["ro", "nosuid", "nodev", "bind"]);
        assert_eq!(m.fs_type, None);
    }
    assert!(
        g.spec
            .devices
            .iter()
            .all(|d| d.container_edits.mounts.is_empty())
    );
}

#[test]
fn claim_level_env() {
    let g = common::generate(UID_LETTER, &[whole_gpu(0), whole_gpu(1)]);
    let env = env_of(&g);
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "void");
    assert_eq!(env["KERF_CLAIM_UID"], UID_LETTER);
    assert_eq!(env["KERF_CLAIM_NAMESPACE"], "team-a");
    assert_eq!(env["KERF_CLAIM_NAME"], "train");
    assert_eq!(env["KERF_DEVICES"], "gpu-0,gpu-1");
    assert_eq!(
        env["KERF_DEVICE_UUIDS"],
        format!("{},{}", whole_gpu(0).uuid, whole_gpu(1).uuid)
    );
    assert_eq!(env["KERF_SHARING"], "Exclusive");
    for absent in [
        "KERF_SLICE_MEMORY_BYTES",
        "KERF_SLICE_COMPUTE_PERCENT",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    ] {
        assert!(!env.contains_key(absent), "{absent} for whole GPUs");
    }
}

#[test]
fn per_device_env_is_keyed_by_the_cdi_device() {
    let g = common::generate(UID_DIGIT, &[slice(1, 10 << 30, 30, Sharing::Mps)]);
    let key = cdi::env_key(&format!("{UID_DIGIT}-gpu-1"));
    let env: BTreeMap<_, _> = g.spec.devices[0]
        .container_edits
        .env
        .iter()
        .filter_map(|e| e.split_once('='))
        .collect();
    let p = format!("KERF_DEVICE_{key}");
    assert_eq!(env[format!("{p}_NAME").as_str()], "gpu-1");
    assert_eq!(env[format!("{p}_UUID").as_str()], whole_gpu(1).uuid);
    assert_eq!(env[format!("{p}_SHARING").as_str()], "MPS");
    assert_eq!(
        env[format!("{p}_MEMORY_BYTES").as_str()],
        (10u64 << 30).to_string()
    );
    assert_eq!(env[format!("{p}_COMPUTE_PERCENT").as_str()], "30");
    assert!(
        env.keys().all(|k| k.starts_with(&p)),
        "only keyed variables per device: {env:?}"
    );
}

#[test]
fn slice_limits_as_mps_and_kerf_env() {
    let g = common::generate(UID_LETTER, &[slice(1, 10 << 30, 30, Sharing::Mps)]);
    let env = env_of(&g);
    assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "30");
    assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=10240M");
    assert_eq!(env["KERF_SLICE_MEMORY_BYTES"], (10u64 << 30).to_string());
    assert_eq!(env["KERF_SLICE_COMPUTE_PERCENT"], "30");
    assert_eq!(env["KERF_SHARING"], "MPS");
}

#[test]
fn mixed_slices_use_the_smallest_compute_limit_and_ordinals_by_minor() {
    // Given out of minor order: ordinals follow the minor (CUDA's enumeration order).
    let g = common::generate(
        UID_LETTER,
        &[
            slice(5, 4 << 30, 50, Sharing::Mps),
            slice(2, (8 << 30) + 12345, 25, Sharing::Mps),
        ],
    );
    let env = env_of(&g);
    assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
    assert_eq!(
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=8192M,1=4096M",
        "rounded down to whole MiB"
    );
    for absent in [
        "KERF_SHARING",
        "KERF_SLICE_MEMORY_BYTES",
        "KERF_SLICE_COMPUTE_PERCENT",
    ] {
        assert!(
            !env.contains_key(absent),
            "{absent} must be left out when devices differ"
        );
    }
}

#[test]
fn memory_only_slice_and_tiny_limits() {
    let memory_only = PreparedDevice {
        limits: SliceLimits {
            memory_bytes: Some(3 << 29),
            compute_percent: None,
        },
        sharing: Sharing::TimeSlicing,
        mps: None,
        ..whole_gpu(0)
    };
    let env = env_of(&common::generate(UID_LETTER, &[memory_only]));
    assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=1536M");
    assert!(!env.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"));
    assert_eq!(env["KERF_SHARING"], "TimeSlicing");
    let tiny = PreparedDevice {
        limits: SliceLimits {
            memory_bytes: Some(1000),
            compute_percent: None,
        },
        ..whole_gpu(0)
    };
    let env = env_of(&common::generate(UID_LETTER, &[tiny]));
    assert_eq!(
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=1M",
        "never a zero limit"
    );
}

#[test]
fn devices_of_one_claim_never_conflict() {
    for (name, g) in common::scenarios() {
        let n = g.spec.devices.len();
        let all: Vec<usize> = (0..n).collect();
        for subset in [
            all.clone(),
            all.iter().rev().copied().collect(),
            vec![0],
            vec![n - 1],
        ] {
            let c = conflicts(&injected_env(&g.spec, &subset));
            assert!(c.is_empty(), "{name}: devices {subset:?} conflict on {c:?}");
        }
    }
}

#[test]
fn devices_of_two_claims_conflict_only_on_documented_claim_level_names() {
    let documented: BTreeSet<&str> = [
        "KERF_CLAIM_UID",
        "KERF_CLAIM_NAMESPACE",
        "KERF_CLAIM_NAME",
        "KERF_DEVICES",
        "KERF_DEVICE_UUIDS",
        "KERF_SHARING",
        "KERF_SLICE_MEMORY_BYTES",
        "KERF_SLICE_COMPUTE_PERCENT",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    ]
    .into();
    // Two claims sharing GPU 0 with different slices, as MPS sharing does.
    let a = common::generate(UID_DIGIT, &[slice(0, 10 << 30, 30, Sharing::Mps)]);
    let b = common::generate(UID_LETTER, &[slice(0, 20 << 30, 60, Sharing::Mps)]);
    let mut env = injected_env(&a.spec, &[0]);
    env.extend(injected_env(&b.spec, &[0]));
    let c = conflicts(&env);
    assert!(!c.is_empty());
    for name in &c {
        assert!(
            documented.contains(name.as_str()),
            "{name} conflicts but is not a documented claim-level variable"
        );
    }
    let keyed: Vec<_> = env
        .iter()
        .filter(|(k, _)| k.starts_with("KERF_DEVICE_") && k != "KERF_DEVICE_UUIDS")
        .collect();
    assert_eq!(
        keyed.len(),
        2 * 5,
        "both claims' keyed variables are present"
    );
}

#[test]
fn generation_is_deterministic() {
    let devices = [slice(0, 1 << 30, 10, Sharing::Mps), mig(1, 0, 12, 13)];
    let a = cdi::encode_spec(&common::generate(UID_DIGIT, &devices).spec).unwrap();
    let b = cdi::encode_spec(&common::generate(UID_DIGIT, &devices).spec).unwrap();
    assert_eq!(a, b);
}

fn generate_err(uid: &str, devices: &[PreparedDevice], common: &CommonEdits, kind: &str) -> String {
    let request = ClaimSpecRequest {
        kind,
        claim_uid: uid,
        claim_namespace: "ns",
        claim_name: "c",
        devices,
        common,
    };
    cdi::generate(&request, &DeviceNodePolicy::real())
        .unwrap_err()
        .to_string()
}

#[test]
fn generator_errors_name_the_problem() {
    let nvidia = CommonEdits::nvidia(Vec::new());
    let err = |uid: &str, devices: &[PreparedDevice]| generate_err(uid, devices, &nvidia, KIND);

    assert!(err(UID_LETTER, &[]).contains("no devices"));
    let e = err(UID_LETTER, &[whole_gpu(0), whole_gpu(0)]);
    assert!(e.contains("more than once") && e.contains("gpu-0"), "{e}");
    let e = err(
        UID_LETTER,
        &[
            whole_gpu(0),
            PreparedDevice {
                name: "gpu.0".into(),
                ..whole_gpu(1)
            },
        ],
    );
    assert!(e.contains("gpu.0") && e.contains("environment key"), "{e}");
    assert!(err("bad uid", &[whole_gpu(0)]).contains("bad uid"));
    assert!(
        err(
            UID_LETTER,
            &[PreparedDevice {
                name: "gpu-0/..".into(),
                ..whole_gpu(0)
            }]
        )
        .contains("gpu-0/..")
    );

    let bad_env = CommonEdits {
        env: vec!["not env".into()],
        ..CommonEdits::nvidia(Vec::new())
    };
    assert!(generate_err(UID_LETTER, &[whole_gpu(0)], &bad_env, KIND).contains("not env"));
    assert!(generate_err(UID_LETTER, &[whole_gpu(0)], &nvidia, "nokind").contains("nokind"));
}

#[test]
fn write_read_and_remove_spec() {
    let dir = tempfile::tempdir().unwrap();
    let g = common::generate(UID_DIGIT, &[whole_gpu(0), mig(1, 0, 12, 13)]);
    let path = cdi::write_spec(dir.path(), &g.spec, UID_DIGIT).unwrap();
    assert_eq!(
        path,
        dir.path()
            .join(format!("k8s.gpu.kerf.dev-gpu_{UID_DIGIT}.json"))
    );
    let back = cdi::decode_spec(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(back, g.spec);
    let listing: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(listing.len(), 1, "no temporary files left: {listing:?}");

    assert!(cdi::remove_spec(dir.path(), KIND, UID_DIGIT).unwrap());
    assert!(!path.exists());
    assert!(!cdi::remove_spec(dir.path(), KIND, UID_DIGIT).unwrap());
}

#[test]
fn write_spec_refuses_invalid_specs_and_ids() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = common::generate(UID_LETTER, &[whole_gpu(0)]);
    assert!(cdi::write_spec(dir.path(), &g.spec, "../escape").is_err());
    g.spec.container_edits.env.push("broken".into());
    assert!(cdi::write_spec(dir.path(), &g.spec, UID_LETTER).is_err());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn orphan_specs_are_removed_and_others_kept() {
    let dir = tempfile::tempdir().unwrap();
    let owned = common::generate(UID_DIGIT, &[whole_gpu(0)]);
    let orphan = common::generate(UID_LETTER, &[whole_gpu(1)]);
    cdi::write_spec(dir.path(), &owned.spec, UID_DIGIT).unwrap();
    let orphan_path = cdi::write_spec(dir.path(), &orphan.spec, UID_LETTER).unwrap();
    // Another driver whose class makes the same file name prefix, and a file we cannot read.
    let mut other = orphan.spec.clone();
    other.kind = "k8s.gpu.kerf.dev/gpu_x".into();
    let other_path = cdi::write_spec(dir.path(), &other, UID_LETTER).unwrap();
    assert!(
        other_path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("k8s.gpu.kerf.dev-gpu_")
    );
    let garbage = dir.path().join("k8s.gpu.kerf.dev-gpu_garbage.json");
    std::fs::write(&garbage, b"{not json").unwrap();
    let unrelated = dir.path().join("nvidia.com-gpu_x.json");
    std::fs::write(&unrelated, b"{}").unwrap();

    let removed = cdi::remove_orphan_specs(dir.path(), KIND, &[UID_DIGIT.to_owned()]).unwrap();
    assert_eq!(removed, 1);
    assert!(!orphan_path.exists());
    assert!(other_path.exists() && garbage.exists() && unrelated.exists());
    assert!(
        dir.path()
            .join(format!("k8s.gpu.kerf.dev-gpu_{UID_DIGIT}.json"))
            .exists()
    );

    assert_eq!(
        cdi::remove_orphan_specs(&dir.path().join("missing"), KIND, &[]).unwrap(),
        0
    );
}

fn served(mut device: PreparedDevice, gpu: &str) -> PreparedDevice {
    device.mps = Some(
        kerf_core::mps::MpsDirectories::new(std::path::Path::new("/var/run/kerf/mps"), gpu)
            .unwrap()
            .client(),
    );
    device
}

const GPU_A: &str = "GPU-2f4e0e00-e140-bcbd-d4fd-278c95116d02";
const GPU_B: &str = "GPU-7c1a0e00-e140-bcbd-d4fd-278c95116d03";

#[test]
fn an_mps_served_device_mounts_its_daemons_pipe_and_the_shared_memory() {
    let g = common::generate(
        UID_LETTER,
        &[served(slice(1, 10 << 30, 30, Sharing::Mps), GPU_A)],
    );
    let device = &g.spec.devices[0].container_edits;
    let mounts: Vec<(&str, &str)> = device
        .mounts
        .iter()
        .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
        .collect();
    let pipe = format!("/run/kerf/mps/{GPU_A}");
    assert_eq!(
        mounts,
        [
            (
                format!("/var/run/kerf/mps/{GPU_A}/pipe").as_str(),
                pipe.as_str()
            ),
            ("/var/run/kerf/mps/shm", "/dev/shm"),
        ]
    );
    assert!(
        device
            .mounts
            .iter()
            .all(|m| m.options.contains(&"rw".to_owned()))
    );
    let env = injected_env(&g.spec, &[0]);
    let value = |name: &str| {
        env.iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(value("CUDA_MPS_PIPE_DIRECTORY"), Some(pipe.as_str()));
    assert_eq!(value("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), Some("30"));
    assert_eq!(value("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), Some("0=10240M"));
    let key = cdi::env_key(&g.spec.devices[0].name);
    assert_eq!(
        value(&format!("KERF_DEVICE_{key}_MPS_PIPE_DIRECTORY")),
        Some(pipe.as_str())
    );
    assert!(
        !g.spec
            .container_edits
            .env
            .iter()
            .any(|e| e.starts_with("CUDA_MPS_")),
        "a served device's limits are not claim-level: {:?}",
        g.spec.container_edits.env
    );
}

#[test]
fn each_served_device_of_a_multi_gpu_claim_carries_its_own_pipe_and_limits() {
    let g = common::generate(
        UID_LETTER,
        &[
            served(slice(5, 4 << 30, 50, Sharing::Mps), GPU_A),
            served(slice(2, 8 << 30, 25, Sharing::Mps), GPU_B),
        ],
    );
    for (index, (gpu, mib, percent)) in [(GPU_A, "4096", "50"), (GPU_B, "8192", "25")]
        .into_iter()
        .enumerate()
    {
        let env: BTreeMap<String, String> = injected_env(&g.spec, &[index]).into_iter().collect();
        assert_eq!(
            env["CUDA_MPS_PIPE_DIRECTORY"],
            format!("/run/kerf/mps/{gpu}")
        );
        assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], format!("0={mib}M"));
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], percent);
    }
    // Both in one container: the device applied last sets all three, never a mix.
    let both: BTreeMap<String, String> = injected_env(&g.spec, &[0, 1]).into_iter().collect();
    assert_eq!(
        both["CUDA_MPS_PIPE_DIRECTORY"],
        format!("/run/kerf/mps/{GPU_B}")
    );
    assert_eq!(both["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=8192M");
    assert_eq!(both["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
    let pipes = both
        .iter()
        .filter(|(k, _)| k.starts_with("KERF_DEVICE_") && k.ends_with("_MPS_PIPE_DIRECTORY"))
        .count();
    assert_eq!(pipes, 2, "every device's pipe stays reachable by its key");
}

#[test]
fn unserved_devices_keep_the_claim_level_limits() {
    let g = common::generate(
        UID_LETTER,
        &[
            served(slice(5, 4 << 30, 50, Sharing::Mps), GPU_A),
            slice(2, 8 << 30, 25, Sharing::TimeSlicing),
        ],
    );
    let env = env_of(&g);
    assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=8192M");
    assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
    assert!(g.spec.devices[1].container_edits.mounts.is_empty());
}

/// With the caps major known, MIG capability nodes carry type, major and minor (the runtime
/// creates them without a host node); mock mode keeps the host-path override instead.
#[test]
fn mig_cap_nodes_carry_type_major_minor_when_the_major_is_known() {
    let mut device = mig(3, 0, 30, 31);
    device.mig = device.mig.map(|m| cdi::MigCaps {
        caps_major: Some(237),
        ..m
    });
    let g = common::generate(UID_LETTER, &[device.clone()]);
    let nodes = &g.spec.devices[0].container_edits.device_nodes;
    let cap = nodes
        .iter()
        .find(|n| n.path == "/dev/nvidia-caps/nvidia-cap31")
        .unwrap();
    assert_eq!(
        (cap.node_type.as_deref(), cap.major, cap.minor),
        (Some("c"), Some(237), Some(31))
    );
    let gpu = nodes.iter().find(|n| n.path == "/dev/nvidia3").unwrap();
    assert_eq!(gpu.major, None, "the GPU node still comes from the host");
}
