//! Mock GPU inventories: named profiles modelled on real machines, and the YAML inventory file.
//!
//! Mock mode is a first-class mode (demos, CI, kind clusters without GPUs), so the profiles use
//! the figures NVML reports on real hardware and stay valid for any GPU count:
//!
//! | profile | GPUs | modelled on |
//! |---|---|---|
//! | `h100-sxm-80gb` | 8 × `NVIDIA H100 80GB HBM3` | DGX H100: all-to-all NVLink (NVSwitch), one NVLink domain, GPUs 0–3 on NUMA 0 and 4–7 on NUMA 1 |
//! | `a100-40gb-mig` | 4 × `NVIDIA A100-SXM4-40GB` | HGX A100 4-GPU board with direct NVLink; GPUs 0 and 1 in MIG mode with a few MIG devices |
//! | `l4` | 2 × `NVIDIA L4` | PCIe-only inference server, one GPU per socket |
//! | `a100-40gb-dynmig` | 4 × `NVIDIA A100-SXM4-40GB` | the same board with every GPU in MIG mode and no MIG devices: dynamic MIG creates them on demand from [`crate::mig_catalog::catalog_for`] |
//! | `a100-80gb-dynmig` | 8 × `NVIDIA A100-SXM4-80GB` | DGX A100 80GB (two 4-GPU boards' layout), every GPU in MIG mode without MIG devices, for dynamic MIG |
//! | `h100-sxm-80gb-dynmig` | 8 × `NVIDIA H100 80GB HBM3` | the DGX H100 of `h100-sxm-80gb` with every GPU in MIG mode without MIG devices, for dynamic MIG |
//! | `h100-nvl` | 2 × `NVIDIA H100 NVL` | a PCIe server with one H100 NVL pair: two 94 GB PCIe cards joined by NVLink bridges, no NVSwitch, so no fabric domain |
//!
//! Memory sizes are NVML's `memory_info().total` (what `nvidia-smi` prints as `…MiB`), not the
//! marketing size: 81559 MiB for the H100 SXM, 95830 MiB for the H100 NVL, 40960 MiB for the
//! A100, 23034 MiB for the L4.
//!
//! `PROFILE:COUNT` changes the number of GPUs (1 to [`MAX_MOCK_GPUS`]). GPU `m` always looks
//! the same whatever the count: its UUID derives from the profile name and `m` only, and PCI
//! address, PCIe root, NUMA node, NVLink group and MIG layout follow the profile's pattern
//! repeated every "board" (8, 4 or 2 GPUs), with the PCI domain counting boards.
//!
//! The YAML inventory file is the serde form of [`Inventory`] (camelCase, unknown fields are
//! errors); see `examples/inventory/custom.yaml`.

use std::path::Path;

use crate::error::{Error, Result};
use crate::inventory::{ComputeCapability, Gpu, Inventory, MigDevice, MigPlacement};

/// Driver version reported by every mock profile.
pub const MOCK_DRIVER_VERSION: &str = "570.124.06";
/// CUDA driver API version reported by every mock profile.
pub const MOCK_CUDA_VERSION: &str = "12.8";
/// Largest GPU count a `PROFILE:COUNT` specification may ask for.
pub const MAX_MOCK_GPUS: u32 = 64;
/// GPU minors covered by the driver's MIG capability table (`gpu0` … `gpu31`).
pub const MIG_CAPABLE_MINORS: u32 = 32;
/// Largest inventory file [`load_file`] reads; real inventories are a few KiB.
pub const MAX_INVENTORY_FILE_BYTES: u64 = 4 * 1024 * 1024;

const MIB: u64 = 1024 * 1024;

/// Name of the 8 × H100 SXM 80GB profile.
pub const H100_SXM_80GB: &str = "h100-sxm-80gb";
/// Name of the 4 × A100 SXM4 40GB profile with MIG.
pub const A100_40GB_MIG: &str = "a100-40gb-mig";
/// Name of the 2 × L4 profile.
pub const L4: &str = "l4";
/// Name of the 4 × A100 SXM4 40GB profile in MIG mode without MIG devices, for dynamic MIG.
pub const A100_40GB_DYNMIG: &str = "a100-40gb-dynmig";
/// Name of the 8 × A100 SXM4 80GB profile in MIG mode without MIG devices, for dynamic MIG.
pub const A100_80GB_DYNMIG: &str = "a100-80gb-dynmig";
/// Name of the 8 × H100 SXM 80GB profile in MIG mode without MIG devices, for dynamic MIG.
pub const H100_SXM_80GB_DYNMIG: &str = "h100-sxm-80gb-dynmig";
/// Name of the 2 × H100 NVL profile: one NVLink-bridged pair of PCIe cards.
pub const H100_NVL: &str = "h100-nvl";

