use kerf_core::checkpoint::{ClaimState, MigInstanceRecord, RecordedPlacement};
use kerf_core::mig_catalog::A100_SXM4_40GB;

use super::super::RawMig;
use super::*;

/// What NVML answers on an A100-SXM4-40GB (NVIDIA go-nvml
/// `pkg/nvml/mock/dgxa100/dgxa100.go` (`MIGProfiles`)): profile index, id, name, compute
/// slices, instance count, SMs, engines, MiB and placement starts and size.
fn a100_40gb(named: bool) -> Vec<RawGiProfile> {
    #[allow(clippy::type_complexity)]
    let rows: [(u32, u32, &str, u32, u32, u32, [u32; 5], u64, &[u32], u32); 7] = [
        (
            0,
            19,
            "1g.5gb",
            1,
            7,
            14,
            [1, 0, 0, 0, 0],
            4864,
            &[0, 1, 2, 3, 4, 5, 6],
            1,
        ),
        (
            1,
            14,
            "2g.10gb",
            2,
            3,
            28,
            [2, 1, 0, 0, 0],
            9856,
            &[0, 2, 4],
            2,
        ),
        (
            2,
            9,
            "3g.20gb",
            3,
            2,
            42,
            [3, 2, 0, 0, 0],
            19968,
            &[0, 4],
            4,
        ),
        (3, 5, "4g.20gb", 4, 1, 56, [4, 2, 0, 0, 0], 19968, &[0], 4),
        (4, 0, "7g.40gb", 7, 1, 98, [7, 5, 0, 1, 1], 40192, &[0], 8),
        (
            7,
            20,
            "1g.5gb+me",
            1,
            1,
            14,
            [1, 1, 0, 1, 1],
            4864,
            &[0, 1, 2, 3, 4, 5, 6],
            1,
        ),
        (
            9,
            15,
            "1g.10gb",
            1,
            4,
            14,
            [1, 1, 0, 0, 0],
            9856,
            &[0, 2, 4, 6],
            2,
        ),
    ];
    rows.iter()
        .map(
            |&(index, id, name, slices, instances, sms, engines, mib, starts, size)| RawGiProfile {
                profile_index: index,
                id,
                name: named.then(|| format!("MIG {name}")),
                slice_count: slices,
                instance_count: instances,
                multiprocessors: sms,
                copy_engines: engines[0],
                decoders: engines[1],
                encoders: engines[2],
                jpegs: engines[3],
                ofas: engines[4],
                memory_size_mib: mib,
                placements: starts
                    .iter()
                    .map(|&start| MigPlacement { start, size })
                    .collect(),
            },
        )
        .collect()
}

fn a100_gpu() -> RawGpu {
    RawGpu {
        minor: 2,
        uuid: "GPU-a100".into(),
        name: A100_SXM4_40GB.into(),
        memory_total_bytes: 40960 * MIB,
        mig_enabled: true,
        mig_profiles: a100_40gb(true),
        ..RawGpu::default()
    }
}

#[test]
fn nvml_answers_decode_to_the_builtin_a100_catalogue() {
    let builtin = catalog_for(A100_SXM4_40GB).unwrap();
    for named in [true, false] {
        let decoded = decode_catalog(40960, &a100_40gb(named)).unwrap().unwrap();
        assert_eq!(&decoded, builtin, "named {named}");
        assert_eq!(catalog_difference(&decoded, builtin), None);
    }
    let (catalog, difference) = gpu_catalog(&a100_gpu()).unwrap();
    assert_eq!(catalog.as_ref(), Some(builtin));
    assert_eq!(difference, None);
}

#[test]
fn nvml_wins_over_the_builtin_catalogue_and_the_difference_is_named() {
    let mut gpu = a100_gpu();
    // A driver that does not offer +me and places 1g.10gb only at 0 and 4.
    gpu.mig_profiles.retain(|p| p.profile_index != 7);
    let rev2 = gpu
        .mig_profiles
        .iter_mut()
        .find(|p| p.profile_index == 9)
        .unwrap();
    rev2.placements.truncate(2);
    let (catalog, difference) = gpu_catalog(&gpu).unwrap();
    let catalog = catalog.unwrap();
    assert_eq!(catalog.profiles.len(), 6);
    assert_eq!(catalog.profile("1g.10gb").unwrap().placements.len(), 2);
    let difference = difference.unwrap();
    assert!(difference.contains("1g.10gb differs"), "{difference}");
    assert!(
        difference.contains("1g.5gb+me not offered by NVML"),
        "{difference}"
    );
}

#[test]
fn without_nvml_answers_the_builtin_catalogue_serves() {
    let mut gpu = a100_gpu();
    gpu.mig_profiles.clear();
    let (catalog, difference) = gpu_catalog(&gpu).unwrap();
    assert_eq!(catalog.as_ref(), catalog_for(A100_SXM4_40GB));
    assert_eq!(difference, None);
    gpu.name = "NVIDIA L4".into();
    assert_eq!(gpu_catalog(&gpu).unwrap(), (None, None));
}

