//! One allocator per device: which of kube-scheduler and kerf-controller may allocate each
//! published device (whole GPU or MIG device).
//!
//! The facts flow one way:
//! 1. kerf-controller decides the owner of every device of a node and writes it into the
//!    node's **ownership record**, the Node annotation [`RECORD_ANNOTATION`]
//!    (`{"gpu-0":"controller","gpu-1-mig-…":"scheduler"}`).
//! 2. The node's kubelet plugin publishes each device with the string attribute
//!    [`ATTRIBUTE`] (`allocator`) set to the recorded owner, and without it for devices the
//!    record does not name yet.
//! 3. kube-scheduler sees the attribute through the DeviceClass of every Scheduler GpuClass,
//!    whose selector requires `allocator == "scheduler"` ([`scheduler_guard_cel`]);
//!    kerf-controller places only on devices published with `allocator == "controller"`.
//!
//! A device the record does not name is published without the attribute and is allocated by
//! nobody until the controller names it. An admin pins all devices of a node to one owner with
//! the node label [`NODE_LABEL`] (`scheduler` or `controller`; `dynamic` or no label lets the
//! controller move idle devices by demand).

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, ResourceSliceSpec};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::resourceslice::{DeviceFields, device_attribute};

/// The device attribute (in the driver's domain) naming the device's allocator.
pub const ATTRIBUTE: &str = crate::resourceslice::attributes::ALLOCATOR;
/// The Node annotation holding the node's ownership record, written by kerf-controller.
pub const RECORD_ANNOTATION: &str = "gpu.kerf.dev/allocators";
/// The Node label by which an admin pins the owner of all of a node's devices.
pub const NODE_LABEL: &str = "gpu.kerf.dev/allocator";
/// [`NODE_LABEL`] value that leaves the node's devices to the controller's dynamic policy.
const DYNAMIC: &str = "dynamic";

/// Who may allocate a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Owner {
    /// kube-scheduler, through the DeviceClasses of Scheduler GpuClasses.
    Scheduler,
    /// kerf-controller, for Controller GpuClasses.
    Controller,
}

impl Owner {
    /// The attribute and record value: `scheduler` or `controller`.
    pub fn as_str(self) -> &'static str {
        match self {
            Owner::Scheduler => "scheduler",
            Owner::Controller => "controller",
        }
    }

    /// Parses an attribute or record value.
    pub fn parse(value: &str) -> Option<Owner> {
        match value {
            "scheduler" => Some(Owner::Scheduler),
            "controller" => Some(Owner::Controller),
            _ => None,
        }
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The owner of each device of one node, by published device name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OwnershipRecord(pub BTreeMap<String, Owner>);

impl OwnershipRecord {
    /// Parses the value of [`RECORD_ANNOTATION`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the annotation when the value is not a JSON object of
    /// device names to `"scheduler"` or `"controller"`.
    pub fn parse(value: &str) -> Result<OwnershipRecord> {
        serde_json::from_str(value).map_err(|e| Error::InvalidConfig {
            path: format!("metadata.annotations[{RECORD_ANNOTATION:?}]"),
            message: format!(
                "{e}; expected a JSON object of device names to \"scheduler\" or \"controller\""
            ),
        })
    }

    /// The record of a Node's annotations: empty when the annotation is absent.
    ///
    /// # Errors
    /// See [`OwnershipRecord::parse`].
    pub fn from_annotations(
        annotations: Option<&BTreeMap<String, String>>,
    ) -> Result<OwnershipRecord> {
        match annotations.and_then(|a| a.get(RECORD_ANNOTATION)) {
            Some(value) => OwnershipRecord::parse(value),
            None => Ok(OwnershipRecord::default()),
        }
    }

    /// The annotation value (compact JSON, devices in name order).
    pub fn to_annotation(&self) -> String {
        // Serializing a map of strings to a unit enum cannot fail.
        serde_json::to_string(&self.0).unwrap_or_default()
    }

    /// The recorded owner of `device`.
    pub fn owner(&self, device: &str) -> Option<Owner> {
        self.0.get(device).copied()
    }
}

/// How an admin configured a node through [`NODE_LABEL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodePolicy {
    /// The controller moves idle devices between the owners by demand.
    Dynamic,
    /// Every device of the node belongs to this owner.
    Fixed(Owner),
}

/// The policy of a node with `labels`.
///
/// # Errors
/// [`Error::InvalidConfig`] naming the label and its value when it is neither `scheduler`,
/// `controller` nor `dynamic`.
pub fn node_policy(labels: Option<&BTreeMap<String, String>>) -> Result<NodePolicy> {
    match labels.and_then(|l| l.get(NODE_LABEL)).map(String::as_str) {
        None | Some(DYNAMIC) => Ok(NodePolicy::Dynamic),
        Some(value) => Owner::parse(value)
            .map(NodePolicy::Fixed)
            .ok_or_else(|| Error::InvalidConfig {
                path: format!("metadata.labels[{NODE_LABEL:?}]"),
                message: format!(
                    "{value:?} is not an allocator; use \"scheduler\", \"controller\" or \"dynamic\""
                ),
            }),
    }
}

/// The owner a published device carries in its [`ATTRIBUTE`], if any.
pub fn published_owner<D: DeviceFields + ?Sized>(device: &D, driver: &str) -> Option<Owner> {
    match device_attribute(device, driver, ATTRIBUTE) {
        Some(DeviceAttribute {
            string: Some(value),
            ..
        }) => Owner::parse(value),
        _ => None,
    }
}

