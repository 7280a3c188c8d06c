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
//! Filter gives up when its context ends. What the claims ask for is read once per Filter
//! ([`crate::plan`]), not once per node, and the search ([`crate::search`]) only remembers
//! which devices it took: the allocation result, with its share IDs, is built for the node
//! that is picked ([`Allocator::allocate_feasible`]), not for every feasible one.

use std::borrow::Cow;

use k8s_openapi::api::core::v1::{Node, NodeSelector};
use k8s_openapi::api::resource::v1::{AllocationResult, Device, ResourceClaim};
use kube::ResourceExt;

use crate::allocated::AllocatedState;
use crate::cel::CelCache;
use crate::plan::{Halt, Plan, PlannedRequest};
use crate::pods::node_selector_matches;
use crate::prepared::DeviceFacts;
use crate::search::{Request, Search};
use crate::snapshot::Snapshot;

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
pub(crate) struct Candidate<'a> {
    pub facts: &'a DeviceFacts,
    /// The device's pool: its position in the snapshot's prepared pools.
    pub pool: usize,
    pub device: &'a Device,
    pub node_local: bool,
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
pub(crate) struct OnNode<'n> {
    pub node: &'n Node,
    pub name: Cow<'n, str>,
}

impl<'n> OnNode<'n> {
    pub(crate) fn new(node: &'n Node) -> Self {
        let name = match &node.metadata.name {
            Some(name) => Cow::Borrowed(name.as_str()),
            None => Cow::Owned(node.name_any()),
        };
        Self { node, name }
    }
}

impl Allocator {
    /// The devices `request`'s class and selectors select on `node` among `pools`
    /// (positions in the snapshot's prepared pools), in pool/slice/device order.
    fn candidates<'a>(
        &mut self,
        snapshot: &'a Snapshot,
        pools: &[usize],
        node: &OnNode<'_>,
        request: &PlannedRequest<'_>,
    ) -> Result<Vec<Candidate<'a>>, String> {
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
                    for expression in &request.expressions {
                        let matched = facts
                            .cel_value(device, &spec.driver)
                            .and_then(|value| self.cel.matches_value(expression, value))
                            .map_err(|e| {
                                format!(
                                    "class {}: device {}/{}/{}: {e}",
                                    request.class.name_any(),
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
        let node = OnNode::new(node);
        let pools = snapshot.prepared().pools_for(&node.name);
        let plan = Plan::new(snapshot, claims);
        let search = self.search(snapshot, &plan, (&node, &pools), state)?;
        Ok(search.map(|s| s.into_results(claims, &node.name)))
    }

    /// The search of `plan` on `node`, whose pools are `pools`, run to its end: `None` when
    /// the node cannot satisfy all claims.
    ///
    /// # Errors
    ///
    /// As [`Self::allocate_on_node`].
    pub(crate) fn search<'a>(
        &mut self,
        snapshot: &'a Snapshot,
        plan: &'a Plan<'a>,
        (node, pools): (&OnNode<'_>, &[usize]),
        state: &'a AllocatedState,
    ) -> Result<Option<Search<'a>>, String> {
        let mut requests = Vec::with_capacity(plan.requests.len());
        for planned in &plan.requests {
            let candidates = self.candidates(snapshot, pools, node, planned)?;
            requests.push(Request::new(planned, candidates));
        }
        match &plan.halt {
            Some(Halt::Error(message)) => return Err(message.clone()),
            Some(Halt::NoClass) => return Ok(None),
            None => {}
        }
        let mut search = Search::new(snapshot, state, requests, plan);
        search.narrow_all_requests()?;
        Ok(search.allocate_one(0, 0, 0)?.then_some(search))
    }
}
