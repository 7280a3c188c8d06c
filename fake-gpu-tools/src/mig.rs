//! Emulated MIG GPU and compute instances for mock driver roots: the state NVML's MIG calls
//! (`nvmlDeviceCreateGpuInstanceWithPlacement`, `nvmlGpuInstanceCreateComputeInstance`,
//! `nvmlComputeInstanceDestroy`, `nvmlGpuInstanceDestroy`, `nvmlDeviceGetGpuInstances`) would
//! change on a real GPU, kept in a file several processes share: the kubelet plugin's mock
//! MIG control, the fake `nvidia-smi mig`, and tests that inspect or tamper with it.
//!
//! - State: `<root>/kerf-fake-tools/mig-state.json`, read and replaced (write to a temporary
//!   file, rename) while holding an exclusive `flock` on `<root>/kerf-fake-tools/mig-state.lock`.
//! - Errors are NVML's ([`MigError::nvml_name`]): creating a GPU instance on memory slices an
//!   existing one holds is `INSUFFICIENT_RESOURCES` (not `ALREADY_EXISTS`; NVIDIA's DRA driver
//!   relies on this, kubernetes-sigs/dra-driver-nvidia-gpu `cmd/gpu-kubelet-plugin/nvlib.go`
//!   (`createMigDevice`)), an unknown instance `NOT_FOUND`, destroying a GPU instance that
//!   still has compute instances `IN_USE`.
//! - Ids: the lowest free GPU-instance id from 1 and compute-instance id from 0, reused after
//!   destruction as NVML does (so a recreated instance may get an old id, with a new UUID).
//! - UUIDs: `MIG-` + a deterministic `8-4-4-4-12` hash of (GPU, GPU instance, compute
//!   instance, creation count of the GPU), so tests can predict them and a recreated instance
//!   never repeats one.
//! - Every change re-renders `<root>/proc/driver/nvidia-caps/mig-minors`, the driver's full
//!   capability table (`config 1`, `monitor 2`, then `gpu<N>/gi<G>/access` and
//!   `gpu<N>/gi<G>/ci<C>/access` for 32 GPUs × 15 GPU instances × 8 compute instances, the
//!   layout of `kerf_core::mock::mig_cap_minors`), and `<root>/proc/devices` with an
//!   `nvidia-caps` character-device major ([`CAPS_MAJOR`]).
//! - Fault injection: the message in `<root>/kerf-fake-tools/fail-next-mig` ([`fail_next_mig`])
//!   makes the next create (GPU or compute instance) fail with it, once.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::{self, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::STATE_DIR;

/// The state file under `<root>/kerf-fake-tools`.
pub const MIG_STATE_FILE: &str = "mig-state.json";
/// The fault-injection switch under `<root>/kerf-fake-tools`.
pub const FAIL_NEXT_MIG: &str = "fail-next-mig";
/// The `nvidia-caps` major the mock's `/proc/devices` reports. On a real host the kernel
/// assigns it at module load, so it varies between hosts.
pub const CAPS_MAJOR: u32 = 237;
/// Memory slices of an emulated GPU (A100, H100).
pub const MEMORY_SLICES: u32 = 8;
/// GPUs the driver's capability table covers (`gpu0` … `gpu31`).
const CAPABLE_GPUS: u32 = 32;
/// GPU instances per GPU in the capability table.
const GIS_PER_GPU: u32 = 15;
/// Compute instances per GPU instance in the capability table.
const CIS_PER_GI: u32 = 8;

/// What went wrong, as NVML would say it.
#[derive(Debug)]
pub enum MigError {
    /// `NVML_ERROR_INSUFFICIENT_RESOURCES`: the placement overlaps an existing instance.
    InsufficientResources(String),
    /// `NVML_ERROR_NOT_FOUND`: no such GPU or compute instance.
    NotFound(String),
    /// `NVML_ERROR_IN_USE`: the GPU instance still has compute instances.
    InUse(String),
    /// `NVML_ERROR_INVALID_ARGUMENT`: a placement or GPU the driver cannot have.
    InvalidArgument(String),
    /// The failure a test asked for with [`fail_next_mig`].
    Injected(String),
    /// The state file could not be read or written.
    Io(io::Error),
}

