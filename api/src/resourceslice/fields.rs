//! Read access to published ResourceSlices and their devices, whatever holds them.
//!
//! kerf reads published devices in two shapes: k8s-openapi's `ResourceSlice` (the kubelet
//! plugin, `kerf status`, tests) and kerf-controller's compact cached copy, which keeps every
//! attribute and capacity in a few flat allocations instead of k8s-openapi's `BTreeMap`s (the
//! maps cost about 7.7 KB per device: at 500 nodes of 8 GPUs they were most of the leader's
//! heap). The readers of published devices take these traits, so both shapes share one
//! reading of every attribute.

use std::sync::Arc;

use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool, ResourceSlice,
};

/// What kerf reads of a published device.
pub trait DeviceFields {
    /// The device's name, unique in its pool.
    fn device_name(&self) -> &str;
    /// The attribute published under exactly `key` (qualified or not, as published).
    fn attribute(&self, key: &str) -> Option<&DeviceAttribute>;
    /// The capacity published under exactly `key`.
    fn capacity(&self, key: &str) -> Option<&DeviceCapacity>;
    /// `allowMultipleAllocations`: the device is shareable (scheduler slices).
    fn allows_multiple_allocations(&self) -> bool;
    /// Whether the device consumes shared counters (a dynamic-MIG placement or its GPU's full
    /// device).
    fn consumes_counters(&self) -> bool;
    /// The device's taints.
    fn device_taints(&self) -> &[DeviceTaint];
}

impl DeviceFields for Device {
    fn device_name(&self) -> &str {
        &self.name
    }

    fn attribute(&self, key: &str) -> Option<&DeviceAttribute> {
        self.attributes.as_ref()?.get(key)
    }

    fn capacity(&self, key: &str) -> Option<&DeviceCapacity> {
        self.capacity.as_ref()?.get(key)
    }

    fn allows_multiple_allocations(&self) -> bool {
        self.allow_multiple_allocations == Some(true)
    }

    fn consumes_counters(&self) -> bool {
        self.consumes_counters
            .as_ref()
            .is_some_and(|c| !c.is_empty())
    }

    fn device_taints(&self) -> &[DeviceTaint] {
        self.taints.as_deref().unwrap_or_default()
    }
}

impl<D: DeviceFields + ?Sized> DeviceFields for &D {
    fn device_name(&self) -> &str {
        (**self).device_name()
    }

    fn attribute(&self, key: &str) -> Option<&DeviceAttribute> {
        (**self).attribute(key)
    }

    fn capacity(&self, key: &str) -> Option<&DeviceCapacity> {
        (**self).capacity(key)
    }

    fn allows_multiple_allocations(&self) -> bool {
        (**self).allows_multiple_allocations()
    }

    fn consumes_counters(&self) -> bool {
        (**self).consumes_counters()
    }

    fn device_taints(&self) -> &[DeviceTaint] {
        (**self).device_taints()
    }
}

/// What kerf reads of a published ResourceSlice.
pub trait ResourceSliceFields {
    /// The type of its devices.
    type Device: DeviceFields;
    /// The slice's object name (empty when unnamed).
    fn slice_name(&self) -> &str;
    /// `spec.driver`.
    fn driver(&self) -> &str;
    /// `spec.pool`.
    fn pool(&self) -> &ResourcePool;
    /// `spec.nodeName`.
    fn node_name(&self) -> Option<&str>;
    /// `spec.devices`.
    fn devices(&self) -> &[Self::Device];
    /// Whether the slice publishes `sharedCounters` (a dynamic-MIG counters slice).
    fn has_shared_counters(&self) -> bool;
}

impl ResourceSliceFields for ResourceSlice {
    type Device = Device;

    fn slice_name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }

    fn driver(&self) -> &str {
        &self.spec.driver
    }

    fn pool(&self) -> &ResourcePool {
        &self.spec.pool
    }

    fn node_name(&self) -> Option<&str> {
        self.spec.node_name.as_deref()
    }

    fn devices(&self) -> &[Device] {
        self.spec.devices.as_deref().unwrap_or_default()
    }

    fn has_shared_counters(&self) -> bool {
        self.spec.shared_counters.is_some()
    }
}

macro_rules! slice_fields_through {
    ($($wrapper:ty),*) => {$(
        impl<S: ResourceSliceFields + ?Sized> ResourceSliceFields for $wrapper {
            type Device = S::Device;

            fn slice_name(&self) -> &str {
                (**self).slice_name()
            }

            fn driver(&self) -> &str {
                (**self).driver()
            }

            fn pool(&self) -> &ResourcePool {
                (**self).pool()
            }

            fn node_name(&self) -> Option<&str> {
                (**self).node_name()
            }

            fn devices(&self) -> &[Self::Device] {
                (**self).devices()
            }

            fn has_shared_counters(&self) -> bool {
                (**self).has_shared_counters()
            }
        }
    )*};
}

slice_fields_through!(&S, Arc<S>);
