//! The cached form of kerf's ResourceSlices: every attribute and capacity of every device,
//! held flat.
//!
//! k8s-openapi keeps a device's attributes and capacities in `BTreeMap`s whose nodes hold
//! eleven entries each (about 7.7 KB per kerf device, 62 KB per 8-GPU slice); at 500 nodes the
//! cached slices were 31 MB of the leader's 44 MB live heap. A [`CompactResourceSlice`] keeps each
//! device's attributes and capacities as one sorted array each, sharing what devices have in
//! common through an [`Interner`]: one `Arc<str>` per distinct name, one `Arc` per distinct
//! attribute value (product name, driver version, architecture, type and the like are the
//! same on every GPU of a model; UUIDs and bus IDs stay per device). Nothing is dropped: a
//! class selector may read any attribute, so the readers see exactly what was published,
//! through [`DeviceFields`] and [`ResourceSliceFields`] like any other ResourceSlice.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool, ResourceSlice,
};
use kerf_api::resourceslice::{DeviceFields, ResourceSliceFields};
use kube::runtime::reflector::Lookup;

/// A ResourceSlice as the controller's cache keeps it: identity, pool, node and devices.
#[derive(Debug, Clone, PartialEq)]
pub struct CompactResourceSlice {
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
    attributes: Box<[(Arc<str>, Arc<DeviceAttribute>)]>,
    capacity: Box<[(Arc<str>, DeviceCapacity)]>,
    allows_multiple_allocations: bool,
    consumes_counters: bool,
    taints: Box<[DeviceTaint]>,
}

impl CompactResourceSlice {
    /// The slice's `metadata.uid`.
    pub fn uid(&self) -> Option<&str> {
        self.uid.as_deref()
    }

    /// The slice's `metadata.resourceVersion`.
    pub fn resource_version(&self) -> Option<&str> {
        self.resource_version.as_deref()
    }

    /// Compacts `slice`, sharing names and attribute values through `interner`.
    pub fn new(slice: ResourceSlice, interner: &mut Interner) -> Self {
        let spec = slice.spec;
        let compact = CompactResourceSlice {
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
                .map(|device| CompactDevice::new(device, interner))
                .collect(),
            has_shared_counters: spec.shared_counters.is_some(),
        };
        interner.prune();
        compact
    }
}

impl From<ResourceSlice> for CompactResourceSlice {
    fn from(slice: ResourceSlice) -> Self {
        CompactResourceSlice::new(slice, &mut Interner::default())
    }
}

impl CompactDevice {
    fn new(device: Device, interner: &mut Interner) -> Self {
        CompactDevice {
            allows_multiple_allocations: device.allows_multiple_allocations(),
            consumes_counters: DeviceFields::consumes_counters(&device),
            name: device.name,
            attributes: interner.attributes(device.attributes),
            capacity: interner.entries(device.capacity),
            taints: device.taints.unwrap_or_default().into_boxed_slice(),
        }
    }
}

/// The attribute and capacity names and attribute values seen so far, so that equal ones
/// share one allocation. Names are bounded by what drivers publish (kerf: about twenty) and
/// kept; values no cached slice holds any more (a replaced GPU's UUID) are dropped once the set
/// has doubled since it was last pruned, so it stays within twice what the cache holds.
#[derive(Debug, Default)]
pub struct Interner {
    names: HashSet<Arc<str>>,
    values: HashSet<Value>,
    pruned_at: usize,
}

/// An attribute value compared and hashed by its fields (k8s-openapi's type implements
/// neither `Eq` nor `Hash`).
#[derive(Debug)]
struct Value(Arc<DeviceAttribute>);

impl PartialEq for Value {
    fn eq(&self, other: &Self) -> bool {
        *self.0 == *other.0
    }
}

impl Eq for Value {}

impl Hash for Value {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let DeviceAttribute {
            bool,
            int,
            string,
            version,
        } = &*self.0;
        (bool, int, string, version).hash(state);
    }
}

/// Values are not pruned below this many: pruning a small set saves nothing.
const PRUNE_FLOOR: usize = 1024;

