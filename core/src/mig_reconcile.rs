//! What a starting kubelet plugin does with the MIG instances it finds on dynamic-MIG GPUs:
//! a pure function from the checkpoint's instance records and the live GPU/compute instances
//! to a list of actions.
//!
//! The rules follow NVIDIA's DRA driver, which at start-up keeps only the MIG devices named by
//! claims whose preparation completed and destroys every other one
//! (kubernetes-sigs/dra-driver-nvidia-gpu `cmd/gpu-kubelet-plugin/device_state.go`
//! (`DestroyUnknownMIGDevices`, `obliterateStaleMIGDevices`)):
//! - a GPU instance that a `PrepareCompleted` record names (same parent GPU, placement, GPU
//!   instance id and profile) is kept, with the compute instance the record names; other
//!   compute instances in it are destroyed;
//! - every other GPU instance on a dynamic GPU is destroyed, compute instances first (NVML
//!   refuses to destroy a GPU instance that still has compute instances): those a
//!   `PrepareStarted` intent names (a crash between creating and completing; the retried
//!   prepare creates it again) and those no record names (orphans);
//! - a `PrepareCompleted` record whose instance is gone, and a `PrepareStarted` intent whose
//!   instance is destroyed, are reported ([`MigAction::ForgetInstance`]) so that the plugin
//!   clears the ids and the next prepare creates the instance again;
//! - GPUs that are not dynamic (static MIG layouts, admin opt-out) are never touched, and
//!   records on them are left alone.

use std::collections::{BTreeMap, BTreeSet};

use crate::checkpoint::{ClaimState, MigInstanceRecord};
use crate::inventory::MigPlacement;

/// One recorded MIG instance of a claim, as the checkpoint holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedInstance {
    /// UID of the claim the instance was created for.
    pub claim_uid: String,
    /// How far the claim's preparation got.
    pub state: ClaimState,
    /// The instance.
    pub instance: MigInstanceRecord,
}

/// The MIG instances that exist now, per GPU minor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LiveMigState {
    /// By GPU minor.
    pub gpus: BTreeMap<u32, LiveGpu>,
}

/// The MIG instances of one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LiveGpu {
    /// Whether kerf manages the GPU's instances (dynamic MIG). Instances of other GPUs are
    /// never touched.
    pub dynamic: bool,
    /// Its GPU instances.
    pub gpu_instances: Vec<LiveGpuInstance>,
}

/// A GPU instance that exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveGpuInstance {
    /// GPU instance id.
    pub gi_id: u32,
    /// Its GPU-instance profile id.
    pub gi_profile_id: u32,
    /// Where it sits.
    pub placement: MigPlacement,
    /// Its compute instances.
    pub compute_instances: Vec<LiveComputeInstance>,
}

/// A compute instance that exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveComputeInstance {
    /// Compute instance id.
    pub ci_id: u32,
    /// UUID of the MIG device it makes (`MIG-…`).
    pub uuid: String,
}

/// Why an instance is destroyed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DestroyReason {
    /// Only a `PrepareStarted` intent of this claim names it.
    Unfinished {
        /// The claim whose preparation was interrupted.
        claim_uid: String,
    },
    /// No record names it.
    Unrecorded,
}

impl DestroyReason {
    /// A short, stable label for logs and metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            DestroyReason::Unfinished { .. } => "unfinished",
            DestroyReason::Unrecorded => "unrecorded",
        }
    }
}

/// Why a record's instance ids are to be cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForgetReason {
    /// The completed record's instance no longer exists (or is not the recorded one).
    Vanished,
    /// The intent's instance is destroyed by this reconciliation (or never existed).
    Unfinished,
}

