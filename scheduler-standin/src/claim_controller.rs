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
            let entries = reserved_for(&claim).to_vec();
            let valid: Vec<ResourceClaimConsumerReference> = entries
                .iter()
                .filter(|entry| {
                    if entry.resource != "pods"
                        || entry.api_group.as_deref().is_some_and(|g| !g.is_empty())
                    {
                        return true;
                    }
                    pods.get(&key(Some(&namespace), &entry.name))
                        .is_some_and(|p| p.uid().as_ref() == Some(&entry.uid) && !is_pod_done(p))
                })
                .cloned()
                .collect();
            let builtin = claim.finalizers().iter().any(|f| f == BUILTIN_FINALIZER);
            let without_finalizer = |mut c: ResourceClaim| {
                if let Some(f) = c.metadata.finalizers.as_mut() {
                    f.retain(|f| f != BUILTIN_FINALIZER);
                }
                c
            };
            if valid.len() < entries.len() {
                let mut updated = claim.clone();
                let status = updated
                    .status
                    .get_or_insert_with(ResourceClaimStatus::default);
                status.reserved_for = (!valid.is_empty()).then_some(valid.clone());
                if valid.is_empty() && builtin {
                    status.allocation = None;
                    status.devices = None;
                }
                let Ok(updated) = api
                    .replace_status(&claim.name_any(), &PostParams::default(), &updated)
                    .await
                else {
                    continue;
                };
                changed.push(claim_key(&claim));
                if builtin && allocation_of(&updated).is_none() {
                    let _ = api
                        .replace(
                            &claim.name_any(),
                            &PostParams::default(),
                            &without_finalizer(updated),
                        )
                        .await;
                }
            } else if builtin && claim.metadata.deletion_timestamp.is_some() && valid.is_empty() {
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
                        Err(_) => continue,
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
                    Ok(_) => changed.push(claim_key(&claim)),
                    Err(e) if is_not_found(&e) => changed.push(claim_key(&claim)),
                    Err(_) => {}
                }
            }
        }
        Ok(changed)
    }
}
