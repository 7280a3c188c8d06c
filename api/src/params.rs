//! The opaque parameter kinds of `gpu.kerf.dev/v1alpha1` and their strict decoding.
//!
//! These objects travel in `opaque.parameters` of ResourceClaim and DeviceClass configs and of
//! `status.allocation.devices.config[]`. The API server stores them unvalidated, so every reader
//! goes through [`decode_opaque`]: wrong apiVersion, unknown kind, unknown field, wrong type or
//! an out-of-range value is an [`Error::InvalidConfig`] whose message names the field path and
//! the value.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kerf_core::enforcement::Enforcement;
use kerf_core::inventory::ComputeCapability;
use kerf_core::mps::TimeSliceInterval;
use kerf_core::sharing::{Sharing, SliceLimits};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::group::API_VERSION;
use crate::quantity;

/// Which allocator hands out a class's devices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Allocator {
    /// kube-scheduler's structured-parameters allocator: whole GPUs and MIG devices chosen by
    /// CEL selectors.
    #[default]
    Scheduler,
    /// kerf's controller: GPU slices and topology-constrained sets, by claim parameters.
    Controller,
}

/// How the controller spreads slices over GPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum PlacementPolicy {
    /// Keep the cluster's free GPU capacity usable by the pods it runs: the node and GPUs
    /// whose use least fragments the node against the workload the controller has seen
    /// (kerf-core's `Policy::LeastFragmentation`); BinPack while no workload is known.
    #[default]
    LeastFragmentation,
    /// Fill the most used GPUs first, keeping whole GPUs free.
    BinPack,
    /// Use the least used GPUs first, spreading load.
    Spread,
}

/// How close the devices of one request must be to each other (for `count` > 1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum TopologyScope {
    /// Any devices of one node.
    #[default]
    Any,
    /// Devices behind one PCIe root complex.
    #[serde(rename = "PCIeRoot")]
    PcieRoot,
    /// Devices in one NVLink domain.
    #[serde(rename = "NVLink")]
    NvLink,
}

/// Schema stand-in for [`Sharing`], which lives in kerf-core (no schemars there).
#[derive(JsonSchema)]
#[schemars(rename = "Sharing")]
#[allow(dead_code)]
enum SharingSchema {
    Exclusive,
    #[schemars(rename = "MPS")]
    Mps,
    TimeSlicing,
}

/// Schema stand-in for [`Enforcement`], which lives in kerf-core (no schemars there).
#[derive(JsonSchema)]
#[schemars(rename = "Enforcement")]
#[allow(dead_code)]
enum EnforcementSchema {
    ClientEnvironment,
    Server,
}

/// Schema stand-in for [`TimeSliceInterval`], which lives in kerf-core (no schemars there).
#[derive(JsonSchema)]
#[schemars(rename = "TimeSliceInterval")]
#[allow(dead_code)]
enum TimeSliceIntervalSchema {
    Default,
    Short,
    Medium,
    Long,
}

/// Which GPUs a class selects. Every set field must match; an empty selector matches all.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuSelector {
    /// Product names (`productName` attribute), any of which matches, e.g. `NVIDIA H100 80GB HBM3`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(inner(length(min = 1, max = 64)))]
    pub product_names: Vec<String>,
    /// Minimum memory of the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::quantity")]
    pub min_memory: Option<Quantity>,
    /// Minimum CUDA compute capability, `major.minor`, e.g. `8.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+\.[0-9]+$"))]
    pub min_compute_capability: Option<String>,
    /// Select MIG devices of this profile (e.g. `1g.10gb`) instead of whole GPUs.
    /// Only for the Scheduler allocator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub mig_profile: Option<String>,
}

/// How the controller cuts GPUs into slices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Slicing {
    /// Slice memory is a multiple of this; claims asking for other sizes are rejected.
    #[serde(default = "default_memory_granularity")]
    #[schemars(schema_with = "crate::schema::quantity_with_default_1gi")]
    pub memory_granularity: Quantity,
    /// Most slices one GPU is cut into; unlimited when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_slices_per_gpu: Option<u32>,
    /// Compute percent given to a slice whose claim sets memory but not compute.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "deserialize_percent"
    )]
    #[schemars(range(min = 1, max = 100))]
    pub default_compute: Option<u8>,
}

