//! Unit tests of the mock profiles and the inventory file.

use super::*;
use proptest::prelude::*;

fn profile(spec: &str) -> Inventory {
    match from_spec(spec) {
        Ok(inventory) => inventory,
        Err(e) => panic!("{spec}: {e}"),
    }
}

fn invalid_message(result: Result<Inventory>) -> String {
    match result {
        Err(Error::InvalidInventory(message)) => message,
        other => panic!("expected InvalidInventory, got {other:?}"),
    }
}

#[test]
fn every_profile_validates_at_its_natural_count() {
    for (name, count) in [
        (H100_SXM_80GB, 8),
        (A100_40GB_MIG, 4),
        (L4, 2),
        (A100_40GB_DYNMIG, 4),
        (A100_80GB_DYNMIG, 8),
        (H100_SXM_80GB_DYNMIG, 8),
        (H100_NVL, 2),
    ] {
        let inventory = profile(name);
        assert_eq!(inventory.gpus.len(), count, "{name}");
        assert_eq!(inventory.driver_version, "570.124.06");
        assert_eq!(inventory.cuda_driver_version.as_deref(), Some("12.8"));
    }
    assert_eq!(
        profile_names(),
        &[
            H100_SXM_80GB,
            A100_40GB_MIG,
            L4,
            A100_40GB_DYNMIG,
            A100_80GB_DYNMIG,
            H100_SXM_80GB_DYNMIG,
            H100_NVL
        ]
    );
}

#[test]
fn h100_nvl_is_nvlink_bridged_pairs_of_pcie_cards() {
    let inventory = profile(H100_NVL);
    for gpu in &inventory.gpus {
        assert_eq!(gpu.product_name, "NVIDIA H100 NVL");
        assert_eq!(gpu.architecture, "Hopper");
        assert_eq!(
            gpu.compute_capability,
            ComputeCapability { major: 9, minor: 0 }
        );
        assert_eq!(gpu.memory_bytes, 95830 * MIB);
        assert_eq!(gpu.multiprocessors, 132);
        // Bridged, not switched: no fabric domain.
        assert!(gpu.nvlink_domain.is_none());
        assert!(!gpu.mig_enabled && gpu.mig_devices.is_empty());
    }
    assert_eq!(inventory.gpus[0].nvlink_peers, [1]);
    assert_eq!(inventory.gpus[1].nvlink_peers, [0]);
    assert_eq!(inventory.gpus[0].pci_bus_id, "0000:4e:00.0");
    // Four cards are two pairs: a card's only peer is its bridge partner.
    let four = profile("h100-nvl:4");
    let peers: Vec<&[u32]> = four
        .gpus
        .iter()
        .map(|g| g.nvlink_peers.as_slice())
        .collect();
    assert_eq!(peers, [&[1][..], &[0], &[3], &[2]]);
    assert_eq!(four.gpus[2].pci_bus_id, "0001:4e:00.0");
}

#[test]
fn h100_is_a_dgx_h100() {
    let inventory = profile(H100_SXM_80GB);
    let domains: std::collections::BTreeSet<_> = inventory
        .gpus
        .iter()
        .map(|g| g.nvlink_domain.clone())
        .collect();
    assert_eq!(domains.len(), 1);
    for gpu in &inventory.gpus {
        assert_eq!(gpu.product_name, "NVIDIA H100 80GB HBM3");
        assert_eq!(gpu.architecture, "Hopper");
        assert_eq!(
            gpu.compute_capability,
            ComputeCapability { major: 9, minor: 0 }
        );
        assert_eq!(gpu.memory_bytes, 81559 * MIB);
        assert_eq!(gpu.multiprocessors, 132);
        assert_eq!(gpu.nvlink_peers.len(), 7);
        assert!(gpu.nvlink_domain.is_some());
        assert_eq!(gpu.numa_node, Some(u32::from(gpu.minor >= 4)));
        assert!(!gpu.mig_enabled);
    }
    assert_eq!(inventory.gpus[0].pci_bus_id, "0000:18:00.0");
    assert_eq!(inventory.gpus[7].pcie_root.as_deref(), Some("pci0000:d7"));
}

