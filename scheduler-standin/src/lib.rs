//! A kube-scheduler stand-in for kerf's tests, benchmarks and `kerf demo`: the parts of
//! kube-scheduler's DynamicResources plugin and of kube-controller-manager's resourceclaim
//! controller that decide which pod gets which device, driven step by step against any API
//! server (in practice kerf-tests' in-memory one) so tests can interleave it with
//! kerf-controller deterministically, or run it in the background ([`SchedulerStandIn::spawn`]).
//!
//! Two layers: the pure allocator ([`Allocator`]: a [`Snapshot`] and an [`AllocatedState`]
//! in, allocations out, no API client), which the demo and the benchmarks use alone, and the
//! scheduling loop around it ([`SchedulerStandIn`]: read a snapshot, Filter, Reserve,
//! PreBind, bind, the resourceclaim controller).
//!
//! It exists because kerf's earlier fakes were kinder than kube-scheduler: on a real 1.36
//! cluster the two allocators gave one GPU to two pods. What it keeps from upstream
//! (kubernetes/kubernetes; each module and method cites the file and function it imitates):
//! - a cycle decides from a snapshot read at its start ([`SchedulerStandIn::schedule_one`]),
//!   counting what every claim's `status.allocation` holds, whoever wrote it, plus its own
//!   in-flight allocations (`allocated`); the snapshot is listed through the client or,
//!   with [`SnapshotSource::Reader`], from a reader such as kerf-tests' of its in-memory API
//!   server's store, with only changed objects decoded, as kube-scheduler's informer caches
//!   cost;
//! - the 1.36 structured allocator (`allocator`): an exhaustive search over devices with
//!   DeviceClass and request CEL selectors evaluated by a real CEL interpreter ([`cel`]; a
//!   CEL error aborts the pod's cycle), device taints and tolerations, consumable capacity
//!   with shares (`capacity`), shared counters of partitionable devices
//!   ([`kerf_api::counters`]) and `matchAttribute`/`distinctAttribute` constraints (`constraints`);
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
//! `spec.nodeSelector` (no node affinity, no resources), no `firstAvailable` and no
//! `adminAccess` requests. The pod is bound with a merge patch of `spec.nodeName`, because
//! kerf-tests' in-memory API server has no `pods/binding` subresource.

mod allocated;
mod allocator;
mod bind;
mod capacity;
pub mod cel;
mod claim_controller;
mod constraints;
mod filter;
mod plan;
mod pods;
mod prepared;
mod search;
mod snapshot;
mod spawn;
mod throttle;

pub use allocated::AllocatedState;
pub use allocator::{Allocator, MAX_STEPS};
pub use filter::{Feasible, Filtered};
pub use pods::{node_selector_matches, pod_claim_names};
pub use snapshot::{Snapshot, SnapshotReader, SnapshotSource};
pub use spawn::StandInHandle;
pub use throttle::{ClientRateLimit, num_feasible_nodes_to_find};

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{AllocationResult, ResourceClaim};
use kube::{Client, ResourceExt};

use kerf_api::claim_status::{allocation_of, is_reserved_for, reserved_for};
use pods::{key, pod_key, wants_scheduling};
use throttle::TokenBucket;

/// The built-in finalizer kube-scheduler adds to claims it allocates
/// (`resourceapi.Finalizer`); the resourceclaim controller deallocates only such claims.
pub const BUILTIN_FINALIZER: &str = "resource.kubernetes.io/delete-protection";

/// Most `reservedFor` entries a claim may have (`ResourceClaimReservedForMaxSize`).
pub const RESERVED_FOR_MAX: usize = 256;

/// How many times PreBind retries a claim update after a conflict (`retry.DefaultRetry`).
const BIND_RETRIES: usize = 5;

pub use kerf_core::rng::SeededRng;

/// Settings of the stand-in.
#[derive(Debug, Clone)]
pub struct StandInConfig {
    /// In [`SchedulerStandIn::step`]: a pod reserved in cycle `k` is PreBound at the start of
    /// cycle `k + prebind_delay_cycles` (at least 1: never in its own cycle).
    pub prebind_delay_cycles: u64,
    /// The client-side rate limit of the stand-in's API requests, as kube-scheduler's client
    /// has one ([`ClientRateLimit::KUBE_SCHEDULER`]); `None` (the default): unlimited, so
    /// tests that interleave steps never wait on a clock.
    pub client_rate_limit: Option<ClientRateLimit>,
    /// Whether a bound pod gets kube-scheduler's `Scheduled` Event (off by default: tests
    /// that count requests predate it).
    pub scheduled_events: bool,
}

