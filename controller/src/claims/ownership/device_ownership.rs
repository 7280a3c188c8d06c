//! The owner of every device as the controller wants it, and whether the controller may place
//! on it yet: the state machine behind the one-allocator-per-device rule.
//!
//! # Why no device is allocated by both
//! A device moves between owners only while nothing is allocated on it, and each direction has
//! a fence that guarantees the old owner can no longer allocate it when the new one starts:
//!
//! - **Controller → scheduler (lending).** Decided under the bookkeeping lock that placement also
//!   holds, with the capacity index counting the controller's own writes in flight: the device
//!   is idle, and from that moment no placement can pick it. Only then is the record written,
//!   and kube-scheduler can allocate the device only after the kubelet plugin has republished
//!   it with `allocator: scheduler`. The controller's side of the fence is its own lock.
//! - **Scheduler → controller (reclaiming).** The record says `controller` first, so the
//!   plugin republishes the device without the scheduler's attribute value. kube-scheduler
//!   may still hold an allocation of it decided from an older snapshot (between its Reserve
//!   and PreBind, where the claim is not written yet). The controller therefore starts placing
//!   on the device only after it has *observed* the republished slice and a settle period has
//!   passed since, long enough for such an allocation to reach the API server and the
//!   controller's cache; if one arrives meanwhile, the move is abandoned and the device stays
//!   the scheduler's.
//!
//! Until a device has passed the fence it is in nobody's hands but the old owner's, which is
//! why the record can be written before the fence completes.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kerf_api::ownership::{NodePolicy, Owner, OwnershipRecord};

use crate::config::OwnershipTiming;

/// What is known of one device at one tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFacts {
    /// A MIG device (only kube-scheduler allocates those).
    pub mig: bool,
    /// The owner the published slice carries.
    pub published: Option<Owner>,
    /// The owner the node's record names (the last one written, read back at start-up).
    pub recorded: Option<Owner>,
    /// A claim allocated by the controller (or being written by it) uses the device.
    pub held_by_controller: bool,
    /// A claim the controller did not allocate uses the device.
    pub held_by_scheduler: bool,
    /// The pending scheduler demand wants this device.
    pub demanded: bool,
}

impl DeviceFacts {
    fn idle(&self) -> bool {
        !self.held_by_controller && !self.held_by_scheduler
    }
}

/// What a tick changed for one device, for logs, Events and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// The controller now wants `to` to own the device.
    Moved {
        /// The new owner.
        to: Owner,
    },
    /// The fence passed: the controller may place on the device.
    Usable,
    /// The scheduler allocated a device the controller had already taken over: a DeviceClass
    /// without the ownership guard, or an allocation older than the settle period.
    SchedulerTookControllerDevice,
    /// A move to the controller was abandoned because the scheduler allocated the device
    /// before the fence passed.
    ReclaimAbandoned,
}

#[derive(Debug, Clone)]
struct DeviceState {
    wanted: Owner,
    usable: bool,
    /// When the republished slice showed `wanted == Controller` first.
    observed: Option<Instant>,
    idle_since: Option<Instant>,
}

/// Wanted owners and fences of every device, by node.
#[derive(Debug, Default)]
pub struct DeviceOwnership {
    nodes: HashMap<String, BTreeMap<String, DeviceState>>,
    /// Bumped whenever the set of devices the controller may place on changes, per node.
    epochs: HashMap<String, u64>,
    /// A whole tick has been taken into account.
    decided: bool,
}

impl DeviceOwnership {
    /// True when the controller may place on `device` of `node`.
    pub fn usable(&self, node: &str, device: &str) -> bool {
        self.nodes
            .get(node)
            .and_then(|devices| devices.get(device))
            .is_some_and(|d| d.usable)
    }

    /// The owner the controller wants for `device` of `node`, once the book has met it.
    pub fn wanted(&self, node: &str, device: &str) -> Option<Owner> {
        self.nodes
            .get(node)
            .and_then(|devices| devices.get(device))
            .map(|d| d.wanted)
    }

    /// A tick has decided every published device: until then no device is usable.
    pub(crate) fn mark_decided(&mut self) {
        self.decided = true;
    }

    /// True until the first tick, and while devices the controller has taken over wait for
    /// their fence: a placement that fails now may fit soon.
    pub fn settling(&self) -> bool {
        !self.decided || self.settling_devices() > 0
    }

    /// Devices the controller has taken over whose fence has not passed yet.
    fn settling_devices(&self) -> usize {
        self.nodes
            .values()
            .flat_map(BTreeMap::values)
            .filter(|d| d.wanted == Owner::Controller && !d.usable)
            .count()
    }

    /// Changes whenever the set of usable devices of `node` changes.
    pub(crate) fn epoch(&self, node: &str) -> u64 {
        self.epochs.get(node).copied().unwrap_or(0)
    }

    /// The record the controller wants on `node`.
    pub fn record(&self, node: &str) -> OwnershipRecord {
        OwnershipRecord(
            self.nodes
                .get(node)
                .into_iter()
                .flatten()
                .map(|(device, state)| (device.clone(), state.wanted))
                .collect(),
        )
    }

    /// Nodes the book knows.
    pub fn nodes(&self) -> impl Iterator<Item = &str> {
        self.nodes.keys().map(String::as_str)
    }

