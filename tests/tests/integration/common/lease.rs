//! The Lease fixtures of the leader-election tests (`leader.rs`, `outage.rs`): short timings,
//! the Lease's holder, and leadership awaited within a guard.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kerf_controller::{Config, ControllerConfig, LeaderElector, LeaseConfig};
use kerf_tests::fake_api::FakeApi;

pub const NAMESPACE: &str = "kerf-system";
pub const LEASE: &str = "kerf-controller";
pub const GUARD: Duration = Duration::from_secs(30);

/// A Lease of 4 s, renewed within 2 s, retried every second.
pub fn lease_config(identity: &str) -> LeaseConfig {
    LeaseConfig {
        lease_duration: Duration::from_secs(4),
        renew_deadline: Duration::from_secs(2),
        retry_period: Duration::from_secs(1),
        ..LeaseConfig::new(LEASE, NAMESPACE, identity)
    }
}

/// Who holds the Lease, as stored.
pub fn holder(fake: &FakeApi) -> Option<String> {
    fake.get_resource::<Lease>(Some(NAMESPACE), LEASE)?
        .spec?
        .holder_identity
}

/// Waits for `elector` to lead, failing the test after [`GUARD`].
pub async fn acquire(elector: &mut LeaderElector) {
    tokio::time::timeout(GUARD, elector.acquired())
        .await
        .expect("leadership within the guard")
        .unwrap();
}

/// A replica's configuration: leader election with [`lease_config`] as `identity`, no metrics.
pub fn replica_config(identity: &str) -> Config {
    Config {
        controller: ControllerConfig::new("gpu.kerf.dev"),
        leader_election: Some(lease_config(identity)),
        metrics_address: None,
    }
}
