//! The kubelet plugin's durable record of prepared claims.
//!
//! The format is versioned JSON and decoded tolerantly, because a checkpoint outlives the
//! binary that wrote it (upgrades and downgrades of the plugin): unknown fields are ignored,
//! missing fields take their defaults, a newer `version` is decoded as far as it goes, and a
//! claim entry that does not decode is kept verbatim (and written back unchanged) instead of
//! failing the whole file. Only a file that is not a JSON object with an object of claims is
//! corrupt: [`load`] moves it aside for inspection and the plugin starts empty, which is
//! recoverable (the kubelet prepares again), where a crash loop is not.
//!
//! No checksum: NVIDIA's driver broke on upgrades with a checksum over re-marshalled JSON.
//! The write ([`save`]) replaces the file atomically but does not fsync it: within one boot
//! every reader sees a whole file (the page cache outlives a crashed plugin), and only a
//! power loss or kernel crash can leave it old, empty or torn — after which the node boots
//! again and the file belongs to an older boot, whose claims are no longer prepared (see
//! [`Checkpoint::boot_id`]). So a file that does not decode is read as "nothing prepared",
//! never as an error that stops the plugin.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Deserializer, Serialize};

use crate::cdi::{MigCaps, PreparedDevice};
use crate::enforcement::ServerLimits;
use crate::error::{Error, Result};
use crate::fsutil;
use crate::mps::TimeSliceInterval;
use crate::sharing::{Sharing, SliceLimits};

/// The format version this build writes.
pub const CURRENT_VERSION: u32 = 1;

/// All claims prepared on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// Format version: [`CURRENT_VERSION`] when created or saved by this build; after
    /// [`decode`], the version of the file (see [`Checkpoint::is_newer_format`]).
    pub version: u32,
    /// Boot ID of the node (`/proc/sys/kernel/random/boot_id`) when last written. A
    /// different one means the node booted since: its claims are no longer prepared (see
    /// [`Checkpoint::forget_older_boot`]).
    pub boot_id: String,
    /// Prepared claims by claim UID.
    pub claims: BTreeMap<String, ClaimEntry>,
    /// Claim entries that did not decode (e.g. written by a newer plugin with a sharing mode
    /// this build does not know), by claim UID, kept verbatim with the reason, and written
    /// back unchanged. The UID alone is enough to unprepare them (remove the CDI spec).
    pub undecodable: BTreeMap<String, Undecodable>,
    /// What the plugin set up on shared GPUs (MPS daemons, time slices), by GPU UUID, so that
    /// a restarted plugin finds and undoes it even when no claim needs it any more.
    pub gpu_sharing: BTreeMap<String, GpuSharingEntry>,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Checkpoint {
            version: CURRENT_VERSION,
            boot_id: String::new(),
            claims: BTreeMap::new(),
            undecodable: BTreeMap::new(),
            gpu_sharing: BTreeMap::new(),
        }
    }
}

/// What the plugin set up on one shared GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GpuSharingEntry {
    /// The MPS root under which the GPU's control daemon was started, while one may run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mps_root: Option<PathBuf>,
    /// Which daemon served the GPU when the plugin last looked (opaque: a PID, or a daemon
    /// pod's UID and restart count): a different one found later was restarted meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_daemon: Option<String>,
    /// The time slice set on the GPU, while one is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_slice: Option<TimeSliceInterval>,
    /// The server limits the daemon named by `mps_daemon` was given; a daemon forgets them
    /// when it quits, so they go with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_server_limits: Option<ServerLimits>,
}

impl GpuSharingEntry {
    /// True when nothing is set up on the GPU any more.
    pub fn is_empty(&self) -> bool {
        self.mps_root.is_none()
            && self.mps_daemon.is_none()
            && self.time_slice.is_none()
            && self.mps_server_limits.is_none()
    }
}

/// A claim entry kept as raw JSON because it did not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Undecodable {
    /// The entry as found in the file.
    pub raw: serde_json::Value,
    /// Why it did not decode.
    pub reason: String,
}

/// One prepared (or being prepared) claim.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ClaimEntry {
    /// Namespace of the ResourceClaim.
    pub namespace: String,
    /// Name of the ResourceClaim.
    pub name: String,
    /// For a claim made from a ResourceClaimTemplate, the name the pod gives it
    /// (`pod.spec.resourceClaims[].name`, from the claim's `resource.kubernetes.io/pod-claim-name`
    /// annotation): the name its device metadata paths and claim-named variables use, since
    /// the generated claim name cannot be known in advance. `None` for a claim created directly
    /// and in entries written before this field existed (those keep the claim name).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_claim_name: Option<String>,
    /// How far preparation got.
    pub state: ClaimState,
    /// The claim's devices on this node.
    pub devices: Vec<DeviceRecord>,
}

