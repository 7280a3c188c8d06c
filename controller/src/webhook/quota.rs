//! The validating webhook `quota.gpu.kerf.dev`: a ResourceClaim being created is charged
//! against every GpuQuota of its namespace, and refused when it would exceed one.
//!
//! The model is ResourceQuota's admission (kubernetes/kubernetes
//! `staging/src/k8s.io/apiserver/pkg/admission/plugin/resourcequota/controller.go`,
//! `checkQuotas`): the claim is checked against `status.used`, and the raised usage is written
//! back with a replace of `/status` carrying the `resourceVersion` read. Two admissions racing
//! for the last share cannot both win: the second write conflicts (409), the quota is read
//! again, and the decision is taken on the newer usage. Within one replica admissions of the
//! same quota take turns (a lock per quota), so its own reviews never conflict with each
//! other; conflicts come only from other replicas and the recount. A claim is charged on the
//! newer of the cache's copy and the one this replica last wrote, but refused only on the
//! quota as stored (read again first): a cache that has not seen a recount free usage yet
//! must not refuse a claim that fits.
//!
//! - [`decide`](mod@decide): the pure verdict of one quota on one charge.
//!
//! The configuration (`deploy/helm/kerf/templates/webhook.yaml`) uses `failurePolicy: Ignore`: while no
//! replica answers, claims are admitted uncharged and the controller's recount adds them to
//! `status.used` within one resync. A claim admitted by some quotas of its namespace and then
//! refused by another keeps its charge on the first ones only until their recount, which drops
//! an admission whose claim never appears once `ADMITTED_GRACE` has passed.

pub(crate) mod decide;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kerf_api::GpuQuota;
use kerf_api::gpuquota::{Charge, claim_charge};
use kube::api::PostParams;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, Operation};
use kube::{Api, Client, ResourceExt as _};
use serde_json::{Value, json};

use self::decide::{Admission, QuotaEffect, evaluate};
use super::outcome::{Answer, Outcome, QuotaDecision, Review};
use super::review;
use crate::cache::ProcessCaches;
use crate::quota::classes::quota_class;

/// The path the quota webhook's configuration calls (the other webhooks use `/mutate`).
pub const QUOTA_PATH: &str = "/quota";

/// How many conflicting writes of one quota an admission retries before refusing the claim.
const MAX_TRIES: usize = 10;

/// The lock admissions of one quota take turns on, holding the last copy of it this replica
/// wrote or read.
type Turn = Arc<tokio::sync::Mutex<Option<GpuQuota>>>;

/// What the quota webhook reads and writes: the process's caches (claims' classes, GpuClasses,
/// GpuQuotas) and the API server, for the status writes.
pub struct QuotaAdmission {
    client: Client,
    caches: ProcessCaches,
    driver: String,
    /// The last copy of each quota this replica wrote or read (newer than the cache right
    /// after a write), behind the lock its admissions take turns on.
    turns: Mutex<HashMap<(String, String), Turn>>,
}

impl std::fmt::Debug for QuotaAdmission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuotaAdmission")
            .field("driver", &self.driver)
            .finish_non_exhaustive()
    }
}

impl QuotaAdmission {
    /// Admission for the classes of `driver`, reading `caches` and writing through `client`.
    pub fn new(client: Client, caches: ProcessCaches, driver: &str) -> Self {
        Self {
            client,
            caches,
            driver: driver.to_owned(),
            turns: Mutex::default(),
        }
    }

    /// Handles one AdmissionReview body sent to [`QUOTA_PATH`]: the CREATE of a ResourceClaim
    /// is answered `allowed: false` with `status.code` 403 (`reason: Forbidden`) and the
    /// message the user reads when it does not fit, `allowed: true` otherwise (after its
    /// charge was written, unless `dryRun`). Anything else is allowed with the reason in
    /// `status.message`; a body that is not a review gets HTTP 400.
    pub async fn handle(&self, body: &[u8]) -> Answer {
        let (request, mut response) = match review::parse(body) {
            Ok(parsed) => parsed,
            Err(answer) => return answer,
        };
        let decision = self.review(&request).await;
        let answer = &mut response["response"];
        let outcome = match decision {
            Ok(decision) => {
                if let QuotaDecision::Denied(message) = &decision {
                    answer["allowed"] = json!(false);
                    answer["status"] = forbidden(message, &request);
                }
                Outcome::Quota(decision)
            }
            Err(message) => {
                answer["status"] = json!({"message": message});
                Outcome::NotHandled(Review::Quota, message)
            }
        };
        Answer {
            status: 200,
            body: response.to_string().into_bytes(),
            outcome,
        }
    }

