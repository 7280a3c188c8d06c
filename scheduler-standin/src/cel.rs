//! DeviceClass and request CEL selectors, evaluated as kube-scheduler's structured allocator
//! evaluates them, with the [`cel`] crate (a real CEL parser and interpreter).
//!
//! Upstream (`staging/src/k8s.io/dynamic-resource-allocation/cel/compile.go`) gives the
//! expression one variable, `device`, with `driver`, `attributes` (domain → name → value),
//! `capacity` (domain → name → quantity) and `allowMultipleAllocations`, plus the Kubernetes
//! quantity and semver libraries. This module builds the same variable from a
//! `resource.k8s.io/v1` [`Device`] and registers:
//! - `quantity(string)`, `Quantity.compareTo(Quantity)` (-1/0/1), `isGreaterThan`,
//!   `isLessThan`;
//! - `semver(string)` (strict `major.minor.patch[-pre][+build]`, no normalisation, as the DRA
//!   environment), `Semver.compareTo(Semver)`, `isGreaterThan`, `isLessThan`.
//!
//! Limits, none of which kerf's generated selectors touch: version attributes are semvers
//! only; list attributes (1.36 `DRAListTypeAttributes`) are ignored; there is no cost limit.
//! A domain the device publishes nothing in is absent, except the driver's own domain, which
//! is always present (possibly empty); looking up a missing key is a runtime error, as in CEL.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Arc;

use cel::extractors::This;
use cel::objects::{Key, Map, Opaque};
use cel::{Context, ExecutionError, Program, Value};
use k8s_openapi::api::resource::v1::{Device, DeviceAttribute};

/// A Kubernetes resource quantity as a CEL value: an exact amount in units of 10⁻⁹.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CelQuantity {
    nanos: i128,
}

impl Opaque for CelQuantity {
    fn runtime_type_name(&self) -> &'static str {
        "kubernetes.Quantity"
    }
}

impl CelQuantity {
    /// The amount in units of 10⁻⁹ (exact for every quantity kerf publishes).
    pub fn nanos(self) -> i128 {
        self.nanos
    }

    /// Parses a quantity string (`81559Mi`, `1.5Gi`, `500m`, `1e3`).
    ///
    /// # Errors
    ///
    /// A message when the text is not a quantity or does not fit.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = || format!("invalid quantity {text:?}");
        let split = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
            .unwrap_or(text.len());
        let (number, suffix) = text.split_at(split);
        let (negative, number) = match number.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, number.strip_prefix('+').unwrap_or(number)),
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if (whole.is_empty() && fraction.is_empty())
            || !whole
                .bytes()
                .chain(fraction.bytes())
                .all(|b| b.is_ascii_digit())
        {
            return Err(bad());
        }
        // digits × 10^(-fraction len) × multiplier
        let digits: i128 = format!("{whole}{fraction}").parse().map_err(|_| bad())?;
        let fraction_len = i32::try_from(fraction.len()).map_err(|_| bad())?;
        let (pow2, pow10): (u32, i32) = match suffix {
            "" => (0, 0),
            "Ki" => (10, 0),
            "Mi" => (20, 0),
            "Gi" => (30, 0),
            "Ti" => (40, 0),
            "Pi" => (50, 0),
            "Ei" => (60, 0),
            "n" => (0, -9),
            "u" => (0, -6),
            "m" => (0, -3),
            "k" => (0, 3),
            "M" => (0, 6),
            "G" => (0, 9),
            "T" => (0, 12),
            "P" => (0, 15),
            "E" => (0, 18),
            other => match other.strip_prefix(['e', 'E']) {
                Some(exponent) => (0, exponent.parse().map_err(|_| bad())?),
                None => return Err(bad()),
            },
        };
        // Scale to nanos: × 10^(9 + pow10 - fraction_len) × 2^pow2.
        let scale = 9 + pow10 - fraction_len;
        let mut nanos = digits
            .checked_mul(1_i128.checked_shl(pow2).ok_or_else(bad)?)
            .ok_or_else(bad)?;
        if scale >= 0 {
            nanos = nanos
                .checked_mul(10_i128.checked_pow(scale.unsigned_abs()).ok_or_else(bad)?)
                .ok_or_else(bad)?;
        } else {
            // Below a nano: kept exact when divisible, otherwise rounded up as Kubernetes does.
            let divisor = 10_i128.checked_pow(scale.unsigned_abs()).ok_or_else(bad)?;
            nanos = nanos.div_euclid(divisor) + i128::from(nanos.rem_euclid(divisor) != 0);
        }
        Ok(Self {
            nanos: if negative { -nanos } else { nanos },
        })
    }
}

