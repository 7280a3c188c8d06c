use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Device, ResourceSliceSpec};
use kerf_core::inventory::{ComputeCapability, Gpu, Inventory, MigDevice, MigPlacement};
use proptest::prelude::*;

use super::device::check_names_and_count;
use super::names::{
    ATTRIBUTES_ADDED_LATER, MAX_ATTRIBUTE_VALUE_LEN, MAX_ATTRIBUTES_AND_CAPACITIES,
    MAX_DEVICES_PER_SLICE, is_qualified_name,
};
use super::pool::resource_slices_chunked;
use super::*;

const DRIVER: &str = "gpu.kerf.dev";
const NODE: &str = "node-1";

fn gpu(minor: u32) -> Gpu {
    Gpu {
        index: minor,
        minor,
        uuid: format!("GPU-8d4b4a36-0000-4000-8000-{minor:012}"),
        product_name: "NVIDIA H100 80GB HBM3".into(),
        brand: "Nvidia".into(),
        architecture: "Hopper".into(),
        compute_capability: ComputeCapability { major: 9, minor: 0 },
        memory_bytes: 81_559 << 20,
        multiprocessors: 132,
        pci_bus_id: format!(
            "0000{:04X}:{:02X}:00.0",
            (0x18 + minor) / 256,
            (0x18 + minor) % 256
        ),
        pcie_root: Some(format!("pci0000:{:02x}", minor / 2)),
        numa_node: Some(minor / 4),
        nvlink_peers: Vec::new(),
        nvlink_domain: Some("nvl-0".into()),
        mig_enabled: false,
        mig_devices: Vec::new(),
        mig_catalog: None,
        dynamic_mig: false,
    }
}

fn mig(profile: &str, start: u32, size: u32, gi: u32) -> MigDevice {
    MigDevice {
        profile: profile.into(),
        placement: MigPlacement { start, size },
        gi_id: gi,
        ci_id: 0,
        uuid: format!("MIG-{gi}-{start}"),
        memory_bytes: 9_856 << 20,
        multiprocessors: 14,
        gi_cap_minor: 10 + gi,
        ci_cap_minor: 11 + gi,
    }
}

fn inventory(gpus: Vec<Gpu>) -> Inventory {
    Inventory {
        driver_version: "570.124.06".into(),
        cuda_driver_version: Some("12.8".into()),
        gpus,
    }
}

fn mig_gpu(minor: u32) -> Gpu {
    let mut parent = gpu(minor);
    parent.product_name = "NVIDIA A100-SXM4-40GB".into();
    parent.nvlink_domain = None;
    parent.mig_enabled = true;
    parent.mig_devices = vec![
        mig("3g.20gb", 4, 4, 2),
        mig("1g.5gb", 0, 1, 9),
        mig("1g.5gb+me", 1, 1, 10),
    ];
    parent
}

fn slices(inventory: &Inventory) -> Vec<ResourceSliceSpec> {
    resource_slices(inventory, DRIVER, NODE).expect("publishable")
}

fn all_devices(slices: &[ResourceSliceSpec]) -> Vec<&Device> {
    slices
        .iter()
        .flat_map(|s| s.devices.iter().flatten())
        .collect()
}

fn attribute<'a>(device: &'a Device, name: &str) -> &'a DeviceAttribute {
    device_attribute(device, DRIVER, name)
        .unwrap_or_else(|| panic!("{} has no {name}", device.name))
}

fn string(device: &Device, name: &str) -> String {
    attribute(device, name).string.clone().unwrap_or_default()
}

fn version(device: &Device, name: &str) -> String {
    attribute(device, name).version.clone().unwrap_or_default()
}

fn int(device: &Device, name: &str) -> i64 {
    attribute(device, name).int.unwrap_or(-1)
}

