//! The MIG profiles a GPU model offers and where their GPU instances can be placed: what
//! "dynamic MIG" publishes as one device per (profile, placement) and creates on demand.
//!
//! A GPU with MIG mode on has 8 memory slices and 7 compute slices (A100, H100). A GPU instance
//! of a profile takes `memory_slices` consecutive memory slices starting at one of the
//! profile's placement starts (NVML `nvmlDeviceGetGpuInstancePossiblePlacements_v2`); two GPU
//! instances can coexist exactly when their memory-slice ranges do not overlap
//! ([`conflicts`]), and the engines (copy engines, decoders, JPEG, OFA) of the instances must
//! fit the GPU's.
//!
//! # Counters
//!
//! The scheduler learns these rules as DRA shared counters (DRAPartitionableDevices): one
//! counter set per GPU, the same shape as NVIDIA's DRA driver publishes
//! (kubernetes-sigs/dra-driver-nvidia-gpu `cmd/gpu-kubelet-plugin/partitions.go`
//! (`PartSharedCounterSets`, `capacitiesToCounters`, `addCountersForMemSlices`), `mig.go`
//! (`MigSpec.PartConsumesCounters`), `nvlib.go` (`GpuInfo.PartConsumesCounters`)):
//! - `memory-slice-<i>` = 1 for every memory slice: a placement consumes the slices it covers,
//!   so two overlapping placements never fit together;
//! - `compute-slices`, `multiprocessors`, `memory` (bytes), `copy-engines`, `decoders`,
//!   `encoders`, `jpeg-engines`, `ofa-engines` = the maximum over the catalogue's profiles
//!   (the full-GPU profile's figures): a placement consumes its profile's figures, which is
//!   what limits media-extension (`+me`) profiles to one instance per GPU (one OFA engine);
//! - the whole GPU consumes every counter ([`gpu_counters`]), so it and any placement exclude
//!   each other.
//!
//! `core/tests/mig_catalog.rs` checks exhaustively that, for every built-in catalogue, a set of
//! placements fits the counters exactly when it is non-overlapping and within every profile's
//! instance count.
//!
//! # Media extensions
//!
//! `+me` profiles ([`MigProfileSpec::has_media_extensions`]) are published like the others:
//! they are the only small instances with the JPEG and OFA engines, and the counters above
//! already enforce their one-at-a-time limit, so the scheduler cannot over-commit them. A GPU
//! then publishes 25 placement devices plus itself (26; two GPUs fill a 64-device slice).

use std::collections::BTreeMap;
use std::sync::LazyLock;

use serde::{Deserialize, Serialize};

use crate::inventory::{MigPlacement, mig_device_name};

const MIB: u64 = 1024 * 1024;

/// Prefix of the per-memory-slice counters: `memory-slice-0` … `memory-slice-7`.
pub const COUNTER_MEMORY_SLICE_PREFIX: &str = "memory-slice-";
/// Counter of compute slices.
const COUNTER_COMPUTE_SLICES: &str = "compute-slices";
/// Counter of streaming multiprocessors.
pub const COUNTER_MULTIPROCESSORS: &str = "multiprocessors";
/// Counter of memory, in bytes.
pub const COUNTER_MEMORY: &str = "memory";
/// Counter of copy engines.
const COUNTER_COPY_ENGINES: &str = "copy-engines";
/// Counter of video decoders.
const COUNTER_DECODERS: &str = "decoders";
/// Counter of video encoders.
const COUNTER_ENCODERS: &str = "encoders";
/// Counter of JPEG engines.
const COUNTER_JPEG_ENGINES: &str = "jpeg-engines";
/// Counter of optical-flow accelerators.
const COUNTER_OFA_ENGINES: &str = "ofa-engines";