impl Default for StandInConfig {
    fn default() -> Self {
        Self {
            prebind_delay_cycles: 1,
            client_rate_limit: None,
            scheduled_events: false,
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

/// The kube-scheduler stand-in. See the module documentation.
pub struct SchedulerStandIn {
    client: Client,
    driver: String,
    config: StandInConfig,
    allocator: Allocator,
    cycle: u64,
    pending: VecDeque<Reservation>,
    source: SnapshotSource,
    throttle: Option<TokenBucket>,
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
            throttle: config.client_rate_limit.map(TokenBucket::new),
            config,
            allocator: Allocator::default(),
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
    pub(crate) async fn flush_older_than(&mut self, delay: Duration) -> Vec<BindOutcome> {
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
    /// Filter visits nodes as `pkg/scheduler/schedule_one.go` does ([`Allocator::filter`]):
    /// from where the previous cycle stopped, until [`num_feasible_nodes_to_find`] nodes fit.
    /// The feasible nodes come back in name order before `rng` picks, so where every node is
    /// filtered the choice is the one it was before rotation.
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
        let prepared = pre_filter(pod, snapshot).and_then(|claims| {
            let to_allocate = claims_to_allocate(&claims, snapshot)?;
            let state = self.allocated_state(snapshot)?;
            Ok((claims, to_allocate, state))
        });
        let (claims, to_allocate, state) = match prepared {
            Ok(prepared) => prepared,
            Err(stop) => return stop.outcome(pod_name),
        };
        // Filter.
        let filtered = match self
            .allocator
            .filter(pod, &claims, &to_allocate, snapshot, &state)
        {
            Ok(filtered) => filtered,
            Err(message) => return Stop::Error(message).outcome(pod_name),
        };
        let mut feasible = filtered.feasible;
        if feasible.is_empty() {
            return self
                .post_filter(pod, &claims, &filtered.unavailable, filtered.reason, rng)
                .await;
        }
        let chosen = feasible.swap_remove(rng.below(feasible.len()));
        let allocations =
            match self
                .allocator
                .allocate_feasible(&chosen, &claims, &to_allocate, snapshot, &state)
            {
                Ok(allocations) => allocations,
                Err(message) => return Stop::Error(message).outcome(pod_name),
            };
        self.reserve(pod, &claims, &to_allocate, (chosen.node, allocations))
    }

    /// `ListAllAllocatedDevices` and the claim assume cache: what is written and in flight.
    fn allocated_state(&self, snapshot: &Snapshot) -> Result<AllocatedState, Stop> {
        let mut state = AllocatedState::default();
        let written = snapshot.claims.values().filter_map(|c| allocation_of(c));
        let in_flight = self
            .pending
            .iter()
            .flat_map(|r| r.claims.iter().filter_map(|c| c.allocation.as_ref()));
        for allocation in written.chain(in_flight) {
            state.add(allocation).map_err(Stop::Error)?;
        }
        Ok(state)
    }

    /// Reserve: the pod waits for PreBind on the chosen node with its allocations (one per
    /// claim at `to_allocate`).
    fn reserve(
        &mut self,
        pod: &Pod,
        claims: &[ResourceClaim],
        to_allocate: &[usize],
        (node, allocations): (String, Vec<AllocationResult>),
    ) -> CycleOutcome {
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
            pod: pod_key(pod),
            node,
        }
    }
}

/// Why a scheduling cycle stopped before Filter.
#[derive(Debug)]
enum Stop {
    /// The pod cannot be scheduled now (upstream's words).
    Unschedulable(String),
    /// The cycle failed.
    Error(String),
}

impl Stop {
    fn outcome(self, pod: String) -> CycleOutcome {
        match self {
            Stop::Unschedulable(reason) => CycleOutcome::Unschedulable {
                pod,
                reason,
                deallocated: None,
            },
            Stop::Error(message) => CycleOutcome::Error { pod, message },
        }
    }
}

/// PreFilter: the pod's claims, each existing, not being deleted and with room in
/// `reservedFor`.
fn pre_filter(pod: &Pod, snapshot: &Snapshot) -> Result<Vec<ResourceClaim>, Stop> {
    let namespace = pod.namespace().unwrap_or_default();
    let mut claims = Vec::new();
    for (reference, name) in pod_claim_names(pod) {
        let Some(name) = name else {
            return Err(Stop::Unschedulable(format!(
                "waiting for resource claim of pod claim {reference} to be created"
            )));
        };
        let Some(claim) = snapshot.claims.get(&key(Some(&namespace), &name)) else {
            return Err(Stop::Unschedulable(format!(
                "resourceclaim \"{name}\" not found"
            )));
        };
        if claim.metadata.deletion_timestamp.is_some() {
            return Err(Stop::Unschedulable(format!(
                "resourceclaim \"{name}\" is being deleted"
            )));
        }
        if !is_reserved_for(claim, pod) && reserved_for(claim).len() >= RESERVED_FOR_MAX {
            return Err(Stop::Unschedulable(format!(
                "resourceclaim \"{name}\" is reserved for the maximum number of consumers"
            )));
        }
        claims.push(ResourceClaim::clone(claim));
    }
    Ok(claims)
}

/// The indexes of the claims without allocation, each request checked for what the
/// stand-in supports and a class that exists.
fn claims_to_allocate(claims: &[ResourceClaim], snapshot: &Snapshot) -> Result<Vec<usize>, Stop> {
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
                return Err(Stop::Error(format!(
                    "request {}: firstAvailable is not supported by the stand-in",
                    request.name
                )));
            };
            if !snapshot.classes.contains_key(&exactly.device_class_name) {
                return Err(Stop::Unschedulable(format!(
                    "request {}: device class {} does not exist",
                    request.name, exactly.device_class_name
                )));
            }
        }
        to_allocate.push(index);
    }
    Ok(to_allocate)
}