/// Every API limit a published slice must respect.
fn assert_within_limits(slices: &[ResourceSliceSpec]) {
    let count = i64::try_from(slices.len()).unwrap_or(0);
    let mut names = BTreeSet::new();
    for slice in slices {
        assert_eq!(slice.driver, DRIVER);
        assert_eq!(slice.node_name.as_deref(), Some(NODE));
        assert_eq!(slice.pool.name, NODE);
        assert_eq!(slice.pool.resource_slice_count, count);
        let devices = slice.devices.as_deref().unwrap_or_default();
        assert!(devices.len() <= MAX_DEVICES_PER_SLICE);
        for device in devices {
            assert!(is_dns_label(&device.name), "{}", device.name);
            assert!(
                names.insert(device.name.clone()),
                "duplicate {}",
                device.name
            );
            let attributes = device.attributes.as_ref().expect("attributes");
            let capacity = device.capacity.as_ref().expect("capacity");
            // Room is left for the allocator attribute the kubelet plugin adds.
            assert!(
                attributes.len() + capacity.len() + ATTRIBUTES_ADDED_LATER
                    <= MAX_ATTRIBUTES_AND_CAPACITIES
            );
            assert!(!attributes.contains_key(attributes::ALLOCATOR));
            for (name, value) in attributes {
                assert!(is_qualified_name(name), "{name}");
                let set = [
                    value.string.is_some(),
                    value.version.is_some(),
                    value.int.is_some(),
                    value.bool.is_some(),
                ];
                assert_eq!(
                    set.iter().filter(|s| **s).count(),
                    1,
                    "{name} has exactly one value"
                );
                for text in [&value.string, &value.version].into_iter().flatten() {
                    assert!(text.len() <= MAX_ATTRIBUTE_VALUE_LEN, "{name}={text}");
                }
                if let Some(version) = &value.version {
                    assert_eq!(
                        semver(version).as_deref(),
                        Some(version.as_str()),
                        "{name} is strict semver"
                    );
                }
            }
            for (name, value) in capacity {
                assert!(is_qualified_name(name), "{name}");
                assert!(
                    crate::quantity::quantity_bytes(&value.value).is_ok(),
                    "{name}={:?}",
                    value.value
                );
            }
        }
    }
}

#[test]
fn whole_gpus_get_every_attribute() {
    let published = slices(&inventory(vec![gpu(1), gpu(0)]));
    assert_eq!(published.len(), 1);
    assert_within_limits(&published);
    let devices = all_devices(&published);
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["gpu-0", "gpu-1"], "ordered by minor");

    let device = devices[1];
    assert_eq!(string(device, attributes::TYPE), "gpu");
    assert_eq!(
        string(device, attributes::UUID),
        "GPU-8d4b4a36-0000-4000-8000-000000000001"
    );
    assert_eq!(
        string(device, attributes::PRODUCT_NAME),
        "NVIDIA H100 80GB HBM3"
    );
    assert_eq!(string(device, attributes::BRAND), "Nvidia");
    assert_eq!(string(device, attributes::ARCHITECTURE), "Hopper");
    assert_eq!(
        version(device, attributes::CUDA_COMPUTE_CAPABILITY),
        "9.0.0"
    );
    assert_eq!(version(device, attributes::DRIVER_VERSION), "570.124.6");
    assert_eq!(version(device, attributes::CUDA_DRIVER_VERSION), "12.8.0");
    assert_eq!(int(device, attributes::INDEX), 1);
    assert_eq!(int(device, attributes::MINOR), 1);
    assert_eq!(string(device, attributes::NVLINK_DOMAIN), "nvl-0");
    assert_eq!(int(device, attributes::NUMA_NODE), 0);
    assert_eq!(string(device, attributes::PCIE_ROOT), "pci0000:00");
    assert_eq!(string(device, attributes::PCI_BUS_ID), "0000:19:00.0");
    assert_eq!(
        device_capacity(device, DRIVER, capacities::MEMORY),
        Some(&Quantity("81559Mi".into()))
    );
    assert_eq!(
        device_capacity(device, DRIVER, capacities::MULTIPROCESSORS),
        Some(&Quantity("132".into()))
    );
    for mig_only in [
        attributes::PROFILE,
        attributes::PARENT_UUID,
        attributes::PARENT_MINOR,
    ] {
        assert!(
            device_attribute(device, DRIVER, mig_only).is_none(),
            "{mig_only}"
        );
    }
}

