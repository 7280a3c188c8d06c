//! PostFilter, PreBind, binding and Unreserve: the phases of a pod after its scheduling
//! cycle decided (kubernetes/kubernetes
//! `pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go`).

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    ResourceClaim, ResourceClaimConsumerReference, ResourceClaimStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use kerf_api::claim_status::{allocation_of, is_reserved_for, reserved_for};

use crate::pods::{claim_key, is_conflict, pod_key};
use crate::{
    BIND_RETRIES, BUILTIN_FINALIZER, BindOutcome, CycleOutcome, Reservation, ReservedClaim,
    SchedulerStandIn, SeededRng,
};

impl SchedulerStandIn {
    /// PostFilter (`dynamicresources.go`, `PostFilter`): when no node fits, pick one of the
    /// claims Filter found unavailable (allocated, with a `nodeSelector` that rejected a node
    /// on which everything else fitted) at random, and if nobody but this pod has reserved
    /// it, deallocate it with an UpdateStatus that clears `allocation`, `reservedFor` and
    /// `devices` ("deallocation of ResourceClaim completed").
    pub(super) async fn post_filter(
        &self,
        pod: &Pod,
        claims: &[ResourceClaim],
        unavailable: &BTreeSet<usize>,
        reason: String,
        rng: &mut SeededRng,
    ) -> CycleOutcome {
        let pod_name = pod_key(pod);
        let mut order: Vec<usize> = unavailable.iter().copied().collect();
        // Upstream iterates a Go map: a random order.
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let uid = pod.uid();
        for index in order {
            let claim = &claims[index];
            let reserved = reserved_for(claim);
            if reserved.is_empty()
                || (reserved.len() == 1 && Some(&reserved[0].uid) == uid.as_ref())
            {
                let mut cleared = claim.clone();
                cleared.status = Some(ResourceClaimStatus {
                    allocation: None,
                    reserved_for: None,
                    devices: None,
                });
                let api: Api<ResourceClaim> =
                    Api::namespaced(self.client.clone(), &claim.namespace().unwrap_or_default());
                self.throttled().await;
                return match api
                    .replace_status(&claim.name_any(), &PostParams::default(), &cleared)
                    .await
                {
                    Ok(_) => CycleOutcome::Unschedulable {
                        pod: pod_name,
                        reason: "deallocation of ResourceClaim completed".to_owned(),
                        deallocated: Some(claim_key(claim)),
                    },
                    Err(e) => CycleOutcome::Error {
                        pod: pod_name,
                        message: format!("deallocate claim {}: {e}", claim_key(claim)),
                    },
                };
            }
        }
        CycleOutcome::Unschedulable {
            pod: pod_name,
            reason: if unavailable.is_empty() {
                reason
            } else {
                "still not schedulable".to_owned()
            },
            deallocated: None,
        }
    }

    /// PreBind and bind one reservation. Upstream: `dynamicresources.go`, `PreBind` →
    /// `bindClaim` for every claim not yet reserved for the pod: refuse a claim being
    /// deleted; for an allocation made in Reserve, fail with "got allocated elsewhere in the
    /// meantime" when the live claim is allocated, add the built-in finalizer with an Update,
    /// then write allocation (with `allocationTimestamp`, as the DRADeviceBindingConditions
    /// path does) and the `reservedFor` entry with one UpdateStatus carrying the claim's
    /// resourceVersion; retry on conflict from a fresh GET (`retry.RetryOnConflict`). An
    /// allocation written by someone else without `allocationTimestamp` fails the way a 1.36
    /// API server fails it (reference/dra-api.md §5). Then the pod is bound (a merge patch of
    /// `spec.nodeName`). Any failure runs [`Self::unreserve`].
    pub(super) async fn prebind(&mut self, mut reservation: Reservation) -> BindOutcome {
        let pod_name = pod_key(&reservation.pod);
        let node = reservation.node.clone();
        for index in 0..reservation.claims.len() {
            if is_reserved_for(&reservation.claims[index].claim, &reservation.pod) {
                continue;
            }
            match self
                .bind_claim(&reservation.claims[index], &reservation.pod)
                .await
            {
                Ok(claim) => {
                    reservation.claims[index].claim = claim;
                    // The allocation is now visible in the API: no longer in flight.
                    reservation.claims[index].allocation = None;
                }
                Err(reason) => {
                    self.unreserve(&reservation).await;
                    return BindOutcome::Failed {
                        pod: pod_name,
                        node,
                        reason,
                    };
                }
            }
        }
        if let Err(reason) = self.bind_pod(&reservation.pod, &node).await {
            self.unreserve(&reservation).await;
            return BindOutcome::Failed {
                pod: pod_name,
                node,
                reason,
            };
        }
        if self.config.scheduled_events {
            self.scheduled_event(&reservation.pod, &node).await;
        }
        BindOutcome::Bound {
            pod: pod_name,
            node,
        }
    }

