//! The invariants the sim checks at every observation point, and the ownership moves it sees.
//!
//! Read straight from [`FakeApi`]'s state (what the API server holds at that instant), never
//! from anyone's cache:
//! - **exclusive use**: a device held whole by one claim (a whole-GPU or MIG allocation by
//!   the scheduler, or a whole GPU by the controller) is named by no other allocated claim;
//! - **no over-commit**: the slices on one GPU add up to at most its memory and to at most
//!   100 % of its compute;
//! - **bound pods hold their devices**: a pod the scheduler bound has every claim allocated,
//!   and an allocated claim of a pod with a node names only devices of that node;
//! - **the controller allocates only its own devices**: a device held by a claim
//!   kerf-controller allocated is recorded as the controller's in its node's ownership record.
//!
//! How a claim holds a device is read with [`kerf_api::device_uses`], the reading both
//! allocators' bookkeeping is built on: a `GpuSliceAllocation` entry with memory or compute is
//! a slice, anything else whole.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kerf_api::controller_claims::FINALIZER;
use kerf_api::ownership::{Owner, OwnershipRecord};
use kerf_core::alloc::UseKind;
use kube::ResourceExt as _;

use super::cluster::DeviceInfo;
use crate::fake_api::FakeApi;
use kerf_scheduler_standin::BUILTIN_FINALIZER;

/// One device: (node, device name).
pub type DeviceKey = (String, String);

/// What one observation found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observation {
    /// Broken invariants, each described with the claims and devices involved.
    pub violations: Vec<String>,
    /// Allocated claims.
    pub allocated_claims: usize,
    /// Devices named by at least one allocation.
    pub devices_in_use: usize,
    /// Ownership moves since the previous observation.
    pub moves: u64,
}

/// Checks the invariants and counts ownership moves; keeps the owners seen last.
#[derive(Debug, Clone)]
pub struct Checker {
    driver: String,
    devices: HashMap<DeviceKey, DeviceInfo>,
    owners: HashMap<DeviceKey, Owner>,
    /// Ownership moves seen so far: a device whose recorded owner changed from one allocator
    /// to the other between two observations.
    pub moves: u64,
    /// Devices that got their first recorded owner.
    pub first_owners: u64,
    /// Violations seen so far (all observations).
    pub violations: u64,
}

/// `namespace/name` of a claim.
pub fn claim_key(claim: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.namespace().unwrap_or_default(),
        claim.name_any()
    )
}

fn gib(bytes: u64) -> String {
    #[allow(clippy::cast_precision_loss)] // display only
    let gib = bytes as f64 / f64::from(1u32 << 30);
    format!("{gib:.2}Gi")
}

impl Checker {
    /// A checker of `devices` (of `driver`).
    pub fn new(driver: &str, devices: &[DeviceInfo]) -> Self {
        Checker {
            driver: driver.to_owned(),
            devices: devices
                .iter()
                .map(|d| ((d.node.clone(), d.name.clone()), d.clone()))
                .collect(),
            owners: HashMap::new(),
            moves: 0,
            first_owners: 0,
            violations: 0,
        }
    }

    /// The recorded owner of each device, as last observed.
    pub fn owners(&self) -> &HashMap<DeviceKey, Owner> {
        &self.owners
    }

    /// Observes the fake's current state: checks every invariant and counts ownership moves.
    pub fn observe(&mut self, fake: &FakeApi) -> Observation {
        let before = fake.resource_version();
        let nodes: Vec<Node> = fake.list_resources(None);
        let claims: Vec<ResourceClaim> = fake.list_resources(None);
        let pods: Vec<Pod> = fake.list_resources(None);
        let mut observation = Observation {
            moves: self.track_owners(&nodes),
            ..Observation::default()
        };
        self.check_devices(&claims, &mut observation);
        self.check_controller_owns(&claims, before, &mut observation);
        check_pods(&claims, &pods, &self.driver, &mut observation);
        self.violations += observation.violations.len() as u64;
        observation
    }

    fn check_devices(&self, claims: &[ResourceClaim], observation: &mut Observation) {
        let mut uses: BTreeMap<DeviceKey, Vec<(String, UseKind)>> = BTreeMap::new();
        for claim in claims {
            let held = kerf_api::device_uses(claim, &self.driver);
            if !held.is_empty() {
                observation.allocated_claims += 1;
            }
            for use_ in held {
                uses.entry((use_.node, use_.device))
                    .or_default()
                    .push((claim_key(claim), use_.kind));
            }
        }
        observation.devices_in_use = uses.len();
        for ((node, device), holders) in &uses {
            let info = self.devices.get(&(node.clone(), device.clone()));
            if let Some(violation) = device_violation(node, device, holders, info) {
                observation.violations.push(violation);
            }
        }
    }

    /// A device kerf-controller has allocated is recorded as the controller's: it lends only
    /// idle devices and places only on devices recorded as its own. Checked for claims not
    /// written since `before`, the resourceVersion read before the nodes were, so the claim
    /// held its allocation when the records were read.
    fn check_controller_owns(
        &self,
        claims: &[ResourceClaim],
        before: u64,
        observation: &mut Observation,
    ) {
        for claim in claims {
            let unchanged = claim
                .metadata
                .resource_version
                .as_deref()
                .and_then(|rv| rv.parse::<u64>().ok())
                .is_some_and(|rv| rv <= before);
            let by_controller = claim.finalizers().iter().any(|f| f == FINALIZER)
                && !claim.finalizers().iter().any(|f| f == BUILTIN_FINALIZER);
            if !unchanged || !by_controller {
                continue;
            }
            for held in kerf_api::device_uses(claim, &self.driver) {
                let owner = self.owners.get(&(held.node.clone(), held.device.clone()));
                if owner != Some(&Owner::Controller) {
                    observation.violations.push(format!(
                        "device {}/{}: allocated by kerf-controller to {} but recorded as {}",
                        held.node,
                        held.device,
                        claim_key(claim),
                        owner.map_or("nobody's".to_owned(), |o| format!("the {o}'s"))
                    ));
                }
            }
        }
    }

