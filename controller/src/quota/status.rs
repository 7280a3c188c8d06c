//! The status a recount writes: `hard` from the spec, `used` and per-class usage from the
//! count ([`super::usage`]), the `admitted` entries that still count, the summary of the
//! printer columns, and the Ready condition.

use std::collections::BTreeMap;

use kerf_api::gpuclass::CONDITION_READY;
use kerf_api::gpuquota::{ClassUsage, GpuAmount, GpuQuota, GpuQuotaStatus, GpuResources, summary};

use super::usage::Usage;
use crate::condition::{Verdict, condition};

/// `Ready` reasons the recount writes.
pub mod reasons {
    /// The spec is valid: the webhook enforces it and `used` is recounted.
    pub const ENFORCED: &str = "Enforced";
    /// The spec has a value kerf cannot use: the webhook skips the quota.
    pub const INVALID_SPEC: &str = "InvalidSpec";
}

/// The readiness of `quota`'s spec.
pub(crate) fn readiness(quota: &GpuQuota) -> Verdict {
    match quota.spec.validate("spec") {
        Ok(()) => Verdict {
            ok: true,
            reason: reasons::ENFORCED,
            message: "kerf's webhook charges each ResourceClaim created in the namespace against spec.hard; kerf-controller recounts status.used from the claims".to_owned(),
        },
        Err(error) => Verdict {
            ok: false,
            reason: reasons::INVALID_SPEC,
            message: format!("{error}; the quota is not enforced until the spec is fixed"),
        },
    }
}

/// The status of `quota` after a recount giving `usage`. An invalid spec enforces nothing:
/// no `hard`, no classes, `used` for information.
pub(crate) fn desired_status(
    quota: &GpuQuota,
    usage: &Usage,
    readiness: &Verdict,
) -> GpuQuotaStatus {
    let previous = quota.status.as_ref();
    let generation = quota.metadata.generation;
    let ready = condition(
        CONDITION_READY,
        readiness,
        generation,
        previous.and_then(|s| s.conditions.iter().find(|c| c.type_ == CONDITION_READY)),
    );
    let (hard, classes, shown) = if readiness.ok {
        let classes = quota
            .spec
            .classes
            .iter()
            .map(|class| ClassUsage {
                name: class.name.clone(),
                hard: class.hard.clone(),
                used: GpuResources::of(class_used(&usage.classes, &class.name)),
            })
            .collect();
        (
            Some(quota.spec.hard.clone()),
            classes,
            quota.spec.hard.clone(),
        )
    } else {
        (None, Vec::new(), GpuResources::default())
    };
    GpuQuotaStatus {
        hard,
        used: Some(GpuResources::of(usage.total)),
        classes,
        admitted: usage.admitted.clone(),
        summary: Some(summary(usage.total, &shown)),
        observed_generation: generation,
        conditions: vec![ready],
    }
}

fn class_used(classes: &BTreeMap<String, GpuAmount>, name: &str) -> GpuAmount {
    classes.get(name).copied().unwrap_or_default()
}

/// Whether the Ready condition's status or reason differs between `before` and `after` (an
/// Event is published then).
pub(crate) fn ready_changed(before: Option<&GpuQuotaStatus>, after: &GpuQuotaStatus) -> bool {
    let ready = |s: &GpuQuotaStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == CONDITION_READY)
            .map(|c| (c.status.clone(), c.reason.clone()))
    };
    before.and_then(ready) != ready(after)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use kerf_api::gpuquota::{ClassQuota, GpuQuotaSpec};

    const GIB: u64 = 1 << 30;

    fn quota(spec: GpuQuotaSpec) -> GpuQuota {
        let mut quota = GpuQuota::new("team-a", spec);
        quota.metadata.namespace = Some("team-a".to_owned());
        quota.metadata.generation = Some(3);
        quota
    }

    fn hard(memory: &str, compute: u64, gpus: u64) -> GpuResources {
        GpuResources {
            memory: Some(Quantity(memory.to_owned())),
            compute: Some(compute),
            gpus: Some(gpus),
        }
    }

    fn used() -> Usage {
        let slice = GpuAmount {
            memory_bytes: 20 * GIB,
            compute: 50,
            gpus: 0,
        };
        Usage {
            total: slice,
            classes: BTreeMap::from([("slices".to_owned(), slice)]),
            admitted: Vec::new(),
            claims: 1,
        }
    }

    #[test]
    fn a_valid_quota_shows_used_against_hard_per_resource_and_class() {
        let quota = quota(GpuQuotaSpec {
            hard: hard("40Gi", 100, 2),
            classes: vec![
                ClassQuota {
                    name: "slices".to_owned(),
                    hard: hard("20Gi", 100, 0),
                },
                ClassQuota {
                    name: "h100".to_owned(),
                    hard: hard("160Gi", 200, 2),
                },
            ],
        });
        let ready = readiness(&quota);
        let status = desired_status(&quota, &used(), &ready);
        assert_eq!(status.hard, Some(hard("40Gi", 100, 2)));
        assert_eq!(status.used, Some(hard("20Gi", 50, 0)));
        let classes: Vec<_> = status
            .classes
            .iter()
            .map(|c| (c.name.as_str(), c.used.clone()))
            .collect();
        assert_eq!(
            classes,
            [("slices", hard("20Gi", 50, 0)), ("h100", hard("0", 0, 0))]
        );
        let summary = status.summary.as_ref().unwrap();
        assert_eq!(
            (
                summary.memory.as_str(),
                summary.compute.as_str(),
                summary.gpus.as_str()
            ),
            ("20Gi/40Gi", "50/100", "0/2")
        );
        assert_eq!(status.observed_generation, Some(3));
        let condition = &status.conditions[0];
        assert_eq!(
            (condition.status.as_str(), condition.reason.as_str()),
            ("True", "Enforced")
        );
        assert!(ready_changed(None, &status));
        assert!(!ready_changed(Some(&status), &status));
    }

    #[test]
    fn an_invalid_spec_enforces_nothing_and_says_why() {
        let quota = quota(GpuQuotaSpec {
            hard: GpuResources {
                memory: Some(Quantity("lots".to_owned())),
                ..GpuResources::default()
            },
            classes: Vec::new(),
        });
        let ready = readiness(&quota);
        assert!(!ready.ok);
        assert_eq!(ready.reason, reasons::INVALID_SPEC);
        assert!(
            ready.message.contains("spec.hard.memory"),
            "{}",
            ready.message
        );
        let status = desired_status(&quota, &used(), &ready);
        assert_eq!(status.hard, None);
        assert_eq!(status.used, Some(hard("20Gi", 50, 0)));
        assert_eq!(status.summary.unwrap().memory, "20Gi");
    }
}