impl MigError {
    /// NVML's name for the error, e.g. `ERROR_INSUFFICIENT_RESOURCES`.
    pub fn nvml_name(&self) -> &'static str {
        match self {
            MigError::InsufficientResources(_) => "ERROR_INSUFFICIENT_RESOURCES",
            MigError::NotFound(_) => "ERROR_NOT_FOUND",
            MigError::InUse(_) => "ERROR_IN_USE",
            MigError::InvalidArgument(_) => "ERROR_INVALID_ARGUMENT",
            MigError::Injected(_) | MigError::Io(_) => "ERROR_UNKNOWN",
        }
    }
}

impl std::fmt::Display for MigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MigError::InsufficientResources(m)
            | MigError::NotFound(m)
            | MigError::InUse(m)
            | MigError::InvalidArgument(m)
            | MigError::Injected(m) => write!(f, "{}: {m}", self.nvml_name()),
            MigError::Io(e) => write!(f, "mock MIG state: {e}"),
        }
    }
}

impl std::error::Error for MigError {}

impl From<io::Error> for MigError {
    fn from(e: io::Error) -> Self {
        MigError::Io(e)
    }
}

/// Where a GPU instance sits among the memory slices, as NVML's `nvmlGpuInstancePlacement_t`
/// (`start`, `size`) gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInstancePlacement {
    /// First memory slice.
    pub start: u32,
    /// Number of memory slices.
    pub size: u32,
}

/// A GPU instance that exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInstance {
    /// GPU instance id.
    pub gi_id: u32,
    /// GPU-instance profile id it was created with.
    pub profile_id: u32,
    /// Where it sits.
    pub placement: GpuInstancePlacement,
    /// Its compute instances.
    #[serde(default)]
    pub cis: Vec<ComputeInstance>,
}

