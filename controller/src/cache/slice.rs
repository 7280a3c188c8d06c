//! The cached form of kerf's ResourceSlices: every attribute and capacity of every device,
//! held flat.
//!
//! k8s-openapi keeps a device's attributes and capacities in `BTreeMap`s whose nodes hold
//! eleven entries each (about 7.7 KB per kerf device, 62 KB per 8-GPU slice); at 500 nodes the
//! cached slices were 31 MB of the leader's 44 MB live heap. A [`CompactSlice`] keeps each
//! device's attributes and capacities as one sorted array each, with the names shared between
//! devices (one `Arc<str>` per distinct name), about a third of the size. Nothing is dropped:
//! a class selector may read any attribute, so the readers see exactly what was published,
//! through [`DeviceFields`] and [`SliceFields`] like any other ResourceSlice.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool, ResourceSlice,
};
use kerf_api::resourceslice::{DeviceFields, SliceFields};
use kube::runtime::reflector::Lookup;

/// A ResourceSlice as the controller's cache keeps it: identity, pool, node and devices.
#[derive(Debug, Clone, PartialEq)]
pub struct CompactSlice {
    name: String,
    uid: Option<String>,
    resource_version: Option<String>,
    driver: String,
    pool: ResourcePool,
    node_name: Option<String>,
    devices: Box<[CompactDevice]>,
    has_shared_counters: bool,
}

/// A published device with its attributes and capacities in sorted arrays.
#[derive(Debug, Clone, PartialEq)]
pub struct CompactDevice {
    name: String,
    attributes: Box<[(Arc<str>, DeviceAttribute)]>,
    capacity: Box<[(Arc<str>, DeviceCapacity)]>,
    allows_multiple_allocations: bool,
    consumes_counters: bool,
    taints: Box<[DeviceTaint]>,
}

impl CompactSlice {
    /// The slice's `metadata.uid`.
    pub fn uid(&self) -> Option<&str> {
        self.uid.as_deref()
    }

    /// The slice's `metadata.resourceVersion`.
    pub fn resource_version(&self) -> Option<&str> {
        self.resource_version.as_deref()
    }

    /// Compacts `slice`, sharing attribute and capacity names through `names`.
    pub fn new(slice: ResourceSlice, names: &mut Names) -> Self {
        let spec = slice.spec;
        CompactSlice {
            name: slice.metadata.name.unwrap_or_default(),
            uid: slice.metadata.uid,
            resource_version: slice.metadata.resource_version,
            driver: spec.driver,
            pool: spec.pool,
            node_name: spec.node_name,
            devices: spec
                .devices
                .unwrap_or_default()
                .into_iter()
                .map(|device| CompactDevice::new(device, names))
                .collect(),
            has_shared_counters: spec.shared_counters.is_some(),
        }
    }
}

impl From<ResourceSlice> for CompactSlice {
    fn from(slice: ResourceSlice) -> Self {
        CompactSlice::new(slice, &mut Names::default())
    }
}

impl CompactDevice {
    fn new(device: Device, names: &mut Names) -> Self {
        CompactDevice {
            allows_multiple_allocations: device.allows_multiple_allocations(),
            consumes_counters: DeviceFields::consumes_counters(&device),
            name: device.name,
            attributes: names.entries(device.attributes),
            capacity: names.entries(device.capacity),
            taints: device.taints.unwrap_or_default().into_boxed_slice(),
        }
    }
}

/// The attribute and capacity names seen so far, so that equal names share one allocation.
/// Their number is bounded by what drivers publish (kerf: about twenty).
#[derive(Debug, Default)]
pub struct Names(HashSet<Arc<str>>);

impl Names {
    fn name(&mut self, name: &str) -> Arc<str> {
        if let Some(known) = self.0.get(name) {
            return Arc::clone(known);
        }
        let name: Arc<str> = Arc::from(name);
        self.0.insert(Arc::clone(&name));
        name
    }

    /// A map's entries in its (sorted) order, the keys shared.
    fn entries<V>(&mut self, map: Option<BTreeMap<String, V>>) -> Box<[(Arc<str>, V)]> {
        map.unwrap_or_default()
            .into_iter()
            .map(|(key, value)| (self.name(&key), value))
            .collect()
    }
}

fn lookup<'a, V>(entries: &'a [(Arc<str>, V)], key: &str) -> Option<&'a V> {
    entries
        .binary_search_by(|(name, _)| (**name).cmp(key))
        .ok()
        .map(|at| &entries[at].1)
}

impl DeviceFields for CompactDevice {
    fn device_name(&self) -> &str {
        &self.name
    }

    fn attribute(&self, key: &str) -> Option<&DeviceAttribute> {
        lookup(&self.attributes, key)
    }