/// One GPU-instance profile of a GPU model, as NVML describes it
/// (`nvmlGpuInstanceProfileInfo_t`), with the placements its instances can take.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigProfileSpec {
    /// Profile name as `nvidia-smi mig -lgip` prints it without `MIG `, e.g. `1g.10gb+me`.
    pub name: String,
    /// The profile's NVML `NVML_GPU_INSTANCE_PROFILE_*` index, what
    /// `nvmlDeviceGetGpuInstanceProfileInfo` takes (0 = 1 slice, 7 = 1 slice rev 1 (`+me`),
    /// 9 = 1 slice rev 2 (e.g. `1g.10gb` on A100-40GB)).
    pub profile_index: u32,
    /// The profile id (`nvmlGpuInstanceProfileInfo_t.id`, the `ID` column of
    /// `nvidia-smi mig -lgip`, e.g. 19 for `1g.5gb`), what GPU-instance creation takes.
    pub gi_profile_id: u32,
    /// The compute-instance profile that spans the whole GPU instance
    /// (`NVML_COMPUTE_INSTANCE_PROFILE_*`: 0 = 1 slice, 1 = 2, 2 = 3, 3 = 4, 4 = 7 slices).
    pub ci_profile_id: u32,
    /// Compute slices of an instance.
    pub compute_slices: u32,
    /// Memory slices of an instance (the placement size).
    pub memory_slices: u32,
    /// Memory of an instance in MiB (`memorySizeMB`).
    pub memory_mib: u64,
    /// Streaming multiprocessors of an instance.
    pub multiprocessors: u32,
    /// Copy engines of an instance.
    pub copy_engines: u32,
    /// Video decoders of an instance.
    pub decoders: u32,
    /// Video encoders of an instance.
    pub encoders: u32,
    /// JPEG engines of an instance.
    pub jpegs: u32,
    /// Optical-flow accelerators of an instance.
    pub ofas: u32,
    /// How many instances of the profile the GPU can hold at once (`instanceCount`).
    pub instance_count: u32,
    /// Where an instance can be placed, in NVML's order.
    pub placements: Vec<MigPlacement>,
}

impl MigProfileSpec {
    /// Memory of an instance in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib * MIB
    }

    /// Whether this is a media-extension profile (`+me`): one slice with the GPU's JPEG and
    /// OFA engines, one instance per GPU.
    pub fn has_media_extensions(&self) -> bool {
        self.name.ends_with("+me")
    }
}

/// The MIG geometry of one GPU model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuMigCatalog {
    /// Memory slices of the GPU (8 on A100 and H100).
    pub memory_slice_count: u32,
    /// Compute slices of the GPU (7 on A100 and H100).
    pub compute_slice_count: u32,
    /// The GPU-instance profiles, smallest first.
    pub profiles: Vec<MigProfileSpec>,
}

/// One placement of one profile on one GPU: a device dynamic MIG publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatalogPlacement<'a> {
    /// The profile.
    pub profile: &'a MigProfileSpec,
    /// Where its GPU instance would sit.
    pub placement: MigPlacement,
}

impl CatalogPlacement<'_> {
    /// The published device name on GPU `gpu_minor`, the one an existing MIG device of this
    /// profile and placement has (`mig_device_name`).
    pub fn device_name(&self, gpu_minor: u32) -> String {
        mig_device_name(gpu_minor, &self.profile.name, self.placement.start)
    }
}

impl GpuMigCatalog {
    /// Every (profile, placement) pair, profiles in catalogue order, placements in NVML's.
    pub fn placements(&self) -> impl Iterator<Item = CatalogPlacement<'_>> {
        self.profiles.iter().flat_map(|profile| {
            profile
                .placements
                .iter()
                .map(move |&placement| CatalogPlacement { profile, placement })
        })
    }

    /// Looks a profile up by name.
    pub fn profile(&self, name: &str) -> Option<&MigProfileSpec> {
        self.profiles.iter().find(|p| p.name == name)
    }

    /// Looks a profile up by its GPU-instance profile id.
    pub fn profile_by_id(&self, gi_profile_id: u32) -> Option<&MigProfileSpec> {
        self.profiles
            .iter()
            .find(|p| p.gi_profile_id == gi_profile_id)
    }

    /// The placement whose published name on GPU `gpu_minor` is `device_name`.
    pub fn placement_named(
        &self,
        gpu_minor: u32,
        device_name: &str,
    ) -> Option<CatalogPlacement<'_>> {
        self.placements()
            .find(|p| p.device_name(gpu_minor) == device_name)
    }
}

/// Whether two GPU instances cannot coexist: their memory-slice ranges overlap.
pub fn conflicts(a: MigPlacement, b: MigPlacement) -> bool {
    a.start < b.start + b.size && b.start < a.start + a.size
}

/// The name of GPU `gpu_minor`'s counter set: `gpu-<minor>`, a DNS label like every counter
/// set name must be.
pub fn counter_set_name(gpu_minor: u32) -> String {
    format!("gpu-{gpu_minor}")
}

