//! Raw facts about the node's GPUs, as NVML and sysfs/procfs report them, and the pure
//! functions that turn them into a [`kerf_core::inventory::Inventory`].
//!
//! The NVML layer ([`super::nvml`]) only fills these plain structs; everything that interprets
//! a value — PCI address normalisation, sysfs path parsing, SM counts, MIG profile names, NVLink
//! peer sets — lives here, where it is unit-tested without a GPU. The only reads of the host's
//! files are in [`host`] ([`HostPaths`]), which hands their text to the parsers here.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Component, Path};

use kerf_core::inventory::{ComputeCapability, Gpu, Inventory, MigDevice, MigPlacement};

mod host;

pub use host::HostPaths;

const MIB: u64 = 1024 * 1024;

/// What NVML reported about the whole node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawSystem {
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
    /// Brand, already in display form (see [`super::nvml::brand_name`]).
    pub brand: String,
    /// Architecture, already in display form (see [`super::nvml::architecture_name`]).
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
pub const FABRIC_STATE_COMPLETED: u8 = 3;
/// NVML's `NVML_SUCCESS`.
pub const NVML_SUCCESS: u32 = 0;

/// What NVML reported about one MIG device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawMig {
    /// `MIG-…` UUID.
    pub uuid: String,
    /// Memory of the MIG device as CUDA sees it, in bytes.
    pub memory_total_bytes: u64,
    /// `nvmlDeviceGetAttributes`: SMs.
    pub multiprocessors: u32,
    /// `nvmlDeviceGetAttributes`: GPU-instance slices (the `Ng` of the profile).
    pub gpu_instance_slices: u32,
    /// `nvmlDeviceGetAttributes`: compute-instance slices (the `Nc` of the profile).
    pub compute_instance_slices: u32,
    /// `nvmlDeviceGetAttributes`: memory of the profile in MiB.
    pub memory_size_mib: u64,
    /// GPU instance id, when known.
    pub gi_id: Option<u32>,
    /// Compute instance id, when known.
    pub ci_id: Option<u32>,
    /// Placement of the GPU instance, when known.
    pub placement: Option<MigPlacement>,
}

/// Facts about a PCI device read from sysfs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PciHostFacts {
    /// `numa_node`, `None` when the platform reports -1 or nothing.
    pub numa_node: Option<u32>,
    /// `pci<domain>:<bus>` root complex from the device's sysfs path.
    pub pcie_root: Option<String>,
}

/// Facts from the host's sysfs and procfs, keyed by normalised PCI bus id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// Per GPU PCI bus id (sysfs form).
    pub pci: BTreeMap<String, PciHostFacts>,
    /// The driver's MIG capability table.
    pub mig_minors: MigMinors,
}

/// The driver's table of MIG capability device minors
/// (`/proc/driver/nvidia-caps/mig-minors`): `gpu<minor>/gi<id>/access <cap minor>` and
/// `gpu<minor>/gi<id>/ci<id>/access <cap minor>`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigMinors {
    gpu_instances: BTreeMap<(u32, u32), u32>,
    compute_instances: BTreeMap<(u32, u32, u32), u32>,
}

impl MigMinors {
    /// Parses the table; lines it does not understand (`config 1`, `monitor 2`, anything
    /// newer) are skipped.
    pub fn parse(text: &str) -> Self {
        let mut minors = MigMinors::default();
        for line in text.lines() {
            let Some((path, minor)) = line.trim().split_once(char::is_whitespace) else {
                continue;
            };
            let Ok(minor) = minor.trim().parse::<u32>() else {
                continue;
            };
            let parts: Vec<&str> = path.split('/').collect();
            match parts.as_slice() {
                [gpu, gi, "access"] => {
                    if let (Some(gpu), Some(gi)) = (numbered(gpu, "gpu"), numbered(gi, "gi")) {
                        minors.gpu_instances.insert((gpu, gi), minor);
                    }
                }
                [gpu, gi, ci, "access"] => {
                    if let (Some(gpu), Some(gi), Some(ci)) =
                        (numbered(gpu, "gpu"), numbered(gi, "gi"), numbered(ci, "ci"))
                    {
                        minors.compute_instances.insert((gpu, gi, ci), minor);
                    }
                }
                _ => {}
            }
        }
        minors
    }