    /// The decision on one request; `Err` with the reason when it is not the CREATE of a
    /// claim.
    async fn review(
        &self,
        request: &AdmissionRequest<DynamicObject>,
    ) -> Result<QuotaDecision, String> {
        if request.operation != Operation::Create
            || request.resource.group != "resource.k8s.io"
            || request.resource.resource != "resourceclaims"
            || request.sub_resource.is_some()
        {
            return Err(format!(
                "kerf's quota webhook handles the CREATE of resourceclaims, not {:?} of {}",
                request.operation, request.resource.resource
            ));
        }
        let namespace = request.namespace.clone().unwrap_or_default();
        let mut quotas: Vec<Arc<GpuQuota>> = self
            .caches
            .gpu_quotas
            .state()
            .into_iter()
            .filter(|q| q.namespace().as_deref() == Some(namespace.as_str()))
            .collect();
        if quotas.is_empty() {
            return Ok(QuotaDecision::NotCharged);
        }
        // The first refusal the user reads does not depend on the cache's order.
        quotas.sort_by_key(|q| q.name_any());
        let claim = match decode_claim(request) {
            Ok(claim) => claim,
            Err(message) => return Ok(QuotaDecision::Denied(message)),
        };
        let charge = match self.charge(&claim) {
            Ok(charge) => charge,
            Err(error) => {
                return Ok(QuotaDecision::Denied(format!(
                    "the claim's GPU quota charge cannot be computed: {error}"
                )));
            }
        };
        let admission = Admission {
            name: claim.name_any(),
            // Set by the API server before validating admission; a claim without one (a
            // review posted by hand) is matched by nobody and its admission expires.
            uid: claim.uid().unwrap_or_default(),
            time: Time(Timestamp::now()),
        };
        let mut charged = 0;
        for quota in quotas {
            match self
                .admit(quota, &charge, &admission, request.dry_run)
                .await
            {
                Ok(true) => charged += 1,
                Ok(false) => {}
                Err(message) => return Ok(QuotaDecision::Denied(message)),
            }
        }
        Ok(if charged == 0 {
            QuotaDecision::NotCharged
        } else {
            QuotaDecision::Charged(charged)
        })
    }

    /// The claim's charge, its classes seen as the recount sees them.
    fn charge(&self, claim: &ResourceClaim) -> kerf_api::Result<Charge> {
        let (devices, gpus) = (&self.caches.device_classes, &self.caches.gpu_classes);
        claim_charge(claim, &self.driver, |name| {
            quota_class(devices, gpus, &self.driver, name)
        })
    }

    /// Charges one quota, starting from `cached`: whether it wrote (`false` when the quota is
    /// unaffected, is gone, or on a dry run).
    ///
    /// # Errors
    ///
    /// The refusal the user reads: over the quota, or its status could not be written.
    async fn admit(
        &self,
        cached: Arc<GpuQuota>,
        charge: &Charge,
        admission: &Admission,
        dry_run: bool,
    ) -> Result<bool, String> {
        let (namespace, name) = (cached.namespace().unwrap_or_default(), cached.name_any());
        let turn = self.turn(&namespace, &name);
        let mut last = turn.lock().await;
        let mut quota = newer(last.take(), &cached);
        let api = Api::<GpuQuota>::namespaced(self.client.clone(), &namespace);
        // Whether `quota` was read from the API server during this admission.
        let mut fresh = false;
        for _ in 0..MAX_TRIES {
            let status = match evaluate(&quota, charge, admission) {
                QuotaEffect::Charge(status) if !dry_run => status,
                // A copy from the cache may predate a recount that freed usage: a refusal is
                // made on the quota as stored.
                QuotaEffect::Deny(_) if !fresh => {
                    match api.get_opt(&name).await {
                        Ok(Some(stored)) => quota = stored,
                        Ok(None) => return Ok(false),
                        Err(error) => return Err(unwritable(&name, &error)),
                    }
                    fresh = true;
                    continue;
                }
                // A dry run is checked, never written (sideEffects: NoneOnDryRun).
                verdict => {
                    *last = Some(quota);
                    return match verdict {
                        QuotaEffect::Deny(message) => Err(message),
                        _ => Ok(false),
                    };
                }
            };
            let mut raised = quota.clone();
            raised.status = Some(*status);
            match write(&api, &name, &raised).await? {
                Write::Written(written) => {
                    *last = Some(written);
                    return Ok(true);
                }
                Write::Stale(stored) => (quota, fresh) = (stored, true),
                Write::Gone => return Ok(false),
            }
        }
        Err(format!(
            "could not update GpuQuota {name}: {MAX_TRIES} conflicting writes in a row; retry \
             the create"
        ))
    }

    /// The lock admissions of quota `namespace/name` take turns on, with the last copy seen.
    fn turn(&self, namespace: &str, name: &str) -> Turn {
        // A map of locks is consistent whatever panicked while it was held.
        let mut turns = self.turns.lock().unwrap_or_else(PoisonError::into_inner);
        // Quotas deleted since their last admission leave their slot until here: drop the
        // slots nobody holds whose quota the cache no longer has.
        if turns.len() > self.caches.gpu_quotas.len().saturating_mul(2) + 16 {
            let store = &self.caches.gpu_quotas;
            turns.retain(|(ns, n), slot| {
                Arc::strong_count(slot) > 1
                    || store
                        .get(&kube::runtime::reflector::ObjectRef::new(n).within(ns))
                        .is_some()
            });
        }
        turns
            .entry((namespace.to_owned(), name.to_owned()))
            .or_default()
            .clone()
    }
}

