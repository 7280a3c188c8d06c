//! The GPU fragmentation of each node pool (`kerf_controller_pool_*_gpus`), as the
//! LeastFragmentation policy measures it (`kerf_core::alloc::node_fragmentation`) against the
//! pod kinds the controller has learned.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Labels of a node pool's series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
}

/// One pool's GPUs, in whole-GPU units: each GPU counts the smaller of its free memory and
/// free compute fractions.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolFragmentation {
    /// Nodes of the pool with kerf GPUs.
    pub nodes: u32,
    /// Free GPU capacity.
    pub free_gpus: f64,
    /// The part of it the expected pod could not use (FGD's measure); `None` until the
    /// controller has seen a pod to expect.
    pub fragmented_gpus: Option<f64>,
    /// The part of it the nodes' free CPU and memory cannot feed; `None` as above.
    pub stranded_gpus: Option<f64>,
}

/// The per-pool gauges; clones record into the same series.
#[derive(Debug, Clone, Default)]
pub(crate) struct PoolMetrics {
    nodes: Family<PoolLabels, Gauge>,
    free: Family<PoolLabels, Gauge<f64, AtomicU64>>,
    fragmented: Family<PoolLabels, Gauge<f64, AtomicU64>>,
    stranded: Family<PoolLabels, Gauge<f64, AtomicU64>>,
}

impl PoolMetrics {
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "pool_nodes",
            "Nodes with kerf GPUs in each node pool",
            self.nodes.clone(),
        );
        registry.register(
            "pool_free_gpus",
            "Free GPU capacity of each node pool, in GPUs (per GPU the smaller free share of memory and compute)",
            self.free.clone(),
        );
        registry.register(
            "pool_fragmented_gpus",
            "Free GPU capacity of each node pool that the pods seen could not use, in GPUs",
            self.fragmented.clone(),
        );
        registry.register(
            "pool_stranded_gpus",
            "Free GPU capacity of each node pool that its nodes' free CPU and memory cannot feed, in GPUs",
            self.stranded.clone(),
        );
    }

    /// Replaces every pool's series: pools no longer present lose theirs.
    pub(crate) fn set(&self, pools: &BTreeMap<String, PoolFragmentation>) {
        for family in [&self.free, &self.fragmented, &self.stranded] {
            family.clear();
        }
        self.nodes.clear();
        for (pool, measured) in pools {
            let labels = PoolLabels { pool: pool.clone() };
            self.nodes
                .get_or_create(&labels)
                .set(i64::from(measured.nodes));
            self.free.get_or_create(&labels).set(measured.free_gpus);
            if let Some(gpus) = measured.fragmented_gpus {
                self.fragmented.get_or_create(&labels).set(gpus);
            }
            if let Some(gpus) = measured.stranded_gpus {
                self.stranded.get_or_create(&labels).set(gpus);
            }
        }
    }
}