    fn capacity(&self, key: &str) -> Option<&DeviceCapacity> {
        lookup(&self.capacity, key)
    }

    fn allows_multiple_allocations(&self) -> bool {
        self.allows_multiple_allocations
    }

    fn consumes_counters(&self) -> bool {
        self.consumes_counters
    }

    fn device_taints(&self) -> &[DeviceTaint] {
        &self.taints
    }
}

impl SliceFields for CompactSlice {
    type Device = CompactDevice;

    fn slice_name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &str {
        &self.driver
    }

    fn pool(&self) -> &ResourcePool {
        &self.pool
    }

    fn node_name(&self) -> Option<&str> {
        self.node_name.as_deref()
    }

    fn devices(&self) -> &[CompactDevice] {
        &self.devices
    }

    fn has_shared_counters(&self) -> bool {
        self.has_shared_counters
    }
}

/// Stored in a kube-runtime reflector under the identity of the ResourceSlice it came from.
impl Lookup for CompactSlice {
    type DynamicType = ();

    fn kind(dyntype: &()) -> Cow<'_, str> {
        <ResourceSlice as kube::Resource>::kind(dyntype)
    }

    fn group(dyntype: &()) -> Cow<'_, str> {
        <ResourceSlice as kube::Resource>::group(dyntype)
    }

    fn version(dyntype: &()) -> Cow<'_, str> {
        <ResourceSlice as kube::Resource>::version(dyntype)
    }

    fn plural(dyntype: &()) -> Cow<'_, str> {
        <ResourceSlice as kube::Resource>::plural(dyntype)
    }

    fn name(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(&self.name))
    }

    fn namespace(&self) -> Option<Cow<'_, str>> {
        None
    }

    fn resource_version(&self) -> Option<Cow<'_, str>> {
        self.resource_version.as_deref().map(Cow::Borrowed)
    }

    fn uid(&self) -> Option<Cow<'_, str>> {
        self.uid.as_deref().map(Cow::Borrowed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kerf_api::resourceslice::{attributes, capacities, device_attribute, device_capacity};
    use kerf_core::mock;

    const DRIVER: &str = "gpu.kerf.dev";

    fn published() -> Vec<ResourceSlice> {
        let inventory = mock::from_spec("h100-sxm-80gb:2").unwrap();
        kerf_api::resource_slices(&inventory, DRIVER, "node-a")
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(i, spec)| ResourceSlice {
                metadata: kube::api::ObjectMeta {
                    name: Some(format!("node-a-{i}")),
                    uid: Some(format!("uid-{i}")),
                    resource_version: Some("7".to_owned()),
                    ..Default::default()
                },
                spec,
            })
            .collect()
    }

    #[test]
    fn every_attribute_and_capacity_reads_as_published() {
        let mut names = Names::default();
        for slice in published() {
            let compact = CompactSlice::new(slice.clone(), &mut names);
            assert_eq!(compact.slice_name(), slice.slice_name());
            assert_eq!(compact.pool(), slice.pool());
            assert_eq!(compact.node_name(), slice.node_name());
            assert_eq!(compact.devices().len(), slice.devices().len());
            for (small, full) in compact.devices().iter().zip(slice.devices()) {
                assert_eq!(small.device_name(), full.device_name());
                for (key, value) in full.attributes.iter().flatten() {
                    assert_eq!(small.attribute(key), Some(value), "attribute {key}");
                }
                for (key, value) in full.capacity.iter().flatten() {
                    assert_eq!(small.capacity(key), Some(value), "capacity {key}");
                }
                assert_eq!(small.attribute("absent"), None);
                for name in attributes::ALL {
                    assert_eq!(
                        device_attribute(small, DRIVER, name),
                        device_attribute(full, DRIVER, name)
                    );
                }
                for name in capacities::ALL {
                    assert_eq!(
                        device_capacity(small, DRIVER, name),
                        device_capacity(full, DRIVER, name)
                    );
                }
            }
        }
    }

    #[test]
    fn the_inventory_view_is_the_same_for_both_forms() {
        let full = published();
        let compact: Vec<CompactSlice> = full.iter().cloned().map(CompactSlice::from).collect();
        assert_eq!(
            kerf_api::inventory_view(&compact, DRIVER),
            kerf_api::inventory_view(&full, DRIVER)
        );
    }

    #[test]
    fn names_are_shared_between_devices() {
        let mut names = Names::default();
        let slices: Vec<CompactSlice> = published()
            .into_iter()
            .map(|s| CompactSlice::new(s, &mut names))
            .collect();
        let devices: Vec<&CompactDevice> = slices.iter().flat_map(SliceFields::devices).collect();
        let (first, second) = (&devices[0].attributes[0].0, &devices[1].attributes[0].0);
        assert!(Arc::ptr_eq(first, second), "{first} is stored once");
    }
}
