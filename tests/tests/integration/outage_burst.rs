//! A burst of slice pods right after an API server outage is placed about as fast as one
//! before it (once, after a 45 s outage, a burst of 40 slice pods took 106 s against 21 s).
//!
//! The whole-cluster simulation (real kerf-controller without leader election, real
//! publishers, the kube-scheduler stand-in) places a burst, then the in-memory API server
//! answers every request with 503 for 20 s (`Outage::Unavailable`, a load balancer without a
//! healthy backend; open watches end), then a second burst is created. Through the outage the
//! controller's watches keep failing; kube-runtime's default watch back-off would by then wait
//! up to 30 s between attempts (kube-runtime 5.0 `watcher.rs` `DefaultBackoff`), so the
//! controller would not see the second burst for that long. The second burst must be bound
//! within the first burst's time plus 10 s (the bound without the lease hand-over,
//! which this test has no part of; `tests/tests/integration/outage.rs` covers the Lease).
//!
//! Whether kube-runtime's default back-off would miss this bound depends on where its jittered
//! attempts fall against the outage's end; `tests/tests/integration/outage.rs`
//! (`the_controllers_watches_retry_at_least_every_five_seconds_through_an_outage`) checks the
//! cause itself, the longest wait between two watch attempts, which fails with that default.

use std::time::{Duration, Instant};

use kerf_api::ownership::{NODE_LABEL, Owner};
use kerf_tests::fake_api::Outage;
use kerf_tests::sim::cluster::h100_nodes;
use kerf_tests::sim::workload::{PodPlan, Shape};
use kerf_tests::sim::{DRIVER, NAMESPACE, Sim, SimConfig, check};

const PODS: usize = 12;
const OUTAGE: Duration = Duration::from_secs(20);
const TIMEOUT: Duration = Duration::from_secs(90);

async fn burst(sim: &mut Sim, name: &str) -> Duration {
    let plans: Vec<PodPlan> = (0..PODS)
        .map(|i| PodPlan {
            name: format!("{name}-{i:02}"),
            shape: Shape::Slice {
                memory_gib: 10,
                compute: 10,
            },
            node: None,
        })
        .collect();
    let started = Instant::now();
    for plan in &plans {
        sim.create(plan).await.unwrap();
    }
    let keys: Vec<String> = plans
        .iter()
        .map(|p| format!("{NAMESPACE}/{}", p.name))
        .collect();
    sim.schedule_until(&format!("binding of burst {name}"), TIMEOUT, |sim| {
        keys.iter().all(|k| sim.pods().bound_at(k).is_some())
    })
    .await
    .unwrap();
    let last = keys
        .iter()
        .filter_map(|k| sim.pods().bound_at(k))
        .max()
        .unwrap_or(started);
    last.saturating_duration_since(started)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_right_after_an_outage_is_placed_about_as_fast_as_before() {
    let mut sim = Sim::start(SimConfig::new(h100_nodes(2), 7)).await.unwrap();
    sim.label_nodes(NODE_LABEL, Owner::Controller.as_str())
        .await
        .unwrap();
    sim.wait_for("devices published as the controller's", TIMEOUT, |sim| {
        check::published_owners(sim.fake(), DRIVER)
            .values()
            .all(|o| *o == Some(Owner::Controller))
    })
    .await
    .unwrap();
    // kerf-controller places on devices it took over only after their settle period.
    let claims = &sim.config().controller.claims;
    tokio::time::sleep(claims.ownership.settle + 4 * claims.ownership_tick).await;

    let before = burst(&mut sim, "before").await;
    sim.fake().set_outage(Some(Outage::Unavailable));
    tokio::time::sleep(OUTAGE).await;
    sim.fake().set_outage(None);
    let after = burst(&mut sim, "after").await;
    sim.stop().await;
    eprintln!("burst of {PODS} slice pods: {before:?} before the outage, {after:?} after it");
    assert!(
        after <= before + Duration::from_secs(10),
        "the burst after a {OUTAGE:?} outage took {after:?}, the one before {before:?}"
    );
}
