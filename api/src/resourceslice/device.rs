//! Building one published device: a whole GPU or an existing MIG device, its attributes and
//! capacities, each checked against the API limits as it is added.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, DeviceCapacity};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_core::inventory::{DeviceRef, Gpu, Inventory};

use super::names::{
    ATTRIBUTES_ADDED_LATER, MAX_ATTRIBUTE_VALUE_LEN, MAX_ATTRIBUTES_AND_CAPACITIES, TYPE_GPU,
    TYPE_MIG, attributes, capacities, is_dns_label, is_qualified_name, pci_bus_id, semver,
};
use crate::error::{Error, Result};
use crate::quantity::bytes_quantity;

pub(super) fn publish_device(device: DeviceRef<'_>, inventory: &Inventory) -> Result<Device> {
    let name = device.name();
    let at = format!("devices[{name:?}]");
    if !is_dns_label(&name) {
        return Err(Error::slice(
            at,
            "device name is not a DNS label of at most 63 characters",
        ));
    }
    let mut attributes = Attributes::new(&at);
    common_attributes(
        &mut attributes,
        device.gpu(),
        Some(device.uuid()),
        inventory,
    )?;
    match device {
        DeviceRef::Gpu(gpu) => {
            attributes.string(attributes::TYPE, TYPE_GPU)?;
            attributes.int(attributes::INDEX, gpu.index);
            attributes.int(attributes::MINOR, gpu.minor);
            let bus_id = pci_bus_id(&gpu.pci_bus_id).ok_or_else(|| {
                Error::slice(
                    format!("{at}.attributes[{:?}]", attributes::PCI_BUS_ID),
                    format!(
                        "{:?} is not a PCI address in domain:bus:device.function form",
                        gpu.pci_bus_id
                    ),
                )
            })?;
            attributes.string(attributes::PCI_BUS_ID, &bus_id)?;
        }
        DeviceRef::Mig { parent, mig } => {
            attributes.string(attributes::TYPE, TYPE_MIG)?;
            attributes.string(attributes::PROFILE, &mig.profile)?;
            attributes.string(attributes::PARENT_UUID, &parent.uuid)?;
            attributes.int(attributes::PARENT_MINOR, parent.minor);
            attributes.int(attributes::PLACEMENT_START, mig.placement.start);
            attributes.int(attributes::PLACEMENT_SIZE, mig.placement.size);
        }
    }
    let (memory, multiprocessors) = match device {
        DeviceRef::Gpu(gpu) => (gpu.memory_bytes, gpu.multiprocessors),
        DeviceRef::Mig { mig, .. } => (mig.memory_bytes, mig.multiprocessors),
    };
    let capacity = BTreeMap::from([
        (
            capacities::MEMORY.to_owned(),
            capacity(bytes_quantity(memory)),
        ),
        (
            capacities::MULTIPROCESSORS.to_owned(),
            capacity(Quantity(multiprocessors.to_string())),
        ),
    ]);
    check_names_and_count(&at, &attributes.map, &capacity)?;
    Ok(Device {
        name,
        attributes: Some(attributes.map),
        capacity: Some(capacity),
        ..Device::default()
    })
}

/// The attributes every device of `gpu` has; `uuid` is absent for a placement not yet created.
pub(super) fn common_attributes(
    attributes: &mut Attributes<'_>,
    gpu: &Gpu,
    uuid: Option<&str>,
    inventory: &Inventory,
) -> Result<()> {
    if let Some(uuid) = uuid {
        attributes.string(attributes::UUID, uuid)?;
    }
    attributes.string(attributes::PRODUCT_NAME, &gpu.product_name)?;
    attributes.string(attributes::BRAND, &gpu.brand)?;
    attributes.string(attributes::ARCHITECTURE, &gpu.architecture)?;
    let capability = gpu.compute_capability;
    attributes.version(
        attributes::CUDA_COMPUTE_CAPABILITY,
        &format!("{}.{}", capability.major, capability.minor),
    )?;
    attributes.version(attributes::DRIVER_VERSION, &inventory.driver_version)?;
    if let Some(cuda) = &inventory.cuda_driver_version {
        attributes.version(attributes::CUDA_DRIVER_VERSION, cuda)?;
    }
    if let Some(domain) = &gpu.nvlink_domain {
        attributes.string(attributes::NVLINK_DOMAIN, domain)?;
    }
    if let Some(numa) = gpu.numa_node {
        attributes.int(attributes::NUMA_NODE, numa);
    }
    if let Some(root) = &gpu.pcie_root {
        attributes.string(attributes::PCIE_ROOT, root)?;
    }
    Ok(())
}

