//! kube-scheduler for claims of Scheduler classes (whole GPUs, MIG devices, dynamic-MIG
//! placements, shares of shareable GPUs), which kerf's controller leaves alone: kube-scheduler's structured allocator
//! as the tests' stand-in implements it ([`kerf_scheduler_standin::Allocator`]: DeviceClass
//! and request CEL selectors, `matchAttribute`/`distinctAttribute` constraints, shared
//! counters, consumable capacity, taints; the first devices in ResourceSlice order that
//! satisfy every request of the pod's claims together), over the node's ResourceSlices.
//!
//! What the demo adds is the one part of the cluster it does not run: kerf-controller's
//! ownership record ([`kerf_api::ownership`]). The node's slices are published with the
//! `allocator` attribute as the controller's dynamic policy would set it at that moment
//! ([`owners`]): a GPU the controller uses, or one whose MIG device or parent is in use, is
//! not the scheduler's; every other device is. The Scheduler classes' selectors require
//! `allocator == "scheduler"`, so kube-scheduler never takes a GPU kerf-controller holds.

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1;
use k8s_openapi::api::resource::v1::{AllocationResult, Device, ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kerf_api::ownership::{Owner, OwnershipRecord, publish_owners};
use kerf_api::resourceslice::{TYPE_GPU, TYPE_MIG, attributes, device_attribute};
use kerf_core::alloc::Index;
use kerf_scheduler_standin::{AllocatedState, Allocator, Snapshot};

use super::classes::Classes;

/// What the scheduler stand-in needs to know about the node.
pub struct Node<'a> {
    /// Node name (the pool name).
    pub name: &'a str,
    /// Driver name.
    pub driver: &'a str,
    /// The node's published devices, in ResourceSlice order.
    pub devices: &'a [Device],
    /// The node's ResourceSlices as its plugin publishes them.
    pub slices: &'a [ResourceSlice],
}

/// Allocates `claims` (one pod's Scheduler-class claims) together on `node`, given the
/// allocations `state` already counts; returns one allocation per claim, stamped `now`.
/// `held` names the devices scheduler claims hold on the node and `index` knows every GPU's
/// usage, which decide the ownership record ([`owners`]).
///
/// # Errors
/// The claim (its position in `claims`) that cannot be allocated, and why: the allocator's
/// error (a CEL error, an unsupported request), or the classes whose requests found no
/// devices, as kube-scheduler reports an unschedulable pod.
pub fn allocate(
    allocator: &mut Allocator,
    claims: &[&ResourceClaim],
    classes: &Classes,
    node: &Node<'_>,
    state: &AllocatedState,
    (held, index): (&BTreeSet<String>, &Index),
    now: &Time,
) -> Result<Vec<AllocationResult>, (usize, String)> {
    let mut specs: Vec<_> = node.slices.iter().map(|s| s.spec.clone()).collect();
    publish_owners(&mut specs, &owners(node, held, index));
    let slices = node
        .slices
        .iter()
        .zip(specs)
        .map(|(slice, spec)| {
            Arc::new(ResourceSlice {
                metadata: slice.metadata.clone(),
                spec,
            })
        })
        .collect();
    let snapshot = Snapshot::new(
        Vec::new(),
        slices,
        classes
            .device_classes
            .values()
            .map(|c| Arc::new(c.clone()))
            .collect(),
        Vec::new(),
        Vec::new(),
    );
    let k8s_node = v1::Node {
        metadata: ObjectMeta {
            name: Some(node.name.to_owned()),
            ..ObjectMeta::default()
        },
        ..v1::Node::default()
    };
    // The pod's claims are allocated together (kube-scheduler's Filter); adding them one at
    // a time names the first claim that no longer fits beside the ones before it.
    for count in 1..=claims.len() {
        let found = allocator
            .allocate_on_node(&snapshot, &k8s_node, &claims[..count], state)
            .map_err(|e| (count - 1, e))?;
        match found {
            Some(mut allocations) if count == claims.len() => {
                for allocation in &mut allocations {
                    allocation.allocation_timestamp = Some(now.clone());
                }
                return Ok(allocations);
            }
            Some(_) => {}
            None => {
                let claim = claims[count - 1];
                return Err((count - 1, no_devices(claim)));
            }
        }
    }
    Ok(Vec::new())
}

/// Why `claim` found no devices on the node, naming its classes.
fn no_devices(claim: &ResourceClaim) -> String {
    let mut classes: Vec<String> =
        kerf_api::controller_claims::request_class_names(claim.spec.devices.as_ref())
            .map(|c| format!("{c:?}"))
            .collect();
    classes.dedup();
    format!(
        "cannot allocate all claims: no free devices of class {} satisfy the requests",
        classes.join(", ")
    )
}

/// kerf-controller's ownership record for the node as its dynamic policy keeps it (see the
/// module documentation): partitionable devices (dynamic-MIG placements) are always the
/// scheduler's; a whole GPU is the scheduler's while the controller does not use it and no
/// MIG device of it is held; a MIG device while its parent GPU is neither used nor held.
pub fn owners(node: &Node<'_>, held: &BTreeSet<String>, index: &Index) -> OwnershipRecord {
    let string = |d: &Device, name: &str| -> Option<String> {
        device_attribute(d, node.driver, name).and_then(|a| a.string.clone())
    };
    let mut record = OwnershipRecord::default();
    for device in node.devices {
        let scheduler = if kerf_api::counters::consumes(device) {
            true
        } else {
            match string(device, attributes::TYPE).as_deref() {
                Some(TYPE_GPU) => {
                    let uuid = string(device, attributes::UUID);
                    let child_held = node.devices.iter().any(|d| {
                        held.contains(&d.name)
                            && uuid.is_some()
                            && string(d, attributes::PARENT_UUID) == uuid
                    });
                    let ours = held.contains(&device.name);
                    ours || (!child_held && index.gpu_usage(node.name, &device.name).is_idle())
                }
                Some(TYPE_MIG) => {
                    let parent_uuid = string(device, attributes::PARENT_UUID);
                    let parent = node.devices.iter().find(|d| {
                        parent_uuid.is_some() && string(d, attributes::UUID) == parent_uuid
                    });
                    parent.is_none_or(|p| {
                        !held.contains(&p.name) && index.gpu_usage(node.name, &p.name).is_idle()
                    })
                }
                _ => false,
            }
        };
        let owner = if scheduler {
            Owner::Scheduler
        } else {
            Owner::Controller
        };
        record.0.insert(device.name.clone(), owner);
    }
    record
}
