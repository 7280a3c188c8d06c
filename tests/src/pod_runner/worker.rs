//! One pod's worker: sets up its volumes, runs its containers ([`ContainerTask`]), writes its
//! status, and when the pod is deleted kills the containers and deletes the pod with grace 0.
//!
//! Upstream (kubernetes/kubernetes):
//! - `pkg/kubelet/pod_workers.go` (one worker per pod UID) and
//!   `pkg/kubelet/kuberuntime/kuberuntime_manager.go`, `SyncPod` (volumes first, then each
//!   container that `computePodActions` says to start);
//! - `pkg/kubelet/status/status_manager.go`, `syncPod`: each change of the status is written
//!   to `pods/<name>/status` (a patch, `PatchPodStatus`); once a pod marked for deletion has
//!   no container left (`canBeDeleted`) it is deleted with `gracePeriodSeconds: 0` and a UID
//!   precondition, so that a new pod of the same name is never deleted instead;
//! - `pkg/kubelet/kuberuntime/kuberuntime_container.go`, `killContainer`: the grace period.
//!
//! The kubelet writes as `system:node:<node>`, which the Node authorizer allows; FakeApi has
//! no Node authorizer, so the runner writes as the cluster admin ([`FakeApi::client`]).
//!
//! [`FakeApi::client`]: crate::fake_api::FakeApi::client

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use super::container::{Backoff, ContainerEvent, ContainerTask, Exit};
use super::plan::{PodPlan, Waiting, plan_pod};
use super::status::{ContainerView, State, is_ready, merge_diff, pod_status};
use super::{PodRunnerSettings, RunnerState};

/// What every worker shares.
pub(super) struct Context {
    pub(super) client: kube::Client,
    pub(super) programs: BTreeMap<String, PathBuf>,
    pub(super) settings: PodRunnerSettings,
    pub(super) inner: Arc<Mutex<RunnerState>>,
}

impl Context {
    pub(super) fn inner(&self) -> std::sync::MutexGuard<'_, RunnerState> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The latest pod the watch saw, and whether it is gone from the API.
pub(super) type PodUpdate = (Pod, bool);

struct Worker {
    ctx: Arc<Context>,
    updates: watch::Receiver<PodUpdate>,
    pod: Pod,
    gone: bool,
    namespace: String,
    name: String,
    uid: String,
    views: Vec<ContainerView>,
    written: Value,
    start_time: Timestamp,
    ready_since: Timestamp,
    terminating: bool,
    /// When a failed status write is tried again.
    retry: Option<tokio::time::Instant>,
}

/// Runs the pod in `updates` until it is deleted.
pub(super) async fn run_pod(ctx: Arc<Context>, updates: watch::Receiver<PodUpdate>) {
    let (pod, gone) = updates.borrow().clone();
    let now = Timestamp::now();
    let mut worker = Worker {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        ctx,
        updates,
        pod,
        gone,
        views: Vec::new(),
        written: Value::Null,
        start_time: now,
        ready_since: now,
        terminating: false,
        retry: None,
    };
    worker.run().await;
}

impl Worker {
    fn label(&self) -> String {
        format!("{}_{}({})", self.name, self.namespace, self.uid)
    }

    fn deleting(&self) -> bool {
        self.gone || self.pod.metadata.deletion_timestamp.is_some()
    }

    async fn run(&mut self) {
        let plan = plan_pod(&self.pod, &self.ctx.programs);
        self.register(&plan);
        let creating = Waiting {
            reason: "ContainerCreating",
            message: String::new(),
        };
        self.views = plan
            .containers
            .iter()
            .map(|c| {
                let waiting = plan.refused.clone().unwrap_or_else(|| creating.clone());
                ContainerView::waiting(
                    &c.name,
                    &c.image,
                    &image_id(c.launch.as_ref().ok()),
                    waiting,
                )
            })
            .collect();
        self.write_status().await;
        let mut tasks = JoinSet::new();
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let (kill, _) = watch::channel(None);
        if plan.refused.is_none() && self.volumes_ready(&plan).await {
            self.launch(&plan, &mut tasks, &events_tx, &kill);
            self.write_status().await;
        }
        drop(events_tx);
        while !self.deleting() {
            tokio::select! {
                Some(event) = events.recv() => {
                    self.apply(event);
                    self.write_status().await;
                }
                changed = self.updates.changed() => self.take_update(changed.is_ok()),
                () = sleep_until(self.retry) => self.write_status().await,
            }
        }
        self.terminate(&mut tasks, &mut events, &kill).await;
    }

