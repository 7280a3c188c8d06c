//! What one ResourceClaim is charged against a GpuQuota.
//!
//! - A request of a kerf **Controller** class: the claim's `GpuClaimParameters` (memory,
//!   compute, as the controller's allocator resolves them with the class defaults,
//!   [`crate::claim_request`]); a request for whole GPUs: the class's largest GPU per device.
//! - A request of a kerf **Scheduler** class: whole devices (GPUs, MIG devices) by the largest
//!   device the class selects; a share of a sliced class by its `capacity.requests`, memory
//!   rounded up to the class's granularity and the class's default compute where the claim
//!   names none, as kube-scheduler consumes them (`consumable_capacity.go`,
//!   `calculateConsumedCapacity`).
//! - `firstAvailable`: its largest alternative (by memory, then compute, then devices).
//! - `allocationMode: All`: every device the class selects.
//! - Admin access consumes nothing; classes of other drivers are not charged.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{ExactDeviceRequest, ResourceClaim};
use kerf_core::alloc::DeviceRequest;

use super::amount::GpuAmount;
use crate::error::{Error, Result};
use crate::params::{Allocator, GpuClassParameters, join};
use crate::quantity::quantity_bytes;

/// One device a class hands out whole: its memory and compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSize {
    /// Its memory in bytes.
    pub memory_bytes: u64,
    /// Its compute in percent of a GPU: 100 for a GPU, a MIG device its share of the
    /// multiprocessors.
    pub compute: u64,
}

/// How a quota sees one kerf class.
#[derive(Debug, Clone, PartialEq)]
pub struct QuotaClass {
    /// The class's settings.
    pub params: GpuClassParameters,
    /// The largest device it selects among those published; `None` while none is.
    pub largest: Option<DeviceSize>,
    /// How many published devices it selects (what `allocationMode: All` takes).
    pub devices: u64,
}

/// What a claim is charged: in total and per class.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Charge {
    /// The whole charge.
    pub total: GpuAmount,
    /// The part of it each class takes.
    pub classes: BTreeMap<String, GpuAmount>,
    /// Classes whose whole devices were charged without memory, because none of their
    /// devices is published yet to size them.
    pub unsized_classes: Vec<String>,
}

impl Charge {
    /// Whether the claim is charged nothing (no kerf class, admin access only).
    pub fn is_zero(&self) -> bool {
        self.total.is_zero() && self.unsized_classes.is_empty()
    }

    fn add(&mut self, class: &str, amount: GpuAmount, sized: bool) {
        self.total = self.total.plus(amount);
        let entry = self.classes.entry(class.to_owned()).or_default();
        *entry = entry.plus(amount);
        if !sized && !self.unsized_classes.iter().any(|c| c == class) {
            self.unsized_classes.push(class.to_owned());
        }
    }
}

/// One alternative of a request: its class, amount and whether it could be sized.
struct Priced {
    class: String,
    amount: GpuAmount,
    sized: bool,
}

/// The charge of `claim`; `classes` gives each kerf class of `driver` by name (`None` for any
/// other class, which is not charged).
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming the field for what kerf's allocators would refuse too: a
/// claim whose Controller-class requests do not resolve ([`crate::claim_request`]: bad
/// `GpuClaimParameters`, a Controller class beside another class in one claim), a capacity
/// request that is not a number.
pub fn claim_charge(
    claim: &ResourceClaim,
    driver: &str,
    classes: impl Fn(&str) -> Option<QuotaClass>,
) -> Result<Charge> {
    let requests = crate::claim::claim_requests(claim);
    let is_controller =
        |name: &str| classes(name).is_some_and(|c| c.params.allocator == Allocator::Controller);
    let any_controller = requests.iter().any(|r| {
        r.exactly
            .iter()
            .any(|e| is_controller(&e.device_class_name))
            || r.first_available
                .iter()
                .flatten()
                .any(|s| is_controller(&s.device_class_name))
    });
    let resolved = if any_controller {
        let params = |name: &str| classes(name).map(|c| c.params);
        Some(crate::claim_request(claim, params, driver)?.requests)
    } else {
        None
    };
    let mut charge = Charge::default();
    for (i, request) in requests.iter().enumerate() {
        let at = format!("spec.devices.requests[{i}]");
        let mut alternatives = Vec::new();
        if let Some(exactly) = &request.exactly {
            let controller = resolved.as_ref().and_then(|r| r.get(i));
            alternatives.push(price(exactly, controller, &classes, &join(&at, "exactly"))?);
        }
        for (j, sub) in request.first_available.iter().flatten().enumerate() {
            let exactly = crate::allocation::as_exact_request(sub);
            let controller = resolved
                .as_ref()
                .and_then(|r| r.get(i))
                .and_then(|r| r.first_available.get(j));
            let sub_at = format!("{at}.firstAvailable[{j}]");
            alternatives.push(price(&exactly, controller, &classes, &sub_at)?);
        }
        if let Some(largest) = alternatives.into_iter().max_by_key(|p| p.amount) {
            charge.add(&largest.class, largest.amount, largest.sized);
        }
    }
    charge.classes.retain(|_, amount| !amount.is_zero());
    Ok(charge)
}

