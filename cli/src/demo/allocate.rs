//! Allocation of the demo's claims, pod by pod, as the cluster would do it: kerf's
//! controller first places a pod's Controller-class claims together
//! ([`kerf_api::claim_request`] → [`kerf_core::alloc::place`] →
//! [`kerf_api::allocation_status`]); only then can kube-scheduler schedule the pod and
//! allocate its Scheduler-class claims (kube-scheduler's structured allocator, from
//! kerf-scheduler-standin, through [`super::scheduler`]). A pod whose claims are all
//! allocated is reserved in each claim's `reservedFor`.
//!
//! With several nodes, a pod runs on one: the node kerf's controller placed its controller
//! claims on, else the node of a claim it shares that is already allocated, else the first
//! node (in the demo's order) where the scheduler stand-in can allocate all its claims.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{
    ResourceClaim, ResourceClaimConsumerReference, ResourceClaimStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_api::controller_claims::{ALLOCATED_NODE_ANNOTATION, FINALIZER, is_controller_claim};
use kerf_core::alloc::{self, Index, PodRequest};
use kerf_scheduler_standin::{AllocatedState, Allocator};
use serde::{Deserialize, Serialize};

use super::classes::Classes;
use super::scheduler::{self, Node};
use super::workload::{DemoPod, Workload};

/// Which allocator placed a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AllocatedBy {
    /// kerf's controller (the real allocator).
    #[serde(rename = "kerf-controller")]
    Controller,
    /// kube-scheduler's allocator (kerf-scheduler-standin).
    #[serde(rename = "scheduler (emulated)")]
    Scheduler,
}

impl AllocatedBy {
    /// How the table names it.
    pub fn as_str(self) -> &'static str {
        match self {
            AllocatedBy::Controller => "kerf-controller",
            AllocatedBy::Scheduler => "scheduler (emulated)",
        }
    }
}

/// What allocation did to one claim.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimOutcome {
    /// Who allocated it, when it is allocated.
    pub allocated_by: Option<AllocatedBy>,
    /// Why it is not allocated (or why its pod cannot run).
    pub error: Option<String>,
}

/// What allocation did to one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodOutcome {
    /// `Ok` with the node it runs on when every claim is allocated there.
    pub schedulable: Result<String, String>,
}

impl PodOutcome {
    /// Whether the pod runs on `node`.
    pub fn runs_on(&self, node: &str) -> bool {
        self.schedulable.as_deref() == Ok(node)
    }
}

/// Allocates every pod's claims on one of `nodes` (at least one, all of one driver),
/// writing `status.allocation` and `reservedFor` into the workload's claims. Returns one
/// outcome per claim and per pod, in workload order.
pub fn allocate_all(
    workload: &mut Workload,
    classes: &Classes,
    nodes: &[Node<'_>],
    index: &mut Index,
    now: &Time,
) -> (Vec<ClaimOutcome>, Vec<PodOutcome>) {
    let mut claims = vec![ClaimOutcome::default(); workload.claims.len()];
    let mut held = BTreeMap::new();
    let mut claim_nodes = vec![None; workload.claims.len()];
    let pods = workload.pods.clone();
    let mut pod_outcomes = Vec::with_capacity(pods.len());
    let mut allocator = Allocator::default();
    for pod in &pods {
        let mut allocation = PodAllocation {
            workload: &mut *workload,
            outcomes: &mut claims,
            classes,
            nodes,
            index: &mut *index,
            held: &mut held,
            claim_nodes: &mut claim_nodes,
            allocator: &mut allocator,
            now,
        };
        let schedulable = allocation.pod(pod);
        pod_outcomes.push(PodOutcome { schedulable });
    }
    let driver = nodes.first().map_or("", |n| n.driver);
    explain_unused(workload, classes, driver, &mut claims);
    (claims, pod_outcomes)
}

/// The state one pod's allocation works on.
struct PodAllocation<'a> {
    workload: &'a mut Workload,
    outcomes: &'a mut [ClaimOutcome],
    classes: &'a Classes,
    nodes: &'a [Node<'a>],
    index: &'a mut Index,
    /// The devices claims hold whole, per node.
    held: &'a mut BTreeMap<String, BTreeSet<String>>,
    /// The node of each allocated claim, by workload index.
    claim_nodes: &'a mut [Option<String>],
    allocator: &'a mut Allocator,
    now: &'a Time,
}

