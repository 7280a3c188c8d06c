//! Writing allocations: a pod's claims all or none (rolled back on failure), and
//! deallocation. Every write runs under a [`WriteGuard`] of the claims it touches.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{AllocationResult, ResourceClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_core::alloc::{self, ClaimPlacement};
use kube::ResourceExt as _;
use kube::runtime::events::EventType;

use super::bookkeeping::WriteGuard;
use super::reasons;
use super::report::{describe, publish};
use super::state::{allocation_of, claim_uid, gate_holds, has_finalizer};
use super::write::{self, claim_api};
use crate::claims::ClaimsContext;
use crate::error::Result;

/// What one claim's write went through, for a rollback.
struct Written {
    uid: String,
    had_finalizer: bool,
    latest: ResourceClaim,
    allocated: bool,
}

/// Writes every claim's allocation; on any failure, rolls back the ones written.
pub(super) async fn write_placement(
    pod: &Pod,
    claims: &[Arc<ResourceClaim>],
    placement: &alloc::PodPlacement,
    writing: &mut WriteGuard<'_>,
    ctx: &ClaimsContext,
) -> Result<()> {
    let mut written: Vec<Written> = Vec::new();
    let mut failure = None;
    for placed in &placement.claims {
        let Some(claim) = claims
            .iter()
            .find(|c| c.metadata.uid.as_deref() == Some(placed.key.as_str()))
        else {
            continue;
        };
        if let Err(error) = write_one(
            pod,
            claim,
            placed,
            &placement.node,
            ctx,
            writing,
            &mut written,
        )
        .await
        {
            failure = Some(error);
            break;
        }
    }
    let Some(error) = failure else { return Ok(()) };
    if error.is_routine() {
        // A claim changed or went away under the write: the retry places it anew.
        tracing::debug!(node = %placement.node, %error, "allocation write failed; rolling back the pod's claims");
    } else {
        tracing::warn!(node = %placement.node, %error, "allocation write failed; rolling back the pod's claims");
    }
    rollback(&written, writing, ctx).await;
    for placed in &placement.claims {
        writing.forget(&placed.key);
    }
    Err(error)
}

/// Marks the claim (finalizer, node) and writes its allocation, reserved for `pod` while
/// kerf's gate holds it, recording each step in `written`.
async fn write_one(
    pod: &Pod,
    claim: &ResourceClaim,
    placed: &ClaimPlacement,
    node: &str,
    ctx: &ClaimsContext,
    writing: &mut WriteGuard<'_>,
    written: &mut Vec<Written>,
) -> Result<()> {
    let api = claim_api(ctx, claim);
    let marked = write::mark_allocating(&api, claim, node, &describe(node, placed)).await?;
    written.push(Written {
        uid: placed.key.clone(),
        had_finalizer: has_finalizer(claim),
        latest: marked.clone(),
        allocated: false,
    });
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let allocation =
        kerf_api::allocation::claim_allocation_status(claim, placed, node, ctx.core.driver(), now)?;
    let updated = write::write_allocation(
        &api,
        &marked,
        &allocation,
        gate_holds(pod, ctx).then_some(pod),
    )
    .await?;
    writing.confirm(
        &placed.key,
        held_uses(placed, node, &allocation),
        updated
            .metadata
            .resource_version
            .as_deref()
            .unwrap_or_default(),
    );
    writing.settled(&placed.key);
    if let Some(last) = written.last_mut() {
        last.latest = updated;
        last.allocated = true;
    }
    Ok(())
}

/// Best effort: clears what was written and restores each claim's metadata. What fails is
/// logged; the next reconcile of the pod's claims starts from whatever is left.
async fn rollback(written: &[Written], writing: &mut WriteGuard<'_>, ctx: &ClaimsContext) {
    for step in written {
        let api = claim_api(ctx, &step.latest);
        let mut latest = step.latest.clone();
        if step.allocated {
            writing.unsettled(&step.uid);
            match write::clear_allocation(&api, &latest).await {
                Ok(cleared) => latest = cleared,
                Err(error) => {
                    tracing::error!(claim = %latest.name_any(), %error, "rollback failed");
                    continue;
                }
            }
        }
        match write::unmark(&api, &latest, !step.had_finalizer).await {
            Ok(_) => writing.settled(&step.uid),
            Err(error) => tracing::error!(claim = %latest.name_any(), %error, "rollback failed"),
        }
    }
}

/// Clears our allocation and tells the index; with `drop_finalizer` the claim is let go.
pub(super) async fn deallocate(
    claim: &ResourceClaim,
    ctx: &ClaimsContext,
    drop_finalizer: bool,
    why: &str,
) -> Result<()> {
    let uid = claim_uid(claim)?;
    let Some(mut writing) = ctx.begin_write(vec![uid.to_owned()]) else {
        return Ok(());
    };
    let api = claim_api(ctx, claim);
    let mut latest = None;
    if allocation_of(claim).is_some() {
        let cleared = write::clear_allocation(&api, claim).await?;
        writing.confirm(
            uid,
            Vec::new(),
            cleared
                .metadata
                .resource_version
                .as_deref()
                .unwrap_or_default(),
        );
        ctx.capacity_freed();
        publish(
            ctx,
            claim,
            EventType::Normal,
            reasons::DEALLOCATED,
            why.to_owned(),
        )
        .await;
        latest = Some(cleared);
    }
    write::unmark(&api, latest.as_ref().unwrap_or(claim), drop_finalizer).await?;
    writing.settled(uid);
    Ok(())
}

/// The usage the written allocation puts on `node`: every placed device but those whose
/// result has admin access, which use nothing (as [`kerf_api::device_uses`] reads them back).
fn held_uses(
    placed: &ClaimPlacement,
    node: &str,
    allocation: &AllocationResult,
) -> Vec<alloc::DeviceUse> {
    let results = allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_deref())
        .unwrap_or_default();
    placed
        .device_uses(node)
        .into_iter()
        .enumerate()
        .filter(|(at, _)| {
            results
                .get(*at)
                .is_none_or(|r| r.admin_access != Some(true))
        })
        .map(|(_, device_use)| device_use)
        .collect()
}
