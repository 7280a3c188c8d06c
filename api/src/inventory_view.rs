//! The controller's inventory: the whole GPUs of each node, read back from kerf's published
//! ResourceSlices.
//!
//! Only this driver's slices count, and of each pool only the slices of its highest
//! `pool.generation` (older ones are left over from a republish in progress). Attribute names
//! are looked up bare (the driver's domain) and driver-qualified. MIG devices are skipped
//! silently: the scheduler allocates them. So are the devices of dynamic MIG: a
//! counters-only slice (`sharedCounters`, no devices), and every device that consumes counters
//! — the MIG placements and their GPU's full device, which kube-scheduler allocates against
//! the shared counters the controller does not account for. A GPU published as shareable
//! (`allowMultipleAllocations: true`, scheduler slices) is kube-scheduler's: it is read into
//! [`InventoryView::shared`], never into the placement candidates of
//! [`InventoryView::nodes`]. A device that cannot be read is skipped with a
//! reason rather than failing the whole view, because one bad device must not stop
//! allocation on every other node.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::DeviceAttribute;
use kerf_core::alloc::{self, GpuInfo, NodeGpus};
use kerf_core::inventory::ComputeCapability;

use crate::quantity;
use crate::resourceslice::{
    DeviceFields, ResourceSliceFields, TYPE_GPU, TYPE_MIG, attributes, capacities, device_attribute,
};

/// The nodes' GPUs and the devices that were left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InventoryView {
    /// Per node, its whole GPUs sorted by device name. A node whose slices list no whole GPU
    /// (only MIG devices, or none) is present with an empty list.
    pub nodes: BTreeMap<String, NodeGpus>,
    /// Per node, the GPUs published as shareable (kube-scheduler allocates shares of them),
    /// sorted by device name: not placement candidates of the controller.
    pub shared: BTreeMap<String, Vec<GpuInfo>>,
    /// Devices of this driver that could not be read.
    pub skipped: Vec<SkippedDevice>,
}

/// A published device the view left out, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedDevice {
    /// Name of the ResourceSlice that lists it.
    pub slice: String,
    /// Its pool.
    pub pool: String,
    /// Its name.
    pub device: String,
    /// What is wrong, naming the field and value.
    pub reason: String,
}

/// The whole GPUs per node published by `driver`; see [`inventory_view`], which also reports
/// the devices left out.
pub fn node_gpus_from_slices<S: ResourceSliceFields>(
    slices: &[S],
    driver: &str,
) -> BTreeMap<String, NodeGpus> {
    inventory_view(slices, driver).nodes
}

/// Reads the whole GPUs of every node from `driver`'s ResourceSlices.
///
/// Slices that are not node-local (no `spec.nodeName`) cannot hold kerf GPUs and have their
/// devices skipped. Devices must have `type: gpu`, `uuid`, `productName`,
/// `cudaComputeCapability` and the capacities `memory` and `multiprocessors`; `nvlinkDomain`,
/// `numaNode` and `resource.kubernetes.io/pcieRoot` are optional. A device name seen twice on
/// one node keeps its first occurrence (in slice-name order).
pub fn inventory_view<S: ResourceSliceFields>(slices: &[S], driver: &str) -> InventoryView {
    let ours: Vec<&S> = slices.iter().filter(|s| s.driver() == driver).collect();
    let mut newest: BTreeMap<&str, i64> = BTreeMap::new();
    for &slice in &ours {
        let pool = slice.pool();
        let generation = newest.entry(pool.name.as_str()).or_insert(i64::MIN);
        *generation = (*generation).max(pool.generation);
    }
    let mut current: Vec<&S> = ours
        .into_iter()
        .filter(|s| newest.get(s.pool().name.as_str()) == Some(&s.pool().generation))
        .collect();
    current.sort_by(|a, b| a.slice_name().cmp(b.slice_name()));

    let mut view = InventoryView::default();
    let mut seen: BTreeSet<(String, String)> = BTreeSet::new();
    for slice in current {
        read_slice(slice, driver, &mut view, &mut seen);
    }
    for node in view.nodes.values_mut() {
        node.gpus.sort_by(|a, b| a.device.cmp(&b.device));
    }
    for gpus in view.shared.values_mut() {
        gpus.sort_by(|a, b| a.device.cmp(&b.device));
    }
    view
}

