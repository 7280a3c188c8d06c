//! Recovery after an API server outage, against the in-memory API server with an injected
//! outage ([`FakeApi::set_outage`]): a leader facing a frozen server steps down at its renew
//! deadline instead of when the server answers again, a replica (re)started during an outage
//! waits in-process instead of exiting, and a standby takes the Lease within a few retry
//! periods of the server's return instead of after kube-lease-manager's grown back-off.
//!
//! The controller's watches retry at least every 5 s through an outage, so its caches catch
//! up within seconds of the server's return rather than after kube-runtime's grown back-off.
//!
//! Lease timing is the shortest the Lease API allows (4 s / 2 s / 1 s); the bounds are
//! generous guards on causes (a wait that would otherwise last until the server answers, or
//! up to kube-lease-manager's or kube-runtime's 30 s back-off), not speed measurements.

use crate::common::lease;

use std::time::Duration;

use crate::common::controller::RunningController;
use kerf_api::watch_backoff::MAX_DELAY;
use kerf_controller::{ControllerTask, Error, LeaderElector, Process};
use kerf_tests::fake_api::{FakeApi, Identity, Outage};
use lease::{GUARD, acquire, holder, lease_config, replica_config};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn a_leader_facing_a_frozen_api_server_steps_down_at_its_renew_deadline() {
    let fake = FakeApi::new();
    let mut a = LeaderElector::start(
        fake.client_as(Identity::kerf_controller()),
        lease_config("a"),
    )
    .await
    .unwrap();
    acquire(&mut a).await;
    fake.set_outage(Some(Outage::Frozen));
    let frozen = Instant::now();
    // The server stays frozen for the whole guard: a leader whose Lease reads wait for the
    // answer would only notice when it comes.
    let reason = tokio::time::timeout(GUARD, a.lost())
        .await
        .expect("the leader steps down while the server is still frozen");
    assert!(reason.contains("not renewed"), "{reason}");
    let waited = frozen.elapsed();
    assert!(
        waited < Duration::from_secs(10),
        "stepped down {waited:?} into the outage; the renew deadline is 2 s"
    );
    a.abandon();
    fake.set_outage(None);
}

#[tokio::test]
async fn a_replica_started_during_an_outage_waits_for_the_server_instead_of_exiting() {
    let fake = FakeApi::new();
    fake.set_outage(Some(Outage::Unavailable));
    let shutdown = CancellationToken::new();
    let (started, mut started_rx) = tokio::sync::mpsc::unbounded_channel();
    let task = ControllerTask::new("recorder", move |_ctx, stop: CancellationToken| {
        let started = started.clone();
        async move {
            let _ = started.send(());
            stop.cancelled().await;
            Ok(())
        }
    });
    let config = replica_config("a");
    let replica = tokio::spawn(
        Process {
            controllers: vec![task],
            ..Process::new(
                config,
                fake.client_as(Identity::kerf_controller()),
                shutdown.clone(),
            )
        }
        .run(),
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        !replica.is_finished(),
        "the replica must keep trying, not exit into the kubelet's crash-loop back-off"
    );
    fake.set_outage(None);
    let back = Instant::now();
    tokio::time::timeout(GUARD, started_rx.recv())
        .await
        .expect("the controllers start once the server is back")
        .unwrap();
    let waited = back.elapsed();
    assert!(
        waited < Duration::from_secs(10),
        "the controllers started {waited:?} after the server came back"
    );
    shutdown.cancel();
    let result = tokio::time::timeout(GUARD, replica).await.unwrap().unwrap();
    assert!(
        !matches!(result, Err(Error::LeadershipLost(_))),
        "{result:?}"
    );
}

#[tokio::test]
async fn a_standby_takes_the_lease_within_a_few_retry_periods_of_the_servers_return() {
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
    // The leader goes away with the server, as a leader that lost its Lease and exits does;
    // during the outage the standby's Lease reads fail and kube-lease-manager's back-off grows
    // (1 s doubling towards 30 s, reset only by a success).
    fake.set_outage(Some(Outage::Unavailable));
    a.abandon();
    let b_acquired = tokio::spawn(async move {
        acquire(&mut b).await;
        (Instant::now(), b)
    });
    tokio::time::sleep(Duration::from_secs(20)).await;
    fake.set_outage(None);
    let back = Instant::now();
    let (acquired_at, b) = tokio::time::timeout(GUARD, b_acquired)
        .await
        .expect("the standby leads within the guard")
        .unwrap();
    let waited = acquired_at.saturating_duration_since(back);
    // The Lease expired long ago; the standby checks it every retry period (1 s) and starts
    // competing afresh after 2 × 1 s + 1 s of seeing it free.
    assert!(
        waited < Duration::from_secs(8),
        "the standby took the Lease {waited:?} after the server came back"
    );
    assert_eq!(holder(&fake).as_deref(), Some("b"));
    b.release().await.unwrap();
}

/// The longest wait between two list or watch requests of the controller's Node watch
/// (`claims/watch.rs`, the only one on Nodes) from `since` until `until`, counting the wait
/// from the last request to `until`.
fn longest_wait_between_node_watch_requests(
    fake: &FakeApi,
    since: Instant,
    until: Instant,
) -> Duration {
    let mut times: Vec<Instant> = fake
        .requests()
        .iter()
        .filter(|r| r.path == "/api/v1/nodes" && matches!(r.verb, "list" | "watch"))
        .map(|r| r.at)
        .filter(|at| (since..=until).contains(at))
        .collect();
    times.sort();
    times.push(until);
    times
        .iter()
        .scan(since, |previous, &at| {
            let wait = at.saturating_duration_since(*previous);
            *previous = at;
            Some(wait)
        })
        .max()
        .unwrap_or_default()
}

#[tokio::test]
async fn the_controllers_watches_retry_at_least_every_five_seconds_through_an_outage() {
    const OUTAGE: Duration = Duration::from_secs(20);
    let fake = FakeApi::new();
    let running = RunningController::start(&fake);
    kerf_tests::wait::eventually("the controller's Node watch", GUARD, || async {
        (fake.count("watch", "/api/v1/nodes") > 0).then_some(())
    })
    .await;
    // Every failed attempt grows the back-off; kube-runtime's default would by the end of
    // this outage wait 12.8 s or more between attempts (800 ms doubling, with jitter, to 30 s)
    // and so re-list up to that long after the server's return.
    fake.set_outage(Some(Outage::Unavailable));
    let down = Instant::now();
    tokio::time::sleep(OUTAGE).await;
    fake.set_outage(None);
    let slack = Duration::from_millis(1500);
    tokio::time::sleep(MAX_DELAY + slack).await;
    let longest = longest_wait_between_node_watch_requests(&fake, down, Instant::now());
    assert!(
        longest <= MAX_DELAY + slack,
        "the Node watch waited {longest:?} between two attempts during a {OUTAGE:?} outage \
         and the {:?} after it",
        MAX_DELAY + slack
    );
    running.stop().await;
}
