//! Tests of the GPU facts and the inventory built from them.

use std::path::Path;

use kerf_core::inventory::MigPlacement;

use super::*;

fn h100(index: u32, bus: &str, remotes: Vec<Option<String>>) -> RawGpu {
    RawGpu {
        index,
        minor: index,
        uuid: format!("GPU-{index:08x}-0000-0000-0000-000000000000"),
        name: "NVIDIA H100 80GB HBM3".into(),
        brand: "NVIDIA".into(),
        architecture: "Hopper".into(),
        compute_capability: (9, 0),
        memory_total_bytes: 81559 * MIB,
        multiprocessors: None,
        cuda_cores: Some(16896),
        pci_bus_id: bus.into(),
        nvlink_remotes: remotes,
        ..RawGpu::default()
    }
}

#[test]
fn bus_ids_are_normalised_to_sysfs_form() {
    assert_eq!(
        normalize_bus_id("00000000:1B:00.0").as_deref(),
        Some("0000:1b:00.0")
    );
    assert_eq!(
        normalize_bus_id("0000:1b:00.0").as_deref(),
        Some("0000:1b:00.0")
    );
    assert_eq!(
        normalize_bus_id("00010000:C1:1F.7").as_deref(),
        Some("10000:c1:1f.7")
    );
    for bad in [
        "",
        "1b:00.0",
        "0000:1b:00",
        "0000:1b:00.8",
        "0000:1b:20.0",
        "0000:xx:00.0",
        "a:b:c:d.0",
    ] {
        assert_eq!(normalize_bus_id(bad), None, "{bad:?}");
    }
}

#[test]
fn numa_node_minus_one_is_none() {
    assert_eq!(parse_numa_node("1\n"), Some(1));
    assert_eq!(parse_numa_node("-1\n"), None);
    assert_eq!(parse_numa_node("garbage"), None);
}

#[test]
fn pcie_root_is_the_first_component_under_devices() {
    let link = Path::new("../../../devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:18:00.0");
    assert_eq!(
        pcie_root_from_sysfs_link(link, "0000:18:00.0").as_deref(),
        Some("pci0000:15")
    );
    let absolute = Path::new("/sys/devices/pci0000:00/0000:00:03.0");
    assert_eq!(
        pcie_root_from_sysfs_link(absolute, "0000:00:03.0").as_deref(),
        Some("pci0000:00")
    );
    assert_eq!(pcie_root_from_sysfs_link(link, "0000:19:00.0"), None);
    let no_root = Path::new("../../../devices/platform/0000:18:00.0");
    assert_eq!(pcie_root_from_sysfs_link(no_root, "0000:18:00.0"), None);
}

#[test]
fn sms_from_attribute_or_cores() {
    let mut gpu = h100(0, "00000000:18:00.0", vec![]);
    assert_eq!(multiprocessors(&gpu), Some(132));
    gpu.multiprocessors = Some(130);
    assert_eq!(multiprocessors(&gpu), Some(130));
    let a100 = RawGpu {
        compute_capability: (8, 0),
        cuda_cores: Some(6912),
        ..RawGpu::default()
    };
    assert_eq!(multiprocessors(&a100), Some(108));
    let l4 = RawGpu {
        compute_capability: (8, 9),
        cuda_cores: Some(7424),
        ..RawGpu::default()
    };
    assert_eq!(multiprocessors(&l4), Some(58));
    let unknown = RawGpu {
        compute_capability: (2, 0),
        cuda_cores: Some(512),
        ..RawGpu::default()
    };
    assert_eq!(multiprocessors(&unknown), None);
}

#[test]
fn direct_links_and_switch_fabric() {
    // GPUs 0 and 1 linked directly; 2 and 3 reach an NVSwitch; 4 has no NVLink.
    let gpus = vec![
        h100(0, "00000000:18:00.0", vec![Some("00000000:2A:00.0".into())]),
        h100(1, "00000000:2A:00.0", vec![Some("00000000:18:00.0".into())]),
        h100(2, "00000000:3A:00.0", vec![Some("00000000:E0:00.0".into())]),
        h100(3, "00000000:5D:00.0", vec![None]),
        h100(4, "00000000:9A:00.0", vec![]),
    ];
    let peers = nvlink_peers(&gpus);
    assert_eq!(peers[&0], [1]);
    assert_eq!(peers[&1], [0]);
    assert_eq!(peers[&2], [3]);
    assert_eq!(peers[&3], [2]);
    assert!(peers[&4].is_empty());
}

#[test]
fn one_sided_links_become_symmetric() {
    let gpus = vec![
        h100(0, "00000000:18:00.0", vec![Some("00000000:2A:00.0".into())]),
        h100(1, "00000000:2A:00.0", vec![]),
    ];
    assert_eq!(nvlink_peers(&gpus)[&1], [0]);
}

