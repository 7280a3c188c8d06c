//! The miss path: claims whose allocation is written at the API server right before the
//! kubelet asks for their prepare, so that the plugin's watch has not delivered it yet.
//!
//! Two writers, as a cluster has them:
//! - **kube-scheduler** writes the allocation with an update of the `status` subresource
//!   (kubernetes/kubernetes `pkg/scheduler/framework/plugins/dynamicresources/
//!   dynamicresources.go`, `bindClaim`: `ResourceClaims(ns).UpdateStatus`), as the cluster
//!   admin here. The claim has no `gpu.kerf.dev/node` label yet: kerf-controller labels it
//!   only once it sees the allocation, and no controller runs in the benchmark, so no node
//!   watch ever sees these claims.
//! - **kerf-controller** labels its claims in the finalizer write, before the allocation
//!   exists, and then writes the allocation with a merge patch of `status` guarded by the
//!   resourceVersion (`controller/src/claims/write.rs`, `write_allocation`), as its own
//!   ServiceAccount. The plugin's watch holds the unallocated claim, and the prepare races
//!   the watch event that carries the allocation.

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimStatus};
use kerf_api::claim_node_label::{CLAIM_NODE_LABEL, node_label_value};
use kerf_core::inventory::Inventory;
use kerf_proto::client::Claim;
use kerf_tests::fake_api::{FakeApi, Identity};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};

use crate::node::{NAMESPACE, NODE, numbered_claim, slice_claim};
use crate::{Error, Result};

/// Who writes the allocation of a miss-path claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Writer {
    /// kube-scheduler: `UpdateStatus`, no node label.
    Scheduler,
    /// kerf-controller: the node label first, then a merge patch of `status`.
    Controller,
}

/// A claim stored unallocated, with the allocation to write right before its prepare.
pub(super) struct MissClaim {
    /// The claim as the kubelet names it.
    pub claim: Claim,
    /// The claim as the API server stored it (with its resourceVersion).
    stored: ResourceClaim,
    /// The status with the allocation.
    status: ResourceClaimStatus,
}

/// Stores `count` unallocated claims of `series` (labelled with the node for
/// [`Writer::Controller`]), spread over the GPUs, and returns them with their allocations.
///
/// # Errors
/// kerf-api refuses an allocation.
pub(super) fn insert(
    fake: &FakeApi,
    inventory: &Inventory,
    series: u64,
    count: usize,
    writer: Writer,
) -> Result<Vec<MissClaim>> {
    let gpus = inventory.gpus.len().max(1);
    let mut claims = Vec::with_capacity(count);
    for n in 0..count {
        let claim = numbered_claim(series, n as u64);
        let mut object = slice_claim(&claim, inventory, n % gpus)?;
        let status = object.status.take().unwrap_or_default();
        if writer == Writer::Controller {
            object
                .metadata
                .labels
                .get_or_insert_default()
                .insert(CLAIM_NODE_LABEL.to_owned(), node_label_value(NODE));
        }
        let stored = fake.insert_resource(&object);
        claims.push(MissClaim {
            claim,
            stored,
            status,
        });
    }
    Ok(claims)
}

/// Writes allocations as their writers do, through the in-process clients of the API server
/// (not over HTTP: the write is not timed, and it should land as close to the prepare as a
/// fast kubelet can follow it).
pub(super) struct Allocator {
    scheduler: Api<ResourceClaim>,
    controller: Api<ResourceClaim>,
}

impl Allocator {
    /// The writers of `fake`: the cluster admin for kube-scheduler, kerf-controller's
    /// ServiceAccount for the controller.
    pub(super) fn new(fake: &FakeApi) -> Self {
        Allocator {
            scheduler: Api::namespaced(fake.client(), NAMESPACE),
            controller: Api::namespaced(fake.client_as(Identity::kerf_controller()), NAMESPACE),
        }
    }

    /// Writes the allocation of `claim` as `writer` does.
    ///
    /// # Errors
    /// The API server refuses the write.
    pub(super) async fn allocate(&self, claim: &MissClaim, writer: Writer) -> Result<()> {
        let name = &claim.claim.name;
        let failed = |e: kube::Error| {
            Error::Workload(format!(
                "writing the allocation of claim {name} ({writer:?}): {e}"
            ))
        };
        match writer {
            Writer::Scheduler => {
                let mut object = claim.stored.clone();
                object.status = Some(claim.status.clone());
                self.scheduler
                    .replace_status(name, &PostParams::default(), &object)
                    .await
                    .map_err(failed)?;
            }
            Writer::Controller => {
                let patch = serde_json::json!({
                    "metadata": {"resourceVersion": claim.stored.metadata.resource_version},
                    "status": {"allocation": claim.status.allocation},
                });
                self.controller
                    .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(failed)?;
            }
        }
        Ok(())
    }
}
