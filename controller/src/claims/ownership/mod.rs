//! One allocator per device: the controller decides who owns each published device, writes it
//! into the node's ownership record (the Node annotation
//! [`kerf_api::ownership::RECORD_ANNOTATION`]), places only on devices it owns past their fence,
//! and reports what breaks the rule.
//!
//! Every tick ([`ClaimSettings::ownership_tick`](super::ClaimSettings)) the controller reads
//! the published devices, who holds each (its own allocations in flight included), the
//! pending demand for kube-scheduler and each node's policy label, advances the
//! [`OwnershipBook`] under the ledger lock that placement also takes, and then writes the
//! records that changed. Why this cannot hand a device to both allocators is written in
//! [`book`].

mod book;
mod conflicts;
mod demand;
mod extended;
mod guard;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{Device, ResourceClaim};
use kerf_api::ownership::{NodePolicy, Owner, RECORD_ANNOTATION, Record, node_policy};
use kerf_api::resourceslice::{TYPE_MIG, attributes, device_attribute};
use kerf_api::shared_publication::{SHARED_PUBLICATION_ANNOTATION, SharedPublication};
use kube::Api;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use tokio_util::sync::CancellationToken;

pub use book::{Change, DeviceFacts, OwnershipBook, OwnershipTiming};

use super::context::ClaimsContext;
use super::report::{node_write_failed, node_write_key, publish};
use super::state::annotated_node;
use demand::IdleGpus;

/// Event reason: kube-scheduler allocated a device the controller owns.
pub const SCHEDULER_TOOK_DEVICE: &str = "AllocatorGuardMissing";

/// What the tick loop remembers between ticks: what it already warned about.
#[derive(Debug, Default)]
pub(super) struct Warned {
    node_labels: HashSet<(String, String)>,
    device_classes: HashSet<(String, String)>,
    conflicts: HashSet<(String, String)>,
}

/// Advances ownership every tick until `shutdown`.
pub(super) async fn run(ctx: Arc<ClaimsContext>, shutdown: CancellationToken) {
    if ctx.wait_ready().await.is_err() {
        return;
    }
    let mut interval = tokio::time::interval(ctx.settings.ownership_tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned = Warned::default();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = interval.tick() => {}
        }
        tick(&ctx, &mut warned).await;
    }
}

/// A published device as the tick needs it.
#[derive(Debug, Clone)]
struct Published {
    name: String,
    /// Only kube-scheduler allocates it: a MIG device, or a dynamic-MIG GPU's full device
    /// (it consumes counters, which only kube-scheduler's allocator accounts for).
    mig: bool,
    owner: Option<Owner>,
    /// The device as published, for the sliced classes' selectors.
    device: Device,
}

/// One tick: decide, report, write the records.
pub(super) async fn tick(ctx: &ClaimsContext, warned: &mut Warned) {
    let devices = published_devices(ctx);
    let policies = node_policies(ctx, &devices, warned);
    let needs = demand::pending_needs(ctx);
    let outcome = advance(ctx, &devices, &policies, &needs);
    report(ctx, &outcome).await;
    conflicts::report(ctx, &outcome.conflicts, &mut warned.conflicts).await;
    guard::warn_unguarded_classes(ctx, &mut warned.device_classes).await;
    write_records(ctx, &outcome, &policies).await;
}

/// Every published device of the driver, by node.
fn published_devices(ctx: &ClaimsContext) -> BTreeMap<String, Vec<Published>> {
    let driver = ctx.driver();
    let mut out: BTreeMap<String, Vec<Published>> = BTreeMap::new();
    for slice in ctx.base.caches.slices.state() {
        let spec = &slice.spec;
        let Some(node) = spec.node_name.as_deref().filter(|_| spec.driver == driver) else {
            continue;
        };
        let devices = out.entry(node.to_owned()).or_default();
        for device in spec.devices.iter().flatten() {
            let mig = device_attribute(device, driver, attributes::TYPE)
                .and_then(|a| a.string.as_deref())
                == Some(TYPE_MIG)
                || device
                    .consumes_counters
                    .as_ref()
                    .is_some_and(|c| !c.is_empty());
            devices.push(Published {
                name: device.name.clone(),
                mig,
                owner: kerf_api::ownership::published_owner(device, driver),
                device: device.clone(),
            });
        }
    }
    out
}