/// The price of one `exactly` request (or subrequest) at `at`; `controller` is its resolution
/// by the controller's allocator when its class is a Controller class.
fn price(
    exactly: &ExactDeviceRequest,
    controller: Option<&DeviceRequest>,
    classes: &impl Fn(&str) -> Option<QuotaClass>,
    at: &str,
) -> Result<Priced> {
    let class_name = exactly.device_class_name.as_str();
    let free = Priced {
        class: class_name.to_owned(),
        amount: GpuAmount::ZERO,
        sized: true,
    };
    let Some(class) = classes(class_name) else {
        return Ok(free);
    };
    if exactly.admin_access == Some(true) {
        return Ok(free);
    }
    let count = if exactly.allocation_mode.as_deref() == Some("All") {
        class.devices
    } else {
        u64::try_from(exactly.count.unwrap_or(1).max(0)).unwrap_or(0)
    };
    let (each, sized) = match (class.params.allocator, controller) {
        (Allocator::Controller, Some(resolved)) => match resolved.slice {
            Some(slice) => (
                GpuAmount {
                    memory_bytes: slice.memory_bytes,
                    compute: u64::from(slice.compute_percent),
                    gpus: 0,
                },
                true,
            ),
            None => whole(&class),
        },
        _ if class.params.is_scheduler_sliced() => share(exactly, &class, at)?,
        _ => whole(&class),
    };
    Ok(Priced {
        class: class_name.to_owned(),
        amount: each.times(count),
        sized,
    })
}

/// One whole device of `class`: its largest, or (none published) one device of unknown memory.
fn whole(class: &QuotaClass) -> (GpuAmount, bool) {
    match class.largest {
        Some(size) => (
            GpuAmount {
                memory_bytes: size.memory_bytes,
                compute: size.compute,
                gpus: 1,
            },
            true,
        ),
        None => (
            GpuAmount {
                memory_bytes: 0,
                compute: FULL_COMPUTE,
                gpus: 1,
            },
            false,
        ),
    }
}

/// A GPU's compute in percent.
const FULL_COMPUTE: u64 = 100;

/// One share of a sliced Scheduler class, as kube-scheduler consumes it: memory rounded up to
/// the granularity (the whole GPU's when not requested), compute as requested or the class's
/// default (else 100).
fn share(exactly: &ExactDeviceRequest, class: &QuotaClass, at: &str) -> Result<(GpuAmount, bool)> {
    let requests = exactly.capacity.as_ref().and_then(|c| c.requests.as_ref());
    let granularity = class
        .params
        .memory_granularity_bytes("class slicing")?
        .unwrap_or(1)
        .max(1);
    let memory = match requests.and_then(|r| r.get(crate::resourceslice::capacities::MEMORY)) {
        Some(q) => {
            let bytes = quantity_bytes(q).map_err(|e| {
                Error::config(format!("{at}.capacity.requests.memory"), e.to_string())
            })?;
            Some(bytes.div_ceil(granularity).saturating_mul(granularity))
        }
        None => class
            .largest
            .map(|d| d.memory_bytes / granularity * granularity),
    };
    let compute =
        match requests.and_then(|r| r.get(crate::resourceslice::scheduler_slices::COMPUTE)) {
            Some(q) => parse_percent(&q.0, &format!("{at}.capacity.requests.compute"))?,
            None => class
                .params
                .slicing
                .as_ref()
                .and_then(|s| s.default_compute)
                .map_or(FULL_COMPUTE, u64::from),
        };
    Ok((
        GpuAmount {
            memory_bytes: memory.unwrap_or(0),
            compute,
            gpus: 0,
        },
        memory.is_some(),
    ))
}

/// A compute request: a whole number of percent (kube-scheduler compares quantities; kerf
/// publishes compute in steps of 1).
fn parse_percent(text: &str, at: &str) -> Result<u64> {
    text.trim().parse::<u64>().map_err(|_| {
        Error::config(
            at,
            format!(
                "{text:?} is not a whole number of percent (compute is published in steps of 1)"
            ),
        )
    })
}
