//! The GpuClass reconciler: GpuClass → owned DeviceClass, and the class status.
//!
//! Each reconcile
//! 1. checks the spec (what the CRD schema cannot: quantities, MIG with the Controller
//!    allocator) — an invalid spec only gets `Ready=False, reason InvalidSpec`, and the
//!    DeviceClass keeps its last valid form;
//! 2. refuses to take over a DeviceClass of the same name that it does not control
//!    (`DeviceClassConflict`): an admin's hand-written class is never overwritten;
//! 3. applies the DeviceClass (server-side apply, field manager `kerf-controller`, owner
//!    reference with `controller: true`) unless the cached one is already as desired, with
//!    `spec.extendedResourceName` where [`extended_resource::decide`] says so — only for
//!    Scheduler classes and only when the API server keeps the field (the start-up probe in
//!    [`Context::api_support`]), so a 1.34/1.35 server that drops it causes no apply loop;
//! 4. counts the matching devices of kerf's ResourceSlices and their total and free memory
//!    from the caches, and applies the status (conditions `Ready` and, for classes that name an
//!    extended resource, `ExtendedResource`) through the status subresource — only when it
//!    changed, so the frequent claim-driven reconciles cost no writes.
//!
//! Deletion needs no finalizer: the DeviceClass is owned by the GpuClass and the garbage
//! collector deletes it with the class.
//!
//! Triggers: GpuClass changes; any change of the caches (slices, claims, DeviceClasses), which
//! re-evaluates every class — classes are few and a reconcile reads only memory, and the cache
//! notifications coalesce bursts to at most one pass per `class_status_interval`, because
//! counting capacity decodes every allocated claim; and a periodic resync.

use std::sync::Arc;

use futures::StreamExt as _;
use k8s_openapi::api::resource::v1::DeviceClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kerf_api::gpuclass::DeviceSizeStatus;
use kerf_api::gpuclass::{
    CONDITION_EXTENDED_RESOURCE, CONDITION_READY, validate_extended_resource_name,
};
use kerf_api::quantity::bytes_quantity;
use kerf_api::{API_VERSION, GpuClass, GpuClassStatus};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::capacity::{
    ClassCapacity, ClassScope, UsageMemo, class_capacity, current_devices, free_compute,
};
use crate::condition::{Verdict, condition};
use crate::context::{Context, Write};
use crate::deviceclass::{device_class, is_controlled_by, needs_apply};
use crate::error::{Error, Result};
use crate::extended_resource;
use crate::retry::Retry;
use crate::selector::DeviceSelector;

/// Name of this controller in metrics and logs.
pub(crate) const CONTROLLER: &str = "gpuclass";

/// `Ready` reasons the reconciler writes.
pub mod reasons {
    /// The DeviceClass is in place and devices match.
    pub const DEVICE_CLASS_APPLIED: &str = "DeviceClassApplied";
    /// The DeviceClass is in place but no published device matches.
    pub(crate) const NO_MATCHING_DEVICES: &str = "NoMatchingDevices";
    /// The spec has a value the controller cannot use.
    pub(crate) const INVALID_SPEC: &str = "InvalidSpec";
    /// A DeviceClass of the same name exists and this GpuClass does not control it.
    pub(crate) const DEVICE_CLASS_CONFLICT: &str = "DeviceClassConflict";
    /// A sliced Scheduler class on a cluster without DRAConsumableCapacity.
    pub const CONSUMABLE_CAPACITY_UNAVAILABLE: &str = "ConsumableCapacityUnavailable";
    /// A sliced Scheduler class selects GPUs another sliced class slices differently.
    pub const CONFLICTING_SLICING: &str = "ConflictingSlicing";
}

/// Runs the GpuClass controller until `shutdown` is cancelled; in-flight reconciles finish.
///
/// The caches in `ctx` must be running; the controller waits for their first lists so that
/// the first statuses it writes are not computed from empty caches.
///
/// # Errors
///
/// [`Error::ControllerStopped`] when the caches stop before they are ready.
pub async fn run(ctx: Arc<Context>, shutdown: CancellationToken) -> Result<()> {
    tokio::select! {
        () = shutdown.cancelled() => return Ok(()),
        ready = ctx.caches.wait_ready() => ready?,
    }
    let controller = Controller::new(
        Api::<GpuClass>::all(ctx.client.clone()),
        watcher::Config::default(),
    )
    .reconcile_all_on(ctx.caches.changes(ctx.config.class_status_interval))
    .graceful_shutdown_on(async move { shutdown.cancelled().await });
    let classes = controller.store();
    let metrics = ctx.metrics.clone();
    let applied_ctx = Arc::clone(&ctx);
    controller
        .run(
            reconcile,
            RETRY.error_policy(),
            Arc::new(ClassContext::new(ctx)),
        )
        .for_each(|result| {
            // A class gone from the cache is deleted: its failures are history.
            RETRY.applied(&applied_ctx, &result);
            let names: Vec<String> = classes.state().iter().map(|c| c.name_any()).collect();
            metrics.retain_classes(names.iter().map(String::as_str));
            std::future::ready(())
        })
        .await;
    Ok(())
}

