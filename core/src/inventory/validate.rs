//! The invariants of an [`Inventory`], checked before it is published or allocated from.
//!
//! Errors name the field by its YAML path (`gpus[3].minor`) and the offending value, because
//! the most common source of a broken inventory is a hand-written mock file.

use std::collections::{BTreeMap, BTreeSet};

use super::{Gpu, Inventory, MigDevice};
use crate::error::{Error, Result};

/// Kubernetes' limit on a string or version attribute value of a ResourceSlice device.
pub(crate) const MAX_ATTRIBUTE_LEN: usize = 64;

impl Inventory {
    /// Checks the invariants every consumer of an inventory relies on:
    /// - `driverVersion` (and `cudaDriverVersion` when set) is non-empty;
    /// - minors and UUIDs (GPU and MIG) are unique;
    /// - names are non-empty and every value published as a ResourceSlice string attribute
    ///   fits Kubernetes' limit of `MAX_ATTRIBUTE_LEN` characters;
    /// - `pciBusId` is in sysfs form (`0000:1b:00.0`) and `pcieRoot` in the form `pci0000:00`;
    /// - memory and multiprocessors are positive;
    /// - NVLink peers name other GPUs of the inventory, each at most once;
    /// - MIG devices exist only on MIG-enabled GPUs, fit inside their parent, have
    ///   non-overlapping GPU-instance placements, unique capability minors and device names
    ///   that are valid DNS labels.
    ///
    /// # Errors
    /// [`Error::InvalidInventory`] with a message of the form `field: problem value`, e.g.
    /// `gpus[3].minor: duplicate minor 2`.
    pub fn validate(&self) -> Result<()> {
        attribute_string("driverVersion", &self.driver_version)?;
        if let Some(cuda) = &self.cuda_driver_version {
            attribute_string("cudaDriverVersion", cuda)?;
        }
        // Minors first: every later check (peers, device names) refers to GPUs by minor.
        let mut known_minors = BTreeSet::new();
        for (i, gpu) in self.gpus.iter().enumerate() {
            if !known_minors.insert(gpu.minor) {
                return Err(invalid(format!(
                    "gpus[{i}].minor: duplicate minor {}",
                    gpu.minor
                )));
            }
        }
        let mut uuids = BTreeSet::new();
        let mut device_names = BTreeSet::new();
        let mut ci_cap_minors = BTreeSet::new();
        let mut gi_cap_minors = BTreeMap::new();
        for (i, gpu) in self.gpus.iter().enumerate() {
            let at = format!("gpus[{i}]");
            unique_uuid(&mut uuids, &format!("{at}.uuid"), &gpu.uuid)?;
            validate_gpu_fields(&at, gpu)?;
            validate_peers(&at, gpu, &known_minors)?;
            if !gpu.mig_enabled && !gpu.mig_devices.is_empty() {
                return Err(invalid(format!(
                    "{at}.migDevices: GPU {} has MIG devices but migEnabled is false",
                    gpu.minor
                )));
            }
            if !gpu.mig_enabled {
                device_names.insert(gpu.device_name());
            }
            validate_placements(&at, gpu)?;
            for (j, mig) in gpu.mig_devices.iter().enumerate() {
                let at = format!("{at}.migDevices[{j}]");
                unique_uuid(&mut uuids, &format!("{at}.uuid"), &mig.uuid)?;
                validate_mig_fields(&at, gpu, mig)?;
                let name = mig.device_name(gpu.minor);
                if !device_names.insert(name.clone()) {
                    return Err(invalid(format!("{at}: duplicate device name {name:?}")));
                }
                check_caps(&at, gpu.minor, mig, &mut gi_cap_minors, &mut ci_cap_minors)?;
            }
        }
        Ok(())
    }
}

fn invalid(message: String) -> Error {
    Error::InvalidInventory(message)
}

/// A value published as a string attribute: non-empty and within Kubernetes' limit.
fn attribute_string(field: &str, value: &str) -> Result<()> {
    if value.trim().is_empty() {
        return Err(invalid(format!("{field}: must not be empty")));
    }
    let chars = value.chars().count();
    if chars > MAX_ATTRIBUTE_LEN {
        return Err(invalid(format!(
            "{field}: {value:?} is {chars} characters long; Kubernetes allows at most \
             {MAX_ATTRIBUTE_LEN} in a device attribute"
        )));
    }
    Ok(())
}