#[test]
fn optional_attributes_are_left_out_when_unknown() {
    let mut bare = gpu(0);
    bare.numa_node = None;
    bare.nvlink_domain = None;
    bare.pcie_root = None;
    let mut inventory = inventory(vec![bare]);
    inventory.cuda_driver_version = None;
    let published = slices(&inventory);
    let device = all_devices(&published)[0];
    for absent in [
        attributes::NUMA_NODE,
        attributes::NVLINK_DOMAIN,
        attributes::PCIE_ROOT,
        attributes::CUDA_DRIVER_VERSION,
    ] {
        assert!(
            device_attribute(device, DRIVER, absent).is_none(),
            "{absent}"
        );
    }
    assert_eq!(string(device, attributes::PCI_BUS_ID), "0000:18:00.0");
}

#[test]
fn mig_devices_replace_their_parent() {
    let published = slices(&inventory(vec![mig_gpu(0), gpu(1)]));
    assert_within_limits(&published);
    let devices = all_devices(&published);
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "gpu-0-mig-1g-5gb-0",
            "gpu-0-mig-1g-5gb-me-1",
            "gpu-0-mig-3g-20gb-4",
            "gpu-1"
        ],
        "MIG devices by placement, the MIG-enabled parent itself not published"
    );
    let device = devices[2];
    assert_eq!(string(device, attributes::TYPE), "mig");
    assert_eq!(string(device, attributes::UUID), "MIG-2-4");
    assert_eq!(string(device, attributes::PROFILE), "3g.20gb");
    assert_eq!(
        string(device, attributes::PARENT_UUID),
        "GPU-8d4b4a36-0000-4000-8000-000000000000"
    );
    assert_eq!(int(device, attributes::PARENT_MINOR), 0);
    assert_eq!(int(device, attributes::PLACEMENT_START), 4);
    assert_eq!(int(device, attributes::PLACEMENT_SIZE), 4);
    assert_eq!(
        string(device, attributes::PRODUCT_NAME),
        "NVIDIA A100-SXM4-40GB"
    );
    assert_eq!(string(device, attributes::PCIE_ROOT), "pci0000:00");
    assert!(
        device_attribute(device, DRIVER, attributes::PCI_BUS_ID).is_none(),
        "a MIG device is not a PCI device"
    );
    assert!(device_attribute(device, DRIVER, attributes::MINOR).is_none());
    assert_eq!(
        device_capacity(device, DRIVER, capacities::MEMORY),
        Some(&Quantity("9856Mi".into()))
    );
    assert_eq!(
        device_capacity(device, DRIVER, capacities::MULTIPROCESSORS),
        Some(&Quantity("14".into()))
    );
}

#[test]
fn two_hundred_gpus_split_into_two_slices() {
    let published = slices(&inventory((0..200).map(gpu).collect()));
    assert_eq!(published.len(), 2);
    assert_within_limits(&published);
    let counts: Vec<usize> = published
        .iter()
        .map(|s| s.devices.as_deref().unwrap_or_default().len())
        .collect();
    assert_eq!(counts, [128, 72]);
    assert!(published.iter().all(|s| s.pool.resource_slice_count == 2));
    assert_eq!(
        published[1]
            .devices
            .as_deref()
            .and_then(|d| d.first())
            .map(|d| d.name.as_str()),
        Some("gpu-128")
    );
}

