//! What the cluster has allocated already, as kube-scheduler's DynamicResources plugin hands
//! it to the allocator, and the share IDs new shares get.
//!
//! Upstream: kubernetes/kubernetes
//! `pkg/scheduler/framework/plugins/dynamicresources/allocateddevices.go`
//! (`foreachAllocatedDevice`): results with `adminAccess` are not counted; with
//! DRAConsumableCapacity on, a result **with** `shareID` is a share (its `consumedCapacity`
//! is added to the device's aggregated capacity) and a result **without** one allocates the
//! device exclusively, whether the device allows multiple allocations or not.
//! `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/allocatedstate.go`
//! (`AllocatedState`, `GenerateShareID`) and `structured/allocator.go` (`IsDeviceAllocated`:
//! exclusively allocated, or holding at least one share).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use k8s_openapi::api::resource::v1::AllocationResult;

use crate::SeededRng;
use crate::capacity::{Amounts, amount};

/// A device of a ResourceSlice: (driver, pool, device).
pub type DeviceId = (String, String, String);

/// Devices in use by allocations visible to a cycle (written ones and in-flight ones).
#[derive(Debug, Default)]
pub struct AllocatedState {
    exclusive: HashSet<DeviceId>,
    shared: HashSet<DeviceId>,
    consumed: HashMap<DeviceId, Amounts>,
}

impl AllocatedState {
    /// Counts the devices of `allocation` (see the module documentation).
    ///
    /// # Errors
    ///
    /// A `consumedCapacity` quantity that does not parse, naming the device.
    pub fn add(&mut self, allocation: &AllocationResult) -> Result<(), String> {
        for result in allocation
            .devices
            .iter()
            .flat_map(|d| d.results.iter().flatten())
        {
            if result.admin_access == Some(true) {
                continue;
            }
            let id = (
                result.driver.clone(),
                result.pool.clone(),
                result.device.clone(),
            );
            if result.share_id.is_none() {
                self.exclusive.insert(id);
                continue;
            }
            if let Some(consumed) = &result.consumed_capacity {
                let what = format!(
                    "consumedCapacity of {}/{}/{}",
                    result.driver, result.pool, result.device
                );
                let entry = self.consumed.entry(id.clone()).or_default();
                for (name, quantity) in consumed {
                    *entry.entry(name.clone()).or_insert(0) += amount(quantity, &what)?;
                }
            }
            self.shared.insert(id);
        }
        Ok(())
    }

    /// Whether an allocation without `shareID` holds the device (`AllocatedDevices`).
    pub fn exclusive(&self, id: &DeviceId) -> bool {
        self.exclusive.contains(id)
    }

    /// The device's aggregated consumed capacity of all shares (`AggregatedCapacity`).
    pub fn consumed(&self, id: &DeviceId) -> Option<&Amounts> {
        self.consumed.get(id)
    }

    /// `IsDeviceAllocated`: exclusively or by at least one share.
    pub fn is_allocated(&self, id: &DeviceId) -> bool {
        self.exclusive.contains(id) || self.shared.contains(id)
    }
}

/// A fresh share ID in a UUID's text form, as upstream's `GenerateShareID`
/// (`uuid.NewUUID`) writes one. The bits are random (version 4 layout) rather than
/// time-based; what matters to the API and to kerf is that every share gets its own.
pub(super) fn new_share_id() -> String {
    static SEQUENCE: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let sequence = SEQUENCE.fetch_add(1, Ordering::Relaxed);
    // SplitMix64's first output is a bijection of its seed: distinct seeds, distinct IDs.
    let seed = (now ^ u64::from(std::process::id()).rotate_left(32))
        .wrapping_add(sequence.wrapping_mul(0xD1B5_4A32_D192_ED03));
    let mut rng = SeededRng::new(seed);
    let high = rng.next_u64();
    let low = rng.next_u64();
    let high = (high & 0xFFFF_FFFF_FFFF_0FFF) | 0x0000_0000_0000_4000;
    let low = (low & 0x3FFF_FFFF_FFFF_FFFF) | 0x8000_0000_0000_0000;
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xFFFF,
        high & 0xFFFF,
        low >> 48,
        low & 0xFFFF_FFFF_FFFF
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn share_ids_are_uuids_and_distinct() {
        let ids: HashSet<String> = (0..1000).map(|_| new_share_id()).collect();
        assert_eq!(ids.len(), 1000);
        for id in &ids {
            let groups: Vec<usize> = id.split('-').map(str::len).collect();
            assert_eq!(groups, [8, 4, 4, 4, 12], "{id}");
            assert!(id.chars().all(|c| c == '-' || c.is_ascii_hexdigit()));
        }
    }
}