    /// The earliest moment after `now` at which a device's state changes with time alone: a
    /// settle fence passing ([`OwnershipTiming::settle`] after the republished slice was
    /// observed) or an idle scheduler device's linger running out. Between passes nothing else
    /// in the book moves by itself, so a pass is due then even if no input changed. Over-eager
    /// by design: a lingering device that demand or the node's policy keeps does not move when
    /// its linger runs out, which costs one pass, once (a moment not after `now` is never
    /// returned again).
    pub(crate) fn next_due(&self, timing: OwnershipTiming, now: Instant) -> Option<Instant> {
        self.nodes
            .values()
            .flat_map(BTreeMap::values)
            .filter_map(|state| match state.wanted {
                Owner::Controller if !state.usable => state.observed.map(|at| at + timing.settle),
                Owner::Scheduler => state.idle_since.map(|since| since + timing.linger),
                Owner::Controller => None,
            })
            .filter(|due| *due > now)
            .min()
    }

    /// Forgets nodes and devices no longer published.
    pub fn retain(&mut self, published: &HashMap<String, Vec<String>>) {
        self.nodes
            .retain(|node, devices| match published.get(node) {
                Some(names) => {
                    devices.retain(|d, _| names.contains(d));
                    true
                }
                None => false,
            });
        self.epochs.retain(|node, _| published.contains_key(node));
    }

    /// Advances one device by one tick: decides its wanted owner and its fence.
    /// `controller_waiting`: a controller claim waits for capacity, so idle scheduler devices
    /// are reclaimed without lingering.
    #[allow(clippy::too_many_arguments)] // one device's whole situation, named at the call
    pub fn advance(
        &mut self,
        node: &str,
        device: &str,
        facts: &DeviceFacts,
        policy: NodePolicy,
        controller_waiting: bool,
        timing: OwnershipTiming,
        now: Instant,
    ) -> Option<Change> {
        let state = self
            .nodes
            .entry(node.to_owned())
            .or_default()
            .entry(device.to_owned())
            .or_insert_with(|| DeviceState {
                wanted: initial_owner(facts, policy),
                usable: false,
                observed: None,
                idle_since: None,
            });
        let was_usable = state.usable;
        let change = step(state, facts, policy, controller_waiting, timing, now);
        if state.usable != was_usable {
            *self.epochs.entry(node.to_owned()).or_default() += 1;
        }
        change
    }
}

/// The owner of a device the book meets first: who holds it, else the record, else the policy
/// (dynamic nodes start with the controller: lending is instant, reclaiming waits a fence).
fn initial_owner(facts: &DeviceFacts, policy: NodePolicy) -> Owner {
    if facts.mig || facts.held_by_scheduler && !facts.held_by_controller {
        return Owner::Scheduler;
    }
    if facts.held_by_controller {
        return Owner::Controller;
    }
    match (facts.recorded, policy) {
        (Some(owner), _) | (None, NodePolicy::Fixed(owner)) => owner,
        (None, NodePolicy::Dynamic) => Owner::Controller,
    }
}

fn step(
    state: &mut DeviceState,
    facts: &DeviceFacts,
    policy: NodePolicy,
    controller_waiting: bool,
    timing: OwnershipTiming,
    now: Instant,
) -> Option<Change> {
    if facts.idle() {
        state.idle_since.get_or_insert(now);
    } else {
        state.idle_since = None;
    }
    let mut change = None;
    if facts.held_by_scheduler && !facts.held_by_controller && state.wanted == Owner::Controller {
        change = Some(if state.usable {
            Change::SchedulerTookControllerDevice
        } else {
            Change::ReclaimAbandoned
        });
        state.wanted = Owner::Scheduler;
        state.observed = None;
    } else if facts.idle() {
        let target = target_owner(state, facts, policy, controller_waiting, timing, now);
        if target != state.wanted {
            state.wanted = target;
            state.observed = None;
            change = Some(Change::Moved { to: target });
        }
    }
    match state.wanted {
        Owner::Scheduler => state.usable = false,
        Owner::Controller if !state.usable => {
            if facts.published == Some(Owner::Controller) {
                let observed = *state.observed.get_or_insert(now);
                if now.duration_since(observed) >= timing.settle {
                    state.usable = true;
                    change = change.or(Some(Change::Usable));
                }
            } else {
                state.observed = None;
            }
        }
        Owner::Controller => {}
    }
    change
}

/// Where an idle device should be.
fn target_owner(
    state: &DeviceState,
    facts: &DeviceFacts,
    policy: NodePolicy,
    controller_waiting: bool,
    timing: OwnershipTiming,
    now: Instant,
) -> Owner {
    if facts.mig {
        return Owner::Scheduler;
    }
    if let NodePolicy::Fixed(owner) = policy {
        return owner;
    }
    if facts.demanded {
        return Owner::Scheduler;
    }
    let idle_for = state
        .idle_since
        .map_or(Duration::ZERO, |since| now.duration_since(since));
    match state.wanted {
        Owner::Scheduler if controller_waiting || idle_for >= timing.linger => Owner::Controller,
        owner => owner,
    }
}

#[cfg(test)]
mod tests;
