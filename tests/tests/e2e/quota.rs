//! The GpuQuota side of the quota e2e test: the quota it creates, how it reads the quota's
//! status, and how it recognises kerf's refusal of a claim over quota. Pure functions, so
//! they are unit-tested without a cluster.
//!
//! A refusal reaches the client as kube-apiserver's ValidatingAdmissionWebhook plugin makes it
//! from the webhook's Status (kubernetes/kubernetes
//! `staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/errors/statuserror.go`,
//! `ToStatusErr`): the webhook's code (403 here), and its message after
//! `admission webhook "<webhook>" denied the request: `. Newer API servers put
//! `<resource>.<group> "<name>" is forbidden: ` in front of that, older ones do not, so both
//! forms are accepted; the part kerf writes must match exactly.

use anyhow::{Result, ensure};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kerf_api::gpuquota::{GpuAmount, GpuResources};
use kerf_api::{GpuQuota, GpuQuotaSpec};
use kube::core::Status;

/// The name of kerf's quota webhook (`deploy/helm/kerf/templates/webhook.yaml`).
pub const QUOTA_WEBHOOK: &str = "quota.gpu.kerf.dev";
/// The ValidatingWebhookConfiguration that holds [`QUOTA_WEBHOOK`].
pub const QUOTA_CONFIGURATION: &str = "kerf-gpu-quota";
/// The condition type the controller sets once it has recounted a quota.
const READY: &str = "Ready";

/// A GpuQuota `name` that caps the namespace's `memory` and `compute`, nothing per class.
pub fn gpu_quota(name: &str, memory: &str, compute: u64) -> GpuQuota {
    GpuQuota {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        spec: GpuQuotaSpec {
            hard: GpuResources {
                memory: Some(Quantity(memory.to_owned())),
                compute: Some(compute),
                gpus: None,
            },
            classes: Vec::new(),
        },
        status: None,
    }
}

/// `status.used` as numbers; `None` before the first recount or admission wrote it.
///
/// # Errors
///
/// A `status.used.memory` that is not a byte quantity.
pub fn used(quota: &GpuQuota) -> Result<Option<GpuAmount>> {
    let used = quota.status.as_ref().and_then(|s| s.used.as_ref());
    Ok(match used {
        Some(used) => Some(used.amount("status.used")?),
        None => None,
    })
}

/// Whether kerf-controller has recounted the quota's current spec and found it valid:
/// `status.observedGeneration` is the quota's generation and its Ready condition is True.
pub fn is_recounted(quota: &GpuQuota) -> bool {
    let Some(status) = quota.status.as_ref() else {
        return false;
    };
    let current = quota.metadata.generation.is_some()
        && status.observed_generation == quota.metadata.generation;
    current
        && status
            .conditions
            .iter()
            .any(|c| c.type_ == READY && c.status == "True")
}

/// One line on the quota's status for wait messages: used, summary, admitted claims,
/// observed generation and conditions.
pub fn describe_quota(quota: &GpuQuota) -> String {
    let name = quota.metadata.name.as_deref().unwrap_or_default();
    let Some(status) = quota.status.as_ref() else {
        return format!("GpuQuota {name}: no status yet (is kerf-controller running?)");
    };
    let admitted: Vec<&str> = status.admitted.iter().map(|a| a.name.as_str()).collect();
    let conditions: Vec<String> = status
        .conditions
        .iter()
        .map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message))
        .collect();
    format!(
        "GpuQuota {name}: used {:?}, summary {:?}, admitted {admitted:?}, observedGeneration {:?} of {:?}, conditions {conditions:?}",
        status.used, status.summary, status.observed_generation, quota.metadata.generation
    )
}

/// What kerf says when it refuses a claim over quota, as the webhook's message: ResourceQuota's
/// `exceeded quota` wording for memory alone.
pub fn exceeded_memory(quota: &str, requested: &str, used: &str, limited: &str) -> String {
    format!(
        "exceeded quota: {quota}, requested: memory={requested}, used: memory={used}, limited: memory={limited}"
    )
}

/// Fails unless `status` is kube-apiserver's answer to creating claim `claim` when
/// [`QUOTA_WEBHOOK`] denied it with `message`: code 403 and the message exactly as
/// `ToStatusErr` wraps it (either form, see the module's documentation).
///
/// # Errors
///
/// Any other answer, quoted.
pub fn expect_quota_denial(status: &Status, claim: &str, message: &str) -> Result<()> {
    let denied = format!("admission webhook {QUOTA_WEBHOOK:?} denied the request: {message}");
    let prefixed = format!("resourceclaims.resource.k8s.io {claim:?} is forbidden: {denied}");
    ensure!(
        status.code == 403 && (status.message == denied || status.message == prefixed),
        "creating claim {claim} was refused with {} {:?} ({}), expected 403 and the message {denied:?}",
        status.code,
        status.message,
        status.reason
    );
    Ok(())
}