impl Default for Slicing {
    fn default() -> Self {
        Slicing {
            memory_granularity: default_memory_granularity(),
            max_slices_per_gpu: None,
            default_compute: None,
        }
    }
}

fn default_memory_granularity() -> Quantity {
    Quantity("1Gi".to_owned())
}

/// Where the controller places slices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ControllerPlacement {
    /// LeastFragmentation (default), BinPack or Spread.
    #[serde(default)]
    pub policy: PlacementPolicy,
}

/// How devices of a class are shared.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SharingConfig {
    /// Exclusive (default), MPS or TimeSlicing.
    #[serde(default)]
    #[schemars(with = "SharingSchema")]
    pub strategy: Sharing,
    /// How long each claim runs on a time-sliced GPU before the next one: Default (the
    /// driver's), Short, Medium or Long (`nvidia-smi compute-policy --set-timeslice`). Only
    /// with strategy TimeSlicing. A GPU keeps the interval of the first claim prepared on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<TimeSliceIntervalSchema>")]
    pub time_slice_interval: Option<TimeSliceInterval>,
    /// The weakest holder of an MPS slice's limits the class accepts: ClientEnvironment
    /// (default; the slice may share its GPU with slices of other sizes, and then only its
    /// container's environment holds it, which its process can clear) or Server (the GPU's
    /// MPS server holds the limits: the slice shares its GPU only with MPS slices of its
    /// size). Server needs strategy MPS (or a class that takes whole GPUs or MIG devices,
    /// which the hardware holds) and the Controller allocator for slices.
    #[serde(default, skip_serializing_if = "Enforcement::is_default")]
    #[schemars(with = "EnforcementSchema")]
    pub enforcement: Enforcement,
}

/// Topology constraint of a claim's request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Topology {
    /// Any (default), PCIeRoot or NVLink.
    #[serde(default)]
    pub scope: TopologyScope,
}

/// `kind: GpuClaimParameters`: what a claim asks for, per device. A whole GPU when neither
/// `memory` nor `compute` is set.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuClaimParameters {
    /// Device memory per device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::quantity")]
    pub memory: Option<Quantity>,
    /// Percent (1–100) of the GPU's multiprocessors per device.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "deserialize_percent"
    )]
    #[schemars(range(min = 1, max = 100))]
    pub compute: Option<u8>,
    /// How the device is shared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<SharingSchema>")]
    pub sharing: Option<Sharing>,
    /// Topology constraint for requests of more than one device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<Topology>,
}

/// `kind: GpuClassParameters`: a class's settings, carried as DeviceClass config so that
/// hand-written DeviceClasses work without a GpuClass. The same fields as `GpuClass.spec`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuClassParameters {
    /// Scheduler (default) or Controller.
    #[serde(default)]
    pub allocator: Allocator,
    /// Which GPUs the class selects.
    #[serde(default, skip_serializing_if = "GpuSelector::is_empty")]
    pub selector: GpuSelector,
    /// Slicing limits: of the controller's slices (Controller classes), or of the shares
    /// kube-scheduler cuts from GPUs published as shareable (Scheduler classes, Kubernetes
    /// 1.36+ with DRAConsumableCapacity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slicing: Option<Slicing>,
    /// Placement policy (Controller classes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<ControllerPlacement>,
    /// Sharing strategy and time slice interval passed to the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<SharingConfig>,
}

/// `kind: GpuSliceAllocation`: the slices the controller allocated, written into
/// `status.allocation.devices.config[]` (`source: FromClaim`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuSliceAllocation {
    /// One entry per allocated device.
    pub devices: Vec<SliceDevice>,
}

