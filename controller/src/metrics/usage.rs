//! How full each GPU is, and what each GpuClass and namespace holds
//! (`kerf_controller_gpu_*`, `kerf_controller_class_*_allocated_*`,
//! `kerf_controller_namespace_*`), and the claims waiting for an allocation
//! (`kerf_controller_unallocated_claims`, `kerf_controller_unallocated_claim_age_seconds`): set
//! by the claim controller's usage pass from the caches (`crate::claims::usage`).

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::capacity::{Held, Holdings};

use super::saturating_i64;

/// Labels of a GPU's series: where it is and what it is.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    node: String,
    gpu: String,
    uuid: String,
    product: String,
}

/// Labels of a class's series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabels {
    class: String,
}

/// Labels of a namespace's series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NamespaceLabels {
    namespace: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// Memory, compute and slices held by one kind of owner.
#[derive(Debug, Clone)]
struct HeldGauges<L> {
    memory: Family<L, Gauge>,
    compute: Family<L, FloatGauge>,
    slices: Family<L, Gauge>,
}

impl<L> Default for HeldGauges<L>
where
    L: Clone + std::hash::Hash + Eq,
{
    fn default() -> Self {
        Self {
            memory: Family::default(),
            compute: Family::default(),
            slices: Family::default(),
        }
    }
}

impl<L> HeldGauges<L>
where
    L: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static,
{
    fn register(&self, registry: &mut Registry, owner: &str, whose: &str) {
        registry.register(
            format!("{owner}_memory_allocated_bytes"),
            format!("GPU memory the allocations of {whose} hold"),
            self.memory.clone(),
        );
        registry.register(
            format!("{owner}_compute_allocated_gpus"),
            format!(
                "GPU compute the allocations of {whose} hold, in GPUs (1.0 is one GPU's multiprocessors)"
            ),
            self.compute.clone(),
        );
        registry.register(
            format!("{owner}_allocated_slices"),
            format!(
                "Devices and slices allocated to {whose} (a whole device counts one, each slice or share one)"
            ),
            self.slices.clone(),
        );
    }

    fn replace<'a>(&self, held: impl IntoIterator<Item = (L, &'a Held)>) {
        self.memory.clear();
        self.compute.clear();
        self.slices.clear();
        for (labels, held) in held {
            self.memory
                .get_or_create(&labels)
                .set(saturating_i64(held.memory_bytes));
            self.compute
                .get_or_create(&labels)
                .set(percent_to_ratio(held.compute_percent));
            self.slices
                .get_or_create(&labels)
                .set(saturating_i64(held.slices));
        }
    }
}

/// The usage gauges; clones record into the same series.
#[derive(Debug, Clone, Default)]
pub(crate) struct UsageMetrics {
    gpu_memory: Family<GpuLabels, Gauge>,
    gpu_memory_allocated: Family<GpuLabels, Gauge>,
    gpu_compute_allocated: Family<GpuLabels, FloatGauge>,
    gpu_slices: Family<GpuLabels, Gauge>,
    classes: HeldGauges<ClassLabels>,
    namespaces: HeldGauges<NamespaceLabels>,
    unallocated: Gauge,
    unallocated_age: FloatGauge,
}

