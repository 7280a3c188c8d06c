//! Leader election against the in-memory API server: one leader at a time, takeover when the
//! leader stops renewing, step-down when renewals fail, and controllers that run only while
//! their replica leads.
//!
//! Lease timing here is the shortest the Lease API allows (whole seconds), so these tests take
//! a few seconds each; the bounds they wait with are generous failure guards, not measurements.
#![allow(
    clippy::needless_pass_by_value,
    reason = "fixtures take JSON values as the tests write them inline"
)]

use crate::common::lease;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kerf_controller::{ControllerTask, LeaderElector, Process};
use kerf_tests::fake_api::{FakeApi, Identity};
use kerf_tests::wait::until;
use lease::{GUARD, LEASE, NAMESPACE, acquire, holder, lease_config, replica_config};
use tokio_util::sync::CancellationToken;

const LEASE_PATH: &str =
    "/apis/coordination.k8s.io/v1/namespaces/kerf-system/leases/kerf-controller";

#[tokio::test]
async fn one_leader_and_a_standby_that_takes_over_when_renewals_stop() {
    let fake = FakeApi::new();
    let mut a = LeaderElector::start(
        fake.client_as(Identity::kerf_controller()),
        lease_config("a"),
    )
    .await
    .unwrap();
    acquire(&mut a).await;
    assert!(a.is_leader());
    assert_eq!(holder(&fake).as_deref(), Some("a"));

    let mut b = LeaderElector::start(
        fake.client_as(Identity::kerf_controller()),
        lease_config("b"),
    )
    .await
    .unwrap();
    // For longer than a Lease duration the leader keeps renewing and the standby waits.
    let waited = tokio::time::timeout(Duration::from_secs(6), b.acquired()).await;
    assert!(
        waited.is_err(),
        "the standby must not lead while the leader renews"
    );
    assert!(!b.is_leader());
    assert_eq!(holder(&fake).as_deref(), Some("a"));

    // The leader stops renewing without releasing, as a crashed process would.
    a.abandon();
    acquire(&mut b).await;
    assert_eq!(holder(&fake).as_deref(), Some("b"));
    b.release().await.unwrap();
    assert_eq!(holder(&fake), None, "a released Lease has no holder");
}

#[tokio::test]
async fn a_leader_whose_renewals_fail_steps_down_before_a_standby_takes_over() {
    let fake = FakeApi::new();
    let mut a = LeaderElector::start(
        fake.client_as(Identity::kerf_controller()),
        lease_config("a"),
    )
    .await
    .unwrap();
    acquire(&mut a).await;
    let mut b = LeaderElector::start(
        fake.client_as(Identity::kerf_controller()),
        lease_config("b"),
    )
    .await
    .unwrap();
    let b_acquired = tokio::spawn(async move {
        acquire(&mut b).await;
        (tokio::time::Instant::now(), b)
    });

    // Renewals fail from now on (the standby does not write until the Lease expires).
    fake.fail_next("patch", LEASE_PATH, 503, 3);
    let reason = tokio::time::timeout(GUARD, a.lost()).await.unwrap();
    let a_stopped = tokio::time::Instant::now();
    assert!(reason.contains("not renewed"), "{reason}");
    a.abandon();

    let (b_started, b) = tokio::time::timeout(GUARD, b_acquired)
        .await
        .unwrap()
        .unwrap();
    assert!(
        a_stopped < b_started,
        "the old leader stops before the new one starts"
    );
    assert_eq!(holder(&fake).as_deref(), Some("b"));
    b.release().await.unwrap();
}

#[tokio::test]
async fn only_the_leader_runs_controllers_and_a_standby_follows_on_shutdown() {
    let fake = FakeApi::new();
    let started: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let replica = |identity: &'static str, shutdown: CancellationToken| {
        let started = started.clone();
        let task = ControllerTask::new(
            "recorder",
            move |_ctx, stop: CancellationToken| async move {
                started.lock().unwrap().push(identity);
                stop.cancelled().await;
                Ok(())
            },
        );
        let config = replica_config(identity);
        let client = fake.client_as(Identity::kerf_controller());
        let process = Process {
            controllers: vec![task],
            ..Process::new(config, client, shutdown)
        };
        tokio::spawn(process.run())
    };
    let stop_a = CancellationToken::new();
    let stop_b = CancellationToken::new();
    let a = replica("a", stop_a.clone());
    until("one started controller", GUARD, || {
        started.lock().unwrap().len() == 1
    })
    .await;
    let b = replica("b", stop_b.clone());
    // B waits longer than a Lease duration without starting its controllers.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(*started.lock().unwrap(), ["a"]);

    // A shuts down and releases the Lease: B leads without waiting for it to expire.
    stop_a.cancel();
    tokio::time::timeout(GUARD, a)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    until("two started controllers", GUARD, || {
        started.lock().unwrap().len() == 2
    })
    .await;
    assert_eq!(*started.lock().unwrap(), ["a", "b"]);
    assert_eq!(holder(&fake).as_deref(), Some("b"));

    stop_b.cancel();
    tokio::time::timeout(GUARD, b)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(holder(&fake), None);
}

#[tokio::test]
async fn losing_the_lease_stops_the_controllers_and_ends_the_run() {
    let fake = FakeApi::new();
    let stopped = Arc::new(Mutex::new(false));
    let task = {
        let stopped = stopped.clone();
        ControllerTask::new(
            "recorder",
            move |_ctx, stop: CancellationToken| async move {
                stop.cancelled().await;
                *stopped.lock().unwrap() = true;
                Ok(())
            },
        )
    };
    let config = replica_config("a");
    let client = fake.client_as(Identity::kerf_controller());
    let process = Process {
        controllers: vec![task],
        ..Process::new(config, client, CancellationToken::new())
    };
    let run = tokio::spawn(process.run());
    until("a holds the Lease", GUARD, || {
        holder(&fake).as_deref() == Some("a")
    })
    .await;
    // Another replica takes the Lease behind this one's back.
    let mut lease: Lease = fake.get_resource(Some(NAMESPACE), LEASE).unwrap();
    lease.spec.as_mut().unwrap().holder_identity = Some("intruder".to_owned());
    fake.insert_resource(&lease);

    let error = tokio::time::timeout(GUARD, run)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert_eq!(error.reason(), "leadership_lost");
    assert!(*stopped.lock().unwrap(), "the controllers were stopped");
    assert_eq!(
        holder(&fake).as_deref(),
        Some("intruder"),
        "a replica that lost does not release"
    );
}
