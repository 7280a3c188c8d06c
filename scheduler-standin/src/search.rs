//! One node's search: upstream's `allocateOne` and `allocateDevice` over the candidates of
//! each request (see [`crate::allocator`] for what they keep from upstream).
//!
//! The search only remembers which devices it took, with what each share consumes; the
//! allocation result (with fresh share IDs and the `consumedCapacity` to write) is built by
//! [`Search::into_results`], only for a node an allocation is wanted on.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, Device, DeviceAllocationConfiguration, DeviceAllocationResult,
    DeviceRequestAllocationResult, ResourceClaim, ResourceSlice,
};

use crate::allocated::{AllocatedState, DeviceKey, new_share_id};
use crate::allocator::{Candidate, MAX_STEPS};
use crate::capacity::{self, Consumed};
use crate::constraints::Constraint;
use crate::plan::{Plan, PlannedRequest};
use crate::pods::tainted;
use crate::snapshot::Snapshot;
use kerf_api::counters::{self, Counters};

/// One request of one claim with its candidates on this node.
pub(crate) struct Request<'a> {
    pub planned: &'a PlannedRequest<'a>,
    pub candidates: Vec<Candidate<'a>>,
    /// Per candidate, whether [`Search::allocate_device`] refused it for a reason that holds
    /// for the whole search while this attempt has no share of it (in use, tainted, the
    /// request not servable, too little capacity left), so that backtracking over
    /// combinations checks each such device once. The answer is the same as checking again.
    rejected: Vec<bool>,
}

impl<'a> Request<'a> {
    /// The request with its candidates on the node.
    pub(crate) fn new(planned: &'a PlannedRequest<'a>, candidates: Vec<Candidate<'a>>) -> Self {
        Self {
            planned,
            rejected: vec![false; candidates.len()],
            candidates,
        }
    }
}

/// One device chosen for a request.
struct Chosen<'a> {
    request: &'a str,
    key: &'a DeviceKey,
    device: &'a Device,
    node_local: bool,
    /// Whether the device is shared (it gets a share ID).
    share: bool,
    /// What the share consumes of each of the device's capacities, in their order.
    consumed: Vec<Consumed<'a>>,
}

/// What one successful [`Search::allocate_device`] changed besides the chosen device, to
/// take it back.
struct Undo<'a> {
    claim: usize,
    request: &'a str,
    /// The device's slot, when this attempt's shares of it grew.
    shared: Option<usize>,
    /// The device's slot, when it was taken exclusively.
    exclusive: Option<usize>,
    counters: Option<(usize, Counters)>,
}

/// The state of one node's search.
pub(crate) struct Search<'a> {
    snapshot: &'a Snapshot,
    state: &'a AllocatedState,
    available: HashMap<usize, Counters>,
    requests: Vec<Request<'a>>,
    constraints: Vec<Vec<Constraint<'a>>>,
    /// Slots of the devices taken exclusively in this attempt.
    exclusive: Vec<usize>,
    /// Per device (slot) shared in this attempt, what its shares consume, in the order of
    /// its capacities; a device whose amounts are all 0 is dropped
    /// (`ConsumedCapacityCollection.Remove`).
    capacity: Vec<(usize, Vec<i128>)>,
    counters: HashMap<usize, Counters>,
    results: Vec<Vec<Chosen<'a>>>,
    /// Kept from one device check to the next, so that a check allocates nothing.
    consumed: Vec<Consumed<'a>>,
    steps: usize,
}

impl<'a> Search<'a> {
    /// A search over `requests` (one per planned request of `plan`, with its candidates).
    pub(crate) fn new(
        snapshot: &'a Snapshot,
        state: &'a AllocatedState,
        requests: Vec<Request<'a>>,
        plan: &'a Plan<'a>,
    ) -> Self {
        Self {
            snapshot,
            state,
            available: HashMap::new(),
            requests,
            constraints: plan.constraints.clone(),
            exclusive: Vec::new(),
            capacity: Vec::new(),
            counters: HashMap::new(),
            results: plan.constraints.iter().map(|_| Vec::new()).collect(),
            consumed: Vec::new(),
            steps: 0,
        }
    }

