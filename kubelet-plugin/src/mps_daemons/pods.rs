//! Control daemons as pods (`--mps-daemons=pod`): one bare pod per GPU, bound to this node,
//! created by the plugin and run by the kubelet (see the module docs of
//! [`crate::mps_daemons`]).
//!
//! The kubelet restarts a daemon that dies (`restartPolicy: Always`), so a pod's
//! [`Incarnation`] is its UID and its container's restart count. Nothing of the daemon lives
//! in the plugin's process or container: a restarted plugin (or a second instance during a
//! rolling update) finds the pods by name and adopts them.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kerf_core::mps::{ComputeMode, MpsDirectories};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};

use super::pod_spec::{COMPONENT, COMPONENT_LABEL, CONTAINER, DaemonPodTemplate, GPU_LABEL};
use super::tools::{
    accepts_connections, clean_up, create_shm_directory, mps_error, set_compute_mode,
};
use super::{Incarnation, MpsSettings};
use crate::error::{Error, Result};

/// How often a starting or stopping daemon is looked at.
const POLL: Duration = Duration::from_millis(25);
/// How often the pod of a starting daemon is read to fail fast on what the kubelet reports.
const POD_POLL: Duration = Duration::from_millis(500);
/// Waiting reasons of the kubelet after which a daemon will not start without an admin.
const FATAL_WAITING_REASONS: [&str; 6] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// Starts, finds and stops daemon pods (see the module docs).
#[derive(Debug, Clone)]
pub struct PodDaemons {
    settings: MpsSettings,
    pods: Api<Pod>,
    node: String,
    template: Arc<DaemonPodTemplate>,
    start_timeout: Duration,
}

impl PodDaemons {
    /// Daemon pods of `node` made from `template`, created and read through `client`.
    pub fn new(
        client: kube::Client,
        node: &str,
        template: DaemonPodTemplate,
        settings: MpsSettings,
        start_timeout: Duration,
    ) -> Self {
        PodDaemons {
            pods: Api::namespaced(client, &template.namespace),
            node: node.to_owned(),
            template: Arc::new(template),
            settings,
            start_timeout,
        }
    }

    /// Reads the plugin's own pod `namespace/name` and makes the daemon pods' template of it.
    ///
    /// # Errors
    /// [`Error::Kube`] when the pod cannot be read; [`Error::Config`] when it lacks what the
    /// template copies.
    pub(crate) async fn template_of_plugin_pod(
        client: kube::Client,
        namespace: &str,
        name: &str,
        tools_root: &std::path::Path,
        image: Option<String>,
    ) -> Result<DaemonPodTemplate> {
        let plugin = Api::<Pod>::namespaced(client, namespace).get(name).await?;
        DaemonPodTemplate::from_plugin_pod(&plugin, tools_root, image)
    }

    /// Where the daemons keep their files and which tools run them.
    pub fn settings(&self) -> &MpsSettings {
        &self.settings
    }

    /// The same daemons with their files under `root`.
    #[must_use]
    pub(crate) fn with_root(&self, root: PathBuf) -> Self {
        PodDaemons {
            settings: MpsSettings {
                root,
                ..self.settings.clone()
            },
            ..self.clone()
        }
    }

    fn directories(&self, gpu: &str) -> Result<MpsDirectories> {
        Ok(MpsDirectories::new(&self.settings.root, gpu)?)
    }

    fn name(&self, gpu: &str) -> String {
        super::daemon_pod_name(&self.node, gpu)
    }

    /// The daemon pod of `gpu` while it is meant to run (not deleted, not finished).
    ///
    /// # Errors
    /// [`Error::Core`] for an invalid UUID; [`Error::Kube`] when the pod cannot be read.
    pub async fn current(&self, gpu: &str) -> Result<Option<Incarnation>> {
        self.directories(gpu)?;
        Ok(self.live_pod(gpu).await?.as_ref().map(incarnation))
    }

    async fn live_pod(&self, gpu: &str) -> Result<Option<Pod>> {
        Ok(self.pods.get_opt(&self.name(gpu)).await?.filter(is_live))
    }

    /// Makes sure the daemon pod of `gpu` runs and accepts clients: adopts it, else creates it
    /// (after putting the GPU in compute mode `EXCLUSIVE_PROCESS`) and waits for it.
    ///
    /// # Errors
    /// [`Error::Mps`] when it does not accept clients within the start timeout (with what the
    /// kubelet reports), [`Error::Write`] when the pod cannot be created; a pod this call
    /// created is deleted again and the GPU's files and compute mode restored.
    pub async fn ensure(&self, gpu: &str) -> Result<Incarnation> {
        self.start(gpu, true).await
    }