    fn take_update(&mut self, sent: bool) {
        if sent {
            let (pod, gone) = self.updates.borrow_and_update().clone();
            self.pod = pod;
            self.gone = gone;
        } else {
            // The runner stopped watching: nothing will delete the pod, stop its containers.
            self.gone = true;
        }
    }

    fn register(&self, plan: &PodPlan) {
        let mut inner = self.ctx.inner();
        inner.unemulated.extend(plan.unemulated.iter().cloned());
        inner.pods.insert(
            (self.namespace.clone(), self.name.clone()),
            super::PodRecord {
                uid: self.uid.clone(),
                containers: plan
                    .containers
                    .iter()
                    .map(|c| (c.name.clone(), super::ContainerRecord::default()))
                    .collect(),
            },
        );
    }

    /// Prepares the hostPath volumes, retrying a failed check until it passes or the pod is
    /// deleted (the kubelet's volume manager retries too); whether they are ready.
    async fn volumes_ready(&mut self, plan: &PodPlan) -> bool {
        loop {
            let failed = plan.host_paths.iter().find_map(|h| h.prepare().err());
            let Some(message) = failed else { return true };
            for view in &mut self.views {
                view.state = State::Waiting(Waiting {
                    reason: "ContainerCreating",
                    message: message.clone(),
                });
            }
            self.write_status().await;
            let retry = tokio::time::sleep(self.ctx.settings.volume_retry);
            tokio::select! {
                () = retry => {}
                changed = self.updates.changed() => self.take_update(changed.is_ok()),
            }
            if self.deleting() {
                return false;
            }
        }
    }

    fn launch(
        &mut self,
        plan: &PodPlan,
        tasks: &mut JoinSet<()>,
        events: &mpsc::UnboundedSender<ContainerEvent>,
        kill: &watch::Sender<Option<Duration>>,
    ) {
        let settings = &self.ctx.settings;
        let pod_dir = settings
            .log_dir
            .join(format!("{}_{}_{}", self.namespace, self.name, self.uid));
        for (index, container) in plan.containers.iter().enumerate() {
            let launch = match &container.launch {
                Ok(launch) => launch.clone(),
                Err(waiting) => {
                    self.views[index].state = State::Waiting(waiting.clone());
                    continue;
                }
            };
            let task = ContainerTask {
                index,
                name: container.name.clone(),
                pod_label: self.label(),
                pod_uid: self.uid.clone(),
                launch,
                log_dir: pod_dir.join(&container.name),
                backoff: Backoff::new(settings.initial_backoff, settings.max_backoff),
                events: events.clone(),
                kill: kill.subscribe(),
            };
            tasks.spawn(task.run());
        }
    }

    fn apply(&mut self, event: ContainerEvent) {
        match event {
            ContainerEvent::Started {
                index,
                pid,
                id,
                at,
                log,
            } => {
                self.record(index, Some(pid), Some(log));
                let view = &mut self.views[index];
                if view.id.is_some() {
                    view.restart_count += 1;
                }
                if let State::Terminated(exit) = &view.state {
                    view.last = Some(exit.clone());
                }
                view.id = Some(id);
                view.state = State::Running { started_at: at };
            }
            ContainerEvent::Exited {
                index,
                exit,
                backoff,
            } => {
                self.record(index, None, None);
                let label = self.label();
                let view = &mut self.views[index];
                if exit.id != view.id && view.id.is_some() {
                    // An instance that failed to start still counts as a restart.
                    view.restart_count += 1;
                }
                view.id.clone_from(&exit.id);
                if self.terminating {
                    view.state = State::Terminated(exit);
                    return;
                }
                view.state = match backoff {
                    Some(wait) => State::Waiting(Waiting {
                        reason: "CrashLoopBackOff",
                        message: format!(
                            "back-off {} restarting failed container={} pod={label}",
                            go_duration(wait),
                            view.name
                        ),
                    }),
                    None => State::Terminated(exit.clone()),
                };
                view.last = Some(exit);
            }
        }
    }

    /// The current process and log of container `index`, for [`super::PodRunner::pid`].
    fn record(&self, index: usize, pid: Option<u32>, log: Option<PathBuf>) {
        let name = &self.views[index].name;
        let mut inner = self.ctx.inner();
        let Some(record) = inner
            .pods
            .get_mut(&(self.namespace.clone(), self.name.clone()))
            .filter(|record| record.uid == self.uid)
        else {
            return;
        };
        if let Some((_, container)) = record.containers.iter_mut().find(|(n, _)| n == name) {
            container.pid = pid;
            if log.is_some() {
                container.log = log;
            }
        }
    }

