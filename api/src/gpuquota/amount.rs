//! The three quantities a GpuQuota caps, their arithmetic, and the check of a charge against
//! `hard` with ResourceQuota's refusal message.

use super::{GpuResources, RESOURCE_COMPUTE, RESOURCE_GPUS, RESOURCE_MEMORY};
use crate::error::Result;
use crate::quantity::format_bytes;

/// GPU memory, compute and whole devices, as numbers. Arithmetic saturates: a sum past
/// `u64::MAX` is over any quota anyway.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GpuAmount {
    /// GPU memory in bytes.
    pub memory_bytes: u64,
    /// Percent of one GPU's multiprocessors, summed.
    pub compute: u64,
    /// Whole GPUs and MIG devices.
    pub gpus: u64,
}

impl GpuAmount {
    /// Nothing.
    pub const ZERO: GpuAmount = GpuAmount {
        memory_bytes: 0,
        compute: 0,
        gpus: 0,
    };

    /// The sum of both.
    #[must_use]
    pub fn plus(self, other: GpuAmount) -> GpuAmount {
        GpuAmount {
            memory_bytes: self.memory_bytes.saturating_add(other.memory_bytes),
            compute: self.compute.saturating_add(other.compute),
            gpus: self.gpus.saturating_add(other.gpus),
        }
    }

    /// `count` times this.
    #[must_use]
    pub fn times(self, count: u64) -> GpuAmount {
        GpuAmount {
            memory_bytes: self.memory_bytes.saturating_mul(count),
            compute: self.compute.saturating_mul(count),
            gpus: self.gpus.saturating_mul(count),
        }
    }

    /// Whether all three are 0.
    pub fn is_zero(self) -> bool {
        self == GpuAmount::ZERO
    }
}

impl std::iter::Sum for GpuAmount {
    fn sum<I: Iterator<Item = GpuAmount>>(iter: I) -> Self {
        iter.fold(GpuAmount::ZERO, GpuAmount::plus)
    }
}

/// One resource over its cap: the key as messages name it and the three values, formatted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exceeded {
    /// `memory`, `compute`, `gpus`, or for a class cap `<class>.gpuclass.gpu.kerf.dev/<resource>`
    /// (the form of ResourceQuota's `<class>.deviceclass.resource.k8s.io/devices`).
    pub resource: String,
    /// What the claim asks for.
    pub requested: String,
    /// What the namespace holds already.
    pub used: String,
    /// The cap.
    pub hard: String,
}

/// The resources `requested` would push past `hard`, given `used`; `class` names the class
/// cap being checked (`None` for the namespace's caps).
///
/// As ResourceQuota's `checkRequest`
/// (`staging/src/k8s.io/apiserver/pkg/admission/plugin/resourcequota/controller.go`), only
/// resources the charge asks for (non-zero) and the quota caps are checked: a claim that asks
/// for no whole GPU passes a `gpus` cap that is already exceeded.
///
/// # Errors
///
/// [`crate::Error::InvalidConfig`] for a `hard.memory` that is not a byte quantity; `path`
/// names it (`spec.hard`, `spec.classes[0].hard`).
pub fn exceeded(
    class: Option<&str>,
    requested: GpuAmount,
    used: GpuAmount,
    hard: &GpuResources,
    path: &str,
) -> Result<Vec<Exceeded>> {
    let caps = hard.caps();
    let limit = hard.amount(path)?;
    let key = |resource: &str| match class {
        Some(class) => format!("{class}.gpuclass.gpu.kerf.dev/{resource}"),
        None => resource.to_owned(),
    };
    let checks = [
        (
            RESOURCE_MEMORY,
            caps.memory,
            [
                requested.memory_bytes,
                used.memory_bytes,
                limit.memory_bytes,
            ],
            format_bytes as fn(u64) -> String,
        ),
        (
            RESOURCE_COMPUTE,
            caps.compute,
            [requested.compute, used.compute, limit.compute],
            |n: u64| n.to_string(),
        ),
        (
            RESOURCE_GPUS,
            caps.gpus,
            [requested.gpus, used.gpus, limit.gpus],
            |n: u64| n.to_string(),
        ),
    ];
    Ok(checks
        .into_iter()
        .filter(|(_, capped, [asked, held, cap], _)| {
            *capped && *asked > 0 && asked.saturating_add(*held) > *cap
        })
        .map(|(resource, _, [asked, held, cap], show)| Exceeded {
            resource: key(resource),
            requested: show(asked),
            used: show(held),
            hard: show(cap),
        })
        .collect())
}

/// The refusal of a claim over quota `quota`, in ResourceQuota's words
/// (`checkRequest` and `prettyPrint` in
/// `staging/src/k8s.io/apiserver/pkg/admission/plugin/resourcequota/controller.go`): `exceeded
/// quota: <name>, requested: <k=v,…>, used: <k=v,…>, limited: <k=v,…>`, keys sorted.
pub fn exceeded_message(quota: &str, exceeded: &[Exceeded]) -> String {
    let mut sorted: Vec<&Exceeded> = exceeded.iter().collect();
    sorted.sort_by(|a, b| a.resource.cmp(&b.resource));
    let list = |value: fn(&Exceeded) -> &str| {
        sorted
            .iter()
            .map(|e| format!("{}={}", e.resource, value(e)))
            .collect::<Vec<_>>()
            .join(",")
    };
    format!(
        "exceeded quota: {quota}, requested: {}, used: {}, limited: {}",
        list(|e| &e.requested),
        list(|e| &e.used),
        list(|e| &e.hard)
    )
}
