//! Dynamic MIG: placement devices and a full-GPU device share one counter set, as NVIDIA's
//! DRA driver publishes them (`cmd/gpu-kubelet-plugin/partitions.go`); the stand-in never
//! lets their counters run over (`allocator_incubating.go` `checkAvailableCounters`).

use serde_json::json;

use super::fixtures::{
    MIG_1G, MIG_3G, WHOLE_GPU, check_allocations, classes, counter_set, dynamic_mig_devices,
    results_of, share_claim, slice,
};
use super::shares::schedule;
use super::*;

/// One node with one dynamic-MIG GPU: a counters-only slice and a device slice. Without
/// `counters_slice` the pool misses a slice.
fn mig_cluster(counters_slice: bool) -> FakeApi {
    let fake = FakeApi::new();
    node(&fake, "node-0", json!([]));
    if counters_slice {
        slice(
            &fake,
            "node-0",
            0,
            2,
            json!({"sharedCounters": [counter_set(0)]}),
        );
    }
    slice(
        &fake,
        "node-0",
        1,
        2,
        json!({"devices": dynamic_mig_devices(0)}),
    );
    classes(&fake);
    fake
}

fn device_of(fake: &FakeApi, claim: &str) -> Option<String> {
    results_of(&get_claim(fake, claim))
        .first()
        .map(|r| r.0.clone())
}

async fn claim_and_schedule(
    fake: &FakeApi,
    scheduler: &mut SchedulerStandIn,
    name: &str,
    class: &str,
) -> CycleOutcome {
    share_claim(fake, name, class, Value::Null);
    pod(fake, name, &[name], json!({}));
    schedule(scheduler, name).await
}

#[tokio::test]
async fn overlapping_placements_are_never_both_allocated() {
    let fake = mig_cluster(true);
    let mut scheduler = stand_in(&fake);
    assert_eq!(
        claim_and_schedule(&fake, &mut scheduler, "big", MIG_3G).await,
        reserved("big", "node-0")
    );
    assert_eq!(
        device_of(&fake, "big").as_deref(),
        Some("gpu-0-mig-3g-20gb-0")
    );
    // Memory slices 0-3 are taken: the first 1g placement that fits starts at slice 4.
    assert_eq!(
        claim_and_schedule(&fake, &mut scheduler, "small", MIG_1G).await,
        reserved("small", "node-0")
    );
    assert_eq!(
        device_of(&fake, "small").as_deref(),
        Some("gpu-0-mig-1g-5gb-4")
    );
    // Placement 3g@4 overlaps slice 4, and 3 + 1 + 3 compute slices stay within 7 — the
    // memory slices alone refuse it.
    assert!(matches!(
        claim_and_schedule(&fake, &mut scheduler, "big2", MIG_3G).await,
        CycleOutcome::Unschedulable { .. }
    ));
    check_allocations(&fake);
    // No exclusive result carries a shareID: MIG devices are not shareable.
    for claim in ["big", "small"] {
        assert_eq!(results_of(&get_claim(&fake, claim))[0].1, None);
    }
}

#[tokio::test]
async fn the_full_gpu_and_a_placement_exclude_each_other() {
    let fake = mig_cluster(true);
    let mut scheduler = stand_in(&fake);
    assert_eq!(
        claim_and_schedule(&fake, &mut scheduler, "whole", WHOLE_GPU).await,
        reserved("whole", "node-0")
    );
    assert_eq!(device_of(&fake, "whole").as_deref(), Some("gpu-0"));
    assert!(matches!(
        claim_and_schedule(&fake, &mut scheduler, "part", MIG_1G).await,
        CycleOutcome::Unschedulable { .. }
    ));

    let fake = mig_cluster(true);
    let mut scheduler = stand_in(&fake);
    assert_eq!(
        claim_and_schedule(&fake, &mut scheduler, "part", MIG_1G).await,
        reserved("part", "node-0")
    );
    assert!(matches!(
        claim_and_schedule(&fake, &mut scheduler, "whole", WHOLE_GPU).await,
        CycleOutcome::Unschedulable { .. }
    ));
    check_allocations(&fake);
}

#[tokio::test]
async fn placements_fill_the_gpu_and_allocations_by_others_count() {
    let fake = mig_cluster(true);
    // Someone else allocated placement 3g@0 (no builtin finalizer: kerf-style), memory
    // slices 0-3: its counters are gone, whoever wrote the allocation.
    claim(&fake, "other", MIG_3G);
    allocate_as_kerf(&fake, "other", "node-0", "gpu-0-mig-3g-20gb-0", true);
    let mut scheduler = stand_in(&fake);
    let mut devices = Vec::new();
    for i in 4..7 {
        let name = format!("p{i}");
        assert_eq!(
            claim_and_schedule(&fake, &mut scheduler, &name, MIG_1G).await,
            reserved(&name, "node-0")
        );
        devices.push(device_of(&fake, &name).unwrap());
    }
    let expected: Vec<String> = (4..7).map(|s| format!("gpu-0-mig-1g-5gb-{s}")).collect();
    assert_eq!(devices, expected);
    // 3 + 3 × 1 compute slices leave one, but no 1g placement has a free memory slice.
    assert!(matches!(
        claim_and_schedule(&fake, &mut scheduler, "p7", MIG_1G).await,
        CycleOutcome::Unschedulable { .. }
    ));
    check_allocations(&fake);
}

#[tokio::test]
async fn a_pool_missing_its_counters_slice_allocates_nothing_until_it_is_published() {
    let fake = mig_cluster(false);
    let mut scheduler = stand_in(&fake);
    assert!(matches!(
        claim_and_schedule(&fake, &mut scheduler, "early", MIG_1G).await,
        CycleOutcome::Unschedulable { .. }
    ));
    slice(
        &fake,
        "node-0",
        0,
        2,
        json!({"sharedCounters": [counter_set(0)]}),
    );
    assert_eq!(
        schedule(&mut scheduler, "early").await,
        reserved("early", "node-0")
    );
}
