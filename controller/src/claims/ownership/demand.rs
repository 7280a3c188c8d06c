//! Pending demand for kube-scheduler: pods the scheduler could run if it had idle whole GPUs,
//! and which idle devices would serve them.
//!
//! A pod counts when it is live, not bound, carries no scheduling gate, and has unallocated
//! claims whose requests ask for whole GPUs of a kerf Scheduler class (MIG classes are served
//! by MIG devices, which are always the scheduler's), or asks for devices of such a class by
//! extended resource name and kube-scheduler has not made its claim yet ([`super::extended`]):
//! `N` of the name count as a claim of the class asking for `N`. The match is by count and
//! node: the pod's node selector, affinity and taints are honoured, a class's GPU selector is
//! not (a device lent that the pod's selector refuses goes back after the linger period).
//!
//! A sliced Scheduler class counts like a whole one, one GPU per device asked for, whether by
//! claim or by extended resource name: the shares of one GPU may need fewer, and what is lent
//! beyond the need goes back after the linger period.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, DeviceRequest, ResourceClaim};
use kerf_api::Allocator;
use kube::runtime::reflector::ObjectRef;

use super::super::consumers;
use super::super::nodes::node_fits;
use super::super::state::allocation_of;
use super::extended;
use crate::claims::ClaimsContext;

/// A pending pod and how many whole GPUs of the scheduler it needs on one node.
#[derive(Debug, Clone)]
pub(super) struct SchedulerNeed {
    /// The pod.
    pub pod: Arc<Pod>,
    /// Whole GPUs its unallocated Scheduler-class claims and its extended resources not yet
    /// claimed ask for.
    pub gpus: usize,
}

/// What the demand of every pod is read against, gathered once per tick.
struct Lookup<'a> {
    ctx: &'a ClaimsContext,
    /// Every DeviceClass, for extended resource names.
    device_classes: Vec<Arc<DeviceClass>>,
    /// Pods (name, UID) whose extended-resource claim kube-scheduler has made.
    claimed: HashSet<(String, String)>,
}

/// Every pending pod's need, oldest pod first.
pub(super) fn pending_needs(ctx: &ClaimsContext) -> Vec<SchedulerNeed> {
    let mut pods: Vec<Arc<Pod>> = ctx
        .pods
        .state()
        .into_iter()
        .filter(|pod| consumers::is_live(pod) && consumers::is_unscheduled(pod))
        .filter(|pod| !is_gated(pod))
        .collect();
    pods.sort_by(|a, b| {
        let key = |p: &Pod| {
            (
                p.metadata.creation_timestamp.clone(),
                p.metadata.uid.clone(),
            )
        };
        key(a).cmp(&key(b))
    });
    if pods.is_empty() {
        return Vec::new();
    }
    let lookup = Lookup {
        ctx,
        device_classes: ctx.core.caches.device_classes.state(),
        claimed: extended::claim_owners(&ctx.core.caches.claims.state()),
    };
    pods.into_iter()
        .filter_map(|pod| {
            let gpus = whole_gpus_needed(&pod, ctx) + extended_gpus_needed(&pod, &lookup);
            (gpus > 0).then_some(SchedulerNeed { pod, gpus })
        })
        .collect()
}

fn is_gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|gates| !gates.is_empty())
}

fn whole_gpus_needed(pod: &Pod, ctx: &ClaimsContext) -> usize {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    consumers::pod_claims(pod)
        .names
        .iter()
        .filter_map(|name| ctx.core.claim(namespace, name))
        .filter(|claim| allocation_of(claim).is_none() && !ctx.core.is_controller_claim(claim))
        .map(|claim| claim_whole_gpus(&claim, ctx))
        .sum()
}

