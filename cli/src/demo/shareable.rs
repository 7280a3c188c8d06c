//! Scheduler slices in the demo: the GPUs published shareable (Kubernetes 1.36,
//! `DRAConsumableCapacity`) and the node made for them, `demo-nvl-node` (mock profile
//! `h100-nvl`: the H100 NVL that `examples/admin/scheduler-slices.yaml` selects), with its own
//! kubelet plugin.
//!
//! The main node's and this node's ResourceSlices are published the way the cluster publishes
//! them (`publish`; the dynamic-MIG node's GPUs are in MIG mode, never shareable):
//! - kerf-controller decides: its ownership record gives every GPU to the scheduler while
//!   nothing is allocated ([`super::scheduler::owners`]), and the GPUs that the sliced
//!   Scheduler classes select alike make up the Node's shared publication
//!   ([`kerf_controller::node_shares`], what its ownership tick writes to the Node);
//! - the plugin's publisher honours it: a GPU the publication names and the record gives the
//!   scheduler becomes shareable
//!   ([`kerf_api::resourceslice::scheduler_slices::publish_shared`]) and every device carries
//!   its owner ([`kerf_api::ownership::publish_owners`]).
//!
//! kube-scheduler's allocator (the stand-in) then cuts shares from those GPUs with a shareID
//! and consumedCapacity, and the node's plugin prepares each share under the GPU's MPS daemon
//! with the share's limits. The plugin has no API server here, so it reads no publication: a
//! share is shared as the class config in its allocation says (the GpuClass's `sharing`),
//! which is what the publication would say too, as both come from the class.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{Device, ResourceSlice, ResourceSliceSpec};
use kerf_api::ownership::{Owner, publish_owners};
use kerf_api::resourceslice::scheduler_slices::{COMPUTE, SLICES, publish_shared};
use kerf_api::resourceslice::{capacities, limits};
use kerf_core::alloc::Index;
use kerf_kubelet_plugin::config::Discovery;
use serde::{Deserialize, Serialize};

use super::classes::Classes;
use super::extra_node::ExtraNode;
use super::node;
use super::scheduler;
use crate::error::Result;

/// The shareable node's name unless told otherwise.
pub const DEFAULT_SHAREABLE_NODE_NAME: &str = "demo-nvl-node";
/// Its mock profile unless told otherwise.
pub const DEFAULT_SHAREABLE_MOCK_GPUS: &str = "h100-nvl";

/// The node of shareable GPUs of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareableNode {
    /// Its name (the pool name).
    pub name: String,
    /// Its mock inventory.
    pub discovery: Discovery,
}

impl Default for ShareableNode {
    fn default() -> Self {
        ShareableNode {
            name: DEFAULT_SHAREABLE_NODE_NAME.to_owned(),
            discovery: Discovery::MockProfile(DEFAULT_SHAREABLE_MOCK_GPUS.to_owned()),
        }
    }
}

/// What the node of shareable GPUs published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShareableNodeReport {
    /// The node's name.
    pub node: String,
    /// `mock profile h100-nvl`.
    pub inventory: String,
    /// Its devices as published ([`super::report::describe_devices`]), shareable ones with
    /// their slicing.
    pub devices: Vec<String>,
}

/// Publishes `slices` of `node` as the cluster does with consumable capacity (see the module
/// documentation). Returns, as `node/device: why`, every GPU a sliced Scheduler class selects
/// that stays whole: classes that slice it differently (kerf-controller's
/// `ConflictingSlicing`), or a GPU that cannot hold shares (the plugin logs those).
///
/// # Errors
/// A slice or the pool breaks an API limit once published so.
pub(super) fn publish(
    slices: &mut [ResourceSlice],
    node: &str,
    driver: &str,
    classes: &Classes,
) -> Result<Vec<String>> {
    let devices = node::published_devices(slices);
    let at_start = scheduler::Node {
        name: node,
        driver,
        devices: &devices,
        slices,
    };
    let record = scheduler::owners(&at_start, &BTreeSet::new(), &Index::new());
    let gpus: Vec<Device> = devices
        .iter()
        .filter(|d| record.owner(&d.name) == Some(Owner::Scheduler))
        .cloned()
        .collect();
    let device_classes: Vec<Arc<_>> = classes
        .device_classes
        .values()
        .map(|c| Arc::new(c.clone()))
        .collect();
    let (publication, conflicts) =
        kerf_controller::node_shares(&device_classes, driver, node, &gpus);
    let mut specs: Vec<ResourceSliceSpec> = slices.iter().map(|s| s.spec.clone()).collect();
    let mut whole = conflict_lines(&conflicts);
    whole.extend(
        publish_shared(&mut specs, &record, &publication)
            .iter()
            .map(|e| format!("{node}: published whole: {e}")),
    );
    publish_owners(&mut specs, &record);
    for spec in &specs {
        limits::check_slice(spec)?;
    }
    limits::check_pool(&specs)?;
    for (slice, spec) in slices.iter_mut().zip(specs) {
        slice.spec = spec;
    }
    Ok(whole)
}

