//! Which published devices a GpuClass's status counts, and when a scheduler share of a
//! shareable GPU is the whole GPU.

use kerf_api::params::{Allocator, GpuClassParameters};
use kerf_api::quantity::quantity_bytes;
use kerf_api::resourceslice::{DeviceFields, capacities, device_capacity_entry};

use crate::selector::{DeviceKind, DeviceSelector};

/// Whether a class counts devices published shareable (`allowMultipleAllocations: true`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shareable {
    /// Shareable or not (Controller classes, MIG devices, clusters without consumable
    /// capacity).
    Any,
    /// Only shareable GPUs (a sliced Scheduler class).
    Only,
    /// Only GPUs that are not shareable (a whole-GPU Scheduler class).
    Excluded,
    /// None (a sliced Scheduler class on a cluster without consumable capacity, whose
    /// DeviceClass selects nothing).
    Nothing,
}

/// The devices a class's status counts: its selector, narrowed as its DeviceClass narrows it
/// for kube-scheduler (`crate::selector::class_cel`).
#[derive(Debug, Clone, Copy)]
pub struct ClassScope<'a> {
    /// The class's selector.
    pub selector: &'a DeviceSelector,
    /// Shareable devices counted or not.
    pub shareable: Shareable,
}

impl<'a> ClassScope<'a> {
    /// Every device `selector` matches.
    pub fn all(selector: &'a DeviceSelector) -> Self {
        ClassScope {
            selector,
            shareable: Shareable::Any,
        }
    }

    /// The scope of a class with `params`, on a cluster that serves DRAConsumableCapacity
    /// or not (`consumable_capacity`), as its DeviceClass selects.
    pub fn of_class(
        selector: &'a DeviceSelector,
        params: &GpuClassParameters,
        consumable_capacity: bool,
    ) -> Self {
        let sliced = params.is_scheduler_sliced();
        let scheduler = params.allocator == Allocator::Scheduler;
        let shareable = if sliced && !consumable_capacity {
            Shareable::Nothing
        } else if !scheduler || !consumable_capacity || selector.kind != DeviceKind::WholeGpu {
            Shareable::Any
        } else if sliced {
            Shareable::Only
        } else {
            Shareable::Excluded
        };
        ClassScope {
            selector,
            shareable,
        }
    }

    /// Whether the class counts `device`.
    pub fn matches<D: DeviceFields>(&self, device: &D, driver: &str) -> bool {
        let is_shareable = device.allows_multiple_allocations();
        let admitted = match self.shareable {
            Shareable::Any => true,
            Shareable::Only => is_shareable,
            Shareable::Excluded => !is_shareable,
            Shareable::Nothing => false,
        };
        admitted && self.selector.matches(device, driver)
    }
}

/// The memory from which a share of a shareable `device` is the whole GPU: the published
/// `memory` request policy's `default`; `None` for a device that is not shareable.
pub(super) fn whole_share_bytes<D: DeviceFields>(device: &D, driver: &str) -> Option<u64> {
    if !device.allows_multiple_allocations() {
        return None;
    }
    let memory = device_capacity_entry(device, driver, capacities::MEMORY)?;
    quantity_bytes(memory.request_policy.as_ref()?.default.as_ref()?).ok()
}
