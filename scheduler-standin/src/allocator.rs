//! The structured allocator for one node: finds devices for every request of a pod's
//! unallocated claims, or reports that the node cannot serve them.
//!
//! Upstream: kubernetes/kubernetes
//! `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/incubating/allocator_incubating.go`
//! (the variant 1.36 runs when any beta DRA feature is on):
//! - `Allocate` / `allocateOne`: an exhaustive depth-first search, claim after claim and
//!   request after request, devices in pool/slice order; the next device of the same request
//!   is looked for after the previous one (combinations, not permutations), so one request
//!   never gets the same device twice, while two requests may share a shareable device;
//!   the first full solution wins;
//! - `validateDeviceRequest`: `allocationMode: All` takes every selectable device whose
//!   capacity check passes, and fails if any of them cannot be allocated;
//! - `isSelectable` / `selectorsMatch`: the class's CEL selectors, then the request's; a CEL
//!   error aborts the attempt ([`crate::cel`]);
//! - `allocateDevice`: a device allocated without `shareID` or being allocated exclusively
//!   in this attempt is in use; untolerated NoSchedule/NoExecute taints refuse it;
//!   `checkAvailableCounters` ([`kerf_api::counters`]), skipped for a shareable device that
//!   already has consumed capacity; the claim's constraints ([`crate::constraints`]); the
//!   capacity check ([`crate::capacity`]); a device with `allowMultipleAllocations` is not
//!   marked in use, and its result gets `consumedCapacity` and a fresh `shareID`;
//! - `GatherPools` (`pools_incubating.go`): only slices of a pool's newest generation count,
//!   devices of an incomplete pool (fewer slices than `resourceSliceCount`) are not
//!   allocated, and slices are local to the node by `nodeName`, `allNodes`, `nodeSelector`
//!   or, with `perDeviceNodeSelection`, by each device's own fields;
//! - `createNodeSelector`: a device from a node-local slice pins the allocation to the node.
//!
//! Differences: no scoring (none upstream either), configs are listed per request rather
//! than merged per class, and the search gives up after [`MAX_STEPS`] steps as upstream's
//! Filter gives up when its context ends.

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::core::v1::{Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, Device, DeviceAllocationConfiguration, DeviceAllocationResult, DeviceClass,
    DeviceRequestAllocationResult, ExactDeviceRequest, ResourceClaim, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;

use crate::allocated::{AllocatedState, DeviceId, new_share_id};
use crate::capacity::{self, Amounts, Requested};
use crate::cel::CelCache;
use crate::constraints::Constraint;
use crate::pods::{claim_key, node_selector_matches, tainted};
use crate::prepared::DeviceFacts;
use crate::snapshot::Snapshot;
use kerf_api::counters::{self, Counters};

/// kube-scheduler's structured allocator without any API client: it decides from a
/// [`Snapshot`] and an [`AllocatedState`] (see the module documentation), for the stand-in's
/// scheduling cycle, `kerf demo` and the benchmarks. It keeps compiled CEL programs between
/// attempts, and where the Filter over all nodes ([`Self::filter`]) starts next.
#[derive(Debug, Default)]
pub struct Allocator {
    pub(crate) cel: CelCache,
    /// Where the next Filter starts (`nextStartNodeIndex`).
    pub(crate) next_start_node_index: usize,
}

/// Most search steps one node may take before the attempt fails.
pub const MAX_STEPS: usize = 200_000;

/// A device a request's selectors accept on this node.
struct Candidate<'a> {
    facts: &'a DeviceFacts,
    /// The device's pool: its position in the snapshot's prepared pools.
    pool: usize,
    device: &'a Device,
    node_local: bool,
}

/// One request of one claim with its candidates.
struct Request<'a> {
    claim: usize,
    name: &'a str,
    exactly: &'a ExactDeviceRequest,
    requested: Requested<'a>,
    class: &'a DeviceClass,
    all: bool,
    count: usize,
    candidates: Vec<Candidate<'a>>,
}

/// One device chosen for a request.
struct Chosen<'a> {
    request: &'a str,
    id: &'a DeviceId,
    node_local: bool,
    share_id: Option<String>,
    consumed: Option<BTreeMap<String, Quantity>>,
}

