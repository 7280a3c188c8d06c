//! The node's GPU inventory: whole GPUs, their MIG devices and the driver that runs them.
//!
//! Identity comes from stable hardware facts (minor number, UUID), never from enumeration
//! order, so names derived from it survive reboots and driver reloads.
//! [`Inventory::validate`] checks its invariants.

use serde::{Deserialize, Serialize};

mod validate;

/// Everything the kubelet plugin knows about the GPUs of one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Inventory {
    /// Kernel driver version, e.g. `570.124.06`.
    pub driver_version: String,
    /// CUDA driver API version, e.g. `12.8`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_driver_version: Option<String>,
    /// The GPUs, in any order.
    #[serde(default)]
    pub gpus: Vec<Gpu>,
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Gpu {
    /// NVML enumeration index (informational only; never used for naming).
    pub index: u32,
    /// Minor number of `/dev/nvidia<minor>`; the stable name of the GPU on this node.
    pub minor: u32,
    /// NVML UUID, e.g. `GPU-8d4b4a36-…`.
    pub uuid: String,
    /// Marketing product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub product_name: String,
    /// Brand, e.g. `Nvidia`, `Tesla`.
    pub brand: String,
    /// Architecture name, e.g. `Hopper`.
    pub architecture: String,
    /// CUDA compute capability.
    pub compute_capability: ComputeCapability,
    /// Total framebuffer memory in bytes.
    pub memory_bytes: u64,
    /// Number of streaming multiprocessors.
    pub multiprocessors: u32,
    /// PCI bus id in NVML's long form, e.g. `0000:1b:00.0`.
    pub pci_bus_id: String,
    /// PCIe root complex the GPU hangs off, e.g. `pci0000:00`, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_root: Option<String>,
    /// NUMA node of the GPU, when the platform reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// Minor numbers of the GPUs this GPU has an active NVLink to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvlink_peers: Vec<u32>,
    /// Identifier of the NVLink domain (fabric clique) the GPU belongs to, when any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink_domain: Option<String>,
    /// Whether MIG mode is enabled (current mode, not pending).
    #[serde(default)]
    pub mig_enabled: bool,
    /// The MIG devices that exist on this GPU now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_devices: Vec<MigDevice>,
    /// The GPU's MIG profiles and placements, when known (from NVML, or
    /// [`crate::mig_catalog::catalog_for`] in mock mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_catalog: Option<crate::mig_catalog::GpuMigCatalog>,
    /// Whether kerf creates this GPU's MIG devices on demand (dynamic MIG): MIG mode on, no
    /// MIG devices but kerf's, a catalogue, and not opted out. Its placements are published
    /// instead of its existing MIG devices.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dynamic_mig: bool,
}

/// CUDA compute capability, `major.minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeCapability {
    /// Major version, e.g. 9 for Hopper.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl std::fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// One MIG device (a GPU instance plus one compute instance) that exists on a parent GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigDevice {
    /// MIG profile name, e.g. `1g.10gb`.
    pub profile: String,
    /// Placement of the GPU instance within the parent's memory slices.
    pub placement: MigPlacement,
    /// GPU instance id.
    pub gi_id: u32,
    /// Compute instance id.
    pub ci_id: u32,
    /// NVML UUID of the MIG device, e.g. `MIG-…`.
    pub uuid: String,
    /// Memory of the MIG device in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors of the MIG device.
    pub multiprocessors: u32,
    /// Minor of `/dev/nvidia-caps/nvidia-cap<minor>` that grants access to the GPU instance.
    pub gi_cap_minor: u32,
    /// Minor of `/dev/nvidia-caps/nvidia-cap<minor>` that grants access to the compute instance.
    pub ci_cap_minor: u32,
}

/// Where a MIG GPU instance sits among the parent's memory slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigPlacement {
    /// First memory slice.
    pub start: u32,
    /// Number of memory slices.
    pub size: u32,
}

impl Gpu {
    /// The device name kerf publishes for this GPU: `gpu-<minor>`.
    pub fn device_name(&self) -> String {
        format!("gpu-{}", self.minor)
    }
}

impl MigDevice {
    /// The device name kerf publishes for this MIG device:
    /// `gpu-<parent minor>-mig-<profile>-<placement start>` with the profile's dots and
    /// plus signs made DNS-label safe, e.g. `gpu-0-mig-1g-10gb-3`.
    pub fn device_name(&self, parent_minor: u32) -> String {
        mig_device_name(parent_minor, &self.profile, self.placement.start)
    }
}

/// The device name kerf publishes for a MIG device of profile `profile` placed at memory slice
/// `start` of GPU `parent_minor`: `gpu-<parent minor>-mig-<profile>-<start>`, the profile
/// lower-cased with every character other than a letter or digit made `-`
/// (`gpu-0-mig-1g-10gb-me-3` for `1g.10gb+me`).
///
/// Static MIG devices ([`MigDevice::device_name`]) and the placements of a dynamic-MIG GPU
/// ([`crate::mig_catalog::GpuMigCatalog::placements`]) share it, so an instance created for a
/// placement keeps the name it was allocated under.
pub(crate) fn mig_device_name(parent_minor: u32, profile: &str, start: u32) -> String {
    let profile: String = profile
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    format!("gpu-{parent_minor}-mig-{profile}-{start}")
}

