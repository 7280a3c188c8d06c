//! GPU discovery through NVML (nvml-wrapper, which loads `libnvidia-ml.so` at run time).
//!
//! This layer only asks NVML and copies the answers into `RawSystem`; the interpretation is
//! in [`super::facts`]. The facts nvml-wrapper 0.13 has no safe call for — MIG GPU-instance
//! and compute-instance ids, MIG placements, the NVLink fabric registration — come from the
//! raw calls of `super::nvml_raw`.
//!
//! Those facts may still be unknown: a driver too old to have the call, or an NVML error (the
//! placement lookup needs a privileged user). Without ids and placement a MIG device cannot be
//! named or given its capability devices, so such devices are left out with a warning rather
//! than published wrongly; a GPU whose fabric is unknown is published without an NVLink
//! domain.

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::Brand;
use nvml_wrapper::enums::device::DeviceArchitecture;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, NvLink};

use super::facts::{
    DynamicMigPolicy, HostPaths, RawGiProfile, RawGpu, RawMig, RawSystem, build_inventory,
    ids_from_legacy_mig_uuid,
};
use super::nvml_raw;
use super::{DeviceDiscovery, DynamicMigSource};
use crate::{Error, Result};
use kerf_core::inventory::Inventory;

/// NVML's `NVML_NVLINK_MAX_LINKS`: the most NVLinks one GPU has.
const NVLINK_MAX_LINKS: u32 = 18;
/// NVML's `NVML_DEVICE_MIG_ENABLE`.
const MIG_ENABLED: u32 = 1;

/// Discovers the node's GPUs through NVML.
pub(crate) struct NvmlDiscovery {
    nvml: Nvml,
    host: HostPaths,
    dynamic_mig: Option<DynamicMigSource>,
}

impl std::fmt::Debug for NvmlDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlDiscovery")
            .field("host", &self.host)
            .finish_non_exhaustive()
    }
}

impl NvmlDiscovery {
    /// Loads and initialises NVML, reading sysfs and procfs at `/sys` and `/proc`.
    ///
    /// # Errors
    /// [`Error::Nvml`] with the library's message when `libnvidia-ml.so` cannot be loaded or
    /// NVML does not initialise (no driver, no permission).
    pub fn init() -> Result<Self> {
        Self::init_with_host_paths(HostPaths::default())
    }

    /// Loads and initialises NVML, reading sysfs and procfs under `host`.
    ///
    /// # Errors
    /// As [`NvmlDiscovery::init`].
    fn init_with_host_paths(host: HostPaths) -> Result<Self> {
        let nvml = Nvml::init().map_err(|e| Error::Nvml(format!("initialise: {}", message(&e))))?;
        Ok(NvmlDiscovery {
            nvml,
            host,
            dynamic_mig: None,
        })
    }

    /// Marks MIG-enabled GPUs as dynamic-MIG GPUs as the policy `source` returns decides
    /// ([`super::facts::dynamic_decision`]). `source` is asked at every discovery, because the
    /// MIG instances kerf created (which do not make a GPU static) change as claims are
    /// prepared. Without it no GPU is dynamic.
    #[must_use]
    pub(crate) fn with_dynamic_mig(mut self, source: DynamicMigSource) -> Self {
        self.dynamic_mig = Some(source);
        self
    }

    fn gather(&self) -> Result<RawSystem> {
        let driver_version = self
            .nvml
            .sys_driver_version()
            .map_err(call_failed("driver version"))?;
        let cuda_driver_version = self.nvml.sys_cuda_driver_version().ok();
        let count = self
            .nvml
            .device_count()
            .map_err(call_failed("device count"))?;
        let mut gpus = Vec::new();
        for index in 0..count {
            let device = self
                .nvml
                .device_by_index(index)
                .map_err(call_failed_for(index, "device handle"))?;
            gpus.push(raw_gpu(index, &device)?);
        }
        Ok(RawSystem {
            driver_version,
            cuda_driver_version,
            gpus,
        })
    }
}

impl DeviceDiscovery for NvmlDiscovery {
    fn discover(&self) -> Result<Inventory> {
        let raw = self.gather()?;
        let host = self.host.facts_for(&raw);
        let policy = self
            .dynamic_mig
            .as_ref()
            .map_or_else(DynamicMigPolicy::default, |source| source());
        let converted = build_inventory(&raw, &host, &policy);
        for reason in &converted.skipped {
            tracing::warn!(%reason, "device left out of the inventory");
        }
        for note in &converted.notes {
            tracing::info!(%note, "MIG discovery");
        }
        converted.inventory.validate()?;
        Ok(converted.inventory)
    }

