//! The plugin's side of GPU sharing beyond prepares: which daemons it runs, what start-up
//! restored, and the periodic check that restarts dead daemons and tells their claims.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::claim_events::{ClaimEvents, ClaimWarning};
use crate::config::{MpsDaemonMode, PluginConfig};
use crate::gpu_sharing::{GpuSharing, Restarted, SharingRestore};
use crate::metrics::Metrics;
use crate::mps_daemons::{ControlDaemons, PodDaemons, ProcessDaemons};
use crate::preparer::Preparer;
use crate::{Error, Result};

/// The MPS daemons and time slices of the node, run with the configured GPU tools (as pods
/// made from the plugin's own pod, read through `client`, or as processes); not enforced in
/// mock mode without a mock driver root.
///
/// # Errors
/// [`Error::Config`] when daemon pods are asked for without the plugin's pod or a client;
/// [`Error::Kube`] when the plugin's pod cannot be read; [`Error::Io`] for the node-wide
/// shared-memory directory of daemon processes.
pub(crate) async fn gpu_sharing(
    config: &PluginConfig,
    client: Option<kube::Client>,
) -> Result<GpuSharing> {
    let Some(settings) = config.mps_settings() else {
        tracing::info!(
            "mock mode without --mock-driver-root: MPS and time-slicing are not enforced, slices are accounting only"
        );
        return Ok(GpuSharing::new(None));
    };
    let daemons = match config.mps_daemons {
        MpsDaemonMode::Process => {
            crate::mps_daemons::tools::create_shm_directory(
                &config.mps_root.join(kerf_core::mps::SHM_DIRECTORY_NAME),
            )?;
            ControlDaemons::Processes(ProcessDaemons::new(settings))
        }
        MpsDaemonMode::Pod => {
            let (Some(own), Some(client)) = (&config.own_pod, client) else {
                return Err(Error::Config(
                    "--mps-daemons=pod needs the plugin's pod (--pod-name, --pod-namespace) and an API client".into(),
                ));
            };
            let template = PodDaemons::template_of_plugin_pod(
                client.clone(),
                &own.namespace,
                &own.name,
                &settings.driver_root,
                config.mps_daemon_image.clone(),
            )
            .await?;
            tracing::info!(namespace = %template.namespace, image = %template.image, "MPS daemons run as pods");
            ControlDaemons::Pods(Box::new(PodDaemons::new(
                client,
                &config.node_name,
                template,
                settings,
                config.mps_start_timeout,
            )))
        }
    };
    Ok(GpuSharing::new(Some(daemons)))
}

/// Logs what start-up did to the GPUs' sharing.
pub(crate) fn log_sharing_restore(report: &SharingRestore) {
    for error in &report.failures {
        tracing::error!(%error, "start-up: GPU sharing set-up failed; the daemon check retries MPS daemons");
    }
    tracing::info!(
        adopted = ?report.adopted,
        started = ?report.started,
        replaced = ?report.replaced,
        orphans_stopped = ?report.orphans_stopped,
        time_slices_set = ?report.time_slices_set,
        time_slices_restored = ?report.time_slices_restored,
        "GPU sharing restored"
    );
}

/// Every `period` (first at once, which reports what start-up found), starts again the MPS
/// daemons that died; each replaced daemon is logged, counted and reported as a Warning Event
/// on the GPU's MPS claims, whose processes lost their server.
///
/// # Errors
/// None so far: failures are reported on the claims and retried; the `Result` is the plugin
/// task's.
pub(crate) async fn check_mps_daemons(
    preparer: Arc<Preparer>,
    metrics: Metrics,
    events: Arc<dyn ClaimEvents>,
    period: std::time::Duration,
    shutdown: CancellationToken,
) -> Result<()> {
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            _ = ticks.tick() => {}
        }
        for restarted in preparer.check_mps_daemons().await {
            report_restart(restarted, &metrics, events.as_ref()).await;
        }
    }
}

async fn report_restart(restarted: Restarted, metrics: &Metrics, events: &dyn ClaimEvents) {
    metrics.record_mps_daemon_restart(&restarted.gpu, restarted.error.is_none());
    let (reason, note) = match &restarted.error {
        None => {
            tracing::warn!(gpu = %restarted.gpu, claims = restarted.claims.len(), "MPS daemon had died; started again");
            let note = format!(
                "the MPS control daemon of GPU {} had died and was started again; CUDA processes of this claim that were connected to it must be restarted",
                restarted.gpu
            );
            ("MpsDaemonRestarted", note)
        }
        Some(error) => {
            tracing::error!(gpu = %restarted.gpu, %error, "MPS daemon had died and cannot be started again; retrying");
            let note = format!(
                "the MPS control daemon of GPU {} died and cannot be started again: {error}",
                restarted.gpu
            );
            ("MpsDaemonRestartFailed", note)
        }
    };
    for claim in restarted.claims {
        events
            .warn(ClaimWarning {
                claim,
                reason,
                note: note.clone(),
            })
            .await;
    }
}
