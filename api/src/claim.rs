//! What an allocated ResourceClaim gives this driver: the devices and, per device, the slice
//! limits, sharing and time slice interval that its opaque configs resolve to.

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::{
    DeviceAllocationConfiguration, DeviceRequestAllocationResult, ResourceClaim,
};
use kerf_core::enforcement::Enforcement;
use kerf_core::mps::TimeSliceInterval;
use kerf_core::sharing::{Sharing, SliceLimits};

use crate::error::{Error, Result};
use crate::params::{OpaqueConfig, SliceDevice, decode_opaque, join};
use crate::quantity::format_bytes;
use crate::shared_publication::SharedSlicing;

mod share;
pub(crate) use share::{CONSUMED_COMPUTE, CONSUMED_MEMORY, ShareConsumption};

/// `source` of a config copied from the DeviceClass.
pub(crate) const SOURCE_FROM_CLASS: &str = "FromClass";
/// `source` of a config copied from the claim (or written by kerf's controller).
pub(crate) const SOURCE_FROM_CLAIM: &str = "FromClaim";

/// One device allocated to this driver, with the configuration that applies to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatedDevice {
    /// The request as written in the result; may be `request/subrequest`.
    pub request: String,
    /// Pool of the device (the node name for kerf's devices).
    pub pool: String,
    /// Device name, e.g. `gpu-3`.
    pub device: String,
    /// Share ID when the device was allocated as one share of a shared device.
    pub share_id: Option<String>,
    /// Whether the device was allocated with admin access.
    pub admin_access: bool,
    /// The slice of the device (whole when no limit is set).
    pub limits: SliceLimits,
    /// How the device is shared.
    pub sharing: Sharing,
    /// The time slice the GPU gets while it carries time-sliced slices: the class's for
    /// [`Sharing::TimeSlicing`], `Default` for any other sharing (see [`resolve_allocation`]).
    pub time_slice_interval: TimeSliceInterval,
    /// The GPU UUID the allocator placed the slice on (from a `GpuSliceAllocation`), so the
    /// node can refuse to prepare it on a different GPU that took the same name.
    pub expected_gpu_uuid: Option<String>,
    /// The holder of its limits the class requires (kerf-controller's allocations record
    /// it; the default for everything else).
    pub enforcement: Enforcement,
    /// For a scheduler share (`shareID`/`consumedCapacity`) until
    /// [`AllocatedDevice::finish_share`] has compared it with its GPU: what it consumed.
    pub share: Option<ShareConsumption>,
}

impl AllocatedDevice {
    /// Completes a scheduler share once the GPU it is on is known: a share larger than the
    /// GPU's `gpu_memory_bytes` is refused; a share that takes all memory on the grid
    /// (the published `memory` default, `⌊memory/G⌋·G`, what a claim without capacity requests
    /// gets) is the whole GPU, exclusive; otherwise, when no config of the claim named a
    /// sharing, the sharing of the Node's shared publication for this GPU (`slicing`), MPS
    /// when the publication no longer names the GPU. Does nothing for a device that is not a
    /// share, or a second time.
    ///
    /// The granularity is the class config's when the allocation carries one, else the
    /// publication's; without either only a share of exactly the GPU's memory is whole.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidAllocation`] at `…consumedCapacity.memory` when the share consumed more
    /// memory than the GPU has.
    pub fn finish_share(
        &mut self,
        gpu_memory_bytes: u64,
        slicing: Option<&SharedSlicing>,
    ) -> Result<()> {
        let Some(share) = self.share.take() else {
            return Ok(());
        };
        if share.memory_bytes > gpu_memory_bytes {
            let message = format!(
                "{:?} ({} bytes) is more than the {} of device {:?}",
                share.memory_text,
                share.memory_bytes,
                format_bytes(gpu_memory_bytes),
                self.device
            );
            self.share = Some(share.clone());
            return Err(Error::InvalidAllocation {
                claim: share.claim,
                path: share.memory_path,
                message,
            });
        }
        let granule = share
            .granularity
            .or(slicing.map(|s| s.memory_granularity_bytes))
            .filter(|g| *g > 0)
            .unwrap_or(1);
        let on_grid = gpu_memory_bytes / granule * granule;
        if share.memory_bytes >= on_grid {
            self.limits = SliceLimits::default();
            self.sharing = Sharing::Exclusive;
            self.time_slice_interval = TimeSliceInterval::Default;
            return Ok(());
        }
        if !share.sharing_configured {
            self.sharing = slicing.map_or(Sharing::Mps, SharedSlicing::strategy);
            self.time_slice_interval = slicing
                .and_then(|s| s.sharing)
                .and_then(|s| s.time_slice_interval_for(self.sharing))
                .unwrap_or_default();
        }
        Ok(())
    }
}

/// The device requests of `claim`'s spec, none when it has no `spec.devices`.
pub fn claim_requests(claim: &ResourceClaim) -> &[k8s_openapi::api::resource::v1::DeviceRequest] {
    claim
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_deref())
        .unwrap_or_default()
}

