//! The pure decision of the quota webhook: one GpuQuota and one claim's charge in, allow,
//! deny or the quota's raised status out.
//!
//! As ResourceQuota's admission (`checkRequest` in kubernetes/kubernetes
//! `staging/src/k8s.io/apiserver/pkg/admission/plugin/resourcequota/controller.go`), the base
//! is the quota's `status.used`, which already holds earlier admissions; the new status is
//! written back by the caller with the quota's `resourceVersion`, so a concurrent admission
//! makes the write conflict and the decision is taken again on the newer status.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_api::GpuQuota;
use kerf_api::gpuquota::{
    AdmittedClaim, Charge, ClassCharge, ClassUsage, GpuAmount, GpuQuotaStatus, GpuResources,
    exceeded, exceeded_message, summary,
};
use kube::ResourceExt as _;

/// The claim being admitted, as `status.admitted` records it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Admission {
    /// The claim's name.
    pub(crate) name: String,
    /// The claim's UID (the API server sets it before validating admission).
    pub(crate) uid: String,
    /// Now.
    pub(crate) time: Time,
}

/// What one quota says about one claim.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum QuotaEffect {
    /// The quota does not change: its spec is invalid (skipped, logged; the recount reports
    /// it on the object), the charge is zero, or this claim is charged already.
    Unaffected,
    /// The claim is refused, with the message the user reads.
    Deny(String),
    /// The claim fits; this is the quota's status with the charge added.
    Charge(Box<GpuQuotaStatus>),
}

/// The verdict of `quota` on a claim charged `charge`.
pub(crate) fn evaluate(quota: &GpuQuota, charge: &Charge, admission: &Admission) -> QuotaEffect {
    let name = quota.name_any();
    if let Err(error) = quota.spec.validate("spec") {
        tracing::warn!(
            quota = %name,
            namespace = quota.namespace().unwrap_or_default(),
            %error,
            "webhook: GpuQuota with an invalid spec is not enforced"
        );
        return QuotaEffect::Unaffected;
    }
    let status = quota.status.clone().unwrap_or_default();
    if charge.is_zero() || status.admitted.iter().any(|a| a.uid == admission.uid) {
        return QuotaEffect::Unaffected;
    }
    if let Some(class) = unsized_capped(quota, charge) {
        return QuotaEffect::Deny(format!(
            "GpuQuota {name} caps memory, and no device of class {class} is published yet, so \
             its memory cannot be charged; retry once the nodes publish their GPUs"
        ));
    }
    let used = amount_or_zero(status.used.as_ref(), &name, "status.used");
    let class_used = class_usage(&status, &name);
    // validate() checked every quantity of the spec: none of these fails.
    let mut over =
        exceeded(None, charge.total, used, &quota.spec.hard, "spec.hard").unwrap_or_default();
    for (i, class) in quota.spec.classes.iter().enumerate() {
        let Some(&asked) = charge.classes.get(&class.name) else {
            continue;
        };
        let held = class_used.get(&class.name).copied().unwrap_or_default();
        let path = format!("spec.classes[{i}].hard");
        over.extend(
            exceeded(Some(&class.name), asked, held, &class.hard, &path).unwrap_or_default(),
        );
    }
    if !over.is_empty() {
        return QuotaEffect::Deny(exceeded_message(&name, &over));
    }
    QuotaEffect::Charge(Box::new(charged(
        quota,
        status,
        used,
        &class_used,
        charge,
        admission,
    )))
}

/// The first class the charge could not size whose memory the quota caps (in `spec.hard` or
/// in the class's own caps): charging it nothing would let any number of its devices in.
fn unsized_capped<'a>(quota: &GpuQuota, charge: &'a Charge) -> Option<&'a str> {
    let hard_memory = quota.spec.hard.memory.is_some();
    charge
        .unsized_classes
        .iter()
        .find(|class| {
            hard_memory
                || quota
                    .spec
                    .classes
                    .iter()
                    .any(|c| &c.name == *class && c.hard.memory.is_some())
        })
        .map(String::as_str)
}

/// `resources` as numbers; missing or unreadable (only kerf writes the status, so never in
/// practice) counts as nothing, which the next recount corrects.
fn amount_or_zero(resources: Option<&GpuResources>, quota: &str, path: &str) -> GpuAmount {
    let Some(resources) = resources else {
        return GpuAmount::ZERO;
    };
    resources.amount(path).unwrap_or_else(|error| {
        tracing::warn!(%quota, %error, "webhook: GpuQuota usage unreadable; counting it as 0");
        GpuAmount::ZERO
    })
}

/// What each class of `status.classes` holds.
fn class_usage(status: &GpuQuotaStatus, quota: &str) -> BTreeMap<String, GpuAmount> {
    status
        .classes
        .iter()
        .map(|c| {
            let path = format!("status.classes[{}].used", c.name);
            (c.name.clone(), amount_or_zero(Some(&c.used), quota, &path))
        })
        .collect()
}

/// `status` with the charge added: `used`, each capped class's `used`, the admission
/// recorded (until the recount sees the claim) and the summary.
fn charged(
    quota: &GpuQuota,
    mut status: GpuQuotaStatus,
    used: GpuAmount,
    class_used: &BTreeMap<String, GpuAmount>,
    charge: &Charge,
    admission: &Admission,
) -> GpuQuotaStatus {
    let used = used.plus(charge.total);
    let mut class_charges = Vec::new();
    status.classes = quota
        .spec
        .classes
        .iter()
        .map(|class| {
            let asked = charge.classes.get(&class.name).copied().unwrap_or_default();
            if !asked.is_zero() {
                class_charges.push(ClassCharge {
                    name: class.name.clone(),
                    charge: GpuResources::of(asked),
                });
            }
            let held = class_used.get(&class.name).copied().unwrap_or_default();
            ClassUsage {
                name: class.name.clone(),
                hard: class.hard.clone(),
                used: GpuResources::of(held.plus(asked)),
            }
        })
        .collect();
    status.used = Some(GpuResources::of(used));
    status.admitted.push(AdmittedClaim {
        name: admission.name.clone(),
        uid: admission.uid.clone(),
        time: admission.time.clone(),
        charge: GpuResources::of(charge.total),
        classes: class_charges,
    });
    status.summary = Some(summary(used, &quota.spec.hard));
    status
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