impl Interner {
    fn name(&mut self, name: &str) -> Arc<str> {
        if let Some(known) = self.names.get(name) {
            return Arc::clone(known);
        }
        let name: Arc<str> = Arc::from(name);
        self.names.insert(Arc::clone(&name));
        name
    }

    fn value(&mut self, value: DeviceAttribute) -> Arc<DeviceAttribute> {
        let value = Value(Arc::new(value));
        if let Some(known) = self.values.get(&value) {
            return Arc::clone(&known.0);
        }
        let shared = Arc::clone(&value.0);
        self.values.insert(value);
        shared
    }

    /// Drops the values only this interner holds, when the set has doubled since the last
    /// prune.
    fn prune(&mut self) {
        if self.values.len() > 2 * self.pruned_at.max(PRUNE_FLOOR) {
            self.values.retain(|value| Arc::strong_count(&value.0) > 1);
            self.pruned_at = self.values.len();
        }
    }

    /// Attributes in their (sorted) order, names and values shared.
    fn attributes(
        &mut self,
        map: Option<BTreeMap<String, DeviceAttribute>>,
    ) -> Box<[(Arc<str>, Arc<DeviceAttribute>)]> {
        map.unwrap_or_default()
            .into_iter()
            .map(|(key, value)| (self.name(&key), self.value(value)))
            .collect()
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
        lookup(&self.attributes, key).map(|value| &**value)
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

impl ResourceSliceFields for CompactResourceSlice {
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
impl Lookup for CompactResourceSlice {
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
        let mut interner = Interner::default();
        for slice in published() {
            let compact = CompactResourceSlice::new(slice.clone(), &mut interner);
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
        let compact: Vec<CompactResourceSlice> = full
            .iter()
            .cloned()
            .map(CompactResourceSlice::from)
            .collect();
        assert_eq!(
            kerf_api::inventory_view(&compact, DRIVER),
            kerf_api::inventory_view(&full, DRIVER)
        );
    }

    fn value<'a>(device: &'a CompactDevice, name: &str) -> &'a Arc<DeviceAttribute> {
        let at = device
            .attributes
            .iter()
            .position(|(key, _)| &**key == name)
            .unwrap();
        &device.attributes[at].1
    }

    #[test]
    fn names_and_equal_values_are_shared_between_devices() {
        let mut interner = Interner::default();
        let slices: Vec<CompactResourceSlice> = published()
            .into_iter()
            .map(|s| CompactResourceSlice::new(s, &mut interner))
            .collect();
        let devices: Vec<&CompactDevice> = slices
            .iter()
            .flat_map(ResourceSliceFields::devices)
            .collect();
        let (first, second) = (devices[0], devices[1]);
        let name = &first.attributes[0].0;
        assert!(
            Arc::ptr_eq(name, &second.attributes[0].0),
            "{name} is stored once"
        );
        let product = attributes::PRODUCT_NAME;
        assert!(Arc::ptr_eq(value(first, product), value(second, product)));
        let uuid = attributes::UUID;
        assert!(!Arc::ptr_eq(value(first, uuid), value(second, uuid)));
    }

    /// Fails when values of slices gone stay in the interner for ever.
    #[test]
    fn values_no_slice_holds_are_pruned() {
        let mut interner = Interner::default();
        let uuid = |i: usize| DeviceAttribute {
            string: Some(format!("GPU-{i}")),
            ..DeviceAttribute::default()
        };
        let kept: Vec<Arc<DeviceAttribute>> = (0..10).map(|i| interner.value(uuid(i))).collect();
        for i in 10..5000 {
            drop(interner.value(uuid(i)));
            interner.prune();
        }
        assert!(
            interner.values.len() <= 2 * PRUNE_FLOOR + 1,
            "{} values held",
            interner.values.len()
        );
        for (i, value) in kept.iter().enumerate() {
            assert!(Arc::ptr_eq(value, &interner.value(uuid(i))), "GPU-{i} kept");
        }
    }
}
