//! A kube-scheduler stand-in for kerf's tests: the parts of kube-scheduler's DynamicResources
//! plugin and of kube-controller-manager's resourceclaim controller that decide which pod gets
//! which device, driven step by step against any API server (in practice
//! [`crate::fake_api::FakeApi`]) so tests can interleave it with kerf-controller
//! deterministically, or run it in the background ([`SchedulerStandIn::spawn`]).
//!
//! It exists because kerf's earlier fakes were kinder than kube-scheduler: on a real 1.36
//! cluster the two allocators gave one GPU to two pods. What it keeps from upstream
//! (kubernetes/kubernetes; each method cites the file and function it imitates):
//! - a cycle decides from a snapshot read at its start ([`SchedulerStandIn::schedule_one`]),
//!   counting a device as in use when any claim's `status.allocation` names it, whoever wrote
//!   it, plus its own in-flight allocations; the snapshot is listed through the client or,
//!   with [`SnapshotSource::Store`], read from the fake API server's store with only changed
//!   objects decoded, as kube-scheduler's informer caches cost;
//! - DeviceClass and request CEL selectors are evaluated by a real CEL interpreter
//!   ([`cel`]); a CEL error aborts the pod's cycle;
//! - Reserve only remembers the allocation; it becomes visible to others at PreBind
//!   ([`SchedulerStandIn::flush_prebinds`]), which may be many steps later;
//! - allocated claims are honoured through their `nodeSelector`, and only get the pod added
//!   to `reservedFor`; a missing `allocationTimestamp` fails PreBind as on 1.36;
//! - pods with scheduling gates or with `spec.nodeName` are never tried;
//! - PostFilter deallocates one unreserved allocated claim of an unschedulable pod;
//! - the resourceclaim controller ([`SchedulerStandIn::run_claim_controller_once`]) drops
//!   stale `reservedFor` entries and deallocates claims carrying the built-in finalizer.
//!
//! Simplifications, documented where they apply: no scoring (a feasible node is picked by the
//! seeded RNG, as upstream's `selectHost` breaks ties at random), no unschedulable queue (every
//! pending pod is a candidate in every cycle: more eager than upstream, never less), node
//! filters limited to `spec.unschedulable`, NoSchedule/NoExecute taints and
//! `spec.nodeSelector` (no node affinity, no resources), first-fit device allocation without
//! backtracking, no `firstAvailable`, constraints, consumable capacity, counters or device
//! taint tolerations. The pod is bound with a merge patch of `spec.nodeName`, because
//! [`crate::fake_api::FakeApi`] has no `pods/binding` subresource.

pub mod cel;
mod snapshot;

pub use snapshot::{SnapshotSource, StoreCaches};

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, NodeSelector, NodeSelectorRequirement, Pod};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult,
    DeviceRequestAllocationResult, ResourceClaim, ResourceClaimConsumerReference,
    ResourceClaimStatus, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kerf_api::node_selection;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use cel::CelCache;
use snapshot::Snapshot;

/// The built-in finalizer kube-scheduler adds to claims it allocates
/// (`resourceapi.Finalizer`); the resourceclaim controller deallocates only such claims.
pub const BUILTIN_FINALIZER: &str = "resource.kubernetes.io/delete-protection";

/// Most `reservedFor` entries a claim may have (`ResourceClaimReservedForMaxSize`).
pub const RESERVED_FOR_MAX: usize = 256;

/// How many times PreBind retries a claim update after a conflict (`retry.DefaultRetry`).
const BIND_RETRIES: usize = 5;

/// A small deterministic RNG (SplitMix64): the same seed gives the same choices.
#[derive(Debug, Clone)]
pub struct SeededRng(u64);

impl SeededRng {
    /// An RNG starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n`; 0 when `n` is 0.
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        // Modulo bias is irrelevant for test scheduling choices.
        usize::try_from(self.next_u64() % (n as u64)).unwrap_or(0)
    }
}

/// Settings of the stand-in.
#[derive(Debug, Clone)]
pub struct StandInConfig {
    /// In [`SchedulerStandIn::step`]: a pod reserved in cycle `k` is PreBound at the start of
    /// cycle `k + prebind_delay_cycles` (at least 1: never in its own cycle).
    pub prebind_delay_cycles: u64,
}

impl Default for StandInConfig {
    fn default() -> Self {
        Self {
            prebind_delay_cycles: 1,
        }
    }
}

/// Settings of [`SchedulerStandIn::spawn`].
#[derive(Debug, Clone, Copy)]
pub struct SpawnConfig {
    /// Seed of the RNG that picks pods and nodes.
    pub seed: u64,
    /// Pause between two scheduling cycles.
    pub interval: Duration,
    /// Reserve → PreBind delay: how long a reservation stays invisible to others.
    pub prebind_delay: Duration,
    /// Whether each loop also runs the resourceclaim controller once.
    pub claim_controller: bool,
}

impl Default for SpawnConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            interval: Duration::from_millis(20),
            prebind_delay: Duration::from_millis(50),
            claim_controller: true,
        }
    }
}

/// What one scheduling cycle did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CycleOutcome {
    /// No pod to schedule.
    Idle,
    /// The pod (`namespace/name`) fits `node`; its allocations wait for PreBind.
    Reserved {
        /// `namespace/name` of the pod.
        pod: String,
        /// The chosen node.
        node: String,
    },
    /// No node fits the pod.
    Unschedulable {
        /// `namespace/name` of the pod.
        pod: String,
        /// Why, in upstream's words where there are some.
        reason: String,
        /// `namespace/name` of the claim PostFilter deallocated, if it did.
        deallocated: Option<String>,
    },
    /// The cycle was aborted (a CEL error, an API error); the pod is retried later.
    Error {
        /// `namespace/name` of the pod.
        pod: String,
        /// What failed.
        message: String,
    },
}

