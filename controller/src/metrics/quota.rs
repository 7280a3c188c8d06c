//! The GpuQuota recount's gauges, part of the controller's [`crate::Metrics`], labelled
//! `namespace` and `quota`, one name per unit: `kerf_controller_quota_used_memory_bytes`,
//! `kerf_controller_quota_used_compute_gpus` (1.0 is one GPU's multiprocessors) and
//! `kerf_controller_quota_used_gpus` (whole GPUs and MIG devices), and the same three with
//! `hard` for the quota's caps, which have a series only for the resources the quota caps.

use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};

use kerf_api::gpuquota::GpuAmount;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::saturating_i64;

/// Labels of a quota series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuotaLabels {
    namespace: String,
    quota: String,
}

/// `namespace/name` of a quota with series.
type QuotaKey = (String, String);

/// One gauge per resource of a GpuQuota, each in its own unit.
#[derive(Clone, Debug, Default)]
struct AmountGauges {
    memory_bytes: Family<QuotaLabels, Gauge>,
    compute_gpus: Family<QuotaLabels, Gauge<f64, AtomicU64>>,
    gpus: Family<QuotaLabels, Gauge>,
}

impl AmountGauges {
    fn register(&self, registry: &mut Registry, prefix: &str, what: &str) {
        registry.register(
            format!("{prefix}_memory_bytes"),
            format!("GPU memory {what}"),
            self.memory_bytes.clone(),
        );
        registry.register(
            format!("{prefix}_compute_gpus"),
            format!("GPU compute {what}, in GPUs (1.0 is one GPU's multiprocessors)"),
            self.compute_gpus.clone(),
        );
        registry.register(
            format!("{prefix}_gpus"),
            format!("Whole GPUs and MIG devices {what}"),
            self.gpus.clone(),
        );
    }

    /// Sets the resources that are `Some`, drops the series of the others.
    fn set(&self, labels: &QuotaLabels, values: [Option<u64>; 3]) {
        let [memory, compute, gpus] = values;
        set_or_remove(&self.memory_bytes, labels, memory.map(saturating_i64));
        // Percent of a GPU to GPUs: exact enough for any quota (below 2^53 percent).
        #[allow(clippy::cast_precision_loss)]
        let compute = compute.map(|percent| percent as f64 / 100.0);
        set_or_remove(&self.compute_gpus, labels, compute);
        set_or_remove(&self.gpus, labels, gpus.map(saturating_i64));
    }

    fn remove(&self, labels: &QuotaLabels) {
        self.memory_bytes.remove(labels);
        self.compute_gpus.remove(labels);
        self.gpus.remove(labels);
    }
}

fn set_or_remove<N, A>(
    family: &Family<QuotaLabels, Gauge<N, A>>,
    labels: &QuotaLabels,
    value: Option<N>,
) where
    Gauge<N, A>: Default,
    A: prometheus_client::metrics::gauge::Atomic<N>,
{
    match value {
        Some(value) => {
            family.get_or_create(labels).set(value);
        }
        None => {
            family.remove(labels);
        }
    }
}

/// The quota gauges; clones record into the same series.
#[derive(Clone, Debug, Default)]
pub(crate) struct QuotaMetrics {
    used: AmountGauges,
    hard: AmountGauges,
    /// Quotas that have series: a `Family` cannot list its label sets.
    known: Arc<Mutex<BTreeSet<QuotaKey>>>,
}

impl QuotaMetrics {
    /// Registers the gauges in `registry` (the controller's prefixed one).
    pub(crate) fn register(&self, registry: &mut Registry) {
        self.used.register(
            registry,
            "quota_used",
            "the ResourceClaims of a GpuQuota's namespace hold",
        );
        self.hard.register(
            registry,
            "quota_hard",
            "a GpuQuota caps its namespace to (only the resources it caps)",
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
        let labels = QuotaLabels {
            namespace: namespace.to_owned(),
            quota: name.to_owned(),
        };
        self.used.set(&labels, values(used).map(Some));
        let hard = hard.map_or([None; 3], |(amount, capped)| {
            let values = values(amount);
            [0, 1, 2].map(|i| capped[i].then_some(values[i]))
        });
        self.hard.set(&labels, hard);
    }

    /// Drops the series of every quota not in `quotas` (deleted GpuQuotas).
    pub(crate) fn retain(&self, quotas: &BTreeSet<QuotaKey>) {
        self.lock().retain(|(namespace, quota)| {
            if quotas.contains(&(namespace.clone(), quota.clone())) {
                return true;
            }
            let labels = QuotaLabels {
                namespace: namespace.clone(),
                quota: quota.clone(),
            };
            self.used.remove(&labels);
            self.hard.remove(&labels);
            false
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<QuotaKey>> {
        // The set is only ever extended or filtered; a panic elsewhere leaves it usable.
        self.known.lock().unwrap_or_else(PoisonError::into_inner)
    }
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
        assert!(
            text.contains(
                r#"kerf_controller_quota_used_memory_bytes{namespace="team-a",quota="q"} 1073741824"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kerf_controller_quota_used_compute_gpus{namespace="team-a",quota="q"} 0.5"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"kerf_controller_quota_hard_gpus{namespace="team-a",quota="q"} 1"#),
            "{text}"
        );
        assert!(
            !text.contains(r#"quota_hard_compute_gpus{namespace="team-a""#),
            "{text}"
        );
        metrics.retain(&BTreeSet::new());
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        assert!(!text.contains("team-a"), "{text}");
    }
}