#[test]
fn a100_has_real_mig_layouts() {
    let inventory = profile(A100_40GB_MIG);
    let gpu0 = &inventory.gpus[0];
    assert!(gpu0.mig_enabled);
    let profiles: Vec<&str> = gpu0
        .mig_devices
        .iter()
        .map(|m| m.profile.as_str())
        .collect();
    assert_eq!(profiles, ["3g.20gb", "2g.10gb", "1g.5gb"]);
    assert_eq!(
        gpu0.mig_devices[1].placement,
        MigPlacement { start: 4, size: 2 }
    );
    assert_eq!(gpu0.mig_devices[0].memory_bytes, 19968 * MIB);
    // gpu0/gi1/access is 3 + 9 = 12 and gpu0/gi1/ci0/access 13 in the driver's table.
    assert_eq!(
        (
            gpu0.mig_devices[0].gi_cap_minor,
            gpu0.mig_devices[0].ci_cap_minor
        ),
        (12, 13)
    );
    assert!(inventory.gpus[1].mig_enabled);
    assert_eq!(inventory.gpus[1].mig_devices.len(), 4);
    assert!(!inventory.gpus[2].mig_enabled && inventory.gpus[2].mig_devices.is_empty());
    assert!(inventory.gpus[0].mig_devices[0].uuid.starts_with("MIG-"));
    let names: Vec<String> = inventory.devices().map(|d| d.name()).collect();
    assert!(
        names.contains(&"gpu-0-mig-3g-20gb-0".to_owned()),
        "{names:?}"
    );
    assert!(names.contains(&"gpu-2".to_owned()));
    assert!(!names.contains(&"gpu-0".to_owned()));
}

#[test]
fn l4_is_pcie_only() {
    let inventory = profile(L4);
    for gpu in &inventory.gpus {
        assert_eq!(gpu.architecture, "Ada Lovelace");
        assert_eq!(
            gpu.compute_capability,
            ComputeCapability { major: 8, minor: 9 }
        );
        assert_eq!(gpu.multiprocessors, 58);
        assert!(gpu.nvlink_peers.is_empty() && gpu.nvlink_domain.is_none());
    }
}

#[test]
fn cap_minor_table_matches_the_drivers_last_entry() {
    // The driver's table ends with `gpu31/gi14/ci7/access 4322`.
    assert_eq!(mig_cap_minors(31, 14, 7), Some((4314, 4322)));
    assert_eq!(mig_cap_minors(0, 0, 0), Some((3, 4)));
    assert_eq!(mig_cap_minors(32, 0, 0), None);
    assert_eq!(mig_cap_minors(0, 15, 0), None);
    assert_eq!(mig_cap_minors(0, 0, 8), None);
}

#[test]
fn uuids_look_like_nvml_uuids() {
    let uuid = gpu_uuid(H100_SXM_80GB, 3);
    assert_eq!(uuid.len(), 40);
    let groups: Vec<usize> = uuid["GPU-".len()..].split('-').map(str::len).collect();
    assert_eq!(groups, [8, 4, 4, 4, 12]);
    assert_eq!(uuid, gpu_uuid(H100_SXM_80GB, 3));
    assert_ne!(uuid, gpu_uuid(H100_SXM_80GB, 4));
    assert_ne!(uuid, gpu_uuid(L4, 3));
}

#[test]
fn count_override() {
    assert_eq!(profile("l4:5").gpus.len(), 5);
    assert_eq!(
        profile("h100-sxm-80gb:1").gpus[0].nvlink_peers,
        Vec::<u32>::new()
    );
    let big = profile("h100-sxm-80gb:20");
    assert_eq!(big.gpus[9].pci_bus_id, "0001:2a:00.0");
    assert_eq!(big.gpus[9].nvlink_peers.len(), 19);
    let a100 = profile("a100-40gb-mig:6");
    assert_eq!(a100.gpus[4].nvlink_peers, [5]);
    assert!(a100.gpus[4].mig_enabled && a100.gpus[5].mig_enabled);
    let max = profile("a100-40gb-mig:64");
    assert!(max.gpus[32].mig_devices.is_empty() && !max.gpus[32].mig_enabled);
}

#[test]
fn bad_specs_name_the_value() {
    for (spec, needle) in [
        ("l4:0", "GPU count 0"),
        ("l4:65", "GPU count 65"),
        ("l4:two", "\"two\""),
        ("l4:", "\"\""),
        ("l4:-1", "\"-1\""),
    ] {
        match from_spec(spec) {
            Err(e @ Error::InvalidMockSpec { .. }) => {
                assert!(e.to_string().contains(needle), "{spec}: {e}");
            }
            other => panic!("{spec}: expected InvalidMockSpec, got {other:?}"),
        }
    }
    match from_spec("v100") {
        Err(Error::UnknownMockProfile { name, known }) => {
            assert_eq!(name, "v100");
            assert!(known.contains("h100-sxm-80gb") && known.contains("l4"));
        }
        other => panic!("expected UnknownMockProfile, got {other:?}"),
    }
}

