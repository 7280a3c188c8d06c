//! One allocator per device: the controller decides who owns each published device, writes it
//! into the node's ownership record (the Node annotation
//! [`kerf_api::ownership::RECORD_ANNOTATION`]), places only on devices it owns past their fence,
//! and reports what breaks the rule.
//!
//! A pass reads the published devices, who holds each (its own allocations in flight
//! included), the pending demand for kube-scheduler and each node's policy label, advances the
//! [`DeviceOwnership`] under the bookkeeping lock that placement also takes, and then writes the
//! records that changed. Why this cannot hand a device to both allocators is written in
//! `ownership/device_ownership.rs`.
//!
//! A pass runs only when something it reads changed (`InputChanges`) or a moment it computed
//! has come (a fence, a linger, an assumed allocation's expiry, a node write's back-off), and
//! at most once per [`ClaimSettings::ownership_tick`](super::ClaimSettings): a busy cluster
//! costs at most one pass per tick, an idle one none. Passes are counted in
//! `kerf_controller_ownership_passes_total`.

mod conflicts;
mod demand;
pub(super) mod device_ownership;
mod extended;
mod guard;
mod inputs;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::inventory_view::device_taints;
use kerf_api::ownership::{NodePolicy, Owner, OwnershipRecord, RECORD_ANNOTATION, node_policy};
use kerf_api::resourceslice::{
    DeviceFields as _, ResourceSliceFields as _, TYPE_MIG, attributes, device_attribute,
};
use kerf_api::shared_publication::{SHARED_PUBLICATION_ANNOTATION, SharedPublication};
use kerf_core::alloc::idle_gpu_counts;
use kube::Api;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use tokio_util::sync::CancellationToken;

pub use crate::config::OwnershipTiming;
pub use device_ownership::{Change, DeviceFacts, DeviceOwnership};
pub(crate) use inputs::InputChanges;

use super::index::CapacityIndex;
use super::report::{node_write_failed, node_write_key, publish};
use super::state::annotated_node;
use crate::cache::{CompactDevice, CompactResourceSlice};
use crate::claims::ClaimsContext;
use demand::IdleGpus;

/// Event reason: kube-scheduler allocated a device the controller owns.
const SCHEDULER_TOOK_DEVICE: &str = "AllocatorGuardMissing";

/// What the pass loop remembers between passes: what it already warned about.
#[derive(Debug, Default)]
pub(super) struct Warned {
    node_labels: HashSet<(String, String)>,
    device_classes: HashSet<(String, String)>,
    conflicts: HashSet<(String, String)>,
}

/// Advances ownership until `shutdown`: a pass at once, then one whenever an input changed or a
/// computed moment has come, at most one per [`ClaimSettings::ownership_tick`](super::ClaimSettings).
pub(super) async fn run(ctx: Arc<ClaimsContext>, shutdown: CancellationToken) {
    if ctx.wait_ready().await.is_err() {
        return;
    }
    // The shared caches (slices, claims, DeviceClasses) keep their own counter; their changes
    // are inputs too. If the caches stop, the stores stop with them: passes stay driven by the
    // other inputs until `shutdown`.
    let inputs = ctx.ownership_inputs.clone();
    let cache_changes = ctx.core.caches.changes(Duration::ZERO);
    let forward = async move {
        cache_changes
            .for_each(move |()| {
                inputs.bump();
                std::future::ready(())
            })
            .await;
        std::future::pending::<()>().await;
    };
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = forward => {}
        () = passes(&ctx, &shutdown) => {}
    }
}

/// The pass loop: waits for an input change or the next computed moment, keeps the minimum
/// spacing, runs a pass. Returns when `shutdown` is cancelled.
async fn passes(ctx: &ClaimsContext, shutdown: &CancellationToken) {
    let mut changed = ctx.ownership_inputs.subscribe();
    let mut warned = Warned::default();
    let mut due = Some(tokio::time::Instant::now());
    let mut last: Option<tokio::time::Instant> = None;
    loop {
        let at_due = async {
            match due {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => return,
            // The sender lives in `ctx`, which outlives this loop.
            _ = changed.changed() => {}
            () = at_due => {}
        }
        if let Some(last) = last {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep_until(last + ctx.core.config.claims.ownership_tick) => {}
            }
        }
        // Changes from here on wake the next pass; the ones before are read by this one.
        changed.mark_unchanged();
        last = Some(tokio::time::Instant::now());
        due = pass(ctx, &mut warned)
            .await
            .map(tokio::time::Instant::from_std);
    }
}

