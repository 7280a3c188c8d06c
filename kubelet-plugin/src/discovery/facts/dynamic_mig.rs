//! Dynamic-MIG facts: a GPU's MIG catalogue as NVML describes it, and which MIG-enabled GPUs
//! kerf partitions on demand.
//!
//! NVML describes each GPU-instance profile by its index (`NVML_GPU_INSTANCE_PROFILE_*`):
//! `nvmlDeviceGetGpuInstanceProfileInfo[V]` gives its id, slices, engines and memory, and
//! `nvmlDeviceGetGpuInstancePossiblePlacements_v2` where its instances may start. NVIDIA's DRA
//! driver reads the same calls for every profile index and skips the indices the GPU answers
//! with `NOT_SUPPORTED` or `INVALID_ARGUMENT` (kubernetes-sigs/dra-driver-nvidia-gpu
//! `cmd/gpu-kubelet-plugin/nvlib.go` (`getGpuInfo`, `inspectMigProfilesAndPlacements`));
//! [`decode_catalog`] turns those answers into a [`GpuMigCatalog`].

use std::collections::BTreeSet;

use kerf_core::inventory::MigPlacement;
use kerf_core::mig_catalog::{GpuMigCatalog, MigProfileSpec, catalog_for};
use kerf_core::mig_reconcile::RecordedInstance;

use super::{RawGpu, mig_profile_name};

const MIB: u64 = 1024 * 1024;

/// NVML's `NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1`: the one-slice profile with the media
/// extensions (`1g.5gb+me`), which NVML's slice and memory figures do not tell apart.
pub(crate) const GI_PROFILE_1_SLICE_REV1: u32 = 7;

/// What NVML reported about one GPU-instance profile of a GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawGiProfile {
    /// The profile index asked for (`NVML_GPU_INSTANCE_PROFILE_*`).
    pub profile_index: u32,
    /// `id`: what GPU-instance creation takes.
    pub id: u32,
    /// `name` of `nvmlGpuInstanceProfileInfo_v2_t` (e.g. `MIG 1g.5gb`), when the driver has
    /// the versioned call.
    pub name: Option<String>,
    /// `sliceCount`: compute slices.
    pub slice_count: u32,
    /// `instanceCount`.
    pub instance_count: u32,
    /// `multiprocessorCount`.
    pub multiprocessors: u32,
    /// `copyEngineCount`.
    pub copy_engines: u32,
    /// `decoderCount`.
    pub decoders: u32,
    /// `encoderCount`.
    pub encoders: u32,
    /// `jpegCount`.
    pub jpegs: u32,
    /// `ofaCount`.
    pub ofas: u32,
    /// `memorySizeMB` (MiB).
    pub memory_size_mib: u64,
    /// `nvmlDeviceGetGpuInstancePossiblePlacements_v2`, in NVML's order.
    pub placements: Vec<MigPlacement>,
}

/// The compute-instance profile index (`NVML_COMPUTE_INSTANCE_PROFILE_*`) of a compute
/// instance spanning a GPU instance of `compute_slices` slices; `None` for slice counts NVML
/// has no such profile for.
pub(crate) fn full_compute_profile(compute_slices: u32) -> Option<u32> {
    match compute_slices {
        1 => Some(0),
        2 => Some(1),
        3 => Some(2),
        4 => Some(3),
        7 => Some(4),
        8 => Some(5),
        6 => Some(6),
        _ => None,
    }
}