#[test]
fn yaml_unknown_field_is_an_error() {
    let text = "driverVersion: \"1\"\ngpus: []\nextra: 1\n";
    assert!(matches!(from_yaml(text, "x.yaml"), Err(Error::Yaml { .. })));
}

#[test]
fn yaml_errors_carry_the_source_name() {
    let mut inventory = profile(L4);
    inventory.gpus[1].minor = 0;
    let text = to_yaml(&inventory);
    assert_eq!(
        invalid_message(from_yaml(&text, "custom.yaml")),
        "custom.yaml: gpus[1].minor: duplicate minor 0"
    );
}

#[test]
fn example_inventory_file_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/inventory/custom.yaml");
    let inventory = match load_file(&path) {
        Ok(inventory) => inventory,
        Err(e) => panic!("{e}"),
    };
    assert!(!inventory.gpus.is_empty());
    assert!(inventory.gpus.iter().any(|g| g.mig_enabled));
}

#[test]
fn load_file_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.yaml");
    assert!(matches!(
        load_file(&missing),
        Err(Error::Io { op: "open", .. })
    ));
    let big = dir.path().join("big.yaml");
    let size = usize::try_from(MAX_INVENTORY_FILE_BYTES).unwrap() + 1;
    std::fs::write(&big, format!("#{}", " ".repeat(size))).unwrap();
    assert!(matches!(load_file(&big), Err(Error::Io { op: "read", .. })));
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "driverVersion: [").unwrap();
    match load_file(&bad) {
        Err(Error::Yaml { what, .. }) => assert!(what.ends_with("bad.yaml")),
        other => panic!("expected Yaml, got {other:?}"),
    }
}

fn to_yaml(inventory: &Inventory) -> String {
    match serde_saphyr::to_string(inventory) {
        Ok(text) => text,
        Err(e) => panic!("serialize: {e}"),
    }
}

/// Breaks one invariant of a valid inventory.
type Breaker = fn(&mut Inventory);

/// Cases on inventory and GPU fields: the breaker and the start of the expected message.
fn gpu_cases() -> Vec<(Breaker, &'static str)> {
    vec![
        (
            |i| i.driver_version = String::new(),
            "driverVersion: must not be empty",
        ),
        (
            |i| i.cuda_driver_version = Some(" ".into()),
            "cudaDriverVersion: must not be empty",
        ),
        (|i| i.gpus[1].minor = 0, "gpus[1].minor: duplicate minor 0"),
        (
            |i| i.gpus[1].uuid = i.gpus[0].uuid.clone(),
            "gpus[1].uuid: duplicate UUID",
        ),
        (
            |i| i.gpus[0].mig_devices[0].uuid = i.gpus[0].uuid.clone(),
            "gpus[0].migDevices[0].uuid: duplicate UUID",
        ),
        (
            |i| i.gpus[2].product_name = String::new(),
            "gpus[2].productName: must not be empty",
        ),
        (
            |i| i.gpus[2].brand = String::new(),
            "gpus[2].brand: must not be empty",
        ),
        (
            |i| i.gpus[2].architecture = String::new(),
            "gpus[2].architecture: must not be empty",
        ),
        (
            |i| i.gpus[2].uuid = String::new(),
            "gpus[2].uuid: must not be empty",
        ),
        (
            |i| i.gpus[2].product_name = "x".repeat(65),
            "gpus[2].productName: \"xxxxxxxx",
        ),
        (
            |i| i.gpus[3].nvlink_domain = Some("d".repeat(65)),
            "gpus[3].nvlinkDomain:",
        ),
        (
            |i| i.gpus[3].pci_bus_id = "0000:4E:00.0".into(),
            "gpus[3].pciBusId: \"0000:4E:00.0\"",
        ),
        (
            |i| i.gpus[3].pcie_root = Some("root".into()),
            "gpus[3].pcieRoot: \"root\"",
        ),
        (
            |i| i.gpus[3].memory_bytes = 0,
            "gpus[3].memoryBytes: must be greater than 0",
        ),
        (
            |i| i.gpus[3].multiprocessors = 0,
            "gpus[3].multiprocessors: must be greater than 0",
        ),
        (
            |i| i.gpus[3].nvlink_peers.push(3),
            "gpus[3].nvlinkPeers[3]: GPU 3 cannot be its own NVLink peer",
        ),
        (
            |i| i.gpus[3].nvlink_peers.push(9),
            "gpus[3].nvlinkPeers[3]: no GPU with minor 9",
        ),
        (
            |i| i.gpus[3].nvlink_peers.push(0),
            "gpus[3].nvlinkPeers[3]: duplicate peer 0",
        ),
    ]
}