/// A compute instance that exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ComputeInstance {
    /// Compute instance id.
    pub ci_id: u32,
    /// Compute-instance profile id it was created with.
    pub profile_id: u32,
    /// UUID of the MIG device.
    pub uuid: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct GpuState {
    /// Instances created on this GPU so far: part of every UUID.
    #[serde(default)]
    creations: u64,
    #[serde(default)]
    gis: Vec<GpuInstance>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct State {
    /// By GPU minor (as a string: JSON object keys).
    #[serde(default)]
    gpus: BTreeMap<String, GpuState>,
}

/// Makes the next create under `root` fail with `message`.
///
/// # Errors
/// The switch file cannot be written.
pub fn fail_next_mig(root: &Path, message: &str) -> io::Result<()> {
    fs::create_dir_all(root.join(STATE_DIR))?;
    fs::write(root.join(STATE_DIR).join(FAIL_NEXT_MIG), message)
}

/// The emulated MIG state of a mock driver root.
#[derive(Debug, Clone)]
pub struct MockMig {
    root: PathBuf,
}

impl MockMig {
    /// Opens (creating if need be) the MIG state of the mock driver root `root`, and renders
    /// its `/proc` files.
    ///
    /// # Errors
    /// The state directory or files cannot be created.
    pub fn open(root: &Path) -> Result<Self, MigError> {
        fs::create_dir_all(root.join(STATE_DIR))?;
        let mig = MockMig {
            root: root.to_path_buf(),
        };
        mig.update(|_| Ok(()))?;
        Ok(mig)
    }

    /// Creates a GPU instance of `profile_id` at `placement` on GPU `minor`; returns its id.
    ///
    /// # Errors
    /// [`MigError::InsufficientResources`] when the placement overlaps an instance,
    /// [`MigError::InvalidArgument`] for a placement outside the memory slices or a GPU minor
    /// outside the driver's capability table, [`MigError::Injected`], [`MigError::Io`].
    pub fn create_gi(
        &self,
        minor: u32,
        profile_id: u32,
        placement: GpuInstancePlacement,
    ) -> Result<u32, MigError> {
        if minor >= CAPABLE_GPUS {
            return Err(MigError::InvalidArgument(format!(
                "GPU {minor} has no MIG capability minors"
            )));
        }
        if placement.size == 0 || placement.start + placement.size > MEMORY_SLICES {
            return Err(MigError::InvalidArgument(format!(
                "placement {}:{} is outside the {MEMORY_SLICES} memory slices",
                placement.start, placement.size
            )));
        }
        self.take_injected_failure()?;
        self.update(|state| {
            let gpu = state.gpus.entry(minor.to_string()).or_default();
            if let Some(other) = gpu.gis.iter().find(|gi| overlaps(gi.placement, placement)) {
                return Err(MigError::InsufficientResources(format!(
                    "placement {}:{} overlaps GPU instance {} at {}:{} on GPU {minor}",
                    placement.start,
                    placement.size,
                    other.gi_id,
                    other.placement.start,
                    other.placement.size
                )));
            }
            let gi_id = lowest_free(gpu.gis.iter().map(|gi| gi.gi_id), 1, GIS_PER_GPU).ok_or_else(
                || MigError::InsufficientResources(format!("GPU {minor} has no free GI id")),
            )?;
            gpu.gis.push(GpuInstance {
                gi_id,
                profile_id,
                placement,
                cis: Vec::new(),
            });
            gpu.gis.sort_by_key(|gi| gi.gi_id);
            Ok(gi_id)
        })
    }

    /// Creates a compute instance of `ci_profile_id` in GPU instance `gi_id` of GPU `minor`;
    /// returns its id and the MIG device's UUID.
    ///
    /// # Errors
    /// [`MigError::NotFound`] for an unknown GPU instance, [`MigError::InsufficientResources`]
    /// when it has no free compute-instance id, [`MigError::Injected`], [`MigError::Io`].
    pub fn create_ci(
        &self,
        minor: u32,
        gi_id: u32,
        ci_profile_id: u32,
    ) -> Result<(u32, String), MigError> {
        self.take_injected_failure()?;
        self.update(|state| {
            let gpu = state
                .gpus
                .get_mut(&minor.to_string())
                .ok_or_else(|| not_found_gi(minor, gi_id))?;
            gpu.creations += 1;
            let creation = gpu.creations;
            let gi = gpu
                .gis
                .iter_mut()
                .find(|gi| gi.gi_id == gi_id)
                .ok_or_else(|| not_found_gi(minor, gi_id))?;
            let ci_id =
                lowest_free(gi.cis.iter().map(|ci| ci.ci_id), 0, CIS_PER_GI).ok_or_else(|| {
                    MigError::InsufficientResources(format!(
                        "GPU instance {gi_id} of GPU {minor} has no free CI id"
                    ))
                })?;
            let uuid = mig_uuid(minor, gi_id, ci_id, creation);
            gi.cis.push(ComputeInstance {
                ci_id,
                profile_id: ci_profile_id,
                uuid: uuid.clone(),
            });
            gi.cis.sort_by_key(|ci| ci.ci_id);
            Ok((ci_id, uuid))
        })
    }

    /// Destroys compute instance `ci_id` of GPU instance `gi_id` on GPU `minor`.
    ///
    /// # Errors
    /// [`MigError::NotFound`] when either does not exist, [`MigError::Io`].
    pub fn destroy_ci(&self, minor: u32, gi_id: u32, ci_id: u32) -> Result<(), MigError> {
        self.update(|state| {
            let gi = find_gi(state, minor, gi_id)?;
            let before = gi.cis.len();
            gi.cis.retain(|ci| ci.ci_id != ci_id);
            if gi.cis.len() == before {
                return Err(MigError::NotFound(format!(
                    "no compute instance {ci_id} in GPU instance {gi_id} of GPU {minor}"
                )));
            }
            Ok(())
        })
    }

    /// Destroys GPU instance `gi_id` of GPU `minor`.
    ///
    /// # Errors
    /// [`MigError::NotFound`] when it does not exist, [`MigError::InUse`] while it has compute
    /// instances, [`MigError::Io`].
    pub fn destroy_gi(&self, minor: u32, gi_id: u32) -> Result<(), MigError> {
        self.update(|state| {
            let gi = find_gi(state, minor, gi_id)?;
            if !gi.cis.is_empty() {
                return Err(MigError::InUse(format!(
                    "GPU instance {gi_id} of GPU {minor} still has {} compute instance(s)",
                    gi.cis.len()
                )));
            }
            if let Some(gpu) = state.gpus.get_mut(&minor.to_string()) {
                gpu.gis.retain(|gi| gi.gi_id != gi_id);
            }
            Ok(())
        })
    }

    /// The GPU instances of GPU `minor`, by id.
    ///
    /// # Errors
    /// [`MigError::Io`] when the state cannot be read.
    pub fn list(&self, minor: u32) -> Result<Vec<GpuInstance>, MigError> {
        self.update(|state| {
            Ok(state
                .gpus
                .get(&minor.to_string())
                .map(|gpu| gpu.gis.clone())
                .unwrap_or_default())
        })
    }

    /// The GPU minors that have GPU instances.
    ///
    /// # Errors
    /// [`MigError::Io`] when the state cannot be read.
    pub fn gpus(&self) -> Result<Vec<u32>, MigError> {
        self.update(|state| {
            Ok(state
                .gpus
                .iter()
                .filter(|(_, gpu)| !gpu.gis.is_empty())
                .filter_map(|(minor, _)| minor.parse().ok())
                .collect())
        })
    }

    fn dir(&self) -> PathBuf {
        self.root.join(STATE_DIR)
    }

    fn take_injected_failure(&self) -> Result<(), MigError> {
        let switch = self.dir().join(FAIL_NEXT_MIG);
        match fs::read_to_string(&switch) {
            Ok(message) => {
                let _ = fs::remove_file(&switch);
                Err(MigError::Injected(message.trim().to_owned()))
            }
            Err(_) => Ok(()),
        }
    }

    /// Runs `change` on the state under the lock; writes the state and the `/proc` files back
    /// when it succeeds.
    fn update<T>(
        &self,
        change: impl FnOnce(&mut State) -> Result<T, MigError>,
    ) -> Result<T, MigError> {
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir().join("mig-state.lock"))?;
        lock.lock()?;
        let path = self.dir().join(MIG_STATE_FILE);
        let mut state: State = match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => State::default(),
            Err(e) => return Err(e.into()),
        };
        let out = change(&mut state)?;
        let bytes = serde_json::to_vec_pretty(&state)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        replace(&path, &bytes)?;
        self.render_proc()?;
        drop(lock);
        Ok(out)
    }

    fn render_proc(&self) -> io::Result<()> {
        let caps = self.root.join("proc/driver/nvidia-caps");
        fs::create_dir_all(&caps)?;
        if !caps.join("mig-minors").exists() {
            replace(&caps.join("mig-minors"), mig_minors_table().as_bytes())?;
        }
        let devices = format!(
            "Character devices:\n  1 mem\n  4 /dev/vc/0\n195 nvidia-frontend\n{CAPS_MAJOR} nvidia-caps\n\
             {} nvidia-uvm\n\nBlock devices:\n  7 loop\n  8 sd\n",
            CAPS_MAJOR + 1
        );
        replace(&self.root.join("proc/devices"), devices.as_bytes())
    }
}