/// A semantic version as a CEL value (the DRA environment's `semver()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CelSemver {
    core: (u64, u64, u64),
    pre: Vec<String>,
}

impl Opaque for CelSemver {
    fn runtime_type_name(&self) -> &'static str {
        "kubernetes.Semver"
    }
}

impl CelSemver {
    /// Parses `major.minor.patch[-pre][+build]` strictly: all three parts, no leading `v`.
    ///
    /// # Errors
    ///
    /// A message when the text is not such a version.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = || format!("invalid semver {text:?}");
        let without_build = text.split_once('+').map_or(text, |(v, _)| v);
        let (core, pre) = match without_build.split_once('-') {
            Some((core, pre)) if !pre.is_empty() => {
                (core, pre.split('.').map(str::to_owned).collect())
            }
            Some(_) => return Err(bad()),
            None => (without_build, Vec::new()),
        };
        let parts: Vec<u64> = core
            .split('.')
            .map(|part| {
                if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                    Err(bad())
                } else {
                    part.parse().map_err(|_| bad())
                }
            })
            .collect::<Result<_, _>>()?;
        match parts.as_slice() {
            [major, minor, patch] => Ok(Self {
                core: (*major, *minor, *patch),
                pre,
            }),
            _ => Err(bad()),
        }
    }
}

impl PartialOrd for CelSemver {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for CelSemver {
    fn cmp(&self, other: &Self) -> Ordering {
        self.core
            .cmp(&other.core)
            .then_with(|| match (self.pre.is_empty(), other.pre.is_empty()) {
                (true, true) => Ordering::Equal,
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                (false, false) => compare_pre(&self.pre, &other.pre),
            })
    }
}

fn compare_pre(a: &[String], b: &[String]) -> Ordering {
    for (x, y) in a.iter().zip(b) {
        let order = match (x.parse::<u64>(), y.parse::<u64>()) {
            (Ok(x), Ok(y)) => x.cmp(&y),
            (Ok(_), Err(_)) => Ordering::Less,
            (Err(_), Ok(_)) => Ordering::Greater,
            (Err(_), Err(_)) => x.cmp(y),
        };
        if order != Ordering::Equal {
            return order;
        }
    }
    a.len().cmp(&b.len())
}

fn ordering_value(order: Ordering) -> i64 {
    match order {
        Ordering::Less => -1,
        Ordering::Equal => 0,
        Ordering::Greater => 1,
    }
}

fn compare_opaque(
    function: &str,
    this: &Arc<dyn Opaque>,
    other: &Arc<dyn Opaque>,
) -> Result<Ordering, ExecutionError> {
    if let (Some(a), Some(b)) = (
        this.downcast_ref::<CelQuantity>(),
        other.downcast_ref::<CelQuantity>(),
    ) {
        return Ok(a.cmp(b));
    }
    if let (Some(a), Some(b)) = (
        this.downcast_ref::<CelSemver>(),
        other.downcast_ref::<CelSemver>(),
    ) {
        return Ok(a.cmp(b));
    }
    Err(ExecutionError::function_error(
        function,
        format!(
            "no such overload: {}.{function}({})",
            this.runtime_type_name(),
            other.runtime_type_name()
        ),
    ))
}

#[allow(
    clippy::needless_pass_by_value,
    reason = "the cel crate's extractors hand arguments over by value"
)]
fn quantity(text: Arc<String>) -> Result<Value, ExecutionError> {
    CelQuantity::parse(&text)
        .map(|q| Value::Opaque(Arc::new(q)))
        .map_err(|e| ExecutionError::function_error("quantity", e))
}

