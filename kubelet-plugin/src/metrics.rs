//! Prometheus metrics of the kubelet plugin.
//!
//! Every metric lives in a [`Registry`] the caller owns (no process-wide globals), under the
//! prefix `kerf_plugin_`. [`Metrics`] is a cheap handle: the metric families share their
//! state, so clones record into the same series. Two have no prefix:
//! `kerf_mps_daemon_restarts_total` and `kerf_api_write_failures_total{component="kubelet-plugin",
//! resource,reason}`, the writes the API server would not take, told as Warning Events
//! ([`crate::write_failures`]), counted alike for every kerf component.

use std::time::Duration;

use kerf_ops::write_failures::ApiWriteFailures;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Prefix of every metric of the plugin (an underscore is added by the registry).
const PREFIX: &str = "kerf_plugin";

/// Label value of `result` for a success.
const OK: &str = "ok";
/// Label value of `result` for a failure.
const ERROR: &str = "error";

/// Labels of outcome counters: `result` is `ok` or `error`; `reason` is the error's stable
/// reason label, empty on success.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    result: &'static str,
    reason: &'static str,
}

impl OutcomeLabels {
    fn from_result(result: Result<(), &'static str>) -> Self {
        match result {
            Ok(()) => Self {
                result: OK,
                reason: "",
            },
            Err(reason) => Self {
                result: ERROR,
                reason,
            },
        }
    }
}

/// Labels of the per-request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    method: &'static str,
    api_version: &'static str,
}

/// Labels of the claim lookup counter: `source` is `cache` or `api`; `reason` says why a
/// lookup went to the API server (`cache_off`, `not_synced`, `miss`, `uid_mismatch`,
/// `deleting`, `not_allocated_here`), empty for the cache.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LookupLabels {
    source: &'static str,
    reason: &'static str,
}

/// Labels of the MPS daemon restart counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RestartLabels {
    gpu: String,
    result: &'static str,
}

/// Handles to all metrics of the kubelet plugin.
///
/// Cloning is cheap and every clone records into the same series.
#[derive(Clone, Debug)]
pub struct Metrics {
    prepare_claims: Family<OutcomeLabels, Counter>,
    unprepare_claims: Family<OutcomeLabels, Counter>,
    prepare_duration: Histogram,
    unprepare_duration: Histogram,
    requests: Family<RequestLabels, Counter>,
    prepared_claims: Gauge,
    publish: Family<OutcomeLabels, Counter>,
    registration_status: Gauge,
    mps_daemon_restarts: Family<RestartLabels, Counter>,
    device_health: Family<HealthLabels, Gauge>,
    faults: Family<FaultLabels, Counter>,
    claim_lookups: Family<LookupLabels, Counter>,
    write_failures: ApiWriteFailures,
}

/// Labels of the device health gauge: `healthy`, `unhealthy` or `unknown`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HealthLabels {
    status: &'static str,
}

/// Labels of the fault counter: the fault's class (`xid`, `fatal_xid`, `ecc_uncorrected`,
/// `gpu_lost`, `thermal_throttle`, `power_throttle`, `unmonitored`), never the XID number or
/// the GPU, so the label set stays small.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultLabels {
    reason: &'static str,
}

/// Latency buckets from 100 µs to about 13 s: a prepare is sub-millisecond work when the claim
/// read hits a cache and can take seconds when the API server is slow, and both ends matter.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 18))
}

impl Metrics {
    /// Creates the metrics and registers them in `registry` under the `kerf_plugin_` prefix.
    pub fn new(registry: &mut Registry) -> Self {
        let metrics = Self {
            prepare_claims: Family::default(),
            unprepare_claims: Family::default(),
            prepare_duration: latency_histogram(),
            unprepare_duration: latency_histogram(),
            requests: Family::default(),
            prepared_claims: Gauge::default(),
            publish: Family::default(),
            registration_status: Gauge::default(),
            mps_daemon_restarts: Family::default(),
            device_health: Family::default(),
            faults: Family::default(),
            claim_lookups: Family::default(),
            write_failures: ApiWriteFailures::new("kubelet-plugin", registry),
        };
        // Named without the plugin prefix: `kerf_mps_daemon_restarts_total` is the name admins
        // alert on, and only the plugin runs MPS daemons.
        registry.register(
            "kerf_mps_daemon_restarts",
            "MPS control daemons found dead and started again, by GPU and result (ok, or error when the restart failed)",
            metrics.mps_daemon_restarts.clone(),
        );
        metrics.register(registry.sub_registry_with_prefix(PREFIX));
        metrics
    }

