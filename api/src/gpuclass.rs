//! The GpuClass custom resource: an admin's class of GPUs, reconciled into a DeviceClass.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::params::{
    Allocator, GpuClassParameters, GpuSelector, Placement, SharingConfig, Slicing,
};

/// The condition type that says whether the class is usable.
pub const CONDITION_READY: &str = "Ready";

/// `GpuClass.spec`: which GPUs, which allocator, and how they are sliced, placed and shared.
// Several printcolumns share `type_ = "string"`, which clippy takes for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpu.kerf.dev",
    version = "v1alpha1",
    kind = "GpuClass",
    plural = "gpuclasses",
    shortname = "gpuc",
    status = "GpuClassStatus",
    derive = "PartialEq",
    doc = "GpuClass is an admin's class of GPUs. kerf's controller reconciles each GpuClass into a DeviceClass of the same name and reports what the class matches.",
    printcolumn(name = "Allocator", type_ = "string", json_path = ".spec.allocator"),
    printcolumn(
        name = "DeviceClass",
        type_ = "string",
        json_path = ".status.deviceClassName"
    ),
    printcolumn(
        name = "Devices",
        type_ = "integer",
        json_path = ".status.matchingDevices"
    ),
    printcolumn(
        name = "Free memory",
        type_ = "string",
        json_path = ".status.freeMemory"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.selector) || !has(self.selector.migProfile) || self.allocator == 'Scheduler'",
        "message": "selector.migProfile needs allocator Scheduler: MIG devices are allocated by kube-scheduler",
        "fieldPath": ".selector.migProfile",
    },
    {
        "rule": "!has(self.sharing) || !has(self.sharing.timeSliceInterval) || (has(self.sharing.strategy) && self.sharing.strategy == 'TimeSlicing')",
        "message": "sharing.timeSliceInterval needs sharing.strategy TimeSlicing: only time-sliced GPUs have a time slice",
        "fieldPath": ".sharing.timeSliceInterval",
    },
]))]
pub struct GpuClassSpec {
    /// Scheduler (default): whole GPUs and MIG devices allocated by kube-scheduler.
    /// Controller: GPU slices and topology-constrained sets allocated by kerf's controller.
    #[serde(default)]
    pub allocator: Allocator,
    /// Which GPUs the class selects. Empty selects every kerf GPU.
    #[serde(default)]
    pub selector: GpuSelector,
    /// How GPUs are cut into slices (Controller classes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slicing: Option<Slicing>,
    /// Where slices are placed (Controller classes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
    /// How devices are shared, and the time slice of time-sliced GPUs; passed to the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<SharingConfig>,
}

/// `GpuClass.status`, written by the controller.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuClassStatus {
    /// Name of the DeviceClass the controller maintains for this class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_class_name: Option<String>,
    /// How many published devices match the selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matching_devices: Option<i64>,
    /// Total memory of the matching GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::quantity")]
    pub total_memory: Option<Quantity>,
    /// Memory of the matching GPUs not allocated to any claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::quantity")]
    pub free_memory: Option<Quantity>,
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready says whether the DeviceClass is in place and devices match, with reason and message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::schema::conditions")]
    pub conditions: Vec<Condition>,
}

impl GpuClassSpec {
    /// Checks every value: those the CRD schema cannot (quantities, compute capability) and
    /// those its CEL rules check too (MIG with the Controller allocator, a time slice interval
    /// without TimeSlicing); `path` is usually `spec`.
    ///
    /// # Errors
    ///
    /// [`crate::Error::InvalidConfig`] naming the first bad field and its value.
    pub fn validate(&self, path: &str) -> Result<()> {
        self.parameters().validate(path)
    }

    /// The class settings as the opaque `GpuClassParameters` the DeviceClass carries.
    pub fn parameters(&self) -> GpuClassParameters {
        GpuClassParameters::from(self)
    }
}

impl From<&GpuClassSpec> for GpuClassParameters {
    fn from(spec: &GpuClassSpec) -> Self {
        GpuClassParameters {
            allocator: spec.allocator,
            selector: spec.selector.clone(),
            slicing: spec.slicing.clone(),
            placement: spec.placement,
            sharing: spec.sharing,
        }
    }
}

impl GpuClassStatus {
    /// The Ready condition, when there is one.
    pub fn ready(&self) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == CONDITION_READY)
    }
}