/// The counters of one GPU (see the module docs). The whole GPU consumes all of them.
pub fn gpu_counters(catalog: &GpuMigCatalog) -> BTreeMap<String, u64> {
    let max = |f: fn(&MigProfileSpec) -> u64| catalog.profiles.iter().map(f).max().unwrap_or(0);
    let mut counters = BTreeMap::from([
        (
            COUNTER_COMPUTE_SLICES.to_owned(),
            u64::from(catalog.compute_slice_count),
        ),
        (
            COUNTER_MULTIPROCESSORS.to_owned(),
            max(|p| u64::from(p.multiprocessors)),
        ),
        (COUNTER_MEMORY.to_owned(), max(MigProfileSpec::memory_bytes)),
        (
            COUNTER_COPY_ENGINES.to_owned(),
            max(|p| u64::from(p.copy_engines)),
        ),
        (COUNTER_DECODERS.to_owned(), max(|p| u64::from(p.decoders))),
        (COUNTER_ENCODERS.to_owned(), max(|p| u64::from(p.encoders))),
        (COUNTER_JPEG_ENGINES.to_owned(), max(|p| u64::from(p.jpegs))),
        (COUNTER_OFA_ENGINES.to_owned(), max(|p| u64::from(p.ofas))),
    ]);
    for slice in 0..catalog.memory_slice_count {
        counters.insert(memory_slice_counter(slice), 1);
    }
    counters
}

/// What a GPU instance of `profile` at `placement` consumes of its GPU's counters. Counters
/// it consumes none of are left out.
pub fn placement_consumption(
    profile: &MigProfileSpec,
    placement: MigPlacement,
) -> BTreeMap<String, u64> {
    let mut consumed: BTreeMap<String, u64> = [
        (COUNTER_COMPUTE_SLICES, u64::from(profile.compute_slices)),
        (COUNTER_MULTIPROCESSORS, u64::from(profile.multiprocessors)),
        (COUNTER_MEMORY, profile.memory_bytes()),
        (COUNTER_COPY_ENGINES, u64::from(profile.copy_engines)),
        (COUNTER_DECODERS, u64::from(profile.decoders)),
        (COUNTER_ENCODERS, u64::from(profile.encoders)),
        (COUNTER_JPEG_ENGINES, u64::from(profile.jpegs)),
        (COUNTER_OFA_ENGINES, u64::from(profile.ofas)),
    ]
    .into_iter()
    .filter(|&(_, value)| value > 0)
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    for slice in placement.start..placement.start + placement.size {
        consumed.insert(memory_slice_counter(slice), 1);
    }
    consumed
}

fn memory_slice_counter(slice: u32) -> String {
    format!("{COUNTER_MEMORY_SLICE_PREFIX}{slice}")
}

/// The built-in catalogue of a GPU model, by its NVML product name; `None` for GPUs without
/// MIG or that kerf has no built-in catalogue for.
///
/// Figures: the A100-SXM4-40GB profiles as NVML reports them (NVIDIA go-nvml
/// `pkg/nvml/mock/dgxa100/dgxa100.go` (`MIGProfiles`), which mirrors a DGX A100); memory sizes
/// and multiprocessors of the A100-80GB and H100-80GB from `nvidia-smi mig -lgip` (NVIDIA MIG
/// user guide, "Supported MIG Profiles"), engines from the same guide's profile tables;
/// placements from `nvidia-smi mig -lgipp` (the same for all three). The
/// real plugin should prefer what NVML reports on the node; these serve mock mode and GPUs
/// whose NVML lacks the placement call.
pub fn catalog_for(product_name: &str) -> Option<&'static GpuMigCatalog> {
    let index = match product_name {
        A100_SXM4_40GB => 0,
        A100_SXM4_80GB => 1,
        H100_SXM5_80GB => 2,
        _ => return None,
    };
    CATALOGS.get(index)
}

/// NVML product name of the A100 SXM4 40GB.
pub const A100_SXM4_40GB: &str = "NVIDIA A100-SXM4-40GB";
/// NVML product name of the A100 SXM4 80GB.
pub const A100_SXM4_80GB: &str = "NVIDIA A100-SXM4-80GB";
/// NVML product name of the H100 SXM5 80GB.
pub const H100_SXM5_80GB: &str = "NVIDIA H100 80GB HBM3";

static CATALOGS: LazyLock<[GpuMigCatalog; 3]> = LazyLock::new(|| {
    [
        catalog(&A100_40GB_PROFILES),
        catalog(&A100_80GB_PROFILES),
        catalog(&H100_80GB_PROFILES),
    ]
});

/// One row of a built-in table: name, profile index, GI profile id, CI profile id, compute
/// slices, memory slices, MiB, SMs, copy engines, decoders, encoders, JPEG, OFA, instance count.
type Row = (&'static str, [u32; 4], u32, u64, u32, [u32; 5], u32);

/// Placement starts per placement size, the same on A100 and H100 (`nvidia-smi mig -lgipp`):
/// `+me` shares the 1-slice starts; 1-slice rev 2 (two memory slices, one compute slice) and
/// 2-slice profiles differ in where they may start.
fn starts(name: &str, memory_slices: u32, compute_slices: u32) -> &'static [u32] {
    match (memory_slices, compute_slices) {
        (1, _) => &[0, 1, 2, 3, 4, 5, 6],
        (2, 1) => &[0, 2, 4, 6],
        (2, _) => &[0, 2, 4],
        (4, 3) => &[0, 4],
        (4 | 8, _) => &[0],
        _ => {
            debug_assert!(false, "no placement rule for {name}");
            &[]
        }
    }
}