/// A published device as a pass needs it, borrowed from the cached slice.
#[derive(Debug, Clone)]
struct Published<'a> {
    name: &'a str,
    /// Only kube-scheduler allocates it: a MIG device, or a dynamic-MIG GPU's full device
    /// (it consumes counters, which only kube-scheduler's allocator accounts for).
    mig: bool,
    owner: Option<Owner>,
    /// The device as published, for the sliced classes' selectors.
    device: &'a CompactDevice,
}

/// One pass: decide, report, write the records. Returns when the next pass is due if no input
/// changes before: the earliest fence, linger or assumed allocation's expiry, or one tick from
/// now while a node's write is in back-off.
async fn pass(ctx: &ClaimsContext, warned: &mut Warned) -> Option<Instant> {
    ctx.core.metrics.record_ownership_pass();
    let slices = ctx.core.caches.slices.state();
    let devices = published_devices(ctx, &slices);
    let policies = node_policies(ctx, &devices, warned);
    let needs = demand::pending_needs(ctx);
    let mut outcome = advance(ctx, &devices, &policies, &needs);
    let idle_gpu_nodes = std::mem::take(&mut outcome.idle_gpu_nodes);
    ctx.idle_gpu_nodes
        .send_replace(Some(Arc::new(idle_gpu_nodes)));
    report(ctx, &outcome).await;
    conflicts::report(ctx, &outcome.conflicts, &mut warned.conflicts).await;
    guard::warn_unguarded_classes(ctx, &mut warned.device_classes).await;
    let retry = write_records(ctx, &outcome, &policies)
        .await
        .then(|| Instant::now() + ctx.core.config.claims.ownership_tick);
    [outcome.due, retry].into_iter().flatten().min()
}

/// Every published device of the driver, by node.
fn published_devices<'a>(
    ctx: &ClaimsContext,
    slices: &'a [Arc<CompactResourceSlice>],
) -> BTreeMap<&'a str, Vec<Published<'a>>> {
    let driver = ctx.core.driver();
    let mut out: BTreeMap<&str, Vec<Published>> = BTreeMap::new();
    for slice in slices {
        let Some(node) = slice.node_name().filter(|_| slice.driver() == driver) else {
            continue;
        };
        let devices = out.entry(node).or_default();
        for device in slice.devices() {
            let mig = device_attribute(device, driver, attributes::TYPE)
                .and_then(|a| a.string.as_deref())
                == Some(TYPE_MIG)
                || device.consumes_counters();
            devices.push(Published {
                name: device.device_name(),
                mig,
                owner: kerf_api::ownership::published_owner(device, driver),
                device,
            });
        }
    }
    out
}

/// Each node's policy label and current record (an unreadable label or record is warned
/// about once and read as dynamic / empty).
fn node_policies<'a>(
    ctx: &ClaimsContext,
    devices: &BTreeMap<&'a str, Vec<Published<'a>>>,
    warned: &mut Warned,
) -> BTreeMap<&'a str, (NodePolicy, OwnershipRecord)> {
    let mut out = BTreeMap::new();
    for &name in devices.keys() {
        let Some(node) = ctx.nodes.get(&ObjectRef::<Node>::new(name)) else {
            continue;
        };
        let policy = node_policy(node.metadata.labels.as_ref()).unwrap_or_else(|error| {
            let key = (name.to_owned(), error.to_string());
            if warned.node_labels.insert(key) {
                tracing::warn!(node = %name, %error, "ignoring the node's allocator label; its devices are moved dynamically");
            }
            NodePolicy::Dynamic
        });
        let record = OwnershipRecord::from_annotations(node.metadata.annotations.as_ref())
            .unwrap_or_default();
        out.insert(name, (policy, record));
    }
    out
}