#[allow(
    clippy::needless_pass_by_value,
    reason = "the cel crate's extractors hand arguments over by value"
)]
fn semver(text: Arc<String>) -> Result<Value, ExecutionError> {
    CelSemver::parse(&text)
        .map(|v| Value::Opaque(Arc::new(v)))
        .map_err(|e| ExecutionError::function_error("semver", e))
}

#[allow(
    clippy::needless_pass_by_value,
    reason = "the cel crate's extractors hand arguments over by value"
)]
fn compare_to(
    This(this): This<Arc<dyn Opaque>>,
    other: Arc<dyn Opaque>,
) -> Result<i64, ExecutionError> {
    compare_opaque("compareTo", &this, &other).map(ordering_value)
}

#[allow(
    clippy::needless_pass_by_value,
    reason = "the cel crate's extractors hand arguments over by value"
)]
fn is_greater_than(
    This(this): This<Arc<dyn Opaque>>,
    other: Arc<dyn Opaque>,
) -> Result<bool, ExecutionError> {
    compare_opaque("isGreaterThan", &this, &other).map(Ordering::is_gt)
}

#[allow(
    clippy::needless_pass_by_value,
    reason = "the cel crate's extractors hand arguments over by value"
)]
fn is_less_than(
    This(this): This<Arc<dyn Opaque>>,
    other: Arc<dyn Opaque>,
) -> Result<bool, ExecutionError> {
    compare_opaque("isLessThan", &this, &other).map(Ordering::is_lt)
}

fn attribute_value(attribute: &DeviceAttribute) -> Result<Option<Value>, String> {
    Ok(if let Some(value) = attribute.bool {
        Some(Value::Bool(value))
    } else if let Some(value) = attribute.int {
        Some(Value::Int(value))
    } else if let Some(value) = &attribute.string {
        Some(Value::String(Arc::new(value.clone())))
    } else if let Some(value) = &attribute.version {
        Some(Value::Opaque(Arc::new(CelSemver::parse(value)?)))
    } else {
        None
    })
}

/// Splits a published attribute or capacity name into (domain, identifier); unqualified names
/// are in the driver's domain.
fn qualified<'a>(name: &'a str, driver: &'a str) -> (&'a str, &'a str) {
    name.split_once('/').unwrap_or((driver, name))
}

fn nested_map(entries: HashMap<String, HashMap<String, Value>>) -> Value {
    let map: HashMap<Key, Value> = entries
        .into_iter()
        .map(|(domain, inner)| {
            let inner: HashMap<Key, Value> =
                inner.into_iter().map(|(k, v)| (Key::from(k), v)).collect();
            (
                Key::from(domain),
                Value::Map(Map {
                    map: Arc::new(inner),
                }),
            )
        })
        .collect();
    Value::Map(Map { map: Arc::new(map) })
}

/// The CEL `device` variable of `device` published by `driver`.
///
/// # Errors
///
/// A message when a published version or capacity does not parse.
pub fn device_value(device: &Device, driver: &str) -> Result<Value, String> {
    let mut attributes: HashMap<String, HashMap<String, Value>> =
        HashMap::from([(driver.to_owned(), HashMap::new())]);
    for (name, attribute) in device.attributes.iter().flatten() {
        let (domain, id) = qualified(name, driver);
        if let Some(value) = attribute_value(attribute)? {
            attributes
                .entry(domain.to_owned())
                .or_default()
                .insert(id.to_owned(), value);
        }
    }
    let mut capacity: HashMap<String, HashMap<String, Value>> =
        HashMap::from([(driver.to_owned(), HashMap::new())]);
    for (name, value) in device.capacity.iter().flatten() {
        let (domain, id) = qualified(name, driver);
        let quantity = CelQuantity::parse(&value.value.0)?;
        capacity
            .entry(domain.to_owned())
            .or_default()
            .insert(id.to_owned(), Value::Opaque(Arc::new(quantity)));
    }
    let fields: HashMap<Key, Value> = HashMap::from([
        (
            Key::from("driver".to_owned()),
            Value::String(Arc::new(driver.to_owned())),
        ),
        (Key::from("attributes".to_owned()), nested_map(attributes)),
        (Key::from("capacity".to_owned()), nested_map(capacity)),
        (
            Key::from("allowMultipleAllocations".to_owned()),
            Value::Bool(device.allow_multiple_allocations.unwrap_or(false)),
        ),
    ]);
    Ok(Value::Map(Map {
        map: Arc::new(fields),
    }))
}