/// `node/device: published whole: sliced classes a, b slice it differently`, per GPU.
fn conflict_lines(conflicts: &BTreeMap<String, Vec<String>>) -> Vec<String> {
    let mut by_gpu: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (class, gpus) in conflicts {
        for gpu in gpus {
            by_gpu.entry(gpu).or_default().push(class);
        }
    }
    by_gpu
        .into_iter()
        .map(|(gpu, classes)| {
            format!(
                "{gpu}: published whole: sliced classes {} slice it differently \
                 (kerf-controller reports them ConflictingSlicing)",
                classes.join(", ")
            )
        })
        .collect()
}

/// The node of shareable GPUs before its plugin runs.
pub(super) struct Setup {
    pub(super) node: ExtraNode,
    /// Its GPUs a sliced class selects that stay whole, and why ([`publish`]).
    pub(super) whole: Vec<String>,
}

/// Lays out the node under `<output>/<name>`, discovers its GPUs and publishes them as the
/// cluster does with `classes` ([`publish`]).
///
/// # Errors
/// Bad names, an unusable mock inventory, the directories or the tools cannot be created,
/// or the slices break an API limit.
pub(super) fn setup(
    shareable: &ShareableNode,
    output: &Path,
    driver: &str,
    gpu_tools: Option<&Path>,
    classes: &Classes,
) -> Result<Setup> {
    let node = ExtraNode::open(
        (&shareable.name, "the shareable node's name"),
        &shareable.discovery,
        output,
        driver,
        gpu_tools,
    )?;
    let mut slices = crate::inventory::resource_slices(&node.inventory, driver, &shareable.name)?;
    let whole = publish(&mut slices, &shareable.name, driver, classes)?;
    Ok(Setup {
        node: node.with_slices(slices),
        whole,
    })
}

/// The report of the node.
pub(super) fn report(setup: &Setup, driver: &str) -> ShareableNodeReport {
    ShareableNodeReport {
        node: setup.node.name.clone(),
        inventory: setup.node.inventory_text.clone(),
        devices: super::report::describe_devices(&setup.node.devices, driver),
    }
}

/// `, shareable: memory in 1Gi steps, compute 25% unless asked, at most 7 shares` for a
/// shareable device, read back from its published capacities; empty for any other.
pub(super) fn shareable_text(device: &Device) -> String {
    if device.allow_multiple_allocations != Some(true) {
        return String::new();
    }
    let capacity = |name: &str| device.capacity.as_ref().and_then(|c| c.get(name));
    let mut text = ", shareable".to_owned();
    let mut parts = Vec::new();
    if let Some(step) = capacity(capacities::MEMORY)
        .and_then(|c| c.request_policy.as_ref())
        .and_then(|p| p.valid_range.as_ref())
        .and_then(|r| r.step.as_ref())
    {
        parts.push(format!("memory in {} steps", step.0));
    }
    if let Some(default) = capacity(COMPUTE)
        .and_then(|c| c.request_policy.as_ref())
        .and_then(|p| p.default.as_ref())
    {
        parts.push(format!("compute {}% unless asked", default.0));
    }
    if let Some(most) = capacity(SLICES) {
        parts.push(format!("at most {} shares", most.value.0));
    }
    if !parts.is_empty() {
        let _ = write!(text, ": {}", parts.join(", "));
    }
    text
}
