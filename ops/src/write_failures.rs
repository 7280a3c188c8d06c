//! `kerf_api_write_failures_total{component,resource,reason}`: the writes a kerf component
//! could not make and reported to the user (a refusal, or a failure that outlasted its
//! retries). One series family for every component, so one alert covers kerf as a whole.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// The metric's name in the registry (the counter's `_total` is added on encoding).
const METRIC: &str = "kerf_api_write_failures";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WriteFailureLabels {
    component: &'static str,
    resource: &'static str,
    reason: &'static str,
}

/// A handle on the counter for one component; clones count into the same series.
#[derive(Clone, Debug)]
pub struct ApiWriteFailures {
    component: &'static str,
    counts: Family<WriteFailureLabels, Counter>,
}

impl ApiWriteFailures {
    /// The counter of `component` (`controller`, `kubelet-plugin`), registered in `registry`
    /// at its root: the name carries no component prefix.
    pub fn new(component: &'static str, registry: &mut Registry) -> Self {
        let counts = Family::default();
        registry.register(
            METRIC,
            "API writes a kerf component could not make and reported as a Warning Event, by component, resource (plural, with subresource) and reason",
            counts.clone(),
        );
        Self { component, counts }
    }

    /// Counts one failed write of `resource` (e.g. `pods`, `resourceclaims/status`) for
    /// `reason` (the name of a `kerf_api::write_failure::WriteFailure` variant).
    pub fn record(&self, resource: &'static str, reason: &'static str) {
        self.counts
            .get_or_create(&WriteFailureLabels {
                component: self.component,
                resource,
                reason,
            })
            .inc();
    }

    /// The count so far of `resource` and `reason` for this component.
    pub fn count(&self, resource: &'static str, reason: &'static str) -> u64 {
        self.counts
            .get_or_create(&WriteFailureLabels {
                component: self.component,
                resource,
                reason,
            })
            .get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_encoded_with_component_resource_and_reason() {
        let mut registry = Registry::default();
        let failures = ApiWriteFailures::new("controller", &mut registry);
        failures.record("pods", "Forbidden");
        failures.record("pods", "Forbidden");
        assert_eq!(failures.count("pods", "Forbidden"), 2);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(
                r#"kerf_api_write_failures_total{component="controller",resource="pods",reason="Forbidden"} 2"#
            ),
            "{text}"
        );
    }
}