/// What PreBind and binding did for one reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BindOutcome {
    /// Claims written and the pod bound to `node`.
    Bound {
        /// `namespace/name` of the pod.
        pod: String,
        /// The node.
        node: String,
    },
    /// PreBind or binding failed; Unreserve ran and the pod will be tried again.
    Failed {
        /// `namespace/name` of the pod.
        pod: String,
        /// The node that was chosen.
        node: String,
        /// Why, in upstream's words.
        reason: String,
    },
}

/// What one [`SchedulerStandIn::step`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepReport {
    /// Reservations whose PreBind ran at the start of the step.
    pub bound: Vec<BindOutcome>,
    /// The scheduling cycle.
    pub cycle: CycleOutcome,
}

/// One claim of a reservation: the claim as the cycle saw it and, when the stand-in allocated
/// it, the allocation Reserve remembered.
#[derive(Debug, Clone)]
struct ReservedClaim {
    claim: ResourceClaim,
    allocation: Option<AllocationResult>,
}

/// A pod that passed Reserve and waits for PreBind.
#[derive(Debug, Clone)]
struct Reservation {
    pod: Pod,
    node: String,
    claims: Vec<ReservedClaim>,
    cycle: u64,
    at: Instant,
}

/// A device of a ResourceSlice: (driver, pool, device).
type DeviceId = (String, String, String);

/// The kube-scheduler stand-in. See the module documentation.
pub struct SchedulerStandIn {
    client: Client,
    driver: String,
    config: StandInConfig,
    cel: CelCache,
    cycle: u64,
    pending: VecDeque<Reservation>,
    source: SnapshotSource,
}

impl std::fmt::Debug for SchedulerStandIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerStandIn")
            .field("driver", &self.driver)
            .field("config", &self.config)
            .field("cycle", &self.cycle)
            .field("pending", &self.pending_prebinds())
            .finish_non_exhaustive()
    }
}

fn key(namespace: Option<&str>, name: &str) -> String {
    format!("{}/{name}", namespace.unwrap_or_default())
}

fn pod_key(pod: &Pod) -> String {
    key(pod.metadata.namespace.as_deref(), &pod.name_any())
}

fn claim_key(claim: &ResourceClaim) -> String {
    key(claim.metadata.namespace.as_deref(), &claim.name_any())
}

fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 404)
}

fn is_reserved_for(claim: &ResourceClaim, pod: &Pod) -> bool {
    let uid = pod.uid();
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .is_some_and(|r| {
            r.iter()
                .any(|c| c.resource == "pods" && Some(&c.uid) == uid.as_ref())
        })
}

fn allocation_of(claim: &ResourceClaim) -> Option<&AllocationResult> {
    claim.status.as_ref().and_then(|s| s.allocation.as_ref())
}

fn reserved_for(claim: &ResourceClaim) -> &[ResourceClaimConsumerReference] {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_deref())
        .unwrap_or_default()
}

/// Devices named in an allocation.
fn allocated_devices(allocation: &AllocationResult) -> impl Iterator<Item = DeviceId> + '_ {
    allocation
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
        .map(|r| (r.driver.clone(), r.pool.clone(), r.device.clone()))
}

/// Whether `selector` selects `node` (`v1helper.NodeSelectorRequirementsAsSelector` and
/// `MatchNodeSelectorTerms`: terms are ORed, requirements of a term ANDed; `matchFields`
/// supports `metadata.name`).
pub fn node_selector_matches(selector: &NodeSelector, node: &Node) -> bool {
    node_selection::node_selector_matches(selector, node.labels(), &node.name_any())
}

/// The node filters the stand-in runs before DynamicResources' Filter (upstream plugins
/// NodeUnschedulable, TaintToleration and NodeAffinity's `spec.nodeSelector` part).
fn node_fits(pod: &Pod, node: &Node) -> bool {
    let spec = pod.spec.as_ref();
    let node_spec = node.spec.as_ref();
    if node_spec.and_then(|s| s.unschedulable) == Some(true) {
        return false;
    }
    let tolerations = spec
        .and_then(|s| s.tolerations.as_deref())
        .unwrap_or_default();
    let taints = node_spec
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default();
    if node_selection::untolerated_blocking_taint(taints, tolerations).is_some() {
        return false;
    }
    let labels = node.labels();
    spec.and_then(|s| s.node_selector.as_ref())
        .is_none_or(|selector| selector.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

/// Whether a pod is waiting for a scheduler: no node, no gates, not deleted, not finished.
/// Upstream: the scheduler's informer queues only unassigned pods (`assignedPod` in
/// `pkg/scheduler/eventhandlers.go`), and SchedulingGates' `PreEnqueue`
/// (`pkg/scheduler/framework/plugins/schedulinggates/scheduling_gates.go`) keeps a pod with
/// any `spec.schedulingGates` out of the active queue.
fn wants_scheduling(pod: &Pod) -> bool {
    let spec = pod.spec.as_ref();
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    spec.and_then(|s| s.node_name.as_deref())
        .is_none_or(str::is_empty)
        && spec
            .and_then(|s| s.scheduling_gates.as_ref())
            .is_none_or(Vec::is_empty)
        && pod.metadata.deletion_timestamp.is_none()
        && !matches!(phase, Some("Succeeded" | "Failed"))
}

/// `isPodDone` of `pkg/controller/resourceclaim/controller.go`: terminal phase, or deleted
/// and never scheduled.
fn is_pod_done(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed"))
        || (pod.metadata.deletion_timestamp.is_some()
            && pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .is_none_or(str::is_empty))
}

/// The claim names a pod refers to, in `spec.resourceClaims` order; `None` for a template
/// claim whose generated name is not in `status.resourceClaimStatuses` yet.
pub(crate) fn pod_claim_names(pod: &Pod) -> Vec<(String, Option<String>)> {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_deref())
        .unwrap_or_default();
    pod.spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_deref())
        .unwrap_or_default()
        .iter()
        .map(|c| {
            let name = c.resource_claim_name.clone().or_else(|| {
                statuses
                    .iter()
                    .find(|s| s.name == c.name)
                    .and_then(|s| s.resource_claim_name.clone())
            });
            (c.name.clone(), name)
        })
        .collect()
}