/// Compiled selector expressions, by expression text (upstream: `celcache.go`).
#[derive(Default)]
pub struct CelCache {
    programs: HashMap<String, Result<Arc<Program>, String>>,
}

impl std::fmt::Debug for CelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CelCache")
            .field("expressions", &self.programs.len())
            .finish()
    }
}

impl CelCache {
    /// Whether `expression` selects `device` of `driver`.
    ///
    /// # Errors
    ///
    /// A compile or runtime error message (a missing attribute, a wrong type, a result that
    /// is not a bool). Upstream (`allocator.go`, `selectorsMatch`) turns both into an
    /// allocation error that aborts the pod's scheduling cycle; the caller does the same.
    pub fn matches(
        &mut self,
        expression: &str,
        device: &Device,
        driver: &str,
    ) -> Result<bool, String> {
        self.matches_value(expression, &device_value(device, driver)?)
    }

    /// [`Self::matches`] for a device whose CEL `device` variable ([`device_value`]) is
    /// built already: the allocator builds it once per device and snapshot.
    ///
    /// # Errors
    ///
    /// As [`Self::matches`].
    pub fn matches_value(&mut self, expression: &str, device: &Value) -> Result<bool, String> {
        // Looked up before inserting, so that a known expression costs no key allocation.
        let program = if let Some(compiled) = self.programs.get(expression) {
            compiled.clone()?
        } else {
            let compiled = Program::compile(expression)
                .map(Arc::new)
                .map_err(|e| format!("CEL compile error: {e}"));
            self.programs
                .insert(expression.to_owned(), compiled.clone());
            compiled?
        };
        let mut context = Context::default();
        for (name, result) in [
            ("quantity", context.add_function("quantity", quantity)),
            ("semver", context.add_function("semver", semver)),
            ("compareTo", context.add_function("compareTo", compare_to)),
            (
                "isGreaterThan",
                context.add_function("isGreaterThan", is_greater_than),
            ),
            (
                "isLessThan",
                context.add_function("isLessThan", is_less_than),
            ),
        ] {
            result.map_err(|e| format!("register CEL function {name}: {e:?}"))?;
        }
        context.add_variable_from_value("device", device.clone());
        match program.execute(&context) {
            Ok(Value::Bool(matches)) => Ok(matches),
            Ok(other) => Err(format!(
                "CEL runtime error: expression returned {other:?}, not a bool"
            )),
            Err(e) => Err(format!("CEL runtime error: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_compare_exactly() {
        let q = |s: &str| CelQuantity::parse(s).unwrap();
        assert_eq!(q("1Gi"), q("1024Mi"));
        assert_eq!(q("1.5Gi"), q("1536Mi"));
        assert!(q("81559Mi") < q("80Gi"));
        assert!(q("81559Mi") > q("79Gi"));
        assert!(q("500m") < q("1"));
        assert_eq!(q("1k"), q("1e3"));
        assert!(CelQuantity::parse("1Xi").is_err());
        assert!(CelQuantity::parse("").is_err());
    }

    #[test]
    fn semvers_follow_semver_precedence() {
        let v = |s: &str| CelSemver::parse(s).unwrap();
        assert!(v("9.0.0") > v("8.0.0"));
        assert!(v("8.0.0-rc1") < v("8.0.0"));
        assert_eq!(v("8.0.0+build"), v("8.0.0"));
        assert!(CelSemver::parse("8.0").is_err());
    }
}
