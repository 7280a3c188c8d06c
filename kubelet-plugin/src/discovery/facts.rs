//! Raw facts about the node's GPUs, as NVML and sysfs/procfs report them, and the pure
//! functions that turn them into a [`kerf_core::inventory::Inventory`].
//!
//! The NVML layer ([`super::nvml`]) only fills these plain structs; everything that interprets
//! a value — PCI address normalisation, sysfs path parsing, SM counts, MIG profile names, NVLink
//! peer sets — lives here, where it is unit-tested without a GPU. The only reads of the host's
//! files are in [`host`] (`HostPaths`), which hands their text to the parsers here; the MIG
//! facts (MIG devices, the capability-device table and major) are in [`mig`].

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Component, Path};

use kerf_core::inventory::{ComputeCapability, Gpu, Inventory};

mod dynamic_mig;
mod host;
mod mig;

pub(crate) use dynamic_mig::{
    DynamicMigPolicy, KerfInstances, RawGiProfile, dynamic_decision, gpu_catalog,
};
pub(crate) use host::HostPaths;
pub use mig::MigMinors;
use mig::convert_mig;
pub(crate) use mig::{
    RawMig, caps_major_from_proc_devices, ids_from_legacy_mig_uuid, mig_profile_name,
};

const MIB: u64 = 1024 * 1024;

/// What NVML reported about the whole node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RawSystem {
    /// `nvmlSystemGetDriverVersion`, e.g. `570.124.06`.
    pub driver_version: String,
    /// `nvmlSystemGetCudaDriverVersion`, e.g. `12080`, when available.
    pub cuda_driver_version: Option<i32>,
    /// One entry per NVML device index.
    pub gpus: Vec<RawGpu>,
}

/// What NVML reported about one physical GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawGpu {
    /// NVML enumeration index.
    pub index: u32,
    /// `/dev/nvidia<minor>`.
    pub minor: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Brand, already in display form (see `super::nvml::brand_name`).
    pub brand: String,
    /// Architecture, already in display form (see `super::nvml::architecture_name`).
    pub architecture: String,
    /// CUDA compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Total framebuffer memory in bytes.
    pub memory_total_bytes: u64,
    /// SM count from `nvmlDeviceGetAttributes`, when the driver answers it for a whole GPU.
    pub multiprocessors: Option<u32>,
    /// CUDA core count from `nvmlDeviceGetNumGpuCores`, the fallback for the SM count.
    pub cuda_cores: Option<u32>,
    /// PCI bus id in NVML's form, e.g. `00000000:1B:00.0`.
    pub pci_bus_id: String,
    /// One entry per active NVLink: the remote end's PCI bus id in NVML's form, or `None`
    /// when NVML could not say what is at the other end.
    pub nvlink_remotes: Vec<Option<String>>,
    /// Current (not pending) MIG mode.
    pub mig_enabled: bool,
    /// The MIG devices that exist now.
    pub mig_devices: Vec<RawMig>,
    /// The GPU-instance profiles NVML offers, with their placements; empty when MIG mode is
    /// off or the driver lacks the calls.
    pub mig_profiles: Vec<RawGiProfile>,
    /// `nvmlDeviceGetGpuFabricInfo[V]`, when the GPU and driver answer it.
    pub fabric: Option<RawFabric>,
}

/// What `nvmlDeviceGetGpuFabricInfo[V]` reported about a GPU's NVLink fabric registration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RawFabric {
    /// UUID of the NVLink cluster (multi-node NVLink domain); all zeros when there is none.
    pub cluster_uuid: [u8; 16],
    /// The clique (partition) within the cluster.
    pub clique_id: u32,
    /// `NVML_GPU_FABRIC_STATE_*`: how far the GPU's registration with the fabric manager got.
    pub state: u8,
    /// NVML return code of the registration, meaningful once it completed.
    pub status: u32,
}

/// NVML's `NVML_GPU_FABRIC_STATE_COMPLETED`.
pub(crate) const FABRIC_STATE_COMPLETED: u8 = 3;
/// NVML's `NVML_SUCCESS`.
pub(crate) const NVML_SUCCESS: u32 = 0;