/// The catalogue NVML's answers describe for a GPU with `parent_memory_mib` of memory;
/// `Ok(None)` when NVML named no usable profile (a driver without the calls). Profiles
/// without placements are left out (NVML lists profiles a GPU cannot place at all, such as
/// graphics profiles in compute mode), and so are profiles whose slice count has no
/// full-instance compute profile. Profiles come smallest first, as the built-in catalogues
/// list them.
///
/// # Errors
/// A message naming the profile when NVML's answer is inconsistent: placements of different
/// sizes, an empty placement, or a profile without a name or memory figures.
pub(crate) fn decode_catalog(
    parent_memory_mib: u64,
    raw: &[RawGiProfile],
) -> Result<Option<GpuMigCatalog>, String> {
    let mut profiles = Vec::new();
    for profile in raw.iter().filter(|p| !p.placements.is_empty()) {
        if let Some(spec) = decode_profile(parent_memory_mib, profile)? {
            profiles.push(spec);
        }
    }
    if profiles.is_empty() {
        return Ok(None);
    }
    profiles.sort_by_key(|p| (p.memory_slices, p.compute_slices, p.profile_index));
    let memory_slice_count = profiles
        .iter()
        .flat_map(|p| p.placements.iter().map(|pl| pl.start + pl.size))
        .max()
        .unwrap_or(0);
    let compute_slice_count = profiles.iter().map(|p| p.compute_slices).max().unwrap_or(0);
    Ok(Some(GpuMigCatalog {
        memory_slice_count,
        compute_slice_count,
        profiles,
    }))
}

fn decode_profile(
    parent_memory_mib: u64,
    raw: &RawGiProfile,
) -> Result<Option<MigProfileSpec>, String> {
    let what = || format!("GPU instance profile {} (id {})", raw.profile_index, raw.id);
    let size = raw.placements[0].size;
    if size == 0 || raw.placements.iter().any(|p| p.size != size) {
        return Err(format!(
            "{}: placements of different or zero sizes {:?}",
            what(),
            raw.placements
        ));
    }
    let Some(ci_profile_id) = full_compute_profile(raw.slice_count) else {
        return Ok(None);
    };
    let name = match raw.name.as_deref().map(str::trim) {
        Some(name) if !name.is_empty() => name.strip_prefix("MIG ").unwrap_or(name).to_owned(),
        _ => {
            let base = mig_profile_name(
                raw.slice_count,
                raw.slice_count,
                raw.memory_size_mib,
                parent_memory_mib,
            )
            .ok_or_else(|| format!("{}: no name and no slice or memory figures", what()))?;
            if raw.profile_index == GI_PROFILE_1_SLICE_REV1 {
                format!("{base}+me")
            } else {
                base
            }
        }
    };
    Ok(Some(MigProfileSpec {
        name,
        profile_index: raw.profile_index,
        gi_profile_id: raw.id,
        ci_profile_id,
        compute_slices: raw.slice_count,
        memory_slices: size,
        memory_mib: raw.memory_size_mib,
        multiprocessors: raw.multiprocessors,
        copy_engines: raw.copy_engines,
        decoders: raw.decoders,
        encoders: raw.encoders,
        jpegs: raw.jpegs,
        ofas: raw.ofas,
        instance_count: raw.instance_count,
        placements: raw.placements.clone(),
    }))
}

/// The catalogue of `gpu`: NVML's ([`decode_catalog`] of [`RawGpu::mig_profiles`]) when it
/// answered, else the built-in one of its product ([`catalog_for`]). The second value says
/// how NVML's answer differs from the built-in catalogue, for a log line: the built-in
/// figures come from documentation, NVML's from the driver that will create the instances.
///
/// # Errors
/// [`decode_catalog`]'s message when NVML's answer is inconsistent.
pub(crate) fn gpu_catalog(gpu: &RawGpu) -> Result<(Option<GpuMigCatalog>, Option<String>), String> {
    let builtin = catalog_for(&gpu.name);
    let Some(nvml) = decode_catalog(gpu.memory_total_bytes / MIB, &gpu.mig_profiles)? else {
        return Ok((builtin.cloned(), None));
    };
    let difference = builtin.and_then(|b| catalog_difference(&nvml, b));
    Ok((Some(nvml), difference))
}

