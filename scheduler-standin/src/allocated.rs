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

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use k8s_openapi::api::resource::v1::AllocationResult;

use crate::SeededRng;
use crate::capacity::{Amounts, amount};

/// A device of a ResourceSlice: (driver, pool, device).
pub type DeviceId = (String, String, String);

/// A [`DeviceId`] with its hash worked out once: the allocator looks up the same published
/// devices on every node of every Filter, and hashing three strings each time was most of
/// what a device check cost.
#[derive(Debug, Clone)]
pub(crate) struct DeviceKey {
    hash: u64,
    /// The device.
    pub id: DeviceId,
}

impl DeviceKey {
    /// The key of `id`.
    pub(crate) fn new(id: DeviceId) -> Self {
        let mut hasher = DefaultHasher::new();
        id.hash(&mut hasher);
        Self {
            hash: hasher.finish(),
            id,
        }
    }
}

impl PartialEq for DeviceKey {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.id == other.id
    }
}

impl Eq for DeviceKey {}

impl Hash for DeviceKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// Hands a [`DeviceKey`]'s stored hash to the map unchanged.
#[derive(Default)]
pub(crate) struct StoredHash(u64);

impl Hasher for StoredHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by `DeviceKey`; anything else still hashes, if slowly.
        for byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*byte);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

/// How the allocated claims use one device.
#[derive(Debug, Default)]
pub(crate) struct InUse {
    /// Held by an allocation without `shareID`.
    pub exclusive: bool,
    /// The shares' aggregated consumed capacity, when any share wrote `consumedCapacity`.
    pub consumed: Option<Amounts>,
}

/// Devices in use by allocations visible to a cycle (written ones and in-flight ones).
#[derive(Debug, Default)]
pub struct AllocatedState {
    /// Every device held exclusively or by at least one share.
    devices: HashMap<DeviceKey, InUse, BuildHasherDefault<StoredHash>>,
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
            let key = DeviceKey::new((
                result.driver.clone(),
                result.pool.clone(),
                result.device.clone(),
            ));
            let entry = self.devices.entry(key).or_default();
            if result.share_id.is_none() {
                entry.exclusive = true;
                continue;
            }
            if let Some(consumed) = &result.consumed_capacity {
                let what = format!(
                    "consumedCapacity of {}/{}/{}",
                    result.driver, result.pool, result.device
                );
                let total = entry.consumed.get_or_insert_default();
                for (name, quantity) in consumed {
                    total.add(name, amount(quantity, &what)?);
                }
            }
        }
        Ok(())
    }

    /// How allocated claims use the device; `None` when none does (`IsDeviceAllocated` is
    /// false).
    pub(crate) fn in_use(&self, key: &DeviceKey) -> Option<&InUse> {
        self.devices.get(key)
    }

    /// `IsDeviceAllocated`: exclusively or by at least one share.
    pub(crate) fn is_allocated(&self, key: &DeviceKey) -> bool {
        self.devices.contains_key(key)
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
    use std::collections::HashSet;

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