/// Facts about a PCI device read from sysfs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PciHostFacts {
    /// `numa_node`, `None` when the platform reports -1 or nothing.
    pub numa_node: Option<u32>,
    /// `pci<domain>:<bus>` root complex from the device's sysfs path.
    pub pcie_root: Option<String>,
}

/// Facts from the host's sysfs and procfs, keyed by normalised PCI bus id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct HostFacts {
    /// Per GPU PCI bus id (sysfs form).
    pub pci: BTreeMap<String, PciHostFacts>,
    /// The driver's MIG capability table.
    pub mig_minors: MigMinors,
}

/// Turns NVML's PCI bus id (`00000000:1B:00.0`, 8-digit domain, uppercase) into sysfs form
/// (`0000:1b:00.0`), the form `/sys/bus/pci/devices` and `resource.kubernetes.io/pciBusID`
/// use. `None` when it is not a PCI address.
fn normalize_bus_id(nvml: &str) -> Option<String> {
    let mut parts = nvml.trim().split(':');
    let (domain, bus, rest) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let (device, function) = rest.split_once('.')?;
    let hex = |s: &str, max_len: usize| {
        (!s.is_empty() && s.len() <= max_len && s.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(s, 16).ok())
            .flatten()
    };
    let (domain, bus) = (hex(domain, 8)?, hex(bus, 2)?);
    let (device, function) = (hex(device, 2)?, hex(function, 1)?);
    if device > 0x1f || function > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

/// Reads sysfs `numa_node`: a number, or -1 when the platform has no NUMA information.
fn parse_numa_node(text: &str) -> Option<u32> {
    text.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// The PCIe root complex (`pci0000:15`) from the target of `/sys/bus/pci/devices/<bus id>`,
/// e.g. `../../../devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:18:00.0`: the first
/// component under `devices`. `None` when the link does not end at `bus_id` or has no root.
fn pcie_root_from_sysfs_link(target: &Path, bus_id: &str) -> Option<String> {
    if target.file_name()?.to_str()? != bus_id {
        return None;
    }
    let mut components = target
        .components()
        .skip_while(|c| *c != Component::Normal("devices".as_ref()));
    components.next()?;
    let root = components.next()?.as_os_str().to_str()?;
    is_pcie_root(root).then(|| root.to_owned())
}

fn is_pcie_root(value: &str) -> bool {
    let Some((domain, bus)) = value.strip_prefix("pci").and_then(|r| r.split_once(':')) else {
        return false;
    };
    let hex = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    domain.len() >= 4 && bus.len() == 2 && hex(domain) && hex(bus)
}

/// CUDA cores per SM for a compute capability; `None` for capabilities kerf does not know.
fn cores_per_sm(major: i32, minor: i32) -> Option<u32> {
    match (major, minor) {
        (3, _) => Some(192),
        (5 | 9..=12, _) | (6, 1 | 2) | (8, 6..=9) => Some(128),
        (6 | 8, 0) | (7, _) => Some(64),
        _ => None,
    }
}

/// The GPU's SM count: NVML's attribute when it gave one, else CUDA cores divided by the cores
/// per SM of its compute capability.
pub fn multiprocessors(gpu: &RawGpu) -> Option<u32> {
    if let Some(sms) = gpu.multiprocessors.filter(|&n| n > 0) {
        return Some(sms);
    }
    let (major, minor) = gpu.compute_capability;
    let per_sm = cores_per_sm(major, minor)?;
    gpu.cuda_cores
        .map(|cores| cores / per_sm)
        .filter(|&n| n > 0)
}

/// The NVLink domain a GPU belongs to, `<cluster UUID>.<clique id>`, e.g.
/// `6f1c2a8e-4b7d-4e19-9a3c-52d0e8f1b764.32766`: the GPUs that share both can reach each
/// other's memory over NVLink, across nodes too. `None` until the GPU's fabric registration
/// has completed successfully, and when the cluster UUID is all zeros (a GPU outside any
/// multi-node NVLink fabric reports a completed registration with no cluster).
pub fn nvlink_domain(fabric: &RawFabric) -> Option<String> {
    if fabric.state != FABRIC_STATE_COMPLETED || fabric.status != NVML_SUCCESS {
        return None;
    }
    if fabric.cluster_uuid.iter().all(|&b| b == 0) {
        return None;
    }
    Some(format!(
        "{}.{}",
        format_uuid(&fabric.cluster_uuid),
        fabric.clique_id
    ))
}

/// The canonical text form of a 16-byte UUID: lowercase hex in 8-4-4-4-12 groups, bytes in
/// order (RFC 9562), as `uuid.FromBytes` and NVIDIA's tools print a fabric cluster UUID.
fn format_uuid(bytes: &[u8; 16]) -> String {
    let mut text = String::with_capacity(36);
    for (i, byte) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            text.push('-');
        }
        // Writing to a String cannot fail.
        let _ = write!(text, "{byte:02x}");
    }
    text
}