const PROFILE_NAMES: [&str; 7] = [
    H100_SXM_80GB,
    A100_40GB_MIG,
    L4,
    A100_40GB_DYNMIG,
    A100_80GB_DYNMIG,
    H100_SXM_80GB_DYNMIG,
    H100_NVL,
];

/// The names of the built-in mock profiles.
pub fn profile_names() -> &'static [&'static str] {
    &PROFILE_NAMES
}

/// Builds a mock inventory from `PROFILE[:COUNT]`, e.g. `h100-sxm-80gb` or `l4:4`.
///
/// # Errors
/// [`Error::UnknownMockProfile`] for a profile kerf does not know;
/// [`Error::InvalidMockSpec`] when COUNT is not a number from 1 to [`MAX_MOCK_GPUS`].
pub fn from_spec(spec: &str) -> Result<Inventory> {
    let (name, count) = match spec.split_once(':') {
        Some((name, count)) => (name.trim(), Some(parse_count(spec, count)?)),
        None => (spec.trim(), None),
    };
    let profile = Profile::named(name).ok_or_else(|| Error::UnknownMockProfile {
        name: name.to_owned(),
        known: PROFILE_NAMES.join(", "),
    })?;
    let inventory = profile.inventory(count.unwrap_or(profile.natural_count));
    // The profiles are constructed to be valid; checking keeps a broken edit from shipping.
    inventory.validate()?;
    Ok(inventory)
}

fn parse_count(spec: &str, count: &str) -> Result<u32> {
    let bad = |reason: String| Error::InvalidMockSpec {
        spec: spec.to_owned(),
        reason,
    };
    let n: u32 = count.trim().parse().map_err(|_| {
        bad(format!(
            "GPU count {count:?} is not a number from 1 to {MAX_MOCK_GPUS}"
        ))
    })?;
    if n == 0 || n > MAX_MOCK_GPUS {
        return Err(bad(format!(
            "GPU count {n} is not from 1 to {MAX_MOCK_GPUS}"
        )));
    }
    Ok(n)
}

/// Decodes and validates a YAML inventory; `what` names the source in errors (a file path).
///
/// # Errors
/// [`Error::Yaml`] when the text does not decode (unknown fields included);
/// [`Error::InvalidInventory`] prefixed with `what` when it breaks an invariant of
/// [`Inventory::validate`].
pub fn from_yaml(text: &str, what: &str) -> Result<Inventory> {
    let inventory: Inventory = serde_saphyr::from_str(text).map_err(|source| Error::Yaml {
        what: what.to_owned(),
        source: Box::new(source),
    })?;
    inventory.validate().map_err(|e| match e {
        Error::InvalidInventory(message) => Error::InvalidInventory(format!("{what}: {message}")),
        other => other,
    })?;
    Ok(inventory)
}

/// Reads, decodes and validates a YAML inventory file.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read or is larger than
/// [`MAX_INVENTORY_FILE_BYTES`]; otherwise as [`from_yaml`].
pub fn load_file(path: &Path) -> Result<Inventory> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let mut text = String::new();
    // Reading one byte past the limit tells a file at the limit from one beyond it.
    file.take(MAX_INVENTORY_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| Error::io("read", path, e))?;
    if text.len() as u64 > MAX_INVENTORY_FILE_BYTES {
        return Err(Error::io(
            "read",
            path,
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("inventory file is larger than {MAX_INVENTORY_FILE_BYTES} bytes"),
            ),
        ));
    }
    from_yaml(&text, &path.display().to_string())
}

