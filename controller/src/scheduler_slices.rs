//! Scheduler slices: which GPUs are published as shareable, and how they are sliced.
//!
//! The kubelet plugin cannot evaluate classes, so the controller decides and tells each node
//! through [`SHARED_PUBLICATION_ANNOTATION`]: a GPU is published as shareable when
//! - the ownership record gives it to kube-scheduler and no claim of the controller holds it
//!   (the caller passes only such GPUs), and
//! - a sliced Scheduler class ([`GpuClassParameters::is_scheduler_sliced`]) selects it, and
//!   every sliced Scheduler class that selects it slices it alike.
//!
//! Two sliced classes that select one GPU with different slicing make it a **conflict**: the
//! GPU is published whole (no entry) and both classes report `Ready=False`, reason
//! `ConflictingSlicing`, naming the GPU. The classes are read from the DeviceClass cache
//! (each carries its `GpuClassParameters` as opaque config), so the ownership tick and the
//! GpuClass reconciler see the same classes, and hand-written DeviceClasses count too.
//!
//! [`SHARED_PUBLICATION_ANNOTATION`]: kerf_api::shared_publication::SHARED_PUBLICATION_ANNOTATION

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{Device, DeviceClass};
use kerf_api::controller_claims::class_parameters;
use kerf_api::params::GpuClassParameters;
use kerf_api::resourceslice::{DeviceFields, TYPE_GPU, attributes, device_attribute};
use kerf_api::shared_publication::{SharedPublication, SharedSlicing};
use kube::ResourceExt as _;

use crate::selector::{DeviceKind, DeviceSelector};

/// A sliced Scheduler class: its name, which GPUs it selects and how it slices them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlicedClass {
    /// The DeviceClass (and GpuClass) name.
    pub name: String,
    /// The GPUs it selects.
    pub selector: DeviceSelector,
    /// The publication entry of a GPU it alone (or with like classes) selects.
    pub slicing: SharedSlicing,
}

/// The publication entry of a sliced Scheduler class's parameters; `None` for any other class
/// or one whose values do not check (the GpuClass reconciler reports those as InvalidSpec).
pub(crate) fn slicing_of(params: &GpuClassParameters) -> Option<SharedSlicing> {
    if !params.is_scheduler_sliced() || params.validate("spec").is_err() {
        return None;
    }
    let slicing = params.slicing.as_ref()?;
    let entry = SharedSlicing {
        memory_granularity_bytes: slicing.memory_granularity_bytes("spec.slicing").ok()?,
        default_compute_percent: slicing.default_compute,
        max_slices_per_gpu: slicing.max_slices_per_gpu,
        sharing: params.sharing,
    };
    entry.validate("spec").ok().map(|()| entry)
}

/// Every sliced Scheduler class of `driver` among `device_classes`, by name.
pub(crate) fn sliced_classes(
    device_classes: &[Arc<DeviceClass>],
    driver: &str,
) -> Vec<SlicedClass> {
    let mut out: Vec<SlicedClass> = device_classes
        .iter()
        .filter(|dc| dc.metadata.deletion_timestamp.is_none())
        .filter_map(|dc| {
            let params = class_parameters(dc, driver)?;
            let slicing = slicing_of(&params)?;
            let selector = DeviceSelector::new(&params, "spec").ok()?;
            (selector.kind == DeviceKind::WholeGpu).then(|| SlicedClass {
                name: dc.name_any(),
                selector,
                slicing,
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Whether `device` is a whole GPU that may be shared: `type: gpu` and not the full-GPU
/// device of a dynamic-MIG GPU (one that consumes counters, which kube-scheduler allocates
/// against its placements).
pub(crate) fn is_shareable_gpu<D: DeviceFields>(device: &D, driver: &str) -> bool {
    device_attribute(device, driver, attributes::TYPE).and_then(|a| a.string.as_deref())
        == Some(TYPE_GPU)
        && !device.consumes_counters()
}

/// What the sliced classes make of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GpuSlicing {
    /// No sliced class selects it: published whole.
    Whole,
    /// Published as shareable with this slicing.
    Shared(SharedSlicing),
    /// Sliced classes that select it disagree (their names, sorted): published whole.
    Conflict(Vec<String>),
}

/// What `classes` make of `device`.
pub(crate) fn gpu_slicing<D: DeviceFields>(
    device: &D,
    driver: &str,
    classes: &[SlicedClass],
) -> GpuSlicing {
    if !is_shareable_gpu(device, driver) {
        return GpuSlicing::Whole;
    }
    let selecting: Vec<&SlicedClass> = classes
        .iter()
        .filter(|c| c.selector.matches(device, driver))
        .collect();
    match selecting.split_first() {
        None => GpuSlicing::Whole,
        Some((first, rest)) if rest.iter().all(|c| c.slicing == first.slicing) => {
            GpuSlicing::Shared(first.slicing.clone())
        }
        Some(_) => GpuSlicing::Conflict(selecting.iter().map(|c| c.name.clone()).collect()),
    }
}

/// The publication of one node: the entries of `gpus` (the GPUs the record gives the
/// scheduler that no controller claim holds) that `classes` slice without conflict.
pub(crate) fn node_publication<'a, D: DeviceFields + 'a>(
    gpus: impl IntoIterator<Item = &'a D>,
    driver: &str,
    classes: &[SlicedClass],
) -> SharedPublication {
    SharedPublication(
        gpus.into_iter()
            .filter_map(|device| match gpu_slicing(device, driver, classes) {
                GpuSlicing::Shared(slicing) => Some((device.device_name().to_owned(), slicing)),
                GpuSlicing::Whole | GpuSlicing::Conflict(_) => None,
            })
            .collect(),
    )
}

/// What kerf-controller publishes for one node (`pool`) from the DeviceClasses it caches:
/// the shared publication of `gpus` (pass only those the ownership record gives the scheduler
/// and no controller claim holds, as the ownership tick does in `claims/ownership.rs`
/// `publications`), and per sliced class the GPUs (`pool/device`) it selects in conflict
/// with another, which the GpuClass reconciler reports as `ConflictingSlicing`. For callers
/// that model the controller without running it (`kerf demo`); it assumes the API server
/// serves DRAConsumableCapacity.
pub fn node_shares(
    device_classes: &[Arc<DeviceClass>],
    driver: &str,
    pool: &str,
    gpus: &[Device],
) -> (SharedPublication, BTreeMap<String, Vec<String>>) {
    let sliced = sliced_classes(device_classes, driver);
    let publication = node_publication(gpus, driver, &sliced);
    let conflicts = conflicts(gpus.iter().map(|d| (pool, d)), driver, &sliced);
    (publication, conflicts)
}

/// Per sliced class, the GPUs (`node/device`, sorted) it selects in conflict with another
/// sliced class. `devices` are `(pool, device)` of the driver's current slices; ownership does
/// not matter here — the classes disagree whoever owns the GPU today.
pub(crate) fn conflicts<'a, D: DeviceFields + 'a>(
    devices: impl IntoIterator<Item = (&'a str, &'a D)>,
    driver: &str,
    classes: &[SlicedClass],
) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (pool, device) in devices {
        if let GpuSlicing::Conflict(names) = gpu_slicing(device, driver, classes) {
            for name in names {
                out.entry(name)
                    .or_default()
                    .push(format!("{pool}/{}", device.device_name()));
            }
        }
    }
    for gpus in out.values_mut() {
        gpus.sort();
        gpus.dedup();
    }
    out
}
