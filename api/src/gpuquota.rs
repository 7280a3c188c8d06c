//! The GpuQuota custom resource: how much GPU memory, compute and how many whole GPUs the
//! ResourceClaims of one namespace may hold, enforced by kerf's webhook when a claim is created.
//!
//! The model is ResourceQuota's (kubernetes/kubernetes
//! `staging/src/k8s.io/apiserver/pkg/admission/plugin/resourcequota/controller.go`,
//! `checkRequest`; `pkg/controller/resourcequota/resource_quota_controller.go`, `syncResourceQuota`):
//! - admission charges a new claim against `status.used` and writes the raised usage back with a
//!   conditional update (the quota's `resourceVersion`), so two concurrent creates can never
//!   both take the last share: one of the writes conflicts and is evaluated again;
//! - kerf-controller recomputes `status.used` from the claims that exist, the source of truth,
//!   so a missed admission or a deleted claim is corrected within one resync.
//!
//! Unlike ResourceQuota, admission also records each charge in `status.admitted` until the
//! controller sees the claim (or [`ADMITTED_GRACE`] passes): a recount that runs between an
//! admission and the claim reaching the controller's cache then keeps the charge instead of
//! lowering `used` below what was admitted.
//!
//! - [`amount`]: [`GpuAmount`], the three quantities a quota caps, and the check against `hard`;
//! - [`charge`]: what one claim is charged ([`claim_charge`]).

pub mod amount;
pub mod charge;

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::quantity::{format_bytes, quantity_bytes};

pub use amount::{Exceeded, GpuAmount, exceeded, exceeded_message};
pub use charge::{Charge, DeviceSize, QuotaClass, claim_charge};

/// How long an admitted charge counts before the controller has seen its claim: longer than a
/// claim takes from admission to the controller's watch on any healthy cluster, short enough
/// that a create that failed after admission (another webhook denied it, etcd refused it)
/// frees its share soon.
pub const ADMITTED_GRACE: Duration = Duration::from_secs(60);

/// The resource names a quota caps, as they appear in `hard`, `used` and messages.
pub const RESOURCE_MEMORY: &str = "memory";
/// See [`RESOURCE_MEMORY`].
pub const RESOURCE_COMPUTE: &str = "compute";
/// See [`RESOURCE_MEMORY`].
pub const RESOURCE_GPUS: &str = "gpus";

/// `GpuQuota.spec`: the caps of one namespace.
// Several printcolumns share `type_ = "string"`, which clippy takes for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpu.kerf.dev",
    version = "v1alpha1",
    kind = "GpuQuota",
    plural = "gpuquotas",
    shortname = "gpuq",
    namespaced,
    status = "GpuQuotaStatus",
    derive = "PartialEq",
    doc = "GpuQuota caps the GPU memory, compute and whole GPUs the ResourceClaims of its namespace may hold. kerf's webhook refuses a claim that would exceed it; kerf's controller keeps status.used.",
    printcolumn(
        name = "Memory",
        type_ = "string",
        json_path = ".status.summary.memory"
    ),
    printcolumn(
        name = "Compute",
        type_ = "string",
        json_path = ".status.summary.compute"
    ),
    printcolumn(name = "GPUs", type_ = "string", json_path = ".status.summary.gpus"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct GpuQuotaSpec {
    /// Caps over every kerf claim of the namespace. A resource left out is not capped.
    #[serde(default)]
    pub hard: GpuResources,
    /// Caps over the claims of one class each (a GpuClass or DeviceClass name), on top of
    /// `hard`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub classes: Vec<ClassQuota>,
}

/// Amounts of the three resources a quota caps; a resource left out is not capped (in `hard`)
/// or not reported.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuResources {
    /// GPU memory in bytes (`40Gi`): a slice's memory, a whole GPU's or MIG device's full memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::quantity")]
    pub memory: Option<Quantity>,
    /// Compute in percent of one GPU's multiprocessors, summed over claims: 250 is two and a
    /// half GPUs. A whole GPU is 100; a MIG device its share of the GPU's multiprocessors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub compute: Option<u64>,
    /// Whole GPUs and MIG devices, each counted as one; slices count none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub gpus: Option<u64>,
}

/// The caps of one class.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClassQuota {
    /// The GpuClass (or DeviceClass) name the claims' requests name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The caps of claims of this class.
    pub hard: GpuResources,
}

/// `GpuQuota.status`, written by kerf's webhook (admissions) and controller (recounts).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuQuotaStatus {
    /// `spec.hard` as last enforced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hard: Option<GpuResources>,
    /// What the namespace's kerf claims hold, all three resources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used: Option<GpuResources>,
    /// Per class of `spec.classes`: its caps and what its claims hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<ClassUsage>,
    /// Claims admitted whose creation the controller has not seen yet; their charge is in `used`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub admitted: Vec<AdmittedClaim>,
    /// `used/hard` per resource, for `kubectl get gpuquota`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<QuotaSummary>,
    /// The spec generation the controller last recounted for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready says whether the quota is valid and enforced, with reason and message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::schema::conditions")]
    pub conditions: Vec<Condition>,
}