fn catalog(rows: &[Row]) -> GpuMigCatalog {
    let profiles = rows
        .iter()
        .map(
            |&(
                name,
                [profile_index, gi_profile_id, ci_profile_id, compute_slices],
                memory_slices,
                memory_mib,
                multiprocessors,
                [copy_engines, decoders, encoders, jpegs, ofas],
                instance_count,
            )| {
                MigProfileSpec {
                    name: name.to_owned(),
                    profile_index,
                    gi_profile_id,
                    ci_profile_id,
                    compute_slices,
                    memory_slices,
                    memory_mib,
                    multiprocessors,
                    copy_engines,
                    decoders,
                    encoders,
                    jpegs,
                    ofas,
                    instance_count,
                    placements: starts(name, memory_slices, compute_slices)
                        .iter()
                        .map(|&start| MigPlacement {
                            start,
                            size: memory_slices,
                        })
                        .collect(),
                }
            },
        )
        .collect();
    GpuMigCatalog {
        memory_slice_count: 8,
        compute_slice_count: 7,
        profiles,
    }
}

// (name, [profile index, GI profile id, CI profile id, compute slices], memory slices, MiB,
//  SMs, [copy engines, decoders, encoders, JPEG, OFA], instance count)
const A100_40GB_PROFILES: [Row; 7] = [
    ("1g.5gb", [0, 19, 0, 1], 1, 4864, 14, [1, 0, 0, 0, 0], 7),
    ("1g.5gb+me", [7, 20, 0, 1], 1, 4864, 14, [1, 1, 0, 1, 1], 1),
    ("1g.10gb", [9, 15, 0, 1], 2, 9856, 14, [1, 1, 0, 0, 0], 4),
    ("2g.10gb", [1, 14, 1, 2], 2, 9856, 28, [2, 1, 0, 0, 0], 3),
    ("3g.20gb", [2, 9, 2, 3], 4, 19968, 42, [3, 2, 0, 0, 0], 2),
    ("4g.20gb", [3, 5, 3, 4], 4, 19968, 56, [4, 2, 0, 0, 0], 1),
    ("7g.40gb", [4, 0, 4, 7], 8, 40192, 98, [7, 5, 0, 1, 1], 1),
];

const A100_80GB_PROFILES: [Row; 7] = [
    ("1g.10gb", [0, 19, 0, 1], 1, 9728, 14, [1, 0, 0, 0, 0], 7),
    ("1g.10gb+me", [7, 20, 0, 1], 1, 9728, 14, [1, 1, 0, 1, 1], 1),
    ("1g.20gb", [9, 15, 0, 1], 2, 19968, 14, [1, 1, 0, 0, 0], 4),
    ("2g.20gb", [1, 14, 1, 2], 2, 19968, 28, [2, 1, 0, 0, 0], 3),
    ("3g.40gb", [2, 9, 2, 3], 4, 40192, 42, [3, 2, 0, 0, 0], 2),
    ("4g.40gb", [3, 5, 3, 4], 4, 40192, 56, [4, 2, 0, 0, 0], 1),
    ("7g.80gb", [4, 0, 4, 7], 8, 80896, 98, [7, 5, 0, 1, 1], 1),
];

const H100_80GB_PROFILES: [Row; 7] = [
    ("1g.10gb", [0, 19, 0, 1], 1, 9984, 16, [1, 1, 0, 1, 0], 7),
    ("1g.10gb+me", [7, 20, 0, 1], 1, 9984, 16, [1, 1, 0, 1, 1], 1),
    ("1g.20gb", [9, 15, 0, 1], 2, 20096, 26, [1, 1, 0, 1, 0], 4),
    ("2g.20gb", [1, 14, 1, 2], 2, 20096, 32, [2, 2, 0, 2, 0], 3),
    ("3g.40gb", [2, 9, 2, 3], 4, 40448, 60, [3, 3, 0, 3, 0], 2),
    ("4g.40gb", [3, 5, 3, 4], 4, 40448, 64, [4, 4, 0, 4, 0], 1),
    ("7g.80gb", [4, 0, 4, 7], 8, 81152, 132, [8, 7, 0, 7, 1], 1),
];