#[test]
fn builds_a_valid_inventory() {
    let raw = RawSystem {
        driver_version: "570.124.06".into(),
        cuda_driver_version: Some(12080),
        gpus: vec![
            h100(0, "00000000:18:00.0", vec![Some("00000000:2A:00.0".into())]),
            h100(1, "00000000:2A:00.0", vec![Some("00000000:18:00.0".into())]),
        ],
    };
    let mut host = HostFacts::default();
    host.pci.insert(
        "0000:18:00.0".into(),
        PciHostFacts {
            numa_node: Some(0),
            pcie_root: Some("pci0000:15".into()),
        },
    );
    let converted = build_inventory(&raw, &host, &DynamicMigPolicy::default());
    assert!(converted.skipped.is_empty(), "{:?}", converted.skipped);
    let inventory = converted.inventory;
    assert!(inventory.validate().is_ok(), "{:?}", inventory.validate());
    assert_eq!(inventory.cuda_driver_version.as_deref(), Some("12.8"));
    assert_eq!(inventory.gpus[0].pci_bus_id, "0000:18:00.0");
    assert_eq!(inventory.gpus[0].pcie_root.as_deref(), Some("pci0000:15"));
    assert_eq!(inventory.gpus[0].numa_node, Some(0));
    assert_eq!(inventory.gpus[1].numa_node, None);
    assert_eq!(inventory.gpus[0].nvlink_peers, [1]);
    assert_eq!(inventory.gpus[0].multiprocessors, 132);
}

#[test]
fn devices_missing_facts_are_skipped_with_a_reason() {
    let mut broken = h100(1, "not-a-bus-id", vec![]);
    broken.uuid = "GPU-broken".into();
    let mut mig_gpu = h100(2, "00000000:3A:00.0", vec![]);
    mig_gpu.mig_enabled = true;
    mig_gpu.mig_devices = vec![
        RawMig {
            uuid: "MIG-opaque".into(),
            memory_total_bytes: 9856 * MIB,
            multiprocessors: 16,
            gpu_instance_slices: 1,
            compute_instance_slices: 1,
            memory_size_mib: 9856,
            ..RawMig::default()
        },
        RawMig {
            uuid: "MIG-GPU-parent/9/0".into(),
            memory_total_bytes: 9856 * MIB,
            multiprocessors: 16,
            gpu_instance_slices: 1,
            compute_instance_slices: 1,
            memory_size_mib: 9856,
            placement: Some(MigPlacement { start: 2, size: 1 }),
            ..RawMig::default()
        },
    ];
    let raw = RawSystem {
        driver_version: "570.124.06".into(),
        gpus: vec![
            h100(0, "00000000:18:00.0", vec![Some("not-a-bus-id".into())]),
            broken,
            mig_gpu,
        ],
        ..RawSystem::default()
    };
    let host = HostFacts {
        mig_minors: MigMinors::parse("gpu2/gi9/access 309\ngpu2/gi9/ci0/access 310\n"),
        ..HostFacts::default()
    };
    let converted = build_inventory(&raw, &host, &DynamicMigPolicy::default());
    assert_eq!(converted.inventory.gpus.len(), 2);
    assert_eq!(converted.skipped.len(), 2, "{:?}", converted.skipped);
    assert!(
        converted.skipped[0].contains("GPU-broken")
            && converted.skipped[0].contains("not-a-bus-id")
    );
    assert!(
        converted.skipped[1].contains("MIG-opaque")
            && converted.skipped[1].contains("GPU instance id")
    );
    let mig = &converted.inventory.gpus[1].mig_devices[0];
    assert_eq!(
        (
            mig.profile.as_str(),
            mig.gi_id,
            mig.gi_cap_minor,
            mig.ci_cap_minor
        ),
        ("1g.10gb", 9, 309, 310)
    );
    assert!(
        converted.inventory.validate().is_ok(),
        "{:?}",
        converted.inventory.validate()
    );
}

const CLUSTER: [u8; 16] = [
    0x6f, 0x1c, 0x2a, 0x8e, 0x4b, 0x7d, 0x4e, 0x19, 0x9a, 0x3c, 0x52, 0xd0, 0xe8, 0xf1, 0xb7, 0x64,
];

fn completed(clique_id: u32) -> RawFabric {
    RawFabric {
        cluster_uuid: CLUSTER,
        clique_id,
        state: FABRIC_STATE_COMPLETED,
        status: NVML_SUCCESS,
    }
}

#[test]
fn uuids_print_in_canonical_form() {
    assert_eq!(
        format_uuid(&CLUSTER),
        "6f1c2a8e-4b7d-4e19-9a3c-52d0e8f1b764"
    );
    assert_eq!(
        format_uuid(&[0; 16]),
        "00000000-0000-0000-0000-000000000000"
    );
    assert_eq!(
        format_uuid(&[0xff; 16]),
        "ffffffff-ffff-ffff-ffff-ffffffffffff"
    );
}