/// How `nvml` differs from `builtin`, profile by profile; `None` when they agree.
pub(crate) fn catalog_difference(nvml: &GpuMigCatalog, builtin: &GpuMigCatalog) -> Option<String> {
    let mut differences = Vec::new();
    for profile in &nvml.profiles {
        match builtin.profile(&profile.name) {
            None => differences.push(format!("{} only in NVML", profile.name)),
            Some(known) if known != profile => {
                differences.push(format!("{} differs", profile.name));
            }
            Some(_) => {}
        }
    }
    for profile in &builtin.profiles {
        if nvml.profile(&profile.name).is_none() {
            differences.push(format!("{} not offered by NVML", profile.name));
        }
    }
    if nvml.memory_slice_count != builtin.memory_slice_count
        || nvml.compute_slice_count != builtin.compute_slice_count
    {
        differences.push(format!(
            "slices {}/{} (built-in {}/{})",
            nvml.memory_slice_count,
            nvml.compute_slice_count,
            builtin.memory_slice_count,
            builtin.compute_slice_count
        ));
    }
    (!differences.is_empty()).then(|| differences.join(", "))
}

/// The MIG instances kerf itself created, as the checkpoint records them: a GPU whose only
/// MIG devices are these is still free for dynamic MIG.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct KerfInstances {
    /// `(parent GPU minor, GPU instance id)` of each created GPU instance.
    pub gpu_instances: BTreeSet<(u32, u32)>,
    /// UUIDs (`MIG-…`) of the MIG devices created.
    pub uuids: BTreeSet<String>,
}

impl KerfInstances {
    /// The instances the checkpoint's records name
    /// ([`kerf_core::mig_reconcile::recorded_instances`]); intents without a GPU instance id
    /// name none.
    pub(crate) fn from_records(records: &[RecordedInstance]) -> Self {
        let mut kerf = KerfInstances::default();
        for record in records {
            let instance = &record.instance;
            if let Some(gi_id) = instance.gi_id {
                kerf.gpu_instances.insert((instance.parent_minor, gi_id));
            }
            if let Some(uuid) = &instance.mig_uuid {
                kerf.uuids.insert(uuid.clone());
            }
        }
        kerf
    }
}

/// Which MIG-enabled GPUs discovery marks as dynamic ([`kerf_core::inventory::Gpu::dynamic_mig`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct DynamicMigPolicy {
    /// Whether dynamic MIG is on at all (`--dynamic-mig`).
    pub enabled: bool,
    /// Minors of GPUs the admin keeps statically partitioned (`--static-mig-gpus`).
    pub static_gpus: BTreeSet<u32>,
    /// The MIG instances kerf created, from the checkpoint.
    pub kerf_instances: KerfInstances,
}

/// Whether `gpu` with catalogue `catalog` is a dynamic-MIG GPU under `policy`: dynamic MIG
/// on, MIG mode on, a catalogue, not listed as static, and no MIG device kerf did not create
/// (someone else's partitioning is left alone, as NVIDIA's driver leaves GPUs with
/// pre-configured MIG devices to static MIG). `Err` says why not, for a log line.
///
/// # Errors
/// The reason the GPU is not dynamic.
pub(crate) fn dynamic_decision(
    gpu: &RawGpu,
    catalog: Option<&GpuMigCatalog>,
    policy: &DynamicMigPolicy,
) -> Result<(), String> {
    if !policy.enabled {
        return Err("dynamic MIG is off".into());
    }
    if !gpu.mig_enabled {
        return Err("MIG mode is off".into());
    }
    if policy.static_gpus.contains(&gpu.minor) {
        return Err("listed as a static-MIG GPU".into());
    }
    if catalog.is_none_or(|c| c.profiles.is_empty()) {
        return Err(format!("no MIG catalogue for {:?}", gpu.name));
    }
    let foreign: Vec<&str> = gpu
        .mig_devices
        .iter()
        .filter(|mig| {
            let by_gi = mig.gi_id.is_some_and(|gi| {
                policy
                    .kerf_instances
                    .gpu_instances
                    .contains(&(gpu.minor, gi))
            });
            !by_gi && !policy.kerf_instances.uuids.contains(&mig.uuid)
        })
        .map(|mig| mig.uuid.as_str())
        .collect();
    if foreign.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "has MIG devices kerf did not create: {}",
            foreign.join(", ")
        ))
    }
}

#[cfg(test)]
#[path = "dynamic_mig_tests.rs"]
mod tests;
