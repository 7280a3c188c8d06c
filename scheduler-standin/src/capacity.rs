//! Consumable capacity (DRAConsumableCapacity, beta and on in 1.36): what one allocation of a
//! device consumes and whether it still fits next to the device's other shares.
//!
//! Upstream: kubernetes/kubernetes
//! `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/incubating/consumable_capacity.go`,
//! in its 1.36 form (`CmpRequestOverCapacity` taking the request and the device's capacity
//! map). What is kept:
//! - a request naming a capacity the device does not publish skips the device ("some
//!   requested capacity has not been defined"); the lookup is by the **exact** key, as in
//!   1.36 (`requestsContainNonExistCapacity`; later releases also resolve `<driver>/name`);
//! - every capacity of the device is consumed (`calculateConsumedCapacity`): not requested →
//!   the policy's `default`, or the full value when there is no policy
//!   (`fillEmptyRequest`); requested without a policy → the request as is; with `validRange`
//!   → below `min` gives `min`, otherwise rounded up to `min + n·step` (`roundUpRange`); with
//!   `validValues` → the smallest valid value at or above the request, else the request
//!   (`roundUpValidValues`);
//! - `violatesPolicy`: a value equal to `default` never violates; above `max`, off the
//!   step grid or not among `validValues` does, and skips the device;
//! - the device fits when, for every capacity, existing shares + shares allocated earlier in
//!   this attempt + this one ≤ the capacity's value.
//!
//! Simplification: amounts are exact in units of 10⁻⁹ instead of upstream's `Value()`
//! integer arithmetic; the two agree for whole-number quantities such as kerf's bytes and
//! percent. `violatesPolicy` compares `default` by value, where upstream compares the Go
//! structs (same value in the same notation).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::resource::v1::{CapacityRequestPolicy, Device, DeviceCapacity};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::cel::CelQuantity;
use crate::prepared::DeviceFacts;

/// Amounts per capacity name, in units of 10⁻⁹: the few capacities of a device, found by
/// comparing names rather than hashing them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Amounts(Vec<(String, i128)>);

impl Amounts {
    /// The amount of capacity `name`, if any.
    pub(super) fn get(&self, name: &str) -> Option<i128> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    /// Adds `value` to capacity `name`.
    pub(super) fn add(&mut self, name: &str, value: i128) {
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some((_, total)) => *total += value,
            None => self.0.push((name.to_owned(), value)),
        }
    }
}

const NANOS_PER_UNIT: i128 = 1_000_000_000;

/// A quantity's exact amount in units of 10⁻⁹.
///
/// # Errors
///
/// A message naming `what` and the text when it is not a quantity.
pub(super) fn amount(quantity: &Quantity, what: &str) -> Result<i128, String> {
    amount_of(quantity, what)
}

/// [`amount`] with `what` written only into an error: the allocator checks capacities of
/// many devices and names one only when it reports a failure.
fn amount_of(quantity: &Quantity, what: impl fmt::Display) -> Result<i128, String> {
    CelQuantity::parse(&quantity.0)
        .map(CelQuantity::nanos)
        .map_err(|e| format!("{what}: {e}"))
}

/// A parse result kept from earlier, with `what` added to its error.
fn parsed(result: &Result<i128, String>, what: impl fmt::Display) -> Result<i128, String> {
    result.clone().map_err(|e| format!("{what}: {e}"))
}

/// Names one capacity of a device (and which part of its policy) in an error message.
#[derive(Clone, Copy)]
struct What<'a> {
    device: &'a str,
    capacity: &'a str,
    part: &'static str,
}

impl What<'_> {
    fn part(self, part: &'static str) -> Self {
        Self { part, ..self }
    }
}

impl fmt::Display for What<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "device {} capacity {}{}",
            self.device, self.capacity, self.part
        )
    }
}

/// A request's `capacity.requests`, each amount parsed once for all devices it is tried on.
pub(super) struct Requested<'a> {
    /// (name, quantity, its amount or the parse error), in name order.
    entries: Vec<(&'a str, &'a Quantity, Result<i128, String>)>,
}

impl<'a> Requested<'a> {
    pub(super) fn new(requests: Option<&'a BTreeMap<String, Quantity>>) -> Self {
        let entries = requests
            .into_iter()
            .flatten()
            .map(|(name, q)| {
                let nanos = CelQuantity::parse(&q.0).map(CelQuantity::nanos);
                (name.as_str(), q, nanos)
            })
            .collect();
        Self { entries }
    }

    fn get(&self, name: &str) -> Option<(&'a Quantity, &Result<i128, String>)> {
        self.entries
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, q, nanos)| (*q, nanos))
    }
}

/// One capacity's consumption: the amount and the quantity written into `consumedCapacity`.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Consumed<'a> {
    pub nanos: i128,
    pub quantity: Cow<'a, Quantity>,
}

impl<'a> Consumed<'a> {
    fn of(quantity: &'a Quantity, what: What<'_>) -> Result<Self, String> {
        Ok(Self {
            nanos: amount_of(quantity, what)?,
            quantity: Cow::Borrowed(quantity),
        })
    }
}