/// How far the preparation of a claim got.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
pub enum ClaimState {
    /// Recorded before side effects (CDI spec, sharing setup); they may be partly done.
    /// Also what an unknown state decodes to: the conservative reading, since both prepare
    /// and unprepare redo or undo everything from this state.
    #[default]
    PrepareStarted,
    /// Every side effect is done; a repeated prepare returns the recorded devices.
    PrepareCompleted,
}

impl<'de> Deserialize<'de> for ClaimState {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        Ok(if s == "PrepareCompleted" {
            ClaimState::PrepareCompleted
        } else {
            ClaimState::PrepareStarted
        })
    }
}

/// One prepared device of a claim: everything unprepare needs without an API call, and
/// everything a repeated prepare needs to answer the same and rewrite the same CDI spec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct DeviceRecord {
    /// Requests of the claim this device serves: top-level names, as the kubelet matches
    /// containers to devices.
    pub request_names: Vec<String>,
    /// The allocation results' full request names, `parent/sub` for a `firstAvailable`
    /// subrequest (the device metadata files name them). Empty in entries written before this
    /// field existed: the top-level names stand in for them.
    pub request_refs: Vec<String>,
    /// Pool of the device (the node name).
    pub pool_name: String,
    /// Published device name within the pool, e.g. `gpu-3`.
    pub device_name: String,
    /// Fully qualified CDI device IDs returned to the kubelet.
    pub cdi_device_ids: Vec<String>,
    /// Share ID of a consumable-capacity allocation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// Whether the device was allocated with admin access (never exclusive).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub admin_access: bool,
    /// GPU or MIG UUID.
    pub uuid: String,
    /// Minor of the (parent) GPU's `/dev/nvidia<minor>`.
    pub gpu_minor: u32,
    /// Capability minors of a MIG device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigCaps>,
    /// The MIG instance kerf created for this device on a dynamic-MIG GPU (intent first).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig_instance: Option<MigInstanceRecord>,
    /// The slice the claim was given.
    pub limits: SliceLimits,
    /// How the device is shared.
    pub sharing: Sharing,
    /// The time slice a time-sliced device's GPU gets.
    #[serde(skip_serializing_if = "is_default_interval")]
    pub time_slice_interval: TimeSliceInterval,
}

/// A MIG instance kerf creates for a claim on a dynamic-MIG GPU: written as an intent (ids
/// `None`) before the GPU instance is created, completed with the ids and UUID once it exists,
/// so that a restarted plugin can tell its own instances from others' and finish or undo a
/// preparation a crash interrupted (see [`crate::mig_reconcile`]).
///
/// Decoded tolerantly like the rest of the checkpoint: unknown fields are ignored and missing
/// ones take their defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MigInstanceRecord {
    /// UUID of the parent GPU.
    pub parent_uuid: String,
    /// Minor of the parent GPU.
    pub parent_minor: u32,
    /// Profile name, e.g. `1g.5gb`.
    pub profile: String,
    /// GPU-instance profile id the instance is created with (e.g. 19 for `1g.5gb`).
    pub gi_profile_id: u32,
    /// Compute-instance profile id the compute instance is created with.
    pub ci_profile_id: u32,
    /// Where the GPU instance sits.
    pub placement: RecordedPlacement,
    /// GPU instance id, once created.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gi_id: Option<u32>,
    /// Compute instance id, once created.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ci_id: Option<u32>,
    /// UUID of the MIG device (`MIG-…`), once created.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig_uuid: Option<String>,
}

/// [`crate::inventory::MigPlacement`] as the checkpoint stores it: tolerant (missing fields
/// are 0, unknown ones ignored), where the inventory's is strict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default)]
pub struct RecordedPlacement {
    /// First memory slice.
    pub start: u32,
    /// Number of memory slices.
    pub size: u32,
}

impl From<crate::inventory::MigPlacement> for RecordedPlacement {
    fn from(p: crate::inventory::MigPlacement) -> Self {
        RecordedPlacement {
            start: p.start,
            size: p.size,
        }
    }
}

impl From<RecordedPlacement> for crate::inventory::MigPlacement {
    fn from(p: RecordedPlacement) -> Self {
        crate::inventory::MigPlacement {
            start: p.start,
            size: p.size,
        }
    }
}