    /// The counter of writes the API server would not take (`kerf_api_write_failures_total`,
    /// `component="kubelet-plugin"`).
    pub fn api_write_failures(&self) -> &ApiWriteFailures {
        &self.write_failures
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "node_prepare_claims",
            "Claims handled by NodePrepareResources, by result and error reason",
            self.prepare_claims.clone(),
        );
        registry.register(
            "node_unprepare_claims",
            "Claims handled by NodeUnprepareResources, by result and error reason",
            self.unprepare_claims.clone(),
        );
        registry.register(
            "node_prepare_duration_seconds",
            "Time to prepare one claim",
            self.prepare_duration.clone(),
        );
        registry.register(
            "node_unprepare_duration_seconds",
            "Time to unprepare one claim",
            self.unprepare_duration.clone(),
        );
        registry.register(
            "node_requests",
            "DRA gRPC requests received from the kubelet, by method and DRA API version",
            self.requests.clone(),
        );
        registry.register(
            "prepared_claims",
            "Claims currently prepared on this node",
            self.prepared_claims.clone(),
        );
        registry.register(
            "resource_slice_publish",
            "ResourceSlice publish attempts, by result and error reason",
            self.publish.clone(),
        );
        registry.register(
            "registration_status",
            "1 when the kubelet has registered the plugin, 0 otherwise",
            self.registration_status.clone(),
        );
        registry.register(
            "devices_by_health",
            "Published devices by the health the kubelet is told (healthy, unhealthy, unknown)",
            self.device_health.clone(),
        );
        registry.register(
            "device_faults",
            "GPU faults seen (each fault once when it appears), by class",
            self.faults.clone(),
        );
        registry.register(
            "claim_lookups",
            "Claims a prepare read, by source (cache; or watch, api_any, api with the reason the cache could not answer at once)",
            self.claim_lookups.clone(),
        );
    }

    /// Gives every GPU of `gpus` its restart series at zero, once the plugin checks MPS
    /// daemons: a series that appeared with its first count would make `increase()` miss that
    /// count (it needs two samples), and alerts on restarts would not fire for it.
    pub(crate) fn init_mps_daemon_restarts<'a>(&self, gpus: impl IntoIterator<Item = &'a str>) {
        for gpu in gpus {
            for result in [OK, ERROR] {
                let _ = self.mps_daemon_restarts.get_or_create(&RestartLabels {
                    gpu: gpu.to_owned(),
                    result,
                });
            }
        }
    }

    /// Counts a dead MPS daemon of `gpu` started again (`restarted`) or not.
    pub(crate) fn record_mps_daemon_restart(&self, gpu: &str, restarted: bool) {
        self.mps_daemon_restarts
            .get_or_create(&RestartLabels {
                gpu: gpu.to_owned(),
                result: if restarted { OK } else { ERROR },
            })
            .inc();
    }

    /// Records the outcome and duration of preparing one claim; `result` carries the error's
    /// reason label on failure.
    pub(crate) fn record_prepare(&self, result: Result<(), &'static str>, elapsed: Duration) {
        self.prepare_claims
            .get_or_create(&OutcomeLabels::from_result(result))
            .inc();
        self.prepare_duration.observe(elapsed.as_secs_f64());
    }

    /// Counts one claim read by a prepare from `source` (`cache`, `watch`: the cache's watch
    /// delivered it while the API read was in flight, `api_any`: a `resourceVersion=0` GET,
    /// `api`: a quorum GET), for `reason` (why the cache could not answer at once; empty for
    /// `cache`).
    pub(crate) fn record_claim_lookup_from(&self, source: &'static str, reason: &'static str) {
        self.claim_lookups
            .get_or_create(&LookupLabels { source, reason })
            .inc();
    }

    /// Records the outcome and duration of unpreparing one claim.
    pub(crate) fn record_unprepare(&self, result: Result<(), &'static str>, elapsed: Duration) {
        self.unprepare_claims
            .get_or_create(&OutcomeLabels::from_result(result))
            .inc();
        self.unprepare_duration.observe(elapsed.as_secs_f64());
    }

    /// Counts one DRA gRPC request, e.g. `("NodePrepareResources", "v1")`.
    pub(crate) fn record_request(&self, method: &'static str, api_version: &'static str) {
        self.requests
            .get_or_create(&RequestLabels {
                method,
                api_version,
            })
            .inc();
    }

    /// Sets the number of claims currently prepared.
    pub(crate) fn set_prepared_claims(&self, n: i64) {
        self.prepared_claims.set(n);
    }

    /// Records the outcome of one ResourceSlice publish attempt.
    pub(crate) fn record_publish(&self, result: Result<(), &'static str>) {
        self.publish
            .get_or_create(&OutcomeLabels::from_result(result))
            .inc();
    }

    /// Sets how many published devices are healthy, unhealthy and unknown.
    pub(crate) fn set_device_health(&self, healthy: i64, unhealthy: i64, unknown: i64) {
        for (status, n) in [
            ("healthy", healthy),
            ("unhealthy", unhealthy),
            ("unknown", unknown),
        ] {
            self.device_health
                .get_or_create(&HealthLabels { status })
                .set(n);
        }
    }

    /// Counts one fault that appeared, by its class (see the fault counter's labels).
    pub(crate) fn record_fault(&self, reason: &'static str) {
        self.faults.get_or_create(&FaultLabels { reason }).inc();
    }

    /// Sets whether the kubelet has registered the plugin.
    pub(crate) fn set_registered(&self, registered: bool) {
        self.registration_status.set(i64::from(registered));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    fn encoded(registry: &Registry) -> String {
        let mut text = String::new();
        encode(&mut text, registry).unwrap();
        text
    }

    fn setup() -> (Registry, Metrics) {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        (registry, metrics)
    }

    #[test]
    fn prepare_outcomes_are_counted_by_result_and_reason() {
        let (registry, metrics) = setup();
        metrics.record_prepare(Ok(()), Duration::from_micros(300));
        metrics.record_prepare(Ok(()), Duration::from_micros(300));
        metrics.record_prepare(Err("claim"), Duration::from_millis(2));
        let text = encoded(&registry);
        assert!(
            text.contains(r#"kerf_plugin_node_prepare_claims_total{result="ok",reason=""} 2"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kerf_plugin_node_prepare_claims_total{result="error",reason="claim"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains("kerf_plugin_node_prepare_duration_seconds_count 3"),
            "{text}"
        );
    }

    #[test]
    fn sub_millisecond_prepares_land_in_their_own_buckets() {
        let (registry, metrics) = setup();
        metrics.record_prepare(Ok(()), Duration::from_micros(150));
        let text = encoded(&registry);
        assert!(
            text.contains(r#"kerf_plugin_node_prepare_duration_seconds_bucket{le="0.0001"} 0"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kerf_plugin_node_prepare_duration_seconds_bucket{le="0.0002"} 1"#),
            "{text}"
        );
    }

    #[test]
    fn unprepare_is_counted_separately_from_prepare() {
        let (registry, metrics) = setup();
        metrics.record_unprepare(Err("io"), Duration::from_millis(1));
        let text = encoded(&registry);
        assert!(
            text.contains(
                r#"kerf_plugin_node_unprepare_claims_total{result="error",reason="io"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains("kerf_plugin_node_unprepare_duration_seconds_count 1"),
            "{text}"
        );
        assert!(
            !text.contains("kerf_plugin_node_prepare_claims_total{"),
            "{text}"
        );
    }

    #[test]
    fn requests_are_counted_by_method_and_version() {
        let (registry, metrics) = setup();
        metrics.record_request("NodePrepareResources", "v1");
        metrics.record_request("NodePrepareResources", "v1beta1");
        metrics.record_request("NodePrepareResources", "v1");
        let text = encoded(&registry);
        assert!(
            text.contains(
                r#"kerf_plugin_node_requests_total{method="NodePrepareResources",api_version="v1"} 2"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kerf_plugin_node_requests_total{method="NodePrepareResources",api_version="v1beta1"} 1"#
            ),
            "{text}"
        );
    }

    #[test]
    fn gauges_and_publish_counter() {
        let (registry, metrics) = setup();
        metrics.set_prepared_claims(3);
        metrics.set_registered(true);
        metrics.record_publish(Ok(()));
        metrics.record_publish(Err("kube_api"));
        let text = encoded(&registry);
        assert!(text.contains("kerf_plugin_prepared_claims 3"), "{text}");
        assert!(text.contains("kerf_plugin_registration_status 1"), "{text}");
        assert!(
            text.contains(r#"kerf_plugin_resource_slice_publish_total{result="ok",reason=""} 1"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kerf_plugin_resource_slice_publish_total{result="error",reason="kube_api"} 1"#
            ),
            "{text}"
        );
        metrics.set_registered(false);
        assert!(encoded(&registry).contains("kerf_plugin_registration_status 0"));
    }

    #[test]
    fn claim_lookups_are_counted_by_source_and_reason() {
        let (registry, metrics) = setup();
        metrics.record_claim_lookup_from("cache", "");
        metrics.record_claim_lookup_from("cache", "");
        metrics.record_claim_lookup_from("api", "miss");
        let text = encoded(&registry);
        assert!(
            text.contains(r#"kerf_plugin_claim_lookups_total{source="cache",reason=""} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kerf_plugin_claim_lookups_total{source="api",reason="miss"} 1"#),
            "{text}"
        );
    }

    #[test]
    fn mps_restart_series_start_at_zero_for_every_gpu() {
        let (registry, metrics) = setup();
        metrics.init_mps_daemon_restarts(["GPU-1"]);
        metrics.record_mps_daemon_restart("GPU-1", true);
        let text = encoded(&registry);
        assert!(
            text.contains(r#"kerf_mps_daemon_restarts_total{gpu="GPU-1",result="ok"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kerf_mps_daemon_restarts_total{gpu="GPU-1",result="error"} 0"#),
            "{text}"
        );
    }

    #[test]
    fn clones_record_into_the_same_series() {
        let (registry, metrics) = setup();
        let clone = metrics.clone();
        clone.set_prepared_claims(7);
        assert!(encoded(&registry).contains("kerf_plugin_prepared_claims 7"));
    }
}