fn read_slice<S: ResourceSliceFields>(
    slice: &S,
    driver: &str,
    view: &mut InventoryView,
    seen: &mut BTreeSet<(String, String)>,
) {
    let devices = slice.devices();
    if devices.is_empty() && slice.has_shared_counters() {
        // A counters-only slice of a dynamic-MIG pool: nothing to place on.
        return;
    }
    let skip = |device: &S::Device, reason: String| SkippedDevice {
        slice: slice.slice_name().to_owned(),
        pool: slice.pool().name.clone(),
        device: device.device_name().to_owned(),
        reason,
    };
    let Some(node) = slice.node_name().filter(|n| !n.is_empty()) else {
        view.skipped.extend(devices.iter().map(|device| {
            skip(
                device,
                "the slice is not node-local (spec.nodeName is not set)".to_owned(),
            )
        }));
        return;
    };
    let entry = view
        .nodes
        .entry(node.to_owned())
        .or_insert_with(|| NodeGpus {
            node: node.to_owned(),
            gpus: Vec::new(),
        });
    for device in devices {
        if device.consumes_counters() {
            continue;
        }
        match read_device(device, driver) {
            Ok(None) => {}
            Ok(Some(gpu)) => {
                if !seen.insert((node.to_owned(), gpu.device.clone())) {
                    view.skipped.push(skip(
                        device,
                        format!(
                            "device name {:?} is published twice for node {node:?}",
                            device.device_name()
                        ),
                    ));
                } else if device.allows_multiple_allocations() {
                    view.shared.entry(node.to_owned()).or_default().push(gpu);
                } else {
                    entry.gpus.push(gpu);
                }
            }
            Err(reason) => view.skipped.push(skip(device, reason)),
        }
    }
}

/// A whole GPU, `None` for a MIG device, or why the device cannot be read.
fn read_device<D: DeviceFields>(device: &D, driver: &str) -> Result<Option<GpuInfo>, String> {
    let attr = |name: &str| device_attribute(device, driver, name);
    match string(attr(attributes::TYPE), attributes::TYPE)? {
        Some(TYPE_GPU) => {}
        Some(TYPE_MIG) => return Ok(None),
        Some(other) => {
            return Err(format!(
                "attributes[\"type\"]: {other:?} is neither {TYPE_GPU:?} nor {TYPE_MIG:?}"
            ));
        }
        None => return Err("attributes[\"type\"]: missing".to_owned()),
    }
    let required = |name: &str| -> Result<String, String> {
        string(attr(name), name)?
            .map(str::to_owned)
            .ok_or_else(|| format!("attributes[{name:?}]: missing"))
    };
    let optional = |name: &str| -> Result<Option<String>, String> {
        Ok(string(attr(name), name)?.map(str::to_owned))
    };
    Ok(Some(GpuInfo {
        device: device.device_name().to_owned(),
        uuid: required(attributes::UUID)?,
        product: required(attributes::PRODUCT_NAME)?,
        memory_bytes: memory(device, driver)?,
        multiprocessors: multiprocessors(device, driver)?,
        compute_capability: compute_capability(attr(attributes::CUDA_COMPUTE_CAPABILITY))?,
        nvlink_domain: optional(attributes::NVLINK_DOMAIN)?,
        pcie_root: optional(attributes::PCIE_ROOT)?,
        numa: numa_node(attr(attributes::NUMA_NODE))?,
        taints: device_taints(device),
    }))
}