/// Resolves the devices of `claim` that belong to `driver`, in result order.
///
/// Each result of this driver gets the configs of this driver whose `requests` is empty or
/// names the result's request (or its parent request for `req/sub`): class configs first, then
/// claim configs, each in list order, later ones overriding earlier ones field by field. A
/// `GpuSliceAllocation` entry naming the device gives its exact limits and sharing and wins.
/// Configs of other drivers are not decoded.
///
/// A result kube-scheduler allocated as a share of a shareable GPU (`shareID` and
/// `consumedCapacity`, no `GpuSliceAllocation` entry) is a slice of its consumed `memory` and
/// `compute`, shared as its configs say or, when they name no sharing (or Exclusive, which
/// a share cannot be), by MPS until [`AllocatedDevice::finish_share`] applies the Node's shared
/// publication.
///
/// The time slice interval of a device whose sharing resolves to TimeSlicing is the
/// `GpuSliceAllocation` entry's when it names one (kerf's controller), else the last
/// `sharing.timeSliceInterval` of the class configs (`GpuClassParameters`, copied by the
/// scheduler from the DeviceClass), else [`TimeSliceInterval::Default`]. Any other sharing
/// gets `Default`.
///
/// # Errors
///
/// - [`Error::NotAllocated`] when `status.allocation` is not set.
/// - [`Error::NoResultsForDriver`] when no result is for `driver`.
/// - [`Error::InvalidConfig`] when a config of this driver does not decode, with the path
///   `status.allocation.devices.config[i].opaque.parameters…`, or when a claim's memory is not a
///   multiple of its class's memory granularity.
/// - [`Error::InvalidAllocation`] for a config `source` other than FromClass or FromClaim, or
///   a share whose `consumedCapacity.memory` is missing, zero or not a quantity of bytes, or
///   whose `consumedCapacity.compute` is not a percent.
pub fn resolve_allocation(claim: &ResourceClaim, driver: &str) -> Result<Vec<AllocatedDevice>> {
    let name = claim_name(claim);
    let allocation = claim
        .status
        .as_ref()
        .and_then(|status| status.allocation.as_ref())
        .ok_or_else(|| Error::NotAllocated {
            claim: name.clone(),
        })?;
    let devices = allocation.devices.as_ref();
    let results = devices
        .and_then(|d| d.results.as_deref())
        .unwrap_or_default();
    let configs = devices
        .and_then(|d| d.config.as_deref())
        .unwrap_or_default();

    let ours: Vec<(usize, &DeviceRequestAllocationResult)> = results
        .iter()
        .enumerate()
        .filter(|(_, r)| r.driver == driver)
        .collect();
    if ours.is_empty() {
        return Err(no_results_error(name, driver, results));
    }
    let configs = driver_configs(&name, configs, driver)?;
    ours.into_iter()
        .map(|(index, result)| resolve_device(&name, index, result, &configs))
        .collect()
}

/// `namespace/name` of a claim, for messages.
pub(crate) fn claim_name(claim: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The request a config's `requests` entry may name for a result of `request`: the result's
/// request itself, or for a subrequest `req/sub` also its parent `req`.
pub(crate) fn parent_request(request: &str) -> &str {
    request
        .split_once('/')
        .map_or(request, |(parent, _)| parent)
}

fn no_results_error(
    claim: String,
    driver: &str,
    results: &[DeviceRequestAllocationResult],
) -> Error {
    let present: BTreeSet<&str> = results.iter().map(|r| r.driver.as_str()).collect();
    let present = if present.is_empty() {
        "none".to_owned()
    } else {
        present.into_iter().collect::<Vec<_>>().join(", ")
    };
    Error::NoResultsForDriver {
        claim,
        driver: driver.to_owned(),
        present,
    }
}

/// A decoded config of this driver and where it came from.
struct DecodedConfig {
    /// Path of its `opaque.parameters`, for messages.
    path: String,
    requests: Vec<String>,
    config: OpaqueConfig,
}

impl DecodedConfig {
    fn applies_to(&self, request: &str) -> bool {
        self.requests.is_empty()
            || self
                .requests
                .iter()
                .any(|r| r == request || r == parent_request(request))
    }
}

/// This driver's configs in precedence order: FromClass entries, then FromClaim entries.
fn driver_configs(
    claim: &str,
    configs: &[DeviceAllocationConfiguration],
    driver: &str,
) -> Result<Vec<DecodedConfig>> {
    let mut from_class = Vec::new();
    let mut from_claim = Vec::new();
    for (i, entry) in configs.iter().enumerate() {
        let Some(opaque) = entry.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        let base = format!("status.allocation.devices.config[{i}]");
        let bucket = match entry.source.as_str() {
            SOURCE_FROM_CLASS => &mut from_class,
            SOURCE_FROM_CLAIM => &mut from_claim,
            other => {
                return Err(Error::InvalidAllocation {
                    claim: claim.to_owned(),
                    path: format!("{base}.source"),
                    message: format!(
                        "{other:?} is neither {SOURCE_FROM_CLASS} nor {SOURCE_FROM_CLAIM}"
                    ),
                });
            }
        };
        let path = format!("{base}.opaque.parameters");
        let config = decode_opaque(&opaque.parameters.0, &path)?;
        bucket.push(DecodedConfig {
            path,
            requests: entry.requests.clone().unwrap_or_default(),
            config,
        });
    }
    from_class.extend(from_claim);
    Ok(from_class)
}

/// The settings accumulated for one device, with where each came from for messages.
#[derive(Default)]
struct Merged<'a> {
    memory: Option<Memory>,
    compute: Option<u8>,
    sharing: Option<Sharing>,
    time_slice_interval: Option<TimeSliceInterval>,
    granularity: Option<(u64, String)>,
    slice: Option<&'a SliceDevice>,
}

