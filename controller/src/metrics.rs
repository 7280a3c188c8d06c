//! Prometheus metrics of the controller.
//!
//! Every metric lives in a [`Registry`] the caller owns (no process-wide globals), under the
//! prefix `kerf_controller_`. [`Metrics`] is a cheap handle: clones record into the same series.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `reconcile_total` | counter | `controller`, `result` (`ok`/`error`), `reason` |
//! | `reconcile_duration_seconds` | histogram | `controller` |
//! | `class_matching_devices` | gauge | `class` |
//! | `class_total_memory_bytes` | gauge | `class` |
//! | `class_free_memory_bytes` | gauge | `class` |
//! | `class_free_compute_gpus` | gauge | `class` |
//! | `allocations_total` | counter | `result`, `reason` |
//! | `allocation_duration_seconds` | histogram | – |
//! | `pod_allocation_duration_seconds` | histogram | – (10 ms to about 5 min) |
//! | `leader` | gauge | – |
//! | `admissions_total` | counter | `outcome` (`gated`/`not_gated`/`error`) |
//! | `claim_admissions_total` | counter | `resource` (`resourceclaims`/`resourceclaimtemplates`), `outcome` (`normalized`/`no_kerf_config`/`denied`/`error`) |
//! | `webhook_serving` | gauge | `address` (only with the webhook) |
//! | `quota_admissions_total` | counter | `outcome` (`charged`/`not_charged`/`denied`/`error`) |
//! | `ownership_moves_total` | counter | `to` (`scheduler`/`controller`) |
//! | `ownership_devices` | gauge | `owner` (`scheduler`/`controller`/`settling`) |
//! | `ownership_passes_total` | counter | – |
//! | `claim_node_labels_total` | counter | `action` (`set`/`removed`) |
//! | `idle_gpus_taints_total` | counter | `action` (`set`/`removed`): writes of the node taint `gpu.kerf.dev/idle-gpus` |
//! | `quota_used_memory_bytes`, `quota_used_compute_gpus`, `quota_used_gpus` | gauge | `namespace`, `quota` |
//! | `quota_hard_memory_bytes`, `quota_hard_compute_gpus`, `quota_hard_gpus` | gauge | `namespace`, `quota` (capped resources only) |
//! | `pool_nodes` | gauge | `pool` (the node label `--node-pool-label`, `unlabeled` without it) |
//! | `pool_free_gpus` | gauge | `pool` |
//! | `pool_fragmented_gpus` | gauge | `pool` |
//! | `pool_stranded_gpus` | gauge | `pool` |
//! | `gpu_memory_bytes`, `gpu_memory_allocated_bytes`, `gpu_compute_allocated_ratio`, `gpu_allocated_slices` | gauge | `node`, `gpu`, `uuid`, `product` |
//! | `class_memory_allocated_bytes`, `class_compute_allocated_gpus`, `class_allocated_slices` | gauge | `class` |
//! | `namespace_memory_allocated_bytes`, `namespace_compute_allocated_gpus`, `namespace_allocated_slices` | gauge | `namespace` |
//! | `unallocated_claims`, `unallocated_claim_age_seconds` | gauge | – |
//!
//! `docs/metrics.md` is the full reference, generated from the registry
//! ([`reference_registry`]).
//!
//! One series has no `kerf_controller_` prefix, because it counts what kerf as a whole must
//! never do: `kerf_allocation_conflicts_total` (counter, `allocator` of the other claim:
//! `scheduler`/`controller`), a device found in two exclusive allocations. Neither has
//! `kerf_api_write_failures_total{component="controller",resource,reason}`, which the kubelet
//! plugin counts too: writes the API server would not take and that were reported as Warning
//! Events ([`kerf_ops::write_failures`]).

use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use kerf_ops::write_failures::ApiWriteFailures;

use crate::capacity::ClassCapacity;

mod pools;
mod quota;
mod reference;
mod usage;

pub use pools::PoolFragmentation;
use pools::PoolMetrics;
pub(crate) use quota::QuotaMetrics;
pub use reference::reference_registry;
use usage::UsageMetrics;

/// `action` label of a write that set a label or taint (or changed its value).
pub const ACTION_SET: &str = "set";
/// `action` label of a write that removed a label or taint.
pub const ACTION_REMOVED: &str = "removed";

/// Prefix of every metric of the controller (an underscore is added by the registry).
const PREFIX: &str = "kerf_controller";

/// Labels of a reconcile outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReconcileLabels {
    controller: &'static str,
    result: &'static str,
    reason: &'static str,
}

/// Labels of per-controller series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: &'static str,
}

/// Labels of per-class series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct ClassLabels {
    class: String,
}

/// Labels of an admission review's outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AdmissionLabels {
    outcome: &'static str,
}

