//! The recount's gauges, part of the controller's [`crate::Metrics`]:
//! `kerf_controller_quota_used` and `kerf_controller_quota_hard`, labelled `namespace`, `quota`
//! and `resource` (`memory` in bytes, `compute` in percent of a GPU, `gpus`). `hard` has a
//! series only for the resources the quota caps.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};

use kerf_api::gpuquota::{GpuAmount, RESOURCE_COMPUTE, RESOURCE_GPUS, RESOURCE_MEMORY};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Labels of a quota series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuotaLabels {
    namespace: String,
    quota: String,
    resource: &'static str,
}

/// `namespace/name` of a quota with series.
type QuotaKey = (String, String);

/// The quota gauges; clones record into the same series.
#[derive(Clone, Debug, Default)]
pub(crate) struct QuotaMetrics {
    used: Family<QuotaLabels, Gauge>,
    hard: Family<QuotaLabels, Gauge>,
    /// Quotas that have series: a `Family` cannot list its label sets.
    known: Arc<Mutex<BTreeSet<QuotaKey>>>,
}

const RESOURCES: [&str; 3] = [RESOURCE_MEMORY, RESOURCE_COMPUTE, RESOURCE_GPUS];

impl QuotaMetrics {
    /// Registers the gauges in `registry` (the controller's prefixed one).
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "quota_used",
            "What the ResourceClaims of a GpuQuota's namespace hold, by resource (memory in bytes, compute in percent of a GPU, gpus)",
            self.used.clone(),
        );
        registry.register(
            "quota_hard",
            "A GpuQuota's cap, by resource, for the resources it caps",
            self.hard.clone(),
        );
    }

    /// Sets the series of quota `namespace/name`: `used`, and `hard` where `capped`
    /// (`None`: the quota enforces nothing, so it has no `hard` series).
    pub(crate) fn set(
        &self,
        namespace: &str,
        name: &str,
        used: GpuAmount,
        hard: Option<(GpuAmount, [bool; 3])>,
    ) {
        self.lock().insert((namespace.to_owned(), name.to_owned()));
        let values = |a: GpuAmount| [a.memory_bytes, a.compute, a.gpus];
        let labels = |resource| QuotaLabels {
            namespace: namespace.to_owned(),
            quota: name.to_owned(),
            resource,
        };
        for (resource, value) in RESOURCES.into_iter().zip(values(used)) {
            self.used
                .get_or_create(&labels(resource))
                .set(saturating_i64(value));
        }
        let hard = hard.map_or([None; 3], |(amount, capped)| {
            let values = values(amount);
            [0, 1, 2].map(|i| capped[i].then_some(values[i]))
        });
        for (resource, value) in RESOURCES.into_iter().zip(hard) {
            if let Some(value) = value {
                self.hard
                    .get_or_create(&labels(resource))
                    .set(saturating_i64(value));
            } else {
                self.hard.remove(&labels(resource));
            }
        }
    }

    /// Drops the series of every quota not in `quotas` (deleted GpuQuotas).
    pub(crate) fn retain(&self, quotas: &BTreeSet<QuotaKey>) {
        self.lock().retain(|(namespace, quota)| {
            if quotas.contains(&(namespace.clone(), quota.clone())) {
                return true;
            }
            for resource in RESOURCES {
                let labels = QuotaLabels {
                    namespace: namespace.clone(),
                    quota: quota.clone(),
                    resource,
                };
                self.used.remove(&labels);
                self.hard.remove(&labels);
            }
            false
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<QuotaKey>> {
        // The set is only ever extended or filtered; a panic elsewhere leaves it usable.
        self.known.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn saturating_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    #[test]
    fn series_follow_the_quotas_and_their_caps() {
        let mut registry = Registry::default();
        let metrics = QuotaMetrics::default();
        metrics.register(registry.sub_registry_with_prefix("kerf_controller"));
        let amount = GpuAmount {
            memory_bytes: 1 << 30,
            compute: 50,
            gpus: 1,
        };
        metrics.set("team-a", "q", amount, Some((amount, [true, false, true])));
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        assert!(text.contains(r#"kerf_controller_quota_used{namespace="team-a",quota="q",resource="memory"} 1073741824"#), "{text}");
        assert!(
            text.contains(
                r#"kerf_controller_quota_hard{namespace="team-a",quota="q",resource="gpus"} 1"#
            ),
            "{text}"
        );
        assert!(
            !text.contains(r#"quota_hard{namespace="team-a",quota="q",resource="compute"}"#),
            "{text}"
        );
        metrics.retain(&BTreeSet::new());
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        assert!(!text.contains("team-a"), "{text}");
    }
}
