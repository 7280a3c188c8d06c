//! The configuration values of the controllers ([`ControllerConfig`]): one leaf that the
//! context, the argument parser and each controller read, so that none of them needs another's
//! module for its settings.

use std::time::Duration;

use crate::backoff::BackoffConfig;

/// Field manager of every write of the controller: server-side apply, merge patches, creates
/// and Events. The default of [`ControllerConfig::field_manager`], through which it is passed.
pub const FIELD_MANAGER: &str = "kerf-controller";

/// Configuration the reconcilers read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerConfig {
    /// DRA driver name, e.g. `gpu.kerf.dev`.
    pub driver_name: String,
    /// Field manager of every write (see [`FIELD_MANAGER`]), reporting controller of Events,
    /// and `app.kubernetes.io/managed-by` of DeviceClasses.
    pub field_manager: String,
    /// How often every object is reconciled even without a change.
    pub resync_period: Duration,
    /// Shortest time between two refreshes of every GpuClass status after cache changes: the
    /// free capacity a status shows may lag this much behind the claims.
    pub class_status_interval: Duration,
    /// Retry delays after a failed reconcile.
    pub backoff: BackoffConfig,
    /// Identity of this replica in Events (`reportingInstance`), usually the pod name.
    pub instance: Option<String>,
    /// Timing of the ResourceClaim allocation controller.
    pub claims: ClaimSettings,
    /// Timing of the GpuQuota recount.
    pub quota: QuotaSettings,
    /// The node label whose value names a node's pool in the fragmentation metrics
    /// (`kerf_api::node_pool`).
    pub node_pool_label: String,
}

impl ControllerConfig {
    /// The defaults of the command-line flags for `driver_name`.
    pub fn new(driver_name: impl Into<String>) -> Self {
        Self {
            driver_name: driver_name.into(),
            field_manager: FIELD_MANAGER.to_owned(),
            resync_period: Duration::from_secs(600),
            class_status_interval: Duration::from_secs(1),
            backoff: BackoffConfig::default(),
            instance: None,
            claims: ClaimSettings::default(),
            quota: QuotaSettings::default(),
            node_pool_label: kerf_api::node_pool::DEFAULT_NODE_POOL_LABEL.to_owned(),
        }
    }
}

/// Timing of the claim reconciler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimSettings {
    /// How long a node the scheduler rejected is avoided for that pod the first time; it
    /// doubles with each further rejection of the same node for the same pod.
    pub rejection_backoff: Duration,
    /// Longest time a rejected node is avoided.
    pub rejection_backoff_max: Duration,
    /// When to try again after nothing fitted.
    pub unplaceable_retry: Duration,
    /// When to look again at a pod whose claims do not all exist yet.
    pub pending_retry: Duration,
    /// Fences and lingering of ownership moves.
    pub ownership: OwnershipTiming,
    /// The shortest time between two ownership passes; a pass runs only when its inputs
    /// changed or a fence or linger is due (`crate::claims::ownership`).
    pub ownership_tick: Duration,
    /// How long a pod the controller placed counts on its node before kube-scheduler binds it
    /// (its requests and host ports, `crate::claims` node usage); zero: until bound, deleted or
    /// placed again.
    pub assumed_pod_ttl: Duration,
    /// After this many rejections by kube-scheduler still remembered for one pod (filters the
    /// controller does not model), the pod is not placed again until they are forgotten; a
    /// Warning says so. Zero: no bound.
    pub max_node_rejections: u32,
    /// How often the fragmentation of each node pool, and the usage of each GPU, class and
    /// namespace, are measured for the metrics; zero: never.
    pub fragmentation_interval: Duration,
    /// Keep the `PreferNoSchedule` taint `gpu.kerf.dev/idle-gpus` on the nodes with an idle
    /// GPU (`crate::claims` idle-GPU taint); off: take it off where an earlier run left it.
    pub idle_gpus_taint: bool,
}

impl Default for ClaimSettings {
    fn default() -> Self {
        ClaimSettings {
            rejection_backoff: Duration::from_secs(5),
            rejection_backoff_max: Duration::from_secs(300),
            unplaceable_retry: Duration::from_secs(30),
            pending_retry: Duration::from_secs(2),
            ownership: OwnershipTiming::default(),
            ownership_tick: Duration::from_millis(500),
            assumed_pod_ttl: Duration::from_secs(300),
            max_node_rejections: 10,
            fragmentation_interval: Duration::from_secs(15),
            idle_gpus_taint: true,
        }
    }
}

/// Timing of ownership moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnershipTiming {
    /// How long after observing a device republished as the controller's the controller
    /// waits before placing on it: allocations the scheduler had decided before then land.
    pub settle: Duration,
    /// How long a scheduler-owned device stays idle before it returns to the controller when
    /// no controller claim is waiting for capacity.
    pub linger: Duration,
}

impl Default for OwnershipTiming {
    fn default() -> Self {
        OwnershipTiming {
            settle: Duration::from_secs(10),
            linger: Duration::from_secs(30),
        }
    }
}

/// How the recount runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaSettings {
    /// How often every GpuQuota is recounted even without a change: the longest a quota stays
    /// wrong after a missed event.
    pub resync: Duration,
    /// How long an admitted charge counts before the claim reaches the controller's cache
    /// (`kerf_api::gpuquota::ADMITTED_GRACE`; shorter in tests).
    pub admitted_grace: Duration,
}

impl Default for QuotaSettings {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(300),
            admitted_grace: kerf_api::gpuquota::ADMITTED_GRACE,
        }
    }
}