/// Sets (or, without a recorded owner, removes) the [`ATTRIBUTE`] of `device`.
pub fn set_published_owner(device: &mut Device, owner: Option<Owner>) {
    let attributes = device.attributes.get_or_insert_with(BTreeMap::new);
    match owner {
        Some(owner) => {
            attributes.insert(
                ATTRIBUTE.to_owned(),
                DeviceAttribute {
                    string: Some(owner.as_str().to_owned()),
                    ..DeviceAttribute::default()
                },
            );
        }
        None => {
            attributes.remove(ATTRIBUTE);
        }
    }
}

/// Sets the [`ATTRIBUTE`] of every device in `specs` from `record` (removing it from devices
/// the record does not name): what the kubelet plugin publishes.
///
/// One owner per GPU: a device that consumes a GPU's shared counters (a dynamic-MIG placement,
/// [`crate::resourceslice::dynamic_mig`]) carries its parent GPU's owner, the record's entry
/// for `gpu-<parentMinor>`, whatever the record says of the placement itself; its GPU's full
/// device and the placements are allocated against the same counters, so two owners there
/// would be two allocators on one GPU.
pub fn publish_owners(specs: &mut [ResourceSliceSpec], record: &OwnershipRecord) {
    for spec in specs.iter_mut() {
        let driver = spec.driver.clone();
        for device in spec.devices.iter_mut().flatten() {
            // A placement follows its GPU where the record names the GPU (one allocator per
            // GPU); kerf-controller records placements under their own names, since a
            // dynamic-MIG GPU publishes no whole-GPU device.
            let owner = placement_parent(device, &driver)
                .and_then(|parent| record.owner(&parent))
                .or_else(|| record.owner(&device.name));
            set_published_owner(device, owner);
        }
    }
}

/// The device name of the GPU whose counters `device` consumes, when it is a placement
/// (consumes counters and names its parent's minor).
fn placement_parent<D: DeviceFields + ?Sized>(device: &D, driver: &str) -> Option<String> {
    if !device.consumes_counters() {
        return None;
    }
    let minor = device_attribute(
        device,
        driver,
        crate::resourceslice::attributes::PARENT_MINOR,
    )?
    .int?;
    Some(format!("gpu-{minor}"))
}

/// The CEL clause the DeviceClass of every Scheduler GpuClass carries, so that kube-scheduler
/// allocates only devices recorded as the scheduler's. The `in` test comes first because a
/// selector that reads a missing attribute is a runtime error, which fails the whole pod's
/// allocation in kube-scheduler rather than skipping the device.
pub fn scheduler_guard_cel(driver: &str) -> String {
    let domain = serde_json::Value::String(driver.to_owned()).to_string();
    format!(
        "{ATTRIBUTE:?} in device.attributes[{domain}] && device.attributes[{domain}].{ATTRIBUTE} == {:?}",
        Owner::Scheduler.as_str()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_bad_values_name_the_annotation() {
        let record =
            OwnershipRecord::parse(r#"{"gpu-1":"scheduler","gpu-0":"controller"}"#).unwrap();
        assert_eq!(record.owner("gpu-0"), Some(Owner::Controller));
        assert_eq!(record.owner("gpu-2"), None);
        assert_eq!(
            record.to_annotation(),
            r#"{"gpu-0":"controller","gpu-1":"scheduler"}"#
        );
        let err = OwnershipRecord::parse(r#"{"gpu-0":"kubelet"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains(RECORD_ANNOTATION), "{err}");
        assert!(
            OwnershipRecord::from_annotations(None)
                .unwrap()
                .0
                .is_empty()
        );
    }

    #[test]
    fn node_label_pins_or_leaves_dynamic() {
        let labels = |v: &str| BTreeMap::from([(NODE_LABEL.to_owned(), v.to_owned())]);
        assert_eq!(node_policy(None).unwrap(), NodePolicy::Dynamic);
        assert_eq!(
            node_policy(Some(&labels("dynamic"))).unwrap(),
            NodePolicy::Dynamic
        );
        assert_eq!(
            node_policy(Some(&labels("scheduler"))).unwrap(),
            NodePolicy::Fixed(Owner::Scheduler)
        );
        let err = node_policy(Some(&labels("both"))).unwrap_err().to_string();
        assert!(
            err.contains("\"both\"") && err.contains(NODE_LABEL),
            "{err}"
        );
    }

    #[test]
    fn the_attribute_is_set_read_and_removed() {
        let mut device = Device {
            name: "gpu-0".to_owned(),
            ..Device::default()
        };
        assert_eq!(published_owner(&device, "gpu.kerf.dev"), None);
        set_published_owner(&mut device, Some(Owner::Controller));
        assert_eq!(
            published_owner(&device, "gpu.kerf.dev"),
            Some(Owner::Controller)
        );
        set_published_owner(&mut device, None);
        assert_eq!(published_owner(&device, "gpu.kerf.dev"), None);
    }

    #[test]
    fn the_guard_tests_presence_before_reading() {
        assert_eq!(
            scheduler_guard_cel("gpu.kerf.dev"),
            r#""allocator" in device.attributes["gpu.kerf.dev"] && device.attributes["gpu.kerf.dev"].allocator == "scheduler""#
        );
    }
}