    /// Waits for the client's rate limit ([`crate::StandInConfig::client_rate_limit`]), as
    /// every request of kube-scheduler's clientset waits on client-go's token bucket
    /// (`rest.Config.QPS`/`Burst` from `clientConnection`). The GET that [`Self::bind_pod`]
    /// makes first is not throttled: it stands in for the checks the `pods/binding`
    /// subresource makes on the server, not for a request of kube-scheduler's.
    async fn throttled(&self) {
        if let Some(bucket) = &self.throttle {
            bucket.wait().await;
        }
    }

    /// kube-scheduler's `Scheduled` Event on a bound pod (kubernetes/kubernetes
    /// `pkg/scheduler/schedule_one.go`, `finishBinding`: `Eventf(assumed, nil, Normal,
    /// "Scheduled", "Binding", "Successfully assigned %v/%v to %v")`), an `events.k8s.io/v1`
    /// Event named as client-go's `tools/events` recorder names it (`<pod>.<nanoseconds in
    /// hex>`). Upstream's recorder sends it from the broadcaster's own goroutine, off the
    /// binding path and not through the binding client's token bucket; here it is written
    /// after binding, unthrottled. A failure is ignored, as the broadcaster only logs it.
    async fn scheduled_event(&self, pod: &Pod, node: &str) {
        let namespace = pod.namespace().unwrap_or_default();
        let now = Timestamp::now();
        let event = json!({
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": format!("{}.{:x}", pod.name_any(), now.as_nanosecond()),
                         "namespace": namespace},
            "eventTime": now.to_string(),
            "reportingController": "default-scheduler",
            "reportingInstance": "default-scheduler-stand-in",
            "action": "Binding",
            "reason": "Scheduled",
            "type": "Normal",
            "note": format!("Successfully assigned {namespace}/{} to {node}", pod.name_any()),
            "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace,
                          "name": pod.name_any(), "uid": pod.uid().unwrap_or_default()},
        });
        let Ok(event) = serde_json::from_value::<k8s_openapi::api::events::v1::Event>(event) else {
            return;
        };
        let api: Api<k8s_openapi::api::events::v1::Event> =
            Api::namespaced(self.client.clone(), &namespace);
        let _ = api.create(&PostParams::default(), &event).await;
    }

    /// Adds the built-in finalizer to `claim` unless it has it; `claim` becomes the claim as
    /// written.
    async fn add_finalizer(
        &self,
        api: &Api<ResourceClaim>,
        label: &str,
        claim: &mut ResourceClaim,
    ) -> Result<(), FinalizerWrite> {
        if claim.finalizers().iter().any(|f| f == BUILTIN_FINALIZER) {
            return Ok(());
        }
        claim
            .metadata
            .finalizers
            .get_or_insert_with(Vec::new)
            .push(BUILTIN_FINALIZER.to_owned());
        self.throttled().await;
        match api
            .replace(&claim.name_any(), &PostParams::default(), claim)
            .await
        {
            Ok(updated) => {
                *claim = updated;
                Ok(())
            }
            Err(e) if is_conflict(&e) => Err(FinalizerWrite::Conflict(format!(
                "add finalizer to claim {label}: {e}"
            ))),
            Err(e) => Err(FinalizerWrite::Failed(format!(
                "add finalizer to claim {label}: {e}"
            ))),
        }
    }

    async fn bind_claim(
        &self,
        reserved: &ReservedClaim,
        pod: &Pod,
    ) -> Result<ResourceClaim, String> {
        let name = reserved.claim.name_any();
        let api: Api<ResourceClaim> = Api::namespaced(
            self.client.clone(),
            &reserved.claim.namespace().unwrap_or_default(),
        );
        let label = claim_key(&reserved.claim);
        let mut claim = reserved.claim.clone();
        let mut last_error = String::new();
        for attempt in 0..BIND_RETRIES {
            if attempt > 0 {
                self.throttled().await;
                claim = api
                    .get(&name)
                    .await
                    .map_err(|e| format!("get updated claim {label} after conflict: {e}"))?;
            }
            if claim.metadata.deletion_timestamp.is_some() {
                return Err(format!("claim {label} got deleted in the meantime"));
            }
            if let Some(allocation) = &reserved.allocation {
                if allocation_of(&claim).is_some() {
                    return Err(format!(
                        "claim {label} got allocated elsewhere in the meantime"
                    ));
                }
                match self.add_finalizer(&api, &label, &mut claim).await {
                    Ok(()) => {}
                    Err(FinalizerWrite::Conflict(message)) => {
                        last_error = message;
                        continue;
                    }
                    Err(FinalizerWrite::Failed(message)) => return Err(message),
                }
                let mut allocation = allocation.clone();
                allocation.allocation_timestamp = Some(Time(Timestamp::now()));
                claim
                    .status
                    .get_or_insert_with(ResourceClaimStatus::default)
                    .allocation = Some(allocation);
            } else if allocation_of(&claim).is_some_and(|a| a.allocation_timestamp.is_none()) {
                return Err(format!(
                    "add reservation to claim {label}: status.allocation: Invalid value: field is immutable (the scheduler stamps a missing allocationTimestamp)"
                ));
            }
            add_consumer(&mut claim, pod);
            let what = if reserved.allocation.is_some() {
                "add allocation and reservation to"
            } else {
                "add reservation to"
            };
            self.throttled().await;
            match api
                .replace_status(&name, &PostParams::default(), &claim)
                .await
            {
                Ok(updated) => return Ok(updated),
                Err(e) if is_conflict(&e) => last_error = format!("{what} claim {label}: {e}"),
                Err(e) => return Err(format!("{what} claim {label}: {e}")),
            }
        }
        Err(last_error)
    }

    /// Binding (`DefaultBinder`, here a merge patch of `spec.nodeName`): fails when the pod is
    /// gone, was replaced, or is already assigned, as the `pods/binding` subresource does.
    async fn bind_pod(&self, pod: &Pod, node: &str) -> Result<(), String> {
        let api: Api<Pod> =
            Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        let name = pod.name_any();
        let live = api
            .get(&name)
            .await
            .map_err(|e| format!("bind pod {}: {e}", pod_key(pod)))?;
        if live.uid() != pod.uid() {
            return Err(format!("bind pod {}: pod was replaced", pod_key(pod)));
        }
        if let Some(assigned) = live.spec.as_ref().and_then(|s| s.node_name.as_deref())
            && !assigned.is_empty()
        {
            return Err(format!(
                "bind pod {}: pod is already assigned to node {assigned:?}",
                pod_key(pod)
            ));
        }
        self.throttled().await;
        api.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"nodeName": node}})),
        )
        .await
        .map(|_| ())
        .map_err(|e| format!("bind pod {}: {e}", pod_key(pod)))
    }

    /// Unreserve (`dynamicresources.go`, `Unreserve`): the in-flight allocations are dropped
    /// (the reservation is no longer pending), and every claim of the pod that is allocated
    /// and reserved for it loses the pod's `reservedFor` entry. Allocations PreBind already
    /// wrote stay. Upstream removes the entry with a strategic-merge `$patch: delete`; the
    /// stand-in reads the claim and writes its status back without the entry (FakeApi treats
    /// strategic merge patches as merge patches). Errors are ignored, as upstream logs them.
    async fn unreserve(&self, reservation: &Reservation) {
        for reserved in &reservation.claims {
            let api: Api<ResourceClaim> = Api::namespaced(
                self.client.clone(),
                &reserved.claim.namespace().unwrap_or_default(),
            );
            self.throttled().await;
            let Ok(mut claim) = api.get(&reserved.claim.name_any()).await else {
                continue;
            };
            if allocation_of(&claim).is_none() || !is_reserved_for(&claim, &reservation.pod) {
                continue;
            }
            let uid = reservation.pod.uid();
            if let Some(entries) = claim.status.as_mut().and_then(|s| s.reserved_for.as_mut()) {
                entries.retain(|c| Some(&c.uid) != uid.as_ref());
            }
            self.throttled().await;
            let _ = api
                .replace_status(&claim.name_any(), &PostParams::default(), &claim)
                .await;
        }
    }
}

/// Why the built-in finalizer was not added.
enum FinalizerWrite {
    /// A conflict: read the claim again and retry.
    Conflict(String),
    /// Anything else: binding fails.
    Failed(String),
}

/// Adds `pod` to the claim's `reservedFor`.
fn add_consumer(claim: &mut ResourceClaim, pod: &Pod) {
    claim
        .status
        .get_or_insert_with(ResourceClaimStatus::default)
        .reserved_for
        .get_or_insert_with(Vec::new)
        .push(ResourceClaimConsumerReference {
            api_group: None,
            resource: "pods".to_owned(),
            name: pod.name_any(),
            uid: pod.uid().unwrap_or_default(),
        });
}