/// The resolved slice of one allocated device: everything the node needs to prepare it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SliceDevice {
    /// Pool of the allocation result (the node name).
    pub pool: String,
    /// Device of the allocation result, e.g. `gpu-3`.
    pub device: String,
    /// Share ID of the allocation result, when the device was allocated as a share.
    #[serde(rename = "shareID", default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// UUID of the physical GPU, so the node can check it prepares the GPU that was allocated.
    #[serde(rename = "gpuUUID")]
    pub gpu_uuid: String,
    /// Memory the slice may pin, in bytes; the whole GPU's when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub memory_bytes: Option<u64>,
    /// Percent (1–100) of the GPU's multiprocessors; all when unset.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "deserialize_percent"
    )]
    #[schemars(range(min = 1, max = 100))]
    pub compute_percent: Option<u8>,
    /// How the device is shared.
    #[serde(default)]
    #[schemars(with = "SharingSchema")]
    pub sharing: Sharing,
    /// The class's time slice, for a TimeSlicing device whose class names one. Absent in
    /// allocations written before classes could name one, which get the driver's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<TimeSliceIntervalSchema>")]
    pub time_slice_interval: Option<TimeSliceInterval>,
    /// Server when the class requires the GPU's MPS server to hold the slice, so that the
    /// allocator keeps the GPU's MPS slices to its size. Absent (ClientEnvironment) in
    /// allocations of other classes and in those written before classes could require it.
    #[serde(default, skip_serializing_if = "Enforcement::is_default")]
    #[schemars(with = "EnforcementSchema")]
    pub enforcement: Enforcement,
}

/// A decoded opaque configuration of one of kerf's kinds.
#[derive(Debug, Clone, PartialEq)]
pub enum OpaqueConfig {
    /// `GpuClaimParameters`.
    Claim(GpuClaimParameters),
    /// `GpuClassParameters`.
    Class(GpuClassParameters),
    /// `GpuSliceAllocation`.
    Slice(GpuSliceAllocation),
}

/// A kind of opaque parameters: its `kind` name and its encoding with `apiVersion`/`kind`.
pub trait OpaqueKind: Serialize {
    /// The `kind` field's value.
    const KIND: &'static str;

    /// The object to put in `opaque.parameters`: the fields plus `apiVersion` and `kind`.
    ///
    /// # Errors
    ///
    /// [`Error::Serialize`] if the value does not serialise to a JSON object.
    fn to_parameters(&self) -> Result<Value> {
        let value = serde_json::to_value(self).map_err(|e| Error::Serialize {
            what: Self::KIND,
            message: e.to_string(),
        })?;
        let Value::Object(fields) = value else {
            return Err(Error::Serialize {
                what: Self::KIND,
                message: "not a JSON object".to_owned(),
            });
        };
        let mut object = Map::new();
        object.insert(
            "apiVersion".to_owned(),
            Value::String(API_VERSION.to_owned()),
        );
        object.insert("kind".to_owned(), Value::String(Self::KIND.to_owned()));
        object.extend(fields);
        Ok(Value::Object(object))
    }

    /// [`OpaqueKind::to_parameters`] wrapped as the `RawExtension` the API types use.
    ///
    /// # Errors
    ///
    /// As [`OpaqueKind::to_parameters`].
    fn to_raw_extension(&self) -> Result<RawExtension> {
        self.to_parameters().map(RawExtension)
    }
}

impl OpaqueKind for GpuClaimParameters {
    const KIND: &'static str = "GpuClaimParameters";
}

impl OpaqueKind for GpuClassParameters {
    const KIND: &'static str = "GpuClassParameters";
}

impl OpaqueKind for GpuSliceAllocation {
    const KIND: &'static str = "GpuSliceAllocation";
}

const KNOWN_KINDS: &str = "GpuClaimParameters, GpuClassParameters, GpuSliceAllocation";