/// Labels of a claim or template admission review.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimAdmissionLabels {
    resource: &'static str,
    outcome: &'static str,
}

/// Labels of the webhook's serving gauge: the address it listens on.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WebhookLabels {
    address: String,
}

/// Labels of an ownership series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OwnerLabels {
    owner: &'static str,
}

/// Labels of an ownership move.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MoveLabels {
    to: &'static str,
}

/// Labels of a write of a claim node label or of the idle-GPU node taint.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LabelActionLabels {
    action: &'static str,
}

/// Labels of an allocation conflict.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConflictLabels {
    allocator: &'static str,
}

/// Labels of an allocation outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    result: &'static str,
    reason: &'static str,
}

fn outcome(result: Result<(), &'static str>) -> (&'static str, &'static str) {
    match result {
        Ok(()) => ("ok", ""),
        Err(reason) => ("error", reason),
    }
}

/// Buckets from 1 ms to about 65 s: a reconcile that only reads caches takes milliseconds, one
/// that waits for a slow API server takes seconds, and both ends matter.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// Handles to all metrics of the controller.
#[derive(Clone, Debug)]
pub struct Metrics {
    reconciles: Family<ReconcileLabels, Counter>,
    reconcile_duration: Family<ControllerLabels, Histogram>,
    class_devices: Family<ClassLabels, Gauge>,
    class_total_memory: Family<ClassLabels, Gauge>,
    class_free_memory: Family<ClassLabels, Gauge>,
    class_free_compute: Family<ClassLabels, Gauge<f64, AtomicU64>>,
    allocations: Family<OutcomeLabels, Counter>,
    allocation_duration: Histogram,
    pod_allocation_duration: Histogram,
    leader: Gauge,
    admissions: Family<AdmissionLabels, Counter>,
    claim_admissions: Family<ClaimAdmissionLabels, Counter>,
    quota_admissions: Family<AdmissionLabels, Counter>,
    webhook_serving: Family<WebhookLabels, Gauge>,
    ownership_moves: Family<MoveLabels, Counter>,
    ownership_devices: Family<OwnerLabels, Gauge>,
    ownership_passes: Counter,
    conflicts: Family<ConflictLabels, Counter>,
    claim_node_labels: Family<LabelActionLabels, Counter>,
    idle_gpus_taints: Family<LabelActionLabels, Counter>,
    write_failures: ApiWriteFailures,
    quota: QuotaMetrics,
    pools: PoolMetrics,
    usage: UsageMetrics,
    /// Classes that have per-class series: a `Family` cannot list its label sets.
    classes: Arc<Mutex<BTreeSet<String>>>,
}

impl Metrics {
    /// Creates the metrics and registers them in `registry` under the `kerf_controller_` prefix.
    pub fn new(registry: &mut Registry) -> Self {
        let metrics = Self {
            reconciles: Family::default(),
            reconcile_duration: Family::new_with_constructor(latency_histogram),
            class_devices: Family::default(),
            class_total_memory: Family::default(),
            class_free_memory: Family::default(),
            class_free_compute: Family::default(),
            allocations: Family::default(),
            allocation_duration: latency_histogram(),
            pod_allocation_duration: Histogram::new(exponential_buckets(0.01, 2.0, 16)),
            leader: Gauge::default(),
            admissions: Family::default(),
            claim_admissions: Family::default(),
            quota_admissions: Family::default(),
            webhook_serving: Family::default(),
            ownership_moves: Family::default(),
            ownership_devices: Family::default(),
            ownership_passes: Counter::default(),
            conflicts: Family::default(),
            claim_node_labels: Family::default(),
            idle_gpus_taints: Family::default(),
            write_failures: ApiWriteFailures::new("controller", registry),
            quota: QuotaMetrics::default(),
            pools: PoolMetrics::default(),
            usage: UsageMetrics::default(),
            classes: Arc::default(),
        };
        registry.register(
            "kerf_allocation_conflicts",
            "Devices found in two exclusive allocations, by the allocator of the other claim",
            metrics.conflicts.clone(),
        );
        metrics.register(registry.sub_registry_with_prefix(PREFIX));
        metrics
    }

    fn register(&self, registry: &mut Registry) {
        self.register_classes(registry);
        self.register_claims(registry);
        self.register_ownership(registry);
        self.quota.register(registry);
        self.pools.register(registry);
        self.usage.register(registry);
    }

    /// Replaces the fragmentation series of every node pool.
    pub fn set_pool_fragmentation(
        &self,
        pools: &std::collections::BTreeMap<String, PoolFragmentation>,
    ) {
        self.pools.set(pools);
    }

    /// The GpuQuota recount's gauges.
    pub(crate) fn quota(&self) -> &QuotaMetrics {
        &self.quota
    }