/// What one successful [`Search::allocate_device`] changed, to take it back.
struct Undo<'a> {
    claim: usize,
    request: &'a str,
    shared: Option<(&'a DeviceId, Amounts)>,
    exclusive: Option<&'a DeviceId>,
    counters: Option<(usize, Counters)>,
}

/// The state of one node's search.
struct Search<'a> {
    snapshot: &'a Snapshot,
    state: &'a AllocatedState,
    available: HashMap<usize, Counters>,
    requests: Vec<Request<'a>>,
    constraints: Vec<Vec<Constraint<'a>>>,
    exclusive: HashSet<&'a DeviceId>,
    capacity: HashMap<&'a DeviceId, Amounts>,
    counters: HashMap<usize, Counters>,
    results: Vec<Vec<Chosen<'a>>>,
    steps: usize,
}

/// `NodeMatches`: by name, all nodes, or a node selector.
fn node_matches(
    node: &Node,
    node_name: &str,
    name: Option<&String>,
    all: Option<bool>,
    selector: Option<&NodeSelector>,
) -> bool {
    match (name, all, selector) {
        (Some(name), _, _) => name == node_name,
        (None, Some(true), _) => true,
        (None, _, Some(selector)) => node_selector_matches(selector, node),
        _ => false,
    }
}

/// The node a search runs for, with its name read once.
struct OnNode<'n> {
    node: &'n Node,
    name: String,
}