    /// Kills the containers (SIGTERM, the grace period, SIGKILL), writes the final status and
    /// deletes the pod with grace 0.
    async fn terminate(
        &mut self,
        tasks: &mut JoinSet<()>,
        events: &mut mpsc::UnboundedReceiver<ContainerEvent>,
        kill: &watch::Sender<Option<Duration>>,
    ) {
        self.terminating = true;
        let grace = self.grace_period();
        kill.send_replace(Some(grace));
        while tasks.join_next().await.is_some() {}
        while let Ok(event) = events.try_recv() {
            self.apply(event);
        }
        for view in &mut self.views {
            if !matches!(view.state, State::Terminated(_)) {
                let exit = view
                    .last
                    .clone()
                    .unwrap_or_else(|| never_ran(view.id.clone()));
                view.state = State::Terminated(exit);
            }
        }
        if self.gone {
            return;
        }
        self.write_status().await;
        self.delete().await;
    }

    /// `killContainer`'s grace period.
    fn grace_period(&self) -> Duration {
        let seconds = self
            .pod
            .metadata
            .deletion_grace_period_seconds
            .or_else(|| self.pod.spec.as_ref()?.termination_grace_period_seconds)
            .unwrap_or(30);
        Duration::from_secs(u64::try_from(seconds).unwrap_or(0))
            .max(self.ctx.settings.minimum_grace_period)
    }

    async fn write_status(&mut self) {
        if self.gone {
            return;
        }
        let mut status = pod_status(
            &self.views,
            self.start_time,
            self.ready_since,
            self.terminating,
        );
        if is_ready(&status) != is_ready(&self.written) {
            self.ready_since = Timestamp::now();
            status = pod_status(
                &self.views,
                self.start_time,
                self.ready_since,
                self.terminating,
            );
        }
        let Some(diff) = merge_diff(&self.written, &status) else {
            self.retry = None;
            return;
        };
        let api = Api::<Pod>::namespaced(self.ctx.client.clone(), &self.namespace);
        let patch = Patch::Merge(json!({ "status": diff }));
        match api
            .patch_status(&self.name, &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => {
                self.written = status;
                self.retry = None;
            }
            Err(kube::Error::Api(status)) if status.code == 404 => self.gone = true,
            Err(error) => {
                self.problem(format!("status write of {} failed: {error}", self.label()));
                self.retry = Some(tokio::time::Instant::now() + Duration::from_secs(1));
            }
        }
    }

    /// The status manager's final delete: grace 0, on this pod's UID only.
    async fn delete(&mut self) {
        let api = Api::<Pod>::namespaced(self.ctx.client.clone(), &self.namespace);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(self.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        for _ in 0..10 {
            match api.delete(&self.name, &params).await {
                Ok(_) => return,
                // Gone already, or replaced by a pod of the same name: nothing of ours left.
                Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => return,
                Err(error) => {
                    self.problem(format!("deleting {} failed: {error}", self.label()));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    fn problem(&self, message: String) {
        tracing::warn!("pod runner: {message}");
        self.ctx.inner().problems.push(message);
    }
}

fn image_id(launch: Option<&super::plan::Launch>) -> String {
    launch.map_or_else(String::new, |l| format!("fake://{}", l.program.display()))
}

/// What the kubelet reports for a container of a terminated pod that never ran
/// (`pkg/kubelet/kubelet_pods.go`, `convertToAPIContainerStatuses`).
fn never_ran(id: Option<String>) -> Exit {
    Exit {
        code: 137,
        reason: "ContainerStatusUnknown".to_owned(),
        message: Some("The container could not be located when the pod was terminated".to_owned()),
        started_at: None,
        finished_at: Timestamp::now(),
        id,
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Go's `time.Duration.String` for whole milliseconds (`100ms`, `1.6s`, `5m0s`).
pub(super) fn go_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if millis < 1000 {
        return format!("{millis}ms");
    }
    let minutes = millis / 60_000;
    let rest = millis % 60_000;
    let mut seconds = format!("{}.{:03}", rest / 1000, rest % 1000);
    while seconds.ends_with('0') {
        seconds.pop();
    }
    let seconds = seconds.trim_end_matches('.');
    if minutes > 0 {
        format!("{minutes}m{seconds}s")
    } else {
        format!("{seconds}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_go_prints_them() {
        assert_eq!(go_duration(Duration::from_millis(100)), "100ms");
        assert_eq!(go_duration(Duration::from_millis(1600)), "1.6s");
        assert_eq!(go_duration(Duration::from_secs(10)), "10s");
        assert_eq!(go_duration(Duration::from_secs(300)), "5m0s");
        assert_eq!(go_duration(Duration::from_secs(160)), "2m40s");
    }
}