fn find_gi(state: &mut State, minor: u32, gi_id: u32) -> Result<&mut GpuInstance, MigError> {
    state
        .gpus
        .get_mut(&minor.to_string())
        .and_then(|gpu| gpu.gis.iter_mut().find(|gi| gi.gi_id == gi_id))
        .ok_or_else(|| not_found_gi(minor, gi_id))
}

fn not_found_gi(minor: u32, gi_id: u32) -> MigError {
    MigError::NotFound(format!("no GPU instance {gi_id} on GPU {minor}"))
}

fn overlaps(a: GpuInstancePlacement, b: GpuInstancePlacement) -> bool {
    a.start < b.start + b.size && b.start < a.start + a.size
}

fn lowest_free(used: impl Iterator<Item = u32>, from: u32, below: u32) -> Option<u32> {
    let used: Vec<u32> = used.collect();
    (from..below).find(|id| !used.contains(id))
}

/// Writes `bytes` to a sibling temporary file and renames it over `path`.
fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    fs::write(&tmp, bytes)?;
    fs::rename(&tmp, path)
}

/// The driver's `mig-minors` table: `config 1`, `monitor 2`, then for each GPU 15 GPU
/// instances of 9 entries (the instance's `access`, then `ci0` … `ci7`).
pub fn mig_minors_table() -> String {
    let mut out = String::from("config 1\nmonitor 2\n");
    let mut minor = 3;
    for gpu in 0..CAPABLE_GPUS {
        for gi in 0..GIS_PER_GPU {
            let _ = writeln!(out, "gpu{gpu}/gi{gi}/access {minor}");
            minor += 1;
            for ci in 0..CIS_PER_GI {
                let _ = writeln!(out, "gpu{gpu}/gi{gi}/ci{ci}/access {minor}");
                minor += 1;
            }
        }
    }
    out
}

fn mig_uuid(minor: u32, gi: u32, ci: u32, creation: u64) -> String {
    fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
        bytes.iter().fold(seed, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }
    let key = format!("kerf-fake-mig/gpu/{minor}/gi/{gi}/ci/{ci}/creation/{creation}");
    let high = fnv1a(0xcbf2_9ce4_8422_2325, key.as_bytes());
    let low = fnv1a(high ^ 0x9e37_79b9_7f4a_7c15, key.as_bytes());
    let hex = format!("{high:016x}{low:016x}");
    format!(
        "MIG-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}
