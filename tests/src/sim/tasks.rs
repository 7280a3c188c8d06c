//! The sim's background tasks: one kubelet-plugin publisher per node, kerf-controller, and a
//! watch of the pods ([`PodWatch`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt as _};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::cluster::NodeSpec;
use super::{DRIVER, SimConfig, SimError, check};

/// What a watch of every pod tells: when each pod was first seen bound, and which pods wait
/// for a scheduler (kube-scheduler's active queue: no node, no scheduling gate, not deleted,
/// not finished).
#[derive(Debug, Clone, Default)]
pub struct PodWatch(Arc<PodWatchState>);

#[derive(Debug, Default)]
struct PodWatchState {
    bound: Mutex<HashMap<String, Instant>>,
    ungated: Mutex<HashMap<String, Instant>>,
    waiting: Mutex<HashSet<String>>,
    changed: Notify,
}

impl PodWatch {
    /// When pod `namespace/name` was first seen bound.
    pub fn bound_at(&self, pod: &str) -> Option<Instant> {
        self.0
            .bound
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(pod)
            .copied()
    }

    /// When pod `namespace/name` was first seen without scheduling gates (for a pod created
    /// with kerf's gate: when kerf-controller removed it).
    pub fn ungated_at(&self, pod: &str) -> Option<Instant> {
        self.0
            .ungated
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(pod)
            .copied()
    }

    /// How many pods were seen bound.
    pub fn bound(&self) -> usize {
        self.0
            .bound
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// How many pods wait for a scheduler now.
    pub fn waiting(&self) -> usize {
        self.0
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Returns once a pod started waiting for a scheduler since the last call (at once if
    /// one did meanwhile).
    pub async fn waiting_changed(&self) {
        self.0.changed.notified().await;
    }

    fn record(&self, pod: &Pod, deleted: bool) {
        let key = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
        if !deleted && check::pod_node(pod).is_some() {
            self.0
                .bound
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(key.clone())
                .or_insert_with(Instant::now);
        }
        if !deleted && !check::is_gated(pod) {
            self.0
                .ungated
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(key.clone())
                .or_insert_with(Instant::now);
        }
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let waits = !deleted
            && check::pod_node(pod).is_none()
            && !check::is_gated(pod)
            && pod.metadata.deletion_timestamp.is_none()
            && !matches!(phase, Some("Succeeded" | "Failed"));
        let mut waiting = self
            .0
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if waits {
            if waiting.insert(key) {
                self.0.changed.notify_one();
            }
        } else {
            waiting.remove(&key);
        }
    }
}

pub(super) fn spawn_publisher(
    client: &Client,
    node: &NodeSpec,
    config: &SimConfig,
    shutdown: CancellationToken,
) -> Result<JoinHandle<()>, SimError> {
    let inventory = Arc::new(node.inventory()?);
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = kerf_kubelet_plugin::metrics::Metrics::new(&mut registry);
    let publisher = kerf_kubelet_plugin::publish::Publisher::new(
        client.clone(),
        DRIVER.to_owned(),
        node.name.clone(),
        metrics,
    )
    .with_debounce(config.publisher_debounce)
    .with_retry_backoff(Duration::from_millis(10), Duration::from_millis(200));
    let name = node.name.clone();
    Ok(tokio::spawn(async move {
        if let Err(error) = publisher
            .run(inventory, Duration::from_secs(60), shutdown)
            .await
        {
            eprintln!("sim: publisher of {name} stopped: {error}");
        }
    }))
}

pub(super) fn spawn_controller(
    client: &Client,
    config: &SimConfig,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let config = kerf_controller::Config {
        controller: config.controller.clone(),
        leader_election: None,
        metrics_address: None,
    };
    let client = client.clone();
    tokio::spawn(async move {
        let process = kerf_controller::Process::new(config, client, shutdown);
        if let Err(error) = process.run().await {
            eprintln!("sim: kerf-controller stopped: {error}");
        }
    })
}

pub(super) fn spawn_pod_watch(
    client: &Client,
    times: PodWatch,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let pods = watcher(Api::<Pod>::all(client.clone()), watcher::Config::default());
    tokio::spawn(async move {
        let mut pods = std::pin::pin!(pods);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                event = pods.next() => match event {
                    Some(Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod))) => times.record(&pod, false),
                    Some(Ok(watcher::Event::Delete(pod))) => times.record(&pod, true),
                    Some(_) => {}
                    None => return,
                },
            }
        }
    })
}
