//! kerf-controller in a test, as its ServiceAccount (`Identity::kerf_controller`): the whole
//! process ([`RunningController`]), or one controller context over watched caches
//! ([`Watched`]) for the tests that call a reconciler or run one controller on it
//! ([`ClaimController`]), with the metrics the context counts in.

use std::sync::Arc;
use std::time::Duration;

use kerf_controller::cache::Caches;
use kerf_controller::{Config, Context, ControllerConfig, Metrics, Process, claims};
use kerf_tests::fake_api::{FakeApi, Identity};
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::claim_cluster::mirror_ownership_records;

/// A controller context over `fake` whose caches are filled, and the registry of its metrics.
pub struct Watched {
    pub context: Context,
    pub registry: Registry,
}

impl Watched {
    /// Starts the caches as kerf-controller's ServiceAccount and waits until they are ready.
    pub async fn start(fake: &FakeApi, config: ControllerConfig) -> Self {
        let client = fake.client_as(Identity::kerf_controller());
        let (caches, fill) = Caches::start(&client, &config.driver_name);
        tokio::spawn(fill);
        caches.wait_ready().await.unwrap();
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        Self {
            context: Context::new(client, config, metrics, caches),
            registry,
        }
    }
}

/// The registry's metrics in the Prometheus text format.
pub fn metrics_text(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text
}

/// The value of one series (`name{labels}` as the text format writes it), if it is there.
pub fn metric(registry: &Registry, series: &str) -> Option<u64> {
    metrics_text(registry)
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map(|n| n.parse().unwrap())
}

/// The claim controller (`claims::run`) on a context the test holds, with each node's kubelet
/// plugin mirroring the ownership records ([`mirror_ownership_records`]).
pub struct ClaimController {
    shutdown: CancellationToken,
    task: JoinHandle<kerf_controller::Result<()>>,
}

impl ClaimController {
    /// Spawns it on the test's runtime.
    pub fn start(fake: &FakeApi, context: Arc<Context>) -> Self {
        let shutdown = CancellationToken::new();
        tokio::spawn(mirror_ownership_records(fake.clone(), shutdown.clone()));
        let task = tokio::spawn(claims::run(context, shutdown.clone()));
        Self { shutdown, task }
    }

    /// Stops it and checks that it stops cleanly within 20 s.
    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("the claim controller stops on shutdown")
            .expect("the claim controller does not panic")
            .expect("the claim controller stops without an error");
    }
}

/// The whole controller process ([`Process::run`], no leader election, no metrics
/// listener) against `fake`, for driver `gpu.kerf.dev`.
pub struct RunningController {
    shutdown: CancellationToken,
    task: JoinHandle<kerf_controller::Result<()>>,
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
        let client = fake.client_as(Identity::kerf_controller());
        let task = tokio::spawn(Process::new(config, client, shutdown.clone()).run());
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