/// Cases on MIG devices: the breaker and the start of the expected message.
fn mig_cases() -> Vec<(Breaker, &'static str)> {
    vec![
        (
            |i| i.gpus[0].mig_enabled = false,
            "gpus[0].migDevices: GPU 0 has MIG devices but migEnabled is false",
        ),
        (
            |i| i.gpus[0].mig_devices[1].placement.start = 3,
            "gpus[0].migDevices[1].placement: 3:2 overlaps GPU instance 1 at 0:4",
        ),
        (
            |i| i.gpus[0].mig_devices[1].gi_id = 1,
            "gpus[0].migDevices[1].placement: GPU instance 1 is placed at 4:2 here",
        ),
        (
            |i| i.gpus[0].mig_devices[1].placement.size = 0,
            "gpus[0].migDevices[1].placement.size: must be greater than 0",
        ),
        (
            |i| i.gpus[0].mig_devices[1].memory_bytes = 0,
            "gpus[0].migDevices[1].memoryBytes: 0 must be greater than 0",
        ),
        (
            |i| i.gpus[0].mig_devices[1].multiprocessors = 200,
            "gpus[0].migDevices[1].multiprocessors: 200 must be greater than 0 and at most \
             the parent's 108",
        ),
        (
            |i| i.gpus[0].mig_devices[1].profile = String::new(),
            "gpus[0].migDevices[1].profile: must not be empty",
        ),
        (
            |i| i.gpus[0].mig_devices[1].profile = "2g.10gb".repeat(9),
            "gpus[0].migDevices[1].profile: \"2g.10gb2g.10gb",
        ),
        (
            |i| i.gpus[0].mig_devices[1].ci_cap_minor = i.gpus[0].mig_devices[1].gi_cap_minor,
            "gpus[0].migDevices[1].ciCapMinor:",
        ),
        (
            |i| i.gpus[1].mig_devices[0].gi_cap_minor = i.gpus[0].mig_devices[0].gi_cap_minor,
            "gpus[1].migDevices[0].giCapMinor: 12 already belongs to GPU 0 instance 1",
        ),
        (
            |i| i.gpus[1].mig_devices[0].ci_cap_minor = i.gpus[0].mig_devices[0].ci_cap_minor,
            "gpus[1].migDevices[0].ciCapMinor: duplicate capability minor 13",
        ),
        (
            |i| i.gpus[1].mig_devices[0].gi_cap_minor = i.gpus[0].mig_devices[0].ci_cap_minor,
            "gpus[1].migDevices[0].giCapMinor: 13 is already a compute-instance capability",
        ),
    ]
}

#[test]
fn every_validation_error() {
    let cases = gpu_cases().into_iter().chain(mig_cases());
    for (break_it, expected) in cases {
        let mut inventory = profile(A100_40GB_MIG);
        break_it(&mut inventory);
        let message = invalid_message(from_yaml(&to_yaml(&inventory), "t.yaml"));
        assert!(
            message.starts_with(&format!("t.yaml: {expected}")),
            "expected {expected:?}, got {message:?}"
        );
    }
}

#[test]
fn compute_instances_of_one_gpu_instance_share_its_placement() {
    let mut inventory = profile(A100_40GB_MIG);
    let mut second_ci = inventory.gpus[0].mig_devices[0].clone();
    second_ci.ci_id = 1;
    second_ci.uuid = mig_uuid(A100_40GB_MIG, 0, 1, 1);
    second_ci.ci_cap_minor += 1;
    inventory.gpus[0].mig_devices.push(second_ci);
    // Same GPU instance and placement is fine for the placement check; the published
    // device name, derived from the placement, then collides.
    let message = invalid_message(inventory.validate().map(|()| inventory.clone()));
    assert_eq!(
        message,
        "gpus[0].migDevices[3]: duplicate device name \"gpu-0-mig-3g-20gb-0\""
    );
}

