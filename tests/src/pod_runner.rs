//! The part of a kubelet that runs pods, for [`FakeApi`]: the pods bound to one node run as
//! local child processes, their status is written as the kubelet writes it, crashed
//! containers are restarted with the kubelet's back-off, and deleted pods are stopped and
//! then deleted with grace 0. Test code only (kerf's MPS control-daemon pods run under it).
//!
//! Upstream (kubernetes/kubernetes), each imitated in the module that names it:
//! - `pkg/kubelet/config` and `pkg/kubelet/kubelet.go`, `syncLoopIteration`: the kubelet
//!   watches the pods whose `spec.nodeName` is its node, in every namespace (here: a kube
//!   watcher with that field selector);
//! - `pkg/kubelet/pod_workers.go`, `pkg/kubelet/kuberuntime/kuberuntime_manager.go`
//!   (`computePodActions`, `SyncPod`, `doBackOff`): `worker`, `container`;
//! - `pkg/kubelet/kuberuntime/kuberuntime_container.go` (`killContainer`): `container`;
//! - `pkg/kubelet/status/status_manager.go` (status writes, the final delete): `worker`,
//!   `status`;
//! - `pkg/registry/core/pod/strategy.go` (`CheckGracefulDelete`), on the API side:
//!   `fake_api::pod_deletion`, which [`PodRunner::start`] turns on for its node.
//!
//! Only `restartPolicy: Always` is run (every pod is treated so); init containers, probes,
//! images, namespaces and cgroups are not emulated (see `plan`, `container`).
//!
//! [`FakeApi`]: crate::fake_api::FakeApi

mod container;
mod plan;
mod status;
mod worker;

pub use plan::UnemulatedMount;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::{WatchStreamExt as _, watcher};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::fake_api::FakeApi;
use worker::{Context, PodUpdate};

/// How the pod runner behaves; [`Default`] is the kubelet's.
#[derive(Debug, Clone)]
pub struct PodRunnerSettings {
    /// The first crash-loop back-off (`pkg/kubelet/kubelet.go`, `backOffPeriod`: 10 s).
    pub initial_backoff: Duration,
    /// The longest back-off (`MaxContainerBackOff`: 300 s).
    pub max_backoff: Duration,
    /// The shortest grace period a container gets when it is killed
    /// (`minimumGracePeriodInSeconds`: 2 s).
    pub minimum_grace_period: Duration,
    /// How often a pod whose hostPath check failed is checked again.
    pub volume_retry: Duration,
    /// Where container logs go: `<log_dir>/<namespace>_<pod>_<uid>/<container>/<n>.log`, the
    /// layout of the kubelet's `/var/log/pods`.
    pub log_dir: PathBuf,
}

impl Default for PodRunnerSettings {
    fn default() -> Self {
        Self {
            initial_backoff: Duration::from_secs(10),
            max_backoff: Duration::from_secs(300),
            minimum_grace_period: Duration::from_secs(2),
            volume_retry: Duration::from_secs(1),
            // Apart per runner: FakeApi's UIDs repeat between fakes, and logs are per UID.
            log_dir: std::env::temp_dir().join(format!(
                "kerf-pod-runner-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos()
            )),
        }
    }
}

/// What the runner knows of one pod, for its accessors.
#[derive(Debug)]
pub(crate) struct PodRecord {
    uid: String,
    /// In the pod's order.
    containers: Vec<(String, ContainerRecord)>,
}

impl PodRecord {
    fn container(&self, name: &str) -> Option<&ContainerRecord> {
        self.containers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c)
    }
}

#[derive(Debug, Default)]
pub(crate) struct ContainerRecord {
    pid: Option<u32>,
    log: Option<PathBuf>,
}

/// State the workers share with [`PodRunner`].
#[derive(Debug, Default)]
pub(crate) struct RunnerState {
    pods: BTreeMap<(String, String), PodRecord>,
    unemulated: Vec<UnemulatedMount>,
    problems: Vec<String>,
}

/// Runs the pods bound to one node as local processes until stopped or dropped; see the
/// module documentation.
#[derive(Debug)]
pub struct PodRunner {
    inner: Arc<Mutex<RunnerState>>,
    task: Option<JoinHandle<()>>,
}

impl PodRunner {
    /// Starts running the pods of `node`: each container's `command[0]` is looked up in
    /// `programs` (the path in the image → a local program, e.g.
    /// `/usr/local/bin/kerf-kubelet-plugin` → the `kerf-test-plugin` binary). Also makes
    /// `api` delete the node's pods gracefully ([`FakeApi::graceful_pod_deletion_on`]).
    ///
    /// Must be called inside a Tokio runtime.
    pub fn start(
        api: &FakeApi,
        node: &str,
        programs: BTreeMap<String, PathBuf>,
        settings: PodRunnerSettings,
    ) -> Self {
        api.graceful_pod_deletion_on(node);
        let inner = Arc::new(Mutex::new(RunnerState::default()));
        let ctx = Arc::new(Context {
            client: api.client(),
            programs,
            settings,
            inner: Arc::clone(&inner),
        });
        let task = tokio::spawn(watch_pods(ctx, node.to_owned()));
        Self {
            inner,
            task: Some(task),
        }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, RunnerState> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The process of the pod's first container, while it runs (the container's PID 1).
    pub fn pid(&self, namespace: &str, name: &str) -> Option<u32> {
        let inner = self.inner();
        let record = inner.pods.get(&(namespace.to_owned(), name.to_owned()))?;
        record.containers.first()?.1.pid
    }

