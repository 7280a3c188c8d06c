//! `kerf inventory`: the ResourceSlices the kubelet plugin would publish for this node.
//!
//! Without [`Features`] it prints today's publication (whole GPUs and static MIG devices, no
//! owners). With the Kubernetes 1.36 features it prints what the plugin publishes when they
//! are in use:
//!
//! - consumable capacity (`DRAConsumableCapacity`): every whole GPU as a scheduler slice, as
//!   when kerf-controller records the GPU as the scheduler's and names it in the Node's shared
//!   publication ([`kerf_api::shared_publication`]); the plugin then sets the `allocator`
//!   attribute ([`kerf_api::ownership::publish_owners`]) and makes the GPU shareable
//!   ([`kerf_api::resourceslice::scheduler_slices::publish_shared`]);
//! - partitionable devices (`DRAPartitionableDevices`): dynamic-MIG GPUs as counter sets and
//!   one device per MIG placement ([`kerf_api::resourceslice::dynamic_mig`]), recorded as the
//!   scheduler's as kerf-controller records them.
//!
//! Every slice and the pool are checked against the API limits ([`limits::check_slice`],
//! [`limits::check_pool`]) as the plugin does before it publishes.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kerf_api::ownership::{Owner, OwnershipRecord, publish_owners};
use kerf_api::resourceslice::scheduler_slices::publish_shared;
use kerf_api::resourceslice::{ResourceSliceFeatures, TYPE_GPU, attributes, limits, node_slices};
use kerf_api::shared_publication::{SharedPublication, SharedSlicing};
use kerf_core::inventory::Inventory;

use crate::error::Result;

/// The memory granularity of scheduler slices when none is given: 1Gi.
pub const DEFAULT_MEMORY_GRANULARITY_BYTES: u64 = 1 << 30;

/// The Kubernetes 1.36 features `kerf inventory` publishes with; all off by default, which
/// is the publication of a cluster without them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Features {
    /// Publish every whole GPU as shareable with this slicing (scheduler slices).
    pub consumable_capacity: Option<SharedSlicing>,
    /// Publish dynamic-MIG GPUs as counter sets and MIG placements.
    pub partitionable_devices: bool,
}

impl Features {
    /// Whether any feature is on.
    pub fn any(&self) -> bool {
        self.consumable_capacity.is_some() || self.partitionable_devices
    }
}

/// The slicing of scheduler slices when the admin names none: 1Gi memory granularity,
/// compute 100 for a share that asks for memory only, no most shares per GPU, MPS.
pub fn default_slicing() -> SharedSlicing {
    SharedSlicing {
        memory_granularity_bytes: DEFAULT_MEMORY_GRANULARITY_BYTES,
        default_compute_percent: None,
        max_slices_per_gpu: None,
        sharing: None,
    }
}

/// Builds the ResourceSlice objects the plugin publishes for `inventory` on `node_name`.
///
/// # Errors
/// The inventory breaks a ResourceSlice limit or a name is invalid.
pub fn resource_slices(
    inventory: &Inventory,
    driver: &str,
    node_name: &str,
) -> Result<Vec<ResourceSlice>, kerf_api::Error> {
    let specs = kerf_api::resource_slices(inventory, driver, node_name)?;
    Ok(named(specs, driver, node_name))
}

/// Builds the ResourceSlice objects the plugin publishes for `inventory` on `node_name` with
/// `features` in use; with no feature, the same as [`resource_slices`].
///
/// The pool comes from [`kerf_api::resourceslice::node_slices`]; the GPUs a feature applies to
/// are recorded as the scheduler's (the one-allocator rule gives both kinds to kube-scheduler),
/// so they and their placements carry `allocator: scheduler`.
///
/// # Errors
///
/// [`Error::Api`] when the inventory breaks a ResourceSlice limit or a name is invalid, when a
/// whole GPU cannot be published shareable with the slicing (the error names the device and
/// the capacity), or when a slice or the pool breaks an API limit ([`limits::check_slice`],
/// [`limits::check_pool`]).
pub fn published_slices(
    inventory: &Inventory,
    driver: &str,
    node_name: &str,
    features: &Features,
) -> Result<Vec<ResourceSlice>> {
    let slice_features = ResourceSliceFeatures {
        device_taints: false,
        partitionable_devices: features.partitionable_devices,
    };
    let mut specs = node_slices(inventory, driver, node_name, slice_features)?;
    if features.any() {
        let mut record = OwnershipRecord::default();
        if features.partitionable_devices {
            // kerf-controller records every placement (a device consuming counters) as the
            // scheduler's under its own name: MIG devices are always kube-scheduler's.
            for placement in specs
                .iter()
                .flat_map(|s| s.devices.iter().flatten())
                .filter(|d| d.consumes_counters.is_some())
            {
                record.0.insert(placement.name.clone(), Owner::Scheduler);
            }
        }
        if let Some(slicing) = &features.consumable_capacity {
            slicing.validate("consumable capacity")?;
            let in_mig_mode: BTreeSet<String> = inventory
                .gpus
                .iter()
                .filter(|g| g.mig_enabled)
                .map(|g| format!("gpu-{}", g.minor))
                .collect();
            share_whole_gpus(&mut specs, &mut record, slicing, &in_mig_mode)?;
        }
        publish_owners(&mut specs, &record);
    }
    for (index, spec) in specs.iter().enumerate() {
        limits::check_slice(spec).map_err(|e| {
            kerf_api::Error::slice(
                kerf_api::slice_name(node_name, driver, index),
                e.to_string(),
            )
        })?;
    }
    limits::check_pool(&specs)?;
    Ok(named(specs, driver, node_name))
}

