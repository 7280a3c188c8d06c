//! The backstop: a device found in two exclusive allocations (an old kerf, a hand-written
//! DeviceClass without the ownership guard, an allocation older than the settle period) is
//! reported on both claims and their pods, naming the other, and counted in
//! `kerf_allocation_conflicts_total`. The controller's claim yields the device when no pod has
//! it reserved yet (reconciling it runs the yield in `yielding.rs`); a reserved one may be
//! prepared already, so it is only reported, and the kubelet plugin's refusal names the claim
//! that holds the device.

use std::collections::HashSet;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::alloc::GpuUsage;
use kube::Resource as _;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;

use super::super::report::{publish, publish_on};
use super::super::state::{annotated_node, in_use};
use crate::claims::ClaimsContext;

/// Event reason on both claims (and their pods) of a conflict.
pub(super) const ALLOCATION_CONFLICT: &str = "AllocationConflict";

/// Claims that share one device although one of them holds it exclusively.
#[derive(Debug, Clone)]
pub(super) struct Conflict {
    /// Node of the device.
    pub node: String,
    /// The device.
    pub device: String,
    /// Every claim using it.
    pub holders: Vec<ObjectRef<ResourceClaim>>,
}

/// True when `usage` is more than one exclusive user can have.
pub(super) fn is_conflict(usage: &GpuUsage) -> bool {
    usage.whole_holders >= 2 || (usage.whole_holders >= 1 && usage.slices >= 1)
}

/// Reports each conflicting pair once (`reported` remembers pairs across ticks) and makes the
/// controller's unreserved claims yield.
pub(super) async fn report(
    ctx: &ClaimsContext,
    conflicts: &[Conflict],
    reported: &mut HashSet<(String, String)>,
) {
    for conflict in conflicts {
        let claims: Vec<_> = conflict
            .holders
            .iter()
            .filter_map(|r| ctx.core.caches.claims.get(r))
            .collect();
        for (i, one) in claims.iter().enumerate() {
            for other in &claims[i + 1..] {
                let (Some(a), Some(b)) = (one.metadata.uid.clone(), other.metadata.uid.clone())
                else {
                    continue;
                };
                let pair = if a < b { (a, b) } else { (b, a) };
                if !reported.insert(pair) {
                    continue;
                }
                let allocator = if annotated_node(one).is_some() && annotated_node(other).is_some()
                {
                    "controller"
                } else {
                    "scheduler"
                };
                ctx.core.metrics.record_allocation_conflict(allocator);
                tracing::warn!(node = %conflict.node, device = %conflict.device, claim = %ObjectRef::from_obj(one.as_ref()), other = %ObjectRef::from_obj(other.as_ref()), "device in two exclusive allocations");
                warn_about(ctx, conflict, one, other).await;
                warn_about(ctx, conflict, other, one).await;
            }
        }
        for claim in &claims {
            if annotated_node(claim).is_some()
                && !in_use(claim, ctx)
                && ctx
                    .trigger
                    .send(ObjectRef::from_obj(claim.as_ref()))
                    .is_err()
            {
                return;
            }
        }
    }
}

async fn warn_about(
    ctx: &ClaimsContext,
    conflict: &Conflict,
    claim: &ResourceClaim,
    other: &ResourceClaim,
) {
    let by = |c: &ResourceClaim| {
        if annotated_node(c).is_some() {
            "kerf-controller"
        } else {
            "kube-scheduler"
        }
    };
    let name = |c: &ResourceClaim| {
        format!(
            "{}/{}",
            c.metadata.namespace.as_deref().unwrap_or_default(),
            c.metadata.name.as_deref().unwrap_or_default()
        )
    };
    let note = format!(
        "device {}/{} is also allocated to claim {} (by {}); this claim got it from {}: one of \
         them cannot run. {}",
        conflict.node,
        conflict.device,
        name(other),
        by(other),
        by(claim),
        if annotated_node(claim).is_some() && !in_use(claim, ctx) {
            "kerf-controller gives this claim's allocation up and places it again."
        } else {
            "Delete one of the pods to resolve it."
        }
    );
    publish(
        ctx,
        claim,
        EventType::Warning,
        ALLOCATION_CONFLICT,
        note.clone(),
    )
    .await;
    for pod in ctx.consumers(claim) {
        publish_on(
            ctx,
            &pod.object_ref(&()),
            EventType::Warning,
            ALLOCATION_CONFLICT,
            note.clone(),
        )
        .await;
    }
}