#[allow(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if passes a reference"
)]
fn is_default_interval(interval: &TimeSliceInterval) -> bool {
    *interval == TimeSliceInterval::Default
}

impl DeviceRecord {
    /// The input of the CDI spec generator for this device, without an MPS daemon (the
    /// plugin adds the one that serves it).
    pub fn prepared_device(&self) -> PreparedDevice {
        PreparedDevice {
            name: self.device_name.clone(),
            uuid: self.uuid.clone(),
            gpu_minor: self.gpu_minor,
            mig: self.mig,
            limits: self.limits,
            sharing: self.sharing,
            mps: None,
        }
    }
}

impl Checkpoint {
    /// True when this checkpoint was written in another boot than `boot_id`; unknown when
    /// either ID is empty (an unreadable boot ID file), which reads as the same boot.
    pub fn is_from_older_boot(&self, boot_id: &str) -> bool {
        !self.boot_id.is_empty() && !boot_id.is_empty() && self.boot_id != boot_id
    }

    /// Forgets the claims of an older boot and returns how many there were. Nothing a
    /// prepare did outlives a reboot: `/var/run/cdi` is a tmpfs, MPS daemons are processes,
    /// and MIG GPU and compute instances are not persistent across a reboot (NVIDIA's MIG
    /// user guide); the kubelet prepares every claim of its pods again, because it keeps
    /// whether a claim is prepared in memory only (kubernetes/kubernetes
    /// `pkg/kubelet/cm/dra/claiminfo.go`, `newClaimInfoFromState`: `prepared: false`). The
    /// GPU set-up records stay, so that start-up still undoes what the plugin had set on a
    /// GPU and no claim needs any more.
    pub fn forget_older_boot(&mut self) -> usize {
        let dropped = self.claims.len() + self.undecodable.len();
        self.claims.clear();
        self.undecodable.clear();
        dropped
    }

    /// Forgets a claim, decoded or not. Returns whether it was there.
    pub fn remove_claim(&mut self, claim_uid: &str) -> bool {
        let decoded = self.claims.remove(claim_uid).is_some();
        let raw = self.undecodable.remove(claim_uid).is_some();
        decoded || raw
    }

    /// True when the file was written by a newer format than this build's: what decoded is
    /// usable, but fields this build does not know were dropped.
    pub fn is_newer_format(&self) -> bool {
        self.version > CURRENT_VERSION
    }

    /// Things the caller should log after loading: a newer format, undecodable entries.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.is_newer_format() {
            out.push(format!(
                "checkpoint format version {} is newer than this build's {CURRENT_VERSION}; fields it does not know are ignored",
                self.version
            ));
        }
        for (uid, entry) in &self.undecodable {
            out.push(format!(
                "claim {uid}: checkpoint entry kept but not decoded: {}",
                entry.reason
            ));
        }
        out
    }
}

