//! What a class's devices hold and how much of it is free, from kerf's ResourceSlices and the
//! allocations in ResourceClaims, for the GpuClass status.
//!
//! Only the pool's highest generation counts, as for every consumer of ResourceSlices. Memory in
//! use is counted per device from every allocation that names it, whoever wrote it:
//! - a device with a `GpuSliceAllocation` entry (written by kerf's controller) uses the slice's
//!   memory (the whole device when the entry sets none);
//! - a device allocated as a share (`shareID`, consumable capacity) uses its consumed `memory`,
//!   and the whole device when that is at least the published `memory` request policy's
//!   `default` (what a request without `capacity.requests` consumes; the plugin prepares such
//!   a share as the whole GPU, `kerf_api::AllocatedDevice::finish_share`);
//! - any other allocation holds the whole device.
//!
//! A class counts the devices its DeviceClass lets kube-scheduler allocate ([`ClassScope`]):
//! a sliced Scheduler class only GPUs published shareable (`allowMultipleAllocations`, the
//! GPUs the Node's shared publication names), a whole-GPU Scheduler class only the others.
//!
//! Admin-access results do not count: they give access without consuming the device. A GPU in
//! MIG mode is published only as its MIG devices, so whole GPUs and MIG devices never share
//! memory here.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceRequestAllocationResult, ResourceClaim,
};
use kerf_api::resourceslice::{DeviceFields as _, ResourceSliceFields as _};

use crate::cache::{CompactDevice, CompactResourceSlice};
use kerf_api::params::{GpuSliceAllocation, OpaqueConfig, decode_opaque};
use kerf_api::quantity::quantity_bytes;
use kerf_api::resourceslice::capacities;

use kerf_api::resourceslice::device_memory_bytes;

mod holdings;
mod refresh;
mod scope;

pub use holdings::{DeviceFill, Held, Holdings, UNKNOWN_CLASS, holdings};
pub use refresh::{Usage, UsageMemo};
use scope::whole_share_bytes;
pub use scope::{ClassScope, Shareable};

/// One device of the driver's current ResourceSlices.
#[derive(Debug, Clone, Copy)]
pub struct PublishedDevice<'a> {
    /// The pool (the node name for kerf's devices).
    pub pool: &'a str,
    /// The device as published.
    pub device: &'a CompactDevice,
}

/// `(pool, device)`: how allocation results name a device.
pub type DeviceKey = (String, String);

/// The devices of `driver` in `slices`, from each pool's highest generation only.
pub fn current_devices<'a>(
    slices: &'a [Arc<CompactResourceSlice>],
    driver: &str,
) -> Vec<PublishedDevice<'a>> {
    let ours = || slices.iter().filter(move |s| s.driver() == driver);
    let mut newest: HashMap<&str, i64> = HashMap::new();
    for slice in ours() {
        let pool = slice.pool();
        let generation = newest.entry(pool.name.as_str()).or_insert(pool.generation);
        *generation = (*generation).max(pool.generation);
    }
    ours()
        .filter(|s| newest.get(s.pool().name.as_str()) == Some(&s.pool().generation))
        .flat_map(|slice| {
            slice.devices().iter().map(|device| PublishedDevice {
                pool: &slice.pool().name,
                device,
            })
        })
        .collect()
}

/// Memory in use per published device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryUse {
    used: HashMap<DeviceKey, u64>,
}

impl MemoryUse {
    /// Bytes in use on the device `pool`/`device` (at most its memory).
    pub fn used(&self, pool: &str, device: &str) -> u64 {
        self.used
            .get(&(pool.to_owned(), device.to_owned()))
            .copied()
            .unwrap_or(0)
    }
}

