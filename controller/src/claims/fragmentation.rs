//! The fragmentation of each node pool, measured every `fragmentation_interval` for the
//! `kerf_controller_pool_*_gpus` metrics: per node of kerf's inventory,
//! `kerf_core::alloc::node_fragmentation` against the pod kinds learned so far
//! (`super::pod_kinds`) with the node's free CPU and memory from its books
//! (`super::node_usage`), summed per pool (the node label `ControllerConfig::node_pool_label`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Node;
use kerf_api::node_pool::{UNLABELED_POOL, pool_of};
use kerf_core::alloc::node_fragmentation;
use kube::runtime::reflector::ObjectRef;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::claims::ClaimsContext;
use crate::metrics::PoolFragmentation;

/// Measures the pools, and the usage (`super::usage`), and sets their metrics every
/// `fragmentation_interval` until `shutdown`; an interval of zero measures nothing.
pub(super) async fn run(ctx: Arc<ClaimsContext>, shutdown: CancellationToken) {
    let every = ctx.core.config.claims.fragmentation_interval;
    if every.is_zero() {
        return;
    }
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => {}
        }
        ctx.core
            .metrics
            .set_pool_fragmentation(&measure_pools(&ctx));
        super::usage::measure(&ctx);
    }
}

/// Every pool's free, fragmented and stranded GPUs now.
fn measure_pools(ctx: &ClaimsContext) -> BTreeMap<String, PoolFragmentation> {
    let workload = ctx.pod_kinds.distribution();
    let known = !workload.is_empty();
    let books = ctx.books();
    let usage = ctx.node_usage.read(Instant::now());
    let label = ctx.core.config.node_pool_label.as_str();
    let mut pools: BTreeMap<String, PoolFragmentation> = BTreeMap::new();
    for node in books.index().nodes() {
        let name = node.name();
        let host = usage.host(name).map(|state| state.free());
        let Some(measured) = node_fragmentation(books.index(), name, host, &workload) else {
            continue;
        };
        let pool = ctx.nodes.get(&ObjectRef::<Node>::new(name)).map_or_else(
            || UNLABELED_POOL.to_owned(),
            |node| pool_of(node.metadata.labels.as_ref(), label).to_owned(),
        );
        let sum = pools.entry(pool).or_default();
        sum.nodes += 1;
        sum.free_gpus += measured.free_gpus;
        if known {
            *sum.fragmented_gpus.get_or_insert(0.0) += measured.fragmented_gpus;
            *sum.stranded_gpus.get_or_insert(0.0) += measured.stranded_gpus;
        }
    }
    pools
}