/// Decodes an `opaque.parameters` object of driver kerf, strictly.
///
/// `field_path` is where `parameters` sits in the enclosing object, e.g.
/// `spec.devices.config[1].opaque.parameters`; error messages extend it to the field at fault.
///
/// # Errors
///
/// [`Error::InvalidConfig`] when `parameters` is not an object, its `apiVersion` is not
/// `gpu.kerf.dev/v1alpha1`, its `kind` is unknown, a field is unknown or of the wrong type,
/// or a value is out of range (see each kind's `validate`).
pub fn decode_opaque(parameters: &Value, field_path: &str) -> Result<OpaqueConfig> {
    let Value::Object(object) = parameters else {
        return Err(Error::config(
            field_path,
            format!(
                "expected an object with apiVersion and kind, got {}",
                show(parameters)
            ),
        ));
    };
    let api_version = required_string(object, "apiVersion", field_path)?;
    if api_version != API_VERSION {
        return Err(Error::config(
            join(field_path, "apiVersion"),
            format!("{api_version:?} is not supported; expected {API_VERSION:?}"),
        ));
    }
    let kind = required_string(object, "kind", field_path)?;
    let mut body = object.clone();
    body.remove("apiVersion");
    body.remove("kind");
    let body = Value::Object(body);
    match kind {
        GpuClaimParameters::KIND => {
            decode_kind::<GpuClaimParameters>(body, field_path).map(OpaqueConfig::Claim)
        }
        GpuClassParameters::KIND => {
            decode_kind::<GpuClassParameters>(body, field_path).map(OpaqueConfig::Class)
        }
        GpuSliceAllocation::KIND => {
            decode_kind::<GpuSliceAllocation>(body, field_path).map(OpaqueConfig::Slice)
        }
        other => Err(Error::config(
            join(field_path, "kind"),
            format!("unknown kind {other:?}; expected one of {KNOWN_KINDS}"),
        )),
    }
}

impl OpaqueConfig {
    /// The kind's name.
    pub fn kind(&self) -> &'static str {
        match self {
            OpaqueConfig::Claim(_) => GpuClaimParameters::KIND,
            OpaqueConfig::Class(_) => GpuClassParameters::KIND,
            OpaqueConfig::Slice(_) => GpuSliceAllocation::KIND,
        }
    }

    /// The object to put in `opaque.parameters`.
    ///
    /// # Errors
    ///
    /// As [`OpaqueKind::to_parameters`].
    pub fn to_parameters(&self) -> Result<Value> {
        match self {
            OpaqueConfig::Claim(c) => c.to_parameters(),
            OpaqueConfig::Class(c) => c.to_parameters(),
            OpaqueConfig::Slice(s) => s.to_parameters(),
        }
    }
}

trait Validate {
    fn validate_at(&self, path: &str) -> Result<()>;
}

fn decode_kind<T: DeserializeOwned + Validate>(body: Value, base: &str) -> Result<T> {
    let value: T = serde_path_to_error::deserialize(body)
        .map_err(|e| Error::config(join(base, &e.path().to_string()), e.inner().to_string()))?;
    value.validate_at(base)?;
    Ok(value)
}

fn required_string<'a>(object: &'a Map<String, Value>, field: &str, base: &str) -> Result<&'a str> {
    match object.get(field) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(Error::config(
            join(base, field),
            format!("expected a string, got {}", show(other)),
        )),
        None => Err(Error::config(
            join(base, field),
            format!(
                "missing; expected {field}: {}",
                if field == "kind" {
                    KNOWN_KINDS
                } else {
                    API_VERSION
                }
            ),
        )),
    }
}

impl GpuClaimParameters {
    /// True when the claim asks for whole GPUs.
    pub fn is_whole(&self) -> bool {
        self.memory.is_none() && self.compute.is_none()
    }

    /// Checks every value; `path` is where this object sits, for the messages.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a memory that is not a positive whole number of bytes, or a
    /// compute percent outside 1–100.
    pub fn validate(&self, path: &str) -> Result<()> {
        self.limits(path).map(|_| ())
    }

    /// The slice limits this claim asks for.
    ///
    /// # Errors
    ///
    /// As [`GpuClaimParameters::validate`].
    pub fn limits(&self, path: &str) -> Result<SliceLimits> {
        let memory_bytes = self
            .memory
            .as_ref()
            .map(|q| quantity_at(q, &join(path, "memory")))
            .transpose()?;
        if let Some(compute) = self.compute {
            check_percent(compute, &join(path, "compute"))?;
        }
        Ok(SliceLimits {
            memory_bytes,
            compute_percent: self.compute,
        })
    }
}

impl Validate for GpuClaimParameters {
    fn validate_at(&self, path: &str) -> Result<()> {
        self.validate(path)
    }
}