#[test]
fn slices_that_may_carry_taints_hold_at_most_64_devices() {
    let gpus = inventory((0..130).map(gpu).collect());
    let published = resource_slices_chunked(
        &gpus,
        DRIVER,
        NODE,
        taints::MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    )
    .unwrap();
    let counts: Vec<usize> = published
        .iter()
        .map(|s| s.devices.as_deref().unwrap_or_default().len())
        .collect();
    assert_eq!(counts, [64, 64, 2]);
    assert!(published.iter().all(|s| s.pool.resource_slice_count == 3));
    for bad in [0, MAX_DEVICES_PER_SLICE + 1] {
        let err = resource_slices_chunked(&gpus, DRIVER, NODE, bad).unwrap_err();
        assert!(err.to_string().contains(&bad.to_string()), "{err}");
    }
}

#[test]
fn exactly_128_devices_fit_one_slice() {
    let published = slices(&inventory((0..128).map(gpu).collect()));
    assert_eq!(published.len(), 1);
    assert_within_limits(&published);
}

#[test]
fn an_empty_inventory_publishes_one_empty_slice() {
    let published = slices(&inventory(Vec::new()));
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].pool.resource_slice_count, 1);
    assert_eq!(
        published[0].devices.as_deref().map(<[Device]>::len),
        Some(0)
    );
}

#[test]
fn output_is_deterministic() {
    let forward = inventory((0..10).map(gpu).collect());
    let mut reversed = forward.clone();
    reversed.gpus.reverse();
    assert_eq!(slices(&forward), slices(&reversed));
}

#[test]
fn mock_profiles_are_publishable() {
    for name in kerf_core::mock::profile_names() {
        let inventory = kerf_core::mock::from_spec(name).expect("mock profile");
        let published = slices(&inventory);
        assert_within_limits(&published);
        let published_count = all_devices(&published).len();
        // A GPU in MIG mode is never published whole: a dynamic-MIG GPU without partitionable
        // devices publishes nothing, a static one its MIG devices.
        let expected: usize = inventory
            .gpus
            .iter()
            .map(|g| match (g.mig_enabled, g.dynamic_mig) {
                (false, _) => 1,
                (true, true) => 0,
                (true, false) => g.mig_devices.len(),
            })
            .sum();
        assert_eq!(published_count, expected, "{name}");
    }
    let h100 = kerf_core::mock::from_spec("h100-sxm-80gb").expect("mock profile");
    let published = slices(&h100);
    let devices = all_devices(&published);
    assert_eq!(devices.len(), 8);
    assert!(devices.iter().all(|d| string(d, attributes::TYPE) == "gpu"));
}

fn error(inventory: &Inventory) -> String {
    match resource_slices(inventory, DRIVER, NODE) {
        Ok(slices) => panic!("expected an error, got {slices:?}"),
        Err(e) => {
            assert_eq!(e.reason(), "invalid_resource_slice");
            e.to_string()
        }
    }
}

#[test]
fn too_long_strings_are_refused_not_published() {
    let mut long = gpu(0);
    long.product_name = "N".repeat(65);
    let message = error(&inventory(vec![long]));
    assert!(
        message.contains("devices[\"gpu-0\"].attributes[\"productName\"]"),
        "{message}"
    );
    assert!(message.contains("65 bytes"), "{message}");

    let mut exact = gpu(0);
    exact.product_name = "N".repeat(64);
    assert_within_limits(&slices(&inventory(vec![exact])));
}

#[test]
fn bad_versions_and_bus_ids_are_refused() {
    let mut odd = inventory(vec![gpu(0)]);
    odd.driver_version = "570.124.06-beta".into();
    assert!(error(&odd).contains("\"570.124.06-beta\""));

    let mut bus = gpu(0);
    bus.pci_bus_id = "1b:00.0".into();
    assert!(error(&inventory(vec![bus])).contains("\"1b:00.0\""));
}