/// A device kerf publishes: a whole GPU or one MIG device of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRef<'a> {
    /// A whole GPU.
    Gpu(&'a Gpu),
    /// A MIG device and its parent GPU.
    Mig {
        /// The parent GPU.
        parent: &'a Gpu,
        /// The MIG device.
        mig: &'a MigDevice,
    },
}

impl DeviceRef<'_> {
    /// The published device name.
    pub fn name(&self) -> String {
        match self {
            DeviceRef::Gpu(gpu) => gpu.device_name(),
            DeviceRef::Mig { parent, mig } => mig.device_name(parent.minor),
        }
    }

    /// The GPU that physically holds this device.
    pub fn gpu(&self) -> &Gpu {
        match self {
            DeviceRef::Gpu(gpu) | DeviceRef::Mig { parent: gpu, .. } => gpu,
        }
    }

    /// The device's UUID (GPU or MIG).
    pub fn uuid(&self) -> &str {
        match self {
            DeviceRef::Gpu(gpu) => &gpu.uuid,
            DeviceRef::Mig { mig, .. } => &mig.uuid,
        }
    }
}

impl Inventory {
    /// Every publishable device: each GPU without MIG as a whole GPU, and each existing MIG
    /// device of GPUs with MIG enabled. A MIG-enabled GPU is not itself allocatable.
    pub fn devices(&self) -> impl Iterator<Item = DeviceRef<'_>> {
        self.gpus.iter().flat_map(|gpu| {
            let whole = (!gpu.mig_enabled).then_some(DeviceRef::Gpu(gpu));
            let migs = gpu
                .mig_devices
                .iter()
                .filter(move |_| gpu.mig_enabled)
                .map(move |mig| DeviceRef::Mig { parent: gpu, mig });
            whole.into_iter().chain(migs)
        })
    }

    /// Looks a published device up by name.
    pub fn device(&self, name: &str) -> Option<DeviceRef<'_>> {
        self.devices().find(|d| d.name() == name)
    }

    /// Looks a GPU up by its minor number.
    pub fn gpu_by_minor(&self, minor: u32) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.minor == minor)
    }

    /// Looks up the placement a dynamic-MIG GPU publishes as `name`
    /// (`gpu-<minor>-mig-<profile>-<start>`, [`crate::mig_catalog::CatalogPlacement::device_name`]):
    /// the GPU, the profile and where its GPU instance goes. `None` for any other name,
    /// including the MIG devices of GPUs that are not dynamic.
    pub fn dynamic_placement(&self, name: &str) -> Option<DynamicPlacement<'_>> {
        // Only the minor is parsed; the catalogue's own names decide the rest, so a name
        // matches exactly when the publisher would have produced it.
        let minor = name
            .strip_prefix("gpu-")?
            .split_once("-mig-")?
            .0
            .parse::<u32>()
            .ok()?;
        let gpu = self.gpu_by_minor(minor).filter(|g| g.dynamic_mig)?;
        let found = gpu.mig_catalog.as_ref()?.placement_named(minor, name)?;
        Some(DynamicPlacement {
            gpu,
            profile: found.profile,
            placement: found.placement,
        })
    }
}

/// One published placement of a dynamic-MIG GPU ([`Inventory::dynamic_placement`]): the MIG
/// device kerf creates when a claim that was allocated it is prepared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DynamicPlacement<'a> {
    /// The parent GPU.
    pub gpu: &'a Gpu,
    /// The MIG profile.
    pub profile: &'a crate::mig_catalog::MigProfileSpec,
    /// Where the GPU instance goes.
    pub placement: MigPlacement,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_published_placement_of_a_dynamic_gpu_is_found_by_its_name() {
        let inventory = crate::mock::from_spec(crate::mock::A100_40GB_DYNMIG).unwrap();
        let gpu = &inventory.gpus[1];
        let catalog = gpu.mig_catalog.as_ref().unwrap();
        let mut found = 0;
        for placement in catalog.placements() {
            let name = placement.device_name(gpu.minor);
            let hit = inventory.dynamic_placement(&name).unwrap();
            assert_eq!(hit.gpu.minor, gpu.minor, "{name}");
            assert_eq!(hit.profile.name, placement.profile.name, "{name}");
            assert_eq!(hit.placement, placement.placement, "{name}");
            found += 1;
        }
        assert_eq!(found, 25);
        let small = inventory.dynamic_placement("gpu-1-mig-1g-5gb-3").unwrap();
        assert_eq!(
            (small.profile.gi_profile_id, small.placement),
            (19, MigPlacement { start: 3, size: 1 })
        );
    }

    #[test]
    fn other_names_are_not_placements() {
        let inventory = crate::mock::from_spec(crate::mock::A100_40GB_DYNMIG).unwrap();
        for name in [
            "gpu-0",
            "gpu-0-mig-1g-5gb-7",
            "gpu-0-mig-9g-99gb-0",
            "gpu-9-mig-1g-5gb-0",
            "gpu-x-mig-1g-5gb-0",
            "gpu-0-mig-1g-5gb-0-extra",
            "",
        ] {
            assert!(inventory.dynamic_placement(name).is_none(), "{name}");
        }
        // Static MIG devices are not dynamic placements even when their names look alike.
        let static_mig = crate::mock::from_spec("a100-40gb-mig").unwrap();
        let (parent, mig) = static_mig
            .gpus
            .iter()
            .find_map(|g| g.mig_devices.first().map(|m| (g.minor, m)))
            .unwrap();
        assert!(
            static_mig
                .dynamic_placement(&mig.device_name(parent))
                .is_none()
        );
    }
}