/// The newer of the copy this replica kept from its last write or read and the cache's, as
/// ResourceQuota's admission picks between its own writes and its informer's
/// (`quotaAccessor.checkCache` in kubernetes/kubernetes
/// `staging/src/k8s.io/apiserver/pkg/admission/plugin/resourcequota/resource_access.go`,
/// comparing resourceVersions as numbers). A kept copy of another quota of the same name
/// (deleted and created again), or one whose version is not a number, loses to the cache.
fn newer(kept: Option<GpuQuota>, cached: &GpuQuota) -> GpuQuota {
    let version = |q: &GpuQuota| q.resource_version().and_then(|v| v.parse::<u64>().ok());
    match kept {
        Some(kept)
            if kept.uid() == cached.uid()
                && version(&kept)
                    .zip(version(cached))
                    .is_some_and(|(k, c)| k > c) =>
        {
            kept
        }
        _ => cached.clone(),
    }
}

/// How a conditional write of a quota's status ended.
enum Write {
    /// Written; the quota as stored now.
    Written(GpuQuota),
    /// Someone wrote since it was read; the quota as stored now.
    Stale(GpuQuota),
    /// Deleted since the cache saw it: it caps nothing any more.
    Gone,
}

/// Replaces the status of quota `name` with `raised`'s, on the condition that it is still at
/// `raised`'s resourceVersion.
///
/// # Errors
///
/// The refusal the user reads when the quota can be neither written nor read again.
async fn write(api: &Api<GpuQuota>, name: &str, raised: &GpuQuota) -> Result<Write, String> {
    match api
        .replace_status(name, &PostParams::default(), raised)
        .await
    {
        Ok(written) => Ok(Write::Written(written)),
        Err(kube::Error::Api(status)) if status.code == 409 => match api.get_opt(name).await {
            Ok(Some(fresh)) => Ok(Write::Stale(fresh)),
            Ok(None) => Ok(Write::Gone),
            Err(error) => Err(unwritable(name, &error)),
        },
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(Write::Gone),
        Err(error) => Err(unwritable(name, &error)),
    }
}

/// The refusal when quota `name` cannot be written: without the write, the charge would not
/// count against the next claim.
fn unwritable(name: &str, error: &kube::Error) -> String {
    format!("could not update GpuQuota {name}: {error}")
}

/// The claim of a review.
fn decode_claim(request: &AdmissionRequest<DynamicObject>) -> Result<ResourceClaim, String> {
    let object = request
        .object
        .as_ref()
        .ok_or_else(|| "the review carries no claim".to_owned())?;
    serde_json::to_value(object)
        .and_then(serde_json::from_value::<ResourceClaim>)
        .map_err(|e| format!("cannot read the claim: {e}"))
}

/// A refusal as ResourceQuota's admission makes it (`admission.NewForbidden`: 403
/// `Forbidden`); kube-apiserver's `ToStatusErr`
/// (`staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/errors/statuserror.go`) puts
/// `admission webhook "quota.gpu.kerf.dev" denied the request: ` in front of the message.
fn forbidden(message: &str, request: &AdmissionRequest<DynamicObject>) -> Value {
    json!({
        "status": "Failure",
        "code": 403,
        "reason": "Forbidden",
        "message": message,
        "details": {"name": request.name, "group": "resource.k8s.io", "kind": "resourceclaims"},
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kerf_api::GpuQuotaSpec;

    fn quota(uid: &str, version: &str) -> GpuQuota {
        let mut quota = GpuQuota::new("q", GpuQuotaSpec::default());
        quota.metadata.uid = Some(uid.to_owned());
        quota.metadata.resource_version = Some(version.to_owned());
        quota
    }

    fn version(quota: &GpuQuota) -> &str {
        quota.metadata.resource_version.as_deref().unwrap()
    }

    #[test]
    fn the_kept_copy_wins_only_while_it_is_newer_than_the_cache() {
        let cached = quota("u", "10");
        assert_eq!(version(&newer(Some(quota("u", "12")), &cached)), "12");
        assert_eq!(version(&newer(Some(quota("u", "9")), &cached)), "10");
        assert_eq!(version(&newer(Some(quota("u", "10")), &cached)), "10");
        assert_eq!(version(&newer(None, &cached)), "10");
        // Another quota of the same name, or versions that are not numbers.
        assert_eq!(version(&newer(Some(quota("v", "12")), &cached)), "10");
        assert_eq!(version(&newer(Some(quota("u", "x")), &cached)), "10");
    }
}