    /// `validateDeviceRequest` for `allocationMode: All`: keep the candidates whose capacity
    /// check passes against what is allocated already.
    pub(crate) fn narrow_all_requests(&mut self) -> Result<(), String> {
        for request in self.requests.iter_mut().filter(|r| r.planned.all) {
            let mut kept = Vec::new();
            for candidate in request.candidates.drain(..) {
                let (device, facts) = (candidate.device, candidate.facts);
                let requested = &request.planned.requested;
                if capacity::request_consumption(requested, device, facts, &mut self.consumed)?
                    && capacity::fits(
                        &self.consumed,
                        existing(self.state, &facts.key),
                        None,
                        device,
                        facts,
                    )?
                {
                    kept.push(candidate);
                }
            }
            request.rejected = vec![false; kept.len()];
            request.candidates = kept;
        }
        Ok(())
    }

    /// `allocateOne`: the `device`-th device of request `request`, looked for from candidate
    /// `start` on; true when everything from here on got allocated.
    pub(crate) fn allocate_one(
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
        let (all, found) = (current.planned.all, current.candidates.len());
        if all && found == 0 {
            return Ok(false);
        }
        let needed = if all { found } else { current.planned.count };
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
            // Fewer candidates left than devices still needed: no combination from here on
            // (upstream tries them all and finds none; the first solution is the same).
            if found - index < needed - device {
                break;
            }
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
                    state.is_allocated(&DeviceKey::new((
                        slice.spec.driver.clone(),
                        slice.spec.pool.name.clone(),
                        device.name.clone(),
                    )))
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
        let planned = current.planned;
        let (claim, name) = (planned.claim, planned.name);
        let candidate = &current.candidates[index];
        let (facts, pool, device) = (candidate.facts, candidate.pool, candidate.device);
        let node_local = candidate.node_local;
        let shareable = device.allow_multiple_allocations == Some(true);
        let allocating = allocating(&self.capacity, facts.slot);
        if allocating.is_none() && current.rejected[index] {
            return Ok(None);
        }
        if self.exclusive.contains(&facts.slot) {
            return Ok(None);
        }
        let in_use = self.state.in_use(&facts.key);
        let existing = in_use.and_then(|u| u.consumed.as_ref()).is_some();
        let skip_counters = shareable && (existing || allocating.is_some());
        let Some(mut consumed) = self.consumption(request, index)? else {
            return Ok(None);
        };
        let mut taken_counters = None;
        if !skip_counters
            && device
                .consumes_counters
                .as_ref()
                .is_some_and(|c| !c.is_empty())
        {
            let Some(mine) = self.counters_fit(device, pool)? else {
                self.consumed = consumed;
                return Ok(None);
            };
            taken_counters = Some(mine);
        }
        if !self.add_to_constraints(claim, name, device, &facts.key.id.0) {
            self.consumed = consumed;
            if must {
                let id = &facts.key.id;
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
        let share = self.take(facts.slot, &consumed, shareable, &mut undo);
        if !share {
            consumed.clear();
        }
        self.results[claim].push(Chosen {
            request: name,
            key: &facts.key,
            device,
            node_local,
            share,
            consumed,
        });
        Ok(Some(undo))
    }

    /// The capacity candidate `index` of request `request` would consume, or `None` when it
    /// cannot serve the request: in exclusive use, tainted, or out of capacity. A refusal that
    /// holds for the whole search (no share of the device is being taken in this attempt) is
    /// remembered, so backtracking does not check the device again.
    fn consumption(
        &mut self,
        request: usize,
        index: usize,
    ) -> Result<Option<Vec<Consumed<'a>>>, String> {
        let current = &self.requests[request];
        let planned = current.planned;
        let candidate = &current.candidates[index];
        let (facts, device) = (candidate.facts, candidate.device);
        let allocating = allocating(&self.capacity, facts.slot);
        let in_use = self.state.in_use(&facts.key);
        let mut consumed = std::mem::take(&mut self.consumed);
        let servable = !in_use.is_some_and(|u| u.exclusive)
            && !tainted(
                device,
                planned.exactly.tolerations.as_deref().unwrap_or_default(),
            )
            && capacity::request_consumption(&planned.requested, device, facts, &mut consumed)?;
        let existing = in_use.and_then(|u| u.consumed.as_ref());
        if servable && capacity::fits(&consumed, existing, allocating, device, facts)? {
            return Ok(Some(consumed));
        }
        self.consumed = consumed;
        if allocating.is_none() {
            self.requests[request].rejected[index] = true;
        }
        Ok(None)
    }

    /// Marks the device (`slot`) taken in this attempt: a share's consumed capacity, or the
    /// whole device. True for a share.
    fn take(
        &mut self,
        slot: usize,
        consumed: &[Consumed<'_>],
        shareable: bool,
        undo: &mut Undo<'a>,
    ) -> bool {
        if !shareable {
            self.exclusive.push(slot);
            undo.exclusive = Some(slot);
            return false;
        }
        match self.capacity.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, total)) => {
                for (total, this) in total.iter_mut().zip(consumed) {
                    *total += this.nanos;
                }
            }
            None => self.capacity.push((slot, capacity::amounts(consumed))),
        }
        undo.shared = Some(slot);
        true
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
        let chosen = self.results[undo.claim].pop();
        if let Some(slot) = undo.exclusive {
            self.exclusive.retain(|s| *s != slot);
        }
        if let Some(slot) = undo.shared
            && let Some(at) = self.capacity.iter().position(|(s, _)| *s == slot)
        {
            let total = &mut self.capacity[at].1;
            for (total, this) in total
                .iter_mut()
                .zip(chosen.iter().flat_map(|c| &c.consumed))
            {
                *total -= this.nanos;
            }
            // `ConsumedCapacityCollection.Remove` forgets a device whose amounts are all 0.
            if total.iter().all(|v| *v == 0) {
                self.capacity.swap_remove(at);
            }
        }
        if let Some((pool, mine)) = undo.counters
            && let Some(total) = self.counters.get_mut(&pool)
        {
            for (key, value) in mine {
                *total.entry(key).or_insert(0) -= value;
            }
        }
        if let Some(chosen) = chosen {
            // The buffer goes back to the checks, so the next one allocates nothing.
            self.consumed = chosen.consumed;
        }
    }

    /// The allocation results, one per claim, in the order of `claims`: the devices taken,
    /// each share with a fresh share ID and its `consumedCapacity`.
    pub(crate) fn into_results(
        self,
        claims: &[&ResourceClaim],
        node_name: &str,
    ) -> Vec<AllocationResult> {
        let mut results = Vec::new();
        for (index, (claim, chosen)) in claims.iter().zip(self.results).enumerate() {
            let node_local = chosen.iter().any(|c| c.node_local);
            let mut configs = Vec::new();
            for request in self.requests.iter().filter(|r| r.planned.claim == index) {
                for config in request.planned.class.spec.config.iter().flatten() {
                    configs.push(DeviceAllocationConfiguration {
                        source: "FromClass".to_owned(),
                        requests: Some(vec![request.planned.name.to_owned()]),
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
            let request_results = chosen.iter().map(request_result).collect();
            results.push(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(request_results),
                    config: (!configs.is_empty()).then_some(configs),
                }),
                node_selector: node_local.then(|| on_node(node_name)),
                allocation_timestamp: None,
            });
        }
        results
    }
}