/// The device's taints. An effect kerf does not know is left out: kube-scheduler's allocator
/// (`allocator_stable.go`, `taintPreventsAllocation`) lets only `NoSchedule` and `NoExecute`
/// keep a device from a request, so an unknown effect blocks nothing there either.
pub fn device_taints<D: DeviceFields>(device: &D) -> Vec<alloc::DeviceTaint> {
    device
        .device_taints()
        .iter()
        .filter_map(|taint| {
            Some(alloc::DeviceTaint {
                key: taint.key.clone(),
                value: taint.value.clone().unwrap_or_default(),
                effect: taint.effect.parse().ok()?,
            })
        })
        .collect()
}

/// The string value of an attribute, `None` when absent, an error when of another type.
fn string<'a>(value: Option<&'a DeviceAttribute>, name: &str) -> Result<Option<&'a str>, String> {
    match value {
        None => Ok(None),
        Some(DeviceAttribute {
            string: Some(text), ..
        }) => Ok(Some(text)),
        Some(other) => Err(format!(
            "attributes[{name:?}]: expected a string, got {}",
            describe(other)
        )),
    }
}

fn compute_capability(value: Option<&DeviceAttribute>) -> Result<ComputeCapability, String> {
    let name = attributes::CUDA_COMPUTE_CAPABILITY;
    let version = match value {
        None => return Err(format!("attributes[{name:?}]: missing")),
        Some(DeviceAttribute {
            version: Some(version),
            ..
        }) => version,
        Some(other) => {
            return Err(format!(
                "attributes[{name:?}]: expected a version, got {}",
                describe(other)
            ));
        }
    };
    let mut parts = version.split(['.', '-', '+']);
    let mut number = || parts.next().and_then(|p| p.parse::<u32>().ok());
    match (number(), number()) {
        (Some(major), Some(minor)) => Ok(ComputeCapability { major, minor }),
        _ => Err(format!(
            "attributes[{name:?}]: {version:?} is not a version of the form major.minor.patch"
        )),
    }
}

fn numa_node(value: Option<&DeviceAttribute>) -> Result<Option<u32>, String> {
    let name = attributes::NUMA_NODE;
    match value {
        None => Ok(None),
        Some(DeviceAttribute { int: Some(n), .. }) => u32::try_from(*n)
            .map(Some)
            .map_err(|_| format!("attributes[{name:?}]: {n} is not a NUMA node number")),
        Some(other) => Err(format!(
            "attributes[{name:?}]: expected an int, got {}",
            describe(other)
        )),
    }
}

fn capacity<'a, D: DeviceFields>(
    device: &'a D,
    driver: &str,
    name: &str,
) -> Result<&'a str, String> {
    crate::resourceslice::device_capacity(device, driver, name)
        .map(|q| q.0.as_str())
        .ok_or_else(|| format!("capacity[{name:?}]: missing"))
}

fn memory<D: DeviceFields>(device: &D, driver: &str) -> Result<u64, String> {
    let text = capacity(device, driver, capacities::MEMORY)?;
    quantity::parse_bytes(text).map_err(|e| format!("capacity[{:?}]: {e}", capacities::MEMORY))
}

fn multiprocessors<D: DeviceFields>(device: &D, driver: &str) -> Result<u32, String> {
    let name = capacities::MULTIPROCESSORS;
    let text = capacity(device, driver, name)?;
    quantity::parse_bytes(text)
        .ok()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| format!("capacity[{name:?}]: {text:?} is not a positive whole number"))
}