impl PodAllocation<'_> {
    fn pod(&mut self, pod: &DemoPod) -> Result<String, String> {
        let pod_key = format!("{}/{}", pod.namespace, pod.name);
        let indices: Vec<usize> = pod
            .claims
            .iter()
            .filter_map(|c| c.claim.as_ref().ok().copied())
            .collect();
        if let Some(missing) = pod.claims.iter().find_map(|c| c.claim.as_ref().err()) {
            return Err(self.unschedulable(&pod_key, &indices, missing));
        }
        let unallocated: Vec<usize> = indices
            .iter()
            .copied()
            .filter(|i| !self.is_allocated(*i))
            .collect();
        let (controller, scheduler): (Vec<usize>, Vec<usize>) = unallocated
            .into_iter()
            .partition(|i| self.is_controller_claim(*i));
        // A claim the pod shares with an earlier pod pins it to that claim's node.
        let pinned = indices.iter().find_map(|&i| self.claim_nodes[i].clone());
        let placed = match self.controller(&controller, pinned.as_deref()) {
            Ok(placed) => placed,
            Err(e) => return Err(self.unschedulable(&pod_key, &indices, &e)),
        };
        let candidates: Vec<&str> = match placed.or(pinned) {
            Some(node) => self
                .nodes
                .iter()
                .map(|n| n.name)
                .filter(|n| *n == node)
                .collect(),
            None => self.nodes.iter().map(|n| n.name).collect(),
        };
        let node = match self.scheduler(&scheduler, &candidates) {
            Ok(node) => node,
            Err(e) => return Err(self.unschedulable(&pod_key, &indices, &e)),
        };
        for &i in &indices {
            self.reserve(i, pod);
        }
        Ok(node)
    }

    /// Records why the pod cannot run on every claim of the pod that has no error yet and
    /// that no other pod has reserved (those run for that pod).
    fn unschedulable(&mut self, pod_key: &str, indices: &[usize], why: &str) -> String {
        let message = format!("pod {pod_key} cannot be scheduled: {why}");
        for &i in indices {
            let reserved = self
                .claim(i)
                .and_then(|c| c.status.as_ref())
                .and_then(|s| s.reserved_for.as_ref())
                .is_some_and(|r| !r.is_empty());
            if self.outcomes[i].error.is_none() && !reserved {
                self.outcomes[i].error = Some(message.clone());
            }
        }
        message
    }

    fn claim(&self, index: usize) -> Option<&ResourceClaim> {
        self.workload.claims[index].claim.as_ref()
    }

    fn is_allocated(&self, index: usize) -> bool {
        self.claim(index)
            .and_then(|c| c.status.as_ref())
            .and_then(|s| s.allocation.as_ref())
            .is_some()
    }

    /// As the controller decides it: a request uses a Controller class of this driver.
    fn is_controller_claim(&self, index: usize) -> bool {
        self.claim(index)
            .is_some_and(|c| is_controller_claim(c, |class| self.classes.params(class)))
    }

    /// Places the controller claims together, all or nothing, as the controller does, on
    /// `pinned` or any node; returns the node, or `None` without controller claims.
    fn controller(
        &mut self,
        indices: &[usize],
        pinned: Option<&str>,
    ) -> Result<Option<String>, String> {
        if indices.is_empty() {
            return Ok(None);
        }
        let driver = self.nodes.first().map_or("", |n| n.driver);
        let mut request = PodRequest::default();
        for &i in indices {
            let Some(claim) = self.claim(i) else { continue };
            match kerf_api::claim_request(claim, |class| self.classes.params(class), driver) {
                Ok(part) => request.claims.push(part),
                Err(e) => {
                    let message = e.to_string();
                    self.outcomes[i].error = Some(message.clone());
                    let name = &self.workload.claims[i].name;
                    return Err(format!("kerf-controller: claim {name}: {message}"));
                }
            }
        }
        let names: Vec<&str> = match pinned {
            Some(node) => vec![node],
            None => self.nodes.iter().map(|n| n.name).collect(),
        };
        let placement = alloc::place(self.index, &request, &names).map_err(|e| {
            let message = e.to_string();
            for &i in indices {
                self.outcomes[i].error = Some(message.clone());
            }
            format!("kerf-controller: {message}")
        })?;
        self.index.apply(&placement);
        for placed in &placement.claims {
            let Some(i) = indices
                .iter()
                .copied()
                .find(|&i| self.workload.claims[i].uid() == placed.key)
            else {
                continue;
            };
            let status =
                kerf_api::allocation_status(placed, &placement.node, driver, self.now.clone())
                    .map_err(|e| e.to_string())?;
            let node = placement.node.clone();
            if let Some(claim) = self.workload.claims[i].claim.as_mut() {
                mark_controller_allocated(claim, &node);
                claim
                    .status
                    .get_or_insert_with(ResourceClaimStatus::default)
                    .allocation = Some(status);
            }
            self.claim_nodes[i] = Some(node);
            self.outcomes[i].allocated_by = Some(AllocatedBy::Controller);
        }
        Ok(Some(placement.node))
    }

    /// Allocates the scheduler claims of one pod, all or nothing, on the first of
    /// `candidates` where they all fit; returns that node. When none fits, each failing claim
    /// gets the reason (per node, when the nodes give different ones).
    fn scheduler(&mut self, indices: &[usize], candidates: &[&str]) -> Result<String, String> {
        let mut failures: Vec<(&str, usize, String)> = Vec::new();
        for &name in candidates {
            let Some(node) = self.nodes.iter().find(|n| n.name == name) else {
                continue;
            };
            match self.scheduler_on(indices, node) {
                Ok(()) => return Ok(name.to_owned()),
                Err((i, e)) => failures.push((name, i, e)),
            }
        }
        let Some(first) = failures.first() else {
            return Err("no node to schedule the pod on".to_owned());
        };
        let same = failures
            .iter()
            .all(|(_, i, e)| *i == first.1 && *e == first.2);
        if same {
            let (_, i, e) = first;
            self.outcomes[*i].error = Some(e.clone());
            let name = &self.workload.claims[*i].name;
            return Err(format!("scheduler: claim {name}: {e}"));
        }
        let mut by_claim: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        let mut message = Vec::new();
        for (node, i, e) in &failures {
            by_claim
                .entry(*i)
                .or_default()
                .push(format!("node {node}: {e}"));
            let name = &self.workload.claims[*i].name;
            message.push(format!("node {node}: claim {name}: {e}"));
        }
        for (i, reasons) in by_claim {
            self.outcomes[i].error = Some(reasons.join("; "));
        }
        Err(format!("scheduler: {}", message.join("; ")))
    }

    /// [`Self::scheduler`] on one node; the failing claim and why.
    fn scheduler_on(&mut self, indices: &[usize], node: &Node<'_>) -> Result<(), (usize, String)> {
        // Copies: the allocator borrows `self` mutably while it reads them.
        let wanted: Vec<(usize, ResourceClaim)> = indices
            .iter()
            .filter_map(|&i| self.claim(i).map(|c| (i, c.clone())))
            .collect();
        let claims: Vec<&ResourceClaim> = wanted.iter().map(|(_, c)| c).collect();
        let held = self.held.get(node.name).cloned().unwrap_or_default();
        let first = wanted.first().map_or(0, |(i, _)| *i);
        let state = self.allocated_state().map_err(|e| (first, e))?;
        let allocations = scheduler::allocate(
            self.allocator,
            &claims,
            self.classes,
            node,
            &state,
            (&held, self.index),
            self.now,
        )
        .map_err(|(at, e)| (wanted[at].0, e))?;
        let indices: Vec<usize> = wanted.iter().map(|(i, _)| *i).collect();
        let held = self.held.entry(node.name.to_owned()).or_default();
        for (&i, allocation) in indices.iter().zip(allocations) {
            held.extend(
                allocation
                    .devices
                    .iter()
                    .flat_map(|d| d.results.iter().flatten())
                    .filter(|r| r.pool == node.name)
                    .map(|r| r.device.clone()),
            );
            if let Some(claim) = self.workload.claims[i].claim.as_mut() {
                claim
                    .status
                    .get_or_insert_with(ResourceClaimStatus::default)
                    .allocation = Some(allocation);
                let uid = claim.metadata.uid.clone().unwrap_or_default();
                // The controller learns of the scheduler's devices from the claim, as its
                // watch would show it.
                self.index
                    .set_claim_usage(&uid, kerf_api::device_uses(claim, node.driver));
            }
            self.claim_nodes[i] = Some(node.name.to_owned());
            self.outcomes[i].allocated_by = Some(AllocatedBy::Scheduler);
        }
        Ok(())
    }

    /// What every claim's `status.allocation` holds, whoever wrote it
    /// (`ListAllAllocatedDevices`).
    ///
    /// # Errors
    /// A `consumedCapacity` that does not parse, naming the device.
    fn allocated_state(&self) -> Result<AllocatedState, String> {
        let mut state = AllocatedState::default();
        for claim in self.workload.claims.iter().filter_map(|c| c.claim.as_ref()) {
            if let Some(allocation) = kerf_api::claim_status::allocation_of(claim) {
                state.add(allocation)?;
            }
        }
        Ok(state)
    }

    fn reserve(&mut self, index: usize, pod: &DemoPod) {
        let Some(claim) = self.workload.claims[index].claim.as_mut() else {
            return;
        };
        let reserved = claim
            .status
            .get_or_insert_with(ResourceClaimStatus::default)
            .reserved_for
            .get_or_insert_with(Vec::new);
        if !reserved.iter().any(|r| r.uid == pod.uid) {
            reserved.push(ResourceClaimConsumerReference {
                api_group: None,
                resource: "pods".to_owned(),
                name: pod.name.clone(),
                uid: pod.uid.clone(),
            });
        }
    }
}