impl SchedulerStandIn {
    /// A stand-in talking to the API through `client`, for the devices of `driver` (used as
    /// the CEL domain of unqualified attribute names); default [`StandInConfig`].
    pub fn new(client: Client, driver: &str) -> Self {
        Self::with_config(client, driver, StandInConfig::default())
    }

    /// As [`Self::new`], with `config`.
    pub fn with_config(client: Client, driver: &str, config: StandInConfig) -> Self {
        Self {
            client,
            driver: driver.to_owned(),
            config,
            cel: CelCache::default(),
            cycle: 0,
            pending: VecDeque::new(),
            source: SnapshotSource::Api,
        }
    }

    /// Takes each cycle's snapshot from `source` instead of listing through the client
    /// (see [`SnapshotSource`]); writes still go through the client.
    #[must_use]
    pub fn reading(mut self, source: SnapshotSource) -> Self {
        self.source = source;
        self
    }

    /// `namespace/name` of the pods reserved and waiting for PreBind, oldest first.
    pub fn pending_prebinds(&self) -> Vec<String> {
        self.pending.iter().map(|r| pod_key(&r.pod)).collect()
    }

    /// One step: first PreBind every reservation that is due (made at least
    /// [`StandInConfig::prebind_delay_cycles`] cycles ago), then one scheduling cycle for one
    /// pod picked by `rng` ([`Self::schedule_one`]).
    ///
    /// # Errors
    ///
    /// A failed read of the cluster snapshot; failures of single writes are outcomes.
    pub async fn step(&mut self, rng: &mut SeededRng) -> Result<StepReport, kube::Error> {
        let delay = self.config.prebind_delay_cycles.max(1);
        let mut bound = Vec::new();
        while self
            .pending
            .front()
            .is_some_and(|r| r.cycle + delay <= self.cycle + 1)
        {
            if let Some(reservation) = self.pending.pop_front() {
                bound.push(self.prebind(reservation).await);
            }
        }
        let cycle = self.schedule_one(rng).await?;
        Ok(StepReport { bound, cycle })
    }

    /// PreBind (and bind) every pending reservation now, oldest first.
    pub async fn flush_prebinds(&mut self) -> Vec<BindOutcome> {
        let mut outcomes = Vec::new();
        while let Some(reservation) = self.pending.pop_front() {
            outcomes.push(self.prebind(reservation).await);
        }
        outcomes
    }

    /// PreBind the reservations made at least `delay` ago, oldest first.
    async fn flush_older_than(&mut self, delay: Duration) -> Vec<BindOutcome> {
        let mut outcomes = Vec::new();
        while self
            .pending
            .front()
            .is_some_and(|r| r.at.elapsed() >= delay)
        {
            if let Some(reservation) = self.pending.pop_front() {
                outcomes.push(self.prebind(reservation).await);
            }
        }
        outcomes
    }

    /// One scheduling cycle (PreFilter, Filter, PostFilter, Reserve) for one pod picked by
    /// `rng` among those waiting for a scheduler ([`wants_scheduling`]) and not already
    /// reserved, decided from a snapshot of nodes, slices, classes, claims and pods read at
    /// its start.
    ///
    /// Upstream: `pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go`,
    /// `PreFilter` (allocated claims become a node filter from `allocation.nodeSelector`;
    /// unallocated claims need their DeviceClass; in-use devices are
    /// `ListAllAllocatedDevices` — every claim's allocation plus in-flight ones), `Filter`
    /// (per node: node-selector mismatches are recorded as unavailable claims, but only when
    /// the allocator succeeded on that node, because a failed `Allocate` returns first;
    /// a CEL error aborts the cycle), `PostFilter` ([`Self::post_filter`]) and `Reserve`
    /// (remembers the allocation with the built-in finalizer as in flight; nothing is
    /// written). The node is picked by `rng` among the feasible ones.
    ///
    /// # Errors
    ///
    /// A failed read of the snapshot.
    pub async fn schedule_one(&mut self, rng: &mut SeededRng) -> Result<CycleOutcome, kube::Error> {
        self.cycle += 1;
        let snapshot = self.source.snapshot(&self.client).await?;
        let pending: HashSet<String> = self.pending.iter().map(|r| pod_key(&r.pod)).collect();
        let candidates: Vec<&Pod> = snapshot
            .pods
            .iter()
            .map(AsRef::as_ref)
            .filter(|p| wants_scheduling(p) && !pending.contains(&pod_key(p)))
            .collect();
        if candidates.is_empty() {
            return Ok(CycleOutcome::Idle);
        }
        let pod = candidates[rng.below(candidates.len())].clone();
        Ok(self.cycle_for(&pod, &snapshot, rng).await)
    }