fn unique_uuid(seen: &mut BTreeSet<String>, field: &str, uuid: &str) -> Result<()> {
    attribute_string(field, uuid)?;
    if !seen.insert(uuid.to_owned()) {
        return Err(invalid(format!("{field}: duplicate UUID {uuid:?}")));
    }
    Ok(())
}

fn validate_gpu_fields(at: &str, gpu: &Gpu) -> Result<()> {
    attribute_string(&format!("{at}.productName"), &gpu.product_name)?;
    attribute_string(&format!("{at}.brand"), &gpu.brand)?;
    attribute_string(&format!("{at}.architecture"), &gpu.architecture)?;
    if !is_pci_bus_id(&gpu.pci_bus_id) {
        return Err(invalid(format!(
            "{at}.pciBusId: {:?} is not a PCI address in sysfs form, e.g. \"0000:1b:00.0\"",
            gpu.pci_bus_id
        )));
    }
    if let Some(root) = &gpu.pcie_root
        && !is_pcie_root(root)
    {
        return Err(invalid(format!(
            "{at}.pcieRoot: {root:?} is not a PCIe root in sysfs form, e.g. \"pci0000:00\""
        )));
    }
    if let Some(domain) = &gpu.nvlink_domain {
        attribute_string(&format!("{at}.nvlinkDomain"), domain)?;
    }
    if gpu.memory_bytes == 0 {
        return Err(invalid(format!("{at}.memoryBytes: must be greater than 0")));
    }
    if gpu.multiprocessors == 0 {
        return Err(invalid(format!(
            "{at}.multiprocessors: must be greater than 0"
        )));
    }
    Ok(())
}

fn validate_peers(at: &str, gpu: &Gpu, known: &BTreeSet<u32>) -> Result<()> {
    let mut seen = BTreeSet::new();
    for (k, &peer) in gpu.nvlink_peers.iter().enumerate() {
        let field = format!("{at}.nvlinkPeers[{k}]");
        if peer == gpu.minor {
            return Err(invalid(format!(
                "{field}: GPU {peer} cannot be its own NVLink peer"
            )));
        }
        if !known.contains(&peer) {
            return Err(invalid(format!("{field}: no GPU with minor {peer}")));
        }
        if !seen.insert(peer) {
            return Err(invalid(format!("{field}: duplicate peer {peer}")));
        }
    }
    Ok(())
}

fn validate_mig_fields(at: &str, gpu: &Gpu, mig: &MigDevice) -> Result<()> {
    attribute_string(&format!("{at}.profile"), &mig.profile)?;
    let name = mig.device_name(gpu.minor);
    if let Err(e) = crate::names::dns_label("migDevices.profile", &name) {
        return Err(invalid(format!(
            "{at}.profile: {:?} gives the device name {name:?}, which is not a DNS label ({e})",
            mig.profile
        )));
    }
    if mig.memory_bytes == 0 || mig.memory_bytes > gpu.memory_bytes {
        return Err(invalid(format!(
            "{at}.memoryBytes: {} must be greater than 0 and at most the parent's {}",
            mig.memory_bytes, gpu.memory_bytes
        )));
    }
    if mig.multiprocessors == 0 || mig.multiprocessors > gpu.multiprocessors {
        return Err(invalid(format!(
            "{at}.multiprocessors: {} must be greater than 0 and at most the parent's {}",
            mig.multiprocessors, gpu.multiprocessors
        )));
    }
    if mig.placement.size == 0 {
        return Err(invalid(format!(
            "{at}.placement.size: must be greater than 0"
        )));
    }
    Ok(())
}

/// Compute instances of one GPU instance share its placement; different GPU instances must not
/// overlap.
fn validate_placements(at: &str, gpu: &Gpu) -> Result<()> {
    let mut instances: BTreeMap<u32, (usize, super::MigPlacement)> = BTreeMap::new();
    for (j, mig) in gpu.mig_devices.iter().enumerate() {
        let field = format!("{at}.migDevices[{j}].placement");
        let placement = mig.placement;
        if let Some((first, existing)) = instances.get(&mig.gi_id) {
            if *existing != placement {
                return Err(invalid(format!(
                    "{field}: GPU instance {} is placed at {}:{} here but at {}:{} in \
                     migDevices[{first}]",
                    mig.gi_id, placement.start, placement.size, existing.start, existing.size
                )));
            }
            continue;
        }
        for (other_gi, (other_j, other)) in &instances {
            if overlaps(placement, *other) {
                return Err(invalid(format!(
                    "{field}: {}:{} overlaps GPU instance {other_gi} at {}:{} \
                     (migDevices[{other_j}])",
                    placement.start, placement.size, other.start, other.size
                )));
            }
        }
        instances.insert(mig.gi_id, (j, placement));
    }
    Ok(())
}

