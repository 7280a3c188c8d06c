//! The DeviceClass a GpuClass is reconciled into.
//!
//! Same name as the GpuClass; one CEL selector (`crate::selector::class_cel`); the class
//! settings as opaque `GpuClassParameters` config for the driver, so the kubelet plugin and the
//! allocation controller read them from the DeviceClass exactly as from a hand-written one. The
//! GpuClass is its controller owner, so deleting the GpuClass makes the garbage collector delete
//! the DeviceClass: no finalizer is needed. The owner reference sets `blockOwnerDeletion`, so
//! on clusters with the OwnerReferencesPermissionEnforcement admission plugin the controller
//! needs `update` on `gpuclasses/finalizers` besides `patch` on `deviceclasses`.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, DeviceClass, DeviceClassConfiguration, DeviceClassSpec, DeviceSelector,
    OpaqueDeviceConfiguration,
};
use kerf_api::GpuClass;
use kerf_api::params::{GpuClassParameters, OpaqueKind};
use kube::api::ObjectMeta;
use kube::{Resource, ResourceExt};

use crate::error::{Error, Result};
use crate::selector::class_cel;

/// Label on every DeviceClass the controller writes.
const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";

/// Builds the DeviceClass of `class` for `driver`; `manager` is the `MANAGED_BY_LABEL` value;
/// `consumable_capacity` says whether the API server serves DRAConsumableCapacity (see
/// `class_cel`).
///
/// # Errors
///
/// - [`Error::Api`] with [`kerf_api::Error::InvalidConfig`] when the spec is invalid; the
///   message names the field (`spec.selector.minMemory`, …).
/// - [`Error::MissingField`] when the GpuClass has no name or UID (it was not read from the
///   API server).
pub fn device_class(
    class: &GpuClass,
    driver: &str,
    manager: &str,
    consumable_capacity: bool,
) -> Result<DeviceClass> {
    let params: GpuClassParameters = class.spec.parameters();
    let expression = class_cel(&params, driver, "spec", consumable_capacity)?;
    let name = class.metadata.name.clone().ok_or(Error::MissingField {
        kind: "GpuClass",
        field: "name",
    })?;
    let owner = class.controller_owner_ref(&()).ok_or(Error::MissingField {
        kind: "GpuClass",
        field: "uid",
    })?;
    Ok(DeviceClass {
        metadata: ObjectMeta {
            name: Some(name),
            labels: Some(BTreeMap::from([(
                MANAGED_BY_LABEL.to_owned(),
                manager.to_owned(),
            )])),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        spec: DeviceClassSpec {
            selectors: Some(vec![DeviceSelector {
                cel: Some(CELDeviceSelector { expression }),
            }]),
            config: Some(vec![DeviceClassConfiguration {
                opaque: Some(OpaqueDeviceConfiguration {
                    driver: driver.to_owned(),
                    parameters: params.to_raw_extension()?,
                }),
            }]),
            ..DeviceClassSpec::default()
        },
    })
}

/// Whether `device_class` is controlled by `class` (an owner reference with `controller: true`
/// and the class's UID), i.e. the controller may overwrite it.
pub(crate) fn is_controlled_by(device_class: &DeviceClass, class: &GpuClass) -> bool {
    let Some(uid) = class.uid() else { return false };
    device_class
        .owner_references()
        .iter()
        .any(|owner| owner.controller == Some(true) && owner.uid == uid)
}

/// Whether `existing` (the cached DeviceClass, if any) differs from `desired` in what the
/// controller sets: spec, its labels, its owner reference. Skipping identical applies keeps
/// the frequent cache-driven reconciles free of writes.
pub(crate) fn needs_apply(existing: Option<&DeviceClass>, desired: &DeviceClass) -> bool {
    let Some(existing) = existing else {
        return true;
    };
    let labels_set = desired
        .labels()
        .iter()
        .all(|(k, v)| existing.labels().get(k) == Some(v));
    let owners_set = desired
        .owner_references()
        .iter()
        .all(|o| existing.owner_references().contains(o));
    existing.spec != desired.spec || !labels_set || !owners_set
}

#[cfg(test)]
mod tests {
    use super::*;
    use kerf_api::params::{Allocator, GpuSelector, SharingConfig};
    use kerf_api::{GpuClassSpec, decode_opaque, params::OpaqueConfig};

    fn class(spec: GpuClassSpec) -> GpuClass {
        let mut class = GpuClass::new("fast", spec);
        class.metadata.uid = Some("uid-1".to_owned());
        class
    }

    #[test]
    fn carries_selector_config_and_owner() {
        let spec = GpuClassSpec {
            allocator: Allocator::Scheduler,
            selector: GpuSelector {
                product_names: vec!["NVIDIA L4".to_owned()],
                ..GpuSelector::default()
            },
            sharing: Some(SharingConfig::default()),
            ..GpuClassSpec::default()
        };
        let gpu_class = class(spec.clone());
        let dc = device_class(&gpu_class, "gpu.kerf.dev", "kerf-controller", true).unwrap();
        assert_eq!(dc.metadata.name.as_deref(), Some("fast"));
        assert_eq!(
            dc.labels().get(MANAGED_BY_LABEL).map(String::as_str),
            Some("kerf-controller")
        );
        let owner = &dc.owner_references()[0];
        assert_eq!(owner.kind, "GpuClass");
        assert_eq!(owner.api_version, "gpu.kerf.dev/v1alpha1");
        assert_eq!(owner.uid, "uid-1");
        assert_eq!(owner.controller, Some(true));
        assert!(is_controlled_by(&dc, &gpu_class));

        let selectors = dc.spec.selectors.as_ref().unwrap();
        assert_eq!(selectors.len(), 1);
        let expression = &selectors[0].cel.as_ref().unwrap().expression;
        assert!(
            expression.starts_with(r#"device.driver == "gpu.kerf.dev" && "#),
            "{expression}"
        );

        let config = dc.spec.config.as_ref().unwrap();
        let opaque = config[0].opaque.as_ref().unwrap();
        assert_eq!(opaque.driver, "gpu.kerf.dev");
        let decoded = decode_opaque(&opaque.parameters.0, "parameters").unwrap();
        assert_eq!(decoded, OpaqueConfig::Class(spec.parameters()));
    }

    #[test]
    fn other_owners_do_not_count() {
        let gpu_class = class(GpuClassSpec::default());
        let mut dc = device_class(&gpu_class, "gpu.kerf.dev", "kerf-controller", true).unwrap();
        let mut other = gpu_class.clone();
        other.metadata.uid = Some("uid-2".to_owned());
        assert!(!is_controlled_by(&dc, &other));
        dc.metadata.owner_references = None;
        assert!(!is_controlled_by(&dc, &gpu_class));
    }

    #[test]
    fn identical_classes_need_no_apply() {
        let gpu_class = class(GpuClassSpec::default());
        let desired = device_class(&gpu_class, "gpu.kerf.dev", "kerf-controller", true).unwrap();
        assert!(needs_apply(None, &desired));
        let mut live = desired.clone();
        live.metadata.resource_version = Some("7".to_owned());
        live.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("extra".to_owned(), "x".to_owned());
        assert!(!needs_apply(Some(&live), &desired));
        live.spec.selectors = None;
        assert!(needs_apply(Some(&live), &desired));
        let mut unowned = desired.clone();
        unowned.metadata.owner_references = None;
        assert!(needs_apply(Some(&unowned), &desired));
    }

    #[test]
    fn a_class_not_read_from_the_api_is_refused() {
        let gpu_class = GpuClass::new("fast", GpuClassSpec::default());
        let err = device_class(&gpu_class, "gpu.kerf.dev", "kerf-controller", true).unwrap_err();
        assert_eq!(err.reason(), "missing_field");
    }
}