    #[allow(
        clippy::too_many_lines,
        reason = "one upstream scheduling cycle, kept in one piece to read side by side"
    )]
    async fn cycle_for(
        &mut self,
        pod: &Pod,
        snapshot: &Snapshot,
        rng: &mut SeededRng,
    ) -> CycleOutcome {
        let pod_name = pod_key(pod);
        let unschedulable = |reason: String| CycleOutcome::Unschedulable {
            pod: pod_name.clone(),
            reason,
            deallocated: None,
        };
        // PreFilter: the pod's claims.
        let namespace = pod.namespace().unwrap_or_default();
        let mut claims = Vec::new();
        for (reference, name) in pod_claim_names(pod) {
            let Some(name) = name else {
                return unschedulable(format!(
                    "waiting for resource claim of pod claim {reference} to be created"
                ));
            };
            let Some(claim) = snapshot.claims.get(&key(Some(&namespace), &name)) else {
                return unschedulable(format!("resourceclaim \"{name}\" not found"));
            };
            if claim.metadata.deletion_timestamp.is_some() {
                return unschedulable(format!("resourceclaim \"{name}\" is being deleted"));
            }
            if !is_reserved_for(claim, pod) && reserved_for(claim).len() >= RESERVED_FOR_MAX {
                return unschedulable(format!(
                    "resourceclaim \"{name}\" is reserved for the maximum number of consumers"
                ));
            }
            claims.push(ResourceClaim::clone(claim));
        }
        let mut to_allocate = Vec::new();
        for (index, claim) in claims.iter().enumerate() {
            if allocation_of(claim).is_some() {
                continue;
            }
            for request in claim
                .spec
                .devices
                .iter()
                .flat_map(|d| d.requests.iter().flatten())
            {
                let Some(exactly) = &request.exactly else {
                    return CycleOutcome::Error {
                        pod: pod_name,
                        message: format!(
                            "request {}: firstAvailable is not supported by the stand-in",
                            request.name
                        ),
                    };
                };
                if !snapshot.classes.contains_key(&exactly.device_class_name) {
                    return unschedulable(format!(
                        "request {}: device class {} does not exist",
                        request.name, exactly.device_class_name
                    ));
                }
            }
            to_allocate.push(index);
        }
        let mut in_use: HashSet<DeviceId> = snapshot
            .claims
            .values()
            .filter_map(|claim| allocation_of(claim))
            .flat_map(allocated_devices)
            .collect();
        for reservation in &self.pending {
            for reserved in &reservation.claims {
                if let Some(allocation) = &reserved.allocation {
                    in_use.extend(allocated_devices(allocation));
                }
            }
        }

        // Filter.
        let mut unavailable: BTreeSet<usize> = BTreeSet::new();
        let mut feasible: Vec<(String, Vec<AllocationResult>)> = Vec::new();
        let mut last_reason = "no node fits the pod".to_owned();
        for node in &snapshot.nodes {
            if !node_fits(pod, node) {
                continue;
            }
            let mismatched: Vec<usize> = claims
                .iter()
                .enumerate()
                .filter(|(_, c)| {
                    allocation_of(c)
                        .and_then(|a| a.node_selector.as_ref())
                        .is_some_and(|s| !node_selector_matches(s, node))
                })
                .map(|(i, _)| i)
                .collect();
            let mut allocations = Vec::new();
            if !to_allocate.is_empty() {
                let wanted: Vec<&ResourceClaim> = to_allocate.iter().map(|i| &claims[*i]).collect();
                match self.allocate_on_node(snapshot, node, &wanted, &in_use) {
                    Err(message) => {
                        return CycleOutcome::Error {
                            pod: pod_name,
                            message,
                        };
                    }
                    Ok(None) => {
                        "cannot allocate all claims".clone_into(&mut last_reason);
                        continue;
                    }
                    Ok(Some(a)) => allocations = a,
                }
            }
            if !mismatched.is_empty() {
                unavailable.extend(mismatched);
                "resourceclaim not available on the node".clone_into(&mut last_reason);
                continue;
            }
            feasible.push((node.name_any(), allocations));
        }

        if feasible.is_empty() {
            return self
                .post_filter(pod, &claims, &unavailable, last_reason, rng)
                .await;
        }

        // Reserve.
        let (node, allocations) = feasible.swap_remove(rng.below(feasible.len()));
        let mut allocations = allocations.into_iter();
        let reserved = claims
            .iter()
            .enumerate()
            .map(|(index, claim)| ReservedClaim {
                claim: claim.clone(),
                allocation: if to_allocate.contains(&index) {
                    allocations.next()
                } else {
                    None
                },
            })
            .collect();
        self.pending.push_back(Reservation {
            pod: pod.clone(),
            node: node.clone(),
            claims: reserved,
            cycle: self.cycle,
            at: Instant::now(),
        });
        CycleOutcome::Reserved {
            pod: pod_name,
            node,
        }
    }

    /// The structured allocator for one node: every request of `claims` gets the first
    /// matching free devices in slice order (`staging/src/k8s.io/dynamic-resource-allocation/
    /// structured/internal/stable/allocator_stable.go`, `Allocate`/`allocateDevice`: a device
    /// is free when it is not in `allocatedDevices` and not being allocated in this attempt;
    /// `selectorsMatch` evaluates the class's selectors, then the request's; a CEL error is an
    /// error). Only slices of the pool's highest generation that are local to the node
    /// (`nodeName`, `allNodes` or a matching `nodeSelector`) count. `Ok(None)`: the node
    /// cannot satisfy all claims.
    #[allow(
        clippy::too_many_lines,
        reason = "the allocator loop and result building belong together"
    )]
    fn allocate_on_node(
        &mut self,
        snapshot: &Snapshot,
        node: &Node,
        claims: &[&ResourceClaim],
        in_use: &HashSet<DeviceId>,
    ) -> Result<Option<Vec<AllocationResult>>, String> {
        let node_name = node.name_any();
        let mut generations: HashMap<(String, String), i64> = HashMap::new();
        for slice in &snapshot.slices {
            let entry = generations
                .entry((slice.spec.driver.clone(), slice.spec.pool.name.clone()))
                .or_insert(slice.spec.pool.generation);
            *entry = (*entry).max(slice.spec.pool.generation);
        }
        let local: Vec<&ResourceSlice> = snapshot
            .slices
            .iter()
            .map(AsRef::as_ref)
            .filter(|s| {
                generations.get(&(s.spec.driver.clone(), s.spec.pool.name.clone()))
                    == Some(&s.spec.pool.generation)
            })
            .filter(|s| {
                s.spec.node_name.as_deref() == Some(node_name.as_str())
                    || s.spec.all_nodes == Some(true)
                    || s.spec
                        .node_selector
                        .as_ref()
                        .is_some_and(|sel| node_selector_matches(sel, node))
            })
            .collect();
        let mut allocating: HashSet<DeviceId> = HashSet::new();
        let mut results = Vec::new();
        for claim in claims {
            let devices = claim.spec.devices.clone().unwrap_or_default();
            let mut request_results = Vec::new();
            let mut configs = Vec::new();
            let mut node_local = false;
            for request in devices.requests.iter().flatten() {
                let Some(exactly) = &request.exactly else {
                    return Err(format!(
                        "request {}: only `exactly` is supported",
                        request.name
                    ));
                };
                let Some(class) = snapshot.classes.get(&exactly.device_class_name) else {
                    return Ok(None);
                };
                let mut expressions: Vec<String> = Vec::new();
                for selector in class.spec.selectors.iter().flatten() {
                    if let Some(cel) = &selector.cel {
                        expressions.push(cel.expression.clone());
                    }
                }
                for selector in exactly.selectors.iter().flatten() {
                    if let Some(cel) = &selector.cel {
                        expressions.push(cel.expression.clone());
                    }
                }
                let all = exactly.allocation_mode.as_deref() == Some("All");
                let count = usize::try_from(exactly.count.unwrap_or(1)).unwrap_or(0);
                let mut chosen = Vec::new();
                let mut matching_in_use = false;
                for slice in &local {
                    for device in &slice.spec.devices.clone().unwrap_or_default() {
                        if !all && chosen.len() == count {
                            break;
                        }
                        let id = (
                            slice.spec.driver.clone(),
                            slice.spec.pool.name.clone(),
                            device.name.clone(),
                        );
                        let tolerations = exactly.tolerations.as_deref().unwrap_or_default();
                        let tainted = device.taints.iter().flatten().any(|t| {
                            (t.effect == "NoSchedule" || t.effect == "NoExecute")
                                && !tolerations.iter().any(|tol| tolerates_taint(tol, t))
                        });
                        let mut selected = true;
                        for expression in &expressions {
                            let matched = self
                                .cel
                                .matches(expression, device, &slice.spec.driver)
                                .map_err(|e| {
                                    format!(
                                        "class {}: device {}/{}/{}: {e}",
                                        class.name_any(),
                                        id.0,
                                        id.1,
                                        id.2
                                    )
                                })?;
                            if !matched {
                                selected = false;
                                break;
                            }
                        }
                        if !selected {
                            continue;
                        }
                        if in_use.contains(&id) || allocating.contains(&id) || tainted {
                            matching_in_use = true;
                            continue;
                        }
                        if slice.spec.node_name.is_some() {
                            node_local = true;
                        }
                        chosen.push(id);
                    }
                }
                if (all && (matching_in_use || chosen.is_empty())) || (!all && chosen.len() < count)
                {
                    return Ok(None);
                }
                for id in chosen {
                    allocating.insert(id.clone());
                    request_results.push(DeviceRequestAllocationResult {
                        request: request.name.clone(),
                        driver: id.0,
                        pool: id.1,
                        device: id.2,
                        ..DeviceRequestAllocationResult::default()
                    });
                }
                for config in class.spec.config.iter().flatten() {
                    configs.push(DeviceAllocationConfiguration {
                        source: "FromClass".to_owned(),
                        requests: Some(vec![request.name.clone()]),
                        opaque: config.opaque.clone(),
                    });
                }
            }
            for config in devices.config.iter().flatten() {
                configs.push(DeviceAllocationConfiguration {
                    source: "FromClaim".to_owned(),
                    requests: config.requests.clone(),
                    opaque: config.opaque.clone(),
                });
            }
            // createNodeSelector: a node-local device pins the allocation to the node.
            let node_selector = node_local.then(|| NodeSelector {
                node_selector_terms: vec![k8s_openapi::api::core::v1::NodeSelectorTerm {
                    match_fields: Some(vec![NodeSelectorRequirement {
                        key: "metadata.name".to_owned(),
                        operator: "In".to_owned(),
                        values: Some(vec![node_name.clone()]),
                    }]),
                    match_expressions: None,
                }],
            });
            results.push(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(request_results),
                    config: (!configs.is_empty()).then_some(configs),
                }),
                node_selector,
                allocation_timestamp: None,
            });
        }
        Ok(Some(results))
    }

    /// PostFilter (`dynamicresources.go`, `PostFilter`): when no node fits, pick one of the
    /// claims Filter found unavailable (allocated, with a `nodeSelector` that rejected a node
    /// on which everything else fitted) at random, and if nobody but this pod has reserved
    /// it, deallocate it with an UpdateStatus that clears `allocation`, `reservedFor` and
    /// `devices` ("deallocation of ResourceClaim completed").
    async fn post_filter(
        &self,
        pod: &Pod,
        claims: &[ResourceClaim],
        unavailable: &BTreeSet<usize>,
        reason: String,
        rng: &mut SeededRng,
    ) -> CycleOutcome {
        let pod_name = pod_key(pod);
        let mut order: Vec<usize> = unavailable.iter().copied().collect();
        // Upstream iterates a Go map: a random order.
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let uid = pod.uid();
        for index in order {
            let claim = &claims[index];
            let reserved = reserved_for(claim);
            if reserved.is_empty()
                || (reserved.len() == 1 && Some(&reserved[0].uid) == uid.as_ref())
            {
                let mut cleared = claim.clone();
                cleared.status = Some(ResourceClaimStatus {
                    allocation: None,
                    reserved_for: None,
                    devices: None,
                });
                let api: Api<ResourceClaim> =
                    Api::namespaced(self.client.clone(), &claim.namespace().unwrap_or_default());
                return match api
                    .replace_status(&claim.name_any(), &PostParams::default(), &cleared)
                    .await
                {
                    Ok(_) => CycleOutcome::Unschedulable {
                        pod: pod_name,
                        reason: "deallocation of ResourceClaim completed".to_owned(),
                        deallocated: Some(claim_key(claim)),
                    },
                    Err(e) => CycleOutcome::Error {
                        pod: pod_name,
                        message: format!("deallocate claim {}: {e}", claim_key(claim)),
                    },
                };
            }
        }
        CycleOutcome::Unschedulable {
            pod: pod_name,
            reason: if unavailable.is_empty() {
                reason
            } else {
                "still not schedulable".to_owned()
            },
            deallocated: None,
        }
    }

    /// PreBind and bind one reservation. Upstream: `dynamicresources.go`, `PreBind` →
    /// `bindClaim` for every claim not yet reserved for the pod: refuse a claim being
    /// deleted; for an allocation made in Reserve, fail with "got allocated elsewhere in the
    /// meantime" when the live claim is allocated, add the built-in finalizer with an Update,
    /// then write allocation (with `allocationTimestamp`, as the DRADeviceBindingConditions
    /// path does) and the `reservedFor` entry with one UpdateStatus carrying the claim's
    /// resourceVersion; retry on conflict from a fresh GET (`retry.RetryOnConflict`). An
    /// allocation written by someone else without `allocationTimestamp` fails the way a 1.36
    /// API server fails it (reference/dra-api.md §5). Then the pod is bound (a merge patch of
    /// `spec.nodeName`). Any failure runs [`Self::unreserve`].
    async fn prebind(&mut self, mut reservation: Reservation) -> BindOutcome {
        let pod_name = pod_key(&reservation.pod);
        let node = reservation.node.clone();
        for index in 0..reservation.claims.len() {
            if is_reserved_for(&reservation.claims[index].claim, &reservation.pod) {
                continue;
            }
            match self
                .bind_claim(&reservation.claims[index], &reservation.pod)
                .await
            {
                Ok(claim) => {
                    reservation.claims[index].claim = claim;
                    // The allocation is now visible in the API: no longer in flight.
                    reservation.claims[index].allocation = None;
                }
                Err(reason) => {
                    self.unreserve(&reservation).await;
                    return BindOutcome::Failed {
                        pod: pod_name,
                        node,
                        reason,
                    };
                }
            }
        }
        if let Err(reason) = self.bind_pod(&reservation.pod, &node).await {
            self.unreserve(&reservation).await;
            return BindOutcome::Failed {
                pod: pod_name,
                node,
                reason,
            };
        }
        BindOutcome::Bound {
            pod: pod_name,
            node,
        }
    }

    async fn bind_claim(
        &self,
        reserved: &ReservedClaim,
        pod: &Pod,
    ) -> Result<ResourceClaim, String> {
        let name = reserved.claim.name_any();
        let api: Api<ResourceClaim> = Api::namespaced(
            self.client.clone(),
            &reserved.claim.namespace().unwrap_or_default(),
        );
        let label = claim_key(&reserved.claim);
        let mut claim = reserved.claim.clone();
        let mut last_error = String::new();
        for attempt in 0..BIND_RETRIES {
            if attempt > 0 {
                claim = api
                    .get(&name)
                    .await
                    .map_err(|e| format!("get updated claim {label} after conflict: {e}"))?;
            }
            if claim.metadata.deletion_timestamp.is_some() {
                return Err(format!("claim {label} got deleted in the meantime"));
            }
            if let Some(allocation) = &reserved.allocation {
                if allocation_of(&claim).is_some() {
                    return Err(format!(
                        "claim {label} got allocated elsewhere in the meantime"
                    ));
                }
                if !claim.finalizers().iter().any(|f| f == BUILTIN_FINALIZER) {
                    claim
                        .metadata
                        .finalizers
                        .get_or_insert_with(Vec::new)
                        .push(BUILTIN_FINALIZER.to_owned());
                    match api.replace(&name, &PostParams::default(), &claim).await {
                        Ok(updated) => claim = updated,
                        Err(e) if is_conflict(&e) => {
                            last_error = format!("add finalizer to claim {label}: {e}");
                            continue;
                        }
                        Err(e) => return Err(format!("add finalizer to claim {label}: {e}")),
                    }
                }
                let mut allocation = allocation.clone();
                allocation.allocation_timestamp = Some(Time(Timestamp::now()));
                claim
                    .status
                    .get_or_insert_with(ResourceClaimStatus::default)
                    .allocation = Some(allocation);
            } else if allocation_of(&claim).is_some_and(|a| a.allocation_timestamp.is_none()) {
                return Err(format!(
                    "add reservation to claim {label}: status.allocation: Invalid value: field is immutable (the scheduler stamps a missing allocationTimestamp)"
                ));
            }
            claim
                .status
                .get_or_insert_with(ResourceClaimStatus::default)
                .reserved_for
                .get_or_insert_with(Vec::new)
                .push(ResourceClaimConsumerReference {
                    api_group: None,
                    resource: "pods".to_owned(),
                    name: pod.name_any(),
                    uid: pod.uid().unwrap_or_default(),
                });
            let what = if reserved.allocation.is_some() {
                "add allocation and reservation to"
            } else {
                "add reservation to"
            };
            match api
                .replace_status(&name, &PostParams::default(), &claim)
                .await
            {
                Ok(updated) => return Ok(updated),
                Err(e) if is_conflict(&e) => last_error = format!("{what} claim {label}: {e}"),
                Err(e) => return Err(format!("{what} claim {label}: {e}")),
            }
        }
        Err(last_error)
    }

    /// Binding (`DefaultBinder`, here a merge patch of `spec.nodeName`): fails when the pod is
    /// gone, was replaced, or is already assigned, as the `pods/binding` subresource does.
    async fn bind_pod(&self, pod: &Pod, node: &str) -> Result<(), String> {
        let api: Api<Pod> =
            Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        let name = pod.name_any();
        let live = api
            .get(&name)
            .await
            .map_err(|e| format!("bind pod {}: {e}", pod_key(pod)))?;
        if live.uid() != pod.uid() {
            return Err(format!("bind pod {}: pod was replaced", pod_key(pod)));
        }
        if let Some(assigned) = live.spec.as_ref().and_then(|s| s.node_name.as_deref())
            && !assigned.is_empty()
        {
            return Err(format!(
                "bind pod {}: pod is already assigned to node {assigned:?}",
                pod_key(pod)
            ));
        }
        api.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"nodeName": node}})),
        )
        .await
        .map(|_| ())
        .map_err(|e| format!("bind pod {}: {e}", pod_key(pod)))
    }

    /// Unreserve (`dynamicresources.go`, `Unreserve`): the in-flight allocations are dropped
    /// (the reservation is no longer pending), and every claim of the pod that is allocated
    /// and reserved for it loses the pod's `reservedFor` entry. Allocations PreBind already
    /// wrote stay. Upstream removes the entry with a strategic-merge `$patch: delete`; the
    /// stand-in reads the claim and writes its status back without the entry (FakeApi treats
    /// strategic merge patches as merge patches). Errors are ignored, as upstream logs them.
    async fn unreserve(&self, reservation: &Reservation) {
        for reserved in &reservation.claims {
            let api: Api<ResourceClaim> = Api::namespaced(
                self.client.clone(),
                &reserved.claim.namespace().unwrap_or_default(),
            );
            let Ok(mut claim) = api.get(&reserved.claim.name_any()).await else {
                continue;
            };
            if allocation_of(&claim).is_none() || !is_reserved_for(&claim, &reservation.pod) {
                continue;
            }
            let uid = reservation.pod.uid();
            if let Some(entries) = claim.status.as_mut().and_then(|s| s.reserved_for.as_mut()) {
                entries.retain(|c| Some(&c.uid) != uid.as_ref());
            }
            let _ = api
                .replace_status(&claim.name_any(), &PostParams::default(), &claim)
                .await;
        }
    }

    /// One pass of kube-controller-manager's resourceclaim controller over all claims
    /// (`pkg/controller/resourceclaim/controller.go`, `syncClaim`): `reservedFor` entries of
    /// pods that are gone, replaced (other UID) or done (`isPodDone`) are removed with an
    /// UpdateStatus carrying the resourceVersion; when that removes the last entry of a claim
    /// with the built-in finalizer, the same update clears `allocation` (and `devices`, which
    /// the API server's `dropDeallocatedStatusDevices` would drop), then an Update removes
    /// the finalizer. A deleted, unreserved claim with the finalizer is deallocated and
    /// released. Claims without the built-in finalizer (kerf-controller's, finalizer
    /// `gpu.kerf.dev/allocation`) keep their allocation. Returns the `namespace/name` of the
    /// claims it changed.
    ///
    /// # Errors
    ///
    /// A failed list; write conflicts are skipped (the next pass retries).
    pub async fn run_claim_controller_once(&self) -> Result<Vec<String>, kube::Error> {
        let lp = ListParams::default();
        let pods: HashMap<String, Pod> = Api::<Pod>::all(self.client.clone())
            .list(&lp)
            .await?
            .items
            .into_iter()
            .map(|p| (pod_key(&p), p))
            .collect();
        let mut claims = Api::<ResourceClaim>::all(self.client.clone())
            .list(&lp)
            .await?
            .items;
        claims.sort_by_key(claim_key);
        let mut changed = Vec::new();
        for claim in claims {
            let namespace = claim.namespace().unwrap_or_default();
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
            let entries = reserved_for(&claim).to_vec();
            let valid: Vec<ResourceClaimConsumerReference> = entries
                .iter()
                .filter(|entry| {
                    if entry.resource != "pods"
                        || entry.api_group.as_deref().is_some_and(|g| !g.is_empty())
                    {
                        return true;
                    }
                    pods.get(&key(Some(&namespace), &entry.name))
                        .is_some_and(|p| p.uid().as_ref() == Some(&entry.uid) && !is_pod_done(p))
                })
                .cloned()
                .collect();
            let builtin = claim.finalizers().iter().any(|f| f == BUILTIN_FINALIZER);
            let without_finalizer = |mut c: ResourceClaim| {
                if let Some(f) = c.metadata.finalizers.as_mut() {
                    f.retain(|f| f != BUILTIN_FINALIZER);
                }
                c
            };
            if valid.len() < entries.len() {
                let mut updated = claim.clone();
                let status = updated
                    .status
                    .get_or_insert_with(ResourceClaimStatus::default);
                status.reserved_for = (!valid.is_empty()).then_some(valid.clone());
                if valid.is_empty() && builtin {
                    status.allocation = None;
                    status.devices = None;
                }
                let Ok(updated) = api
                    .replace_status(&claim.name_any(), &PostParams::default(), &updated)
                    .await
                else {
                    continue;
                };
                changed.push(claim_key(&claim));
                if builtin && allocation_of(&updated).is_none() {
                    let _ = api
                        .replace(
                            &claim.name_any(),
                            &PostParams::default(),
                            &without_finalizer(updated),
                        )
                        .await;
                }
            } else if builtin && claim.metadata.deletion_timestamp.is_some() && valid.is_empty() {
                let mut updated = claim.clone();
                if allocation_of(&updated).is_some() {
                    if let Some(status) = updated.status.as_mut() {
                        status.allocation = None;
                        status.devices = None;
                    }
                    match api
                        .replace_status(&claim.name_any(), &PostParams::default(), &updated)
                        .await
                    {
                        Ok(u) => updated = u,
                        Err(_) => continue,
                    }
                }
                match api
                    .replace(
                        &claim.name_any(),
                        &PostParams::default(),
                        &without_finalizer(updated),
                    )
                    .await
                {
                    Ok(_) => changed.push(claim_key(&claim)),
                    Err(e) if is_not_found(&e) => changed.push(claim_key(&claim)),
                    Err(_) => {}
                }
            }
        }
        Ok(changed)
    }

    /// Runs the stand-in in the background: every [`SpawnConfig::interval`] it PreBinds the
    /// reservations older than [`SpawnConfig::prebind_delay`], runs one scheduling cycle and,
    /// if configured, the resourceclaim controller once. Read errors are retried on the next
    /// tick. [`StandInHandle::stop`] ends the loop and returns the stand-in.
    pub fn spawn(mut self, config: SpawnConfig) -> StandInHandle {
        let (stop, mut stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut rng = SeededRng::new(config.seed);
            let mut log = Vec::new();
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    () = tokio::time::sleep(config.interval) => {}
                }
                for outcome in self.flush_older_than(config.prebind_delay).await {
                    log.push(format!("{outcome:?}"));
                }
                if let Ok(outcome) = self.schedule_one(&mut rng).await
                    && outcome != CycleOutcome::Idle
                {
                    log.push(format!("{outcome:?}"));
                }
                if config.claim_controller {
                    let _ = self.run_claim_controller_once().await;
                }
            }
            (self, log)
        });
        StandInHandle { stop, task }
    }
}