/// The devices of `specs` that are whole GPUs (`type: gpu`).
fn whole_gpus(specs: &[ResourceSliceSpec]) -> impl Iterator<Item = &Device> {
    specs
        .iter()
        .flat_map(|s| s.devices.iter().flatten())
        .filter(|d| {
            d.attributes
                .as_ref()
                .and_then(|a| a.get(attributes::TYPE))
                .and_then(|t| t.string.as_deref())
                == Some(TYPE_GPU)
        })
}

/// Records every whole GPU outside MIG mode as the scheduler's and names it in a shared
/// publication with `slicing`, as kerf-controller does for GPUs a sliced Scheduler GpuClass
/// selects, then makes them shareable as the plugin does. A GPU in MIG mode (`in_mig_mode`,
/// by device name) runs no process on the whole GPU, so it holds no shares.
fn share_whole_gpus(
    specs: &mut [ResourceSliceSpec],
    record: &mut OwnershipRecord,
    slicing: &SharedSlicing,
    in_mig_mode: &BTreeSet<String>,
) -> Result<()> {
    let gpus: Vec<String> = whole_gpus(specs)
        .filter(|d| d.consumes_counters.is_none() && !in_mig_mode.contains(&d.name))
        .map(|d| d.name.clone())
        .collect();
    for name in &gpus {
        record.0.insert(name.clone(), Owner::Scheduler);
    }
    let publication = SharedPublication(
        gpus.into_iter()
            .map(|name| (name, slicing.clone()))
            .collect::<BTreeMap<_, _>>(),
    );
    // The plugin logs these and publishes the GPU whole; asked for shares, a GPU that cannot
    // hold them is an error here.
    match publish_shared(specs, record, &publication)
        .into_iter()
        .next()
    {
        Some(error) => Err(error.into()),
        None => Ok(()),
    }
}

fn named(specs: Vec<ResourceSliceSpec>, driver: &str, node_name: &str) -> Vec<ResourceSlice> {
    specs
        .into_iter()
        .enumerate()
        .map(|(index, spec)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(kerf_api::slice_name(node_name, driver, index)),
                ..ObjectMeta::default()
            },
            spec,
        })
        .collect()
}

/// Renders slices as a multi-document YAML stream (k8s-openapi writes `apiVersion` and
/// `kind`), so the output can be fed to `kubectl apply --dry-run=server`.
///
/// # Errors
/// Serialization fails.
pub fn to_yaml(slices: &[ResourceSlice]) -> Result<String, serde_saphyr::ser::Error> {
    let mut out = String::new();
    for slice in slices {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(slice)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h100_profile_is_one_slice_of_eight_gpus() {
        let inventory = kerf_core::mock::from_spec("h100-sxm-80gb").unwrap();
        let slices = resource_slices(&inventory, "gpu.kerf.dev", "node-1").unwrap();
        assert_eq!(slices.len(), 1);
        let names: Vec<&str> = slices[0]
            .spec
            .devices
            .as_ref()
            .unwrap()
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(
            names,
            [
                "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7"
            ]
        );
        let yaml = to_yaml(&slices).unwrap();
        assert!(yaml.contains("kind: ResourceSlice"), "{yaml}");
        assert!(yaml.contains("nodeName: node-1"), "{yaml}");
    }

    #[test]
    fn without_features_the_publication_is_unchanged() {
        let inventory = kerf_core::mock::from_spec("a100-40gb-mig").unwrap();
        let plain = resource_slices(&inventory, "gpu.kerf.dev", "node-1").unwrap();
        let published =
            published_slices(&inventory, "gpu.kerf.dev", "node-1", &Features::default()).unwrap();
        assert_eq!(plain, published);
    }
}