/// What one pass decided.
#[derive(Debug, Default)]
struct Outcome {
    changes: Vec<(String, String, Change)>,
    /// Claims holding a device kube-scheduler took from the controller, per device.
    intruders: HashMap<(String, String), Vec<ObjectRef<ResourceClaim>>>,
    records: BTreeMap<String, OwnershipRecord>,
    /// Per node, the GPUs to publish as shareable ([`crate::scheduler_slices`]).
    publications: BTreeMap<String, SharedPublication>,
    conflicts: Vec<conflicts::Conflict>,
    /// When time alone changes a decision next: a fence, a linger, an assumption's expiry.
    due: Option<Instant>,
    /// The nodes with an idle GPU that wants kerf's node taint, whoever owns it.
    idle_gpu_nodes: BTreeSet<String>,
}

/// One device's facts, by (node, device), borrowed from the published slices.
type Facts<'a> = BTreeMap<(&'a str, &'a str), DeviceFacts>;

fn advance(
    ctx: &ClaimsContext,
    devices: &BTreeMap<&str, Vec<Published>>,
    policies: &BTreeMap<&str, (NodePolicy, OwnershipRecord)>,
    needs: &[demand::SchedulerNeed],
) -> Outcome {
    let timing = ctx.core.config.claims.ownership;
    let now = Instant::now();
    let mut books = ctx.books();
    let waiting = books.controller_waiting();
    let expiry = books.next_expiry();
    let (capacity, book) = books.ownership();
    let (mut facts, idle, conflicts) = gather(ctx, capacity, book, devices, policies);
    let idle_gpu_nodes = idle
        .iter()
        .filter(|(_, gpus)| gpus.keeps_node_tainted)
        .map(|(node, _)| node.clone())
        .collect();
    let chosen = demand::serve(needs, idle, &ctx.nodes);
    for (&(node, device), fact) in &mut facts {
        fact.demanded = chosen.get(node).is_some_and(|set| set.contains(device));
    }
    let mut outcome = Outcome {
        conflicts,
        idle_gpu_nodes,
        ..Outcome::default()
    };
    for (&(node, device), fact) in &facts {
        let Some((policy, _)) = policies.get(node) else {
            continue;
        };
        if let Some(change) = book.advance(node, device, fact, *policy, waiting, timing, now) {
            if change == Change::SchedulerTookControllerDevice {
                let holders = capacity.holders(node, device, "");
                outcome
                    .intruders
                    .insert((node.to_owned(), device.to_owned()), holders);
            }
            outcome
                .changes
                .push((node.to_owned(), device.to_owned(), change));
        }
    }
    let published: HashMap<String, Vec<String>> = devices
        .iter()
        .map(|(node, list)| {
            let names = list.iter().map(|d| d.name.to_owned()).collect();
            ((*node).to_owned(), names)
        })
        .collect();
    book.retain(&published);
    book.mark_decided();
    count_owners(ctx, book, &facts);
    for &node in devices.keys().filter(|n| policies.contains_key(*n)) {
        outcome.records.insert(node.to_owned(), book.record(node));
    }
    outcome.publications = publications(ctx, devices, policies, book, &facts);
    outcome.due = [book.next_due(timing, now), expiry]
        .into_iter()
        .flatten()
        .min();
    outcome
}

/// Every published device's facts, the idle whole GPUs per node, and the devices found in two
/// exclusive allocations.
fn gather<'a>(
    ctx: &ClaimsContext,
    capacity: &CapacityIndex,
    book: &DeviceOwnership,
    devices: &BTreeMap<&'a str, Vec<Published<'a>>>,
    policies: &BTreeMap<&str, (NodePolicy, OwnershipRecord)>,
) -> (
    Facts<'a>,
    BTreeMap<String, IdleGpus>,
    Vec<conflicts::Conflict>,
) {
    let is_ours = |r: &ObjectRef<ResourceClaim>| {
        ctx.core
            .caches
            .claims
            .get(r)
            .is_some_and(|claim| annotated_node(&claim).is_some())
    };
    let mut facts = Facts::new();
    let mut idle: BTreeMap<String, IdleGpus> = BTreeMap::new();
    let mut conflicts = Vec::new();
    for (&node, published) in devices {
        let Some((policy, record)) = policies.get(node) else {
            continue;
        };
        for device in published {
            let (ours, others) = capacity.holder_kinds(node, device.name, is_ours);
            if conflicts::is_conflict(&capacity.index().gpu_usage(node, device.name)) {
                conflicts.push(conflicts::Conflict {
                    node: node.to_owned(),
                    device: device.name.to_owned(),
                    holders: capacity.holders(node, device.name, ""),
                });
            }
            let fact = DeviceFacts {
                mig: device.mig,
                published: device.owner,
                recorded: record.owner(device.name),
                held_by_controller: ours,
                held_by_scheduler: others,
                demanded: false,
            };
            if !ours && !others && !device.mig {
                let lists = idle.entry(node.to_owned()).or_default();
                lists.keeps_node_tainted |= idle_gpu_counts(&device_taints(device.device));
                match (policy, book.wanted(node, device.name)) {
                    (NodePolicy::Fixed(Owner::Controller), _) => {}
                    (NodePolicy::Fixed(Owner::Scheduler), _) | (_, Some(Owner::Scheduler)) => {
                        lists.scheduler.push(device.name.to_owned());
                    }
                    _ => lists.controller.push(device.name.to_owned()),
                }
            }
            facts.insert((node, device.name), fact);
        }
    }
    (facts, idle, conflicts)
}