/// A stand-in running in the background ([`SchedulerStandIn::spawn`]).
#[derive(Debug)]
pub struct StandInHandle {
    stop: oneshot::Sender<()>,
    task: JoinHandle<(SchedulerStandIn, Vec<String>)>,
}

impl StandInHandle {
    /// Stops the loop after its current tick and returns the stand-in (with any reservations
    /// still pending) and a log of every non-idle cycle and bind outcome, in order.
    ///
    /// # Errors
    ///
    /// The task's [`tokio::task::JoinError`] if it panicked or was cancelled.
    pub async fn stop(self) -> Result<(SchedulerStandIn, Vec<String>), tokio::task::JoinError> {
        let _ = self.stop.send(());
        self.task.await
    }
}

/// Upstream `ToleratesTaint` (kubernetes/kubernetes
/// `staging/src/k8s.io/dynamic-resource-allocation/resourceclaim/devicetoleration.go`): an
/// empty effect or key matches all, `Exists` any value, `Equal` (or empty) an equal value.
fn tolerates_taint(
    toleration: &k8s_openapi::api::resource::v1::DeviceToleration,
    taint: &k8s_openapi::api::resource::v1::DeviceTaint,
) -> bool {
    let effect = toleration.effect.as_deref().unwrap_or_default();
    let key = toleration.key.as_deref().unwrap_or_default();
    if (!effect.is_empty() && effect != taint.effect) || (!key.is_empty() && key != taint.key) {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or_default() {
        "" | "Equal" => {
            toleration.value.as_deref().unwrap_or_default()
                == taint.value.as_deref().unwrap_or_default()
        }
        "Exists" => true,
        _ => false,
    }
}