/// NVLink peers by minor: a GPU is a peer of every GPU whose PCI address one of its active
/// links reaches, and all GPUs with an active link to something that is not a GPU (an
/// NVSwitch, or an end NVML could not identify) are peers of each other through the switch
/// fabric. The relation is made symmetric.
pub fn nvlink_peers(gpus: &[RawGpu]) -> BTreeMap<u32, Vec<u32>> {
    let minor_by_bus: BTreeMap<String, u32> = gpus
        .iter()
        .filter_map(|g| Some((normalize_bus_id(&g.pci_bus_id)?, g.minor)))
        .collect();
    let mut peers: BTreeMap<u32, BTreeSet<u32>> =
        gpus.iter().map(|g| (g.minor, BTreeSet::new())).collect();
    let mut switched = BTreeSet::new();
    for gpu in gpus {
        for remote in &gpu.nvlink_remotes {
            match remote
                .as_deref()
                .and_then(normalize_bus_id)
                .and_then(|b| minor_by_bus.get(&b))
            {
                Some(&peer) if peer != gpu.minor => {
                    peers.entry(gpu.minor).or_default().insert(peer);
                    peers.entry(peer).or_default().insert(gpu.minor);
                }
                Some(_) => {}
                None => {
                    switched.insert(gpu.minor);
                }
            }
        }
    }
    for &a in &switched {
        for &b in &switched {
            if a != b {
                peers.entry(a).or_default().insert(b);
            }
        }
    }
    peers
        .into_iter()
        .map(|(minor, set)| (minor, set.into_iter().collect()))
        .collect()
}

/// The result of converting raw facts: the inventory, and what had to be left out and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Converted {
    /// The inventory (not yet validated).
    pub inventory: Inventory,
    /// One message per GPU or MIG device left out, or MIG catalogue NVML described wrongly.
    pub skipped: Vec<String>,
    /// Facts worth an info line: whether each MIG-enabled GPU is a dynamic-MIG GPU and why
    /// not, and how NVML's MIG catalogue differs from the built-in one.
    pub notes: Vec<String>,
}

/// Converts raw NVML facts and host facts into an inventory. GPUs and MIG devices whose
/// essential facts are missing are left out with a message in [`Converted::skipped`], so one
/// odd device does not hide the others. MIG-enabled GPUs get their catalogue
/// ([`gpu_catalog`]) and are dynamic-MIG GPUs as `policy` decides ([`dynamic_decision`]).
pub(crate) fn build_inventory(
    raw: &RawSystem,
    host: &HostFacts,
    policy: &DynamicMigPolicy,
) -> Converted {
    let peers = nvlink_peers(&raw.gpus);
    let mut skipped = Vec::new();
    let mut notes = Vec::new();
    let mut gpus = Vec::new();
    for gpu in &raw.gpus {
        match convert_gpu(gpu, host, &peers, &mut skipped) {
            Ok(mut converted) => {
                if gpu.mig_enabled {
                    let (catalog, dynamic) =
                        mig_partitioning(gpu, policy, &mut notes, &mut skipped);
                    converted.mig_catalog = catalog;
                    converted.dynamic_mig = dynamic;
                }
                gpus.push(converted);
            }
            Err(reason) => skipped.push(format!("GPU {} ({}): {reason}", gpu.minor, gpu.uuid)),
        }
    }
    // A peer that was itself left out must not be referenced.
    let kept: BTreeSet<u32> = gpus.iter().map(|g| g.minor).collect();
    for gpu in &mut gpus {
        gpu.nvlink_peers.retain(|p| kept.contains(p));
    }
    let cuda_driver_version = raw
        .cuda_driver_version
        .filter(|&v| v > 0)
        .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10));
    Converted {
        inventory: Inventory {
            driver_version: raw.driver_version.clone(),
            cuda_driver_version,
            gpus,
        },
        skipped,
        notes,
    }
}

