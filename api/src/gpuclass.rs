//! The GpuClass custom resource: an admin's class of GPUs, reconciled into a DeviceClass.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::params::{
    Allocator, ControllerPlacement, GpuClassParameters, GpuSelector, SharingConfig, Slicing,
};

/// The condition type that says whether the class is usable.
pub const CONDITION_READY: &str = "Ready";

/// The condition type that says whether `spec.extendedResourceName` reached the DeviceClass;
/// present only on classes that set the name.
pub const CONDITION_EXTENDED_RESOURCE: &str = "ExtendedResource";

/// Longest extended resource name: kube-apiserver checks `requests.<name>` as a qualified name
/// (`IsExtendedResourceName`), whose prefix is a DNS subdomain of at most 253 characters and
/// whose name part has at most 63, so the prefix of the name itself has at most 244.
#[cfg(test)]
const MAX_EXTENDED_RESOURCE_NAME_LEN: usize = 244 + 1 + 63;

/// The prefix kube-apiserver reserves for resource quota keys; names may not start with it.
const QUOTA_REQUESTS_PREFIX: &str = "requests.";

/// The domain of Kubernetes' own resources; extended resource names may not contain it.
const NATIVE_RESOURCE_DOMAIN: &str = "kubernetes.io/";

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
        name = "Extended resource",
        type_ = "string",
        json_path = ".spec.extendedResourceName",
        priority = 1
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
    {
        "rule": "!has(self.slicing) || self.allocator != 'Scheduler' || !has(self.selector) || !has(self.selector.migProfile)",
        "message": "slicing of a Scheduler class shares whole GPUs; MIG devices (selector.migProfile) are not shareable",
        "fieldPath": ".slicing",
    },
    {
        "rule": "!has(self.slicing) || self.allocator != 'Scheduler' || !has(self.sharing) || !has(self.sharing.strategy) || self.sharing.strategy != 'Exclusive'",
        "message": "sharing.strategy Exclusive cannot share a GPU among the slices of a sliced Scheduler class: use MPS or TimeSlicing",
        "fieldPath": ".sharing.strategy",
    },
    {
        "rule": "!has(self.extendedResourceName) || (!self.extendedResourceName.contains('kubernetes.io/') && !self.extendedResourceName.startsWith('requests.'))",
        "message": "extendedResourceName must not be in the kubernetes.io/ domain nor start with requests. (Kubernetes' IsExtendedResourceName)",
        "fieldPath": ".extendedResourceName",
    },
]))]
pub struct GpuClassSpec {
    /// Scheduler (default): whole GPUs, MIG devices and (with `slicing`) GPU slices allocated
    /// by kube-scheduler.
    /// Controller: GPU slices and topology-constrained sets allocated by kerf's controller.
    #[serde(default)]
    pub allocator: Allocator,
    /// Which GPUs the class selects. Empty selects every kerf GPU.
    #[serde(default)]
    pub selector: GpuSelector,
    /// How GPUs are cut into slices. Controller classes: the controller's slices. Scheduler
    /// classes: the selected GPUs are published as shareable (`allowMultipleAllocations`,
    /// consumable capacities `memory` and `compute`) and kube-scheduler allocates shares of
    /// them to claims that ask with `capacity.requests`; this needs Kubernetes 1.36+ with
    /// DRAConsumableCapacity (the class reports Ready=False, reason
    /// ConsumableCapacityUnavailable, without it). Two sliced Scheduler classes that select
    /// one GPU must slice it alike, or the GPU is published whole (reason ConflictingSlicing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slicing: Option<Slicing>,
    /// Where slices are placed (Controller classes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<ControllerPlacement>,
    /// How devices are shared, and the time slice of time-sliced GPUs; passed to the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<SharingConfig>,
    /// The extended resource name by which pods may ask for this class's devices without a
    /// ResourceClaim (`resources.limits: {gpu.kerf.dev/gpu: 1}`), written into the
    /// DeviceClass's `spec.extendedResourceName` (Kubernetes 1.36+, feature DRAExtendedResource).
    /// Scheduler classes only: kube-scheduler allocates such requests itself, so a Controller
    /// class reports condition ExtendedResource=False instead. Format: `<domain>/<name>`,
    /// not in the kubernetes.io domain; unique among the cluster's DeviceClasses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 3, max = 308),
        regex(
            pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
        )
    )]
    pub extended_resource_name: Option<String>,
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
    /// The largest matching device (by memory): what a GpuQuota charges for one whole device
    /// of this class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub largest_device: Option<DeviceSizeStatus>,
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready says whether the DeviceClass is in place and devices match, with reason and message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::schema::conditions")]
    pub conditions: Vec<Condition>,
}

/// The size of one device, as a GpuQuota charges it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeviceSizeStatus {
    /// Its memory.
    #[schemars(schema_with = "crate::schema::quantity")]
    pub memory: Quantity,
    /// Its compute in percent of a GPU: 100 for a GPU, a MIG device its share of the GPU's
    /// multiprocessors.
    pub compute: u64,
}

