//! The metrics reference: kerf-kubelet-plugin's registry with every part's families, which
//! `docs/metrics.md` is generated from. Above [`crate::metrics`] and the parts that register
//! families of their own (the device status writer, dynamic MIG), so that none of them needs
//! another.

use std::time::Duration;

use prometheus_client::registry::Registry;

use crate::metrics::Metrics;

/// kerf-kubelet-plugin's registry as the plugin fills it when every part runs (the device
/// status writer, dynamic MIG), with one example series in every family so that the
/// reference can show each family's labels: what `docs/metrics.md` is generated from.
pub fn reference_registry() -> Registry {
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    crate::preparer::device_status::reference_metrics(&mut registry);
    crate::dynamic_mig::metrics::MigMetrics::reference(&mut registry);
    let tick = Duration::from_millis(1);
    metrics.record_prepare(Ok(()), tick);
    metrics.record_unprepare(Ok(()), tick);
    metrics.record_request("NodePrepareResources", "v1");
    metrics.set_prepared_claims(0);
    metrics.record_publish(Ok(()));
    metrics.set_registered(false);
    metrics.record_mps_daemon_restart("GPU-0", true);
    metrics.set_device_health(0, 0, 0);
    metrics.record_fault("xid");
    metrics.record_claim_lookup_from("cache", "");
    metrics
        .api_write_failures()
        .record("resourceclaims/status", "Forbidden");
    registry
}