    /// The process of the named container of the pod, while it runs.
    pub fn container_pid(&self, namespace: &str, name: &str, container: &str) -> Option<u32> {
        let inner = self.inner();
        let record = inner.pods.get(&(namespace.to_owned(), name.to_owned()))?;
        record.container(container)?.pid
    }

    /// The UID of the pod the runner runs (or last ran) under this name.
    pub fn uid(&self, namespace: &str, name: &str) -> Option<String> {
        let inner = self.inner();
        Some(
            inner
                .pods
                .get(&(namespace.to_owned(), name.to_owned()))?
                .uid
                .clone(),
        )
    }

    /// The log file of the container's latest instance (stdout and stderr).
    pub fn log_path(&self, namespace: &str, name: &str, container: &str) -> Option<PathBuf> {
        let inner = self.inner();
        let record = inner.pods.get(&(namespace.to_owned(), name.to_owned()))?;
        record.container(container)?.log.clone()
    }

    /// The latest log of every container of the pod, headed by the container's name: for
    /// test diagnostics.
    pub fn logs(&self, namespace: &str, name: &str) -> String {
        let paths: Vec<(String, Option<PathBuf>)> = {
            let inner = self.inner();
            let Some(record) = inner.pods.get(&(namespace.to_owned(), name.to_owned())) else {
                return format!("pod runner: no pod {namespace}/{name}\n");
            };
            record
                .containers
                .iter()
                .map(|(container, record)| (container.clone(), record.log.clone()))
                .collect()
        };
        let mut out = String::new();
        for (container, path) in paths {
            let text = match &path {
                Some(path) => std::fs::read_to_string(path)
                    .unwrap_or_else(|e| format!("(cannot read {}: {e})\n", path.display())),
                None => "(never started)\n".to_owned(),
            };
            let _ = write!(out, "--- {namespace}/{name} {container}\n{text}");
        }
        out
    }

    /// Every mount the runner could not emulate (its mount path differs from its host path),
    /// in the order the pods were seen.
    pub fn unemulated_mounts(&self) -> Vec<UnemulatedMount> {
        self.inner().unemulated.clone()
    }

    /// Failures of the runner's own API writes (status writes, deletes), which a real
    /// kubelet would retry and log.
    pub fn problems(&self) -> Vec<String> {
        self.inner().problems.clone()
    }

    /// Stops running pods: every container's processes are killed at once (SIGKILL, no grace)
    /// and nothing more is written to the API.
    pub async fn stop(mut self) {
        self.kill_everything();
        if let Some(task) = self.task.take() {
            // Aborted on purpose: the error says only that.
            let _ = task.await;
        }
    }

    fn kill_everything(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
        let inner = self.inner();
        for record in inner.pods.values() {
            for pid in record.containers.iter().filter_map(|(_, c)| c.pid) {
                container::kill_group(pid);
            }
        }
    }
}

impl Drop for PodRunner {
    fn drop(&mut self) {
        self.kill_everything();
    }
}

/// The kubelet's pod source: every pod bound to `node`, one worker per UID.
async fn watch_pods(ctx: Arc<Context>, node: String) {
    let api = Api::<Pod>::all(ctx.client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut pods = std::pin::pin!(watcher(api, config).default_backoff());
    let mut workers: HashMap<String, watch::Sender<PodUpdate>> = HashMap::new();
    let mut listed: Option<HashSet<String>> = None;
    let mut tasks = JoinSet::new();
    loop {
        let event = tokio::select! {
            event = pods.next() => event,
            Some(_) = tasks.join_next() => continue,
        };
        match event {
            Some(Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod))) => {
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                if let Some(listed) = &mut listed {
                    listed.insert(uid.clone());
                }
                if let Some(sender) = workers.get(&uid) {
                    sender.send_replace((pod, false));
                } else {
                    let (sender, updates) = watch::channel((pod, false));
                    workers.insert(uid, sender);
                    tasks.spawn(worker::run_pod(Arc::clone(&ctx), updates));
                }
            }
            Some(Ok(watcher::Event::Delete(pod))) => {
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                if let Some(sender) = workers.remove(&uid) {
                    sender.send_replace((pod, true));
                }
            }
            Some(Ok(watcher::Event::Init)) => listed = Some(HashSet::new()),
            Some(Ok(watcher::Event::InitDone)) => {
                // A relist that misses a pod means it was deleted meanwhile.
                let seen = listed.take().unwrap_or_default();
                workers.retain(|uid, sender| {
                    let keep = seen.contains(uid);
                    if !keep {
                        sender.send_modify(|(_, gone)| *gone = true);
                    }
                    keep
                });
            }
            Some(Err(error)) => tracing::warn!(%error, "pod runner: watching pods"),
            None => return,
        }
    }
}
