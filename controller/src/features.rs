//! Which optional `resource.k8s.io/v1` fields the API server keeps, asked once when a
//! leadership term starts and handed to the reconcilers as a value in the
//! [`Context`](crate::Context).
//!
//! A 1.34/1.35 API server (feature gate DRAExtendedResource off) accepts a DeviceClass with
//! `spec.extendedResourceName` and silently drops the field, so writing it anyway would make
//! every reconcile see a DeviceClass that differs from the desired one and apply it again. The
//! probe is a dry-run create ([`kerf_api::features::extended_resource_probe`]): nothing is
//! stored, and the controller may already create DeviceClasses, so it needs no extra RBAC.

use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, DeviceClass, DeviceClassSpec, DeviceSelector,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kerf_api::features::{
    ApiFeature, PROBE_NAME_PREFIX, Probed, extended_resource_probe, kept_extended_resource,
};
use kube::api::PostParams;
use kube::{Api, Client};

/// Feature gate of consumable capacity, for log lines and conditions.
pub(crate) const CONSUMABLE_CAPACITY_GATE: &str = "DRAConsumableCapacity";

/// What the API server serves of the optional fields the controller writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiSupport {
    /// DRAExtendedResource: DeviceClass `spec.extendedResourceName`.
    pub extended_resource: Probed,
    /// DRAConsumableCapacity: `device.allowMultipleAllocations` in DeviceClass CEL selectors,
    /// hence sliced Scheduler classes.
    pub consumable_capacity: Probed,
}

impl ApiSupport {
    /// Every optional field served: what [`Context::new`](crate::Context::new) assumes until
    /// [`probe`] answers (tests that do not exercise the degraded path keep it).
    pub fn all_served() -> Self {
        Self {
            extended_resource: Probed::Served,
            consumable_capacity: Probed::Served,
        }
    }
}

/// Asks the API server which optional fields it keeps, and logs one line per feature it does
/// not serve (the degraded mode is a property of the cluster, not an error: info when the
/// field is dropped, a warning when the probe itself failed).
///
/// Never fails: a probe that cannot be made counts as not served
/// ([`Probed::Failed`]), so the controller runs as on a 1.34/1.35 cluster.
pub async fn probe(client: &Client, driver: &str, field_manager: &str) -> ApiSupport {
    let params = PostParams {
        dry_run: true,
        field_manager: Some(field_manager.to_owned()),
    };
    let extended_resource = match Api::<DeviceClass>::all(client.clone())
        .create(&params, &extended_resource_probe(driver))
        .await
    {
        Ok(answer) => kept_extended_resource(&answer),
        Err(error) => Probed::Failed(error.to_string()),
    };
    log_outcome(ApiFeature::ExtendedResource, &extended_resource);
    let consumable_capacity = match Api::<DeviceClass>::all(client.clone())
        .create(&params, &consumable_capacity_probe(driver))
        .await
    {
        Ok(_) => Probed::Served,
        Err(kube::Error::Api(status)) if status.code == 422 => Probed::Dropped,
        Err(error) => Probed::Failed(error.to_string()),
    };
    match &consumable_capacity {
        Probed::Served => tracing::debug!(gate = CONSUMABLE_CAPACITY_GATE, "served"),
        Probed::Dropped => tracing::info!(
            gate = CONSUMABLE_CAPACITY_GATE,
            "the API server does not know device.allowMultipleAllocations (feature gate {CONSUMABLE_CAPACITY_GATE} off, or Kubernetes before 1.36): sliced Scheduler GpuClasses report Ready=False"
        ),
        Probed::Failed(why) => tracing::warn!(
            gate = CONSUMABLE_CAPACITY_GATE,
            "cannot tell whether the API server serves {CONSUMABLE_CAPACITY_GATE} ({why}); assuming it does not: sliced Scheduler GpuClasses report Ready=False"
        ),
    }
    ApiSupport {
        extended_resource,
        consumable_capacity,
    }
}

/// The dry-run DeviceClass that asks whether the API server serves consumable capacity. The
/// DRA CEL environment declares `device.allowMultipleAllocations` only with
/// DRAConsumableCapacity on (kubernetes
/// `staging/src/k8s.io/dynamic-resource-allocation/cel/compile.go`, `newCompiler`), and
/// DeviceClass validation compiles every selector, so a server without the feature refuses
/// this class as invalid (422) — the exact thing the controller's sliced classes need. It
/// needs no RBAC beyond the DeviceClass writes the controller makes anyway.
pub fn consumable_capacity_probe(driver: &str) -> DeviceClass {
    DeviceClass {
        metadata: ObjectMeta {
            generate_name: Some(PROBE_NAME_PREFIX.to_owned()),
            ..ObjectMeta::default()
        },
        spec: DeviceClassSpec {
            selectors: Some(vec![DeviceSelector {
                cel: Some(CELDeviceSelector {
                    expression: format!(
                        "device.driver == {} && device.allowMultipleAllocations",
                        crate::selector::cel_string(driver)
                    ),
                }),
            }]),
            ..DeviceClassSpec::default()
        },
    }
}

fn log_outcome(feature: ApiFeature, probed: &Probed) {
    match (probed, probed.degraded_message(feature)) {
        (Probed::Failed(_), Some(line)) => tracing::warn!(feature = %feature, "{line}"),
        (_, Some(line)) => tracing::info!(feature = %feature, "{line}"),
        (_, None) => tracing::debug!(feature = %feature, field = feature.field(), "served"),
    }
}
