//! How full each GPU is and who holds it, for the usage metrics (`crate::metrics::usage`):
//! per published device its memory and compute in use and its number of allocations, and the
//! same amounts summed per GpuClass and per namespace of the claims that hold them.
//!
//! A device's memory and compute are counted as the class status counts them
//! ([`memory_in_use`], [`compute_in_use`]: capped at the device). The per-class and
//! per-namespace sums count each allocation result as the allocator's index does
//! ([`kerf_api::allocation::device_uses`]): a whole device is all its memory and compute, a
//! slice what it reserves (a share of a shareable GPU's whole memory is the whole GPU).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::resourceslice::{DeviceFields as _, attributes, device_attribute};
use kerf_core::alloc::UseKind;
use kube::ResourceExt as _;

use super::scope::whole_share_bytes;
use super::{DeviceKey, PublishedDevice, compute_in_use, memory_in_use};
use kerf_api::resourceslice::device_memory_bytes;

/// Class label of an allocation whose request names no DeviceClass the claim still has.
pub const UNKNOWN_CLASS: &str = "unknown";

/// One published device and how full it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFill {
    /// The node (pool) that published it.
    pub node: String,
    /// The device name, e.g. `gpu-0`.
    pub device: String,
    /// The GPU's or MIG device's UUID; empty when not published.
    pub uuid: String,
    /// The product name, e.g. `NVIDIA H100 80GB HBM3`; empty when not published.
    pub product: String,
    /// Its memory.
    pub memory_bytes: u64,
    /// Memory the allocations naming it use (at most `memory_bytes`).
    pub memory_allocated_bytes: u64,
    /// Percent of its multiprocessors the allocations naming it use (at most 100).
    pub compute_allocated_percent: u32,
    /// Allocation results naming it: one per slice or share, one for a whole device.
    pub slices: u64,
}

/// What a set of allocations holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Memory, in bytes.
    pub memory_bytes: u64,
    /// Compute, in percent of one GPU (summed over devices).
    pub compute_percent: u64,
    /// Allocation results.
    pub slices: u64,
}

impl Held {
    fn add(&mut self, memory_bytes: u64, compute_percent: u32) {
        self.memory_bytes = self.memory_bytes.saturating_add(memory_bytes);
        self.compute_percent = self
            .compute_percent
            .saturating_add(u64::from(compute_percent));
        self.slices = self.slices.saturating_add(1);
    }
}

/// Every device's fill and the sums per class and per namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holdings {
    /// One entry per published device, in the order of the slices.
    pub devices: Vec<DeviceFill>,
    /// Per GpuClass (the DeviceClass the allocated request named).
    pub classes: BTreeMap<String, Held>,
    /// Per namespace of the claims.
    pub namespaces: BTreeMap<String, Held>,
}

/// The holdings of `claims` on `devices` (allocations of `driver` only).
pub fn holdings(
    devices: &[PublishedDevice<'_>],
    claims: &[Arc<ResourceClaim>],
    driver: &str,
) -> Holdings {
    let memory = memory_in_use(devices, claims, driver);
    let compute = compute_in_use(devices, claims, driver);
    let sizes: HashMap<DeviceKey, (u64, Option<u64>)> = devices
        .iter()
        .map(|d| {
            let key = (d.pool.to_owned(), d.device.device_name().to_owned());
            let size = device_memory_bytes(d.device, driver).unwrap_or(0);
            (key, (size, whole_share_bytes(d.device, driver)))
        })
        .collect();
    let mut slices: HashMap<DeviceKey, u64> = HashMap::new();
    let mut classes: BTreeMap<String, Held> = BTreeMap::new();
    let mut namespaces: BTreeMap<String, Held> = BTreeMap::new();
    for claim in claims {
        let namespace = claim.namespace().unwrap_or_default();
        for (request, used) in requested_uses(claim, driver) {
            let key = (used.node, used.device);
            let Some(&(size, whole_share)) = sizes.get(&key) else {
                continue;
            };
            *slices.entry(key).or_insert(0) += 1;
            let (bytes, percent) = held_by(used.kind, size, whole_share);
            let class = request_class(claim, &request).unwrap_or(UNKNOWN_CLASS);
            classes
                .entry(class.to_owned())
                .or_default()
                .add(bytes, percent);
            namespaces
                .entry(namespace.clone())
                .or_default()
                .add(bytes, percent);
        }
    }
    let devices = devices
        .iter()
        .map(|d| {
            let name = d.device.device_name();
            let key = (d.pool.to_owned(), name.to_owned());
            let text = |attribute| {
                device_attribute(d.device, driver, attribute)
                    .and_then(|a| a.string.clone())
                    .unwrap_or_default()
            };
            DeviceFill {
                node: d.pool.to_owned(),
                device: name.to_owned(),
                uuid: text(attributes::UUID),
                product: text(attributes::PRODUCT_NAME),
                memory_bytes: sizes.get(&key).map_or(0, |(size, _)| *size),
                memory_allocated_bytes: memory.used(d.pool, name),
                compute_allocated_percent: compute.used.get(&key).copied().unwrap_or(0),
                slices: slices.get(&key).copied().unwrap_or(0),
            }
        })
        .collect();
    Holdings {
        devices,
        classes,
        namespaces,
    }
}

/// Memory and compute percent one use holds on a device of `size` bytes.
fn held_by(kind: UseKind, size: u64, whole_share: Option<u64>) -> (u64, u32) {
    match kind {
        UseKind::Whole => (size, 100),
        UseKind::Slice { memory_bytes, .. } if whole_share.is_some_and(|w| memory_bytes >= w) => {
            (size, 100)
        }
        UseKind::Slice {
            memory_bytes,
            compute_percent,
            ..
        } => (memory_bytes.min(size), u32::from(compute_percent.min(100))),
    }
}

/// The uses of `claim`'s allocation with the request each result answers
/// (`device_uses` keeps the order of the results it counts).
fn requested_uses(
    claim: &ResourceClaim,
    driver: &str,
) -> impl Iterator<Item = (String, kerf_core::alloc::DeviceUse)> {
    let requests: Vec<String> = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.driver == driver && r.admin_access != Some(true))
        .map(|r| r.request.clone())
        .collect();
    requests
        .into_iter()
        .zip(kerf_api::allocation::device_uses(claim, driver))
}

/// The DeviceClass that `request` (`name` or `name/subrequest`) of `claim` names.
fn request_class<'a>(claim: &'a ResourceClaim, request: &str) -> Option<&'a str> {
    let (name, sub) = match request.split_once('/') {
        Some((name, sub)) => (name, Some(sub)),
        None => (request, None),
    };
    let found = claim
        .spec
        .devices
        .as_ref()?
        .requests
        .as_ref()?
        .iter()
        .find(|r| r.name == name)?;
    match sub {
        None => found.exactly.as_ref().map(|e| e.device_class_name.as_str()),
        Some(sub) => found
            .first_available
            .as_ref()?
            .iter()
            .find(|s| s.name == sub)
            .map(|s| s.device_class_name.as_str()),
    }
}

#[cfg(test)]
#[path = "holdings_tests.rs"]
mod tests;
