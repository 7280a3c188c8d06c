//! Allocation of the demo's claims, pod by pod, as the cluster would do it: kerf's
//! controller first places a pod's Controller-class claims together
//! ([`kerf_api::claim_request`] → [`kerf_core::alloc::place`] →
//! [`kerf_api::allocation_status`]); only then can kube-scheduler schedule the pod and
//! allocate its Scheduler-class claims (emulated by [`super::scheduler`]). A pod whose claims
//! are all allocated is reserved in each claim's `reservedFor`.

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::{
    ResourceClaim, ResourceClaimConsumerReference, ResourceClaimStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_api::controller_claims::{ALLOCATED_NODE_ANNOTATION, FINALIZER, is_controller_claim};
use kerf_core::alloc::{self, Index, PodRequest};
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
    /// The demo's stand-in for kube-scheduler.
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
    /// `Ok` when every claim is allocated and the pod can run on the node.
    pub schedulable: Result<(), String>,
}

/// Allocates every pod's claims on `node`, writing `status.allocation` and `reservedFor`
/// into the workload's claims. Returns one outcome per claim and per pod, in workload order.
pub fn allocate_all(
    workload: &mut Workload,
    classes: &Classes,
    node: &Node<'_>,
    index: &mut Index,
    now: &Time,
) -> (Vec<ClaimOutcome>, Vec<PodOutcome>) {
    let mut claims = vec![ClaimOutcome::default(); workload.claims.len()];
    let mut held = BTreeSet::new();
    let pods = workload.pods.clone();
    let mut pod_outcomes = Vec::with_capacity(pods.len());
    for pod in &pods {
        let mut allocation = PodAllocation {
            workload: &mut *workload,
            outcomes: &mut claims,
            classes,
            node,
            index: &mut *index,
            held: &mut held,
            now,
        };
        let schedulable = allocation.pod(pod);
        pod_outcomes.push(PodOutcome { schedulable });
    }
    explain_unused(workload, classes, node.driver, &mut claims);
    (claims, pod_outcomes)
}

/// The state one pod's allocation works on.
struct PodAllocation<'a> {
    workload: &'a mut Workload,
    outcomes: &'a mut [ClaimOutcome],
    classes: &'a Classes,
    node: &'a Node<'a>,
    index: &'a mut Index,
    held: &'a mut BTreeSet<String>,
    now: &'a Time,
}

impl PodAllocation<'_> {
    fn pod(&mut self, pod: &DemoPod) -> Result<(), String> {
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
        if let Err(e) = self.controller(&controller) {
            return Err(self.unschedulable(&pod_key, &indices, &e));
        }
        if let Err(e) = self.scheduler(&scheduler) {
            return Err(self.unschedulable(&pod_key, &indices, &e));
        }
        for &i in &indices {
            self.reserve(i, pod);
        }
        Ok(())
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

    /// Places the controller claims together, all or nothing, as the controller does.
    fn controller(&mut self, indices: &[usize]) -> Result<(), String> {
        if indices.is_empty() {
            return Ok(());
        }
        let driver = self.node.driver;
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
        let placement = alloc::place(self.index, &request, &[self.node.name]).map_err(|e| {
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
            self.outcomes[i].allocated_by = Some(AllocatedBy::Controller);
        }
        Ok(())
    }

    /// Allocates the scheduler claims of one pod, all or nothing.
    fn scheduler(&mut self, indices: &[usize]) -> Result<(), String> {
        let mut tentative = self.held.clone();
        let mut allocations = Vec::new();
        for &i in indices {
            let Some(claim) = self.claim(i) else { continue };
            match scheduler::allocate(
                claim,
                self.classes,
                self.node,
                &tentative,
                self.index,
                self.now.clone(),
            ) {
                Ok((allocation, taken)) => {
                    tentative.extend(taken);
                    allocations.push((i, allocation));
                }
                Err(e) => {
                    self.outcomes[i].error = Some(e.clone());
                    let name = &self.workload.claims[i].name;
                    return Err(format!("scheduler: claim {name}: {e}"));
                }
            }
        }
        *self.held = tentative;
        for (i, allocation) in allocations {
            if let Some(claim) = self.workload.claims[i].claim.as_mut() {
                claim
                    .status
                    .get_or_insert_with(ResourceClaimStatus::default)
                    .allocation = Some(allocation);
                let uid = claim.metadata.uid.clone().unwrap_or_default();
                // The controller learns of the scheduler's devices from the claim, as its
                // watch would show it.
                self.index
                    .set_claim_usage(&uid, kerf_api::device_uses(claim, self.node.driver));
            }
            self.outcomes[i].allocated_by = Some(AllocatedBy::Scheduler);
        }
        Ok(())
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
