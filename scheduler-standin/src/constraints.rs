//! A claim's `constraints[]`: `matchAttribute` (all devices of the named requests have the
//! same value) and `distinctAttribute` (all have different values).
//!
//! Upstream: kubernetes/kubernetes
//! `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/incubating/allocator_incubating.go`
//! (`Allocate` builds one constraint per entry and refuses an empty one;
//! `matchAttributeConstraint.add/remove`, `lookupAttribute`) and `incubating/constraint.go`
//! (`distinctAttributeConstraint.add/remove/matchesAttribute`). A constraint with no
//! `requests` applies to every request of the claim; a device without the attribute never
//! satisfies it. Upstream's `matchesAttribute` treats values of different types as
//! distinct; so does this.

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, DeviceConstraint};

/// An attribute value, typed, borrowed from the device (the search tries many devices and
/// keeps only a few).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Value<'a> {
    Bool(bool),
    Int(i64),
    String(&'a str),
    Version(&'a str),
}

impl<'a> Value<'a> {
    fn of(attribute: &'a DeviceAttribute) -> Option<Self> {
        if let Some(v) = attribute.bool {
            Some(Self::Bool(v))
        } else if let Some(v) = attribute.int {
            Some(Self::Int(v))
        } else if let Some(v) = &attribute.string {
            Some(Self::String(v))
        } else {
            // semver 2.0 versions are in minimal form: equal versions are equal strings.
            attribute.version.as_deref().map(Self::Version)
        }
    }

    fn same_type(&self, other: &Self) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

#[derive(Debug, Clone)]
enum Kind<'a> {
    Match {
        first: Option<Value<'a>>,
        count: usize,
    },
    Distinct {
        values: Vec<Value<'a>>,
    },
}

/// One constraint of a claim, tracking the devices chosen so far in an attempt. It borrows
/// its spec, so that each node's attempt starts from a cheap clone of a fresh one.
#[derive(Debug, Clone)]
pub(super) struct Constraint<'a> {
    requests: &'a [String],
    attribute: &'a str,
    kind: Kind<'a>,
}

impl<'a> Constraint<'a> {
    /// The constraint `spec` describes.
    ///
    /// # Errors
    ///
    /// Neither `matchAttribute` nor `distinctAttribute` set, as upstream's "empty
    /// constraint (unsupported constraint type?)".
    pub fn new(spec: &'a DeviceConstraint, index: usize) -> Result<Self, String> {
        let requests = spec.requests.as_deref().unwrap_or_default();
        if let Some(attribute) = &spec.match_attribute {
            return Ok(Self {
                requests,
                attribute,
                kind: Kind::Match {
                    first: None,
                    count: 0,
                },
            });
        }
        if let Some(attribute) = &spec.distinct_attribute {
            return Ok(Self {
                requests,
                attribute,
                kind: Kind::Distinct { values: Vec::new() },
            });
        }
        Err(format!(
            "constraint #{index}: empty constraint (unsupported constraint type?)"
        ))
    }

    fn applies_to(&self, request: &str) -> bool {
        self.requests.is_empty() || self.requests.iter().any(|r| r == request)
    }

    /// Whether `device` of `driver`, chosen for `request`, keeps the constraint; if so it
    /// is counted until [`Self::remove`].
    pub fn add(&mut self, request: &str, device: &'a Device, driver: &str) -> bool {
        if !self.applies_to(request) {
            return true;
        }
        let Some(value) = lookup(device, driver, self.attribute) else {
            return false;
        };
        match &mut self.kind {
            Kind::Match { first, count } => {
                match first {
                    None => *first = Some(value),
                    Some(first) if *first == value => {}
                    Some(_) => return false,
                }
                *count += 1;
            }
            Kind::Distinct { values } => {
                if values.iter().any(|v| v.same_type(&value) && *v == value) {
                    return false;
                }
                values.push(value);
            }
        }
        true
    }

    /// Undoes the last successful [`Self::add`] for `request`.
    pub fn remove(&mut self, request: &str) {
        if !self.applies_to(request) {
            return;
        }
        match &mut self.kind {
            Kind::Match { first, count } => {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    *first = None;
                }
            }
            Kind::Distinct { values } => {
                values.pop();
            }
        }
    }
}

/// `lookupAttribute`: the fully qualified name as published, or, when its domain is the
/// driver's, the bare name.
fn lookup<'a>(device: &'a Device, driver: &str, name: &str) -> Option<Value<'a>> {
    let attributes = device.attributes.as_ref()?;
    if let Some(attribute) = attributes.get(name) {
        return Value::of(attribute);
    }
    let (domain, id) = name.split_once('/')?;
    if domain != driver {
        return None;
    }
    attributes.get(id).and_then(Value::of)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn device(uuid: &str) -> Device {
        Device {
            name: uuid.to_owned(),
            attributes: Some(BTreeMap::from([(
                "uuid".to_owned(),
                DeviceAttribute {
                    string: Some(uuid.to_owned()),
                    ..DeviceAttribute::default()
                },
            )])),
            ..Device::default()
        }
    }

    fn spec(distinct: bool) -> DeviceConstraint {
        DeviceConstraint {
            requests: Some(vec!["a".to_owned(), "b".to_owned()]),
            match_attribute: (!distinct).then(|| "gpu.kerf.dev/uuid".to_owned()),
            distinct_attribute: distinct.then(|| "gpu.kerf.dev/uuid".to_owned()),
        }
    }

    #[test]
    fn distinct_refuses_a_repeated_value_until_removed() {
        let gpu1 = device("GPU-1");
        let spec = spec(true);
        let mut c = Constraint::new(&spec, 0).unwrap();
        assert!(c.add("a", &gpu1, "gpu.kerf.dev"));
        assert!(!c.add("b", &gpu1, "gpu.kerf.dev"));
        assert!(c.add("other", &gpu1, "gpu.kerf.dev"));
        assert!(!c.add("b", &gpu1, "other.driver"), "no attribute");
        c.remove("a");
        assert!(c.add("b", &gpu1, "gpu.kerf.dev"));
    }

    #[test]
    fn match_requires_the_first_value() {
        let (gpu1, gpu2) = (device("GPU-1"), device("GPU-2"));
        let spec = spec(false);
        let mut c = Constraint::new(&spec, 0).unwrap();
        assert!(c.add("a", &gpu1, "gpu.kerf.dev"));
        assert!(!c.add("b", &gpu2, "gpu.kerf.dev"));
        assert!(c.add("b", &gpu1, "gpu.kerf.dev"));
        c.remove("b");
        c.remove("a");
        assert!(c.add("b", &gpu2, "gpu.kerf.dev"));
    }
}