fn describe(value: &DeviceAttribute) -> String {
    match value {
        DeviceAttribute { int: Some(n), .. } => format!("int {n}"),
        DeviceAttribute { bool: Some(b), .. } => format!("bool {b}"),
        DeviceAttribute {
            string: Some(s), ..
        } => format!("string {s:?}"),
        DeviceAttribute {
            version: Some(v), ..
        } => format!("version {v:?}"),
        _ => "an empty value".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::{
        Device, DeviceCapacity, ResourcePool, ResourceSlice, ResourceSliceSpec,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kerf_core::mock;

    use super::*;
    use crate::resource_slices;

    const DRIVER: &str = "gpu.kerf.dev";

    fn slice(name: &str, spec: ResourceSliceSpec) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            spec,
        }
    }

    /// What the kubelet plugin publishes for a mock profile on `node`.
    fn published(profile: &str, node: &str, generation: i64) -> Vec<ResourceSlice> {
        let inventory = mock::from_spec(profile).unwrap();
        resource_slices(&inventory, DRIVER, node)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(i, mut spec)| {
                spec.pool.generation = generation;
                slice(&format!("{node}-{i}"), spec)
            })
            .collect()
    }

    fn string(value: &str) -> DeviceAttribute {
        DeviceAttribute {
            string: Some(value.to_owned()),
            ..DeviceAttribute::default()
        }
    }

    /// A minimal whole GPU with the required attributes only.
    fn bare_gpu(name: &str) -> Device {
        Device {
            name: name.to_owned(),
            attributes: Some(BTreeMap::from([
                ("type".to_owned(), string("gpu")),
                ("uuid".to_owned(), string(&format!("GPU-{name}"))),
                ("productName".to_owned(), string("NVIDIA L4")),
                (
                    "cudaComputeCapability".to_owned(),
                    DeviceAttribute {
                        version: Some("8.9.0".to_owned()),
                        ..DeviceAttribute::default()
                    },
                ),
            ])),
            capacity: Some(BTreeMap::from([
                ("memory".to_owned(), cap("23034Mi")),
                ("multiprocessors".to_owned(), cap("58")),
            ])),
            ..Device::default()
        }
    }

    fn cap(value: &str) -> DeviceCapacity {
        DeviceCapacity {
            value: Quantity(value.to_owned()),
            request_policy: None,
        }
    }

    fn node_slice(name: &str, node: &str, generation: i64, devices: Vec<Device>) -> ResourceSlice {
        slice(
            name,
            ResourceSliceSpec {
                driver: DRIVER.to_owned(),
                node_name: Some(node.to_owned()),
                pool: ResourcePool {
                    name: node.to_owned(),
                    generation,
                    resource_slice_count: 1,
                },
                devices: Some(devices),
                ..ResourceSliceSpec::default()
            },
        )
    }

    #[test]
    fn reads_back_what_the_plugin_publishes() {
        for profile in ["h100-sxm-80gb", "a100-40gb-mig", "l4", "h100-sxm-80gb:20"] {
            let view = inventory_view(&published(profile, "node-1", 3), DRIVER);
            assert!(view.skipped.is_empty(), "{profile}: {:?}", view.skipped);
            let mut expected =
                NodeGpus::from_inventory("node-1", &mock::from_spec(profile).unwrap());
            expected.gpus.sort_by(|a, b| a.device.cmp(&b.device));
            assert_eq!(view.nodes.len(), 1);
            assert_eq!(view.nodes["node-1"], expected, "{profile}");
        }
    }

    #[test]
    fn mig_devices_are_left_to_the_scheduler() {
        let nodes = node_gpus_from_slices(&published("a100-40gb-mig", "node-1", 1), DRIVER);
        let devices: Vec<&str> = nodes["node-1"]
            .gpus
            .iter()
            .map(|g| g.device.as_str())
            .collect();
        assert_eq!(devices, ["gpu-2", "gpu-3"]);
    }

    #[test]
    fn other_drivers_and_older_generations_are_ignored() {
        let mut slices = published("l4", "node-1", 2);
        slices.extend(published("h100-sxm-80gb", "node-1", 1));
        let mut foreign = published("h100-sxm-80gb", "node-2", 5);
        for s in &mut foreign {
            s.spec.driver = "other.example.com".to_owned();
        }
        slices.extend(foreign);
        let nodes = node_gpus_from_slices(&slices, DRIVER);
        assert_eq!(nodes.keys().collect::<Vec<_>>(), ["node-1"]);
        assert_eq!(
            nodes["node-1"].gpus.len(),
            2,
            "only generation 2 (the L4s) counts"
        );
        assert_eq!(nodes["node-1"].gpus[0].product, "NVIDIA L4");
    }

    #[test]
    fn devices_of_several_slices_of_a_pool_are_merged_and_sorted() {
        let slices = vec![
            node_slice("b", "node-1", 0, vec![bare_gpu("gpu-1")]),
            node_slice("a", "node-1", 0, vec![bare_gpu("gpu-0"), bare_gpu("gpu-2")]),
        ];
        let nodes = node_gpus_from_slices(&slices, DRIVER);
        let devices: Vec<&str> = nodes["node-1"]
            .gpus
            .iter()
            .map(|g| g.device.as_str())
            .collect();
        assert_eq!(devices, ["gpu-0", "gpu-1", "gpu-2"]);
    }

    #[test]
    fn optional_attributes_may_be_missing_and_names_may_be_qualified() {
        let mut device = bare_gpu("gpu-0");
        let attributes = device.attributes.as_mut().unwrap();
        let uuid = attributes.remove("uuid").unwrap();
        attributes.insert(format!("{DRIVER}/uuid"), uuid);
        let nodes = node_gpus_from_slices(&[node_slice("a", "node-1", 0, vec![device])], DRIVER);
        assert_eq!(
            nodes["node-1"].gpus,
            [GpuInfo {
                device: "gpu-0".into(),
                uuid: "GPU-gpu-0".into(),
                product: "NVIDIA L4".into(),
                memory_bytes: 23034 << 20,
                multiprocessors: 58,
                compute_capability: ComputeCapability { major: 8, minor: 9 },
                nvlink_domain: None,
                pcie_root: None,
                numa: None,
                taints: Vec::new(),
            }]
        );
    }

    #[test]
    fn device_taints_are_read_and_unknown_effects_left_out() {
        use k8s_openapi::api::resource::v1::DeviceTaint;
        let mut device = bare_gpu("gpu-0");
        device.taints = Some(vec![
            DeviceTaint {
                key: "gpu.kerf.dev/unhealthy".into(),
                value: Some("xid-79".into()),
                effect: "NoExecute".into(),
                time_added: None,
            },
            DeviceTaint {
                key: "example.com/future".into(),
                value: None,
                effect: "SomeFutureEffect".into(),
                time_added: None,
            },
        ]);
        let nodes = node_gpus_from_slices(&[node_slice("a", "node-1", 0, vec![device])], DRIVER);
        assert_eq!(
            nodes["node-1"].gpus[0].taints,
            [alloc::DeviceTaint {
                key: "gpu.kerf.dev/unhealthy".into(),
                value: "xid-79".into(),
                effect: alloc::TaintEffect::NoExecute,
            }]
        );
    }

    #[test]
    fn malformed_devices_are_skipped_with_a_reason() {
        let broken = |name: &str, change: &dyn Fn(&mut Device)| {
            let mut device = bare_gpu(name);
            change(&mut device);
            device
        };
        let devices = vec![
            bare_gpu("gpu-0"),
            broken("gpu-1", &|d| {
                d.attributes.as_mut().unwrap().remove("uuid");
            }),
            broken("gpu-2", &|d| {
                d.capacity
                    .as_mut()
                    .unwrap()
                    .insert("memory".into(), cap("lots"));
            }),
            broken("gpu-3", &|d| {
                d.attributes.as_mut().unwrap().insert(
                    "numaNode".into(),
                    DeviceAttribute {
                        int: Some(-1),
                        ..DeviceAttribute::default()
                    },
                );
            }),
            broken("gpu-4", &|d| {
                d.attributes
                    .as_mut()
                    .unwrap()
                    .insert("type".into(), string("vgpu"));
            }),
            broken("gpu-5", &|d| {
                d.attributes
                    .as_mut()
                    .unwrap()
                    .insert("cudaComputeCapability".into(), string("8.9"));
            }),
            broken("gpu-6", &|d| {
                d.capacity.as_mut().unwrap().remove("multiprocessors");
            }),
            broken("gpu-7", &|d| {
                d.attributes.as_mut().unwrap().remove("type");
            }),
            bare_gpu("gpu-0"),
        ];
        let view = inventory_view(&[node_slice("s", "node-1", 0, devices)], DRIVER);
        let kept: Vec<&str> = view.nodes["node-1"]
            .gpus
            .iter()
            .map(|g| g.device.as_str())
            .collect();
        assert_eq!(kept, ["gpu-0"]);
        let reasons: Vec<(&str, &str)> = view
            .skipped
            .iter()
            .map(|s| (s.device.as_str(), s.reason.as_str()))
            .collect();
        assert_eq!(
            reasons,
            [
                ("gpu-1", "attributes[\"uuid\"]: missing"),
                (
                    "gpu-2",
                    "capacity[\"memory\"]: \"lots\" is not a valid byte quantity: malformed: expected a number with an optional suffix, such as 512Mi, 40Gi, 1.5G or 8e9"
                ),
                (
                    "gpu-3",
                    "attributes[\"numaNode\"]: -1 is not a NUMA node number"
                ),
                (
                    "gpu-4",
                    "attributes[\"type\"]: \"vgpu\" is neither \"gpu\" nor \"mig\""
                ),
                (
                    "gpu-5",
                    "attributes[\"cudaComputeCapability\"]: expected a version, got string \"8.9\""
                ),
                ("gpu-6", "capacity[\"multiprocessors\"]: missing"),
                ("gpu-7", "attributes[\"type\"]: missing"),
                (
                    "gpu-0",
                    "device name \"gpu-0\" is published twice for node \"node-1\""
                ),
            ]
        );
        assert!(
            view.skipped
                .iter()
                .all(|s| s.slice == "s" && s.pool == "node-1")
        );
    }

    #[test]
    fn slices_without_a_node_name_are_skipped() {
        let mut s = node_slice("s", "node-1", 0, vec![bare_gpu("gpu-0")]);
        s.spec.node_name = None;
        s.spec.all_nodes = Some(true);
        let view = inventory_view(&[s], DRIVER);
        assert!(view.nodes.is_empty());
        assert_eq!(view.skipped.len(), 1);
        assert!(view.skipped[0].reason.contains("not node-local"));
    }

    /// The slices the kubelet plugin publishes for 8 dynamic-MIG GPUs with `features`.
    fn dynamic(partitionable: bool) -> Vec<ResourceSlice> {
        let inventory = mock::from_spec("h100-sxm-80gb-dynmig").unwrap();
        let features = crate::resourceslice::ResourceSliceFeatures {
            device_taints: false,
            partitionable_devices: partitionable,
        };
        crate::resourceslice::node_slices(&inventory, DRIVER, "node-1", features)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(i, spec)| slice(&format!("node-1-{i}"), spec))
            .collect()
    }

    #[test]
    fn a_dynamic_mig_pool_gives_the_controller_nothing_to_place_on() {
        let slices = dynamic(true);
        assert!(slices.iter().any(|s| s.spec.shared_counters.is_some()));
        let view = inventory_view(&slices, DRIVER);
        assert!(view.skipped.is_empty(), "{:?}", view.skipped);
        assert_eq!(view.nodes["node-1"].gpus, []);
        assert!(view.shared.is_empty());
        // Without partitionable devices the GPUs, in MIG mode, publish nothing to place on.
        let view = inventory_view(&dynamic(false), DRIVER);
        assert_eq!(view.nodes["node-1"].gpus, []);
    }

    #[test]
    fn a_node_with_an_empty_pool_is_present_without_gpus() {
        let nodes = node_gpus_from_slices(&[node_slice("s", "node-1", 0, Vec::new())], DRIVER);
        assert_eq!(nodes["node-1"].gpus, []);
    }
}