/// Whole GPUs the pod asks for by extended resource name, while kube-scheduler has not made
/// its claim: per name, the count kube-scheduler would request of the DeviceClass the name
/// maps to ([`crate::extended_resource::device_class_for`]), as a claim of that class asking
/// for that count.
fn extended_gpus_needed(pod: &Pod, lookup: &Lookup<'_>) -> usize {
    let requests = extended::requests(pod);
    if requests.values().all(|n| *n == 0) || extended::has_claim(pod, &lookup.claimed) {
        return 0;
    }
    requests
        .iter()
        .filter(|(_, count)| **count > 0)
        .filter_map(|(name, count)| {
            let class = crate::extended_resource::device_class_for(name, &lookup.device_classes)?;
            let class = class.metadata.name.as_deref()?;
            let count = i64::try_from(*count).ok();
            Some(scheduler_whole_gpus(lookup.ctx, class, "ExactCount", count))
        })
        .sum()
}

/// Whole GPUs one request of `count` devices of DeviceClass `class` asks of kerf's Scheduler
/// classes: none for another class. `All` counts as one: how many the scheduler would take is
/// not known before it sees the devices.
fn scheduler_whole_gpus(ctx: &ClaimsContext, class: &str, mode: &str, count: Option<i64>) -> usize {
    let scheduler_whole = ctx
        .core
        .class_params(class)
        .is_some_and(|p| p.allocator == Allocator::Scheduler && p.selector.mig_profile.is_none());
    if !scheduler_whole {
        return 0;
    }
    if mode == "All" {
        return 1;
    }
    count.and_then(|c| usize::try_from(c).ok()).unwrap_or(1)
}

/// Whole GPUs a claim asks of kerf's Scheduler classes: `exactly` requests by their count, a
/// `firstAvailable` list by its first kerf choice ([`scheduler_whole_gpus`]).
fn claim_whole_gpus(claim: &ResourceClaim, ctx: &ClaimsContext) -> usize {
    claim
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_ref())
        .into_iter()
        .flatten()
        .map(|request: &DeviceRequest| {
            if let Some(exact) = &request.exactly {
                let mode = exact.allocation_mode.as_deref().unwrap_or("ExactCount");
                return scheduler_whole_gpus(ctx, &exact.device_class_name, mode, exact.count);
            }
            request
                .first_available
                .iter()
                .flatten()
                .map(|sub| {
                    let mode = sub.allocation_mode.as_deref().unwrap_or("ExactCount");
                    scheduler_whole_gpus(ctx, &sub.device_class_name, mode, sub.count)
                })
                .find(|n| *n > 0)
                .unwrap_or(0)
        })
        .sum()
}

/// Idle whole GPUs of one node, by the owner the controller wants for them now.
#[derive(Debug, Clone, Default)]
pub(super) struct IdleGpus {
    /// Idle and the scheduler's.
    pub scheduler: Vec<String>,
    /// Idle and the controller's (or on their way to it): lendable.
    pub controller: Vec<String>,
    /// Some idle GPU of the node, whoever owns it, counts for kerf's node taint
    /// (`kerf_core::alloc::idle_gpu_counts`, `claims::idle_gpus_taint`).
    pub keeps_node_tainted: bool,
}

/// Chooses the devices that serve `needs`: per pod, on the node where it fits that has the
/// most idle scheduler GPUs and enough idle GPUs in all, first the scheduler's, then lent
/// ones. A pod that fits nowhere takes nothing. Returns the chosen devices per node.
pub(super) fn serve(
    needs: &[SchedulerNeed],
    mut idle: BTreeMap<String, IdleGpus>,
    nodes: &kube::runtime::reflector::Store<Node>,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut chosen: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for need in needs {
        let best = idle
            .iter()
            .filter(|(_, gpus)| gpus.scheduler.len() + gpus.controller.len() >= need.gpus)
            .filter(|(name, _)| {
                nodes
                    .get(&ObjectRef::<Node>::new(name))
                    .is_some_and(|node| node_fits(&need.pod, &node).is_ok())
            })
            .max_by_key(|(name, gpus)| (gpus.scheduler.len(), std::cmp::Reverse(name.as_str())))
            .map(|(name, _)| name.clone());
        let Some(node) = best else { continue };
        let Some(gpus) = idle.get_mut(&node) else {
            continue;
        };
        let entry = chosen.entry(node).or_default();
        for _ in 0..need.gpus {
            if let Some(device) = gpus.scheduler.pop().or_else(|| gpus.controller.pop()) {
                entry.insert(device);
            }
        }
    }
    chosen
}
