//! The node label (`gpu.kerf.dev/node`) kerf-controller keeps on kerf claims, against the
//! in-memory API server: on its own claims from the write that marks them (before the
//! allocation) until the allocation goes; on claims kube-scheduler allocated with kerf devices
//! as soon as it sees them; never on other drivers' claims; never a write when it is right.
//! Tests poll the fake for outcomes with a deadline; nothing is timed.

use crate::common::claim_cluster;
use crate::common::label_cluster;

use std::collections::BTreeMap;

use claim_cluster::{CLAIMS, Controller, DRIVER, NODES, PODS, allocation, cluster, get_claim};
use kerf_api::claim_node_label::node_label_value;
use kerf_scheduler_standin::SeededRng;
use kerf_tests::fake_api::FakeApi;
use kerf_tests::wait::eventually;
use label_cluster::{
    DEADLINE, Versions, annotated, controller_claim, kerf_pool, label, pod, scheduler_allocation,
    scheduler_claim, set_allocation, touch,
};
use serde_json::Value;

async fn claim_where(fake: &FakeApi, name: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    eventually(&format!("claim {name}: {what}"), DEADLINE, || async {
        get_claim(fake, name).filter(|c| ok(c))
    })
    .await
}

/// PATCHes of claim `name`'s object (not its status) so far.
fn metadata_patches(fake: &FakeApi, name: &str) -> usize {
    let path = format!("{CLAIMS}/{name}");
    fake.requests()
        .iter()
        .filter(|r| r.verb == "patch" && r.path == path)
        .count()
}

/// The label a version of a controller claim must carry: the node of its kerf results when
/// allocated, else its annotation's node.
fn rule(claim: &Value) -> Option<String> {
    match allocation(claim) {
        Some(_) => kerf_pool(claim).map(node_label_value),
        None => annotated(claim).map(node_label_value),
    }
}

/// Every version of the controller claim `name` carries the label of [`rule`]: it arrives in
/// the write that annotates the claim, before the allocation, and goes with the annotation.
fn assert_labelled_at_every_version(versions: &Versions, name: &str) {
    let seen = versions.of(name);
    assert!(!seen.is_empty(), "no version of {name} recorded");
    for version in &seen {
        assert_eq!(
            label(version).map(str::to_owned),
            rule(version),
            "claim {name} at resourceVersion {}: {version}",
            version["metadata"]["resourceVersion"]
        );
    }
}

#[tokio::test]
async fn a_controller_claim_is_labelled_in_the_write_that_marks_it_and_unlabelled_with_it() {
    let fake = cluster();
    let versions = Versions::record(&fake).await;
    controller_claim(&fake, "c");
    pod(&fake, "p", "c");
    let controller = Controller::start(&fake);

    let allocated = claim_where(&fake, "c", "allocated", |c| allocation(c).is_some()).await;
    let node = kerf_pool(&allocated).unwrap().to_owned();
    assert_eq!(label(&allocated), Some(node.as_str()));
    let seen = versions.of("c");
    let first_marked = seen.iter().find(|c| annotated(c).is_some()).unwrap();
    assert_eq!(label(first_marked), Some(node.as_str()), "{first_marked}");
    assert!(allocation(first_marked).is_none(), "{first_marked}");
    // One mark (finalizer, annotation, label) and one allocation: no write of the label alone.
    assert_eq!(metadata_patches(&fake, "c"), 1);

    fake.remove(&format!("{PODS}/p"));
    let released = claim_where(&fake, "c", "deallocated and unmarked", |c| {
        allocation(c).is_none() && annotated(c).is_none()
    })
    .await;
    assert_eq!(label(&released), None, "{released}");
    assert_labelled_at_every_version(&versions, "c");
    controller.stop().await;
}

#[tokio::test]
async fn a_scheduler_allocated_claim_is_labelled_with_its_node_until_the_allocation_goes() {
    let fake = cluster();
    let controller = Controller::start(&fake);
    scheduler_claim(
        &fake,
        "theirs",
        Some(scheduler_allocation(DRIVER, "node-2", "gpu-7")),
    );
    claim_where(&fake, "theirs", "labelled node-2", |c| {
        label(c) == Some("node-2")
    })
    .await;

    set_allocation(&fake, "theirs", None);
    claim_where(&fake, "theirs", "unlabelled", |c| label(c).is_none()).await;

    // Allocated again, elsewhere.
    set_allocation(
        &fake,
        "theirs",
        Some(scheduler_allocation(DRIVER, "node-1", "gpu-7")),
    );
    claim_where(&fake, "theirs", "labelled node-1", |c| {
        label(c) == Some("node-1")
    })
    .await;
    controller.stop().await;
}

#[tokio::test]
async fn claims_of_other_drivers_are_never_labelled_and_long_node_names_get_the_hashed_value() {
    let fake = cluster();
    let controller = Controller::start(&fake);
    scheduler_claim(
        &fake,
        "foreign",
        Some(scheduler_allocation("nic.example.com", "node-1", "nic-0")),
    );
    let long = format!("{}.compute.internal", "gpu-worker-".repeat(6));
    assert!(long.len() > 63);
    scheduler_claim(
        &fake,
        "long",
        Some(scheduler_allocation(DRIVER, &long, "gpu-0")),
    );
    let expected = node_label_value(&long);
    assert_ne!(expected, long);
    // Claims are reconciled one after the other off one watch; once the later one is labelled,
    // the earlier one has had its chance.
    claim_where(&fake, "long", "labelled with the hashed value", |c| {
        label(c) == Some(expected.as_str())
    })
    .await;
    let foreign = get_claim(&fake, "foreign").unwrap();
    assert_eq!(label(&foreign), None, "{foreign}");
    assert_eq!(metadata_patches(&fake, "foreign"), 0);
    controller.stop().await;
}