    /// As [`PodDaemons::ensure`] for a GPU whose clients run: a failed start deletes the pod
    /// but keeps the GPU's files, which their containers have mounted.
    ///
    /// # Errors
    /// As [`PodDaemons::ensure`].
    pub async fn restart(&self, gpu: &str) -> Result<Incarnation> {
        self.start(gpu, false).await
    }

    async fn start(&self, gpu: &str, clean_up_on_failure: bool) -> Result<Incarnation> {
        let dirs = self.directories(gpu)?;
        let name = self.name(gpu);
        match self.pods.get_opt(&name).await? {
            Some(pod) if is_live(&pod) => return self.wait_ready(&dirs).await,
            Some(pod) => self.delete_and_wait(gpu, &pod).await?,
            None => {}
        }
        let Err(error) = self.create(&dirs).await else {
            return self.wait_ready(&dirs).await;
        };
        let undone = if clean_up_on_failure {
            self.stop(gpu).await
        } else {
            self.delete(gpu).await
        };
        if let Err(undo) = undone {
            tracing::warn!(gpu, error = %undo, "cannot undo a failed MPS daemon start");
        }
        Err(error)
    }

    async fn create(&self, dirs: &MpsDirectories) -> Result<()> {
        let gpu = dirs.gpu_uuid();
        for dir in [dirs.base().to_path_buf(), dirs.log()] {
            tokio::fs::create_dir_all(&dir)
                .await
                .map_err(|e| Error::io("create MPS directory", &dir, e))?;
        }
        create_shm_directory(&dirs.gpu_shm())?;
        set_compute_mode(
            &self.settings.driver_root,
            gpu,
            ComputeMode::ExclusiveProcess,
        )
        .await?;
        let pod = self.template.pod(
            &self.node,
            dirs,
            &self.settings.driver_root,
            self.settings.stop_timeout,
        );
        let params = PostParams {
            field_manager: Some(crate::identity::FIELD_MANAGER.to_owned()),
            ..PostParams::default()
        };
        match self.pods.create(&params, &pod).await {
            Ok(_) => tracing::info!(gpu, pod = %self.name(gpu), "MPS daemon pod created"),
            // Another instance of the plugin (a rolling update) created it first.
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(error) => return Err(Error::write("create", "pods", &self.name(gpu), error)),
        }
        Ok(())
    }

