//! The host's sysfs and procfs as the plugin reads them: every file read of discovery outside
//! NVML, the text handed to the pure parsers of [`super`].

use std::path::PathBuf;

use super::{
    HostFacts, MigMinors, PciHostFacts, RawSystem, caps_major_from_proc_devices, normalize_bus_id,
    parse_numa_node, pcie_root_from_sysfs_link,
};

/// Where the host's `/sys` and `/proc` are; a container mounts them elsewhere at times.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostPaths {
    /// sysfs mount, normally `/sys`.
    pub sys: PathBuf,
    /// procfs mount, normally `/proc`.
    pub proc: PathBuf,
}

impl Default for HostPaths {
    fn default() -> Self {
        HostPaths {
            sys: PathBuf::from("/sys"),
            proc: PathBuf::from("/proc"),
        }
    }
}

impl HostPaths {
    /// Reads NUMA node and PCIe root of the PCI device `bus_id` (sysfs form). Missing files
    /// give `None`: VMs and some platforms have no NUMA information.
    fn pci_facts(&self, bus_id: &str) -> PciHostFacts {
        let device = self.sys.join("bus/pci/devices").join(bus_id);
        let numa_node = std::fs::read_to_string(device.join("numa_node"))
            .ok()
            .and_then(|text| parse_numa_node(&text));
        let pcie_root = std::fs::read_link(&device)
            .ok()
            .and_then(|target| pcie_root_from_sysfs_link(&target, bus_id));
        PciHostFacts {
            numa_node,
            pcie_root,
        }
    }

    /// Reads `/proc/driver/nvidia-caps/mig-minors`; empty when the driver does not provide it.
    pub(crate) fn mig_minors(&self) -> MigMinors {
        std::fs::read_to_string(self.proc.join("driver/nvidia-caps/mig-minors"))
            .map(|text| MigMinors::parse(&text))
            .unwrap_or_default()
    }

    /// Reads the character-device major of `/dev/nvidia-caps/nvidia-cap<minor>` from
    /// `/proc/devices` ([`caps_major_from_proc_devices`]); `None` when the file cannot be read
    /// or names no `nvidia-caps` device. A CDI device node needs it to be created in a
    /// container without a node on the host (a MIG instance made after the host's
    /// `/dev/nvidia-caps` was populated).
    pub(crate) fn nvidia_caps_major(&self) -> Option<u32> {
        let path = self.proc.join("devices");
        match std::fs::read_to_string(&path) {
            Ok(text) => caps_major_from_proc_devices(&text),
            Err(error) => {
                tracing::debug!(path = %path.display(), %error, "cannot read the device majors");
                None
            }
        }
    }

    /// Gathers the host facts for every GPU of `raw`.
    pub(crate) fn facts_for(&self, raw: &RawSystem) -> HostFacts {
        let pci = raw
            .gpus
            .iter()
            .filter_map(|gpu| normalize_bus_id(&gpu.pci_bus_id))
            .map(|bus_id| {
                let facts = self.pci_facts(&bus_id);
                (bus_id, facts)
            })
            .collect();
        let mig_minors = if raw.gpus.iter().any(|g| g.mig_enabled) {
            self.mig_minors()
        } else {
            MigMinors::default()
        };
        HostFacts { pci, mig_minors }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_paths_read_a_fake_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        let sys = dir.path().join("sys");
        let device = sys.join("devices/pci0000:15/0000:15:01.0/0000:18:00.0");
        std::fs::create_dir_all(&device).unwrap();
        std::fs::write(device.join("numa_node"), "1\n").unwrap();
        let bus = sys.join("bus/pci/devices");
        std::fs::create_dir_all(&bus).unwrap();
        std::os::unix::fs::symlink(
            "../../../devices/pci0000:15/0000:15:01.0/0000:18:00.0",
            bus.join("0000:18:00.0"),
        )
        .unwrap();
        let proc = dir.path().join("proc");
        std::fs::create_dir_all(proc.join("driver/nvidia-caps")).unwrap();
        std::fs::write(
            proc.join("driver/nvidia-caps/mig-minors"),
            "gpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n",
        )
        .unwrap();
        let paths = HostPaths { sys, proc };
        assert_eq!(
            paths.pci_facts("0000:18:00.0"),
            PciHostFacts {
                numa_node: Some(1),
                pcie_root: Some("pci0000:15".into())
            }
        );
        assert_eq!(paths.pci_facts("0000:19:00.0"), PciHostFacts::default());
        assert_eq!(paths.mig_minors().lookup(0, 1, 0), Some((12, 13)));
        assert_eq!(paths.nvidia_caps_major(), None);
        std::fs::write(
            paths.proc.join("devices"),
            "Character devices:\n195 nvidia\n237 nvidia-caps\n",
        )
        .unwrap();
        assert_eq!(paths.nvidia_caps_major(), Some(237));
    }
}