/// What a request consumes of every capacity of `device`, in the order of its capacities,
/// written into `consumed` (cleared first); false when the device cannot serve it (an
/// unknown capacity requested, or a policy violated). `facts` are the device's, with its
/// parsed capacity values. The caller keeps `consumed` from one device to the next, so that
/// checking a device allocates nothing.
///
/// # Errors
///
/// A quantity that does not parse, naming the device and capacity.
pub(super) fn request_consumption<'a>(
    requested: &Requested<'a>,
    device: &'a Device,
    facts: &DeviceFacts,
    consumed: &mut Vec<Consumed<'a>>,
) -> Result<bool, String> {
    consumed.clear();
    let capacities = device.capacity.as_ref();
    if requested
        .entries
        .iter()
        .any(|(name, _, _)| !capacities.is_some_and(|c| c.contains_key(*name)))
    {
        return Ok(false);
    }
    for ((name, capacity), value) in capacities.into_iter().flatten().zip(&facts.capacity) {
        let what = What {
            device: &device.name,
            capacity: name,
            part: "",
        };
        let amount = consumption(requested.get(name), capacity, value, what)?;
        if violates_policy(amount.nanos, capacity.request_policy.as_ref(), what)? {
            consumed.clear();
            return Ok(false);
        }
        consumed.push(amount);
    }
    Ok(true)
}