/// The memory every allocation of `driver` in `claims` uses on `devices`.
pub fn memory_in_use(
    devices: &[PublishedDevice<'_>],
    claims: &[Arc<ResourceClaim>],
    driver: &str,
) -> MemoryUse {
    let memory: HashMap<DeviceKey, (u64, Option<u64>)> = devices
        .iter()
        .map(|d| {
            (
                (d.pool.to_owned(), d.device.device_name().to_owned()),
                (
                    device_memory_bytes(d.device, driver).unwrap_or(0),
                    whole_share_bytes(d.device, driver),
                ),
            )
        })
        .collect();
    let mut used: HashMap<DeviceKey, u64> = HashMap::new();
    for claim in claims {
        let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
            continue;
        };
        let slices = slice_allocations(allocation, driver);
        for result in results_of(allocation, driver) {
            let key = (result.pool.clone(), result.device.clone());
            let Some(&(whole, whole_share)) = memory.get(&key) else {
                continue;
            };
            let bytes = result_memory(result, &slices, whole, whole_share);
            let entry = used.entry(key).or_insert(0);
            *entry = entry.saturating_add(bytes).min(whole);
        }
    }
    MemoryUse { used }
}

/// This driver's results that consume their device.
fn results_of<'a>(
    allocation: &'a AllocationResult,
    driver: &'a str,
) -> impl Iterator<Item = &'a DeviceRequestAllocationResult> {
    allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_deref())
        .unwrap_or_default()
        .iter()
        .filter(move |r| r.driver == driver && r.admin_access != Some(true))
}

/// The `GpuSliceAllocation` configs of this driver in an allocation; configs that do not decode
/// are skipped (their devices then count as wholly used, the safe side for a free count).
fn slice_allocations(allocation: &AllocationResult, driver: &str) -> Vec<GpuSliceAllocation> {
    allocation
        .devices
        .as_ref()
        .and_then(|d| d.config.as_deref())
        .unwrap_or_default()
        .iter()
        .filter_map(|config| config.opaque.as_ref().filter(|o| o.driver == driver))
        .filter_map(
            |opaque| match decode_opaque(&opaque.parameters.0, "parameters") {
                Ok(OpaqueConfig::Slice(slice)) => Some(slice),
                Ok(_) => None,
                Err(error) => {
                    tracing::debug!(%error, "ignoring an allocation config that does not decode");
                    None
                }
            },
        )
        .collect()
}

fn result_memory(
    result: &DeviceRequestAllocationResult,
    slices: &[GpuSliceAllocation],
    whole: u64,
    whole_share: Option<u64>,
) -> u64 {
    let share = result.share_id.as_deref();
    if let Some(slice) = slices
        .iter()
        .find_map(|s| s.find(&result.pool, &result.device, share))
    {
        return slice.memory_bytes.unwrap_or(whole);
    }
    if share.is_some() {
        return consumed_memory(result.consumed_capacity.as_ref())
            .filter(|bytes| whole_share.is_none_or(|w| *bytes < w))
            .unwrap_or(whole);
    }
    whole
}

fn consumed_memory(
    consumed: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
) -> Option<u64> {
    consumed?
        .iter()
        .find(|(name, _)| {
            name.as_str() == capacities::MEMORY
                || name
                    .rsplit_once('/')
                    .is_some_and(|(_, id)| id == capacities::MEMORY)
        })
        .and_then(|(_, q)| quantity_bytes(q).ok())
}

/// The compute a class's devices have left, in whole GPUs (1.0 = one GPU's multiprocessors):
/// a whole-device allocation takes all of a device, a slice its compute percent, a share of
/// a shareable GPU's whole memory all of it.
pub fn free_compute_gpus(
    scope: &ClassScope<'_>,
    devices: &[PublishedDevice<'_>],
    claims: &[Arc<ResourceClaim>],
    driver: &str,
) -> f64 {
    free_compute(
        scope,
        devices,
        &compute_in_use(devices, claims, driver),
        driver,
    )
}

/// Compute in use per published device, in percent of the device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ComputeUse {
    used: HashMap<DeviceKey, u32>,
}

