//! Claim writes, deletions and re-creations racing prepares, in a seeded random order: every
//! prepare that succeeds used the claim with the kubelet's UID, allocated on this node, and no
//! prepare succeeds for a claim deleted before it started whose delete the cache had seen.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kerf_kubelet_plugin::preparer::Preparer;
use kerf_scheduler_standin::SeededRng;

use super::*;

/// Claim names in play; claim `i` is allocated the whole GPU `gpu-i` (or a device of another
/// node), whatever its generation.
const NAMES: usize = 3;
const STEPS: usize = 60;
const SEEDS: [u64; 4] = [1, 7, 42, 2026];

/// True `percent` times in a hundred: the seeded sequence of [`SeededRng`], so that a failing
/// seed can be run again.
fn chance(rng: &mut SeededRng, percent: usize) -> bool {
    rng.below(100) < percent
}

/// What the test wrote for one claim generation (one UID). `pool` is set before the API
/// server gets the allocation, and `deleted` after the API server dropped the claim.
#[derive(Debug, Clone)]
struct Generation {
    name: String,
    device: String,
    labelled: bool,
    pool: Option<&'static str>,
    deleted: bool,
}

type Generations = Arc<Mutex<HashMap<String, Generation>>>;

/// Prepare tasks of each UID that have not ended (unprepare included). A prepare that starts
/// while another of its UID has prepared it is an idempotent repeat, answered from the
/// checkpoint without reading the claim, deleted or not, as the kubelet expects.
type InFlight = Arc<Mutex<HashMap<String, usize>>>;

fn name_of(index: usize) -> String {
    format!("race-{index}")
}

/// The claim as the API server should hold generation `uid`.
fn generation_claim(uid: &str, generation: &Generation) -> Value {
    let allocation = generation
        .pool
        .map(|pool| (pool, generation.device.as_str()));
    claim(&generation.name, uid, generation.labelled, allocation)
}