    /// The capability minors `(gpu instance, compute instance)` of `gpu/gi/ci`.
    pub fn lookup(&self, gpu: u32, gi: u32, ci: u32) -> Option<(u32, u32)> {
        Some((
            *self.gpu_instances.get(&(gpu, gi))?,
            *self.compute_instances.get(&(gpu, gi, ci))?,
        ))
    }
}

fn numbered(part: &str, prefix: &str) -> Option<u32> {
    part.strip_prefix(prefix)?.parse().ok()
}

/// Turns NVML's PCI bus id (`00000000:1B:00.0`, 8-digit domain, uppercase) into sysfs form
/// (`0000:1b:00.0`), the form `/sys/bus/pci/devices` and `resource.kubernetes.io/pciBusID`
/// use. `None` when it is not a PCI address.
pub fn normalize_bus_id(nvml: &str) -> Option<String> {
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
pub fn parse_numa_node(text: &str) -> Option<u32> {
    text.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// The PCIe root complex (`pci0000:15`) from the target of `/sys/bus/pci/devices/<bus id>`,
/// e.g. `../../../devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:18:00.0`: the first
/// component under `devices`. `None` when the link does not end at `bus_id` or has no root.
pub fn pcie_root_from_sysfs_link(target: &Path, bus_id: &str) -> Option<String> {
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
pub fn cores_per_sm(major: i32, minor: i32) -> Option<u32> {
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

/// The MIG profile name NVML would print, e.g. `1g.5gb` or `1c.3g.20gb`, from the device's
/// slices and memory and the parent's total memory (both in MiB). The memory figure is the
/// MIG device's share of the parent rounded up to eighths, times the parent's memory in GB
/// rounded up, rounded to the nearest GB. Media-engine variants (`+me`, `+gfx`) are not
/// visible in these attributes and come out without the suffix.
pub fn mig_profile_name(
    gpu_instance_slices: u32,
    compute_instance_slices: u32,
    memory_mib: u64,
    parent_memory_mib: u64,
) -> Option<String> {
    if gpu_instance_slices == 0 || parent_memory_mib == 0 {
        return None;
    }
    let eighths = (8 * memory_mib).div_ceil(parent_memory_mib);
    let parent_gb = parent_memory_mib.div_ceil(1024);
    // round(eighths * parent_gb / 8)
    let gb = (eighths * parent_gb * 2 + 8) / 16;
    let base = format!("{gpu_instance_slices}g.{gb}gb");
    if compute_instance_slices > 0 && compute_instance_slices < gpu_instance_slices {
        Some(format!("{compute_instance_slices}c.{base}"))
    } else {
        Some(base)
    }
}

/// GPU and compute instance ids encoded in the MIG UUID form of drivers before R470:
/// `MIG-GPU-<parent uuid>/<gi>/<ci>`. Newer drivers use opaque `MIG-<uuid>` UUIDs.
pub fn ids_from_legacy_mig_uuid(uuid: &str) -> Option<(u32, u32)> {
    let rest = uuid.strip_prefix("MIG-GPU-")?;
    let mut parts = rest.rsplitn(3, '/');
    let ci = parts.next()?.parse().ok()?;
    let gi = parts.next()?.parse().ok()?;
    parts.next()?;
    Some((gi, ci))
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
pub fn format_uuid(bytes: &[u8; 16]) -> String {
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
pub struct Converted {
    /// The inventory (not yet validated).
    pub inventory: Inventory,
    /// One message per GPU or MIG device left out.
    pub skipped: Vec<String>,
}

/// Converts raw NVML facts and host facts into an inventory. GPUs and MIG devices whose
/// essential facts are missing are left out with a message in [`Converted::skipped`], so one
/// odd device does not hide the others.
pub fn build_inventory(raw: &RawSystem, host: &HostFacts) -> Converted {
    let peers = nvlink_peers(&raw.gpus);
    let mut skipped = Vec::new();
    let mut gpus = Vec::new();
    for gpu in &raw.gpus {
        match convert_gpu(gpu, host, &peers, &mut skipped) {
            Ok(converted) => gpus.push(converted),
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
    }
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

fn convert_mig(
    parent_minor: u32,
    parent_memory_mib: u64,
    mig: &RawMig,
    minors: &MigMinors,
) -> Result<MigDevice, String> {
    let legacy = ids_from_legacy_mig_uuid(&mig.uuid);
    let gi_id = mig
        .gi_id
        .or(legacy.map(|(gi, _)| gi))
        .ok_or("GPU instance id unknown")?;
    let ci_id = mig
        .ci_id
        .or(legacy.map(|(_, ci)| ci))
        .ok_or("compute instance id unknown")?;
    let placement = mig.placement.ok_or("GPU instance placement unknown")?;
    let profile = mig_profile_name(
        mig.gpu_instance_slices,
        mig.compute_instance_slices,
        mig.memory_size_mib,
        parent_memory_mib,
    )
    .ok_or("MIG profile unknown (no slice or memory attributes)")?;
    let (gi_cap_minor, ci_cap_minor) = minors.lookup(parent_minor, gi_id, ci_id).ok_or_else(|| {
        format!("no capability minors for gpu{parent_minor}/gi{gi_id}/ci{ci_id} in the driver's mig-minors table")
    })?;
    Ok(MigDevice {
        profile,
        placement,
        gi_id,
        ci_id,
        uuid: mig.uuid.clone(),
        memory_bytes: mig.memory_total_bytes,
        multiprocessors: mig.multiprocessors,
        gi_cap_minor,
        ci_cap_minor,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100(index: u32, bus: &str, remotes: Vec<Option<String>>) -> RawGpu {
        RawGpu {
            index,
            minor: index,
            uuid: format!("GPU-{index:08x}-0000-0000-0000-000000000000"),
            name: "NVIDIA H100 80GB HBM3".into(),
            brand: "NVIDIA".into(),
            architecture: "Hopper".into(),
            compute_capability: (9, 0),
            memory_total_bytes: 81559 * MIB,
            multiprocessors: None,
            cuda_cores: Some(16896),
            pci_bus_id: bus.into(),
            nvlink_remotes: remotes,
            ..RawGpu::default()
        }
    }

    #[test]
    fn bus_ids_are_normalised_to_sysfs_form() {
        assert_eq!(
            normalize_bus_id("00000000:1B:00.0").as_deref(),
            Some("0000:1b:00.0")
        );
        assert_eq!(
            normalize_bus_id("0000:1b:00.0").as_deref(),
            Some("0000:1b:00.0")
        );
        assert_eq!(
            normalize_bus_id("00010000:C1:1F.7").as_deref(),
            Some("10000:c1:1f.7")
        );
        for bad in [
            "",
            "1b:00.0",
            "0000:1b:00",
            "0000:1b:00.8",
            "0000:1b:20.0",
            "0000:xx:00.0",
            "a:b:c:d.0",
        ] {
            assert_eq!(normalize_bus_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn numa_node_minus_one_is_none() {
        assert_eq!(parse_numa_node("1\n"), Some(1));
        assert_eq!(parse_numa_node("-1\n"), None);
        assert_eq!(parse_numa_node("garbage"), None);
    }

    #[test]
    fn pcie_root_is_the_first_component_under_devices() {
        let link = Path::new("../../../devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:18:00.0");
        assert_eq!(
            pcie_root_from_sysfs_link(link, "0000:18:00.0").as_deref(),
            Some("pci0000:15")
        );
        let absolute = Path::new("/sys/devices/pci0000:00/0000:00:03.0");
        assert_eq!(
            pcie_root_from_sysfs_link(absolute, "0000:00:03.0").as_deref(),
            Some("pci0000:00")
        );
        assert_eq!(pcie_root_from_sysfs_link(link, "0000:19:00.0"), None);
        let no_root = Path::new("../../../devices/platform/0000:18:00.0");
        assert_eq!(pcie_root_from_sysfs_link(no_root, "0000:18:00.0"), None);
    }

    #[test]
    fn sms_from_attribute_or_cores() {
        let mut gpu = h100(0, "00000000:18:00.0", vec![]);
        assert_eq!(multiprocessors(&gpu), Some(132));
        gpu.multiprocessors = Some(130);
        assert_eq!(multiprocessors(&gpu), Some(130));
        let a100 = RawGpu {
            compute_capability: (8, 0),
            cuda_cores: Some(6912),
            ..RawGpu::default()
        };
        assert_eq!(multiprocessors(&a100), Some(108));
        let l4 = RawGpu {
            compute_capability: (8, 9),
            cuda_cores: Some(7424),
            ..RawGpu::default()
        };
        assert_eq!(multiprocessors(&l4), Some(58));
        let unknown = RawGpu {
            compute_capability: (2, 0),
            cuda_cores: Some(512),
            ..RawGpu::default()
        };
        assert_eq!(multiprocessors(&unknown), None);
    }

    #[test]
    fn mig_profile_names_match_nvml() {
        // A100-SXM4-40GB: 40960 MiB.
        assert_eq!(
            mig_profile_name(1, 1, 4864, 40960).as_deref(),
            Some("1g.5gb")
        );
        assert_eq!(
            mig_profile_name(2, 2, 9856, 40960).as_deref(),
            Some("2g.10gb")
        );
        assert_eq!(
            mig_profile_name(3, 3, 19968, 40960).as_deref(),
            Some("3g.20gb")
        );
        assert_eq!(
            mig_profile_name(4, 4, 19968, 40960).as_deref(),
            Some("4g.20gb")
        );
        assert_eq!(
            mig_profile_name(7, 7, 40192, 40960).as_deref(),
            Some("7g.40gb")
        );
        assert_eq!(
            mig_profile_name(4, 2, 19968, 40960).as_deref(),
            Some("2c.4g.20gb")
        );
        // H100 80GB HBM3: 81559 MiB.
        assert_eq!(
            mig_profile_name(1, 1, 9856, 81559).as_deref(),
            Some("1g.10gb")
        );
        assert_eq!(
            mig_profile_name(3, 3, 40192, 81559).as_deref(),
            Some("3g.40gb")
        );
        assert_eq!(
            mig_profile_name(7, 7, 80768, 81559).as_deref(),
            Some("7g.80gb")
        );
        assert_eq!(mig_profile_name(0, 0, 1, 1), None);
    }

    #[test]
    fn legacy_mig_uuids_carry_ids() {
        let uuid = "MIG-GPU-5b1e0f3a-7c2d-4e8b-9a61-3d0c2f4e8a17/3/0";
        assert_eq!(ids_from_legacy_mig_uuid(uuid), Some((3, 0)));
        assert_eq!(
            ids_from_legacy_mig_uuid("MIG-0e7d4c21-9b3a-5f68-a2c4-71d5e8f0b396"),
            None
        );
    }

    #[test]
    fn mig_minors_table() {
        let text = "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n\
                    gpu1/gi2/access 156\ngpu1/gi2/ci0/access 157\nnonsense\ngpu1/gi2/ci1/access x\n";
        let minors = MigMinors::parse(text);
        assert_eq!(minors.lookup(0, 0, 0), Some((3, 4)));
        assert_eq!(minors.lookup(1, 2, 0), Some((156, 157)));
        assert_eq!(minors.lookup(1, 2, 1), None);
        assert_eq!(minors.lookup(2, 0, 0), None);
    }

    #[test]
    fn direct_links_and_switch_fabric() {
        // GPUs 0 and 1 linked directly; 2 and 3 reach an NVSwitch; 4 has no NVLink.
        let gpus = vec![
            h100(0, "00000000:18:00.0", vec![Some("00000000:2A:00.0".into())]),
            h100(1, "00000000:2A:00.0", vec![Some("00000000:18:00.0".into())]),
            h100(2, "00000000:3A:00.0", vec![Some("00000000:E0:00.0".into())]),
            h100(3, "00000000:5D:00.0", vec![None]),
            h100(4, "00000000:9A:00.0", vec![]),
        ];
        let peers = nvlink_peers(&gpus);
        assert_eq!(peers[&0], [1]);
        assert_eq!(peers[&1], [0]);
        assert_eq!(peers[&2], [3]);
        assert_eq!(peers[&3], [2]);
        assert!(peers[&4].is_empty());
    }

    #[test]
    fn one_sided_links_become_symmetric() {
        let gpus = vec![
            h100(0, "00000000:18:00.0", vec![Some("00000000:2A:00.0".into())]),
            h100(1, "00000000:2A:00.0", vec![]),
        ];
        assert_eq!(nvlink_peers(&gpus)[&1], [0]);
    }

    #[test]
    fn builds_a_valid_inventory() {
        let raw = RawSystem {
            driver_version: "570.124.06".into(),
            cuda_driver_version: Some(12080),
            gpus: vec![
                h100(0, "00000000:18:00.0", vec![Some("00000000:2A:00.0".into())]),
                h100(1, "00000000:2A:00.0", vec![Some("00000000:18:00.0".into())]),
            ],
        };
        let mut host = HostFacts::default();
        host.pci.insert(
            "0000:18:00.0".into(),
            PciHostFacts {
                numa_node: Some(0),
                pcie_root: Some("pci0000:15".into()),
            },
        );
        let converted = build_inventory(&raw, &host);
        assert!(converted.skipped.is_empty(), "{:?}", converted.skipped);
        let inventory = converted.inventory;
        assert!(inventory.validate().is_ok(), "{:?}", inventory.validate());
        assert_eq!(inventory.cuda_driver_version.as_deref(), Some("12.8"));
        assert_eq!(inventory.gpus[0].pci_bus_id, "0000:18:00.0");
        assert_eq!(inventory.gpus[0].pcie_root.as_deref(), Some("pci0000:15"));
        assert_eq!(inventory.gpus[0].numa_node, Some(0));
        assert_eq!(inventory.gpus[1].numa_node, None);
        assert_eq!(inventory.gpus[0].nvlink_peers, [1]);
        assert_eq!(inventory.gpus[0].multiprocessors, 132);
    }

    #[test]
    fn devices_missing_facts_are_skipped_with_a_reason() {
        let mut broken = h100(1, "not-a-bus-id", vec![]);
        broken.uuid = "GPU-broken".into();
        let mut mig_gpu = h100(2, "00000000:3A:00.0", vec![]);
        mig_gpu.mig_enabled = true;
        mig_gpu.mig_devices = vec![
            RawMig {
                uuid: "MIG-opaque".into(),
                memory_total_bytes: 9856 * MIB,
                multiprocessors: 16,
                gpu_instance_slices: 1,
                compute_instance_slices: 1,
                memory_size_mib: 9856,
                ..RawMig::default()
            },
            RawMig {
                uuid: "MIG-GPU-parent/9/0".into(),
                memory_total_bytes: 9856 * MIB,
                multiprocessors: 16,
                gpu_instance_slices: 1,
                compute_instance_slices: 1,
                memory_size_mib: 9856,
                placement: Some(MigPlacement { start: 2, size: 1 }),
                ..RawMig::default()
            },
        ];
        let raw = RawSystem {
            driver_version: "570.124.06".into(),
            gpus: vec![
                h100(0, "00000000:18:00.0", vec![Some("not-a-bus-id".into())]),
                broken,
                mig_gpu,
            ],
            ..RawSystem::default()
        };
        let host = HostFacts {
            mig_minors: MigMinors::parse("gpu2/gi9/access 309\ngpu2/gi9/ci0/access 310\n"),
            ..HostFacts::default()
        };
        let converted = build_inventory(&raw, &host);
        assert_eq!(converted.inventory.gpus.len(), 2);
        assert_eq!(converted.skipped.len(), 2, "{:?}", converted.skipped);
        assert!(
            converted.skipped[0].contains("GPU-broken")
                && converted.skipped[0].contains("not-a-bus-id")
        );
        assert!(
            converted.skipped[1].contains("MIG-opaque")
                && converted.skipped[1].contains("GPU instance id")
        );
        let mig = &converted.inventory.gpus[1].mig_devices[0];
        assert_eq!(
            (
                mig.profile.as_str(),
                mig.gi_id,
                mig.gi_cap_minor,
                mig.ci_cap_minor
            ),
            ("1g.10gb", 9, 309, 310)
        );
        assert!(
            converted.inventory.validate().is_ok(),
            "{:?}",
            converted.inventory.validate()
        );
    }

    const CLUSTER: [u8; 16] = [
        0x6f, 0x1c, 0x2a, 0x8e, 0x4b, 0x7d, 0x4e, 0x19, 0x9a, 0x3c, 0x52, 0xd0, 0xe8, 0xf1, 0xb7,
        0x64,
    ];

    fn completed(clique_id: u32) -> RawFabric {
        RawFabric {
            cluster_uuid: CLUSTER,
            clique_id,
            state: FABRIC_STATE_COMPLETED,
            status: NVML_SUCCESS,
        }
    }

    #[test]
    fn uuids_print_in_canonical_form() {
        assert_eq!(
            format_uuid(&CLUSTER),
            "6f1c2a8e-4b7d-4e19-9a3c-52d0e8f1b764"
        );
        assert_eq!(
            format_uuid(&[0; 16]),
            "00000000-0000-0000-0000-000000000000"
        );
        assert_eq!(
            format_uuid(&[0xff; 16]),
            "ffffffff-ffff-ffff-ffff-ffffffffffff"
        );
    }

    #[test]
    fn nvlink_domain_only_for_a_completed_registration_in_a_cluster() {
        assert_eq!(
            nvlink_domain(&completed(32766)).as_deref(),
            Some("6f1c2a8e-4b7d-4e19-9a3c-52d0e8f1b764.32766")
        );
        assert_eq!(
            nvlink_domain(&completed(0)).as_deref(),
            Some("6f1c2a8e-4b7d-4e19-9a3c-52d0e8f1b764.0")
        );
        for state in [0, 1, 2, 4] {
            let fabric = RawFabric {
                state,
                ..completed(1)
            };
            assert_eq!(nvlink_domain(&fabric), None, "state {state}");
        }
        // Registration finished but failed, e.g. NVML_ERROR_NOT_READY or an unknown error.
        for status in [27, 999] {
            let fabric = RawFabric {
                status,
                ..completed(1)
            };
            assert_eq!(nvlink_domain(&fabric), None, "status {status}");
        }
        let no_cluster = RawFabric {
            cluster_uuid: [0; 16],
            ..completed(1)
        };
        assert_eq!(nvlink_domain(&no_cluster), None);
        // The longest domain still fits a device attribute (64 characters).
        let longest = nvlink_domain(&completed(u32::MAX)).unwrap();
        assert!(longest.len() <= 64, "{longest}");
    }

    #[test]
    fn nvml_ids_and_placement_keep_mig_devices_and_fabric_gives_the_domain() {
        let mut gpu = h100(0, "00000000:18:00.0", vec![None]);
        gpu.fabric = Some(completed(7));
        gpu.mig_enabled = true;
        gpu.mig_devices = vec![RawMig {
            uuid: "MIG-0e7d4c21-9b3a-5f68-a2c4-71d5e8f0b396".into(),
            memory_total_bytes: 9856 * MIB,
            multiprocessors: 16,
            gpu_instance_slices: 1,
            compute_instance_slices: 1,
            memory_size_mib: 9856,
            gi_id: Some(13),
            ci_id: Some(0),
            placement: Some(MigPlacement { start: 6, size: 1 }),
        }];
        let mut other = h100(1, "00000000:2A:00.0", vec![None]);
        other.fabric = Some(RawFabric {
            state: 2,
            ..completed(7)
        });
        let raw = RawSystem {
            driver_version: "570.124.06".into(),
            gpus: vec![gpu, other],
            ..RawSystem::default()
        };
        let host = HostFacts {
            mig_minors: MigMinors::parse("gpu0/gi13/access 120\ngpu0/gi13/ci0/access 121\n"),
            ..HostFacts::default()
        };
        let converted = build_inventory(&raw, &host);
        assert!(converted.skipped.is_empty(), "{:?}", converted.skipped);
        let inventory = converted.inventory;
        assert!(inventory.validate().is_ok(), "{:?}", inventory.validate());
        assert_eq!(
            inventory.gpus[0].nvlink_domain.as_deref(),
            Some("6f1c2a8e-4b7d-4e19-9a3c-52d0e8f1b764.7")
        );
        assert_eq!(inventory.gpus[1].nvlink_domain, None);
        let mig = &inventory.gpus[0].mig_devices[0];
        assert_eq!(
            (
                mig.gi_id,
                mig.ci_id,
                mig.placement,
                mig.gi_cap_minor,
                mig.ci_cap_minor
            ),
            (13, 0, MigPlacement { start: 6, size: 1 }, 120, 121)
        );
        assert_eq!(mig.device_name(0), "gpu-0-mig-1g-10gb-6");
    }
}
