//! Start-up reconciliation of dynamic-MIG instances: examples for each rule, then random
//! states from fixed seeds checked against the rules and against applying the actions.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests may fail loudly.

use std::collections::{BTreeMap, BTreeSet};

use kerf_core::checkpoint::{ClaimState, MigInstanceRecord, RecordedPlacement};
use kerf_core::inventory::MigPlacement;
use kerf_core::mig_reconcile::{
    DestroyReason, ForgetReason, LiveComputeInstance, LiveGpu, LiveGpuInstance, LiveMigState,
    MigAction, RecordedInstance, reconcile,
};
use kerf_core::rng::SeededRng;

fn record(
    claim: &str,
    state: ClaimState,
    minor: u32,
    start: u32,
    size: u32,
    ids: Option<(u32, u32)>,
) -> RecordedInstance {
    RecordedInstance {
        claim_uid: claim.to_owned(),
        state,
        instance: MigInstanceRecord {
            parent_uuid: format!("GPU-{minor}"),
            parent_minor: minor,
            profile: format!("p{size}"),
            gi_profile_id: profile_id(size),
            ci_profile_id: 0,
            placement: RecordedPlacement { start, size },
            gi_id: ids.map(|(gi, _)| gi),
            ci_id: ids.map(|(_, ci)| ci),
            mig_uuid: ids.map(|(gi, ci)| uuid(minor, gi, ci)),
        },
    }
}

fn profile_id(size: u32) -> u32 {
    100 + size
}

fn uuid(minor: u32, gi: u32, ci: u32) -> String {
    format!("MIG-{minor}-{gi}-{ci}")
}

fn gi(minor: u32, gi_id: u32, start: u32, size: u32, cis: &[u32]) -> LiveGpuInstance {
    LiveGpuInstance {
        gi_id,
        gi_profile_id: profile_id(size),
        placement: MigPlacement { start, size },
        compute_instances: cis
            .iter()
            .map(|&ci_id| LiveComputeInstance {
                ci_id,
                uuid: uuid(minor, gi_id, ci_id),
            })
            .collect(),
    }
}

fn live(gpus: Vec<(u32, bool, Vec<LiveGpuInstance>)>) -> LiveMigState {
    LiveMigState {
        gpus: gpus
            .into_iter()
            .map(|(minor, dynamic, gpu_instances)| {
                (
                    minor,
                    LiveGpu {
                        dynamic,
                        gpu_instances,
                    },
                )
            })
            .collect(),
    }
}

use ClaimState::{PrepareCompleted as Done, PrepareStarted as Started};

#[test]
fn completed_instances_stay_and_orphans_go_compute_instances_first() {
    let records = [record("a", Done, 0, 0, 1, Some((7, 0)))];
    let state = live(vec![(
        0,
        true,
        vec![gi(0, 7, 0, 1, &[0]), gi(0, 3, 4, 4, &[0, 1])],
    )]);
    assert_eq!(
        reconcile(&records, &state),
        [
            MigAction::Keep {
                claim_uid: "a".into(),
                parent_minor: 0,
                gi_id: 7
            },
            MigAction::DestroyComputeInstance {
                parent_minor: 0,
                gi_id: 3,
                ci_id: 0,
                reason: DestroyReason::Unrecorded
            },
            MigAction::DestroyComputeInstance {
                parent_minor: 0,
                gi_id: 3,
                ci_id: 1,
                reason: DestroyReason::Unrecorded
            },
            MigAction::DestroyGpuInstance {
                parent_minor: 0,
                gi_id: 3,
                reason: DestroyReason::Unrecorded
            },
        ]
    );
}

#[test]
fn an_interrupted_preparation_is_undone_and_its_intent_forgotten() {
    // Crash after creating the GPU instance, before its id was recorded: found by placement.
    let records = [record("b", Started, 1, 2, 2, None)];
    let state = live(vec![(1, true, vec![gi(1, 5, 2, 2, &[])])]);
    let unfinished = DestroyReason::Unfinished {
        claim_uid: "b".into(),
    };
    assert_eq!(
        reconcile(&records, &state),
        [
            MigAction::DestroyGpuInstance {
                parent_minor: 1,
                gi_id: 5,
                reason: unfinished
            },
            MigAction::ForgetInstance {
                claim_uid: "b".into(),
                parent_minor: 1,
                placement: MigPlacement { start: 2, size: 2 },
                reason: ForgetReason::Unfinished
            },
        ]
    );
    // An intent that created nothing has nothing to undo.
    assert_eq!(reconcile(&records, &live(vec![(1, true, vec![])])), []);
}

