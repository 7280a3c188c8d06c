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

use k8s_openapi::api::resource::v1::{DeviceAttribute, DeviceCapacity};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

mod device;
pub mod dynamic_mig;
mod fields;
pub mod limits;
mod names;
mod pool;
pub mod scheduler_slices;
pub mod taints;

pub use fields::{DeviceFields, ResourceSliceFields};
use names::MAX_NAME_LEN;
pub use names::{
    TYPE_GPU, TYPE_MIG, attributes, capacities, is_dns_label, is_dns_subdomain, pci_bus_id, semver,
};
pub use pool::{ResourceSliceFeatures, node_slices, resource_slices};

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