impl UsageMetrics {
    /// Registers the gauges in `registry` (the controller's prefixed one).
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "gpu_memory_bytes",
            "Memory of each published GPU or MIG device",
            self.gpu_memory.clone(),
        );
        registry.register(
            "gpu_memory_allocated_bytes",
            "Memory of each published GPU or MIG device that allocations hold",
            self.gpu_memory_allocated.clone(),
        );
        registry.register(
            "gpu_compute_allocated_ratio",
            "Share of each published GPU's or MIG device's multiprocessors that allocations hold (0 to 1)",
            self.gpu_compute_allocated.clone(),
        );
        registry.register(
            "gpu_allocated_slices",
            "Allocations holding each published GPU or MIG device (a whole device counts one, each slice or share one)",
            self.gpu_slices.clone(),
        );
        self.classes
            .register(registry, "class", "a GpuClass's claims");
        self.namespaces
            .register(registry, "namespace", "a namespace's claims");
        registry.register(
            "unallocated_claims",
            "Claims of kerf's classes that a pod waits for and that have no allocation yet",
            self.unallocated.clone(),
        );
        registry.register(
            "unallocated_claim_age_seconds",
            "How long the oldest of the unallocated claims has waited, from the later of its and its pod's creation (0 when none waits)",
            self.unallocated_age.clone(),
        );
    }

    /// Replaces every GPU, class and namespace series with `holdings`.
    pub(crate) fn set_holdings(&self, holdings: &Holdings) {
        for family in [
            &self.gpu_memory,
            &self.gpu_memory_allocated,
            &self.gpu_slices,
        ] {
            family.clear();
        }
        self.gpu_compute_allocated.clear();
        for device in &holdings.devices {
            let labels = GpuLabels {
                node: device.node.clone(),
                gpu: device.device.clone(),
                uuid: device.uuid.clone(),
                product: device.product.clone(),
            };
            self.gpu_memory
                .get_or_create(&labels)
                .set(saturating_i64(device.memory_bytes));
            self.gpu_memory_allocated
                .get_or_create(&labels)
                .set(saturating_i64(device.memory_allocated_bytes));
            self.gpu_compute_allocated
                .get_or_create(&labels)
                .set(f64::from(device.compute_allocated_percent) / 100.0);
            self.gpu_slices
                .get_or_create(&labels)
                .set(saturating_i64(device.slices));
        }
        self.classes
            .replace(holdings.classes.iter().map(|(class, held)| {
                (
                    ClassLabels {
                        class: class.clone(),
                    },
                    held,
                )
            }));
        self.namespaces
            .replace(holdings.namespaces.iter().map(|(namespace, held)| {
                (
                    NamespaceLabels {
                        namespace: namespace.clone(),
                    },
                    held,
                )
            }));
    }

    /// Sets how many claims wait for an allocation and how long the oldest has waited.
    pub(crate) fn set_unallocated(&self, claims: usize, oldest: std::time::Duration) {
        self.unallocated
            .set(i64::try_from(claims).unwrap_or(i64::MAX));
        self.unallocated_age.set(oldest.as_secs_f64());
    }
}

/// Percent of one GPU to GPUs; exact for any realistic sum (below 2^53 percent).
#[allow(clippy::cast_precision_loss)]
fn percent_to_ratio(percent: u64) -> f64 {
    percent as f64 / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capacity::DeviceFill;
    use prometheus_client::encoding::text::encode;

    #[test]
    fn gpus_classes_and_namespaces_have_one_series_each() {
        let mut registry = Registry::default();
        let metrics = UsageMetrics::default();
        metrics.register(registry.sub_registry_with_prefix("kerf_controller"));
        let held = Held {
            memory_bytes: 10,
            compute_percent: 150,
            slices: 2,
        };
        let mut holdings = Holdings {
            devices: vec![DeviceFill {
                node: "n1".into(),
                device: "gpu-0".into(),
                uuid: "GPU-1".into(),
                product: "NVIDIA L4".into(),
                memory_bytes: 100,
                memory_allocated_bytes: 10,
                compute_allocated_percent: 25,
                slices: 2,
            }],
            classes: [("l4".to_owned(), held)].into(),
            namespaces: [("team-a".to_owned(), held)].into(),
        };
        metrics.set_holdings(&holdings);
        metrics.set_unallocated(1, std::time::Duration::from_secs(3));
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for line in [
            r#"kerf_controller_gpu_compute_allocated_ratio{node="n1",gpu="gpu-0",uuid="GPU-1",product="NVIDIA L4"} 0.25"#,
            r#"kerf_controller_gpu_memory_bytes{node="n1",gpu="gpu-0",uuid="GPU-1",product="NVIDIA L4"} 100"#,
            r#"kerf_controller_class_compute_allocated_gpus{class="l4"} 1.5"#,
            r#"kerf_controller_namespace_allocated_slices{namespace="team-a"} 2"#,
            "kerf_controller_unallocated_claims 1",
            "kerf_controller_unallocated_claim_age_seconds 3.0",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        holdings.devices.clear();
        holdings.namespaces.clear();
        metrics.set_holdings(&holdings);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        assert!(!text.contains("gpu-0"), "{text}");
        assert!(!text.contains("team-a"), "{text}");
    }
}
