//! How a GpuQuota sees each of kerf's classes (`kerf_api::gpuquota::QuotaClass`): the
//! DeviceClass's kerf parameters, sized by the GpuClass that controls it. The admission
//! webhook and the recount both price claims through [`quota_class`], so what admission
//! charges and what the recount counts agree.

use k8s_openapi::api::resource::v1::DeviceClass;
use kerf_api::GpuClass;
use kerf_api::controller_claims::class_parameters;
use kerf_api::gpuquota::{DeviceSize, QuotaClass};
use kerf_api::quantity::quantity_bytes;
use kube::runtime::reflector::{ObjectRef, Store};

use crate::deviceclass::is_controlled_by;

/// The quota's view of DeviceClass `name`: `None` when it is not a class of `driver` (claims
/// of it are not charged). The largest device and the number of devices come from the
/// GpuClass of the same name that controls the DeviceClass (its `status.largestDevice` and
/// `status.matchingDevices`); a hand-written DeviceClass, or a GpuClass whose status has no
/// device yet, has no size (`largest: None`), and its whole devices are charged unsized.
pub(crate) fn quota_class(
    device_classes: &Store<DeviceClass>,
    gpu_classes: &Store<GpuClass>,
    driver: &str,
    name: &str,
) -> Option<QuotaClass> {
    let device_class = device_classes.get(&ObjectRef::new(name))?;
    let params = class_parameters(&device_class, driver)?;
    // Only the GpuClass that owns the DeviceClass describes its devices: a GpuClass that
    // happens to share the name of a hand-written DeviceClass selects other devices.
    let status = gpu_classes
        .get(&ObjectRef::new(name))
        .filter(|class| is_controlled_by(&device_class, class))
        .and_then(|class| class.status.clone());
    let largest = status
        .as_ref()
        .and_then(|s| s.largest_device.as_ref())
        .and_then(|size| {
            // A memory the controller wrote is always bytes; anything else sizes nothing,
            // which charges whole devices as unsized (refused where memory is capped).
            let memory_bytes = quantity_bytes(&size.memory).ok()?;
            Some(DeviceSize {
                memory_bytes,
                compute: size.compute,
            })
        });
    let devices = status
        .and_then(|s| s.matching_devices)
        .map_or(0, |n| u64::try_from(n).unwrap_or(0));
    Some(QuotaClass {
        params,
        largest,
        devices,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{
        DeviceClassConfiguration, DeviceClassSpec, OpaqueDeviceConfiguration,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
    use kerf_api::gpuclass::DeviceSizeStatus;
    use kerf_api::params::{Allocator, GpuClassParameters, OpaqueKind as _};
    use kerf_api::{GpuClassSpec, GpuClassStatus};
    use kube::runtime::{reflector, watcher};

    const DRIVER: &str = "gpu.kerf.dev";

    fn device_class(name: &str, driver: &str, owner_uid: Option<&str>) -> DeviceClass {
        let params = GpuClassParameters {
            allocator: Allocator::Scheduler,
            ..GpuClassParameters::default()
        };
        DeviceClass {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                owner_references: owner_uid.map(|uid| {
                    vec![OwnerReference {
                        api_version: "gpu.kerf.dev/v1alpha1".to_owned(),
                        kind: "GpuClass".to_owned(),
                        name: name.to_owned(),
                        uid: uid.to_owned(),
                        controller: Some(true),
                        block_owner_deletion: Some(true),
                    }]
                }),
                ..ObjectMeta::default()
            },
            spec: DeviceClassSpec {
                config: Some(vec![DeviceClassConfiguration {
                    opaque: Some(OpaqueDeviceConfiguration {
                        driver: driver.to_owned(),
                        parameters: params.to_raw_extension().unwrap(),
                    }),
                }]),
                ..DeviceClassSpec::default()
            },
        }
    }

    fn gpu_class(name: &str, uid: &str, memory: &str, devices: i64) -> GpuClass {
        let mut class = GpuClass::new(name, GpuClassSpec::default());
        class.metadata.uid = Some(uid.to_owned());
        class.status = Some(GpuClassStatus {
            matching_devices: Some(devices),
            largest_device: Some(DeviceSizeStatus {
                memory: Quantity(memory.to_owned()),
                compute: 100,
            }),
            ..GpuClassStatus::default()
        });
        class
    }

    fn store<K>(objects: Vec<K>) -> Store<K>
    where
        K: kube::Resource<DynamicType = ()> + Clone + 'static,
    {
        let (store, mut writer) = reflector::store::<K>();
        writer.apply_watcher_event(&watcher::Event::Init);
        for object in objects {
            writer.apply_watcher_event(&watcher::Event::InitApply(object));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        store
    }

    #[test]
    fn a_class_is_sized_by_the_gpu_class_that_controls_it() {
        let devices = store(vec![
            device_class("h100", DRIVER, Some("uid-h100")),
            device_class("hand", DRIVER, None),
            device_class("other", "other.example.com", None),
        ]);
        let gpus = store(vec![
            gpu_class("h100", "uid-h100", "80Gi", 8),
            // Same name as the hand-written DeviceClass, but it does not own it.
            gpu_class("hand", "uid-hand", "40Gi", 2),
        ]);
        let h100 = quota_class(&devices, &gpus, DRIVER, "h100").unwrap();
        assert_eq!(
            h100.largest,
            Some(DeviceSize {
                memory_bytes: 80 << 30,
                compute: 100
            })
        );
        assert_eq!(h100.devices, 8);
        let hand = quota_class(&devices, &gpus, DRIVER, "hand").unwrap();
        assert_eq!((hand.largest, hand.devices), (None, 0));
        assert!(quota_class(&devices, &gpus, DRIVER, "other").is_none());
        assert!(quota_class(&devices, &gpus, DRIVER, "missing").is_none());
    }

    #[test]
    fn a_memory_that_is_not_bytes_sizes_nothing() {
        let devices = store(vec![device_class("h100", DRIVER, Some("uid-h100"))]);
        let gpus = store(vec![gpu_class("h100", "uid-h100", "lots", 8)]);
        let class = quota_class(&devices, &gpus, DRIVER, "h100").unwrap();
        assert_eq!((class.largest, class.devices), (None, 8));
    }
}
