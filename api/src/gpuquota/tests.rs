use k8s_openapi::api::resource::v1::{
    CapacityRequirements, DeviceClaim, DeviceClaimConfiguration, DeviceRequest, DeviceSubRequest,
    ExactDeviceRequest, OpaqueDeviceConfiguration, ResourceClaim, ResourceClaimSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use serde_json::json;

use super::*;
use crate::params::{Allocator, GpuClassParameters, Slicing};

const DRIVER: &str = "gpu.kerf.dev";
const GI: u64 = 1 << 30;
const H100: DeviceSize = DeviceSize {
    memory_bytes: 81_559 * (1 << 20),
    compute: 100,
};

fn class(allocator: Allocator, slicing: Option<Slicing>) -> QuotaClass {
    QuotaClass {
        params: GpuClassParameters {
            allocator,
            slicing,
            ..GpuClassParameters::default()
        },
        largest: Some(H100),
        devices: 8,
    }
}

fn slicing(default_compute: Option<u8>) -> Slicing {
    Slicing {
        memory_granularity: Quantity("1Gi".to_owned()),
        max_slices_per_gpu: None,
        default_compute,
    }
}

fn classes(name: &str) -> Option<QuotaClass> {
    match name {
        "h100" => Some(class(Allocator::Scheduler, None)),
        "h100-slice" => Some(class(Allocator::Controller, Some(slicing(Some(10))))),
        "h100-scheduler-slice" => Some(class(Allocator::Scheduler, Some(slicing(Some(25))))),
        "unpublished" => Some(QuotaClass {
            largest: None,
            devices: 0,
            ..class(Allocator::Scheduler, None)
        }),
        _ => None,
    }
}

fn exactly(class: &str) -> ExactDeviceRequest {
    ExactDeviceRequest {
        device_class_name: class.to_owned(),
        ..ExactDeviceRequest::default()
    }
}

fn claim(requests: Vec<DeviceRequest>, params: Option<serde_json::Value>) -> ResourceClaim {
    let config = params.map(|p| {
        vec![DeviceClaimConfiguration {
            opaque: Some(OpaqueDeviceConfiguration {
                driver: DRIVER.to_owned(),
                parameters: RawExtension(p),
            }),
            requests: None,
        }]
    });
    ResourceClaim {
        metadata: ObjectMeta {
            name: Some("c".to_owned()),
            namespace: Some("team-a".to_owned()),
            uid: Some("uid-c".to_owned()),
            ..ObjectMeta::default()
        },
        spec: ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(requests),
                config,
                constraints: None,
            }),
        },
        status: None,
    }
}

fn request(name: &str, exactly: ExactDeviceRequest) -> DeviceRequest {
    DeviceRequest {
        name: name.to_owned(),
        exactly: Some(exactly),
        first_available: None,
    }
}

fn slice_params(memory: &str, compute: Option<u8>) -> serde_json::Value {
    let mut p = json!({"apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters", "memory": memory});
    if let Some(c) = compute {
        p["compute"] = json!(c);
    }
    p
}

#[test]
fn a_controller_slice_is_charged_its_memory_and_compute_and_no_gpu() {
    let claim = claim(
        vec![request("gpu", exactly("h100-slice"))],
        Some(slice_params("20Gi", None)),
    );
    let charge = claim_charge(&claim, DRIVER, classes).unwrap();
    let expected = GpuAmount {
        memory_bytes: 20 * GI,
        compute: 10,
        gpus: 0,
    };
    assert_eq!(charge.total, expected);
    assert_eq!(charge.classes["h100-slice"], expected);
}

#[test]
fn whole_gpus_are_charged_their_full_memory_100_compute_and_one_gpu_each() {
    let claim = claim(
        vec![request(
            "gpu",
            ExactDeviceRequest {
                count: Some(2),
                ..exactly("h100")
            },
        )],
        None,
    );
    let charge = claim_charge(&claim, DRIVER, classes).unwrap();
    assert_eq!(
        charge.total,
        GpuAmount {
            memory_bytes: 2 * H100.memory_bytes,
            compute: 200,
            gpus: 2,
        }
    );
}

#[test]
fn a_scheduler_share_is_charged_its_rounded_capacity_request() {
    let share = ExactDeviceRequest {
        capacity: Some(CapacityRequirements {
            requests: Some(
                [("memory".to_owned(), Quantity("9.5Gi".to_owned()))]
                    .into_iter()
                    .collect(),
            ),
        }),
        ..exactly("h100-scheduler-slice")
    };
    let charge = claim_charge(&claim(vec![request("gpu", share)], None), DRIVER, classes).unwrap();
    assert_eq!(
        charge.total,
        GpuAmount {
            memory_bytes: 10 * GI,
            compute: 25,
            gpus: 0,
        }
    );
}