/// The GpuClass controller's context: the shared [`Context`] and the usage computed once per
/// version of the caches for all classes of one refresh.
#[derive(Debug)]
pub struct ClassContext {
    /// The client, configuration, caches and metrics every controller shares.
    pub core: Arc<Context>,
    /// Memory and compute in use, computed once per version of the caches for all classes.
    memo: UsageMemo,
}

impl ClassContext {
    /// The GpuClass controller's context over `core`, nothing computed yet.
    pub fn new(core: Arc<Context>) -> Self {
        Self {
            core,
            memo: UsageMemo::default(),
        }
    }
}

impl AsRef<Context> for ClassContext {
    fn as_ref(&self) -> &Context {
        &self.core
    }
}

/// Reconciles one GpuClass (see the module documentation).
///
/// # Errors
///
/// API errors writing the DeviceClass or the status ([`Error::Write`], told on the class as a
/// Warning Event when refused or persistent), and a GpuClass without name or UID;
/// [`RETRY`]'s error policy retries them with per-object back-off.
pub async fn reconcile(class: Arc<GpuClass>, ctx: Arc<ClassContext>) -> Result<Action> {
    RETRY
        .reconcile(
            &ctx.core,
            RETRY.key(class.as_ref()),
            reconcile_class(&class, &ctx.core, &ctx.memo),
            async |write, source, attempts| {
                // The DeviceClass and the status are the class's: `kubectl describe gpuclass` is
                // where the user looks.
                let regarding = [class.object_ref(&())];
                ctx.core
                    .report_write_failure(write, source, attempts, &regarding)
                    .await;
            },
        )
        .await
}

/// How failed reconciles of GpuClasses are retried: after the class's next back-off delay,
/// conflicts and NotFound logged quietly unless the class keeps failing.
pub const RETRY: Retry = Retry::new(CONTROLLER);

/// The spec checks of [`GpuClassSpec::validate`](kerf_api::GpuClassSpec::validate), giving the
/// selector the status is counted with.
fn checked_selector(class: &GpuClass) -> Result<DeviceSelector> {
    let selector = DeviceSelector::new(&class.spec.parameters(), "spec")?;
    if let Some(name) = &class.spec.extended_resource_name {
        validate_extended_resource_name(name, "spec.extendedResourceName")?;
    }
    Ok(selector)
}

async fn reconcile_class(class: &GpuClass, ctx: &Context, memo: &UsageMemo) -> Result<Action> {
    if class.metadata.deletion_timestamp.is_some() {
        // The garbage collector removes the owned DeviceClass.
        return Ok(Action::await_change());
    }
    let name = class.name_any();
    let selector = match checked_selector(class) {
        Ok(selector) => selector,
        Err(error) => {
            let readiness = Verdict {
                ok: false,
                reason: reasons::INVALID_SPEC,
                message: error.to_string(),
            };
            write_status(class, ctx, None, None, readiness, None).await?;
            return Ok(Action::await_change());
        }
    };

    let existing = ctx.caches.device_classes.get(&ObjectRef::new(&name));
    if let Some(existing) = &existing
        && !is_controlled_by(existing, class)
    {
        let readiness = Verdict {
            ok: false,
            reason: reasons::DEVICE_CLASS_CONFLICT,
            message: format!(
                "DeviceClass {name} exists and is not controlled by this GpuClass; delete or rename it to let the controller manage it"
            ),
        };
        write_status(class, ctx, None, None, readiness, None).await?;
        return Ok(Action::requeue(ctx.config.resync_period));
    }

    let extended_verdict = apply_device_class(class, ctx, &name, existing.as_deref()).await?;
    let (counted, readiness) = count_capacity(class, ctx, memo, &name, &selector);
    write_status(
        class,
        ctx,
        Some(&name),
        Some(&counted),
        readiness,
        extended_verdict,
    )
    .await?;
    Ok(Action::requeue(ctx.config.resync_period))
}

/// Step 3 of a reconcile: applies the owned DeviceClass unless the cached one is already as
/// desired, giving the extended-resource verdict for the status.
async fn apply_device_class(
    class: &GpuClass,
    ctx: &Context,
    name: &str,
    existing: Option<&DeviceClass>,
) -> Result<Option<Verdict>> {
    let extended = extended_resource::decide(
        name,
        &class.spec,
        &ctx.api_support.extended_resource,
        existing,
        &ctx.caches.device_classes.state(),
    );
    let mut desired = device_class(
        class,
        ctx.config.driver_name.as_str(),
        &ctx.config.field_manager,
        ctx.api_support.consumable_capacity.is_served(),
    )?;
    desired.spec.extended_resource_name = extended.name;
    if needs_apply(existing, &desired) {
        Api::<DeviceClass>::all(ctx.client.clone())
            .patch(
                name,
                &PatchParams::apply(&ctx.config.field_manager).force(),
                &Patch::Apply(&desired),
            )
            .await
            .map_err(|e| Error::write(Write::patch("deviceclasses", None, name), e))?;
    }
    Ok(extended.verdict)
}

