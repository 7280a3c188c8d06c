//! The node's inventory as `resource.k8s.io/v1` ResourceSlices: one device per whole GPU and
//! per existing MIG device, within the API server's limits; with DRAPartitionableDevices,
//! dynamic-MIG GPUs as counter sets and one device per MIG placement ([`dynamic_mig`]).
//! [`node_slices`] is the one entry point for every combination of API features.
//!
//! Attribute names without a domain are in the driver's domain, so CEL reads them as
//! `device.attributes["gpu.kerf.dev"].productName`; the two standard PCI attributes carry the
//! `resource.kubernetes.io/` prefix.
//!
//! [`resource_slices`] builds every attribute but one: the kubelet plugin adds
//! [`attributes::ALLOCATOR`] afterwards from its Node's ownership record
//! ([`crate::ownership::publish_owners`]), so the attribute count check leaves room for it.

use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, ResourcePool, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_core::inventory::Inventory;

use crate::error::{Error, Result};
use device::published_devices;

mod device;
pub mod dynamic_mig;
pub mod fields;
pub mod limits;
mod pool;
pub mod scheduler_slices;
pub mod taints;

pub use fields::{DeviceFields, SliceFields};
pub use pool::{SliceFeatures, node_slices};

/// Most devices one ResourceSlice may hold (without taints, counters or list attributes).
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Most attributes and capacities one device may have, combined.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// Longest string or version attribute value, in bytes.
pub const MAX_ATTRIBUTE_VALUE_LEN: usize = 64;
/// Longest identifier part of an attribute or capacity name.
pub const MAX_QUALIFIED_NAME_ID_LEN: usize = 32;
/// Longest domain part of an attribute or capacity name, and longest driver name.
pub const MAX_DOMAIN_LEN: usize = 63;
/// Longest device name (a DNS label).
pub const MAX_DEVICE_NAME_LEN: usize = 63;
/// Longest object name (a DNS subdomain), and longest pool name.
pub const MAX_NAME_LEN: usize = 253;

/// Names of the attributes kerf publishes.
pub mod attributes {
    /// `gpu` for a whole GPU, `mig` for a MIG device (string).
    pub const TYPE: &str = "type";
    /// NVML UUID of the device: `GPU-…` or `MIG-…` (string).
    pub const UUID: &str = "uuid";
    /// Product name, e.g. `NVIDIA H100 80GB HBM3` (string).
    pub const PRODUCT_NAME: &str = "productName";
    /// Brand, e.g. `Nvidia` (string).
    pub const BRAND: &str = "brand";
    /// Architecture, e.g. `Hopper` (string).
    pub const ARCHITECTURE: &str = "architecture";
    /// CUDA compute capability as semver, e.g. `9.0.0` (version).
    pub const CUDA_COMPUTE_CAPABILITY: &str = "cudaComputeCapability";
    /// Kernel driver version as semver, e.g. `570.124.6` for `570.124.06` (version).
    pub const DRIVER_VERSION: &str = "driverVersion";
    /// CUDA driver API version as semver, e.g. `12.8.0` (version), when known.
    pub const CUDA_DRIVER_VERSION: &str = "cudaDriverVersion";
    /// NVML index of a whole GPU (int).
    pub const INDEX: &str = "index";
    /// Minor number of a whole GPU (int).
    pub const MINOR: &str = "minor";
    /// NVLink domain of the GPU, when it has one (string).
    pub const NVLINK_DOMAIN: &str = "nvlinkDomain";
    /// NUMA node of the GPU, when known (int).
    pub const NUMA_NODE: &str = "numaNode";
    /// MIG profile, e.g. `1g.10gb` (string).
    pub const PROFILE: &str = "profile";
    /// UUID of a MIG device's parent GPU (string).
    pub const PARENT_UUID: &str = "parentUUID";
    /// Minor number of a MIG device's parent GPU (int).
    pub const PARENT_MINOR: &str = "parentMinor";
    /// First memory slice of a MIG device's placement (int).
    pub const PLACEMENT_START: &str = "placementStart";
    /// Number of memory slices of a MIG device's placement (int).
    pub const PLACEMENT_SIZE: &str = "placementSize";
    /// GPU-instance profile id of a dynamic-MIG placement, what creating its GPU instance
    /// takes (int; `nvidia-smi mig -lgip`'s `ID`, e.g. 19 for `1g.5gb`).
    pub const GI_PROFILE_ID: &str = "giProfileId";
    /// Standard attribute: the PCIe root complex, `pci<domain>:<bus>` (string), when known.
    pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
    /// Standard attribute: PCI address in extended BDF notation, `0000:1b:00.0` (string).
    /// Whole GPUs only: it identifies a PCI device, which a MIG device is not.
    pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
    /// Who may allocate the device, `scheduler` or `controller` (string); absent while the
    /// Node's ownership record does not name the device. Not set by
    /// [`resource_slices`](super::resource_slices): the kubelet plugin sets it from the Node
    /// annotation `gpu.kerf.dev/allocators` that kerf-controller writes
    /// ([`crate::ownership`]).
    pub const ALLOCATOR: &str = crate::ownership::ATTRIBUTE;

