//! Which optional `resource.k8s.io/v1` fields the API server keeps, asked once when a
//! leadership term starts and handed to the reconcilers as a value in the
//! [`Context`](crate::Context).
//!
//! A 1.34/1.35 API server (feature gate DRAExtendedResource off) accepts a DeviceClass with
//! `spec.extendedResourceName` and silently drops the field, so writing it anyway would make
//! every reconcile see a DeviceClass that differs from the desired one and apply it again. The
//! probe is a dry-run create ([`kerf_api::features::extended_resource_probe`]): nothing is
//! stored, and the controller may already create DeviceClasses, so it needs no extra RBAC.

use k8s_openapi::api::resource::v1::DeviceClass;
use kerf_api::features::{ApiFeature, Probed, extended_resource_probe, kept_extended_resource};
use kube::api::PostParams;
use kube::{Api, Client};

/// What the API server serves of the optional fields the controller writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiSupport {
    /// DRAExtendedResource: DeviceClass `spec.extendedResourceName`.
    pub extended_resource: Probed,
}

impl ApiSupport {
    /// Every optional field served: what [`Context::new`](crate::Context::new) assumes until
    /// [`probe`] answers (tests that do not exercise the degraded path keep it).
    pub fn all_served() -> Self {
        Self {
            extended_resource: Probed::Served,
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
    ApiSupport { extended_resource }
}

fn log_outcome(feature: ApiFeature, probed: &Probed) {
    match (probed, probed.degraded_message(feature)) {
        (Probed::Failed(_), Some(line)) => tracing::warn!(feature = %feature, "{line}"),
        (_, Some(line)) => tracing::info!(feature = %feature, "{line}"),
        (_, None) => tracing::debug!(feature = %feature, field = feature.field(), "served"),
    }
}