/// What step 4 counts: the class's devices and their memory, and its largest device (what a
/// GpuQuota charges per whole device, [`crate::quota::device_size`]).
struct Counted {
    capacity: ClassCapacity,
    largest: Option<DeviceSizeStatus>,
}

/// Step 4 of a reconcile: counts the class's matching devices and their memory from the
/// caches, sets the class gauges, and says whether the class is ready.
fn count_capacity(
    class: &GpuClass,
    ctx: &Context,
    memo: &UsageMemo,
    name: &str,
    selector: &DeviceSelector,
) -> (Counted, Verdict) {
    let driver = ctx.config.driver_name.as_str();
    let consumable_capacity = ctx.api_support.consumable_capacity.is_served();
    let slices = ctx.caches.slices.state();
    let claims = ctx.caches.claims.state();
    let devices = current_devices(&slices, driver);
    let usage = memo.usage(&slices, &claims, driver);
    let scope = ClassScope::of_class(selector, &class.spec.parameters(), consumable_capacity);
    let capacity = class_capacity(&scope, &devices, &usage.memory, driver);
    let largest = crate::quota::device_size::largest_device(&scope, &devices, driver);
    ctx.metrics.set_class_capacity(name, &capacity);
    let free = free_compute(&scope, &devices, &usage.compute, driver);
    ctx.metrics.set_class_free_compute(name, free);
    let readiness = if class.spec.parameters().is_scheduler_sliced() {
        let conflicts = crate::scheduler_slices::conflicts(
            devices.iter().map(|d| (d.pool, d.device)),
            driver,
            &crate::scheduler_slices::sliced_classes(&ctx.caches.device_classes.state(), driver),
        );
        sliced_readiness(
            name,
            &capacity,
            consumable_capacity,
            conflicts.get(name).map(Vec::as_slice),
        )
    } else {
        capacity_readiness(name, &capacity)
    };
    (Counted { capacity, largest }, readiness)
}

fn capacity_readiness(device_class: &str, capacity: &ClassCapacity) -> Verdict {
    if capacity.matching_devices == 0 {
        Verdict {
            ok: false,
            reason: reasons::NO_MATCHING_DEVICES,
            message: format!(
                "DeviceClass {device_class} is in place, but no published device matches the class selector"
            ),
        }
    } else {
        Verdict {
            ok: true,
            reason: reasons::DEVICE_CLASS_APPLIED,
            message: format!(
                "DeviceClass {device_class} selects {} device{}",
                capacity.matching_devices,
                if capacity.matching_devices == 1 {
                    ""
                } else {
                    "s"
                }
            ),
        }
    }
}

/// The Ready condition of a sliced Scheduler class: unavailable without
/// DRAConsumableCapacity, not ready while its GPUs are sliced differently by another class,
/// else as any class — with the Kubernetes requirement in the message.
fn sliced_readiness(
    device_class: &str,
    capacity: &ClassCapacity,
    consumable_capacity: bool,
    conflicting_gpus: Option<&[String]>,
) -> Verdict {
    if !consumable_capacity {
        return Verdict {
            ok: false,
            reason: reasons::CONSUMABLE_CAPACITY_UNAVAILABLE,
            message: format!(
                "a sliced Scheduler class needs Kubernetes 1.36+ with feature gate {}; this API server does not serve it, so DeviceClass {device_class} selects no device",
                crate::features::CONSUMABLE_CAPACITY_GATE
            ),
        };
    }
    if let Some(gpus) = conflicting_gpus.filter(|g| !g.is_empty()) {
        return Verdict {
            ok: false,
            reason: reasons::CONFLICTING_SLICING,
            message: format!(
                "another sliced Scheduler class selects {} with different slicing or sharing; published whole until the classes agree",
                gpus.join(", ")
            ),
        };
    }
    let mut readiness = capacity_readiness(device_class, capacity);
    readiness.message = format!(
        "{} (scheduler slices: GPUs published as shareable, Kubernetes 1.36+ with {})",
        readiness.message,
        crate::features::CONSUMABLE_CAPACITY_GATE
    );
    readiness
}