    /// Every attribute name kerf may publish.
    pub const ALL: [&str; 21] = [
        TYPE,
        UUID,
        PRODUCT_NAME,
        BRAND,
        ARCHITECTURE,
        CUDA_COMPUTE_CAPABILITY,
        DRIVER_VERSION,
        CUDA_DRIVER_VERSION,
        INDEX,
        MINOR,
        NVLINK_DOMAIN,
        NUMA_NODE,
        PROFILE,
        PARENT_UUID,
        PARENT_MINOR,
        PLACEMENT_START,
        PLACEMENT_SIZE,
        GI_PROFILE_ID,
        PCIE_ROOT,
        PCI_BUS_ID,
        ALLOCATOR,
    ];
}

/// Attributes the kubelet plugin adds to each device after [`resource_slices`] built it:
/// [`attributes::ALLOCATOR`]. The count check reserves room for them, so setting the owner
/// can never push a device over [`MAX_ATTRIBUTES_AND_CAPACITIES`].
const ATTRIBUTES_ADDED_LATER: usize = 1;

/// Names of the capacities kerf publishes.
pub mod capacities {
    /// Device memory in bytes.
    pub const MEMORY: &str = "memory";
    /// Streaming multiprocessors.
    pub const MULTIPROCESSORS: &str = "multiprocessors";

    /// Every capacity name kerf publishes.
    pub const ALL: [&str; 2] = [MEMORY, MULTIPROCESSORS];
}

/// `type` attribute value of a whole GPU.
pub const TYPE_GPU: &str = "gpu";
/// `type` attribute value of a MIG device.
pub const TYPE_MIG: &str = "mig";

/// Builds the ResourceSlice specs that publish `inventory` for `node_name`.
///
/// The pool is named after the node and `spec.nodeName` is the node. Devices are ordered by
/// GPU minor number, then MIG placement, and split into slices of at most
/// [`MAX_DEVICES_PER_SLICE`]; every slice carries the pool's `resourceSliceCount`. An empty
/// inventory gives one empty slice, so consumers see the pool. `pool.generation` is 0: the
/// publisher sets it.
///
/// # Errors
///
/// [`Error::InvalidResourceSlice`] when the driver or node name is invalid, two devices have
/// the same name, a version cannot be written as semver, the PCI bus ID is not in BDF form, or
/// a device breaks an API limit (name length, value length, attribute count; the count
/// includes the `allocator` attribute the kubelet plugin adds later).
pub fn resource_slices(
    inventory: &Inventory,
    driver: &str,
    node_name: &str,
) -> Result<Vec<ResourceSliceSpec>> {
    resource_slices_chunked(inventory, driver, node_name, MAX_DEVICES_PER_SLICE)
}