fn overlaps(a: super::MigPlacement, b: super::MigPlacement) -> bool {
    let a_end = u64::from(a.start) + u64::from(a.size);
    let b_end = u64::from(b.start) + u64::from(b.size);
    u64::from(a.start) < b_end && u64::from(b.start) < a_end
}

/// A GPU instance has one access capability, shared by its compute instances; every compute
/// instance has its own, and the two kinds never share a minor.
fn check_caps(
    at: &str,
    gpu_minor: u32,
    mig: &MigDevice,
    gi_caps: &mut BTreeMap<u32, (u32, u32)>,
    ci_caps: &mut BTreeSet<u32>,
) -> Result<()> {
    if mig.gi_cap_minor == mig.ci_cap_minor {
        return Err(invalid(format!(
            "{at}.ciCapMinor: {} equals giCapMinor; GPU and compute instances have distinct \
             capability devices",
            mig.ci_cap_minor
        )));
    }
    match gi_caps.get(&mig.gi_cap_minor) {
        Some(&owner) if owner != (gpu_minor, mig.gi_id) => {
            return Err(invalid(format!(
                "{at}.giCapMinor: {} already belongs to GPU {} instance {}",
                mig.gi_cap_minor, owner.0, owner.1
            )));
        }
        Some(_) => {}
        None => {
            if ci_caps.contains(&mig.gi_cap_minor) {
                return Err(invalid(format!(
                    "{at}.giCapMinor: {} is already a compute-instance capability",
                    mig.gi_cap_minor
                )));
            }
            gi_caps.insert(mig.gi_cap_minor, (gpu_minor, mig.gi_id));
        }
    }
    if gi_caps.contains_key(&mig.ci_cap_minor) || !ci_caps.insert(mig.ci_cap_minor) {
        return Err(invalid(format!(
            "{at}.ciCapMinor: duplicate capability minor {}",
            mig.ci_cap_minor
        )));
    }
    Ok(())
}

/// `dddd:bb:dd.f` in lowercase hex: the form sysfs and Kubernetes' `resource.kubernetes.io/
/// pciBusID` use.
pub(crate) fn is_pci_bus_id(value: &str) -> bool {
    let b = value.as_bytes();
    let hex = |range: std::ops::Range<usize>| {
        b[range]
            .iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    };
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && hex(0..4)
        && hex(5..7)
        && hex(8..10)
        && hex(11..12)
}

/// `pci<domain>:<bus>` in lowercase hex, the first component under `/sys/devices`.
pub(crate) fn is_pcie_root(value: &str) -> bool {
    let Some(rest) = value.strip_prefix("pci") else {
        return false;
    };
    let Some((domain, bus)) = rest.split_once(':') else {
        return false;
    };
    let lower_hex = |s: &str| {
        s.bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    };
    domain.len() >= 4 && bus.len() == 2 && lower_hex(domain) && lower_hex(bus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_bus_id_form() {
        assert!(is_pci_bus_id("0000:1b:00.0"));
        assert!(!is_pci_bus_id("0000:1B:00.0"));
        assert!(!is_pci_bus_id("00000000:1b:00.0"));
        assert!(!is_pci_bus_id("0000:1b:00"));
        assert!(!is_pci_bus_id("0000-1b:00.0"));
        assert!(!is_pci_bus_id("ääää:1b:0.0"));
    }

    #[test]
    fn pcie_root_form() {
        assert!(is_pcie_root("pci0000:00"));
        assert!(is_pcie_root("pci10000:e0"));
        assert!(!is_pcie_root("pci0000:0"));
        assert!(!is_pcie_root("0000:00"));
        assert!(!is_pcie_root("pci00:00"));
        assert!(!is_pcie_root("pci0000:AB"));
    }
}