    fn source(&self) -> &'static str {
        "nvml"
    }
}

/// The facts NVML must answer for a GPU to be usable, and the ones it may not.
fn raw_gpu(index: u32, device: &Device<'_>) -> Result<RawGpu> {
    let required = |call| call_failed_for(index, call);
    let cc = device
        .cuda_compute_capability()
        .map_err(required("compute capability"))?;
    let uuid = device.uuid().map_err(required("UUID"))?;
    Ok(RawGpu {
        index,
        minor: device.minor_number().map_err(required("minor number"))?,
        name: device.name().map_err(required("name"))?,
        brand: device
            .brand()
            .map_or_else(|_| "Unknown".to_owned(), |b| brand_name(b).to_owned()),
        architecture: device.architecture().map_or_else(
            |_| "Unknown".to_owned(),
            |a| architecture_name(&a).to_owned(),
        ),
        compute_capability: (cc.major, cc.minor),
        memory_total_bytes: device.memory_info().map_err(required("memory info"))?.total,
        // nvmlDeviceGetAttributes is documented for MIG handles only; some drivers answer it
        // for whole GPUs too. The CUDA core count is the fallback.
        multiprocessors: device.attributes().ok().map(|a| a.multiprocessor_count),
        cuda_cores: device.num_cores().ok(),
        pci_bus_id: device.pci_info().map_err(required("PCI info"))?.bus_id,
        nvlink_remotes: nvlink_remotes(device),
        mig_enabled: device.mig_mode().is_ok_and(|m| m.current == MIG_ENABLED),
        mig_devices: raw_migs(device),
        mig_profiles: raw_mig_profiles(device, &uuid),
        fabric: known(nvml_raw::gpu_fabric_info(device), &uuid, "NVLink fabric"),
        uuid,
    })
}

/// The remote PCI address of every active NVLink; `None` for an active link whose far end
/// NVML cannot name.
fn nvlink_remotes(device: &Device<'_>) -> Vec<Option<String>> {
    let mut remotes = Vec::new();
    for link in 0..NVLINK_MAX_LINKS {
        let link: NvLink<'_, '_> = device.link_wrapper_for(link);
        match link.is_active() {
            Ok(true) => remotes.push(link.remote_pci_info().ok().map(|pci| pci.bus_id)),
            // No NVLink at all, or no link with this number: later numbers will not exist.
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => break,
            // An inactive link, or one NVML failed to query, connects nothing.
            Ok(false) | Err(_) => {}
        }
    }
    remotes
}

/// The MIG devices that exist on a MIG-enabled GPU. NVML's count is the maximum; empty slots
/// answer `NotFound`.
fn raw_migs(device: &Device<'_>) -> Vec<RawMig> {
    if !device.mig_mode().is_ok_and(|m| m.current == MIG_ENABLED) {
        return Vec::new();
    }
    let Ok(max) = device.mig_device_count() else {
        return Vec::new();
    };
    (0..max)
        .filter_map(|i| device.mig_device_by_index(i).ok())
        .filter_map(|mig| raw_mig(device, &mig))
        .collect()
}

/// The GPU-instance profiles of a MIG-enabled GPU with their placements; empty (the built-in
/// catalogue then serves) when MIG mode is off or NVML cannot list them.
fn raw_mig_profiles(device: &Device<'_>, uuid: &str) -> Vec<RawGiProfile> {
    if !device.mig_mode().is_ok_and(|m| m.current == MIG_ENABLED) {
        return Vec::new();
    }
    nvml_raw::gi_profiles(device).unwrap_or_else(|error| {
        tracing::warn!(
            device = uuid,
            call = error.call,
            code = error.code,
            "NVML could not list the MIG profiles; the built-in catalogue serves if there is one"
        );
        Vec::new()
    })
}

/// One MIG device of `parent`; `None` when NVML cannot even say what it is.
fn raw_mig(parent: &Device<'_>, mig: &Device<'_>) -> Option<RawMig> {
    let attributes = mig.attributes().ok()?;
    let uuid = mig.uuid().ok()?;
    let ids = known(
        nvml_raw::mig_ids(mig),
        &uuid,
        "GPU and compute instance ids",
    );
    // Drivers before R470 also spell the ids out in the UUID.
    let gi_id = ids
        .map(|ids| ids.gi_id)
        .or_else(|| ids_from_legacy_mig_uuid(&uuid).map(|(gi, _)| gi));
    let placement = gi_id.and_then(|gi_id| {
        known(
            nvml_raw::gpu_instance_placement(parent, gi_id),
            &uuid,
            "GPU instance placement",
        )
    });
    Some(RawMig {
        memory_total_bytes: mig.memory_info().ok()?.total,
        multiprocessors: attributes.multiprocessor_count,
        gpu_instance_slices: attributes.gpu_instance_slice_count,
        compute_instance_slices: attributes.compute_instance_slice_count,
        memory_size_mib: attributes.memory_size_mb,
        gi_id: ids.map(|ids| ids.gi_id),
        ci_id: ids.map(|ids| ids.ci_id),
        placement,
        uuid,
    })
}