/// The compute every allocation of `driver` in `claims` uses on `devices`: what
/// [`free_compute_gpus`] counts, independent of the class (see [`UsageMemo`]).
fn compute_in_use(
    devices: &[PublishedDevice<'_>],
    claims: &[Arc<ResourceClaim>],
    driver: &str,
) -> ComputeUse {
    let whole_shares: HashMap<DeviceKey, u64> = devices
        .iter()
        .filter_map(|d| {
            let bytes = whole_share_bytes(d.device, driver)?;
            Some((
                (d.pool.to_owned(), d.device.device_name().to_owned()),
                bytes,
            ))
        })
        .collect();
    let mut used: HashMap<DeviceKey, u32> = HashMap::new();
    for claim in claims {
        for device_use in kerf_api::allocation::device_uses(claim, driver) {
            let key = (device_use.node.clone(), device_use.device.clone());
            let percent = match device_use.kind {
                kerf_core::alloc::UseKind::Whole => 100,
                kerf_core::alloc::UseKind::Slice { memory_bytes, .. }
                    if whole_shares.get(&key).is_some_and(|w| memory_bytes >= *w) =>
                {
                    100
                }
                kerf_core::alloc::UseKind::Slice {
                    compute_percent, ..
                } => u32::from(compute_percent),
            };
            let entry = used
                .entry((device_use.node, device_use.device))
                .or_insert(0);
            *entry = entry.saturating_add(percent).min(100);
        }
    }
    ComputeUse { used }
}

/// The compute `scope`'s devices have left given `usage`, in whole GPUs.
pub fn free_compute(
    scope: &ClassScope<'_>,
    devices: &[PublishedDevice<'_>],
    usage: &ComputeUse,
    driver: &str,
) -> f64 {
    let free_percent: u32 = devices
        .iter()
        .filter(|d| scope.matches(d.device, driver))
        .map(|d| {
            100 - usage
                .used
                .get(&(d.pool.to_owned(), d.device.device_name().to_owned()))
                .copied()
                .unwrap_or(0)
        })
        .sum();
    f64::from(free_percent) / 100.0
}

/// What a class's status reports about its devices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassCapacity {
    /// Published devices the class selects.
    pub matching_devices: u64,
    /// Their memory, in bytes.
    pub total_memory_bytes: u64,
    /// Their memory no allocation uses, in bytes.
    pub free_memory_bytes: u64,
}

/// Counts the devices `scope` matches and their total and free memory.
pub fn class_capacity(
    scope: &ClassScope<'_>,
    devices: &[PublishedDevice<'_>],
    usage: &MemoryUse,
    driver: &str,
) -> ClassCapacity {
    devices
        .iter()
        .filter(|d| scope.matches(d.device, driver))
        .fold(ClassCapacity::default(), |mut sum, d| {
            let memory = device_memory_bytes(d.device, driver).unwrap_or(0);
            let used = usage.used(d.pool, d.device.device_name());
            sum.matching_devices += 1;
            sum.total_memory_bytes = sum.total_memory_bytes.saturating_add(memory);
            sum.free_memory_bytes = sum
                .free_memory_bytes
                .saturating_add(memory.saturating_sub(used));
            sum
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::selector::{DeviceKind, DeviceSelector};
    use k8s_openapi::api::resource::v1::{ResourceClaimStatus, ResourceSlice, ResourceSliceSpec};
    use kerf_api::params::{OpaqueKind, SliceDevice};
    use kerf_api::resourceslice::{attributes, device_attribute};
    use serde_json::json;

    const DRIVER: &str = "gpu.kerf.dev";
    const GIB: u64 = 1 << 30;

    fn slices(node: &str, profile: &str, generation: i64) -> Vec<Arc<CompactResourceSlice>> {
        let inventory = kerf_core::mock::from_spec(profile).unwrap();
        kerf_api::resource_slices(&inventory, DRIVER, node)
            .unwrap()
            .into_iter()
            .map(|mut spec: ResourceSliceSpec| {
                spec.pool.generation = generation;
                Arc::new(CompactResourceSlice::from(ResourceSlice {
                    metadata: kube::api::ObjectMeta::default(),
                    spec,
                }))
            })
            .collect()
    }

    fn whole_gpus() -> DeviceSelector {
        DeviceSelector {
            kind: DeviceKind::WholeGpu,
            product_names: Vec::new(),
            min_memory_bytes: None,
            min_compute_capability: None,
        }
    }

    fn claim(allocation: serde_json::Value) -> Arc<ResourceClaim> {
        Arc::new(ResourceClaim {
            status: Some(ResourceClaimStatus {
                allocation: Some(serde_json::from_value(allocation).unwrap()),
                ..ResourceClaimStatus::default()
            }),
            ..ResourceClaim::default()
        })
    }

    fn result(pool: &str, device: &str) -> serde_json::Value {
        json!({"request": "gpu", "driver": DRIVER, "pool": pool, "device": device})
    }

    fn uuid_of(all: &[PublishedDevice<'_>], pool: &str, device: &str) -> String {
        let d = all
            .iter()
            .find(|d| d.pool == pool && d.device.device_name() == device)
            .unwrap();
        device_attribute(d.device, DRIVER, attributes::UUID)
            .and_then(|a| a.string.clone())
            .unwrap()
    }

    #[test]
    fn free_compute_counts_whole_devices_and_slice_percentages() {
        let all = slices("n1", "h100-sxm-80gb:2", 1);
        let devices = current_devices(&all, DRIVER);
        let uuid = uuid_of(&devices, "n1", "gpu-1");
        let slice = GpuSliceAllocation {
            devices: vec![SliceDevice {
                pool: "n1".into(),
                device: "gpu-1".into(),
                share_id: None,
                gpu_uuid: uuid,
                memory_bytes: Some(10 * GIB),
                compute_percent: Some(30),
                sharing: kerf_core::sharing::Sharing::Mps,
                time_slice_interval: None,
                enforcement: kerf_core::enforcement::Enforcement::default(),
            }],
        };
        let sliced = claim(json!({"devices": {
            "results": [result("n1", "gpu-1")],
            "config": [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": slice.to_parameters().unwrap()}}]
        }}));
        let whole = claim(json!({"devices": {"results": [result("n1", "gpu-0")]}}));
        assert!(
            (free_compute_gpus(&ClassScope::all(&whole_gpus()), &devices, &[], DRIVER) - 2.0).abs()
                < 1e-9
        );
        let free = free_compute_gpus(
            &ClassScope::all(&whole_gpus()),
            &devices,
            &[whole, sliced],
            DRIVER,
        );
        assert!((free - 0.7).abs() < 1e-9, "{free}");
    }

    #[test]
    fn only_the_newest_generation_of_each_pool_counts() {
        let mut all = slices("node-a", "l4", 1);
        all.extend(slices("node-a", "l4:1", 2));
        all.extend(slices("node-b", "l4", 5));
        let devices = current_devices(&all, DRIVER);
        let names: Vec<(&str, &str)> = devices
            .iter()
            .map(|d| (d.pool, d.device.device_name()))
            .collect();
        assert_eq!(
            names,
            [
                ("node-a", "gpu-0"),
                ("node-b", "gpu-0"),
                ("node-b", "gpu-1")
            ]
        );
        assert!(current_devices(&all, "other.example.com").is_empty());
    }

    #[test]
    fn whole_and_slice_allocations_use_memory() {
        let all = slices("node-a", "l4", 1);
        let devices = current_devices(&all, DRIVER);
        let whole = device_memory_bytes(devices[0].device, DRIVER).unwrap();
        let slice = GpuSliceAllocation {
            devices: vec![SliceDevice {
                pool: "node-a".to_owned(),
                device: "gpu-1".to_owned(),
                share_id: None,
                gpu_uuid: uuid_of(&devices, "node-a", "gpu-1"),
                memory_bytes: Some(4 * GIB),
                compute_percent: Some(25),
                sharing: kerf_core::sharing::Sharing::default(),
                time_slice_interval: None,
                enforcement: kerf_core::enforcement::Enforcement::default(),
            }],
        };
        let claims = vec![
            claim(json!({"devices": {"results": [result("node-a", "gpu-0")]}})),
            claim(json!({"devices": {
                "results": [result("node-a", "gpu-1")],
                "config": [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": slice.to_parameters().unwrap()}}],
            }})),
            // Another driver's device of the same name, and an admin-access result: neither counts.
            claim(json!({"devices": {"results": [
                {"request": "x", "driver": "other.example.com", "pool": "node-a", "device": "gpu-1"},
                {"request": "y", "driver": DRIVER, "pool": "node-a", "device": "gpu-1", "adminAccess": true},
            ]}})),
        ];
        let usage = memory_in_use(&devices, &claims, DRIVER);
        assert_eq!(usage.used("node-a", "gpu-0"), whole);
        assert_eq!(usage.used("node-a", "gpu-1"), 4 * GIB);
        let capacity = class_capacity(&ClassScope::all(&whole_gpus()), &devices, &usage, DRIVER);
        assert_eq!(
            capacity,
            ClassCapacity {
                matching_devices: 2,
                total_memory_bytes: 2 * whole,
                free_memory_bytes: whole - 4 * GIB,
            }
        );
    }

    #[test]
    fn shares_use_their_consumed_memory_and_never_more_than_the_device() {
        let all = slices("node-a", "l4:1", 1);
        let devices = current_devices(&all, DRIVER);
        let whole = device_memory_bytes(devices[0].device, DRIVER).unwrap();
        let share = |id: &str, memory: &str| {
            let mut r = result("node-a", "gpu-0");
            r["shareID"] = json!(id);
            r["consumedCapacity"] = json!({"memory": memory});
            r
        };
        let claims = vec![claim(
            json!({"devices": {"results": [share("a", "10Gi"), share("b", "2Gi")]}}),
        )];
        assert_eq!(
            memory_in_use(&devices, &claims, DRIVER).used("node-a", "gpu-0"),
            12 * GIB
        );
        let claims = vec![claim(
            json!({"devices": {"results": [share("a", "20Gi"), share("b", "20Gi")]}}),
        )];
        assert_eq!(
            memory_in_use(&devices, &claims, DRIVER).used("node-a", "gpu-0"),
            whole
        );
    }

    #[test]
    fn mig_devices_are_counted_on_their_own() {
        let all = slices("node-a", "a100-40gb-mig", 1);
        let devices = current_devices(&all, DRIVER);
        let mig = devices
            .iter()
            .find(|d| {
                device_attribute(d.device, DRIVER, attributes::TYPE)
                    .and_then(|a| a.string.as_deref())
                    == Some(kerf_api::resourceslice::TYPE_MIG)
            })
            .unwrap();
        let mig_memory = device_memory_bytes(mig.device, DRIVER).unwrap();
        let claims = vec![claim(
            json!({"devices": {"results": [result("node-a", mig.device.device_name())]}}),
        )];
        let usage = memory_in_use(&devices, &claims, DRIVER);
        assert_eq!(usage.used("node-a", mig.device.device_name()), mig_memory);
        let others: u64 = devices
            .iter()
            .filter(|d| d.device.device_name() != mig.device.device_name())
            .map(|d| usage.used(d.pool, d.device.device_name()))
            .sum();
        assert_eq!(others, 0);
    }

    #[test]
    fn claims_naming_unknown_devices_are_ignored() {
        let all = slices("node-a", "l4", 1);
        let devices = current_devices(&all, DRIVER);
        let claims = vec![
            claim(
                json!({"devices": {"results": [result("node-z", "gpu-0"), result("node-a", "gpu-9")]}}),
            ),
            Arc::new(ResourceClaim::default()),
        ];
        assert_eq!(
            memory_in_use(&devices, &claims, DRIVER),
            MemoryUse::default()
        );
    }

    #[test]
    fn a_selector_matching_nothing_has_no_capacity() {
        let all = slices("node-a", "l4", 1);
        let devices = current_devices(&all, DRIVER);
        let selector = DeviceSelector {
            product_names: vec!["NVIDIA B200".to_owned()],
            ..whole_gpus()
        };
        assert_eq!(
            class_capacity(
                &ClassScope::all(&selector),
                &devices,
                &MemoryUse::default(),
                DRIVER
            ),
            ClassCapacity::default()
        );
    }
}
