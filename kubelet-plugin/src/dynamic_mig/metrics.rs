//! Counters of dynamic MIG's driver calls, registered by the component itself (the pattern of
//! the device status writer), under the plugin's prefix.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::Error;

/// Labels of the MIG operation counter: `op` is the driver call (`create_gpu_instance`,
/// `create_compute_instance`, `destroy_compute_instance`, `destroy_gpu_instance`,
/// `list_gpu_instances`); `result` is `ok` or `error`; `reason` is the failure kind
/// ([`crate::dynamic_mig::control::MigFailureKind::as_str`]) or the error's reason label,
/// empty on success.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
    result: &'static str,
    reason: &'static str,
}

/// Handle to the counters; clones count into the same series.
#[derive(Clone, Debug, Default)]
pub(crate) struct MigMetrics {
    operations: Family<OpLabels, Counter>,
}

impl MigMetrics {
    /// Registers `kerf_plugin_mig_operations_total` in `registry`.
    pub fn new(registry: &mut Registry) -> Self {
        let metrics = MigMetrics::default();
        registry.sub_registry_with_prefix("kerf_plugin").register(
            "mig_operations",
            "MIG instance operations on dynamic-MIG GPUs by call and result",
            metrics.operations.clone(),
        );
        metrics
    }

    /// Registers the counter in `registry` with one example series, for the metrics
    /// reference ([`crate::metrics_reference::reference_registry`]).
    pub(crate) fn reference(registry: &mut Registry) {
        Self::new(registry).record("create_gpu_instance", &Ok::<(), Error>(()));
    }

    /// Counts one call of `op` with its outcome.
    pub fn record<T>(&self, op: &'static str, result: &Result<T, Error>) {
        let (result, reason) = match result {
            Ok(_) => ("ok", ""),
            Err(Error::Mig { kind, .. }) => ("error", kind.as_str()),
            Err(other) => ("error", other.reason()),
        };
        self.operations
            .get_or_create(&OpLabels { op, result, reason })
            .inc();
    }
}
