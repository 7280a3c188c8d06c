//! kube-controller-manager's resourceclaim controller, as far as it frees devices.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    ResourceClaim, ResourceClaimConsumerReference, ResourceClaimStatus,
};
use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt};

use kerf_api::claim_status::{allocation_of, reserved_for};

use crate::pods::{claim_key, is_not_found, is_pod_done, key, pod_key};
use crate::{BUILTIN_FINALIZER, SchedulerStandIn};

impl SchedulerStandIn {
    /// One pass of kube-controller-manager's resourceclaim controller over all claims
    /// (`pkg/controller/resourceclaim/controller.go`, `syncClaim`): `reservedFor` entries of
    /// pods that are gone, replaced (other UID) or done (`isPodDone`) are removed with an
    /// UpdateStatus carrying the resourceVersion; when that removes the last entry of a claim
    /// with the built-in finalizer, the same update clears `allocation` (and `devices`, which
    /// the API server's `dropDeallocatedStatusDevices` would drop), then an Update removes
    /// the finalizer. A deleted, unreserved claim with the finalizer is deallocated and
    /// released. Claims without the built-in finalizer (kerf-controller's, finalizer
    /// `gpu.kerf.dev/allocation`) keep their allocation. Returns the `namespace/name` of the
    /// claims it changed.
    ///
    /// # Errors
    ///
    /// A failed list; write conflicts are skipped (the next pass retries).
    pub async fn run_claim_controller_once(&self) -> Result<Vec<String>, kube::Error> {
        let lp = ListParams::default();
        let pods: HashMap<String, Pod> = Api::<Pod>::all(self.client.clone())
            .list(&lp)
            .await?
            .items
            .into_iter()
            .map(|p| (pod_key(&p), p))
            .collect();
        let mut claims = Api::<ResourceClaim>::all(self.client.clone())
            .list(&lp)
            .await?
            .items;
        claims.sort_by_key(claim_key);
        let mut changed = Vec::new();
        for claim in claims {
            let namespace = claim.namespace().unwrap_or_default();
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
            let entries = reserved_for(&claim);
            let valid = live_consumers(entries, &namespace, &pods);
            let builtin = claim.finalizers().iter().any(|f| f == BUILTIN_FINALIZER);
            let done = if valid.len() < entries.len() {
                release_gone_consumers(&api, &claim, valid, builtin).await
            } else if builtin && claim.metadata.deletion_timestamp.is_some() && valid.is_empty() {
                finish_deletion(&api, &claim).await
            } else {
                false
            };
            if done {
                changed.push(claim_key(&claim));
            }
        }
        Ok(changed)
    }
}

/// The entries of `reservedFor` that still name a pod that exists and is not done (entries
/// for other kinds of consumer are kept).
fn live_consumers(
    entries: &[ResourceClaimConsumerReference],
    namespace: &str,
    pods: &HashMap<String, Pod>,
) -> Vec<ResourceClaimConsumerReference> {
    entries
        .iter()
        .filter(|entry| {
            if entry.resource != "pods" || entry.api_group.as_deref().is_some_and(|g| !g.is_empty())
            {
                return true;
            }
            pods.get(&key(Some(namespace), &entry.name))
                .is_some_and(|p| p.uid().as_ref() == Some(&entry.uid) && !is_pod_done(p))
        })
        .cloned()
        .collect()
}

fn without_finalizer(mut claim: ResourceClaim) -> ResourceClaim {
    if let Some(f) = claim.metadata.finalizers.as_mut() {
        f.retain(|f| f != BUILTIN_FINALIZER);
    }
    claim
}

/// Keeps only the `valid` consumers; a claim with the built-in finalizer and none left is
/// deallocated and loses the finalizer. True when the status was written.
async fn release_gone_consumers(
    api: &Api<ResourceClaim>,
    claim: &ResourceClaim,
    valid: Vec<ResourceClaimConsumerReference>,
    builtin: bool,
) -> bool {
    let mut updated = claim.clone();
    let status = updated
        .status
        .get_or_insert_with(ResourceClaimStatus::default);
    let none_left = valid.is_empty();
    status.reserved_for = (!none_left).then_some(valid);
    if none_left && builtin {
        status.allocation = None;
        status.devices = None;
    }
    let Ok(updated) = api
        .replace_status(&claim.name_any(), &PostParams::default(), &updated)
        .await
    else {
        return false;
    };
    if builtin && allocation_of(&updated).is_none() {
        let _ = api
            .replace(
                &claim.name_any(),
                &PostParams::default(),
                &without_finalizer(updated),
            )
            .await;
    }
    true
}

/// A deleted claim with the built-in finalizer and no consumer: deallocated, then the
/// finalizer removed. True when it is gone or its finalizer was removed.
async fn finish_deletion(api: &Api<ResourceClaim>, claim: &ResourceClaim) -> bool {
    let mut updated = claim.clone();
    if allocation_of(&updated).is_some() {
        if let Some(status) = updated.status.as_mut() {
            status.allocation = None;
            status.devices = None;
        }
        match api
            .replace_status(&claim.name_any(), &PostParams::default(), &updated)
            .await
        {
            Ok(u) => updated = u,
            Err(_) => return false,
        }
    }
    match api
        .replace(
            &claim.name_any(),
            &PostParams::default(),
            &without_finalizer(updated),
        )
        .await
    {
        Ok(_) => true,
        Err(e) => is_not_found(&e),
    }
}
