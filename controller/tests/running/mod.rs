//! The whole controller process in a test, as `kerf-controller` runs it without leader
//! election.

use std::time::Duration;

use kerf_controller::{Config, ControllerConfig};
use kerf_tests::fake_api::{FakeApi, Identity};
use tokio_util::sync::CancellationToken;

/// The whole controller process (`kerf_controller::run`, no leader election, no metrics
/// listener) against `fake`, for driver `gpu.kerf.dev`.
pub struct RunningController {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<kerf_controller::Result<()>>,
}

impl RunningController {
    /// Spawns it on the test's runtime.
    pub fn start(fake: &FakeApi) -> Self {
        let shutdown = CancellationToken::new();
        let config = Config {
            controller: ControllerConfig::new("gpu.kerf.dev"),
            leader_election: None,
            metrics_address: None,
        };
        let task = tokio::spawn(kerf_controller::run(
            config,
            fake.client_as(Identity::kerf_controller()),
            shutdown.clone(),
        ));
        RunningController { shutdown, task }
    }

    /// Stops it and checks that it stops cleanly within 20 s.
    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("run stops on shutdown")
            .expect("the controller task does not panic")
            .expect("the controller stops without an error");
    }
}