/// The finalizer and annotation the controller sets before it writes an allocation.
fn mark_controller_allocated(claim: &mut ResourceClaim, node: &str) {
    let finalizers = claim.metadata.finalizers.get_or_insert_with(Vec::new);
    if !finalizers.iter().any(|f| f == FINALIZER) {
        finalizers.push(FINALIZER.to_owned());
    }
    claim
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(ALLOCATED_NODE_ANNOTATION.to_owned(), node.to_owned());
}

/// Why claims that no pod reached are not allocated: a refused manifest, invalid controller
/// parameters (checked here, although the controller only looks once a pod exists), or
/// simply no consumer.
fn explain_unused(
    workload: &Workload,
    classes: &Classes,
    driver: &str,
    outcomes: &mut [ClaimOutcome],
) {
    for (claim, outcome) in workload.claims.iter().zip(outcomes.iter_mut()) {
        if outcome.allocated_by.is_some() || outcome.error.is_some() {
            continue;
        }
        if let Some(error) = &claim.manifest_error {
            outcome.error = Some(format!("the API server refuses the manifest: {error}"));
            continue;
        }
        let Some(object) = &claim.claim else { continue };
        let is_controller = is_controller_claim(object, |class| classes.params(class));
        let invalid = is_controller
            .then(|| kerf_api::claim_request(object, |class| classes.params(class), driver).err())
            .flatten();
        outcome.error = Some(match invalid {
            Some(e) => e.to_string(),
            None => "no pod uses this claim; allocation waits for the first consumer".to_owned(),
        });
    }
}
