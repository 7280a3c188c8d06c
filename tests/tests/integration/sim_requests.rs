//! API requests per pod on each path through the simulated cluster (`kerf_tests::sim`), from
//! FakeApi's request log tallied by user, verb and resource
//! (`kerf_tests::fake_api::RequestCounts`): the writes `kerf-bench scheduling` reports, held
//! to what each component must write so that a change adding a write per pod fails here.
//!
//! - controller path (slice claims, Controller class): the user creates claim and pod;
//!   kerf-controller marks the claim (finalizer and node label, one metadata patch), writes
//!   its allocation reserved for the pod its gate still holds (one status patch) and removes
//!   the scheduling gate (what it allocated is said in the mark patch's annotations, not in
//!   an Event); the stand-in, as kube-scheduler's
//!   PreBind, skips a claim already reserved for the pod, binds the pod and records
//!   `Scheduled`.
//! - structured path (whole GPUs, Scheduler class): the user creates claim and pod; the
//!   stand-in adds its finalizer (an update), writes allocation and reservation (one status
//!   update), binds and records `Scheduled`; kerf-controller labels the claim with its node
//!   (one metadata patch), as it labels every claim of its driver.
//!
//! Not held here: kerf-controller's GpuClass status refreshes (`gpuclasses/status`), which
//! follow the cluster's free capacity rather than each pod, a few per ten pods in these runs.
//!
//! The stand-in's `get pods` before binding is not a write and not kube-scheduler's: it
//! stands in for the checks of the `pods/binding` subresource.

use std::time::Duration;

use kerf_api::ownership::{NODE_LABEL, Owner};
use kerf_tests::fake_api::{Identity, RequestCounts};
use kerf_tests::sim::cluster::h100_nodes;
use kerf_tests::sim::workload::{PodPlan, Shape};
use kerf_tests::sim::{DRIVER, NAMESPACE, SCHEDULER_USER, Sim, SimConfig, check};

const PODS: u64 = 6;
const TIMEOUT: Duration = Duration::from_secs(60);

/// Pins every device to `owner`, creates [`PODS`] pods of `shape`, runs the stand-in until
/// all are bound and returns the requests made from the first creation to the last binding.
async fn run(owner: Owner, shape: &Shape) -> RequestCounts {
    let mut config = SimConfig::new(h100_nodes(2), 7);
    config.stand_in.scheduled_events = true;
    let mut sim = Sim::start(config).await.unwrap();
    sim.label_nodes(NODE_LABEL, owner.as_str()).await.unwrap();
    sim.wait_for("owners published", TIMEOUT, |sim| {
        check::published_owners(sim.fake(), DRIVER)
            .values()
            .all(|o| *o == Some(owner))
    })
    .await
    .unwrap();
    if owner == Owner::Controller {
        // The controller places on a device taken back only after its settle period.
        let claims = &sim.config().controller.claims;
        tokio::time::sleep(claims.ownership.settle + 4 * claims.ownership_tick).await;
    }
    sim.fake().clear_requests();
    let keys: Vec<String> = (0..PODS).map(|i| format!("{NAMESPACE}/p-{i}")).collect();
    for i in 0..PODS {
        let plan = PodPlan {
            name: format!("p-{i}"),
            shape: shape.clone(),
            node: None,
        };
        sim.create(&plan).await.unwrap();
    }
    sim.schedule_until("all pods bound", TIMEOUT, |sim| {
        keys.iter().all(|k| sim.pods().bound_at(k).is_some())
    })
    .await
    .unwrap();
    // Let the writes that follow binding (the Scheduled Event is written right after it)
    // land before counting.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let counts = sim.fake().request_counts();
    let lines = counts.describe_per(PODS, str::to_owned);
    println!("{owner} path, requests per pod:\n  {}", lines.join("\n  "));
    sim.stop().await;
    counts
}

fn controller_user() -> String {
    Identity::kerf_controller().username
}

/// The writes of `user` but GpuClass status refreshes (see the module documentation).
fn pod_writes(counts: &RequestCounts, user: &str) -> u64 {
    counts.writes_of(user) - counts.get(user, "patch", "gpu.kerf.dev/gpuclasses/status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_path_writes_per_pod() {
    let counts = run(
        Owner::Controller,
        &Shape::Slice {
            memory_gib: 10,
            compute: 10,
        },
    )
    .await;
    let admin = Identity::admin().username;
    let controller = controller_user();
    // The user: a claim and a pod.
    assert_eq!(counts.writes_of(&admin), 2 * PODS);
    // kerf-controller: claim metadata, claim status, gate removal, exactly once per pod on
    // this quiet cluster (no conflicts), and no Event.
    let claim = "resource.k8s.io/resourceclaims";
    assert_eq!(counts.get(&controller, "patch", claim), PODS);
    assert_eq!(
        counts.get(&controller, "patch", &format!("{claim}/status")),
        PODS
    );
    assert_eq!(counts.get(&controller, "patch", "pods"), PODS);
    assert_eq!(counts.get(&controller, "create", "events.k8s.io/events"), 0);
    assert_eq!(pod_writes(&counts, &controller), 3 * PODS);
    // The stand-in: the binding and the Scheduled Event; no reservation (kerf-controller's
    // allocation write reserved the claim for the pod).
    assert_eq!(counts.get(SCHEDULER_USER, "patch", "pods"), PODS);
    assert_eq!(
        counts.get(SCHEDULER_USER, "create", "events.k8s.io/events"),
        PODS
    );
    let reservations = counts.get(SCHEDULER_USER, "update", &format!("{claim}/status"));
    assert_eq!(reservations, 0);
    assert_eq!(counts.writes_of(SCHEDULER_USER), 2 * PODS);
    let others = counts.writes() - counts.writes_of(&controller);
    assert_eq!(others + pod_writes(&counts, &controller), 7 * PODS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_structured_path_writes_per_pod() {
    let counts = run(Owner::Scheduler, &Shape::Whole).await;
    let admin = Identity::admin().username;
    let claim = "resource.k8s.io/resourceclaims";
    assert_eq!(counts.writes_of(&admin), 2 * PODS);
    let controller = controller_user();
    // kerf-controller's label reconciler patches each claim once when it sees the
    // allocation; a patch racing the scheduler's status update is sent again.
    let labels = counts.get(&controller, "patch", claim);
    assert!(
        (PODS..=PODS + PODS / 2).contains(&labels),
        "{labels} label patches"
    );
    assert_eq!(pod_writes(&counts, &controller), labels);
    assert_eq!(counts.get(SCHEDULER_USER, "update", claim), PODS);
    assert_eq!(
        counts.get(SCHEDULER_USER, "update", &format!("{claim}/status")),
        PODS
    );
    assert_eq!(counts.get(SCHEDULER_USER, "patch", "pods"), PODS);
    assert_eq!(
        counts.get(SCHEDULER_USER, "create", "events.k8s.io/events"),
        PODS
    );
    assert_eq!(counts.writes_of(SCHEDULER_USER), 4 * PODS);
    assert_eq!(counts.writes() - counts.writes_of(&controller), 6 * PODS);
}