    /// The usage pass's gauges: each GPU's fill, each class's and namespace's holdings, the
    /// claims waiting for an allocation.
    pub(crate) fn usage(&self) -> &UsageMetrics {
        &self.usage
    }

    /// The reconcile and GpuClass status series.
    fn register_classes(&self, registry: &mut Registry) {
        registry.register(
            "reconcile",
            "Reconciles, by controller, result and error reason",
            self.reconciles.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time one reconcile took, by controller",
            self.reconcile_duration.clone(),
        );
        registry.register(
            "class_matching_devices",
            "Published devices a GpuClass selects",
            self.class_devices.clone(),
        );
        registry.register(
            "class_total_memory_bytes",
            "Memory of the devices a GpuClass selects",
            self.class_total_memory.clone(),
        );
        registry.register(
            "class_free_memory_bytes",
            "Memory of the devices a GpuClass selects that no allocation uses",
            self.class_free_memory.clone(),
        );
        registry.register(
            "class_free_compute_gpus",
            "Unallocated compute of the devices a GpuClass selects, in whole-GPU units",
            self.class_free_compute.clone(),
        );
    }

    /// The allocation, leader and admission series.
    fn register_claims(&self, registry: &mut Registry) {
        registry.register(
            "allocations",
            "Claim allocations attempted by the controller, by result and error reason",
            self.allocations.clone(),
        );
        registry.register(
            "allocation_duration_seconds",
            "Time from picking up a claim to its allocation being written",
            self.allocation_duration.clone(),
        );
        registry.register(
            "pod_allocation_duration_seconds",
            "Time from a pod's creation to all its claims being allocated, whoever allocated them (pods this replica saw waiting)",
            self.pod_allocation_duration.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the leader lease, 0 otherwise",
            self.leader.clone(),
        );
        registry.register(
            "admissions",
            "Pods reviewed by the admission webhook, by outcome (gated, not_gated, error)",
            self.admissions.clone(),
        );
        registry.register(
            "claim_admissions",
            "ResourceClaims and ResourceClaimTemplates reviewed by the admission webhook, by resource and outcome (normalized, no_kerf_config, denied, error)",
            self.claim_admissions.clone(),
        );
        registry.register(
            "quota_admissions",
            "ResourceClaims checked against GpuQuotas by the admission webhook, by outcome (charged, not_charged, denied, error)",
            self.quota_admissions.clone(),
        );
        registry.register(
            "webhook_serving",
            "1 while this replica serves the admission webhook on address, 0 while it does not (no series without a webhook)",
            self.webhook_serving.clone(),
        );
    }

    /// The device ownership and claim node label series.
    fn register_ownership(&self, registry: &mut Registry) {
        registry.register(
            "ownership_moves",
            "Devices given to a new owner, by the new owner",
            self.ownership_moves.clone(),
        );
        registry.register(
            "ownership_devices",
            "Devices by owner; settling: taken by the controller, fence not passed yet",
            self.ownership_devices.clone(),
        );
        registry.register(
            "ownership_passes",
            "Ownership passes run: one per change of their inputs or due fence or linger, not per tick",
            self.ownership_passes.clone(),
        );
        registry.register(
            "claim_node_labels",
            "Writes of the claim node label alone (claims the controller did not allocate), by action",
            self.claim_node_labels.clone(),
        );
        registry.register(
            "idle_gpus_taints",
            "Writes of the node taint gpu.kerf.dev/idle-gpus, by action",
            self.idle_gpus_taints.clone(),
        );
    }

    /// The counter of writes the API server would not take (`kerf_api_write_failures_total`,
    /// `component="controller"`).
    pub fn api_write_failures(&self) -> &ApiWriteFailures {
        &self.write_failures
    }

    /// Counts a write of a claim's node label alone; `action` is `set` or `removed`.
    pub fn record_claim_node_label(&self, action: &'static str) {
        self.claim_node_labels
            .get_or_create(&LabelActionLabels { action })
            .inc();
    }

    /// Counts a write of the idle-GPU node taint; `action` is `set` or `removed`.
    pub fn record_idle_gpus_taint(&self, action: &'static str) {
        self.idle_gpus_taints
            .get_or_create(&LabelActionLabels { action })
            .inc();
    }

    /// Counts a device given to `to` (`scheduler` or `controller`).
    pub fn record_ownership_move(&self, to: &'static str) {
        self.ownership_moves.get_or_create(&MoveLabels { to }).inc();
    }

    /// Counts an ownership pass.
    pub fn record_ownership_pass(&self) {
        self.ownership_passes.inc();
    }