/// One step of the reconciliation, in the order the plugin should take them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigAction {
    /// The instance stays: a completed claim uses it.
    Keep {
        /// The claim using it.
        claim_uid: String,
        /// Parent GPU minor.
        parent_minor: u32,
        /// GPU instance id.
        gi_id: u32,
    },
    /// Destroy a compute instance (always before its GPU instance).
    DestroyComputeInstance {
        /// Parent GPU minor.
        parent_minor: u32,
        /// GPU instance id.
        gi_id: u32,
        /// Compute instance id.
        ci_id: u32,
        /// Why.
        reason: DestroyReason,
    },
    /// Destroy a GPU instance (after its compute instances).
    DestroyGpuInstance {
        /// Parent GPU minor.
        parent_minor: u32,
        /// GPU instance id.
        gi_id: u32,
        /// Why.
        reason: DestroyReason,
    },
    /// Clear the instance ids of a claim's record: the instance is gone.
    ForgetInstance {
        /// The claim.
        claim_uid: String,
        /// Parent GPU minor of the record.
        parent_minor: u32,
        /// Placement of the record.
        placement: MigPlacement,
        /// Why.
        reason: ForgetReason,
    },
}

/// The MIG instance records of every decoded claim of `checkpoint`, for [`reconcile`].
pub fn recorded_instances(checkpoint: &crate::checkpoint::Checkpoint) -> Vec<RecordedInstance> {
    checkpoint
        .claims
        .iter()
        .flat_map(|(uid, entry)| {
            entry.devices.iter().filter_map(move |d| {
                d.mig_instance.clone().map(|instance| RecordedInstance {
                    claim_uid: uid.clone(),
                    state: entry.state,
                    instance,
                })
            })
        })
        .collect()
}

/// The actions that bring the live MIG state of dynamic GPUs in line with the records (see
/// the module docs): `Keep` actions first, then per GPU instance its compute instances'
/// destruction and its own, then the records to forget. Deterministic for equal inputs.
pub fn reconcile(records: &[RecordedInstance], live: &LiveMigState) -> Vec<MigAction> {
    let dynamic = |minor: u32| live.gpus.get(&minor).is_some_and(|g| g.dynamic);
    let mut keep = Vec::new();
    // (parent minor, gi id) → the compute instance the completed record keeps.
    let mut kept: BTreeMap<(u32, u32), Option<u32>> = BTreeMap::new();
    let mut forget = Vec::new();
    for record in records
        .iter()
        .filter(|r| r.state == ClaimState::PrepareCompleted)
    {
        let instance = &record.instance;
        if !dynamic(instance.parent_minor) {
            continue;
        }
        match find_recorded(instance, live) {
            Some((gi, ci)) => {
                kept.entry((instance.parent_minor, gi.gi_id))
                    .or_insert(Some(ci));
                keep.push(MigAction::Keep {
                    claim_uid: record.claim_uid.clone(),
                    parent_minor: instance.parent_minor,
                    gi_id: gi.gi_id,
                });
            }
            None => forget.push(forget_action(record, ForgetReason::Vanished)),
        }
    }
    let intents = intents_by_instance(records, live, &kept);
    for record in records
        .iter()
        .filter(|r| r.state == ClaimState::PrepareStarted)
    {
        if dynamic(record.instance.parent_minor)
            && has_ids_or_instance(&record.instance, live, &kept)
        {
            forget.push(forget_action(record, ForgetReason::Unfinished));
        }
    }
    let mut actions = keep;
    for (&minor, gpu) in live.gpus.iter().filter(|(_, g)| g.dynamic) {
        let mut instances: Vec<&LiveGpuInstance> = gpu.gpu_instances.iter().collect();
        instances.sort_by_key(|gi| gi.gi_id);
        for gi in instances {
            destroy_unkept(minor, gi, &kept, &intents, &mut actions);
        }
    }
    actions.extend(forget);
    actions
}