/// Each node's policy label and current record (an unreadable label or record is warned
/// about once and read as dynamic / empty).
fn node_policies(
    ctx: &ClaimsContext,
    devices: &BTreeMap<String, Vec<Published>>,
    warned: &mut Warned,
) -> BTreeMap<String, (NodePolicy, Record)> {
    let mut out = BTreeMap::new();
    for name in devices.keys() {
        let Some(node) = ctx.nodes.get(&ObjectRef::<Node>::new(name)) else {
            continue;
        };
        let policy = node_policy(node.metadata.labels.as_ref()).unwrap_or_else(|error| {
            let key = (name.clone(), error.to_string());
            if warned.node_labels.insert(key) {
                tracing::warn!(node = %name, %error, "ignoring the node's allocator label; its devices are moved dynamically");
            }
            NodePolicy::Dynamic
        });
        let record =
            Record::from_annotations(node.metadata.annotations.as_ref()).unwrap_or_default();
        out.insert(name.clone(), (policy, record));
    }
    out
}

/// What one tick decided.
#[derive(Debug, Default)]
struct Outcome {
    changes: Vec<(String, String, Change)>,
    /// Claims holding a device kube-scheduler took from the controller, per device.
    intruders: HashMap<(String, String), Vec<ObjectRef<ResourceClaim>>>,
    records: BTreeMap<String, Record>,
    /// Per node, the GPUs to publish as shareable ([`crate::shared`]).
    publications: BTreeMap<String, SharedPublication>,
    conflicts: Vec<conflicts::Conflict>,
}

fn advance(
    ctx: &ClaimsContext,
    devices: &BTreeMap<String, Vec<Published>>,
    policies: &BTreeMap<String, (NodePolicy, Record)>,
    needs: &[demand::SchedulerNeed],
) -> Outcome {
    let is_ours = |r: &ObjectRef<ResourceClaim>| {
        ctx.claims
            .get(r)
            .is_some_and(|claim| annotated_node(&claim).is_some())
    };
    let timing = ctx.settings.ownership;
    let now = std::time::Instant::now();
    let mut books = ctx.books();
    let waiting = books.controller_waiting();
    let (capacity, book) = books.ownership();
    let mut facts: BTreeMap<(String, String), DeviceFacts> = BTreeMap::new();
    let mut idle: BTreeMap<String, IdleGpus> = BTreeMap::new();
    let mut conflicts = Vec::new();
    for (node, published) in devices {
        let Some((policy, record)) = policies.get(node) else {
            continue;
        };
        for device in published {
            let (ours, others) = capacity.holder_kinds(node, &device.name, is_ours);
            if conflicts::is_conflict(&capacity.index().gpu_usage(node, &device.name)) {
                conflicts.push(conflicts::Conflict {
                    node: node.clone(),
                    device: device.name.clone(),
                    holders: capacity.holders(node, &device.name, ""),
                });
            }
            let fact = DeviceFacts {
                mig: device.mig,
                published: device.owner,
                recorded: record.owner(&device.name),
                held_by_controller: ours,
                held_by_scheduler: others,
                demanded: false,
            };
            if !ours && !others && !device.mig {
                let lists = idle.entry(node.clone()).or_default();
                match (policy, book.wanted(node, &device.name)) {
                    (NodePolicy::Fixed(Owner::Controller), _) => {}
                    (NodePolicy::Fixed(Owner::Scheduler), _) | (_, Some(Owner::Scheduler)) => {
                        lists.scheduler.push(device.name.clone());
                    }
                    _ => lists.controller.push(device.name.clone()),
                }
            }
            facts.insert((node.clone(), device.name.clone()), fact);
        }
    }
    for (node, chosen) in demand::serve(needs, idle, &ctx.nodes) {
        for device in chosen {
            if let Some(fact) = facts.get_mut(&(node.clone(), device)) {
                fact.demanded = true;
            }
        }
    }
    let mut outcome = Outcome {
        conflicts,
        ..Outcome::default()
    };
    for ((node, device), fact) in &facts {
        let Some((policy, _)) = policies.get(node) else {
            continue;
        };
        if let Some(change) = book.advance(node, device, fact, *policy, waiting, timing, now) {
            if change == Change::SchedulerTookControllerDevice {
                let holders = capacity.holders(node, device, "");
                outcome
                    .intruders
                    .insert((node.clone(), device.clone()), holders);
            }
            outcome.changes.push((node.clone(), device.clone(), change));
        }
    }
    let published: HashMap<String, Vec<String>> = devices
        .iter()
        .map(|(node, list)| (node.clone(), list.iter().map(|d| d.name.clone()).collect()))
        .collect();
    book.retain(&published);
    book.mark_decided();
    let (mut scheduler, mut controller, mut settling) = (0, 0, 0);
    for (node, device) in facts.keys() {
        match (book.wanted(node, device), book.usable(node, device)) {
            (Some(Owner::Scheduler), _) => scheduler += 1,
            (Some(Owner::Controller), true) => controller += 1,
            (Some(Owner::Controller), false) => settling += 1,
            (None, _) => {}
        }
    }
    ctx.base
        .metrics
        .set_ownership_devices(scheduler, controller, settling);
    for node in devices.keys().filter(|n| policies.contains_key(*n)) {
        outcome.records.insert(node.clone(), book.record(node));
    }
    outcome.publications = publications(ctx, devices, policies, book, &facts);
    outcome
}

