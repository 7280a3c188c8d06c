//! Scheduler slices: consumable capacity on shareable GPUs (k/k
//! `structured/internal/incubating`: every capacity of a shareable device is consumed).

use std::collections::BTreeMap;

use serde_json::json;

use super::fixtures::{
    SHARED, WHOLE_GPU, check_allocations, claim_with, classes, request, results_of, share_claim,
    shareable_gpu, slice,
};
use super::*;

/// One node with shareable GPUs of `memory_gi` each and the test classes.
fn shared_cluster(gpus: u32, memory_gi: u32) -> FakeApi {
    let fake = FakeApi::new();
    node(&fake, "node-0", json!([]));
    let devices: Vec<Value> = (0..gpus).map(|m| shareable_gpu(m, memory_gi)).collect();
    slice(&fake, "node-0", 0, 1, json!({"devices": devices}));
    classes(&fake);
    fake
}

/// Runs cycles (each followed by PreBind) until one decides about `pod`; returns it.
pub(super) async fn schedule(scheduler: &mut SchedulerStandIn, pod: &str) -> CycleOutcome {
    let mut rng = SeededRng::new(pod.len() as u64);
    let wanted = format!("{NS}/{pod}");
    for _ in 0..100 {
        let outcome = scheduler.schedule_one(&mut rng).await.unwrap();
        scheduler.flush_prebinds().await;
        let about = match &outcome {
            CycleOutcome::Reserved { pod, .. }
            | CycleOutcome::Unschedulable { pod, .. }
            | CycleOutcome::Error { pod, .. } => pod == &wanted,
            CycleOutcome::Idle => false,
        };
        if about {
            return outcome;
        }
    }
    panic!("no cycle decided about {pod}");
}

fn is_unschedulable(outcome: &CycleOutcome) -> bool {
    matches!(outcome, CycleOutcome::Unschedulable { .. })
}

