//! Seeded random sequences of claims arriving and pods leaving on nodes with shareable GPUs
//! and a dynamic-MIG GPU: after every step, an independent sum over all claims in the API
//! finds no device held twice, no capacity and no counter exceeded.

use serde_json::json;

use super::fixtures::{
    MIG_1G, MIG_3G, SHARED, WHOLE_GPU, check_allocations, claim_with, classes, counter_set,
    dynamic_mig_devices, request, share_claim, shareable_gpu, slice,
};
use super::*;

const NODES: [&str; 2] = ["node-0", "node-1"];

/// Per node: gpu-0 and gpu-1 shareable (40Gi), gpu-2 dynamic MIG; three slices.
fn mixed_cluster() -> FakeApi {
    let fake = FakeApi::new();
    for name in NODES {
        node(&fake, name, json!([]));
        slice(
            &fake,
            name,
            0,
            3,
            json!({"sharedCounters": [counter_set(2)]}),
        );
        let shareable: Vec<Value> = (0..2).map(|m| shareable_gpu(m, 40)).collect();
        slice(&fake, name, 1, 3, json!({"devices": shareable}));
        slice(
            &fake,
            name,
            2,
            3,
            json!({"devices": dynamic_mig_devices(2)}),
        );
    }
    classes(&fake);
    fake
}

/// A claim of a random shape.
fn random_claim(fake: &FakeApi, name: &str, rng: &mut SeededRng) {
    match rng.below(7) {
        0 => share_claim(fake, name, SHARED, Value::Null),
        1 => share_claim(fake, name, MIG_1G, Value::Null),
        2 => share_claim(fake, name, MIG_3G, Value::Null),
        3 => share_claim(fake, name, WHOLE_GPU, Value::Null),
        4 => {
            let memory = json!({"memory": format!("{}Gi", 1 + rng.below(16)), "compute": "20"});
            claim_with(
                fake,
                name,
                json!([
                    request("a", SHARED, memory.clone()),
                    request("b", SHARED, memory)
                ]),
                json!([{"requests": ["a", "b"], "distinctAttribute": "gpu.kerf.dev/uuid"}]),
            );
        }
        _ => {
            let memory = if rng.below(2) == 0 {
                format!("{}Gi", 1 + rng.below(24))
            } else {
                format!("{}Mi", 1 + rng.below(20_000))
            };
            let mut capacity = json!({"memory": memory});
            if rng.below(3) > 0 {
                capacity["compute"] = json!((1 + rng.below(60)).to_string());
            }
            share_claim(fake, name, SHARED, capacity);
        }
    }
}

async fn run(seed: u64) -> (usize, usize) {
    let fake = mixed_cluster();
    let mut scheduler = stand_in(&fake);
    let mut rng = SeededRng::new(seed);
    let pods = Api::<Pod>::namespaced(fake.client(), NS);
    let (mut reserved, mut unschedulable) = (0, 0);
    let mut live: Vec<String> = Vec::new();
    for step in 0..200 {
        if rng.below(2) > 0 || live.is_empty() {
            let name = format!("w{step}");
            random_claim(&fake, &name, &mut rng);
            pod(&fake, &name, &[&name], json!({}));
            live.push(name);
        } else {
            let gone = live.swap_remove(rng.below(live.len()));
            pods.delete(&gone, &DeleteParams::default()).await.unwrap();
            scheduler.run_claim_controller_once().await.unwrap();
        }
        let report = scheduler.step(&mut rng).await.unwrap();
        match report.cycle {
            CycleOutcome::Reserved { .. } => reserved += 1,
            CycleOutcome::Unschedulable { .. } => unschedulable += 1,
            CycleOutcome::Error { message, .. } => panic!("seed {seed} step {step}: {message}"),
            CycleOutcome::Idle => {}
        }
        check_allocations(&fake);
    }
    scheduler.flush_prebinds().await;
    check_allocations(&fake);
    (reserved, unschedulable)
}

#[tokio::test]
async fn random_sequences_never_exceed_capacity_or_counters() {
    for seed in [1, 2, 3] {
        let (reserved, unschedulable) = run(seed).await;
        eprintln!("seed {seed}: {reserved} reserved, {unschedulable} unschedulable");
        // Both outcomes must occur, or the sequence tested nothing.
        assert!(reserved >= 20, "seed {seed}: only {reserved} reserved");
        assert!(
            unschedulable >= 5,
            "seed {seed}: only {unschedulable} unschedulable"
        );
    }
}