struct Memory {
    bytes: u64,
    text: String,
    path: String,
}

fn resolve_device(
    claim: &str,
    index: usize,
    result: &DeviceRequestAllocationResult,
    configs: &[DecodedConfig],
) -> Result<AllocatedDevice> {
    let mut merged = Merged::default();
    for config in configs.iter().filter(|c| c.applies_to(&result.request)) {
        merge(&mut merged, config, result)?;
    }
    check_granularity(&merged)?;
    let share = match merged.slice {
        Some(_) => None,
        None => share::consumed(claim, index, result)?,
    };
    let (limits, sharing, share) = match (merged.slice, share) {
        (Some(slice), _) => (slice.limits(), slice.sharing, None),
        (None, Some((mut consumed, compute))) => {
            // A share runs beside others; Exclusive from a class meant for whole GPUs cannot
            // hold, so it counts as naming no sharing.
            let configured = merged.sharing.filter(|s| *s != Sharing::Exclusive);
            consumed.granularity = merged.granularity.as_ref().map(|(g, _)| *g);
            consumed.sharing_configured = configured.is_some();
            let limits = SliceLimits {
                memory_bytes: Some(consumed.memory_bytes),
                compute_percent: compute,
            };
            (limits, configured.unwrap_or(Sharing::Mps), Some(consumed))
        }
        (None, None) => (
            SliceLimits {
                memory_bytes: merged.memory.as_ref().map(|m| m.bytes),
                compute_percent: merged.compute,
            },
            merged.sharing.unwrap_or_default(),
            None,
        ),
    };
    // A claim may override the class's TimeSlicing with another strategy; the class's
    // interval then means nothing for this device.
    let time_slice_interval = if sharing == Sharing::TimeSlicing {
        merged
            .slice
            .and_then(|slice| slice.time_slice_interval)
            .or(merged.time_slice_interval)
            .unwrap_or_default()
    } else {
        TimeSliceInterval::Default
    };
    Ok(AllocatedDevice {
        request: result.request.clone(),
        pool: result.pool.clone(),
        device: result.device.clone(),
        share_id: result.share_id.clone(),
        admin_access: result.admin_access.unwrap_or(false),
        limits,
        sharing,
        time_slice_interval,
        expected_gpu_uuid: merged.slice.map(|slice| slice.gpu_uuid.clone()),
        enforcement: merged
            .slice
            .map(|slice| slice.enforcement)
            .unwrap_or_default(),
        share,
    })
}

fn merge<'a>(
    merged: &mut Merged<'a>,
    config: &'a DecodedConfig,
    result: &DeviceRequestAllocationResult,
) -> Result<()> {
    match &config.config {
        OpaqueConfig::Class(class) => {
            if let Some(sharing) = class.sharing {
                merged.sharing = Some(sharing.strategy);
                if sharing.time_slice_interval.is_some() {
                    merged.time_slice_interval = sharing.time_slice_interval;
                }
            }
            if let Some(granularity) = class.memory_granularity_bytes(&config.path)? {
                merged.granularity =
                    Some((granularity, join(&config.path, "slicing.memoryGranularity")));
            }
        }
        OpaqueConfig::Claim(claim) => {
            let limits = claim.limits(&config.path)?;
            if let (Some(bytes), Some(quantity)) = (limits.memory_bytes, &claim.memory) {
                merged.memory = Some(Memory {
                    bytes,
                    text: quantity.0.clone(),
                    path: join(&config.path, "memory"),
                });
            }
            if limits.compute_percent.is_some() {
                merged.compute = limits.compute_percent;
            }
            if claim.sharing.is_some() {
                merged.sharing = claim.sharing;
            }
        }
        OpaqueConfig::Slice(slice) => {
            if let Some(device) =
                slice.find(&result.pool, &result.device, result.share_id.as_deref())
            {
                merged.slice = Some(device);
            }
        }
    }
    Ok(())
}

fn check_granularity(merged: &Merged<'_>) -> Result<()> {
    let (Some(memory), Some((granularity, granularity_path))) =
        (&merged.memory, &merged.granularity)
    else {
        return Ok(());
    };
    if memory.bytes % granularity == 0 {
        return Ok(());
    }
    Err(Error::config(
        &memory.path,
        format!(
            "{:?} ({} bytes) is not a multiple of the class memory granularity {} ({granularity_path})",
            memory.text,
            memory.bytes,
            format_bytes(*granularity)
        ),
    ))
}

#[cfg(test)]
mod tests;