fn consumed(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[tokio::test]
async fn two_shares_of_one_gpu_get_their_own_share_ids_and_consumed_capacity() {
    let fake = shared_cluster(1, 80);
    let mut scheduler = stand_in(&fake);
    for name in ["a", "b"] {
        share_claim(
            &fake,
            name,
            SHARED,
            json!({"memory": "10Gi", "compute": "30"}),
        );
        pod(&fake, name, &[name], json!({}));
        assert_eq!(
            schedule(&mut scheduler, name).await,
            reserved(name, "node-0")
        );
    }
    let a = results_of(&get_claim(&fake, "a"));
    let b = results_of(&get_claim(&fake, "b"));
    let expected = consumed(&[
        ("compute", "30"),
        ("memory", "10Gi"),
        ("multiprocessors", "0"),
    ]);
    for results in [&a, &b] {
        assert_eq!(results.len(), 1);
        assert_eq!(results[0].0, "gpu-0");
        assert_eq!(results[0].2, expected);
        let id = results[0].1.as_deref().unwrap();
        assert_eq!(
            id.split('-').map(str::len).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
    }
    assert_ne!(a[0].1, b[0].1, "each share has its own shareID");
    check_allocations(&fake);
}

#[tokio::test]
async fn requests_round_up_to_the_step_and_a_request_above_max_fits_no_gpu() {
    let fake = shared_cluster(1, 80);
    let mut scheduler = stand_in(&fake);
    share_claim(
        &fake,
        "odd",
        SHARED,
        json!({"memory": "1500Mi", "compute": "7"}),
    );
    pod(&fake, "odd", &["odd"], json!({}));
    assert_eq!(
        schedule(&mut scheduler, "odd").await,
        reserved("odd", "node-0")
    );
    assert_eq!(
        results_of(&get_claim(&fake, "odd"))[0].2,
        consumed(&[
            ("compute", "7"),
            ("memory", "2Gi"),
            ("multiprocessors", "0")
        ])
    );

    share_claim(&fake, "huge", SHARED, json!({"memory": "81Gi"}));
    pod(&fake, "huge", &["huge"], json!({}));
    assert!(is_unschedulable(&schedule(&mut scheduler, "huge").await));
    // A capacity the GPU does not publish under that exact name fits no device either.
    share_claim(
        &fake,
        "qualified",
        SHARED,
        json!({"gpu.kerf.dev/memory": "1Gi"}),
    );
    pod(&fake, "qualified", &["qualified"], json!({}));
    assert!(is_unschedulable(
        &schedule(&mut scheduler, "qualified").await
    ));
}

#[tokio::test]
async fn a_claim_without_capacity_requests_takes_the_whole_shareable_gpu() {
    let fake = shared_cluster(1, 80);
    let mut scheduler = stand_in(&fake);
    share_claim(&fake, "all", SHARED, Value::Null);
    pod(&fake, "all", &["all"], json!({}));
    assert_eq!(
        schedule(&mut scheduler, "all").await,
        reserved("all", "node-0")
    );
    let results = results_of(&get_claim(&fake, "all"));
    assert_eq!(
        results[0].2,
        consumed(&[
            ("compute", "100"),
            ("memory", "80Gi"),
            ("multiprocessors", "0")
        ])
    );
    assert!(results[0].1.is_some(), "still a share, with a shareID");

    share_claim(
        &fake,
        "small",
        SHARED,
        json!({"memory": "1Gi", "compute": "1"}),
    );
    pod(&fake, "small", &["small"], json!({}));
    assert!(is_unschedulable(&schedule(&mut scheduler, "small").await));
    // The whole-GPU class never selects a shareable GPU.
    share_claim(&fake, "whole", WHOLE_GPU, Value::Null);
    pod(&fake, "whole", &["whole"], json!({}));
    assert!(is_unschedulable(&schedule(&mut scheduler, "whole").await));
    check_allocations(&fake);
}

#[tokio::test]
async fn an_allocation_without_share_id_blocks_every_share() {
    let fake = shared_cluster(1, 80);
    claim(&fake, "kerf", SHARED);
    allocate_as_kerf(&fake, "kerf", "node-0", "gpu-0", true);
    let mut scheduler = stand_in(&fake);
    share_claim(&fake, "share", SHARED, json!({"memory": "1Gi"}));
    pod(&fake, "share", &["share"], json!({}));
    assert!(is_unschedulable(&schedule(&mut scheduler, "share").await));
}

#[tokio::test]
async fn a_share_that_does_not_fit_waits_until_another_is_released() {
    let fake = shared_cluster(1, 80);
    let mut scheduler = stand_in(&fake);
    for name in ["s0", "s1", "s2"] {
        share_claim(
            &fake,
            name,
            SHARED,
            json!({"memory": "30Gi", "compute": "40"}),
        );
    }
    // One pod after the other, so that s2 is the one left over.
    for name in ["s0", "s1"] {
        pod(&fake, name, &[name], json!({}));
        assert_eq!(
            schedule(&mut scheduler, name).await,
            reserved(name, "node-0")
        );
    }
    pod(&fake, "s2", &["s2"], json!({}));
    // 90Gi > 80Gi and 120 % > 100 %: unschedulable, again and again.
    for _ in 0..3 {
        assert!(is_unschedulable(&schedule(&mut scheduler, "s2").await));
    }
    check_allocations(&fake);

    // s0's pod goes away: the resourceclaim controller deallocates its claim.
    Api::<Pod>::namespaced(fake.client(), NS)
        .delete("s0", &DeleteParams::default())
        .await
        .unwrap();
    scheduler.run_claim_controller_once().await.unwrap();
    assert!(results_of(&get_claim(&fake, "s0")).is_empty());
    assert_eq!(
        schedule(&mut scheduler, "s2").await,
        reserved("s2", "node-0")
    );
    check_allocations(&fake);
}

#[tokio::test]
async fn distinct_attribute_puts_two_requests_on_different_gpus() {
    let fake = shared_cluster(2, 80);
    let mut scheduler = stand_in(&fake);
    let requests = || {
        json!([
            request("a", SHARED, json!({"memory": "10Gi", "compute": "10"})),
            request("b", SHARED, json!({"memory": "10Gi", "compute": "10"})),
        ])
    };
    // Without a constraint both shares land on the first GPU (upstream does not mark a
    // shareable device in use within the claim).
    claim_with(&fake, "same", requests(), json!([]));
    pod(&fake, "same", &["same"], json!({}));
    assert_eq!(
        schedule(&mut scheduler, "same").await,
        reserved("same", "node-0")
    );
    let devices: Vec<String> = results_of(&get_claim(&fake, "same"))
        .into_iter()
        .map(|r| r.0)
        .collect();
    assert_eq!(devices, ["gpu-0", "gpu-0"]);

    let distinct = json!([{"requests": ["a", "b"], "distinctAttribute": "gpu.kerf.dev/uuid"}]);
    claim_with(&fake, "apart", requests(), distinct.clone());
    pod(&fake, "apart", &["apart"], json!({}));
    assert_eq!(
        schedule(&mut scheduler, "apart").await,
        reserved("apart", "node-0")
    );
    let devices: Vec<String> = results_of(&get_claim(&fake, "apart"))
        .into_iter()
        .map(|r| r.0)
        .collect();
    assert_eq!(devices, ["gpu-0", "gpu-1"]);

    // Same-valued attribute wanted: matchAttribute keeps both on one GPU.
    let matched = json!([{"requests": ["a", "b"], "matchAttribute": "gpu.kerf.dev/uuid"}]);
    claim_with(&fake, "together", requests(), matched);
    pod(&fake, "together", &["together"], json!({}));
    assert_eq!(
        schedule(&mut scheduler, "together").await,
        reserved("together", "node-0")
    );
    let results = results_of(&get_claim(&fake, "together"));
    assert_eq!(results[0].0, results[1].0);
    check_allocations(&fake);

    // One GPU only: two distinct GPUs cannot be found.
    let single = shared_cluster(1, 80);
    let mut scheduler = stand_in(&single);
    claim_with(&single, "apart", requests(), distinct);
    pod(&single, "apart", &["apart"], json!({}));
    assert!(is_unschedulable(&schedule(&mut scheduler, "apart").await));
}