struct Race {
    node: CacheNode,
    rng: SeededRng,
    generations: Generations,
    in_flight: InFlight,
    current: Vec<Option<String>>,
    next_uid: u32,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Race {
    fn write(&self, uid: &str) {
        let generation = self.generations.lock().unwrap()[uid].clone();
        let mut claim = generation_claim(uid, &generation);
        claim["metadata"]["annotations"] = json!({"touched": self.next_uid.to_string()});
        self.node.node.api.insert(claim);
    }

    fn create(&mut self, index: usize) {
        self.next_uid += 1;
        let id = uid(1000 + self.next_uid);
        let pool = match self.rng.below(5) {
            0..=2 => Some(NODE),
            3 => Some("node-2"),
            _ => None,
        };
        let generation = Generation {
            name: name_of(index),
            device: format!("gpu-{index}"),
            labelled: chance(&mut self.rng, 80),
            pool,
            deleted: false,
        };
        self.generations
            .lock()
            .unwrap()
            .insert(id.clone(), generation);
        self.write(&id);
        self.current[index] = Some(id);
    }

    /// Allocates a generation that has no allocation yet and labels it, as kerf-controller
    /// does for a claim kube-scheduler allocated.
    fn allocate(&mut self, id: &str) {
        let pool = if chance(&mut self.rng, 75) {
            NODE
        } else {
            "node-2"
        };
        {
            let mut generations = self.generations.lock().unwrap();
            let generation = generations.get_mut(id).unwrap();
            if generation.pool.is_some() {
                return;
            }
            generation.pool = Some(pool);
            generation.labelled = true;
        }
        self.write(id);
    }

    fn delete(&mut self, index: usize) {
        let Some(id) = self.current[index].take() else {
            return;
        };
        self.node
            .node
            .api
            .remove(&fixtures::claim_path(NAMESPACE, &name_of(index)));
        self.generations
            .lock()
            .unwrap()
            .get_mut(&id)
            .unwrap()
            .deleted = true;
    }

    /// Waits until the cache holds generation `id` as written (labelled ones only).
    async fn settle(&self, id: &str) {
        let generation = self.generations.lock().unwrap()[id].clone();
        if !generation.labelled || generation.deleted {
            return;
        }
        until("the cache to catch up", WAIT, || {
            match self.node.cached(NAMESPACE, &generation.name) {
                Cached::Found(c) => {
                    c.metadata.uid.as_deref() == Some(id)
                        && c.status
                            .as_ref()
                            .and_then(|s| s.allocation.as_ref())
                            .is_some()
                            == generation.pool.is_some()
                }
                // A claim unprepared here hides behind its hold-back until the watch shows
                // the allocation cleared; only an allocated copy can be held back.
                Cached::HeldBack => generation.pool.is_some(),
                _ => false,
            }
        })
        .await;
    }

    /// Starts a prepare of generation `id` that races whatever comes next.
    fn spawn_prepare(&mut self, id: String) {
        let generation = self.generations.lock().unwrap()[&id].clone();
        // Deleted before the prepare starts, and the cache no longer holds it: the cache
        // has seen the delete event.
        let deleted_and_seen =
            generation.deleted && self.node.cached_uid(&generation.name).as_deref() != Some(&id);
        let repeat = {
            let mut in_flight = self.in_flight.lock().unwrap();
            let count = in_flight.entry(id.clone()).or_default();
            *count += 1;
            *count > 1
        };
        let preparer = Arc::clone(self.node.running().preparer());
        let generations = Arc::clone(&self.generations);
        let in_flight = Arc::clone(&self.in_flight);
        self.tasks.push(tokio::spawn(async move {
            let must_fail = deleted_and_seen && !repeat;
            check_prepare(preparer, generations, &id, must_fail).await;
            *in_flight.lock().unwrap().get_mut(&id).unwrap() -= 1;
        }));
    }
}

async fn check_prepare(
    preparer: Arc<Preparer>,
    generations: Generations,
    id: &str,
    must_fail: bool,
) {
    let name = generations.lock().unwrap()[id].name.clone();
    let claim = claim_ref(&name, id);
    let answer = preparer
        .prepare(std::slice::from_ref(&claim))
        .await
        .pop()
        .unwrap()
        .1;
    let devices = match answer {
        Ok(devices) => devices,
        Err(e) => {
            assert!(
                matches!(e, Error::Prepare(_)),
                "{id}: not a claim error: {e}"
            );
            return;
        }
    };
    let generation = generations.lock().unwrap()[id].clone();
    assert!(
        !must_fail,
        "{id} was prepared after its deletion reached the cache"
    );
    assert_eq!(generation.pool, Some(NODE), "{id} prepared: {generation:?}");
    for device in &devices {
        assert_eq!(device.pool_name, NODE, "{id}: {devices:?}");
        assert_eq!(device.device_name, generation.device, "{id}: {devices:?}");
        assert!(
            device.cdi_device_ids.iter().all(|cdi| cdi.contains(id)),
            "{id}: {devices:?}"
        );
    }
    for (uid, answer) in preparer.unprepare(&[claim]).await {
        answer.unwrap_or_else(|e| panic!("unprepare of {uid}: {e}"));
    }
}

async fn run_seed(seed: u64) -> u64 {
    let mut race = Race {
        node: CacheNode::start(true).await,
        rng: SeededRng::new(seed),
        generations: Arc::default(),
        in_flight: Arc::default(),
        current: vec![None; NAMES],
        next_uid: u32::try_from(seed % 1000).unwrap() * 1000,
        tasks: Vec::new(),
    };
    for _ in 0..STEPS {
        let index = race.rng.below(NAMES);
        let op = race.rng.below(6);
        match (op, race.current[index].clone()) {
            (0 | 1, None) => race.create(index),
            (0, Some(id)) => race.allocate(&id),
            (1, Some(_)) => race.delete(index),
            (2, Some(_)) => {
                race.delete(index);
                race.create(index);
            }
            (3, Some(id)) => race.write(&id),
            (4, Some(id)) => {
                race.settle(&id).await;
                race.spawn_prepare(id);
            }
            _ => {
                // Any generation of the name, old ones included: the kubelet may name a
                // claim that is gone.
                let known: Vec<String> = race
                    .generations
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(_, g)| g.name == name_of(index))
                    .map(|(uid, _)| uid.clone())
                    .collect();
                if !known.is_empty() {
                    let pick = race.rng.below(known.len());
                    let mut sorted = known;
                    sorted.sort();
                    race.spawn_prepare(sorted.swap_remove(pick));
                }
            }
        }
        if chance(&mut race.rng, 30) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    for task in race.tasks.drain(..) {
        task.await.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    }
    let hits = race.node.lookups("cache", "");
    race.node.stop().await;
    hits
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepares_racing_claim_changes_only_use_live_claims_of_this_node() {
    let mut hits = 0;
    for seed in SEEDS {
        hits += run_seed(seed).await;
    }
    // The settled prepares of labelled claims allocated here come from the cache.
    assert!(hits > 0, "no prepare was served from the cache");
}