/// The catalogue of a MIG-enabled GPU and whether it is a dynamic-MIG GPU. An inconsistent
/// NVML answer falls back to the built-in catalogue with a message in `skipped`.
fn mig_partitioning(
    gpu: &RawGpu,
    policy: &DynamicMigPolicy,
    notes: &mut Vec<String>,
    skipped: &mut Vec<String>,
) -> (Option<kerf_core::mig_catalog::GpuMigCatalog>, bool) {
    let label = format!("GPU {} ({})", gpu.minor, gpu.uuid);
    let catalog = match gpu_catalog(gpu) {
        Ok((catalog, difference)) => {
            if let Some(difference) = difference {
                notes.push(format!(
                    "{label}: NVML's MIG profiles differ from the built-in catalogue of {:?} \
                     ({difference}); NVML's are used",
                    gpu.name
                ));
            }
            catalog
        }
        Err(reason) => {
            skipped.push(format!(
                "{label}: NVML's MIG profiles are unusable ({reason}); the built-in catalogue \
                 serves if there is one"
            ));
            kerf_core::mig_catalog::catalog_for(&gpu.name).cloned()
        }
    };
    let dynamic = match dynamic_decision(gpu, catalog.as_ref(), policy) {
        Ok(()) => {
            notes.push(format!("{label}: dynamic MIG"));
            true
        }
        Err(reason) => {
            notes.push(format!("{label}: not a dynamic-MIG GPU: {reason}"));
            false
        }
    };
    (catalog, dynamic)
}

fn convert_gpu(
    gpu: &RawGpu,
    host: &HostFacts,
    peers: &BTreeMap<u32, Vec<u32>>,
    skipped: &mut Vec<String>,
) -> Result<Gpu, String> {
    let pci_bus_id = normalize_bus_id(&gpu.pci_bus_id)
        .ok_or_else(|| format!("PCI bus id {:?} is not a PCI address", gpu.pci_bus_id))?;
    let multiprocessors = multiprocessors(gpu).ok_or_else(|| {
        format!(
            "SM count unknown (no attribute, {:?} CUDA cores, compute capability {}.{})",
            gpu.cuda_cores, gpu.compute_capability.0, gpu.compute_capability.1
        )
    })?;
    let (major, minor) = gpu.compute_capability;
    let compute_capability = ComputeCapability {
        major: u32::try_from(major).map_err(|_| format!("compute capability major {major}"))?,
        minor: u32::try_from(minor).map_err(|_| format!("compute capability minor {minor}"))?,
    };
    let pci = host.pci.get(&pci_bus_id).cloned().unwrap_or_default();
    let parent_memory_mib = gpu.memory_total_bytes / MIB;
    let mut mig_devices = Vec::new();
    for mig in gpu.mig_devices.iter().filter(|_| gpu.mig_enabled) {
        match convert_mig(gpu.minor, parent_memory_mib, mig, &host.mig_minors) {
            Ok(device) => mig_devices.push(device),
            Err(reason) => {
                skipped.push(format!(
                    "MIG device {} of GPU {}: {reason}",
                    mig.uuid, gpu.minor
                ));
            }
        }
    }
    Ok(Gpu {
        index: gpu.index,
        minor: gpu.minor,
        uuid: gpu.uuid.clone(),
        product_name: gpu.name.clone(),
        brand: gpu.brand.clone(),
        architecture: gpu.architecture.clone(),
        compute_capability,
        memory_bytes: gpu.memory_total_bytes,
        multiprocessors,
        pci_bus_id,
        pcie_root: pci.pcie_root,
        numa_node: pci.numa_node,
        nvlink_peers: peers.get(&gpu.minor).cloned().unwrap_or_default(),
        nvlink_domain: gpu.fabric.as_ref().and_then(nvlink_domain),
        mig_enabled: gpu.mig_enabled,
        mig_devices,
        mig_catalog: None,
        dynamic_mig: false,
    })
}

#[cfg(test)]
mod tests;