impl Allocator {
    /// The devices `class` and `exactly` select on `node` among `pools` (positions in the
    /// snapshot's prepared pools), in pool/slice/device order.
    fn candidates<'a>(
        &mut self,
        snapshot: &'a Snapshot,
        pools: &[usize],
        node: &OnNode<'_>,
        class: &DeviceClass,
        exactly: &ExactDeviceRequest,
    ) -> Result<Vec<Candidate<'a>>, String> {
        let expressions: Vec<&str> = class
            .spec
            .selectors
            .iter()
            .flatten()
            .chain(exactly.selectors.iter().flatten())
            .filter_map(|s| s.cel.as_ref().map(|c| c.expression.as_str()))
            .collect();
        let prepared = snapshot.prepared();
        let mut candidates = Vec::new();
        for &pool in pools.iter().filter(|p| prepared.pools[**p].complete) {
            for &at in &prepared.pools[pool].slices {
                let spec = &snapshot.slices[at].spec;
                let per_device = spec.per_device_node_selection == Some(true);
                let slice_local = node_matches(
                    node.node,
                    &node.name,
                    spec.node_name.as_ref(),
                    spec.all_nodes,
                    spec.node_selector.as_ref(),
                );
                let devices = spec.devices.iter().flatten().zip(&prepared.devices[at]);
                'devices: for (device, facts) in devices {
                    let (local, node_local) = if per_device {
                        let name = device.node_name.as_ref();
                        let local = node_matches(
                            node.node,
                            &node.name,
                            name,
                            device.all_nodes,
                            device.node_selector.as_ref(),
                        );
                        (local, name.is_some())
                    } else {
                        (slice_local, spec.node_name.is_some())
                    };
                    if !local {
                        continue;
                    }
                    for expression in &expressions {
                        let matched = facts
                            .cel_value(device, &spec.driver)
                            .and_then(|value| self.cel.matches_value(expression, value))
                            .map_err(|e| {
                                format!(
                                    "class {}: device {}/{}/{}: {e}",
                                    class.name_any(),
                                    spec.driver,
                                    spec.pool.name,
                                    device.name
                                )
                            })?;
                        if !matched {
                            continue 'devices;
                        }
                    }
                    candidates.push(Candidate {
                        facts,
                        pool,
                        device,
                        node_local,
                    });
                }
            }
        }
        Ok(candidates)
    }

    /// Allocates every request of `claims` on `node` (see the module documentation), given
    /// what `state` says is allocated already. `Ok(None)`: the node cannot satisfy all
    /// claims.
    ///
    /// # Errors
    ///
    /// A CEL error, an unsupported request or constraint, a quantity that does not parse,
    /// a search that took too long: the cycle is aborted, as upstream's Filter error.
    pub fn allocate_on_node(
        &mut self,
        snapshot: &Snapshot,
        node: &Node,
        claims: &[&ResourceClaim],
        state: &AllocatedState,
    ) -> Result<Option<Vec<AllocationResult>>, String> {
        self.allocate_in(snapshot, node, claims, state)
    }

    /// [`Self::allocate_on_node`], for Filter's pass over every node.
    pub(crate) fn allocate_in<'a>(
        &mut self,
        snapshot: &'a Snapshot,
        node: &Node,
        claims: &[&'a ResourceClaim],
        state: &'a AllocatedState,
    ) -> Result<Option<Vec<AllocationResult>>, String> {
        let node = OnNode {
            node,
            name: node.name_any(),
        };
        let pools = snapshot.prepared().pools_for(&node.name);
        let mut requests = Vec::new();
        let mut constraints = Vec::new();
        for (index, claim) in claims.iter().enumerate() {
            let devices = claim.spec.devices.as_ref();
            constraints.push(
                devices
                    .iter()
                    .flat_map(|d| d.constraints.iter().flatten())
                    .enumerate()
                    .map(|(i, c)| {
                        Constraint::new(c, i)
                            .map_err(|e| format!("claim {}: {e}", claim_key(claim)))
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            );
            for request in devices.iter().flat_map(|d| d.requests.iter().flatten()) {
                let Some(exactly) = &request.exactly else {
                    return Err(format!(
                        "request {}: only `exactly` is supported",
                        request.name
                    ));
                };
                let Some(class) = snapshot.classes.get(&exactly.device_class_name) else {
                    return Ok(None);
                };
                let candidates = self.candidates(snapshot, &pools, &node, class, exactly)?;
                let wanted = exactly.capacity.as_ref().and_then(|c| c.requests.as_ref());
                requests.push(Request {
                    claim: index,
                    name: &request.name,
                    exactly,
                    requested: Requested::new(wanted),
                    class,
                    all: exactly.allocation_mode.as_deref() == Some("All"),
                    count: usize::try_from(exactly.count.unwrap_or(1)).unwrap_or(0),
                    candidates,
                });
            }
        }
        let mut search = Search {
            snapshot,
            state,
            available: HashMap::new(),
            requests,
            constraints,
            exclusive: HashSet::new(),
            capacity: HashMap::new(),
            counters: HashMap::new(),
            results: claims.iter().map(|_| Vec::new()).collect(),
            steps: 0,
        };
        search.narrow_all_requests()?;
        if !search.allocate_one(0, 0, 0)? {
            return Ok(None);
        }
        Ok(Some(search.into_results(claims, &node.name)))
    }
}

impl<'a> Search<'a> {
    /// `validateDeviceRequest` for `allocationMode: All`: keep the candidates whose capacity
    /// check passes against what is allocated already.
    fn narrow_all_requests(&mut self) -> Result<(), String> {
        for request in self.requests.iter_mut().filter(|r| r.all) {
            let mut kept = Vec::new();
            for candidate in request.candidates.drain(..) {
                let (device, facts) = (candidate.device, candidate.facts);
                let consumed = capacity::request_consumption(&request.requested, device, facts)?;
                if let Some(consumed) = consumed
                    && capacity::fits(
                        &consumed,
                        self.state.consumed(&facts.id),
                        None,
                        device,
                        facts,
                    )?
                {
                    kept.push(candidate);
                }
            }
            request.candidates = kept;
        }
        Ok(())
    }

    /// `allocateOne`: the `device`-th device of request `request`, looked for from candidate
    /// `start` on; true when everything from here on got allocated.
    fn allocate_one(
        &mut self,
        request: usize,
        device: usize,
        start: usize,
    ) -> Result<bool, String> {
        self.steps += 1;
        if self.steps > MAX_STEPS {
            return Err(format!(
                "filter operation aborted: no allocation found within {MAX_STEPS} steps"
            ));
        }
        let Some(current) = self.requests.get(request) else {
            return Ok(true);
        };
        let (all, found) = (current.all, current.candidates.len());
        if all && found == 0 {
            return Ok(false);
        }
        let needed = if all { found } else { current.count };
        if device >= needed {
            return self.allocate_one(request + 1, 0, 0);
        }
        if all {
            let Some(undo) = self.allocate_device(request, device, true)? else {
                return Ok(false);
            };
            if self.allocate_one(request, device + 1, 0)? {
                return Ok(true);
            }
            self.undo(undo);
            return Ok(false);
        }
        for index in start..found {
            if let Some(undo) = self.allocate_device(request, index, false)? {
                if self.allocate_one(request, device + 1, index + 1)? {
                    return Ok(true);
                }
                self.undo(undo);
            }
        }
        Ok(false)
    }

    /// The pool's counters left after its allocated devices, computed once per attempt.
    fn available(&mut self, pool: usize) -> Result<&Counters, String> {
        if !self.available.contains_key(&pool) {
            let snapshot = self.snapshot;
            let slices: Vec<&ResourceSlice> = snapshot
                .prepared()
                .pools
                .get(pool)
                .map(|p| p.slices.iter().map(|s| &*snapshot.slices[*s]).collect())
                .unwrap_or_default();
            let state = self.state;
            let available = counters::available(
                &slices,
                |slice, device| {
                    state.is_allocated(&(
                        slice.spec.driver.clone(),
                        slice.spec.pool.name.clone(),
                        device.name.clone(),
                    ))
                },
                &capacity::amount,
            )?;
            self.available.insert(pool, available);
        }
        Ok(&self.available[&pool])
    }

    /// `allocateDevice`: candidate `index` of request `request`, if it can be taken.
    /// `must`: the caller gives up without this device, so a constraint that refuses it is
    /// an error (as upstream).
    fn allocate_device(
        &mut self,
        request: usize,
        index: usize,
        must: bool,
    ) -> Result<Option<Undo<'a>>, String> {
        let current = &self.requests[request];
        let (claim, name, exactly) = (current.claim, current.name, current.exactly);
        let candidate = &current.candidates[index];
        let (facts, pool, device) = (candidate.facts, candidate.pool, candidate.device);
        let id = &facts.id;
        let node_local = candidate.node_local;
        let shareable = device.allow_multiple_allocations == Some(true);
        if self.state.exclusive(id) || self.exclusive.contains(id) {
            return Ok(None);
        }
        if tainted(device, exactly.tolerations.as_deref().unwrap_or_default()) {
            return Ok(None);
        }
        let Some(consumed) = capacity::request_consumption(&current.requested, device, facts)?
        else {
            return Ok(None);
        };
        let existing = self.state.consumed(id);
        if !capacity::fits(&consumed, existing, self.capacity.get(id), device, facts)? {
            return Ok(None);
        }
        let skip_counters = shareable && (existing.is_some() || self.capacity.contains_key(id));
        let mut taken_counters = None;
        if !skip_counters
            && device
                .consumes_counters
                .as_ref()
                .is_some_and(|c| !c.is_empty())
        {
            let Some(mine) = self.counters_fit(device, pool)? else {
                return Ok(None);
            };
            taken_counters = Some(mine);
        }
        if !self.add_to_constraints(claim, name, device, &id.0) {
            if must {
                return Err(format!(
                    "request {name}: cannot add device {}/{}/{} because a claim constraint would not be satisfied",
                    id.0, id.1, id.2
                ));
            }
            return Ok(None);
        }
        let mut undo = Undo {
            claim,
            request: name,
            shared: None,
            exclusive: None,
            counters: None,
        };
        if let Some(mine) = taken_counters {
            let total = self.counters.entry(pool).or_default();
            for (key, value) in &mine {
                *total.entry(key.clone()).or_insert(0) += value;
            }
            undo.counters = Some((pool, mine));
        }
        let (share_id, written) = self.take(id, consumed, device, &mut undo);
        self.results[claim].push(Chosen {
            request: name,
            id,
            node_local,
            share_id,
            consumed: written,
        });
        Ok(Some(undo))
    }

    /// Marks the device taken in this attempt: a share's consumed capacity (with a fresh share
    /// ID and the `consumedCapacity` to write), or the whole device.
    fn take(
        &mut self,
        id: &'a DeviceId,
        consumed: Vec<capacity::Consumed<'_>>,
        device: &Device,
        undo: &mut Undo<'a>,
    ) -> (Option<String>, Option<BTreeMap<String, Quantity>>) {
        if device.allow_multiple_allocations != Some(true) {
            self.exclusive.insert(id);
            undo.exclusive = Some(id);
            return (None, None);
        }
        let amounts = capacity::amounts(&consumed, device);
        let entry = self.capacity.entry(id).or_default();
        for (key, value) in &amounts {
            *entry.entry(key.clone()).or_insert(0) += value;
        }
        undo.shared = Some((id, amounts));
        let written = capacity::written(consumed, device);
        (
            Some(new_share_id()),
            (!written.is_empty()).then_some(written),
        )
    }

    /// `checkAvailableCounters`: what `device` consumes of its pool's shared counters, when
    /// that still fits next to the devices taken earlier in this attempt; `None` when not.
    fn counters_fit(&mut self, device: &Device, pool: usize) -> Result<Option<Counters>, String> {
        let mine = counters::consumption(device, &capacity::amount)?;
        let mut total = self.counters.get(&pool).cloned().unwrap_or_default();
        for (key, value) in &mine {
            *total.entry(key.clone()).or_insert(0) += value;
        }
        Ok(counters::within(self.available(pool)?, &total).then_some(mine))
    }

    /// Adds the device to every constraint of the claim, or to none when one refuses it.
    fn add_to_constraints(
        &mut self,
        claim: usize,
        request: &str,
        device: &'a Device,
        driver: &str,
    ) -> bool {
        let constraints = &mut self.constraints[claim];
        for i in 0..constraints.len() {
            if !constraints[i].add(request, device, driver) {
                for earlier in &mut constraints[..i] {
                    earlier.remove(request);
                }
                return false;
            }
        }
        true
    }

    /// Takes back one [`Self::allocate_device`].
    fn undo(&mut self, undo: Undo<'a>) {
        for constraint in &mut self.constraints[undo.claim] {
            constraint.remove(undo.request);
        }
        if let Some(id) = undo.exclusive {
            self.exclusive.remove(id);
        }
        if let Some((id, amounts)) = undo.shared
            && let Some(entry) = self.capacity.get_mut(id)
        {
            for (key, value) in amounts {
                *entry.entry(key).or_insert(0) -= value;
            }
            // `ConsumedCapacityCollection.Remove` forgets a device whose amounts are all 0.
            if entry.values().all(|v| *v == 0) {
                self.capacity.remove(id);
            }
        }
        if let Some((pool, mine)) = undo.counters
            && let Some(total) = self.counters.get_mut(&pool)
        {
            for (key, value) in mine {
                *total.entry(key).or_insert(0) -= value;
            }
        }
        self.results[undo.claim].pop();
    }

    /// The allocation results, one per claim, in the order of `claims`.
    fn into_results(self, claims: &[&ResourceClaim], node_name: &str) -> Vec<AllocationResult> {
        let mut results = Vec::new();
        for (index, (claim, chosen)) in claims.iter().zip(self.results).enumerate() {
            let node_local = chosen.iter().any(|c| c.node_local);
            let mut configs = Vec::new();
            for request in self.requests.iter().filter(|r| r.claim == index) {
                for config in request.class.spec.config.iter().flatten() {
                    configs.push(DeviceAllocationConfiguration {
                        source: "FromClass".to_owned(),
                        requests: Some(vec![request.name.to_owned()]),
                        opaque: config.opaque.clone(),
                    });
                }
            }
            for config in claim
                .spec
                .devices
                .iter()
                .flat_map(|d| d.config.iter().flatten())
            {
                configs.push(DeviceAllocationConfiguration {
                    source: "FromClaim".to_owned(),
                    requests: config.requests.clone(),
                    opaque: config.opaque.clone(),
                });
            }
            let request_results = chosen
                .into_iter()
                .map(|c| DeviceRequestAllocationResult {
                    request: c.request.to_owned(),
                    driver: c.id.0.clone(),
                    pool: c.id.1.clone(),
                    device: c.id.2.clone(),
                    share_id: c.share_id,
                    consumed_capacity: c.consumed,
                    ..DeviceRequestAllocationResult::default()
                })
                .collect();
            let node_selector = node_local.then(|| NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_fields: Some(vec![NodeSelectorRequirement {
                        key: "metadata.name".to_owned(),
                        operator: "In".to_owned(),
                        values: Some(vec![node_name.to_owned()]),
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
        results
    }
}