/// Applies the status when it differs from the current one, and publishes an Event when a
/// condition's status or reason changes.
async fn write_status(
    class: &GpuClass,
    ctx: &Context,
    device_class: Option<&str>,
    counted: Option<&Counted>,
    readiness: Verdict,
    extended: Option<Verdict>,
) -> Result<()> {
    let current = class.status.as_ref();
    let generation = class.metadata.generation;
    let previous = current.and_then(GpuClassStatus::ready);
    let ready = ready_condition(&readiness, generation, previous);
    let previous_extended = current.and_then(|s| s.condition(CONDITION_EXTENDED_RESOURCE));
    let extended_condition = extended.as_ref().map(|verdict| {
        condition(
            CONDITION_EXTENDED_RESOURCE,
            verdict,
            generation,
            previous_extended,
        )
    });
    let capacity = counted.map(|c| &c.capacity);
    let mut conditions = vec![ready.clone()];
    conditions.extend(extended_condition.clone());
    let status = GpuClassStatus {
        device_class_name: device_class
            .map(str::to_owned)
            .or_else(|| current.and_then(|s| s.device_class_name.clone())),
        matching_devices: capacity.map(|c| i64::try_from(c.matching_devices).unwrap_or(i64::MAX)),
        total_memory: capacity.map(|c| bytes_quantity(c.total_memory_bytes)),
        free_memory: capacity.map(|c| bytes_quantity(c.free_memory_bytes)),
        largest_device: counted.and_then(|c| c.largest.clone()),
        observed_generation: generation,
        conditions,
    };
    if current == Some(&status) {
        return Ok(());
    }
    let patch = json!({
        "apiVersion": API_VERSION,
        "kind": "GpuClass",
        "metadata": {"name": class.name_any()},
        "status": status,
    });
    Api::<GpuClass>::all(ctx.client.clone())
        .patch_status(
            &class.name_any(),
            &PatchParams::apply(&ctx.config.field_manager).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(|e| {
            let write = Write::patch("gpuclasses/status", None, &class.name_any());
            Error::write(write, e)
        })?;
    if changed(previous, &ready) {
        publish_event(class, ctx, &readiness).await;
    }
    if let (Some(verdict), Some(new)) = (&extended, &extended_condition)
        && changed(previous_extended, new)
    {
        publish_event(class, ctx, verdict).await;
    }
    Ok(())
}

fn changed(previous: Option<&Condition>, new: &Condition) -> bool {
    previous.is_none_or(|p| p.status != new.status || p.reason != new.reason)
}

/// The Ready condition; its transition time moves only when its status does.
fn ready_condition(
    readiness: &Verdict,
    generation: Option<i64>,
    previous: Option<&Condition>,
) -> Condition {
    condition(CONDITION_READY, readiness, generation, previous)
}

/// Events are best effort: a class whose Event cannot be written is still reconciled.
async fn publish_event(class: &GpuClass, ctx: &Context, readiness: &Verdict) {
    let event = Event {
        type_: if readiness.ok {
            EventType::Normal
        } else {
            EventType::Warning
        },
        reason: readiness.reason.to_owned(),
        note: Some(readiness.message.clone()),
        action: "Reconcile".to_owned(),
        secondary: None,
    };
    if let Err(error) = ctx.recorder.publish(&event, &class.object_ref(&())).await {
        tracing::warn!(class = %class.name_any(), %error, "cannot publish Event");
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;

    use super::*;

    fn readiness(ok: bool, reason: &'static str) -> Verdict {
        Verdict {
            ok,
            reason,
            message: "m".to_owned(),
        }
    }

    #[test]
    fn transition_time_moves_only_with_the_status() {
        let first = ready_condition(
            &readiness(false, reasons::NO_MATCHING_DEVICES),
            Some(1),
            None,
        );
        let mut old = first.clone();
        old.last_transition_time = Time(Timestamp::UNIX_EPOCH);
        let same = ready_condition(
            &readiness(false, reasons::INVALID_SPEC),
            Some(2),
            Some(&old),
        );
        assert_eq!(same.last_transition_time, old.last_transition_time);
        assert_eq!(same.reason, reasons::INVALID_SPEC);
        assert_eq!(same.observed_generation, Some(2));
        let flipped = ready_condition(
            &readiness(true, reasons::DEVICE_CLASS_APPLIED),
            Some(2),
            Some(&old),
        );
        assert_ne!(flipped.last_transition_time, old.last_transition_time);
        assert_eq!(flipped.status, "True");
    }

    #[test]
    fn no_devices_is_not_ready() {
        let none = capacity_readiness("fast", &ClassCapacity::default());
        assert!(!none.ok);
        assert_eq!(none.reason, reasons::NO_MATCHING_DEVICES);
        let some = capacity_readiness(
            "fast",
            &ClassCapacity {
                matching_devices: 1,
                total_memory_bytes: 1,
                free_memory_bytes: 1,
            },
        );
        assert!(some.ok);
        assert_eq!(some.message, "DeviceClass fast selects 1 device");
    }
}