pub(super) fn capacity(value: Quantity) -> DeviceCapacity {
    DeviceCapacity {
        value,
        request_policy: None,
    }
}

pub(super) fn check_names_and_count(
    at: &str,
    attributes: &BTreeMap<String, DeviceAttribute>,
    capacity: &BTreeMap<String, DeviceCapacity>,
) -> Result<()> {
    if let Some(bad) = attributes
        .keys()
        .chain(capacity.keys())
        .find(|name| !is_qualified_name(name))
    {
        return Err(Error::slice(
            at,
            format!("{bad:?} is not a valid attribute or capacity name"),
        ));
    }
    // + the allocator attribute, added after building (see ATTRIBUTES_ADDED_LATER).
    let total = attributes.len() + capacity.len() + ATTRIBUTES_ADDED_LATER;
    if total > MAX_ATTRIBUTES_AND_CAPACITIES {
        return Err(Error::slice(
            at,
            format!(
                "{total} attributes and capacities (with the allocator attribute added later); the API allows at most {MAX_ATTRIBUTES_AND_CAPACITIES}"
            ),
        ));
    }
    Ok(())
}

/// A device's attributes under construction; every value is checked as it is added.
pub(super) struct Attributes<'a> {
    at: &'a str,
    pub(super) map: BTreeMap<String, DeviceAttribute>,
}

impl<'a> Attributes<'a> {
    /// No attributes yet, for the device named in `at`.
    pub(super) fn new(at: &'a str) -> Self {
        Self {
            at,
            map: BTreeMap::new(),
        }
    }

    pub(super) fn string(&mut self, name: &str, value: &str) -> Result<()> {
        self.check_length(name, value)?;
        if value.is_empty() {
            return Err(Error::slice(self.field(name), "is empty"));
        }
        self.insert(
            name,
            DeviceAttribute {
                string: Some(value.to_owned()),
                ..DeviceAttribute::default()
            },
        );
        Ok(())
    }

    pub(super) fn version(&mut self, name: &str, value: &str) -> Result<()> {
        let version = semver(value).ok_or_else(|| {
            Error::slice(
                self.field(name),
                format!("{value:?} cannot be written as a semantic version"),
            )
        })?;
        self.check_length(name, &version)?;
        self.insert(
            name,
            DeviceAttribute {
                version: Some(version),
                ..DeviceAttribute::default()
            },
        );
        Ok(())
    }

    pub(super) fn int(&mut self, name: &str, value: u32) {
        self.insert(
            name,
            DeviceAttribute {
                int: Some(i64::from(value)),
                ..DeviceAttribute::default()
            },
        );
    }

    fn insert(&mut self, name: &str, value: DeviceAttribute) {
        self.map.insert(name.to_owned(), value);
    }

    fn check_length(&self, name: &str, value: &str) -> Result<()> {
        if value.len() > MAX_ATTRIBUTE_VALUE_LEN {
            return Err(Error::slice(
                self.field(name),
                format!(
                    "{value:?} is {} bytes; the API allows at most {MAX_ATTRIBUTE_VALUE_LEN}",
                    value.len()
                ),
            ));
        }
        Ok(())
    }

    fn field(&self, name: &str) -> String {
        format!("{}.attributes[{name:?}]", self.at)
    }
}