/// Sets `kerf_controller_ownership_devices` from the book.
fn count_owners(ctx: &ClaimsContext, book: &DeviceOwnership, facts: &Facts<'_>) {
    let (mut scheduler, mut controller, mut settling) = (0, 0, 0);
    for &(node, device) in facts.keys() {
        match (book.wanted(node, device), book.usable(node, device)) {
            (Some(Owner::Scheduler), _) => scheduler += 1,
            (Some(Owner::Controller), true) => controller += 1,
            (Some(Owner::Controller), false) => settling += 1,
            (None, _) => {}
        }
    }
    ctx.core
        .metrics
        .set_ownership_devices(scheduler, controller, settling);
}

/// Per node, the GPUs to publish as shareable ([`crate::scheduler_slices`]): only GPUs the scheduler
/// owns and no claim of the controller holds, so a share never lands on a GPU the controller
/// places on. Nothing is shared without DRAConsumableCapacity.
fn publications(
    ctx: &ClaimsContext,
    devices: &BTreeMap<&str, Vec<Published>>,
    policies: &BTreeMap<&str, (NodePolicy, OwnershipRecord)>,
    book: &DeviceOwnership,
    facts: &Facts<'_>,
) -> BTreeMap<String, SharedPublication> {
    let sliced = if ctx.core.api_support.consumable_capacity.is_served() {
        crate::scheduler_slices::sliced_classes(
            &ctx.core.caches.device_classes.state(),
            ctx.core.driver(),
        )
    } else {
        Vec::new()
    };
    let mut out = BTreeMap::new();
    for (&node, published) in devices.iter().filter(|(n, _)| policies.contains_key(*n)) {
        let gpus = published
            .iter()
            .filter(|d| book.wanted(node, d.name) == Some(Owner::Scheduler))
            .filter(|d| {
                facts
                    .get(&(node, d.name))
                    .is_some_and(|f| !f.held_by_controller)
            })
            .map(|d| d.device);
        out.insert(
            node.to_owned(),
            crate::scheduler_slices::node_publication(gpus, ctx.core.driver(), &sliced),
        );
    }
    out
}

async fn report(ctx: &ClaimsContext, outcome: &Outcome) {
    let mut freed = false;
    for (node, device, change) in &outcome.changes {
        match change {
            Change::Moved { to } => {
                ctx.core.metrics.record_ownership_move(to.as_str());
                tracing::debug!(%node, %device, owner = %to, "device given to a new owner");
            }
            Change::Usable => {
                freed = true;
                tracing::debug!(%node, %device, "fence passed: the controller places on the device");
            }
            Change::ReclaimAbandoned => {
                tracing::debug!(%node, %device, "the scheduler allocated the device during its fence; it stays the scheduler's");
            }
            Change::SchedulerTookControllerDevice => {
                let holders = outcome
                    .intruders
                    .get(&(node.clone(), device.clone()))
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                warn_intruders(ctx, node, device, holders).await;
            }
        }
    }
    if freed {
        ctx.capacity_freed();
    }
}