#[test]
fn duplicate_device_names_are_refused() {
    let message = error(&inventory(vec![gpu(3), gpu(3)]));
    assert!(message.contains("gpu-3"), "{message}");
}

#[test]
fn bad_driver_or_node_names_are_refused() {
    let inventory = inventory(vec![gpu(0)]);
    assert!(resource_slices(&inventory, "GPU_DRIVER", NODE).is_err());
    assert!(resource_slices(&inventory, &format!("{}.example.com", "d".repeat(60)), NODE).is_err());
    assert!(resource_slices(&inventory, DRIVER, "Node_1").is_err());
    assert!(resource_slices(&inventory, DRIVER, "").is_err());
}

#[test]
fn the_count_check_leaves_room_for_the_allocator_attribute() {
    let named = |count: usize| -> BTreeMap<String, DeviceAttribute> {
        (0..count)
            .map(|i| (format!("a{i}"), DeviceAttribute::default()))
            .collect()
    };
    let capacity = BTreeMap::new();
    let fits = MAX_ATTRIBUTES_AND_CAPACITIES - 1;
    assert!(check_names_and_count("devices[0]", &named(fits), &capacity).is_ok());
    let err = check_names_and_count("devices[0]", &named(fits + 1), &capacity)
        .unwrap_err()
        .to_string();
    assert!(err.contains("allocator"), "{err}");

    // With the allocator set, every device of every profile is within the API's limit.
    for profile in ["h100-sxm-80gb", "a100-40gb-mig", "l4"] {
        let inventory = kerf_core::mock::from_spec(profile).expect("mock profile");
        let mut specs = slices(&inventory);
        let record = crate::ownership::OwnershipRecord(
            all_devices(&specs)
                .iter()
                .map(|d| (d.name.clone(), crate::ownership::Owner::Scheduler))
                .collect(),
        );
        crate::ownership::publish_owners(&mut specs, &record);
        for device in all_devices(&specs) {
            let attributes = device.attributes.as_ref().map_or(0, BTreeMap::len);
            let capacity = device.capacity.as_ref().map_or(0, BTreeMap::len);
            assert!(attributes + capacity <= MAX_ATTRIBUTES_AND_CAPACITIES);
            assert!(
                device
                    .attributes
                    .as_ref()
                    .is_some_and(|a| a.contains_key(attributes::ALLOCATOR))
            );
        }
    }
}

#[test]
fn every_published_name_is_a_valid_qualified_name() {
    for name in attributes::ALL.iter().chain(capacities::ALL.iter()) {
        assert!(is_qualified_name(name), "{name}");
    }
    assert!(!is_qualified_name("a".repeat(33).as_str()));
    assert!(!is_qualified_name("1abc"));
    assert!(!is_qualified_name("Bad_Domain/abc"));
    assert!(is_qualified_name("resource.kubernetes.io/pcieRoot"));
}

#[test]
fn versions_become_semver() {
    assert_eq!(semver("570.124.06").as_deref(), Some("570.124.6"));
    assert_eq!(semver("12.8").as_deref(), Some("12.8.0"));
    assert_eq!(semver("550").as_deref(), Some("550.0.0"));
    assert_eq!(semver("9.0").as_deref(), Some("9.0.0"));
    for bad in [
        "",
        "1.2.3.4",
        "v1.2",
        "1..2",
        "1.2.x",
        "1.-2",
        "99999999999999999999999",
    ] {
        assert_eq!(semver(bad), None, "{bad}");
    }
}

#[test]
fn pci_bus_ids_take_the_standard_form() {
    assert_eq!(
        pci_bus_id("00000000:1B:00.0").as_deref(),
        Some("0000:1b:00.0")
    );
    assert_eq!(pci_bus_id("0000:1b:00.0").as_deref(), Some("0000:1b:00.0"));
    assert_eq!(pci_bus_id("0001:C1:1F.7").as_deref(), Some("0001:c1:1f.7"));
    for bad in [
        "",
        "1b:00.0",
        "0000:1b:00",
        "0000:1b:0.0",
        "00010000:1b:00.0",
        "+000:1b:00.0",
        "0000:1g:00.0",
    ] {
        assert_eq!(pci_bus_id(bad), None, "{bad}");
    }
}