/// The fact NVML answered, or `None` with a warning naming the device and the fact when NVML
/// failed: a missing fact leaves a device out or unadorned, and the operator needs to see why.
fn known<T>(answer: Result<Option<T>>, device: &str, fact: &'static str) -> Option<T> {
    answer.unwrap_or_else(|error| {
        tracing::warn!(device, fact, %error, "NVML could not report this fact");
        None
    })
}

/// Display name of an NVML brand, as `nvidia-smi -q` prints it.
pub(crate) fn brand_name(brand: Brand) -> &'static str {
    match brand {
        Brand::Nvidia => "NVIDIA",
        Brand::Tesla => "Tesla",
        Brand::Quadro => "Quadro",
        Brand::QuadroRTX => "Quadro RTX",
        Brand::NvidiaRTX => "NVIDIA RTX",
        Brand::GeForce => "GeForce",
        Brand::GeForceRTX => "GeForce RTX",
        Brand::Titan => "Titan",
        Brand::TitanRTX => "Titan RTX",
        Brand::NVS => "NVS",
        Brand::GRID => "GRID",
        Brand::VApps => "NVIDIA Virtual Applications",
        Brand::VPC => "NVIDIA Virtual PC",
        Brand::VCS => "NVIDIA Virtual Compute Server",
        Brand::VWS => "NVIDIA RTX Virtual Workstation",
        Brand::CloudGaming | Brand::VGaming => "NVIDIA Cloud Gaming",
        Brand::Unknown => "Unknown",
    }
}

/// Architecture name as kerf publishes it: NVIDIA's names, with Ada spelled out as
/// `Ada Lovelace`.
pub(crate) fn architecture_name(architecture: &DeviceArchitecture) -> &'static str {
    match architecture {
        DeviceArchitecture::Kepler => "Kepler",
        DeviceArchitecture::Maxwell => "Maxwell",
        DeviceArchitecture::Pascal => "Pascal",
        DeviceArchitecture::Volta => "Volta",
        DeviceArchitecture::Turing => "Turing",
        DeviceArchitecture::Ampere => "Ampere",
        DeviceArchitecture::Ada => "Ada Lovelace",
        DeviceArchitecture::Hopper => "Hopper",
        DeviceArchitecture::Blackwell => "Blackwell",
        DeviceArchitecture::Unknown => "Unknown",
    }
}

/// The error and its sources, e.g. the loader's `libnvidia-ml.so: cannot open shared object
/// file` behind nvml-wrapper's `a libloading error occurred`.
fn message(error: &NvmlError) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

fn call_failed(call: &'static str) -> impl Fn(NvmlError) -> Error {
    move |e| Error::Nvml(format!("{call}: {}", message(&e)))
}

fn call_failed_for(index: u32, call: &'static str) -> impl Fn(NvmlError) -> Error {
    move |e| Error::Nvml(format!("GPU {index}: {call}: {}", message(&e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This machine has no NVIDIA driver: initialisation must fail with the loader's message,
    /// not panic. On a machine with a driver there is nothing to check here.
    #[test]
    fn init_without_a_driver_fails_with_a_clear_error() {
        match NvmlDiscovery::init() {
            Ok(discovery) => assert_eq!(discovery.source(), "nvml"),
            Err(Error::Nvml(message)) => {
                assert!(message.starts_with("initialise: "), "{message}");
                assert!(message.contains("libnvidia-ml"), "{message}");
            }
            Err(other) => panic!("expected Error::Nvml, got {other:?}"),
        }
    }

    #[test]
    fn display_names() {
        assert_eq!(architecture_name(&DeviceArchitecture::Ada), "Ada Lovelace");
        assert_eq!(architecture_name(&DeviceArchitecture::Hopper), "Hopper");
        assert_eq!(brand_name(Brand::Nvidia), "NVIDIA");
        assert_eq!(brand_name(Brand::Tesla), "Tesla");
    }
}