#[test]
fn profiles_without_placements_or_compute_profile_are_left_out() {
    let mut raw = a100_40gb(true);
    raw[0].placements.clear();
    raw[1].slice_count = 5;
    let catalog = decode_catalog(40960, &raw).unwrap().unwrap();
    assert!(catalog.profile("1g.5gb").is_none());
    assert!(catalog.profile("2g.10gb").is_none());
    assert_eq!(catalog.profiles.len(), 5);
    assert_eq!(decode_catalog(40960, &[]).unwrap(), None);
}

#[test]
fn inconsistent_placements_are_errors_naming_the_profile() {
    let mut raw = a100_40gb(true);
    raw[2].placements[1].size = 2;
    let error = decode_catalog(40960, &raw).unwrap_err();
    assert!(error.contains("profile 2 (id 9)"), "{error}");
    let mut raw = a100_40gb(false);
    raw[0].memory_size_mib = 0;
    raw[0].slice_count = 0;
    raw[0].profile_index = 8;
    // slice count 0 has no compute profile: left out rather than misnamed.
    assert!(decode_catalog(40960, &raw).unwrap().is_some());
    let error = decode_catalog(0, &a100_40gb(false)).unwrap_err();
    assert!(error.contains("no name"), "{error}");
}

#[test]
fn compute_profiles_span_the_instance() {
    assert_eq!(full_compute_profile(1), Some(0));
    assert_eq!(full_compute_profile(4), Some(3));
    assert_eq!(full_compute_profile(7), Some(4));
    assert_eq!(full_compute_profile(8), Some(5));
    assert_eq!(full_compute_profile(6), Some(6));
    assert_eq!(full_compute_profile(5), None);
    assert_eq!(full_compute_profile(0), None);
}

fn record(gi_id: Option<u32>, uuid: Option<&str>) -> RecordedInstance {
    RecordedInstance {
        claim_uid: "claim".into(),
        state: ClaimState::PrepareCompleted,
        instance: MigInstanceRecord {
            parent_uuid: "GPU-a100".into(),
            parent_minor: 2,
            profile: "1g.5gb".into(),
            gi_profile_id: 19,
            ci_profile_id: 0,
            placement: RecordedPlacement { start: 0, size: 1 },
            gi_id,
            ci_id: gi_id.map(|_| 0),
            mig_uuid: uuid.map(str::to_owned),
        },
    }
}

fn mig(uuid: &str, gi_id: Option<u32>) -> RawMig {
    RawMig {
        uuid: uuid.into(),
        gi_id,
        ..RawMig::default()
    }
}

fn policy() -> DynamicMigPolicy {
    DynamicMigPolicy {
        enabled: true,
        static_gpus: BTreeSet::new(),
        kerf_instances: KerfInstances::from_records(&[
            record(Some(7), Some("MIG-kerf")),
            record(None, None),
        ]),
    }
}

#[test]
fn kerf_instances_come_from_created_records_only() {
    let kerf = policy().kerf_instances;
    assert_eq!(kerf.gpu_instances, BTreeSet::from([(2, 7)]));
    assert_eq!(kerf.uuids, BTreeSet::from(["MIG-kerf".to_owned()]));
}

#[test]
fn a_mig_gpu_with_a_catalogue_and_only_kerf_instances_is_dynamic() {
    let builtin = catalog_for(A100_SXM4_40GB);
    let mut gpu = a100_gpu();
    assert_eq!(dynamic_decision(&gpu, builtin, &policy()), Ok(()));
    // kerf's own instances, known by GPU instance id or by UUID.
    gpu.mig_devices = vec![mig("MIG-other-uuid", Some(7)), mig("MIG-kerf", None)];
    assert_eq!(dynamic_decision(&gpu, builtin, &policy()), Ok(()));
}

#[test]
fn gpus_that_are_not_dynamic_say_why() {
    let builtin = catalog_for(A100_SXM4_40GB);
    let gpu = a100_gpu();
    let why = |gpu: &RawGpu, catalog, policy: &DynamicMigPolicy| {
        dynamic_decision(gpu, catalog, policy).unwrap_err()
    };
    let off = DynamicMigPolicy {
        enabled: false,
        ..policy()
    };
    assert!(why(&gpu, builtin, &off).contains("off"));
    let no_mig = RawGpu {
        mig_enabled: false,
        ..a100_gpu()
    };
    assert!(why(&no_mig, builtin, &policy()).contains("MIG mode is off"));
    let pinned = DynamicMigPolicy {
        static_gpus: BTreeSet::from([2]),
        ..policy()
    };
    assert!(why(&gpu, builtin, &pinned).contains("static"));
    assert!(why(&gpu, None, &policy()).contains("no MIG catalogue"));
    let mut foreign = a100_gpu();
    // GPU instance 7 on another GPU is not kerf's instance on this one.
    foreign.mig_devices = vec![mig("MIG-admin", Some(3)), mig("MIG-kerf", Some(7))];
    let other_minor = RawGpu {
        minor: 3,
        mig_devices: vec![mig("MIG-elsewhere", Some(7))],
        ..a100_gpu()
    };
    let reason = why(&foreign, builtin, &policy());
    assert!(reason.contains("MIG-admin"), "{reason}");
    assert!(!reason.contains("MIG-kerf"), "{reason}");
    assert!(why(&other_minor, builtin, &policy()).contains("MIG-elsewhere"));
}