#[test]
fn slice_names_are_plain_when_they_can_be() {
    assert_eq!(
        slice_name("node-1", "gpu.kerf.dev", 0),
        "node-1-gpu.kerf.dev-0"
    );
    assert_eq!(
        slice_name("node-1", "gpu.kerf.dev", 12),
        "node-1-gpu.kerf.dev-12"
    );
    assert_eq!(
        slice_name("ip-10-0-0-1.ec2.internal", "gpu.kerf.dev", 1),
        "ip-10-0-0-1.ec2.internal-gpu.kerf.dev-1"
    );
}

#[test]
fn long_node_names_get_a_hashed_slice_name() {
    let node = format!("{}.example.com", "n".repeat(240));
    let name = slice_name(&node, DRIVER, 3);
    assert!(name.len() <= MAX_NAME_LEN);
    assert!(is_dns_subdomain(&name), "{name}");
    assert!(name.ends_with("-3"));
    assert_ne!(
        name,
        slice_name(&format!("{}.example.org", "n".repeat(240)), DRIVER, 3)
    );
}

proptest! {
    #[test]
    fn slice_names_are_valid_deterministic_and_distinct(
        node in "[a-zA-Z0-9._-]{0,300}",
        driver in "[a-z0-9.-]{0,70}",
        index in 0usize..10_000,
    ) {
        let name = slice_name(&node, &driver, index);
        prop_assert!(is_dns_subdomain(&name), "{}", name);
        prop_assert!(name.len() <= MAX_NAME_LEN);
        prop_assert_eq!(&name, &slice_name(&node, &driver, index));
        prop_assert_ne!(&name, &slice_name(&node, &driver, index + 1));
        let suffix = format!("-{index}");
        prop_assert!(name.ends_with(&suffix));
    }

    #[test]
    fn valid_node_names_keep_their_plain_slice_name(node in "[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?") {
        prop_assert_eq!(slice_name(&node, DRIVER, 0), format!("{node}-{DRIVER}-0"));
    }

    #[test]
    fn random_inventories_publish_within_limits_or_fail_cleanly(
        count in 0u32..300,
        product in "[ -~]{1,80}",
        architecture in "[A-Za-z]{1,70}",
        driver_version in "[0-9]{1,4}(\\.[0-9]{1,4}){0,3}",
        numa in proptest::option::of(0u32..8),
        domain in proptest::option::of("[a-z0-9-]{1,70}"),
    ) {
        let gpus = (0..count)
            .map(|minor| {
                let mut g = gpu(minor);
                g.product_name.clone_from(&product);
                g.architecture.clone_from(&architecture);
                g.numa_node = numa;
                g.nvlink_domain.clone_from(&domain);
                g
            })
            .collect();
        let mut inventory = inventory(gpus);
        inventory.driver_version = driver_version.clone();
        let too_long = count > 0
            && (product.len() > 64 || architecture.len() > 64 || domain.as_ref().is_some_and(|d| d.len() > 64));
        let bad_version = count > 0 && driver_version.split('.').count() > 3;
        match resource_slices(&inventory, DRIVER, NODE) {
            Ok(published) => {
                prop_assert!(!too_long && !bad_version);
                prop_assert_eq!(published.len(), usize::try_from(count).unwrap_or(0).div_ceil(MAX_DEVICES_PER_SLICE).max(1));
                assert_within_limits(&published);
            }
            Err(e) => {
                prop_assert!(too_long || bad_version, "{}", e);
                prop_assert_eq!(e.reason(), "invalid_resource_slice");
            }
        }
    }
}