#[tokio::test]
async fn a_label_already_right_is_not_written_again() {
    let fake = cluster();
    let controller = Controller::start(&fake);
    scheduler_claim(
        &fake,
        "theirs",
        Some(scheduler_allocation(DRIVER, "node-0", "gpu-7")),
    );
    claim_where(&fake, "theirs", "labelled", |c| label(c) == Some("node-0")).await;
    assert_eq!(metadata_patches(&fake, "theirs"), 1);

    for n in 0..5 {
        touch(&fake, "theirs", n);
        tokio::task::yield_now().await;
    }
    // Barrier: a claim created after the updates is labelled once they were all seen.
    scheduler_claim(
        &fake,
        "barrier",
        Some(scheduler_allocation(DRIVER, "node-3", "gpu-7")),
    );
    claim_where(&fake, "barrier", "labelled", |c| label(c) == Some("node-3")).await;
    assert_eq!(
        metadata_patches(&fake, "theirs"),
        1,
        "a write per unrelated update"
    );
    controller.stop().await;
}

/// The state the randomized test drives towards: per scheduler claim its allocation's node,
/// per controller claim its live pod.
#[derive(Default)]
struct Model {
    scheduler: BTreeMap<String, Option<&'static str>>,
    pods: BTreeMap<String, Option<String>>,
    rejections: BTreeMap<String, u32>,
    next_pod: usize,
}

const SCHEDULER_CLAIMS: [&str; 3] = ["s0", "s1", "s2"];
const CONTROLLER_CLAIMS: [&str; 3] = ["c0", "c1", "c2"];

impl Model {
    /// One random step: allocate, move, deallocate or touch a scheduler claim; give a
    /// controller claim a pod, take it away, or have the scheduler reject its node.
    fn step(&mut self, fake: &FakeApi, rng: &mut SeededRng) {
        if rng.below(2) == 0 {
            let name = SCHEDULER_CLAIMS[rng.below(SCHEDULER_CLAIMS.len())];
            let node = NODES[rng.below(NODES.len())];
            let exists = self.scheduler.contains_key(name);
            match (exists, rng.below(3)) {
                (false, _) => {
                    scheduler_claim(
                        fake,
                        name,
                        Some(scheduler_allocation(DRIVER, node, "gpu-7")),
                    );
                    self.scheduler.insert(name.to_owned(), Some(node));
                }
                (true, 0) => {
                    set_allocation(fake, name, None);
                    self.scheduler.insert(name.to_owned(), None);
                }
                (true, 1) => {
                    set_allocation(
                        fake,
                        name,
                        Some(scheduler_allocation(DRIVER, node, "gpu-7")),
                    );
                    self.scheduler.insert(name.to_owned(), Some(node));
                }
                (true, _) => touch(fake, name, rng.below(1000)),
            }
            return;
        }
        let name = CONTROLLER_CLAIMS[rng.below(CONTROLLER_CLAIMS.len())];
        match self.pods.get(name).cloned().flatten() {
            None => {
                self.next_pod += 1;
                let pod_name = format!("p{}-{name}", self.next_pod);
                pod(fake, &pod_name, name);
                self.pods.insert(name.to_owned(), Some(pod_name));
            }
            Some(pod_name) => {
                let claim = get_claim(fake, name).unwrap();
                let rejected = self.rejections.entry(pod_name.clone()).or_default();
                if rng.below(2) == 0 && allocation(&claim).is_some() && *rejected < 2 {
                    // kube-scheduler's PostFilter clearing an unreserved allocation.
                    *rejected += 1;
                    set_allocation(fake, name, None);
                } else {
                    fake.remove(&format!("{PODS}/{pod_name}"));
                    self.pods.insert(name.to_owned(), None);
                }
            }
        }
    }

    /// Whether the claims are where the model wants them, each with the label of its final
    /// allocation.
    fn settled(&self, fake: &FakeApi) -> Result<(), String> {
        for (name, node) in &self.scheduler {
            let claim = get_claim(fake, name).unwrap();
            let want = node.map(node_label_value);
            if label(&claim).map(str::to_owned) != want {
                return Err(format!("{name}: want label {want:?}: {claim}"));
            }
        }
        for (name, pod) in &self.pods {
            let claim = get_claim(fake, name).unwrap();
            let placed = kerf_pool(&claim).map(node_label_value);
            let ok = match pod {
                Some(_) => placed.is_some() && label(&claim).map(str::to_owned) == placed,
                None => allocation(&claim).is_none() && label(&claim).is_none(),
            };
            if !ok {
                return Err(format!("{name} (pod {pod:?}): {claim}"));
            }
        }
        Ok(())
    }
}

#[tokio::test]
async fn labels_follow_allocations_through_random_interleavings() {
    for seed in [1_u64, 7, 42, 2024] {
        let fake = cluster();
        let versions = Versions::record(&fake).await;
        for name in CONTROLLER_CLAIMS {
            controller_claim(&fake, name);
        }
        let controller = Controller::start(&fake);
        let mut rng = SeededRng::new(seed);
        let mut model = Model::default();
        for _ in 0..40 {
            model.step(&fake, &mut rng);
            // Sometimes let the controller run between steps, sometimes not.
            for _ in 0..rng.below(3) {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        }
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            match model.settled(&fake) {
                Ok(()) => break,
                Err(why) if tokio::time::Instant::now() > deadline => {
                    panic!("seed {seed}: labels do not match the final allocations: {why}")
                }
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        }
        for name in CONTROLLER_CLAIMS {
            assert_labelled_at_every_version(&versions, name);
        }
        controller.stop().await;
    }
}