async fn warn_intruders(
    ctx: &ClaimsContext,
    node: &str,
    device: &str,
    holders: &[ObjectRef<ResourceClaim>],
) {
    for holder in holders {
        let Some(claim) = ctx.core.caches.claims.get(holder) else {
            continue;
        };
        if annotated_node(&claim).is_some() {
            continue;
        }
        let classes = guard::request_classes(&claim).join(", ");
        let note = format!(
            "device {node}/{device} belongs to kerf-controller (published with {}=controller), \
             yet this claim was allocated it by kube-scheduler: DeviceClass {classes} lacks the \
             ownership guard (make it from a GpuClass, or add `{}` to its selector)",
            kerf_api::ownership::ATTRIBUTE,
            kerf_api::ownership::scheduler_guard_cel(ctx.core.driver()),
        );
        tracing::warn!(claim = %holder, %node, %device, "kube-scheduler allocated a device kerf-controller owns");
        publish(ctx, &claim, EventType::Warning, SCHEDULER_TOOK_DEVICE, note).await;
    }
}

/// Writes each node's record and shared publication where the Node's annotations differ, both
/// in one patch: the plugin then never sees a GPU shared that the record gives the controller.
/// True when a node's write is left for later (in back-off, or failed): the pass that writes it
/// must come without an input change.
async fn write_records(
    ctx: &ClaimsContext,
    outcome: &Outcome,
    policies: &BTreeMap<&str, (NodePolicy, OwnershipRecord)>,
) -> bool {
    let api: Api<Node> = Api::all(ctx.core.client.clone());
    let params = PatchParams {
        field_manager: Some(ctx.core.config.field_manager.clone()),
        ..PatchParams::default()
    };
    let empty = SharedPublication::default();
    let mut later = false;
    for (node, record) in &outcome.records {
        let publication = outcome.publications.get(node).unwrap_or(&empty);
        let record_same = policies
            .get(node.as_str())
            .is_some_and(|(_, current)| current == record);
        let publication_same = current_publication(ctx, node).as_ref() == Some(publication);
        let backoff_key = node_write_key(node);
        if record_same && publication_same {
            continue;
        }
        if ctx
            .core
            .backoff
            .backing_off(&ctx.core.config.backoff, &backoff_key)
        {
            later = true;
            continue;
        }
        let patch = annotations_patch(
            (!record_same).then_some(record),
            (!publication_same).then_some(publication),
        );
        match api.patch(node, &params, &Patch::Merge(&patch)).await {
            Ok(_) => {
                ctx.core.backoff.succeeded(&backoff_key);
                let record = record.to_annotation();
                let shared = publication.to_annotation_value();
                tracing::debug!(%node, %record, %shared, "ownership record written");
            }
            Err(kube::Error::Api(status)) if status.code == 404 => {
                ctx.core.backoff.forget(&backoff_key);
                tracing::debug!(%node, "node deleted before its ownership record was written");
            }
            // Backed off per node, and told on the Node when refused or persistent.
            Err(error) => {
                later = true;
                node_write_failed(ctx, node, &backoff_key, "ownership record", &error).await;
            }
        }
    }
    later
}

/// A merge patch of the annotations that differ: the record, the shared publication, or both.
fn annotations_patch(
    record: Option<&OwnershipRecord>,
    publication: Option<&SharedPublication>,
) -> serde_json::Value {
    let mut annotations = serde_json::Map::new();
    if let Some(record) = record {
        annotations.insert(RECORD_ANNOTATION.to_owned(), record.to_annotation().into());
    }
    if let Some(publication) = publication {
        // An empty publication removes the annotation: absent reads as empty.
        let value = if publication.0.is_empty() {
            serde_json::Value::Null
        } else {
            publication.to_annotation_value().into()
        };
        annotations.insert(SHARED_PUBLICATION_ANNOTATION.to_owned(), value);
    }
    serde_json::json!({ "metadata": { "annotations": annotations } })
}

/// The node's shared publication as cached; `None` when the node is unknown or its annotation
/// does not parse (it is then rewritten).
fn current_publication(ctx: &ClaimsContext, node: &str) -> Option<SharedPublication> {
    let node = ctx.nodes.get(&ObjectRef::<Node>::new(node))?;
    SharedPublication::from_annotations(node.metadata.annotations.as_ref()).ok()
}