/// Per node, the GPUs to publish as shareable ([`crate::shared`]): only GPUs the scheduler
/// owns and no claim of the controller holds, so a share never lands on a GPU the controller
/// places on. Nothing is shared without DRAConsumableCapacity.
fn publications(
    ctx: &ClaimsContext,
    devices: &BTreeMap<String, Vec<Published>>,
    policies: &BTreeMap<String, (NodePolicy, Record)>,
    book: &OwnershipBook,
    facts: &BTreeMap<(String, String), DeviceFacts>,
) -> BTreeMap<String, SharedPublication> {
    let sliced = if ctx.base.api_support.consumable_capacity.is_served() {
        crate::shared::sliced_classes(&ctx.base.caches.device_classes.state(), ctx.driver())
    } else {
        Vec::new()
    };
    let mut out = BTreeMap::new();
    for (node, published) in devices.iter().filter(|(n, _)| policies.contains_key(*n)) {
        let gpus = published
            .iter()
            .filter(|d| book.wanted(node, &d.name) == Some(Owner::Scheduler))
            .filter(|d| {
                facts
                    .get(&(node.clone(), d.name.clone()))
                    .is_some_and(|f| !f.held_by_controller)
            })
            .map(|d| &d.device);
        out.insert(
            node.clone(),
            crate::shared::node_publication(gpus, ctx.driver(), &sliced),
        );
    }
    out
}

async fn report(ctx: &ClaimsContext, outcome: &Outcome) {
    let mut freed = false;
    for (node, device, change) in &outcome.changes {
        match change {
            Change::Moved { to } => {
                ctx.base.metrics.record_ownership_move(to.as_str());
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
        let Some(claim) = ctx.claims.get(holder) else {
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
            kerf_api::ownership::scheduler_guard_cel(ctx.driver()),
        );
        tracing::warn!(claim = %holder, %node, %device, "kube-scheduler allocated a device kerf-controller owns");
        publish(ctx, &claim, EventType::Warning, SCHEDULER_TOOK_DEVICE, note).await;
    }
}

/// Writes each node's record and shared publication where the Node's annotations differ, both
/// in one patch: the plugin then never sees a GPU shared that the record gives the controller.
async fn write_records(
    ctx: &ClaimsContext,
    outcome: &Outcome,
    policies: &BTreeMap<String, (NodePolicy, Record)>,
) {
    let api: Api<Node> = Api::all(ctx.base.client.clone());
    let params = PatchParams {
        field_manager: Some(ctx.base.config.field_manager.clone()),
        ..PatchParams::default()
    };
    let empty = SharedPublication::default();
    for (node, record) in &outcome.records {
        let publication = outcome.publications.get(node).unwrap_or(&empty);
        let record_same = policies
            .get(node)
            .is_some_and(|(_, current)| current == record);
        let publication_same = current_publication(ctx, node).as_ref() == Some(publication);
        let backoff_key = node_write_key(node);
        if (record_same && publication_same)
            || ctx
                .base
                .backoff
                .backing_off(&ctx.base.config.backoff, &backoff_key)
        {
            continue;
        }
        let mut annotations = serde_json::Map::new();
        if !record_same {
            annotations.insert(RECORD_ANNOTATION.to_owned(), record.to_annotation().into());
        }
        if !publication_same {
            // An empty publication removes the annotation: absent reads as empty.
            let value = if publication.0.is_empty() {
                serde_json::Value::Null
            } else {
                publication.to_annotation_value().into()
            };
            annotations.insert(SHARED_PUBLICATION_ANNOTATION.to_owned(), value);
        }
        let patch = serde_json::json!({ "metadata": { "annotations": annotations } });
        match api.patch(node, &params, &Patch::Merge(&patch)).await {
            Ok(_) => {
                ctx.base.backoff.succeeded(&backoff_key);
                let record = record.to_annotation();
                let shared = publication.to_annotation_value();
                tracing::debug!(%node, %record, %shared, "ownership record written");
            }
            Err(kube::Error::Api(status)) if status.code == 404 => {
                ctx.base.backoff.forget(&backoff_key);
                tracing::debug!(%node, "node deleted before its ownership record was written");
            }
            // Backed off per node, and told on the Node when refused or persistent.
            Err(error) => node_write_failed(ctx, node, &error).await,
        }
    }
}

/// The node's shared publication as cached; `None` when the node is unknown or its annotation
/// does not parse (it is then rewritten).
fn current_publication(ctx: &ClaimsContext, node: &str) -> Option<SharedPublication> {
    let node = ctx.nodes.get(&ObjectRef::<Node>::new(node))?;
    SharedPublication::from_annotations(node.metadata.annotations.as_ref()).ok()
}