fn spec() -> impl Strategy<Value = (String, u32)> {
    (
        prop::sample::select(PROFILE_NAMES.to_vec()),
        1..=MAX_MOCK_GPUS,
    )
        .prop_map(|(name, count)| (name.to_owned(), count))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn any_count_is_valid_and_consistent((name, count) in spec()) {
        let inventory = profile(&format!("{name}:{count}"));
        prop_assert_eq!(inventory.gpus.len(), usize::try_from(count).unwrap());
        let natural = profile(&name);
        for gpu in &inventory.gpus {
            // NVLink is symmetric.
            for &peer in &gpu.nvlink_peers {
                let other = inventory.gpu_by_minor(peer);
                prop_assert!(other.is_some_and(|o| o.nvlink_peers.contains(&gpu.minor)));
            }
            // A GPU looks the same whatever the count, apart from peers that do not exist.
            if let Some(same) = natural.gpu_by_minor(gpu.minor) {
                prop_assert_eq!(&same.uuid, &gpu.uuid);
                prop_assert_eq!(&same.pci_bus_id, &gpu.pci_bus_id);
                prop_assert_eq!(&same.mig_devices, &gpu.mig_devices);
            }
        }
    }

    #[test]
    fn yaml_round_trip((name, count) in spec()) {
        let inventory = profile(&format!("{name}:{count}"));
        let text = to_yaml(&inventory);
        let back = from_yaml(&text, "round-trip");
        prop_assert!(back.is_ok(), "{:?}", back.err());
        prop_assert_eq!(back.ok(), Some(inventory));
    }
}

#[test]
fn dynmig_gpus_are_in_mig_mode_without_devices_and_have_a_catalogue() {
    let inventory = profile(A100_40GB_DYNMIG);
    assert_eq!(inventory.gpus.len(), 4);
    for gpu in &inventory.gpus {
        assert!(gpu.mig_enabled && gpu.mig_devices.is_empty());
        let catalog = crate::mig_catalog::catalog_for(&gpu.product_name);
        assert_eq!(catalog.map(|c| c.placements().count()), Some(25));
    }
    // Nothing is published statically: a MIG-mode GPU is not allocatable whole.
    assert_eq!(inventory.devices().count(), 0);
    assert_ne!(
        inventory.gpus[0].uuid,
        profile(A100_40GB_MIG).gpus[0].uuid,
        "another machine"
    );
    // The driver's MIG capability table ends at GPU 31; later GPUs stay out of MIG mode.
    let big = profile("a100-40gb-dynmig:40");
    assert!(big.gpus[31].mig_enabled && !big.gpus[32].mig_enabled);
}

#[test]
fn every_dynmig_profile_has_its_gpus_catalogue() {
    for (name, product) in [
        (A100_40GB_DYNMIG, crate::mig_catalog::A100_SXM4_40GB),
        (A100_80GB_DYNMIG, crate::mig_catalog::A100_SXM4_80GB),
        (H100_SXM_80GB_DYNMIG, crate::mig_catalog::H100_SXM5_80GB),
    ] {
        let inventory = profile(&format!("{name}:8"));
        for gpu in &inventory.gpus {
            assert_eq!(gpu.product_name, product, "{name}");
            assert!(gpu.dynamic_mig && gpu.mig_enabled && gpu.mig_devices.is_empty());
            assert_eq!(
                gpu.mig_catalog.as_ref(),
                crate::mig_catalog::catalog_for(product),
                "{name}"
            );
            // The full-GPU profile fits in the GPU's memory.
            let full = gpu.mig_catalog.as_ref().unwrap().profiles.last().unwrap();
            assert!(full.memory_bytes() <= gpu.memory_bytes, "{name}");
        }
    }
    assert_ne!(
        profile(H100_SXM_80GB_DYNMIG).gpus[0].uuid,
        profile(H100_SXM_80GB).gpus[0].uuid,
        "another machine"
    );
}

#[test]
fn dynamic_mig_fields_are_optional_in_inventory_yaml() {
    let old = to_yaml(&profile(A100_40GB_MIG));
    assert!(!old.contains("dynamicMig") && !old.contains("migCatalog"));
    let back = from_yaml(&old, "old.yaml").unwrap();
    assert!(
        back.gpus
            .iter()
            .all(|g| !g.dynamic_mig && g.mig_catalog.is_none())
    );
    let dynamic = profile(A100_40GB_DYNMIG);
    assert!(
        dynamic
            .gpus
            .iter()
            .all(|g| g.dynamic_mig && g.mig_catalog.is_some())
    );
    assert_eq!(from_yaml(&to_yaml(&dynamic), "new.yaml").unwrap(), dynamic);
}