/// Whether `status` is a refusal by [`QUOTA_WEBHOOK`] for a quota exceeded, whatever the
/// numbers: what a create may meet while the webhook's copy of the quota still holds a claim
/// that is gone.
pub fn is_quota_denial(status: &Status) -> bool {
    status.code == 403
        && status.message.contains(&format!(
            "admission webhook {QUOTA_WEBHOOK:?} denied the request: exceeded quota: "
        ))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use k8s_openapi::jiff::Timestamp;
    use kerf_api::GpuQuotaStatus;

    use super::*;

    const MESSAGE: &str =
        "exceeded quota: team, requested: memory=20Gi, used: memory=40Gi, limited: memory=40Gi";

    fn refusal(code: u16, message: &str) -> Status {
        Status::failure(message, "Forbidden").with_code(code)
    }

    #[test]
    fn the_exceeded_message_is_resource_quotas_wording() {
        assert_eq!(exceeded_memory("team", "20Gi", "40Gi", "40Gi"), MESSAGE);
    }

    #[test]
    fn a_denial_matches_with_and_without_the_forbidden_prefix() {
        let plain =
            format!("admission webhook \"quota.gpu.kerf.dev\" denied the request: {MESSAGE}");
        let prefixed = format!("resourceclaims.resource.k8s.io \"slice-c\" is forbidden: {plain}");
        for message in [&plain, &prefixed] {
            expect_quota_denial(&refusal(403, message), "slice-c", MESSAGE).unwrap();
            assert!(is_quota_denial(&refusal(403, message)));
        }
    }

    #[test]
    fn other_answers_are_not_the_quota_denial() {
        let plain =
            format!("admission webhook \"quota.gpu.kerf.dev\" denied the request: {MESSAGE}");
        let other_numbers = plain.replace("used: memory=40Gi", "used: memory=20Gi");
        let other_webhook = plain.replace("quota.gpu.kerf.dev", "claim-parameters.gpu.kerf.dev");
        let other_claim =
            format!("resourceclaims.resource.k8s.io \"slice-b\" is forbidden: {plain}");
        for (code, message) in [
            (400, plain.as_str()),
            (403, other_numbers.as_str()),
            (403, other_webhook.as_str()),
            (403, other_claim.as_str()),
            (
                403,
                "resourceclaims.resource.k8s.io \"slice-c\" is forbidden: User \"u\" cannot create",
            ),
        ] {
            let error = expect_quota_denial(&refusal(code, message), "slice-c", MESSAGE);
            assert!(error.is_err(), "{code} {message} was taken for the denial");
        }
        assert!(!is_quota_denial(&refusal(403, &other_webhook)));
        assert!(!is_quota_denial(&refusal(500, &plain)));
    }

    #[test]
    fn a_quota_counts_as_recounted_only_for_its_generation_and_ready() {
        let mut quota = gpu_quota("team", "40Gi", 100);
        assert!(!is_recounted(&quota));
        assert!(describe_quota(&quota).contains("no status yet"));
        quota.metadata.generation = Some(2);
        let ready = |status: &str| Condition {
            type_: READY.to_owned(),
            status: status.to_owned(),
            reason: "Recounted".to_owned(),
            message: String::new(),
            last_transition_time: Time(Timestamp::UNIX_EPOCH),
            observed_generation: None,
        };
        quota.status = Some(GpuQuotaStatus {
            observed_generation: Some(1),
            conditions: vec![ready("True")],
            used: Some(GpuResources::of(GpuAmount {
                memory_bytes: 20 << 30,
                compute: 25,
                gpus: 0,
            })),
            ..GpuQuotaStatus::default()
        });
        assert!(
            !is_recounted(&quota),
            "an older generation's recount counts"
        );
        if let Some(status) = quota.status.as_mut() {
            status.observed_generation = Some(2);
            status.conditions = vec![ready("False")];
        }
        assert!(
            !is_recounted(&quota),
            "an invalid quota counts as recounted"
        );
        if let Some(status) = quota.status.as_mut() {
            status.conditions = vec![ready("True")];
        }
        assert!(is_recounted(&quota));
        let used = used(&quota).unwrap().unwrap();
        assert_eq!((used.memory_bytes, used.compute), (20 << 30, 25));
    }
}
