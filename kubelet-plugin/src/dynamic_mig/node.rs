//! The node's dynamic MIG as the plugin starts it: which MIG control it uses, and the log of
//! what the start-up reconciliation did.

use std::sync::Arc;

use kerf_core::inventory::Inventory;
use prometheus_client::registry::Registry;

use super::manager::DynamicMig;
use super::metrics::MigMetrics;
use super::mock::MockMigControl;
use super::startup::MigRestore;
use crate::Result;
use crate::config::PluginConfig;
use crate::crash::CrashStep;
use crate::discovery::facts::HostPaths;

/// Dynamic MIG for a node with `inventory`: nothing without dynamic-MIG GPUs; in mock mode
/// the emulated instances under [`PluginConfig::mock_mig_root`], whose `proc` directory is
/// the emulated driver's; on a GPU node, NVML's MIG calls
/// ([`super::nvml::NvmlMigControl`]) and the host's `/proc`. `crash_at` aborts after that
/// step of every MIG prepare (`--mock-crash-at`, refused outside mock mode by
/// [`crate::args::Args::into_config`]).
///
/// # Errors
/// The mock's state directory cannot be created, or NVML does not initialise.
pub(crate) fn for_node(
    config: &PluginConfig,
    inventory: &Inventory,
    registry: &mut Registry,
    crash_at: Option<CrashStep>,
) -> Result<DynamicMig> {
    if !inventory.gpus.iter().any(|g| g.dynamic_mig) {
        return Ok(DynamicMig::unavailable(
            "no GPU of this node creates MIG devices on demand",
        ));
    }
    let metrics = MigMetrics::new(registry);
    let mig = if let Some(root) = config.mock_mig_root() {
        let control = MockMigControl::open(&root)?;
        tracing::info!(root = %root.display(), "dynamic MIG: emulated MIG instances");
        let host = HostPaths {
            sys: root.join("sys"),
            proc: root.join("proc"),
        };
        DynamicMig::new(Arc::new(control), host, metrics)
    } else {
        // The driver's /proc files are the host's: the caps table and /proc/devices.
        let control = super::nvml::NvmlMigControl::new()?;
        DynamicMig::new(Arc::new(control), HostPaths::default(), metrics)
    };
    Ok(mig.with_crash_at(crash_at))
}

/// Logs what [`DynamicMig::restore`] did.
pub(crate) fn log_restore(report: &MigRestore) {
    for error in &report.failures {
        tracing::error!(%error, "start-up: dynamic MIG reconciliation left a GPU as it was");
    }
    tracing::info!(
        kept = report.kept,
        compute_destroyed = report.compute_destroyed,
        gpu_destroyed = report.gpu_destroyed,
        claims_dropped = ?report.claims_dropped,
        "dynamic MIG instances reconciled with the checkpoint"
    );
}
