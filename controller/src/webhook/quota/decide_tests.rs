use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::jiff::Timestamp;
use kerf_api::gpuquota::{ClassQuota, GpuQuotaSpec};

use super::*;

const GI: u64 = 1 << 30;

fn slice(gib: u64, compute: u64) -> GpuAmount {
    GpuAmount {
        memory_bytes: gib * GI,
        compute,
        gpus: 0,
    }
}

fn charge(class: &str, amount: GpuAmount) -> Charge {
    Charge {
        total: amount,
        classes: BTreeMap::from([(class.to_owned(), amount)]),
        unsized_classes: Vec::new(),
    }
}

fn hard(memory: Option<&str>, compute: Option<u64>, gpus: Option<u64>) -> GpuResources {
    GpuResources {
        memory: memory.map(|m| Quantity(m.to_owned())),
        compute,
        gpus,
    }
}

/// team-a: 40Gi of memory, 100 compute, 2 GPUs; `used` as given (`None`: no status yet).
fn quota(used: Option<GpuAmount>, classes: Vec<ClassQuota>) -> GpuQuota {
    let mut quota = GpuQuota::new(
        "team-a",
        GpuQuotaSpec {
            hard: hard(Some("40Gi"), Some(100), Some(2)),
            classes,
        },
    );
    quota.metadata.namespace = Some("team-a".to_owned());
    quota.status = used.map(|used| GpuQuotaStatus {
        used: Some(GpuResources::of(used)),
        ..GpuQuotaStatus::default()
    });
    quota
}

fn admission(uid: &str) -> Admission {
    Admission {
        name: format!("claim-{uid}"),
        uid: uid.to_owned(),
        time: Time(Timestamp::UNIX_EPOCH),
    }
}

fn charged_status(verdict: QuotaEffect) -> GpuQuotaStatus {
    match verdict {
        QuotaEffect::Charge(status) => *status,
        other => panic!("not charged: {other:?}"),
    }
}

#[test]
fn a_claim_that_fits_raises_used_and_is_recorded_as_admitted() {
    let status = charged_status(evaluate(
        &quota(Some(slice(20, 50)), Vec::new()),
        &charge("h100-slice", slice(20, 50)),
        &admission("u1"),
    ));
    assert_eq!(status.used, Some(GpuResources::of(slice(40, 100))));
    assert_eq!(status.admitted.len(), 1);
    assert_eq!(status.admitted[0].uid, "u1");
    assert_eq!(status.admitted[0].name, "claim-u1");
    assert_eq!(status.admitted[0].charge, GpuResources::of(slice(20, 50)));
    assert!(
        status.admitted[0].classes.is_empty(),
        "no class cap: no class charge"
    );
    let summary = status.summary.unwrap();
    assert_eq!(
        (
            summary.memory.as_str(),
            summary.compute.as_str(),
            summary.gpus.as_str()
        ),
        ("40Gi/40Gi", "100/100", "0/2")
    );
}

#[test]
fn a_claim_over_the_quota_is_denied_in_resource_quotas_words() {
    let verdict = evaluate(
        &quota(Some(slice(40, 100)), Vec::new()),
        &charge("h100-slice", slice(20, 10)),
        &admission("u2"),
    );
    assert_eq!(
        verdict,
        QuotaEffect::Deny(
            "exceeded quota: team-a, requested: compute=10,memory=20Gi, used: \
             compute=100,memory=40Gi, limited: compute=100,memory=40Gi"
                .to_owned()
        )
    );
}

#[test]
fn a_class_cap_is_checked_against_the_class_usage() {
    let classes = vec![ClassQuota {
        name: "h100".to_owned(),
        hard: hard(None, None, Some(1)),
    }];
    let mut full = quota(Some(slice(0, 0)), classes.clone());
    full.status.as_mut().unwrap().classes = vec![ClassUsage {
        name: "h100".to_owned(),
        hard: hard(None, None, Some(1)),
        used: GpuResources::of(GpuAmount {
            memory_bytes: 80 * GI,
            compute: 100,
            gpus: 1,
        }),
    }];
    let gpu = GpuAmount {
        memory_bytes: 10 * GI,
        compute: 10,
        gpus: 1,
    };
    assert_eq!(
        evaluate(&full, &charge("h100", gpu), &admission("u3")),
        QuotaEffect::Deny(
            "exceeded quota: team-a, requested: h100.gpuclass.gpu.kerf.dev/gpus=1, used: \
             h100.gpuclass.gpu.kerf.dev/gpus=1, limited: h100.gpuclass.gpu.kerf.dev/gpus=1"
                .to_owned()
        )
    );
    // Another class's claim does not touch the h100 cap, and the per-class usage is kept.
    let status = charged_status(evaluate(
        &quota(None, classes),
        &charge("h100", gpu),
        &admission("u4"),
    ));
    assert_eq!(status.classes.len(), 1);
    assert_eq!(status.classes[0].used, GpuResources::of(gpu));
    assert_eq!(status.admitted[0].classes[0].name, "h100");
}

#[test]
fn a_quota_without_usage_starts_from_zero() {
    let status = charged_status(evaluate(
        &quota(None, Vec::new()),
        &charge("h100-slice", slice(40, 100)),
        &admission("u5"),
    ));
    assert_eq!(status.used, Some(GpuResources::of(slice(40, 100))));
}

#[test]
fn zero_charges_invalid_specs_and_repeated_claims_change_nothing() {
    let fits = charge("h100-slice", slice(1, 1));
    // A claim of another driver's class is charged nothing (claim_charge gives it no amount).
    assert_eq!(
        evaluate(
            &quota(None, Vec::new()),
            &Charge::default(),
            &admission("u6")
        ),
        QuotaEffect::Unaffected
    );
    let mut invalid = quota(None, Vec::new());
    invalid.spec.hard.memory = Some(Quantity("lots".to_owned()));
    assert_eq!(
        evaluate(&invalid, &fits, &admission("u7")),
        QuotaEffect::Unaffected
    );
    let mut admitted = quota(None, Vec::new());
    admitted.status = Some(charged_status(evaluate(&admitted, &fits, &admission("u8"))));
    assert_eq!(
        evaluate(&admitted, &fits, &admission("u8")),
        QuotaEffect::Unaffected,
        "the same claim is charged once"
    );
}

#[test]
fn unsized_devices_are_refused_where_memory_is_capped() {
    let unsized_charge = Charge {
        unsized_classes: vec!["h100".to_owned()],
        ..charge(
            "h100",
            GpuAmount {
                memory_bytes: 0,
                compute: 100,
                gpus: 1,
            },
        )
    };
    let QuotaEffect::Deny(message) =
        evaluate(&quota(None, Vec::new()), &unsized_charge, &admission("u9"))
    else {
        panic!("memory is capped")
    };
    assert!(
        message.contains("no device of class h100 is published yet"),
        "{message}"
    );
    let mut gpus_only = quota(None, Vec::new());
    gpus_only.spec.hard = hard(None, None, Some(2));
    assert!(matches!(
        evaluate(&gpus_only, &unsized_charge, &admission("u9")),
        QuotaEffect::Charge(_)
    ));
}