impl GpuSelector {
    /// True when the selector matches every GPU.
    pub fn is_empty(&self) -> bool {
        self == &GpuSelector::default()
    }

    /// The minimum compute capability, parsed.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when it is not `major.minor`.
    pub fn min_compute_capability(&self, path: &str) -> Result<Option<ComputeCapability>> {
        self.min_compute_capability
            .as_deref()
            .map(|text| {
                parse_compute_capability(text).ok_or_else(|| {
                    Error::config(
                        join(path, "minComputeCapability"),
                        format!("{text:?} is not a compute capability of the form major.minor, e.g. \"8.0\""),
                    )
                })
            })
            .transpose()
    }

    /// The minimum memory in bytes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when it is not a positive whole number of bytes.
    pub fn min_memory_bytes(&self, path: &str) -> Result<Option<u64>> {
        self.min_memory
            .as_ref()
            .map(|q| quantity_at(q, &join(path, "minMemory")))
            .transpose()
    }

    /// Checks every value against `allocator`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the first bad field.
    pub fn validate(&self, allocator: Allocator, path: &str) -> Result<()> {
        for (i, name) in self.product_names.iter().enumerate() {
            check_short_string(name, &format!("{}[{i}]", join(path, "productNames")))?;
        }
        self.min_memory_bytes(path)?;
        self.min_compute_capability(path)?;
        if let Some(profile) = &self.mig_profile {
            let field = join(path, "migProfile");
            check_short_string(profile, &field)?;
            if allocator != Allocator::Scheduler {
                return Err(Error::config(
                    field,
                    format!(
                        "{profile:?}: MIG devices are allocated by the Scheduler allocator, not {allocator:?}"
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl Slicing {
    /// The memory granularity in bytes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when it is not a positive whole number of bytes.
    pub fn memory_granularity_bytes(&self, path: &str) -> Result<u64> {
        quantity_at(&self.memory_granularity, &join(path, "memoryGranularity"))
    }

    /// Checks every value.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the first bad field.
    pub fn validate(&self, path: &str) -> Result<()> {
        self.memory_granularity_bytes(path)?;
        if self.max_slices_per_gpu == Some(0) {
            return Err(Error::config(
                join(path, "maxSlicesPerGpu"),
                "0 is out of range: must be at least 1",
            ));
        }
        if let Some(compute) = self.default_compute {
            check_percent(compute, &join(path, "defaultCompute"))?;
        }
        Ok(())
    }
}

impl SharingConfig {
    /// The time slice for a device shared by `sharing` under this class: the class's interval
    /// when the device is time-sliced, `None` otherwise (a claim may override the class's
    /// strategy, and an interval means nothing to an MPS or exclusive device).
    pub(crate) fn time_slice_interval_for(self, sharing: Sharing) -> Option<TimeSliceInterval> {
        self.time_slice_interval
            .filter(|_| sharing == Sharing::TimeSlicing)
    }

    /// Checks that an interval comes with strategy TimeSlicing; `path` is where this object
    /// sits, for the message.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] at `<path>.timeSliceInterval` when it is set with another
    /// strategy.
    pub fn validate(&self, path: &str) -> Result<()> {
        check_interval_sharing(self.time_slice_interval, self.strategy, path, "strategy")
    }
}

/// An interval set with a sharing other than TimeSlicing is refused rather than ignored: the
/// writer meant the GPU to be time-sliced and would otherwise never learn it is not.
fn check_interval_sharing(
    interval: Option<TimeSliceInterval>,
    sharing: Sharing,
    path: &str,
    sharing_field: &str,
) -> Result<()> {
    match interval {
        Some(interval) if sharing != Sharing::TimeSlicing => Err(Error::config(
            join(path, "timeSliceInterval"),
            format!(
                "{interval:?} applies to time-sliced GPUs only; {sharing_field} is {}, not TimeSlicing",
                sharing.as_str()
            ),
        )),
        _ => Ok(()),
    }
}

impl GpuClassParameters {
    /// Checks every value; `path` is where this object sits, for the messages.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the first bad field.
    pub fn validate(&self, path: &str) -> Result<()> {
        self.selector
            .validate(self.allocator, &join(path, "selector"))?;
        if let Some(slicing) = &self.slicing {
            slicing.validate(&join(path, "slicing"))?;
            if let (true, Some(profile)) = (self.is_scheduler_sliced(), &self.selector.mig_profile)
            {
                return Err(Error::config(
                    join(path, "slicing"),
                    format!(
                        "a sliced Scheduler class shares whole GPUs; MIG devices (selector.migProfile {profile:?}) are not shareable"
                    ),
                ));
            }
        }
        if let Some(sharing) = &self.sharing {
            sharing.validate(&join(path, "sharing"))?;
            // Shares of a GPU published as shareable run side by side, which an exclusive GPU
            // cannot do; the node refuses such a publication, so the class is refused first.
            if self.is_scheduler_sliced() && sharing.strategy == Sharing::Exclusive {
                return Err(Error::config(
                    join(&join(path, "sharing"), "strategy"),
                    "Exclusive cannot share a GPU among the slices of a sliced Scheduler class: use MPS or TimeSlicing (or leave sharing unset for MPS)",
                ));
            }
            self.check_enforcement(*sharing, &join(&join(path, "sharing"), "enforcement"))?;
        }
        Ok(())
    }

    /// Server enforcement of slices needs MPS (its server is what holds them) and kerf's
    /// controller (which keeps a GPU's MPS slices to one size; kube-scheduler cuts shares of
    /// any size). Classes of whole GPUs or MIG devices are held by the hardware anyway.
    fn check_enforcement(&self, sharing: SharingConfig, path: &str) -> Result<()> {
        if sharing.enforcement != Enforcement::Server || self.slicing.is_none() {
            return Ok(());
        }
        if self.is_scheduler_sliced() {
            return Err(Error::config(
                path,
                "Server needs allocator Controller: kube-scheduler cuts shares of any size from a shareable GPU, and one MPS server holds only slices of one size",
            ));
        }
        match sharing.strategy {
            Sharing::Mps => Ok(()),
            other => Err(Error::config(
                path,
                format!(
                    "Server holds MPS slices only; strategy {} leaves a slice's memory unlimited (TimeSlicing) or its limits unenforced (Exclusive)",
                    other.as_str()
                ),
            )),
        }
    }

    /// Whether the class is a sliced Scheduler class: kube-scheduler allocates shares of GPUs
    /// published as shareable (consumable capacity) rather than whole GPUs.
    pub fn is_scheduler_sliced(&self) -> bool {
        self.allocator == Allocator::Scheduler && self.slicing.is_some()
    }

    /// The slice memory granularity in bytes, when the class sets slicing.
    ///
    /// # Errors
    ///
    /// As [`Slicing::memory_granularity_bytes`].
    pub fn memory_granularity_bytes(&self, path: &str) -> Result<Option<u64>> {
        self.slicing
            .as_ref()
            .map(|s| s.memory_granularity_bytes(&join(path, "slicing")))
            .transpose()
    }
}

impl Validate for GpuClassParameters {
    fn validate_at(&self, path: &str) -> Result<()> {
        self.validate(path)
    }
}

impl GpuSliceAllocation {
    /// Checks every device entry; `path` is where this object sits, for the messages.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for an empty list, an empty pool, device or GPU UUID, zero memory,
    /// a compute percent outside 1–100, a time slice interval on a device whose sharing is not
    /// TimeSlicing, or two entries for the same device and share.
    pub fn validate(&self, path: &str) -> Result<()> {
        let devices = join(path, "devices");
        if self.devices.is_empty() {
            return Err(Error::config(devices, "must list at least one device"));
        }
        for (i, device) in self.devices.iter().enumerate() {
            let at = format!("{devices}[{i}]");
            device.validate(&at)?;
            let duplicate = self.devices[..i].iter().any(|d| {
                d.pool == device.pool && d.device == device.device && d.share_id == device.share_id
            });
            if duplicate {
                return Err(Error::config(
                    at,
                    format!(
                        "device {:?} of pool {:?} is listed twice",
                        device.device, device.pool
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The entry for the allocation result `pool`/`device`/`share_id`, when there is one.
    pub fn find(&self, pool: &str, device: &str, share_id: Option<&str>) -> Option<&SliceDevice> {
        self.devices.iter().find(|d| {
            d.pool == pool
                && d.device == device
                && (d.share_id.is_none() || d.share_id.as_deref() == share_id)
        })
    }
}

impl Validate for GpuSliceAllocation {
    fn validate_at(&self, path: &str) -> Result<()> {
        self.validate(path)
    }
}

impl SliceDevice {
    /// The limits of this slice.
    pub fn limits(&self) -> SliceLimits {
        SliceLimits {
            memory_bytes: self.memory_bytes,
            compute_percent: self.compute_percent,
        }
    }

    fn validate(&self, path: &str) -> Result<()> {
        for (field, value) in [
            ("pool", &self.pool),
            ("device", &self.device),
            ("gpuUUID", &self.gpu_uuid),
        ] {
            if value.is_empty() {
                return Err(Error::config(join(path, field), "must not be empty"));
            }
        }
        if self.memory_bytes == Some(0) {
            return Err(Error::config(
                join(path, "memoryBytes"),
                "0 is out of range: must be at least 1",
            ));
        }
        if self.memory_bytes.is_some_and(|b| b > quantity::MAX_BYTES) {
            return Err(Error::config(
                join(path, "memoryBytes"),
                format!(
                    "{} is larger than 2^63-1",
                    self.memory_bytes.unwrap_or_default()
                ),
            ));
        }
        if let Some(compute) = self.compute_percent {
            check_percent(compute, &join(path, "computePercent"))?;
        }
        check_interval_sharing(self.time_slice_interval, self.sharing, path, "sharing")
    }
}

/// Parses `major.minor` into a compute capability.
fn parse_compute_capability(text: &str) -> Option<ComputeCapability> {
    let (major, minor) = text.split_once('.')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(major) || !digits(minor) {
        return None;
    }
    Some(ComputeCapability {
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
    })
}

/// Appends a field to a path: `a` + `b` → `a.b`; `a` + `[0].b` → `a[0].b`.
pub(crate) fn join(base: &str, field: &str) -> String {
    match (base, field) {
        (_, "" | ".") => base.to_owned(),
        ("", _) => field.to_owned(),
        (_, f) if f.starts_with('[') => format!("{base}{f}"),
        _ => format!("{base}.{field}"),
    }
}

/// A quantity's bytes, with a parse error re-labelled as a config error at `path`.
pub(crate) fn quantity_at(quantity: &Quantity, path: &str) -> Result<u64> {
    quantity::quantity_bytes(quantity).map_err(|e| Error::config(path, e.to_string()))
}

fn check_percent(value: u8, path: &str) -> Result<()> {
    if (1..=100).contains(&value) {
        Ok(())
    } else {
        Err(Error::config(
            path,
            format!("{value} is out of range 1-100"),
        ))
    }
}

/// Strings that end up compared with published attributes, which are at most 64 bytes.
fn check_short_string(value: &str, path: &str) -> Result<()> {
    if value.is_empty() {
        Err(Error::config(path, "must not be empty"))
    } else if value.len() > 64 {
        Err(Error::config(
            path,
            format!("{:?} is longer than 64 bytes", show_str(value)),
        ))
    } else {
        Ok(())
    }
}

/// Accepts any JSON number so that `150` and `300` both get the range message rather than
/// serde's "expected u8".
fn deserialize_percent<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u8>, D::Error> {
    let Some(number) = Option::<serde_json::Number>::deserialize(deserializer)? else {
        return Ok(None);
    };
    match number.as_u64().and_then(|v| u8::try_from(v).ok()) {
        Some(v @ 1..=100) => Ok(Some(v)),
        _ if number.is_f64() => Err(serde::de::Error::custom(format!(
            "{number} is not a whole percent: expected an integer 1-100"
        ))),
        _ => Err(serde::de::Error::custom(format!(
            "{number} is out of range 1-100"
        ))),
    }
}

/// A JSON value for an error message, cut short.
fn show(value: &Value) -> String {
    show_str(&value.to_string())
}

fn show_str(text: &str) -> String {
    const LIMIT: usize = 80;
    match text.char_indices().nth(LIMIT) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests;