/// [`resource_slices`] with at most `max_devices` devices per slice: the kubelet plugin
/// passes [`taints::MAX_DEVICES_PER_SLICE_WITH_TAINTS`] whenever it may publish device taints,
/// so that a taint appearing on a device never changes how the pool is cut into slices.
///
/// # Errors
///
/// As [`resource_slices`]; also [`Error::InvalidResourceSlice`] when `max_devices` is 0 or
/// above [`MAX_DEVICES_PER_SLICE`].
pub fn resource_slices_chunked(
    inventory: &Inventory,
    driver: &str,
    node_name: &str,
    max_devices: usize,
) -> Result<Vec<ResourceSliceSpec>> {
    if max_devices == 0 || max_devices > MAX_DEVICES_PER_SLICE {
        return Err(Error::slice(
            "spec.devices",
            format!(
                "{max_devices} devices per slice; must be between 1 and {MAX_DEVICES_PER_SLICE}"
            ),
        ));
    }
    check_driver_name(driver)?;
    check_node_name(node_name)?;
    let devices = published_devices(inventory)?;
    let mut chunks: Vec<Vec<Device>> = Vec::new();
    for device in devices {
        match chunks.last_mut() {
            Some(chunk) if chunk.len() < max_devices => chunk.push(device),
            _ => chunks.push(vec![device]),
        }
    }
    if chunks.is_empty() {
        chunks.push(Vec::new());
    }
    let count = i64::try_from(chunks.len())
        .map_err(|_| Error::slice("pool.resourceSliceCount", "too many slices"))?;
    Ok(chunks
        .into_iter()
        .map(|devices| ResourceSliceSpec {
            driver: driver.to_owned(),
            node_name: Some(node_name.to_owned()),
            pool: ResourcePool {
                name: node_name.to_owned(),
                generation: 0,
                resource_slice_count: count,
            },
            devices: Some(devices),
            ..ResourceSliceSpec::default()
        })
        .collect())
}

/// The name of slice `index` of `driver`'s pool on `node`: `<node>-<driver>-<index>`.
///
/// Always a valid DNS subdomain of at most 253 characters, and the same for the same input,
/// so server-side apply can address the slice. When the plain form would be too long or
/// invalid, a readable prefix is kept and a hash of the node and driver names keeps it unique.
pub fn slice_name(node: &str, driver: &str, index: usize) -> String {
    let plain = format!("{node}-{driver}");
    let suffix = format!("-{index}");
    if is_dns_subdomain(&plain) && plain.len() + suffix.len() <= MAX_NAME_LEN {
        return format!("{plain}{suffix}");
    }
    let hash = format!("{:016x}", fnv1a64(&[node.as_bytes(), driver.as_bytes()]));
    let room = MAX_NAME_LEN - suffix.len() - hash.len() - 1;
    let sanitized = sanitize_subdomain(&plain);
    let prefix = truncate_name(&sanitized, room);
    if prefix.is_empty() {
        format!("{hash}{suffix}")
    } else {
        format!("{prefix}-{hash}{suffix}")
    }
}

/// Looks an attribute of a published device up by kerf's name, whether it was published
/// unqualified (driver domain) or as `<driver>/<name>`.
pub fn device_attribute<'a, D: DeviceFields + ?Sized>(
    device: &'a D,
    driver: &str,
    name: &str,
) -> Option<&'a DeviceAttribute> {
    device
        .attribute(name)
        .or_else(|| device.attribute(&qualified(driver, name)))
}

/// Looks a capacity of a published device up, as [`device_attribute`] does.
pub fn device_capacity<'a, D: DeviceFields + ?Sized>(
    device: &'a D,
    driver: &str,
    name: &str,
) -> Option<&'a Quantity> {
    device_capacity_entry(device, driver, name).map(|c| &c.value)
}

/// The whole capacity entry (value and request policy) of a published device, looked up as
/// [`device_attribute`] does.
pub fn device_capacity_entry<'a, D: DeviceFields + ?Sized>(
    device: &'a D,
    driver: &str,
    name: &str,
) -> Option<&'a DeviceCapacity> {
    device
        .capacity(name)
        .or_else(|| device.capacity(&qualified(driver, name)))
}

/// The `memory` capacity of a published device of `driver`, in bytes.
pub fn device_memory_bytes<D: DeviceFields + ?Sized>(device: &D, driver: &str) -> Option<u64> {
    device_capacity(device, driver, capacities::MEMORY)
        .and_then(|q| crate::quantity::quantity_bytes(q).ok())
}

fn qualified(driver: &str, name: &str) -> String {
    format!("{driver}/{name}")
}