    /// Sets how many devices each owner has (`settling`: the controller's, fence not passed).
    pub fn set_ownership_devices(&self, scheduler: usize, controller: usize, settling: usize) {
        for (owner, count) in [
            ("scheduler", scheduler),
            ("controller", controller),
            ("settling", settling),
        ] {
            self.ownership_devices
                .get_or_create(&OwnerLabels { owner })
                .set(saturating_i64(u64::try_from(count).unwrap_or(u64::MAX)));
        }
    }

    /// Counts a device found in two exclusive allocations; `allocator` made the other one.
    pub fn record_allocation_conflict(&self, allocator: &'static str) {
        self.conflicts
            .get_or_create(&ConflictLabels { allocator })
            .inc();
    }

    /// Records the outcome and duration of one reconcile of `controller`; `result` carries the
    /// error's [`crate::Error::reason`] on failure.
    pub fn record_reconcile(
        &self,
        controller: &'static str,
        result: Result<(), &'static str>,
        elapsed: Duration,
    ) {
        let (result, reason) = outcome(result);
        self.reconciles
            .get_or_create(&ReconcileLabels {
                controller,
                result,
                reason,
            })
            .inc();
        self.reconcile_duration
            .get_or_create(&ControllerLabels { controller })
            .observe(elapsed.as_secs_f64());
    }

    /// Sets the device count and memory gauges of `class`.
    pub fn set_class_capacity(&self, class: &str, capacity: &ClassCapacity) {
        let labels = self.class_labels(class);
        self.class_devices
            .get_or_create(&labels)
            .set(saturating_i64(capacity.matching_devices));
        self.class_total_memory
            .get_or_create(&labels)
            .set(saturating_i64(capacity.total_memory_bytes));
        self.class_free_memory
            .get_or_create(&labels)
            .set(saturating_i64(capacity.free_memory_bytes));
    }

    /// Sets the free compute of `class`, in whole-GPU units (1.0 is one GPU's multiprocessors);
    /// for the allocation controller, which tracks compute shares.
    pub fn set_class_free_compute(&self, class: &str, gpus: f64) {
        self.class_free_compute
            .get_or_create(&self.class_labels(class))
            .set(gpus);
    }

    /// Drops the per-class series of every class not in `classes` (deleted GpuClasses).
    pub fn retain_classes<'a>(&self, classes: impl IntoIterator<Item = &'a str>) {
        let keep: BTreeSet<&str> = classes.into_iter().collect();
        let mut known = self.known_classes();
        known.retain(|class| {
            if keep.contains(class.as_str()) {
                return true;
            }
            let labels = ClassLabels {
                class: class.clone(),
            };
            self.class_devices.remove(&labels);
            self.class_total_memory.remove(&labels);
            self.class_free_memory.remove(&labels);
            self.class_free_compute.remove(&labels);
            false
        });
    }

    fn class_labels(&self, class: &str) -> ClassLabels {
        self.known_classes().insert(class.to_owned());
        ClassLabels {
            class: class.to_owned(),
        }
    }

    fn known_classes(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        // The set is only ever extended or filtered; a panic elsewhere leaves it usable.
        self.classes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the outcome and latency of one claim allocation; `result` carries the error's
    /// reason label on failure (e.g. `no_fit`).
    pub fn record_allocation(&self, result: Result<(), &'static str>, elapsed: Duration) {
        let (result, reason) = outcome(result);
        self.allocations
            .get_or_create(&OutcomeLabels { result, reason })
            .inc();
        self.allocation_duration.observe(elapsed.as_secs_f64());
    }

    /// Records how long a pod waited from its creation until all its claims were allocated.
    pub fn record_pod_allocation(&self, waited: Duration) {
        self.pod_allocation_duration.observe(waited.as_secs_f64());
    }

    /// Counts one admission review with `outcome` (`gated`, `not_gated` or `error`).
    pub fn record_admission(&self, outcome: &'static str) {
        self.admissions
            .get_or_create(&AdmissionLabels { outcome })
            .inc();
    }

    /// Counts one claim or template review of `resource` with `outcome` (`normalized`,
    /// `no_kerf_config`, `denied` or `error`).
    pub fn record_claim_admission(&self, resource: &'static str, outcome: &'static str) {
        self.claim_admissions
            .get_or_create(&ClaimAdmissionLabels { resource, outcome })
            .inc();
    }

    /// Counts one quota review of a claim with `outcome` (`charged`, `not_charged`, `denied`
    /// or `error`).
    pub fn record_quota_admission(&self, outcome: &'static str) {
        self.quota_admissions
            .get_or_create(&AdmissionLabels { outcome })
            .inc();
    }

    /// Sets whether this replica serves the admission webhook on `address`.
    pub fn set_webhook_serving(&self, address: &str, serving: bool) {
        self.webhook_serving
            .get_or_create(&WebhookLabels {
                address: address.to_owned(),
            })
            .set(i64::from(serving));
    }

    /// Sets whether this replica is the leader.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }
}

fn saturating_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests;