/// One class's caps and usage.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClassUsage {
    /// The class name.
    pub name: String,
    /// Its caps, from `spec.classes`.
    pub hard: GpuResources,
    /// What its claims hold.
    pub used: GpuResources,
}

/// A claim the webhook admitted and charged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdmittedClaim {
    /// The claim's name.
    pub name: String,
    /// The claim's UID (set before validating admission runs).
    pub uid: String,
    /// When it was admitted.
    pub time: Time,
    /// What it was charged.
    pub charge: GpuResources,
    /// What it was charged per class of `spec.classes`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<ClassCharge>,
}

/// The part of a charge that falls on one class.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClassCharge {
    /// The class name.
    pub name: String,
    /// The amounts.
    pub charge: GpuResources,
}

/// `used/hard` per resource (`used` alone where the resource is not capped).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaSummary {
    /// E.g. `20Gi/40Gi`.
    pub memory: String,
    /// E.g. `60/100`.
    pub compute: String,
    /// E.g. `1/2`.
    pub gpus: String,
}

impl GpuResources {
    /// The amounts as numbers; a resource left out is 0.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] at `path.memory` for a memory that is not a byte quantity.
    pub fn amount(&self, path: &str) -> Result<GpuAmount> {
        let memory_bytes = match &self.memory {
            // `quantity_bytes` refuses 0 (no device has no memory), but a usage is 0 before
            // any claim and a cap of 0 forbids GPU memory: both are written as "0".
            Some(q) if is_zero(&q.0) => 0,
            Some(q) => quantity_bytes(q)
                .map_err(|e| Error::config(format!("{path}.memory"), e.to_string()))?,
            None => 0,
        };
        Ok(GpuAmount {
            memory_bytes,
            compute: self.compute.unwrap_or(0),
            gpus: self.gpus.unwrap_or(0),
        })
    }

    /// Which resources are capped (set), as [`GpuAmount`] flags.
    pub fn caps(&self) -> Caps {
        Caps {
            memory: self.memory.is_some(),
            compute: self.compute.is_some(),
            gpus: self.gpus.is_some(),
        }
    }

    /// All three amounts written out (`memory` as a binary quantity such as `40Gi`).
    pub fn of(amount: GpuAmount) -> Self {
        GpuResources {
            memory: Some(Quantity(format_bytes(amount.memory_bytes))),
            compute: Some(amount.compute),
            gpus: Some(amount.gpus),
        }
    }
}

/// Whether a quantity is zero (`0`, `0Gi`, `0.0`, `0e3`).
fn is_zero(text: &str) -> bool {
    let number = text
        .trim()
        .trim_end_matches(|c: char| c.is_ascii_alphabetic());
    !number.starts_with('-') && number.parse::<f64>().is_ok_and(|n| n == 0.0)
}

/// Which of the three resources a `hard` caps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Caps {
    /// `memory` is capped.
    pub memory: bool,
    /// `compute` is capped.
    pub compute: bool,
    /// `gpus` is capped.
    pub gpus: bool,
}

impl GpuQuotaSpec {
    /// Checks every value the schema cannot: memory quantities and class names given twice.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the first bad field and its value.
    pub fn validate(&self, path: &str) -> Result<()> {
        self.hard.amount(&format!("{path}.hard"))?;
        let mut seen = std::collections::BTreeSet::new();
        for (i, class) in self.classes.iter().enumerate() {
            let at = format!("{path}.classes[{i}]");
            if class.name.is_empty() {
                return Err(Error::config(format!("{at}.name"), "must not be empty"));
            }
            if !seen.insert(class.name.as_str()) {
                return Err(Error::config(
                    format!("{at}.name"),
                    format!("{:?} is listed twice", class.name),
                ));
            }
            class.hard.amount(&format!("{at}.hard"))?;
        }
        Ok(())
    }
}

/// The summary of `used` against `hard`: `used/hard` per capped resource, `used` alone
/// otherwise.
pub fn summary(used: GpuAmount, hard: &GpuResources) -> QuotaSummary {
    let pair = |used: String, hard: Option<String>| match hard {
        Some(hard) => format!("{used}/{hard}"),
        None => used,
    };
    QuotaSummary {
        memory: pair(
            format_bytes(used.memory_bytes),
            hard.memory.as_ref().map(|q| q.0.clone()),
        ),
        compute: pair(
            used.compute.to_string(),
            hard.compute.map(|c| c.to_string()),
        ),
        gpus: pair(used.gpus.to_string(), hard.gpus.map(|g| g.to_string())),
    }
}

#[cfg(test)]
mod tests;
