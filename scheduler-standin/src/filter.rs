//! DynamicResources' Filter over every node, as the scheduling framework runs it: pure, from a
//! [`Snapshot`], so that the stand-in's cycle and the benchmarks decide alike.
//!
//! Upstream: kubernetes/kubernetes `pkg/scheduler/schedule_one.go`
//! (`findNodesThatPassFilters`, `nextStartNodeIndex`, `numFeasibleNodesToFind`) and
//! `pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go` (`Filter`).

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{AllocationResult, ResourceClaim};
use kerf_api::claim_status::allocation_of;
use kube::ResourceExt;

use crate::allocated::AllocatedState;
use crate::allocator::{Allocator, OnNode};
use crate::plan::Plan;
use crate::pods::{node_fits, node_selector_matches};
use crate::snapshot::Snapshot;
use crate::throttle::num_feasible_nodes_to_find;

/// A node where the pod fits. Its allocations are built for the node that is picked
/// ([`Allocator::allocate_feasible`]), not for every feasible one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Feasible {
    /// The node's position in [`Snapshot::nodes`].
    pub at: usize,
    /// The node's name.
    pub node: String,
}

/// What Filter found over the nodes.
#[derive(Debug, Clone, Default)]
pub struct Filtered {
    /// The feasible nodes, in node (name) order.
    pub feasible: Vec<Feasible>,
    /// The allocated claims (positions in the pod's claims) whose `nodeSelector` rejected a
    /// node on which everything else fitted: PostFilter's candidates.
    pub unavailable: BTreeSet<usize>,
    /// Why the last node that did not fit did not, in upstream's words.
    pub reason: String,
}

impl Allocator {
    /// Filter for `pod` with its `claims`, of which those at `to_allocate` need devices,
    /// given what `state` says is allocated already.
    ///
    /// Nodes are visited as `schedule_one.go` does: starting where the previous Filter
    /// stopped (advanced by the nodes processed) and stopping once
    /// [`num_feasible_nodes_to_find`] nodes fit (all of them under 100 nodes, 230 of 500).
    /// Upstream filters in parallel goroutines and may overshoot the limit by a few; this
    /// filters one node after the other. Per node: the node filters ([`node_fits`]), then
    /// the allocator; node-selector mismatches of allocated claims are recorded as
    /// unavailable only when the allocator succeeded on that node, because a failed
    /// `Allocate` returns first. The feasible nodes come back in name order, so where every
    /// node is filtered the order does not depend on the rotation.
    ///
    /// # Errors
    ///
    /// As [`Allocator::allocate_on_node`]: the whole cycle is aborted.
    pub fn filter(
        &mut self,
        pod: &Pod,
        claims: &[ResourceClaim],
        to_allocate: &[usize],
        snapshot: &Snapshot,
        state: &AllocatedState,
    ) -> Result<Filtered, String> {
        let count = snapshot.nodes.len();
        let start = self.next_start_node_index % count.max(1);
        let wanted = Wanted {
            pod,
            claims,
            to_allocate,
        };
        let limit = num_feasible_nodes_to_find(count);
        let (filtered, processed) = self.filter_from(start, limit, &wanted, snapshot, state)?;
        self.next_start_node_index = (start + processed) % count.max(1);
        Ok(filtered)
    }

    /// Plain first-fit, which kube-scheduler is not: the first node in name order where
    /// [`Self::filter`]'s checks pass, leaving its rotation alone. For reference figures
    /// (benchmarks), never for a scheduling cycle.
    ///
    /// # Errors
    ///
    /// As [`Self::filter`].
    pub fn first_fit(
        &mut self,
        pod: &Pod,
        claims: &[ResourceClaim],
        to_allocate: &[usize],
        snapshot: &Snapshot,
        state: &AllocatedState,
    ) -> Result<Option<Feasible>, String> {
        let wanted = Wanted {
            pod,
            claims,
            to_allocate,
        };
        let (filtered, _) = self.filter_from(0, 1, &wanted, snapshot, state)?;
        Ok(filtered.feasible.into_iter().next())
    }

    /// The allocations of the claims at `to_allocate` on `feasible`, a node [`Self::filter`]
    /// or [`Self::first_fit`] found with the same arguments: one per claim, in that order.
    ///
    /// Upstream's Filter keeps the allocation it found on every node and Reserve takes the
    /// picked node's (`nodeAllocations` in `dynamicresources.go`). The search is
    /// deterministic, so searching the picked node again finds the same devices; only the
    /// share IDs, random anyway, are drawn here, and the hundreds of nodes not picked cost
    /// no allocation results.
    ///
    /// # Errors
    ///
    /// As [`Self::filter`], or the node no longer fits (`state` changed since Filter).
    pub fn allocate_feasible(
        &mut self,
        feasible: &Feasible,
        claims: &[ResourceClaim],
        to_allocate: &[usize],
        snapshot: &Snapshot,
        state: &AllocatedState,
    ) -> Result<Vec<AllocationResult>, String> {
        let wanted: Vec<&ResourceClaim> = to_allocate.iter().map(|i| &claims[*i]).collect();
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let Some(node) = snapshot.nodes.get(feasible.at) else {
            return Err(format!("node {} is not in the snapshot", feasible.node));
        };
        let node = OnNode::new(node);
        let pools = snapshot.prepared().pools_at(feasible.at);
        let plan = Plan::new(snapshot, &wanted);
        match self.search(snapshot, &plan, (&node, pools), state)? {
            Some(search) => Ok(search.into_results(&wanted, &node.name)),
            None => Err(format!(
                "node {} no longer fits the claims it fitted in Filter",
                feasible.node
            )),
        }
    }

    /// Filter from node `start` on until `limit` nodes fit; what it found and how many
    /// nodes it processed.
    fn filter_from(
        &mut self,
        start: usize,
        limit: usize,
        wanted: &Wanted<'_>,
        snapshot: &Snapshot,
        state: &AllocatedState,
    ) -> Result<(Filtered, usize), String> {
        let Wanted {
            pod,
            claims,
            to_allocate,
        } = *wanted;
        let mut filtered = Filtered {
            reason: "no node fits the pod".to_owned(),
            ..Filtered::default()
        };
        let wanted: Vec<&ResourceClaim> = to_allocate.iter().map(|i| &claims[*i]).collect();
        let plan = Plan::new(snapshot, &wanted);
        let count = snapshot.nodes.len();
        let mut processed = 0;
        for at in (0..count).map(|offset| (start + offset) % count) {
            if filtered.feasible.len() >= limit {
                break;
            }
            processed += 1;
            let node = &snapshot.nodes[at];
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
            if !wanted.is_empty() {
                let pools = snapshot.prepared().pools_at(at);
                let on_node = OnNode::new(node);
                if self
                    .search(snapshot, &plan, (&on_node, pools), state)?
                    .is_none()
                {
                    "cannot allocate all claims".clone_into(&mut filtered.reason);
                    continue;
                }
            }
            if !mismatched.is_empty() {
                filtered.unavailable.extend(mismatched);
                "resourceclaim not available on the node".clone_into(&mut filtered.reason);
                continue;
            }
            filtered.feasible.push(Feasible {
                at,
                node: node.name_any(),
            });
        }
        filtered.feasible.sort_by_key(|f| f.at);
        Ok((filtered, processed))
    }
}

/// A pod's claims, of which those at `to_allocate` need devices.
#[derive(Clone, Copy)]
struct Wanted<'a> {
    pod: &'a Pod,
    claims: &'a [ResourceClaim],
    to_allocate: &'a [usize],
}