/// Writes `major[.minor[.patch]]` as semver `major.minor.patch` without leading zeros
/// (`570.124.06` → `570.124.6`, `12.8` → `12.8.0`); `None` when it is not such a version.
pub fn semver(version: &str) -> Option<String> {
    let parts: Vec<u64> = version
        .split('.')
        .map(|part| {
            if part.bytes().all(|b| b.is_ascii_digit()) {
                part.parse().ok()
            } else {
                None
            }
        })
        .collect::<Option<_>>()?;
    match parts.as_slice() {
        [major] => Some(format!("{major}.0.0")),
        [major, minor] => Some(format!("{major}.{minor}.0")),
        [major, minor, patch] => Some(format!("{major}.{minor}.{patch}")),
        _ => None,
    }
}

/// Writes a PCI address in the standard attribute's form, lower-case `dddd:bb:dd.f`
/// (NVML's `00000000:1B:00.0` → `0000:1b:00.0`); `None` when that is not possible.
pub fn pci_bus_id(address: &str) -> Option<String> {
    let lower = address.to_ascii_lowercase();
    let (domain, rest) = lower.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    if domain.is_empty() || domain.len() > 8 || !domain.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let domain = u32::from_str_radix(domain, 16)
        .ok()
        .filter(|d| *d <= 0xffff)?;
    if !(hex(bus, 2) && hex(device, 2) && hex(function, 1)) {
        return None;
    }
    Some(format!("{domain:04x}:{bus}:{device}.{function}"))
}

/// True for a DNS-1123 subdomain: at most 253 characters, dot-separated labels of lower-case
/// letters, digits and `-` that start and end with a letter or digit.
pub fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_LEN && name.split('.').all(is_label_body)
}

/// True for a DNS-1123 label: at most 63 characters of lower-case letters, digits and `-`,
/// starting and ending with a letter or digit.
pub fn is_dns_label(name: &str) -> bool {
    name.len() <= MAX_DEVICE_NAME_LEN && is_label_body(name)
}

fn is_label_body(label: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = label.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(&first), Some(&last)) => {
            alnum(first) && alnum(last) && bytes.iter().all(|&b| alnum(b) || b == b'-')
        }
        _ => false,
    }
}

/// True for an attribute or capacity name the API accepts: a C identifier of at most 32
/// characters, optionally prefixed by `<DNS subdomain of at most 63 characters>/`.
pub fn is_qualified_name(name: &str) -> bool {
    let (domain, id) = match name.rsplit_once('/') {
        Some((domain, id)) => (Some(domain), id),
        None => (None, name),
    };
    let c_identifier = id.len() <= MAX_QUALIFIED_NAME_ID_LEN
        && id
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    c_identifier && domain.is_none_or(|d| d.len() <= MAX_DOMAIN_LEN && is_dns_subdomain(d))
}

fn check_driver_name(driver: &str) -> Result<()> {
    if driver.len() <= MAX_DOMAIN_LEN && is_dns_subdomain(driver) {
        Ok(())
    } else {
        Err(Error::slice(
            "spec.driver",
            format!("{driver:?} is not a DNS subdomain of at most 63 characters"),
        ))
    }
}

fn check_node_name(node: &str) -> Result<()> {
    if is_dns_subdomain(node) {
        Ok(())
    } else {
        Err(Error::slice(
            "spec.pool.name",
            format!("node name {node:?} is not a DNS subdomain of at most 253 characters"),
        ))
    }
}

/// Lower-cases and replaces what a DNS subdomain cannot hold, trimming labels to start and
/// end with a letter or digit.
fn sanitize_subdomain(name: &str) -> String {
    let mapped: String = name
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '.') => c,
            _ => '-',
        })
        .collect();
    mapped
        .split('.')
        .map(|label| label.trim_matches('-'))
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(".")
}

/// At most `max` bytes of an ASCII name, ending with a letter or digit.
fn truncate_name(name: &str, max: usize) -> &str {
    let cut = name.get(..max.min(name.len())).unwrap_or(name);
    cut.trim_end_matches(['-', '.'])
}

/// 64-bit FNV-1a over the parts, separated so that ("ab", "c") and ("a", "bc") differ.
fn fnv1a64(parts: &[&[u8]]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            hash = (hash ^ 0xff).wrapping_mul(PRIME);
        }
        for &byte in *part {
            hash = (hash ^ u64::from(byte)).wrapping_mul(PRIME);
        }
    }
    hash
}

#[cfg(test)]
mod tests;