/// Whether `consumed` (from [`request_consumption`] for `device`) fits next to `existing`
/// (allocations in the API, by capacity name) and `allocating` (earlier shares of this
/// attempt, in the order of the device's capacities) within every capacity's value.
///
/// # Errors
///
/// A capacity value that does not parse.
pub(super) fn fits(
    consumed: &[Consumed<'_>],
    existing: Option<&Amounts>,
    allocating: Option<&[i128]>,
    device: &Device,
    facts: &DeviceFacts,
) -> Result<bool, String> {
    let capacities = device.capacity.iter().flatten().zip(&facts.capacity);
    for (i, (((name, _), value), this)) in capacities.zip(consumed).enumerate() {
        let value = parsed(
            value,
            format_args!("device {} capacity {name}", device.name),
        )?;
        let total = existing.and_then(|e| e.get(name)).unwrap_or(0)
            + allocating.and_then(|a| a.get(i)).copied().unwrap_or(0)
            + this.nanos;
        if total > value {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The amounts of `consumed`, in the order of the device's capacities.
pub(super) fn amounts(consumed: &[Consumed<'_>]) -> Vec<i128> {
    consumed.iter().map(|c| c.nanos).collect()
}

/// The `consumedCapacity` written for `consumed`, by the names of `device`'s capacities.
pub(super) fn written(consumed: &[Consumed<'_>], device: &Device) -> BTreeMap<String, Quantity> {
    device
        .capacity
        .iter()
        .flatten()
        .zip(consumed)
        .map(|((name, _), c)| (name.clone(), c.quantity.clone().into_owned()))
        .collect()
}

/// `calculateConsumedCapacity` for one capacity, whose parsed value is `value`.
fn consumption<'a>(
    requested: Option<(&'a Quantity, &Result<i128, String>)>,
    capacity: &'a DeviceCapacity,
    value: &Result<i128, String>,
    what: What<'_>,
) -> Result<Consumed<'a>, String> {
    let policy = capacity.request_policy.as_ref();
    let Some((requested, requested_nanos)) = requested else {
        return match policy.and_then(|p| p.default.as_ref()) {
            Some(default) => Consumed::of(default, what),
            None => Ok(Consumed {
                nanos: parsed(value, what)?,
                quantity: Cow::Borrowed(&capacity.value),
            }),
        };
    };
    let value = parsed(requested_nanos, what)?;
    let Some(policy) = policy else {
        return Ok(Consumed {
            nanos: value,
            quantity: Cow::Borrowed(requested),
        });
    };
    if let Some(range) = &policy.valid_range {
        let min = amount_of(&range.min, what.part(" validRange.min"))?;
        if value < min {
            return Consumed::of(&range.min, what);
        }
        let Some(step_quantity) = &range.step else {
            return Consumed::of(requested, what);
        };
        let step = amount_of(step_quantity, what.part(" validRange.step"))?;
        if step <= 0 {
            return Err(format!("{what}: validRange.step must be positive"));
        }
        let steps = (value - min + step - 1) / step;
        let nanos = min + steps * step;
        let binary = step_quantity.0.ends_with('i');
        return Ok(Consumed {
            nanos,
            quantity: Cow::Owned(Quantity(format_amount(nanos, binary))),
        });
    }
    if let Some(values) = &policy.valid_values {
        for valid in values {
            if value <= amount_of(valid, what.part(" validValues"))? {
                return Consumed::of(valid, what);
            }
        }
    }
    Consumed::of(requested, what)
}

/// `violatesPolicy`.
fn violates_policy(
    nanos: i128,
    policy: Option<&CapacityRequestPolicy>,
    what: What<'_>,
) -> Result<bool, String> {
    let Some(policy) = policy else {
        return Ok(false);
    };
    if let Some(default) = &policy.default
        && amount_of(default, what.part(" default"))? == nanos
    {
        return Ok(false);
    }
    if let Some(range) = &policy.valid_range {
        if let Some(max) = &range.max
            && nanos > amount_of(max, what.part(" validRange.max"))?
        {
            return Ok(true);
        }
        if let Some(step) = &range.step {
            let step = amount_of(step, what.part(" validRange.step"))?;
            let min = amount_of(&range.min, what.part(" validRange.min"))?;
            return Ok(step > 0 && (nanos - min) % step != 0);
        }
        return Ok(false);
    }
    if let Some(values) = policy.valid_values.as_ref().filter(|v| !v.is_empty()) {
        for valid in values {
            if amount_of(valid, what.part(" validValues"))? == nanos {
                return Ok(false);
            }
        }
        return Ok(true);
    }
    Ok(false)
}

/// A quantity's canonical text, as `resource.NewQuantity(v, format).String()` writes it:
/// the largest binary (`Ki`…`Ei`) or decimal (`k`…`E`) suffix that divides the value
/// exactly, plain digits otherwise; below one unit, milli or nano units.
fn format_amount(nanos: i128, binary: bool) -> String {
    if nanos % NANOS_PER_UNIT != 0 {
        return if nanos % 1_000_000 == 0 {
            format!("{}m", nanos / 1_000_000)
        } else {
            format!("{nanos}n")
        };
    }
    let value = nanos / NANOS_PER_UNIT;
    if value == 0 {
        return "0".to_owned();
    }
    let (base, suffixes): (i128, [&str; 6]) = if binary {
        (1024, ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"])
    } else {
        (1000, ["k", "M", "G", "T", "P", "E"])
    };
    let mut scaled = value;
    let mut suffix = "";
    for candidate in suffixes {
        if scaled % base != 0 {
            break;
        }
        scaled /= base;
        suffix = candidate;
    }
    format!("{scaled}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::CapacityRequestPolicyRange;

    fn q(text: &str) -> Quantity {
        Quantity(text.to_owned())
    }

    fn memory_device() -> Device {
        let capacity = DeviceCapacity {
            value: q("80Gi"),
            request_policy: Some(CapacityRequestPolicy {
                default: Some(q("80Gi")),
                valid_range: Some(CapacityRequestPolicyRange {
                    min: q("1Gi"),
                    max: Some(q("80Gi")),
                    step: Some(q("1Gi")),
                }),
                valid_values: None,
            }),
        };
        Device {
            name: "gpu-0".to_owned(),
            capacity: Some(BTreeMap::from([("memory".to_owned(), capacity)])),
            ..Device::default()
        }
    }

    fn consumed_memory(request: Option<&str>) -> Option<String> {
        let requests = request.map(|r| BTreeMap::from([("memory".to_owned(), q(r))]));
        let device = memory_device();
        let facts = DeviceFacts::of("gpu.kerf.dev", "pool", &device);
        let mut consumed = Vec::new();
        request_consumption(
            &Requested::new(requests.as_ref()),
            &device,
            &facts,
            &mut consumed,
        )
        .unwrap()
        .then(|| consumed[0].quantity.0.clone())
    }

    #[test]
    fn requests_round_up_to_the_step_and_default_when_absent() {
        assert_eq!(consumed_memory(Some("10Gi")).as_deref(), Some("10Gi"));
        assert_eq!(consumed_memory(Some("9.5Gi")).as_deref(), Some("10Gi"));
        assert_eq!(consumed_memory(Some("100Mi")).as_deref(), Some("1Gi"));
        assert_eq!(consumed_memory(None).as_deref(), Some("80Gi"));
        assert_eq!(consumed_memory(Some("81Gi")), None, "above max");
    }

    #[test]
    fn an_unknown_capacity_skips_the_device() {
        let requests = BTreeMap::from([("gpu.kerf.dev/memory".to_owned(), q("1Gi"))]);
        let device = memory_device();
        let facts = DeviceFacts::of("gpu.kerf.dev", "pool", &device);
        let mut consumed = Vec::new();
        assert!(
            !request_consumption(
                &Requested::new(Some(&requests)),
                &device,
                &facts,
                &mut consumed
            )
            .unwrap()
        );
    }

    #[test]
    fn amounts_format_like_kubernetes() {
        assert_eq!(format_amount(30 * NANOS_PER_UNIT, false), "30");
        assert_eq!(format_amount(2000 * NANOS_PER_UNIT, false), "2k");
        assert_eq!(format_amount((3 << 30) * NANOS_PER_UNIT, true), "3Gi");
        assert_eq!(format_amount(1500 * NANOS_PER_UNIT, true), "1500");
        assert_eq!(format_amount(500_000_000, false), "500m");
    }
}