/// The `/dev/nvidia-caps/nvidia-cap<minor>` minors of GPU instance `gi` and its compute
/// instance `ci` on GPU `gpu_minor`, as laid out in the driver's
/// `/proc/driver/nvidia-caps/mig-minors` table: minors 1 and 2 are `config` and `monitor`, then
/// each GPU has 15 GPU instances of 9 entries (the instance's `access`, then `ci0` … `ci7`).
/// `None` outside the table (GPU minor ≥ 32, `gi` ≥ 15, `ci` ≥ 8).
pub fn mig_cap_minors(gpu_minor: u32, gi: u32, ci: u32) -> Option<(u32, u32)> {
    const GIS_PER_GPU: u32 = 15;
    const CIS_PER_GI: u32 = 8;
    const ENTRIES_PER_GI: u32 = 1 + CIS_PER_GI;
    if gpu_minor >= MIG_CAPABLE_MINORS || gi >= GIS_PER_GPU || ci >= CIS_PER_GI {
        return None;
    }
    let gi_minor = 3 + gpu_minor * GIS_PER_GPU * ENTRIES_PER_GI + gi * ENTRIES_PER_GI;
    Some((gi_minor, gi_minor + 1 + ci))
}

/// A deterministic identifier in NVML's UUID layout (`8-4-4-4-12` lowercase hex), derived
/// from `key` with two FNV-1a passes. Not random, not RFC 4122 versioned: only stable.
fn stable_uuid(key: &str) -> String {
    fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
        bytes.iter().fold(seed, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }
    let high = fnv1a(0xcbf2_9ce4_8422_2325, key.as_bytes());
    let low = fnv1a(high ^ 0x9e37_79b9_7f4a_7c15, key.as_bytes());
    let hex = format!("{high:016x}{low:016x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

fn gpu_uuid(profile: &str, minor: u32) -> String {
    format!(
        "GPU-{}",
        stable_uuid(&format!("kerf-mock/{profile}/gpu/{minor}"))
    )
}

fn mig_uuid(profile: &str, minor: u32, gi: u32, ci: u32) -> String {
    format!(
        "MIG-{}",
        stable_uuid(&format!("kerf-mock/{profile}/gpu/{minor}/gi/{gi}/ci/{ci}"))
    )
}

/// Where the GPUs of one board sit on the PCI bus: `(bus, root bus, NUMA node)` per slot.
type Slot = (u8, u8, u32);

/// DGX H100: each GPU behind its own PCIe switch under its own root complex.
const H100_SLOTS: [Slot; 8] = [
    (0x18, 0x15, 0),
    (0x2a, 0x26, 0),
    (0x3a, 0x37, 0),
    (0x5d, 0x59, 0),
    (0x9a, 0x97, 1),
    (0xab, 0xa7, 1),
    (0xba, 0xb7, 1),
    (0xdb, 0xd7, 1),
];
/// HGX A100 4-GPU on an AMD EPYC host: two GPUs per root complex.
const A100_SLOTS: [Slot; 4] = [
    (0x07, 0x00, 0),
    (0x0f, 0x00, 0),
    (0x47, 0x40, 1),
    (0x4e, 0x40, 1),
];
/// Two L4 cards, one per socket.
const L4_SLOTS: [Slot; 2] = [(0x17, 0x16, 0), (0xca, 0xc9, 1)];
/// One H100 NVL pair: two PCIe cards on the same socket, each under its own root port (the
/// bridges join the pair, so it sits in neighbouring slots). GPU 0 at bus 0x4e as `nvidia-smi`
/// shows a two-card H100 NVL machine (NVIDIA/gpu-admin-tools issue #4).
const H100_NVL_SLOTS: [Slot; 2] = [(0x4e, 0x4a, 0), (0x5e, 0x5a, 0)];

/// How the GPUs of a profile are linked by NVLink.
#[derive(Clone, Copy)]
enum Links {
    /// PCIe only.
    None,
    /// Every GPU of the inventory reaches every other through NVSwitch; one fabric domain.
    Switched,
    /// Direct NVLink between all GPUs of the same board, no fabric domain; with a board of two
    /// PCIe cards, the NVLink bridges of an H100 NVL pair.
    PerBoard,
}

/// A MIG device of a mock layout: A100-40GB profile, placement, GPU instance id.
#[derive(Clone, Copy)]
struct MockMig {
    profile: &'static str,
    start: u32,
    size: u32,
    gi_id: u32,
    memory_mib: u64,
    multiprocessors: u32,
}

const fn a100_mig(profile: &'static str, start: u32, gi_id: u32) -> MockMig {
    // A100-SXM4-40GB GPU-instance profiles as NVML reports them (memory, SMs, placement size).
    let (memory_mib, multiprocessors, size) = match profile.as_bytes()[0] {
        b'1' => (4864, 14, 1), // 1g.5gb
        b'2' => (9856, 28, 2), // 2g.10gb
        _ => (19968, 42, 4),   // 3g.20gb
    };
    MockMig {
        profile,
        start,
        size,
        gi_id,
        memory_mib,
        multiprocessors,
    }
}

/// Board slot 0: 3g.20gb + 2g.10gb + 1g.5gb (one compute slice left unused).
const A100_LAYOUT_0: [MockMig; 3] = [
    a100_mig("3g.20gb", 0, 1),
    a100_mig("2g.10gb", 4, 5),
    a100_mig("1g.5gb", 6, 13),
];
/// Board slot 1: 2 × 2g.10gb + 2 × 1g.5gb (memory slice 6 free).
const A100_LAYOUT_1: [MockMig; 4] = [
    a100_mig("2g.10gb", 0, 3),
    a100_mig("2g.10gb", 2, 4),
    a100_mig("1g.5gb", 4, 7),
    a100_mig("1g.5gb", 5, 8),
];

struct Profile {
    name: &'static str,
    natural_count: u32,
    product_name: &'static str,
    architecture: &'static str,
    compute_capability: ComputeCapability,
    memory_mib: u64,
    multiprocessors: u32,
    slots: &'static [Slot],
    links: Links,
    /// MIG layout by board slot; an empty layout leaves the GPU out of MIG mode.
    mig_layouts: &'static [&'static [MockMig]],
    /// Every GPU in MIG mode without MIG devices (dynamic MIG creates them).
    empty_mig_mode: bool,
}

const PROFILES: [Profile; 7] = [
    Profile {
        name: H100_SXM_80GB,
        natural_count: 8,
        product_name: "NVIDIA H100 80GB HBM3",
        architecture: "Hopper",
        compute_capability: ComputeCapability { major: 9, minor: 0 },
        memory_mib: 81559,
        multiprocessors: 132,
        slots: &H100_SLOTS,
        links: Links::Switched,
        mig_layouts: &[],
        empty_mig_mode: false,
    },
    Profile {
        name: A100_40GB_MIG,
        natural_count: 4,
        product_name: "NVIDIA A100-SXM4-40GB",
        architecture: "Ampere",
        compute_capability: ComputeCapability { major: 8, minor: 0 },
        memory_mib: 40960,
        multiprocessors: 108,
        slots: &A100_SLOTS,
        links: Links::PerBoard,
        mig_layouts: &[&A100_LAYOUT_0, &A100_LAYOUT_1],
        empty_mig_mode: false,
    },
    Profile {
        name: L4,
        natural_count: 2,
        product_name: "NVIDIA L4",
        architecture: "Ada Lovelace",
        compute_capability: ComputeCapability { major: 8, minor: 9 },
        memory_mib: 23034,
        multiprocessors: 58,
        slots: &L4_SLOTS,
        links: Links::None,
        mig_layouts: &[],
        empty_mig_mode: false,
    },
    Profile {
        name: A100_40GB_DYNMIG,
        natural_count: 4,
        product_name: "NVIDIA A100-SXM4-40GB",
        architecture: "Ampere",
        compute_capability: ComputeCapability { major: 8, minor: 0 },
        memory_mib: 40960,
        multiprocessors: 108,
        slots: &A100_SLOTS,
        links: Links::PerBoard,
        mig_layouts: &[],
        empty_mig_mode: true,
    },
    Profile {
        name: A100_80GB_DYNMIG,
        natural_count: 8,
        product_name: "NVIDIA A100-SXM4-80GB",
        architecture: "Ampere",
        compute_capability: ComputeCapability { major: 8, minor: 0 },
        memory_mib: 81920,
        multiprocessors: 108,
        slots: &A100_SLOTS,
        links: Links::PerBoard,
        mig_layouts: &[],
        empty_mig_mode: true,
    },
    Profile {
        name: H100_SXM_80GB_DYNMIG,
        natural_count: 8,
        product_name: "NVIDIA H100 80GB HBM3",
        architecture: "Hopper",
        compute_capability: ComputeCapability { major: 9, minor: 0 },
        memory_mib: 81559,
        multiprocessors: 132,
        slots: &H100_SLOTS,
        links: Links::Switched,
        mig_layouts: &[],
        empty_mig_mode: true,
    },
    Profile {
        name: H100_NVL,
        natural_count: 2,
        // NVML's name and `memory_info().total` as `nvidia-smi` prints them for this card
        // ("NVIDIA H100 NVL", "95830MiB", NVIDIA/gpu-admin-tools issue #4); 132 SMs like the
        // SXM part: NVML reports 16896 CUDA cores, 128 per Hopper SM (fastfetch-cli/fastfetch
        // issue #1658).
        product_name: "NVIDIA H100 NVL",
        architecture: "Hopper",
        compute_capability: ComputeCapability { major: 9, minor: 0 },
        memory_mib: 95830,
        multiprocessors: 132,
        slots: &H100_NVL_SLOTS,
        links: Links::PerBoard,
        mig_layouts: &[],
        empty_mig_mode: false,
    },
];

impl Profile {
    fn named(name: &str) -> Option<&'static Profile> {
        PROFILES.iter().find(|p| p.name == name)
    }

    fn inventory(&self, count: u32) -> Inventory {
        Inventory {
            driver_version: MOCK_DRIVER_VERSION.to_owned(),
            cuda_driver_version: Some(MOCK_CUDA_VERSION.to_owned()),
            gpus: (0..count).map(|minor| self.gpu(minor, count)).collect(),
        }
    }

    fn board_size(&self) -> u32 {
        u32::try_from(self.slots.len()).unwrap_or(u32::MAX)
    }

    fn gpu(&self, minor: u32, count: u32) -> Gpu {
        let board = minor / self.board_size();
        let slot_index = minor % self.board_size();
        let (bus, root_bus, numa) = self.slots[slot_index as usize];
        let mig_layout = self.mig_layout(minor, slot_index);
        Gpu {
            index: minor,
            minor,
            uuid: gpu_uuid(self.name, minor),
            product_name: self.product_name.to_owned(),
            brand: "NVIDIA".to_owned(),
            architecture: self.architecture.to_owned(),
            compute_capability: self.compute_capability,
            memory_bytes: self.memory_mib * MIB,
            multiprocessors: self.multiprocessors,
            pci_bus_id: format!("{board:04x}:{bus:02x}:00.0"),
            pcie_root: Some(format!("pci{board:04x}:{root_bus:02x}")),
            numa_node: Some(numa),
            nvlink_peers: self.peers(minor, count),
            nvlink_domain: matches!(self.links, Links::Switched).then(|| {
                format!(
                    "{}.0",
                    stable_uuid(&format!("kerf-mock/{}/fabric", self.name))
                )
            }),
            mig_enabled: mig_layout.is_some()
                || (self.empty_mig_mode && minor < MIG_CAPABLE_MINORS),
            mig_catalog: self
                .empty_mig_mode
                .then(|| crate::mig_catalog::catalog_for(self.product_name).cloned())
                .flatten(),
            dynamic_mig: self.empty_mig_mode && minor < MIG_CAPABLE_MINORS,
            mig_devices: mig_layout
                .unwrap_or_default()
                .iter()
                .map(|m| self.mig_device(minor, m))
                .collect(),
        }
    }

    fn peers(&self, minor: u32, count: u32) -> Vec<u32> {
        let group = match self.links {
            Links::None => return Vec::new(),
            Links::Switched => 0..count,
            Links::PerBoard => {
                let first = minor / self.board_size() * self.board_size();
                first..(first + self.board_size()).min(count)
            }
        };
        group.filter(|&peer| peer != minor).collect()
    }

    /// MIG devices need capability minors, which the driver has only for GPU minors below
    /// [`MIG_CAPABLE_MINORS`]; GPUs beyond that stay out of MIG mode.
    fn mig_layout(&self, minor: u32, slot_index: u32) -> Option<&'static [MockMig]> {
        if minor >= MIG_CAPABLE_MINORS {
            return None;
        }
        self.mig_layouts.get(slot_index as usize).copied()
    }

    fn mig_device(&self, minor: u32, mig: &MockMig) -> MigDevice {
        const CI_ID: u32 = 0;
        // The layouts only use GPU-instance ids below 15 and minors below 32.
        let (gi_cap_minor, ci_cap_minor) =
            mig_cap_minors(minor, mig.gi_id, CI_ID).unwrap_or_default();
        MigDevice {
            profile: mig.profile.to_owned(),
            placement: MigPlacement {
                start: mig.start,
                size: mig.size,
            },
            gi_id: mig.gi_id,
            ci_id: CI_ID,
            uuid: mig_uuid(self.name, minor, mig.gi_id, CI_ID),
            memory_bytes: mig.memory_mib * MIB,
            multiprocessors: mig.multiprocessors,
            gi_cap_minor,
            ci_cap_minor,
        }
    }
}

#[cfg(test)]
mod tests;
