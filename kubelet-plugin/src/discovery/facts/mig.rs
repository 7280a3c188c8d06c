//! MIG facts: what NVML and the driver's procfs files say about MIG devices and the
//! capability devices (`/dev/nvidia-caps`) that grant access to them, and the pure functions
//! that interpret them.

use std::collections::BTreeMap;

use kerf_core::inventory::{MigDevice, MigPlacement};

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
/// The MIG profile name NVML would print, e.g. `1g.5gb` or `1c.3g.20gb`, from the device's
/// slices and memory and the parent's total memory (both in MiB). The memory figure is the
/// MIG device's share of the parent rounded up to eighths, times the parent's memory in GB
/// rounded up, rounded to the nearest GB. Media-engine variants (`+me`, `+gfx`) are not
/// visible in these attributes and come out without the suffix.
pub(crate) fn mig_profile_name(
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
pub(crate) fn ids_from_legacy_mig_uuid(uuid: &str) -> Option<(u32, u32)> {
    let rest = uuid.strip_prefix("MIG-GPU-")?;
    let mut parts = rest.rsplitn(3, '/');
    let ci = parts.next()?.parse().ok()?;
    let gi = parts.next()?.parse().ok()?;
    parts.next()?;
    Some((gi, ci))
}

/// The name of the driver's capability-device character driver in `/proc/devices`.
pub(super) const NVIDIA_CAPS_DEVICE: &str = "nvidia-caps";

/// The character-device major of `/dev/nvidia-caps/nvidia-cap<minor>` from the text of
/// `/proc/devices`: the number on the `nvidia-caps` line of its `Character devices:` section.
/// The kernel assigns the major when the driver loads, so it differs between hosts and must
/// be read, not assumed. `None` when the driver registered no such device (drivers before
/// R450, or MIG capabilities exposed through `/proc/driver/nvidia/capabilities` only).
///
/// Lines are `<major> <name>`, as NVIDIA's own reader takes them
/// (NVIDIA/nvidia-container-toolkit `internal/info/proc/devices/devices.go`
/// (`processProcDeviceLine`), whose `NVIDIACaps` names this device); unlike that reader, a
/// name in the `Block devices:` section is not taken, since a cap node is a character device.
pub(crate) fn caps_major_from_proc_devices(text: &str) -> Option<u32> {
    let mut character = true;
    for line in text.lines() {
        let line = line.trim();
        match line {
            "Character devices:" => character = true,
            "Block devices:" => character = false,
            _ if character => {
                let mut fields = line.split_whitespace();
                if let (Some(major), Some(NVIDIA_CAPS_DEVICE), None) =
                    (fields.next(), fields.next(), fields.next())
                    && let Ok(major) = major.parse()
                {
                    return Some(major);
                }
            }
            _ => {}
        }
    }
    None
}

pub(super) fn convert_mig(
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
    fn caps_major_from_proc_devices_text() {
        let text = "Character devices:\n  1 mem\n  4 /dev/vc/0\n195 nvidia-frontend\n\
                    237 nvidia-caps\n238 nvidia-uvm\n\nBlock devices:\n  7 loop\n";
        assert_eq!(caps_major_from_proc_devices(text), Some(237));
        // Other NVIDIA devices, a prefix match or a block device are not the caps device.
        let none = "Character devices:\n195 nvidia\n236 nvidia-caps-imex-channels\n\
                    510 nvidia-uvm\n\nBlock devices:\n240 nvidia-caps\n";
        assert_eq!(caps_major_from_proc_devices(none), None);
        assert_eq!(caps_major_from_proc_devices(""), None);
        assert_eq!(
            caps_major_from_proc_devices("Character devices:\nx nvidia-caps\n"),
            None
        );
        // Without section headers every line is a character device.
        assert_eq!(caps_major_from_proc_devices("508 nvidia-caps"), Some(508));
    }
}