impl GpuClassSpec {
    /// Checks every value: those the CRD schema cannot (quantities, compute capability) and
    /// those its CEL rules check too (MIG with the Controller allocator, a time slice interval
    /// without TimeSlicing); `path` is usually `spec`.
    ///
    /// # Errors
    ///
    /// [`crate::error::Error::InvalidConfig`] naming the first bad field and its value.
    pub fn validate(&self, path: &str) -> Result<()> {
        self.parameters().validate(path)?;
        if let Some(name) = &self.extended_resource_name {
            validate_extended_resource_name(name, &format!("{path}.extendedResourceName"))?;
        }
        Ok(())
    }

    /// The class settings as the opaque `GpuClassParameters` the DeviceClass carries.
    pub fn parameters(&self) -> GpuClassParameters {
        GpuClassParameters::from(self)
    }
}

/// Checks `name` as kube-apiserver checks a DeviceClass's `spec.extendedResourceName`
/// (kubernetes/kubernetes `pkg/apis/resource/validation/validation.go`, `validateDeviceClassSpec`,
/// which calls `IsExtendedResourceName` of `pkg/apis/core/v1/helper/helpers.go`): the name has
/// a `/` and is not in the `kubernetes.io/` domain, does not start with `requests.`, and
/// `requests.<name>` is a qualified name — a DNS-subdomain prefix of at most 253 characters,
/// `/`, and a name of at most 63 alphanumerics, `-`, `_` and `.` that starts and ends
/// alphanumeric.
///
/// # Errors
///
/// [`crate::error::Error::InvalidConfig`] at `path`, naming the value and the rule it breaks.
pub fn validate_extended_resource_name(name: &str, path: &str) -> Result<()> {
    let invalid = |why: &str| {
        Err(crate::error::Error::config(
            path,
            format!("{name:?} is not a valid extended resource name: {why}"),
        ))
    };
    let Some((domain, local)) = name.split_once('/') else {
        return invalid("it needs a domain prefix, e.g. gpu.kerf.dev/gpu");
    };
    if name.contains(NATIVE_RESOURCE_DOMAIN) {
        return invalid("the kubernetes.io domain is reserved for Kubernetes' own resources");
    }
    if name.starts_with(QUOTA_REQUESTS_PREFIX) {
        return invalid("the prefix requests. is reserved for resource quota");
    }
    let quota_domain = format!("{QUOTA_REQUESTS_PREFIX}{domain}");
    if !crate::resourceslice::is_dns_subdomain(&quota_domain) {
        return invalid(
            "the prefix must be a DNS subdomain (lower-case alphanumerics, '-' and '.') of at most 244 characters",
        );
    }
    let local_ok = !local.is_empty()
        && local.len() <= 63
        && local
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && local.starts_with(|c: char| c.is_ascii_alphanumeric())
        && local.ends_with(|c: char| c.is_ascii_alphanumeric());
    if !local_ok {
        return invalid(
            "the part after '/' must be 1-63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric",
        );
    }
    Ok(())
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
        self.condition(CONDITION_READY)
    }

    /// The condition of type `type_`, when there is one.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extended_resource_names_follow_kubernetes_rules() {
        for good in [
            "gpu.kerf.dev/gpu",
            "gpu.kerf.dev/slice-10gi",
            "example.com/A_b.c",
            "a/b",
        ] {
            validate_extended_resource_name(good, "spec.extendedResourceName").unwrap();
        }
        for (bad, why) in [
            ("gpu", "domain prefix"),
            ("kubernetes.io/gpu", "kubernetes.io"),
            ("gpu.kubernetes.io/gpu", "kubernetes.io"),
            ("requests.gpu.kerf.dev/gpu", "requests."),
            ("Gpu.kerf.dev/gpu", "DNS subdomain"),
            ("gpu.kerf.dev/", "after '/'"),
            ("gpu.kerf.dev/-gpu", "after '/'"),
            ("gpu.kerf.dev/a/b", "after '/'"),
        ] {
            let error = validate_extended_resource_name(bad, "spec.extendedResourceName")
                .unwrap_err()
                .to_string();
            assert!(
                error.starts_with("spec.extendedResourceName: ") && error.contains(why),
                "{bad}: {error}"
            );
            assert!(error.contains(&format!("{bad:?}")), "{error}");
        }
        let long = format!("{}.dev/gpu", "a".repeat(245 - 4));
        assert!(validate_extended_resource_name(&long, "x").is_err());
        let fits = format!("{}.dev/{}", "a".repeat(240), "g".repeat(63));
        assert_eq!(fits.len(), MAX_EXTENDED_RESOURCE_NAME_LEN);
        validate_extended_resource_name(&fits, "x").unwrap();
    }

    #[test]
    fn the_spec_check_covers_the_name() {
        let spec = GpuClassSpec {
            extended_resource_name: Some("nvidia".to_owned()),
            ..GpuClassSpec::default()
        };
        let error = spec.validate("spec").unwrap_err().to_string();
        assert!(error.contains("spec.extendedResourceName"), "{error}");
    }
}