/// The top level of the file, decoded loosely: claims stay raw so that one bad entry cannot
/// spoil the rest.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawCheckpoint {
    #[serde(default)]
    version: u32,
    #[serde(default)]
    boot_id: String,
    #[serde(default)]
    claims: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    gpu_sharing: serde_json::Value,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct EncodedCheckpoint<'a> {
    version: u32,
    boot_id: &'a str,
    claims: BTreeMap<&'a str, EncodedClaim<'a>>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    gpu_sharing: &'a BTreeMap<String, GpuSharingEntry>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum EncodedClaim<'a> {
    Decoded(&'a ClaimEntry),
    Raw(&'a serde_json::Value),
}

/// Encodes a checkpoint as JSON, with `version` = [`CURRENT_VERSION`].
///
/// # Errors
///
/// [`Error::Json`] if serialisation fails (it does not for well-formed checkpoints).
pub fn encode(cp: &Checkpoint) -> Result<Vec<u8>> {
    let claims = cp
        .undecodable
        .iter()
        .map(|(uid, u)| (uid.as_str(), EncodedClaim::Raw(&u.raw)))
        .chain(
            cp.claims
                .iter()
                .map(|(uid, entry)| (uid.as_str(), EncodedClaim::Decoded(entry))),
        )
        .collect();
    let encoded = EncodedCheckpoint {
        version: CURRENT_VERSION,
        boot_id: &cp.boot_id,
        claims,
        gpu_sharing: &cp.gpu_sharing,
    };
    serde_json::to_vec(&encoded).map_err(|source| Error::Json {
        what: "encode checkpoint",
        source,
    })
}

/// Decodes a checkpoint tolerantly (see the module docs).
///
/// # Errors
///
/// [`Error::Json`] when the bytes are not JSON, or not an object whose `claims` (if present)
/// is an object: the only case in which nothing can be recovered.
pub fn decode(bytes: &[u8]) -> Result<Checkpoint> {
    let json_error = |source| Error::Json {
        what: "decode checkpoint",
        source,
    };
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(json_error)?;
    // Serde would also read a struct from a JSON array; a checkpoint is always an object.
    if !value.is_object() {
        return Err(json_error(serde::de::Error::custom(
            "the checkpoint is not a JSON object",
        )));
    }
    let raw = RawCheckpoint::deserialize(value).map_err(json_error)?;
    let mut cp = Checkpoint {
        version: raw.version,
        boot_id: raw.boot_id,
        // Lost set-up records cost little: start-up also finds daemons under the MPS root.
        gpu_sharing: BTreeMap::deserialize(&raw.gpu_sharing).unwrap_or_default(),
        ..Checkpoint::default()
    };
    for (uid, value) in raw.claims {
        match ClaimEntry::deserialize(&value) {
            Ok(entry) => {
                cp.claims.insert(uid, entry);
            }
            Err(e) => {
                cp.undecodable.insert(
                    uid,
                    Undecodable {
                        raw: value,
                        reason: e.to_string(),
                    },
                );
            }
        }
    }
    Ok(cp)
}

/// What [`load`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadOutcome {
    /// No checkpoint file: a fresh node or a first start.
    Missing,
    /// The checkpoint, possibly with [`Checkpoint::warnings`] to log.
    Loaded(Checkpoint),
    /// The file could not be decoded at all and was renamed to `moved_to`; start empty and
    /// log loudly.
    Corrupt {
        /// Where the corrupt file now is (`<name>.corrupt-<unix seconds>`).
        moved_to: PathBuf,
        /// Why it could not be decoded.
        reason: String,
    },
}

/// Reads the checkpoint at `path`.
///
/// # Errors
///
/// [`Error::Io`] when the file exists but cannot be read (e.g. permissions, I/O error), or a
/// corrupt file cannot be moved aside: the caller decides, since starting empty over a
/// checkpoint that may be fine would forget prepared claims.
pub fn load(path: &Path) -> Result<LoadOutcome> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(LoadOutcome::Missing),
        Err(e) => return Err(Error::io("read", path, e)),
    };
    let reason = match decode(&bytes) {
        Ok(cp) => return Ok(LoadOutcome::Loaded(cp)),
        Err(e) if bytes.is_empty() => format!("empty file ({e})"),
        Err(e) => e.to_string(),
    };
    let moved_to = move_aside(path)?;
    Ok(LoadOutcome::Corrupt { moved_to, reason })
}

/// Replaces the checkpoint at `path` atomically, without an fsync: a reader (this plugin
/// restarted, the other instance of a rolling update) sees the old or the new file, never a
/// torn one, until the node loses power; a file written in an older boot records nothing
/// prepared in this one (see the module docs).
///
/// # Errors
///
/// [`Error::Checkpoint`] when `path` has no file name, [`Error::Json`] or [`Error::Io`] when
/// encoding or writing fails (the previous file is intact then).
pub fn save(path: &Path, cp: &Checkpoint) -> Result<()> {
    let (dir, file_name) = split_path(path)?;
    let bytes = encode(cp)?;
    fsutil::write_replace(dir, file_name, &bytes)
}

fn split_path(path: &Path) -> Result<(&Path, &str)> {
    let file_name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::Checkpoint {
            path: path.to_owned(),
            reason: "the path has no UTF-8 file name".to_owned(),
        })?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    Ok((dir, file_name))
}

/// Renames a corrupt checkpoint to `<name>.corrupt-<unix seconds>[-<n>]`, never over an
/// earlier one, and makes the rename durable.
fn move_aside(path: &Path) -> Result<PathBuf> {
    let (dir, file_name) = split_path(path)?;
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let base = format!("{file_name}.corrupt-{seconds}");
    let mut target = dir.join(&base);
    let mut n = 1;
    while target.exists() {
        target = dir.join(format!("{base}-{n}"));
        n += 1;
    }
    fs::rename(path, &target).map_err(|e| Error::io("rename", path, e))?;
    fsutil::fsync_dir(dir)?;
    Ok(target)
}