    /// Reads every node's ownership record; returns how many devices changed owner.
    fn track_owners(&mut self, nodes: &[Node]) -> u64 {
        let mut moves = 0;
        for node in nodes {
            let Ok(record) = OwnershipRecord::from_annotations(node.metadata.annotations.as_ref())
            else {
                continue;
            };
            for (device, owner) in record.0 {
                match self.owners.insert((node.name_any(), device), owner) {
                    Some(before) if before != owner => moves += 1,
                    Some(_) => {}
                    None => self.first_owners += 1,
                }
            }
        }
        self.moves += moves;
        moves
    }
}

/// What is wrong with one device whose allocations are `holders` (claim, how it holds the
/// device), if anything: held whole by one claim and named by another, slices beyond its
/// memory or 100 % compute, or never published (`info` is `None`).
pub fn device_violation(
    node: &str,
    device: &str,
    holders: &[(String, UseKind)],
    info: Option<&DeviceInfo>,
) -> Option<String> {
    let name = format!("{node}/{device}");
    if let Some((whole, _)) = holders.iter().find(|(_, k)| *k == UseKind::Whole)
        && holders.len() > 1
    {
        let others: Vec<&str> = holders
            .iter()
            .map(|(c, _)| c.as_str())
            .filter(|c| c != whole)
            .collect();
        return Some(format!(
            "device {name}: held whole by {whole} and also allocated to {}",
            others.join(", ")
        ));
    }
    let Some(info) = info else {
        return Some(format!("device {name}: allocated but never published"));
    };
    let (memory, compute) = holders
        .iter()
        .fold((0u64, 0u32), |(m, c), (_, kind)| match kind {
            UseKind::Slice {
                memory_bytes,
                compute_percent,
                ..
            } => (m + memory_bytes, c + u32::from(*compute_percent)),
            UseKind::Whole => (m, c),
        });
    (memory > info.memory_bytes || compute > 100).then(|| {
        let claims: Vec<&str> = holders.iter().map(|(c, _)| c.as_str()).collect();
        format!(
            "device {name}: slices over-commit it: {} of {} memory, {compute}% compute ({})",
            gib(memory),
            gib(info.memory_bytes),
            claims.join(", ")
        )
    })
}

/// The owner each published device carries in its `allocator` attribute now (`None`: none),
/// from the slices of each pool's highest generation.
pub fn published_owners(fake: &FakeApi, driver: &str) -> HashMap<DeviceKey, Option<Owner>> {
    let slices: Vec<ResourceSlice> = fake.list_resources(None);
    let mut newest: HashMap<&str, i64> = HashMap::new();
    for slice in slices.iter().filter(|s| s.spec.driver == driver) {
        let generation = newest
            .entry(slice.spec.pool.name.as_str())
            .or_insert(i64::MIN);
        *generation = (*generation).max(slice.spec.pool.generation);
    }
    slices
        .iter()
        .filter(|s| s.spec.driver == driver)
        .filter(|s| newest.get(s.spec.pool.name.as_str()) == Some(&s.spec.pool.generation))
        .flat_map(|s| {
            s.spec.devices.iter().flatten().map(|d| {
                (
                    (s.spec.pool.name.clone(), d.name.clone()),
                    kerf_api::ownership::published_owner(d, driver),
                )
            })
        })
        .collect()
}

/// The pod's claim names (`resourceClaimName`, or the generated name from its status), as the
/// scheduler stand-in resolves them.
pub fn pod_claims(pod: &Pod) -> Vec<String> {
    kerf_scheduler_standin::pod_claim_names(pod)
        .into_iter()
        .filter_map(|(_, name)| name)
        .collect()
}

/// The node a pod is bound to, if any.
pub fn pod_node(pod: &Pod) -> Option<&str> {
    kerf_controller::claims::consumers::assigned_node(pod)
}

/// True when the pod still carries any scheduling gate.
pub fn is_gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| !g.is_empty())
}

fn check_pods(claims: &[ResourceClaim], pods: &[Pod], driver: &str, observation: &mut Observation) {
    let by_key: HashMap<String, &ResourceClaim> =
        claims.iter().map(|c| (claim_key(c), c)).collect();
    for pod in pods {
        let Some(node) = pod_node(pod) else {
            continue;
        };
        let namespace = pod.namespace().unwrap_or_default();
        let pinned = super::is_pinned(pod);
        for name in pod_claims(pod) {
            let key = format!("{namespace}/{name}");
            let claim = by_key.get(&key);
            let held = claim
                .map(|c| kerf_api::device_uses(c, driver))
                .unwrap_or_default();
            let allocated = claim
                .and_then(|c| c.status.as_ref())
                .is_some_and(|s| s.allocation.is_some());
            if !allocated && !pinned {
                observation.violations.push(format!(
                    "pod {namespace}/{} is bound to {node} but its claim {key} is not allocated",
                    pod.name_any()
                ));
            }
            if let Some(other) = held.iter().find(|u| u.node != node) {
                observation.violations.push(format!(
                    "pod {namespace}/{} is on {node} but its claim {key} holds {}/{}",
                    pod.name_any(),
                    other.node,
                    other.device
                ));
            }
        }
    }
}
