//! The sim's background tasks: one kubelet-plugin publisher per node, kerf-controller, and a
//! watch that notes when each pod is first seen bound.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt as _};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::cluster::NodeSpec;
use super::{DRIVER, SimConfig, SimError, check};

/// The first time each pod (`namespace/name`) was seen with `spec.nodeName`, from a watch.
#[derive(Debug, Clone, Default)]
pub struct BindTimes(Arc<Mutex<HashMap<String, Instant>>>);

impl BindTimes {
    /// When pod `namespace/name` was first seen bound.
    pub fn get(&self, pod: &str) -> Option<Instant> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(pod)
            .copied()
    }

    /// How many pods were seen bound.
    pub fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// True when no pod was seen bound.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn record(&self, pod: &Pod) {
        if check::pod_node(pod).is_some() {
            let key = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(key)
                .or_insert_with(Instant::now);
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
        if let Err(error) = kerf_controller::run(config, client, shutdown).await {
            eprintln!("sim: kerf-controller stopped: {error}");
        }
    })
}

pub(super) fn spawn_bind_watch(
    client: &Client,
    times: BindTimes,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let pods = watcher(Api::<Pod>::all(client.clone()), watcher::Config::default());
    tokio::spawn(async move {
        let mut pods = std::pin::pin!(pods);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                event = pods.next() => match event {
                    Some(Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod))) => times.record(&pod),
                    Some(_) => {}
                    None => return,
                },
            }
        }
    })
}