#[test]
fn a_vanished_instance_is_reported_and_a_replaced_one_destroyed() {
    let records = [record("c", Done, 0, 0, 1, Some((7, 0)))];
    assert_eq!(
        reconcile(&records, &live(vec![(0, true, vec![])])),
        [MigAction::ForgetInstance {
            claim_uid: "c".into(),
            parent_minor: 0,
            placement: MigPlacement { start: 0, size: 1 },
            reason: ForgetReason::Vanished
        }]
    );
    // Same placement, another GPU instance id: not ours any more (recreated by someone).
    let actions = reconcile(&records, &live(vec![(0, true, vec![gi(0, 8, 0, 1, &[0])])]));
    assert!(matches!(
        actions.as_slice(),
        [
            MigAction::DestroyComputeInstance { gi_id: 8, .. },
            MigAction::DestroyGpuInstance { gi_id: 8, .. },
            MigAction::ForgetInstance {
                reason: ForgetReason::Vanished,
                ..
            }
        ]
    ));
}

#[test]
fn static_gpus_are_never_touched() {
    let records = [
        record("d", Done, 2, 0, 1, Some((9, 0))),
        record("e", Started, 2, 1, 1, Some((10, 0))),
    ];
    let state = live(vec![(2, false, vec![gi(2, 11, 4, 4, &[0])])]);
    assert_eq!(reconcile(&records, &state), []);
    // A record on a GPU that is no longer there is left alone too.
    assert_eq!(reconcile(&records, &LiveMigState::default()), []);
}

#[test]
fn extra_compute_instances_of_a_kept_instance_go() {
    let records = [record("f", Done, 0, 4, 4, Some((2, 0)))];
    let state = live(vec![(0, true, vec![gi(0, 2, 4, 4, &[0, 1])])]);
    assert_eq!(
        reconcile(&records, &state),
        [
            MigAction::Keep {
                claim_uid: "f".into(),
                parent_minor: 0,
                gi_id: 2
            },
            MigAction::DestroyComputeInstance {
                parent_minor: 0,
                gi_id: 2,
                ci_id: 1,
                reason: DestroyReason::Unrecorded
            },
        ]
    );
}

/// A seeded sequence, so every run checks the same states.
struct Rng(SeededRng);

impl Rng {
    fn below(&mut self, n: u32) -> u32 {
        u32::try_from(self.0.next_u64() % u64::from(n)).unwrap()
    }

    fn chance(&mut self, percent: u32) -> bool {
        self.below(100) < percent
    }
}

/// A random live state (non-overlapping instances per GPU, ids unique per GPU) and random
/// records: some naming live instances exactly, some stale, some intents with or without ids.
fn random_case(rng: &mut Rng) -> (Vec<RecordedInstance>, LiveMigState) {
    let mut gpus = Vec::new();
    let mut records = Vec::new();
    for minor in 0..=rng.below(4) {
        let mut instances = Vec::new();
        let mut start = 0;
        let mut next_id = rng.below(3);
        while start < 8 {
            let size = [1, 2, 4][rng.below(3) as usize].min(8 - start);
            if rng.chance(60) {
                let cis: Vec<u32> = (0..rng.below(3)).collect();
                instances.push(gi(minor, next_id, start, size, &cis));
            }
            next_id += 1 + rng.below(2);
            start += size;
        }
        for (n, instance) in instances.iter().enumerate() {
            let claim = format!("c{minor}-{n}");
            let ci = instance.compute_instances.first().map(|c| c.ci_id);
            let (gi_id, start, size) = (
                instance.gi_id,
                instance.placement.start,
                instance.placement.size,
            );
            match rng.below(5) {
                0 if ci.is_some() => records.push(record(
                    &claim,
                    Done,
                    minor,
                    start,
                    size,
                    Some((gi_id, ci.unwrap())),
                )),
                1 => records.push(record(&claim, Started, minor, start, size, None)),
                2 => records.push(record(
                    &claim,
                    Started,
                    minor,
                    start,
                    size,
                    Some((gi_id, 0)),
                )),
                3 => records.push(record(
                    &claim,
                    Done,
                    minor,
                    start,
                    size,
                    Some((gi_id + 50, 0)),
                )),
                _ => {}
            }
        }
        if rng.chance(30) {
            records.push(record(
                &format!("gone{minor}"),
                Done,
                minor,
                7,
                1,
                Some((40, 0)),
            ));
        }
        gpus.push((minor, rng.chance(75), instances));
    }
    (records, live(gpus))
}