    /// Waits until the daemon accepts connections on its control socket, failing early on
    /// what the kubelet reports it cannot fix alone.
    async fn wait_ready(&self, dirs: &MpsDirectories) -> Result<Incarnation> {
        let gpu = dirs.gpu_uuid();
        let deadline = tokio::time::Instant::now() + self.start_timeout;
        let mut next_pod_read = tokio::time::Instant::now();
        let mut last_state = String::from("not created");
        loop {
            if accepts_connections(dirs).await
                && let Some(pod) = self.live_pod(gpu).await?
            {
                return Ok(incarnation(&pod));
            }
            let now = tokio::time::Instant::now();
            if now >= next_pod_read {
                next_pod_read = now + POD_POLL;
                match self.live_pod(gpu).await? {
                    None => "gone (deleted or finished)".clone_into(&mut last_state),
                    Some(pod) => {
                        last_state = container_state(&pod);
                        if let Some(reason) = fatal_waiting(&pod) {
                            return Err(mps_error(
                                gpu,
                                format!("daemon pod {}: {reason}", self.name(gpu)),
                            ));
                        }
                    }
                }
            }
            if now >= deadline {
                return Err(mps_error(
                    gpu,
                    format!(
                        "daemon pod {} does not accept connections on {} after {:?}; its container: {last_state}",
                        self.name(gpu),
                        dirs.pipe().join("control").display(),
                        self.start_timeout
                    ),
                ));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Deletes the daemon pod of `gpu` (its program sends `quit`), waits until the kubelet
    /// has removed it, then removes the GPU's files and puts it back in compute mode
    /// `DEFAULT`. A GPU without a pod only gets the clean-up.
    ///
    /// # Errors
    /// [`Error::Write`] when the pod cannot be deleted, [`Error::Mps`] when it is still there
    /// after its grace period and the stop timeout; nothing is cleaned up then, so that the
    /// next start-up tries again.
    pub async fn stop(&self, gpu: &str) -> Result<()> {
        let dirs = self.directories(gpu)?;
        self.delete(gpu).await?;
        clean_up(&self.settings.driver_root, &dirs).await;
        Ok(())
    }

    /// Deletes the daemon pod of `gpu`, if any, and waits until the kubelet removed it.
    async fn delete(&self, gpu: &str) -> Result<()> {
        if let Some(pod) = self.pods.get_opt(&self.name(gpu)).await? {
            self.delete_and_wait(gpu, &pod).await?;
            tracing::info!(gpu, pod = %self.name(gpu), "MPS daemon pod deleted");
        }
        Ok(())
    }

    async fn delete_and_wait(&self, gpu: &str, pod: &Pod) -> Result<()> {
        let name = self.name(gpu);
        let uid = pod.metadata.uid.clone();
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match self.pods.delete(&name, &params).await {
            Ok(_) => {}
            // Gone already, or replaced by a pod another instance created: not ours to delete.
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                return Ok(());
            }
            Err(error) => return Err(Error::write("delete", "pods", &name, error)),
        }
        let grace = pod
            .spec
            .as_ref()
            .and_then(|s| s.termination_grace_period_seconds)
            .and_then(|s| u64::try_from(s).ok())
            .unwrap_or(30);
        let deadline =
            tokio::time::Instant::now() + Duration::from_secs(grace) + self.settings.stop_timeout;
        loop {
            let current = self.pods.get_opt(&name).await?;
            if current.is_none_or(|p| p.metadata.uid != uid) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(mps_error(
                    gpu,
                    format!(
                        "daemon pod {name} is still terminating; the kubelet of this node has not removed it"
                    ),
                ));
            }
            tokio::time::sleep(POLL * 4).await;
        }
    }

    /// GPUs with a daemon pod on this node or daemon files under the MPS root.
    pub async fn known_gpus(&self) -> Vec<String> {
        let mut gpus = super::processes::gpus_with_files(&self.settings.root);
        let params = ListParams::default()
            .labels(&format!("{COMPONENT_LABEL}={COMPONENT}"))
            .fields(&format!("spec.nodeName={}", self.node));
        match self.pods.list(&params).await {
            Ok(list) => gpus.extend(
                list.items
                    .iter()
                    .filter_map(|pod| pod.metadata.labels.as_ref()?.get(GPU_LABEL).cloned()),
            ),
            Err(error) => tracing::warn!(%error, "cannot list this node's MPS daemon pods"),
        }
        gpus.sort();
        gpus.dedup();
        gpus
    }
}

/// Not being deleted and not finished: the kubelet runs (or restarts) its container.
fn is_live(pod: &Pod) -> bool {
    let finished = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|phase| phase == "Succeeded" || phase == "Failed");
    pod.metadata.deletion_timestamp.is_none() && !finished
}

fn incarnation(pod: &Pod) -> Incarnation {
    let restarts = daemon_status(pod).map_or(0, |s| s.restart_count);
    Incarnation::pod(pod.metadata.uid.as_deref().unwrap_or_default(), restarts)
}

fn daemon_status(pod: &Pod) -> Option<&k8s_openapi::api::core::v1::ContainerStatus> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == CONTAINER)
}

fn container_state(pod: &Pod) -> String {
    let Some(status) = daemon_status(pod) else {
        return "no status yet (not started by the kubelet)".to_owned();
    };
    let state = status.state.as_ref();
    if let Some(waiting) = state.and_then(|s| s.waiting.as_ref()) {
        return format!(
            "waiting: {} {}",
            waiting.reason.as_deref().unwrap_or_default(),
            waiting.message.as_deref().unwrap_or_default()
        );
    }
    if let Some(terminated) = state.and_then(|s| s.terminated.as_ref()) {
        return format!("terminated with exit code {}", terminated.exit_code);
    }
    format!("running, {} restarts", status.restart_count)
}

fn fatal_waiting(pod: &Pod) -> Option<String> {
    let waiting = daemon_status(pod)?.state.as_ref()?.waiting.as_ref()?;
    let reason = waiting.reason.as_deref()?;
    FATAL_WAITING_REASONS.contains(&reason).then(|| {
        format!(
            "the kubelet cannot start its container: {reason} {}",
            waiting.message.as_deref().unwrap_or_default()
        )
    })
}