/// The live GPU instance and compute instance id a completed record names, when they exist
/// as recorded.
fn find_recorded<'a>(
    instance: &MigInstanceRecord,
    live: &'a LiveMigState,
) -> Option<(&'a LiveGpuInstance, u32)> {
    let gi_id = instance.gi_id?;
    let ci_id = instance.ci_id?;
    let gi = live
        .gpus
        .get(&instance.parent_minor)?
        .gpu_instances
        .iter()
        .find(|gi| {
            gi.gi_id == gi_id
                && MigPlacement::from(instance.placement) == gi.placement
                && gi.gi_profile_id == instance.gi_profile_id
        })?;
    let ci = gi.compute_instances.iter().find(|ci| {
        ci.ci_id == ci_id
            && instance
                .mig_uuid
                .as_deref()
                .is_none_or(|uuid| uuid == ci.uuid)
    })?;
    Some((gi, ci.ci_id))
}

/// The claim of the `PrepareStarted` intent naming each live GPU instance that no completed
/// record keeps, by (parent minor, gi id): the intent's gi id when it has one, else its
/// placement (a crash after creating the instance but before recording its id).
fn intents_by_instance<'a>(
    records: &'a [RecordedInstance],
    live: &LiveMigState,
    kept: &BTreeMap<(u32, u32), Option<u32>>,
) -> BTreeMap<(u32, u32), &'a str> {
    let mut out = BTreeMap::new();
    for record in records
        .iter()
        .filter(|r| r.state == ClaimState::PrepareStarted)
    {
        let instance = &record.instance;
        let Some(gpu) = live.gpus.get(&instance.parent_minor) else {
            continue;
        };
        let placement = MigPlacement::from(instance.placement);
        for gi in &gpu.gpu_instances {
            let named = match instance.gi_id {
                Some(id) => id == gi.gi_id,
                None => gi.placement == placement,
            };
            if named && !kept.contains_key(&(instance.parent_minor, gi.gi_id)) {
                out.entry((instance.parent_minor, gi.gi_id))
                    .or_insert(record.claim_uid.as_str());
            }
        }
    }
    out
}

/// Whether an intent has anything to forget: ids recorded, or a live instance at its
/// placement that this reconciliation destroys.
fn has_ids_or_instance(
    instance: &MigInstanceRecord,
    live: &LiveMigState,
    kept: &BTreeMap<(u32, u32), Option<u32>>,
) -> bool {
    if instance.gi_id.is_some() || instance.ci_id.is_some() || instance.mig_uuid.is_some() {
        return true;
    }
    let placement = MigPlacement::from(instance.placement);
    live.gpus.get(&instance.parent_minor).is_some_and(|gpu| {
        gpu.gpu_instances.iter().any(|gi| {
            gi.placement == placement && !kept.contains_key(&(instance.parent_minor, gi.gi_id))
        })
    })
}

fn destroy_unkept(
    minor: u32,
    gi: &LiveGpuInstance,
    kept: &BTreeMap<(u32, u32), Option<u32>>,
    intents: &BTreeMap<(u32, u32), &str>,
    actions: &mut Vec<MigAction>,
) {
    let key = (minor, gi.gi_id);
    let reason = || match intents.get(&key) {
        Some(claim_uid) => DestroyReason::Unfinished {
            claim_uid: (*claim_uid).to_owned(),
        },
        None => DestroyReason::Unrecorded,
    };
    let kept_ci = kept.get(&key);
    let cis: BTreeSet<u32> = gi
        .compute_instances
        .iter()
        .map(|ci| ci.ci_id)
        .filter(|&ci| kept_ci.is_none_or(|&keep| keep != Some(ci)))
        .collect();
    for ci_id in cis {
        actions.push(MigAction::DestroyComputeInstance {
            parent_minor: minor,
            gi_id: gi.gi_id,
            ci_id,
            reason: reason(),
        });
    }
    if kept_ci.is_none() {
        actions.push(MigAction::DestroyGpuInstance {
            parent_minor: minor,
            gi_id: gi.gi_id,
            reason: reason(),
        });
    }
}

fn forget_action(record: &RecordedInstance, reason: ForgetReason) -> MigAction {
    MigAction::ForgetInstance {
        claim_uid: record.claim_uid.clone(),
        parent_minor: record.instance.parent_minor,
        placement: record.instance.placement.into(),
        reason,
    }
}
