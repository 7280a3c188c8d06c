//! The GpuQuotas of `kerf status`: per namespace, what its claims hold against each cap, in
//! total and per class — `status.used` and `status.classes` as kerf-controller last recounted
//! them, against `spec.hard` and `spec.classes`.

use std::fmt::Write as _;

use kerf_api::gpuclass::CONDITION_READY;
use kerf_api::gpuquota::{GpuQuota, GpuResources};
use kerf_api::quantity::quantity_bytes;
use serde::Serialize;

/// One GpuQuota.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QuotaStatus {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its Ready condition: `true` while kerf enforces it, `false` for an invalid spec, `None`
    /// before kerf-controller first recounted it.
    pub ready: Option<bool>,
    /// Why it is not ready (the condition's message).
    pub problem: Option<String>,
    /// Over every kerf claim of the namespace.
    pub total: QuotaUse,
    /// Per capped class, in the order of `spec.classes`.
    pub classes: Vec<ClassQuotaUse>,
    /// Claims admitted whose creation kerf-controller has not seen yet (counted in `used`).
    pub pending_admissions: usize,
}

/// One class's caps and use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClassQuotaUse {
    /// The class name.
    pub class: String,
    /// Its caps and use.
    #[serde(flatten)]
    pub quota: QuotaUse,
}

/// Use against caps.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QuotaUse {
    /// What is held; `None` before the first recount.
    pub used: Option<Amounts>,
    /// The caps; a resource left out is not capped.
    pub hard: Amounts,
}

/// Memory (bytes), compute (percent of a GPU) and whole devices; `None` where not given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Amounts {
    /// Bytes of GPU memory.
    pub memory_bytes: Option<u64>,
    /// Percent of one GPU's multiprocessors, summed.
    pub compute: Option<u64>,
    /// Whole GPUs and MIG devices.
    pub gpus: Option<u64>,
}

impl Amounts {
    fn of(resources: &GpuResources) -> Amounts {
        Amounts {
            memory_bytes: resources
                .memory
                .as_ref()
                .and_then(|q| quantity_bytes(q).ok()),
            compute: resources.compute,
            gpus: resources.gpus,
        }
    }
}

/// The quotas of `quotas`, by namespace and name.
pub fn quotas(quotas: &[GpuQuota]) -> Vec<QuotaStatus> {
    let mut shown: Vec<QuotaStatus> = quotas.iter().map(quota).collect();
    shown.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    shown
}

fn quota(quota: &GpuQuota) -> QuotaStatus {
    let status = quota.status.as_ref();
    let condition = status.and_then(|s| s.conditions.iter().find(|c| c.type_ == CONDITION_READY));
    let ready = condition.map(|c| c.status == "True");
    let classes = quota
        .spec
        .classes
        .iter()
        .map(|class| {
            let used = status
                .and_then(|s| s.classes.iter().find(|c| c.name == class.name))
                .map(|c| Amounts::of(&c.used));
            ClassQuotaUse {
                class: class.name.clone(),
                quota: QuotaUse {
                    used,
                    hard: Amounts::of(&class.hard),
                },
            }
        })
        .collect();
    QuotaStatus {
        namespace: quota.metadata.namespace.clone().unwrap_or_default(),
        name: quota.metadata.name.clone().unwrap_or_default(),
        ready,
        problem: condition
            .filter(|_| ready == Some(false))
            .map(|c| c.message.clone()),
        total: QuotaUse {
            used: status.and_then(|s| s.used.as_ref()).map(Amounts::of),
            hard: Amounts::of(&quota.spec.hard),
        },
        classes,
        pending_admissions: status.map_or(0, |s| s.admitted.len()),
    }
}

/// The quota table: a header, per quota a row for the namespace's total and one per class,
/// then a line per quota that is not enforced. Empty without quotas.
pub(super) fn render(quotas: &[QuotaStatus], gib: fn(u64) -> String) -> Vec<Vec<String>> {
    if quotas.is_empty() {
        return Vec::new();
    }
    let mut rows = vec![
        [
            "NAMESPACE",
            "QUOTA",
            "CLASS",
            "MEMORY",
            "COMPUTE",
            "GPUS",
            "PENDING",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    for quota in quotas {
        let mut first = vec![
            quota.namespace.clone(),
            quota.name.clone(),
            "(all)".to_owned(),
        ];
        first.extend(cells(&quota.total, gib));
        first.push(quota.pending_admissions.to_string());
        rows.push(first);
        for class in &quota.classes {
            let mut row = vec![String::new(), String::new(), class.class.clone()];
            row.extend(cells(&class.quota, gib));
            rows.push(row);
        }
    }
    rows
}

/// The lines under the table: quotas kerf does not enforce, and why.
pub(super) fn problems(quotas: &[QuotaStatus]) -> String {
    let mut out = String::new();
    for quota in quotas {
        match (quota.ready, &quota.problem) {
            (Some(false), problem) => {
                let _ = writeln!(
                    out,
                    "  {}/{} is not enforced: {}",
                    quota.namespace,
                    quota.name,
                    problem.as_deref().unwrap_or("its spec is invalid")
                );
            }
            (None, _) => {
                let _ = writeln!(
                    out,
                    "  {}/{} has not been counted yet (is kerf-controller running?)",
                    quota.namespace, quota.name
                );
            }
            (Some(true), _) => {}
        }
    }
    out
}

/// `used/hard` per resource (memory in GiB), `used` alone where not capped, `?` for a use not
/// counted yet.
fn cells(quota: &QuotaUse, gib: fn(u64) -> String) -> [String; 3] {
    let used = quota.used.unwrap_or_default();
    let counted = quota.used.is_some();
    let pair = |used: Option<u64>, hard: Option<u64>, show: &dyn Fn(u64) -> String, unit: &str| {
        let used = if counted {
            show(used.unwrap_or(0))
        } else {
            "?".to_owned()
        };
        match hard {
            Some(hard) => format!("{used}/{}{unit}", show(hard)),
            None => format!("{used}{unit}"),
        }
    };
    let number = |n: u64| n.to_string();
    [
        pair(used.memory_bytes, quota.hard.memory_bytes, &gib, "Gi"),
        pair(used.compute, quota.hard.compute, &number, ""),
        pair(used.gpus, quota.hard.gpus, &number, ""),
    ]
}