#[test]
fn nvlink_domain_only_for_a_completed_registration_in_a_cluster() {
    assert_eq!(
        nvlink_domain(&completed(32766)).as_deref(),
        Some("6f1c2a8e-4b7d-4e19-9a3c-52d0e8f1b764.32766")
    );
    assert_eq!(
        nvlink_domain(&completed(0)).as_deref(),
        Some("6f1c2a8e-4b7d-4e19-9a3c-52d0e8f1b764.0")
    );
    for state in [0, 1, 2, 4] {
        let fabric = RawFabric {
            state,
            ..completed(1)
        };
        assert_eq!(nvlink_domain(&fabric), None, "state {state}");
    }
    // Registration finished but failed, e.g. NVML_ERROR_NOT_READY or an unknown error.
    for status in [27, 999] {
        let fabric = RawFabric {
            status,
            ..completed(1)
        };
        assert_eq!(nvlink_domain(&fabric), None, "status {status}");
    }
    let no_cluster = RawFabric {
        cluster_uuid: [0; 16],
        ..completed(1)
    };
    assert_eq!(nvlink_domain(&no_cluster), None);
    // The longest domain still fits a device attribute (64 characters).
    let longest = nvlink_domain(&completed(u32::MAX)).unwrap();
    assert!(longest.len() <= 64, "{longest}");
}

#[test]
fn nvml_ids_and_placement_keep_mig_devices_and_fabric_gives_the_domain() {
    let mut gpu = h100(0, "00000000:18:00.0", vec![None]);
    gpu.fabric = Some(completed(7));
    gpu.mig_enabled = true;
    gpu.mig_devices = vec![RawMig {
        uuid: "MIG-0e7d4c21-9b3a-5f68-a2c4-71d5e8f0b396".into(),
        memory_total_bytes: 9856 * MIB,
        multiprocessors: 16,
        gpu_instance_slices: 1,
        compute_instance_slices: 1,
        memory_size_mib: 9856,
        gi_id: Some(13),
        ci_id: Some(0),
        placement: Some(MigPlacement { start: 6, size: 1 }),
    }];
    let mut other = h100(1, "00000000:2A:00.0", vec![None]);
    other.fabric = Some(RawFabric {
        state: 2,
        ..completed(7)
    });
    let raw = RawSystem {
        driver_version: "570.124.06".into(),
        gpus: vec![gpu, other],
        ..RawSystem::default()
    };
    let host = HostFacts {
        mig_minors: MigMinors::parse("gpu0/gi13/access 120\ngpu0/gi13/ci0/access 121\n"),
        ..HostFacts::default()
    };
    let converted = build_inventory(&raw, &host, &DynamicMigPolicy::default());
    assert!(converted.skipped.is_empty(), "{:?}", converted.skipped);
    let inventory = converted.inventory;
    assert!(inventory.validate().is_ok(), "{:?}", inventory.validate());
    assert_eq!(
        inventory.gpus[0].nvlink_domain.as_deref(),
        Some("6f1c2a8e-4b7d-4e19-9a3c-52d0e8f1b764.7")
    );
    assert_eq!(inventory.gpus[1].nvlink_domain, None);
    let mig = &inventory.gpus[0].mig_devices[0];
    assert_eq!(
        (
            mig.gi_id,
            mig.ci_id,
            mig.placement,
            mig.gi_cap_minor,
            mig.ci_cap_minor
        ),
        (13, 0, MigPlacement { start: 6, size: 1 }, 120, 121)
    );
    assert_eq!(mig.device_name(0), "gpu-0-mig-1g-10gb-6");
}

#[test]
fn mig_gpus_get_a_catalogue_and_are_dynamic_as_the_policy_says() {
    let mut a100 = h100(0, "00000000:18:00.0", vec![]);
    a100.name = kerf_core::mig_catalog::A100_SXM4_40GB.into();
    a100.memory_total_bytes = 40960 * MIB;
    a100.mig_enabled = true;
    let plain = h100(1, "00000000:2A:00.0", vec![]);
    let raw = RawSystem {
        driver_version: "570.124.06".into(),
        gpus: vec![a100, plain],
        ..RawSystem::default()
    };
    let on = DynamicMigPolicy {
        enabled: true,
        ..DynamicMigPolicy::default()
    };
    let converted = build_inventory(&raw, &HostFacts::default(), &on);
    let gpus = &converted.inventory.gpus;
    assert!(gpus[0].dynamic_mig);
    assert_eq!(
        gpus[0].mig_catalog.as_ref(),
        kerf_core::mig_catalog::catalog_for(kerf_core::mig_catalog::A100_SXM4_40GB)
    );
    assert!(!gpus[1].dynamic_mig && gpus[1].mig_catalog.is_none());
    assert_eq!(
        converted.notes,
        ["GPU 0 (GPU-00000000-0000-0000-0000-000000000000): dynamic MIG"]
    );
    assert!(converted.inventory.validate().is_ok());
    let off = build_inventory(&raw, &HostFacts::default(), &DynamicMigPolicy::default());
    assert!(!off.inventory.gpus[0].dynamic_mig);
    assert!(off.inventory.gpus[0].mig_catalog.is_some());
    assert!(
        off.notes[0].contains("dynamic MIG is off"),
        "{:?}",
        off.notes
    );
}