/// One chosen device as a result: a share gets a fresh share ID and, when it consumes any
/// capacity, its `consumedCapacity`.
fn request_result(chosen: &Chosen<'_>) -> DeviceRequestAllocationResult {
    let (driver, pool, device) = &chosen.key.id;
    let consumed_capacity = chosen
        .share
        .then(|| capacity::written(&chosen.consumed, chosen.device))
        .filter(|written| !written.is_empty());
    DeviceRequestAllocationResult {
        request: chosen.request.to_owned(),
        driver: driver.clone(),
        pool: pool.clone(),
        device: device.clone(),
        share_id: chosen.share.then(new_share_id),
        consumed_capacity,
        ..DeviceRequestAllocationResult::default()
    }
}

/// `createNodeSelector` for a node-local device: the node by `metadata.name`.
fn on_node(node_name: &str) -> NodeSelector {
    NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_fields: Some(vec![NodeSelectorRequirement {
                key: "metadata.name".to_owned(),
                operator: "In".to_owned(),
                values: Some(vec![node_name.to_owned()]),
            }]),
            match_expressions: None,
        }],
    }
}

/// What this attempt's earlier shares of the device (`slot`) consume, from the search's
/// `capacity`.
fn allocating(capacity: &[(usize, Vec<i128>)], slot: usize) -> Option<&[i128]> {
    capacity
        .iter()
        .find(|(s, _)| *s == slot)
        .map(|(_, amounts)| amounts.as_slice())
}

/// What the allocated claims' shares consume of the device, by capacity name.
fn existing<'s>(state: &'s AllocatedState, key: &DeviceKey) -> Option<&'s capacity::Amounts> {
    state.in_use(key).and_then(|u| u.consumed.as_ref())
}