#[test]
fn first_available_is_charged_its_largest_alternative() {
    let sub = |name: &str, class: &str| DeviceSubRequest {
        name: name.to_owned(),
        device_class_name: class.to_owned(),
        ..DeviceSubRequest::default()
    };
    let prioritized = DeviceRequest {
        name: "gpu".to_owned(),
        exactly: None,
        first_available: Some(vec![
            sub("share", "h100-scheduler-slice"),
            sub("whole", "h100"),
        ]),
    };
    let charge = claim_charge(&claim(vec![prioritized], None), DRIVER, classes).unwrap();
    assert_eq!(charge.total.gpus, 1);
    assert_eq!(charge.classes.keys().collect::<Vec<_>>(), ["h100"]);
}

#[test]
fn other_drivers_and_admin_access_are_free_and_unpublished_classes_unsized() {
    let admin = ExactDeviceRequest {
        admin_access: Some(true),
        ..exactly("h100")
    };
    let claim_ = claim(
        vec![
            request("other", exactly("someone-elses")),
            request("admin", admin),
        ],
        None,
    );
    assert!(claim_charge(&claim_, DRIVER, classes).unwrap().is_zero());
    let unsized_classes = claim_charge(
        &claim(vec![request("gpu", exactly("unpublished"))], None),
        DRIVER,
        classes,
    )
    .unwrap();
    assert_eq!(unsized_classes.unsized_classes, ["unpublished"]);
    assert_eq!(unsized_classes.total.gpus, 1);
}

#[test]
fn bad_parameters_of_a_controller_class_are_refused_naming_the_field() {
    let claim = claim(
        vec![request("gpu", exactly("h100-slice"))],
        Some(
            json!({"apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters", "memroy": "1Gi"}),
        ),
    );
    let err = claim_charge(&claim, DRIVER, classes)
        .unwrap_err()
        .to_string();
    assert!(err.contains("memroy"), "{err}");
}

#[test]
fn the_refusal_reads_like_resourcequotas() {
    let hard = GpuResources {
        memory: Some(Quantity("40Gi".to_owned())),
        compute: Some(100),
        gpus: None,
    };
    let used = GpuAmount {
        memory_bytes: 40 * GI,
        compute: 20,
        gpus: 5,
    };
    let asked = GpuAmount {
        memory_bytes: 20 * GI,
        compute: 10,
        gpus: 1,
    };
    let over = exceeded(None, asked, used, &hard, "spec.hard").unwrap();
    assert_eq!(
        exceeded_message("team-a", &over),
        "exceeded quota: team-a, requested: memory=20Gi, used: memory=40Gi, limited: memory=40Gi"
    );
    let class_over = exceeded(Some("h100"), asked, used, &hard, "spec.classes[0].hard").unwrap();
    assert_eq!(class_over[0].resource, "h100.gpuclass.gpu.kerf.dev/memory");
    let nothing_asked = exceeded(None, GpuAmount::ZERO, used, &hard, "spec.hard").unwrap();
    assert!(nothing_asked.is_empty());
}

#[test]
fn the_summary_shows_used_over_hard_where_capped() {
    let hard = GpuResources {
        memory: Some(Quantity("40Gi".to_owned())),
        compute: None,
        gpus: Some(2),
    };
    let used = GpuAmount {
        memory_bytes: 20 * GI,
        compute: 60,
        gpus: 1,
    };
    assert_eq!(
        summary(used, &hard),
        QuotaSummary {
            memory: "20Gi/40Gi".to_owned(),
            compute: "60".to_owned(),
            gpus: "1/2".to_owned(),
        }
    );
}

#[test]
fn a_spec_with_a_class_twice_or_a_bad_memory_is_refused() {
    let twice = GpuQuotaSpec {
        hard: GpuResources::default(),
        classes: vec![
            ClassQuota {
                name: "h100".to_owned(),
                hard: GpuResources::default(),
            },
            ClassQuota {
                name: "h100".to_owned(),
                hard: GpuResources::default(),
            },
        ],
    };
    let err = twice.validate("spec").unwrap_err().to_string();
    assert!(err.starts_with("spec.classes[1].name"), "{err}");
    let bad = GpuQuotaSpec {
        hard: GpuResources {
            memory: Some(Quantity("lots".to_owned())),
            ..GpuResources::default()
        },
        classes: Vec::new(),
    };
    let err = bad.validate("spec").unwrap_err().to_string();
    assert!(err.starts_with("spec.hard.memory"), "{err}");
}

#[test]
fn a_zero_memory_reads_back_as_zero() {
    // What a recount writes before any claim, and a cap that forbids GPU memory.
    let zero = GpuResources::of(GpuAmount::ZERO);
    assert_eq!(zero.amount("used").unwrap(), GpuAmount::ZERO);
    for text in ["0", "0Gi", "0.0"] {
        let cap = GpuResources {
            memory: Some(Quantity(text.to_owned())),
            ..GpuResources::default()
        };
        assert_eq!(cap.amount("hard").unwrap(), GpuAmount::ZERO, "{text}");
    }
    let negative = GpuResources {
        memory: Some(Quantity("-1Gi".to_owned())),
        ..GpuResources::default()
    };
    assert!(negative.amount("hard").is_err());
}