/// What the live state becomes after the destroy actions, checking their order on the way.
fn apply(state: &LiveMigState, actions: &[MigAction]) -> LiveMigState {
    let mut state = state.clone();
    for action in actions {
        match action {
            MigAction::DestroyComputeInstance {
                parent_minor,
                gi_id,
                ci_id,
                ..
            } => {
                let gpu = state.gpus.get_mut(parent_minor).unwrap();
                assert!(gpu.dynamic, "touched static GPU {parent_minor}");
                let gi = gpu
                    .gpu_instances
                    .iter_mut()
                    .find(|g| g.gi_id == *gi_id)
                    .unwrap();
                let before = gi.compute_instances.len();
                gi.compute_instances.retain(|c| c.ci_id != *ci_id);
                assert_eq!(gi.compute_instances.len() + 1, before, "{action:?}");
            }
            MigAction::DestroyGpuInstance {
                parent_minor,
                gi_id,
                ..
            } => {
                let gpu = state.gpus.get_mut(parent_minor).unwrap();
                assert!(gpu.dynamic, "touched static GPU {parent_minor}");
                let gi = gpu
                    .gpu_instances
                    .iter()
                    .find(|g| g.gi_id == *gi_id)
                    .unwrap();
                assert!(
                    gi.compute_instances.is_empty(),
                    "GI {gi_id} destroyed before its CIs"
                );
                gpu.gpu_instances.retain(|g| g.gi_id != *gi_id);
            }
            MigAction::Keep { .. } | MigAction::ForgetInstance { .. } => {}
        }
    }
    state
}

#[test]
fn random_states_end_with_exactly_the_completed_instances() {
    for seed in 0..2000 {
        let mut rng = Rng(SeededRng::new(seed));
        let (records, state) = random_case(&mut rng);
        let actions = reconcile(&records, &state);
        let after = apply(&state, &actions);

        let completed: BTreeMap<(u32, u32), &RecordedInstance> = records
            .iter()
            .filter(|r| r.state == Done)
            .filter_map(|r| Some(((r.instance.parent_minor, r.instance.gi_id?), r)))
            .collect();
        for (&minor, gpu) in &after.gpus {
            let before = &state.gpus[&minor];
            if !gpu.dynamic {
                assert_eq!(gpu, before, "seed {seed}: static GPU {minor} changed");
                continue;
            }
            for gi in &gpu.gpu_instances {
                let r = completed.get(&(minor, gi.gi_id)).unwrap_or_else(|| {
                    panic!(
                        "seed {seed}: GPU {minor} GI {} survived without a completed record",
                        gi.gi_id
                    )
                });
                let ci = r.instance.ci_id.unwrap();
                assert_eq!(
                    gi.compute_instances
                        .iter()
                        .map(|c| c.ci_id)
                        .collect::<Vec<_>>(),
                    [ci],
                    "seed {seed}"
                );
            }
        }
        // Every record on a dynamic GPU either keeps its instance, or is forgotten, or is an
        // intent with nothing created.
        let kept: BTreeSet<&str> = actions
            .iter()
            .filter_map(|a| match a {
                MigAction::Keep { claim_uid, .. } => Some(claim_uid.as_str()),
                _ => None,
            })
            .collect();
        let forgotten: BTreeSet<&str> = actions
            .iter()
            .filter_map(|a| match a {
                MigAction::ForgetInstance { claim_uid, .. } => Some(claim_uid.as_str()),
                _ => None,
            })
            .collect();
        for r in &records {
            let dynamic = state
                .gpus
                .get(&r.instance.parent_minor)
                .is_some_and(|g| g.dynamic);
            let uid = r.claim_uid.as_str();
            if !dynamic {
                assert!(
                    !kept.contains(uid) && !forgotten.contains(uid),
                    "seed {seed}: {uid}"
                );
            } else if r.state == Done {
                assert!(
                    kept.contains(uid) != forgotten.contains(uid),
                    "seed {seed}: {uid}"
                );
            } else {
                assert!(!kept.contains(uid), "seed {seed}: intent {uid} kept");
                if r.instance.gi_id.is_some() {
                    assert!(
                        forgotten.contains(uid),
                        "seed {seed}: intent {uid} not forgotten"
                    );
                }
            }
        }
        // Reconciling again, with the forgotten records cleared, changes nothing.
        let remaining: Vec<RecordedInstance> = records
            .iter()
            .filter(|r| !forgotten.contains(r.claim_uid.as_str()))
            .cloned()
            .collect();
        let again = reconcile(&remaining, &after);
        assert!(
            again.iter().all(|a| matches!(a, MigAction::Keep { .. })),
            "seed {seed}: {again:?}"
        );
        assert_eq!(apply(&after, &again), after);
    }
}
