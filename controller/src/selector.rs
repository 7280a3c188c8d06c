//! Which published devices a class selects, written two ways from one description: as the CEL
//! expression the DeviceClass carries for kube-scheduler, and as a Rust predicate the controller
//! evaluates over ResourceSlices for the class status. Keeping both in one type keeps them from
//! drifting apart.
//!
//! The CEL uses only what the DRA CEL environment of Kubernetes 1.34+ offers: the Kubernetes
//! quantity library (`quantity("80Gi")`, `Quantity.compareTo`) and the semver library without
//! normalisation (`semver("8.0.0")` needs all three parts, `Semver.compareTo` returns -1/0/1).

use std::cmp::Ordering;
use std::fmt::Write as _;

use k8s_openapi::api::resource::v1::DeviceAttribute;
use kerf_api::params::{Allocator, GpuClassParameters};
use kerf_api::quantity::format_bytes;
use kerf_api::resourceslice::{
    DeviceFields, TYPE_GPU, TYPE_MIG, attributes, capacities, device_attribute, device_memory_bytes,
};
use kerf_core::inventory::ComputeCapability;

/// `type` value of no published device: the selector of Controller classes requires it, so
/// kube-scheduler never allocates their claims and leaves them to kerf's controller.
const TYPE_SLICE: &str = "slice";

/// Whether a class selects whole GPUs or MIG devices of one profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceKind {
    /// Whole GPUs (`type == "gpu"`).
    WholeGpu,
    /// MIG devices of one profile (`type == "mig" && profile == …`).
    Mig {
        /// The MIG profile, e.g. `1g.10gb`.
        profile: String,
    },
}

/// A class's GPU selector with every value parsed: the devices it matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSelector {
    /// Whole GPUs or MIG devices.
    pub kind: DeviceKind,
    /// Accepted `productName` values; empty accepts any.
    pub product_names: Vec<String>,
    /// Least `memory` capacity, in bytes.
    pub min_memory_bytes: Option<u64>,
    /// Least `cudaComputeCapability`.
    pub min_compute_capability: Option<ComputeCapability>,
}

impl DeviceSelector {
    /// The selector of a class's parameters, checked; `path` names the parameters object in
    /// error messages (e.g. `spec`).
    ///
    /// # Errors
    ///
    /// [`kerf_api::Error::InvalidConfig`] naming the first bad field (see
    /// [`GpuClassParameters::validate`]).
    pub fn new(params: &GpuClassParameters, path: &str) -> kerf_api::Result<Self> {
        params.validate(path)?;
        let selector_path = if path.is_empty() {
            "selector".to_owned()
        } else {
            format!("{path}.selector")
        };
        let selector = &params.selector;
        Ok(Self {
            kind: selector
                .mig_profile
                .clone()
                .map_or(DeviceKind::WholeGpu, |profile| DeviceKind::Mig { profile }),
            product_names: selector.product_names.clone(),
            min_memory_bytes: selector.min_memory_bytes(&selector_path)?,
            min_compute_capability: selector.min_compute_capability(&selector_path)?,
        })
    }

    /// The CEL expression that matches exactly these devices of `driver`.
    ///
    /// It tests `device.driver` first: `&&` then skips other drivers' devices, which lack
    /// kerf's attributes and would make the rest of the expression fail.
    pub fn cel(&self, driver: &str) -> String {
        let mut clauses = vec![driver_guard(driver)];
        let attribute = |name: &str| format!("device.attributes[{}].{name}", cel_string(driver));
        match &self.kind {
            DeviceKind::WholeGpu => clauses.push(format!(
                "{} == {}",
                attribute(attributes::TYPE),
                cel_string(TYPE_GPU)
            )),
            DeviceKind::Mig { profile } => {
                clauses.push(format!(
                    "{} == {}",
                    attribute(attributes::TYPE),
                    cel_string(TYPE_MIG)
                ));
                clauses.push(format!(
                    "{} == {}",
                    attribute(attributes::PROFILE),
                    cel_string(profile)
                ));
            }
        }
        if !self.product_names.is_empty() {
            let names: Vec<String> = self.product_names.iter().map(|n| cel_string(n)).collect();
            clauses.push(format!(
                "{} in [{}]",
                attribute(attributes::PRODUCT_NAME),
                names.join(", ")
            ));
        }
        if let Some(bytes) = self.min_memory_bytes {
            clauses.push(format!(
                "device.capacity[{}].{}.compareTo(quantity({})) >= 0",
                cel_string(driver),
                capacities::MEMORY,
                cel_string(&format_bytes(bytes))
            ));
        }
        if let Some(capability) = self.min_compute_capability {
            clauses.push(format!(
                "{}.compareTo(semver({})) >= 0",
                attribute(attributes::CUDA_COMPUTE_CAPABILITY),
                cel_string(&capability_semver(capability))
            ));
        }
        clauses.join(" && ")
    }

    /// Whether `device`, published by `driver`, matches, with the CEL expression's semantics
    /// (unqualified attribute names are in the driver's domain). A device whose attribute is
    /// missing or malformed does not match, where CEL would fail the evaluation. The caller
    /// picks the driver's devices (the CEL's `device.driver` test).
    pub fn matches<D: DeviceFields>(&self, device: &D, driver: &str) -> bool {
        self.kind_matches(device, driver)
            && self.product_matches(device, driver)
            && self.memory_matches(device, driver)
            && self.capability_matches(device, driver)
    }

    fn kind_matches<D: DeviceFields>(&self, device: &D, driver: &str) -> bool {
        let device_type = string_attribute(device, driver, attributes::TYPE);
        match &self.kind {
            DeviceKind::WholeGpu => device_type == Some(TYPE_GPU),
            DeviceKind::Mig { profile } => {
                device_type == Some(TYPE_MIG)
                    && string_attribute(device, driver, attributes::PROFILE)
                        == Some(profile.as_str())
            }
        }
    }

    fn product_matches<D: DeviceFields>(&self, device: &D, driver: &str) -> bool {
        self.product_names.is_empty()
            || string_attribute(device, driver, attributes::PRODUCT_NAME)
                .is_some_and(|product| self.product_names.iter().any(|n| n == product))
    }

    fn memory_matches<D: DeviceFields>(&self, device: &D, driver: &str) -> bool {
        self.min_memory_bytes
            .is_none_or(|min| device_memory_bytes(device, driver).is_some_and(|m| m >= min))
    }

    fn capability_matches<D: DeviceFields>(&self, device: &D, driver: &str) -> bool {
        self.min_compute_capability.is_none_or(|min| {
            device_attribute(device, driver, attributes::CUDA_COMPUTE_CAPABILITY)
                .and_then(|a| a.version.as_deref())
                .and_then(|v| compare_semver(v, (min.major.into(), min.minor.into(), 0)))
                .is_some_and(Ordering::is_ge)
        })
    }
}

/// The CEL expression of a class's DeviceClass.
///
/// Scheduler classes get [`DeviceSelector::cel`] and the ownership guard
/// ([`kerf_api::ownership::scheduler_guard_cel`]): kube-scheduler allocates only devices the
/// ownership record gives it. Controller classes get a selector that no
/// published device matches (`type == "slice"`), so kube-scheduler leaves their claims
/// unallocated until kerf's controller writes the allocation; the controller reads the GPU
/// selector from the class parameters instead.
///
/// `consumable_capacity` says whether the API server serves DRAConsumableCapacity. Only then
/// does the DRA CEL environment declare `device.allowMultipleAllocations` (kubernetes
/// `staging/src/k8s.io/dynamic-resource-allocation/cel/compile.go`, `newCompiler`: the
/// `kubernetes.DRADevice` type gains the field only when `Features.EnableConsumableCapacity`
/// is set; `DeviceMatches` passes a device without the field as `false`); without the feature
/// an expression naming it does not compile. With it, a sliced Scheduler class
/// ([`GpuClassParameters::is_scheduler_sliced`]) selects only shareable GPUs
/// (`device.allowMultipleAllocations`) and a whole-GPU Scheduler class only GPUs that are not
/// (`!device.allowMultipleAllocations`), so a GPU published for shares is never taken whole.
/// Without it, a sliced Scheduler class selects nothing ([`unavailable_cel`]): handing out
/// whole GPUs for a class that asked for shares would half-work.
///
/// # Errors
///
/// As [`DeviceSelector::new`].
pub(crate) fn class_cel(
    params: &GpuClassParameters,
    driver: &str,
    path: &str,
    consumable_capacity: bool,
) -> kerf_api::Result<String> {
    let selector = DeviceSelector::new(params, path)?;
    let sliced = params.is_scheduler_sliced();
    Ok(match params.allocator {
        Allocator::Scheduler if sliced && !consumable_capacity => unavailable_cel(driver),
        Allocator::Scheduler => {
            let mut cel = format!(
                "{} && {}",
                selector.cel(driver),
                kerf_api::ownership::scheduler_guard_cel(driver)
            );
            if consumable_capacity && selector.kind == DeviceKind::WholeGpu {
                cel.push_str(if sliced {
                    " && device.allowMultipleAllocations"
                } else {
                    " && !device.allowMultipleAllocations"
                });
            }
            cel
        }
        Allocator::Controller => controller_cel(driver),
    })
}

/// `type` value of no published device, selected by sliced Scheduler classes on a cluster
/// without DRAConsumableCapacity: their claims stay pending, and the class says why.
const TYPE_SHARES_UNAVAILABLE: &str = "shares-unavailable";

/// The never-matching selector of a sliced Scheduler class without DRAConsumableCapacity.
pub fn unavailable_cel(driver: &str) -> String {
    format!(
        "{} && device.attributes[{}].{} == {}",
        driver_guard(driver),
        cel_string(driver),
        attributes::TYPE,
        cel_string(TYPE_SHARES_UNAVAILABLE)
    )
}

/// The never-matching selector of Controller classes.
fn controller_cel(driver: &str) -> String {
    format!(
        "{} && device.attributes[{}].{} == {}",
        driver_guard(driver),
        cel_string(driver),
        attributes::TYPE,
        cel_string(TYPE_SLICE)
    )
}

fn driver_guard(driver: &str) -> String {
    format!("device.driver == {}", cel_string(driver))
}

/// `major.minor.0`: the DRA CEL environment's `semver()` does not normalise short versions.
fn capability_semver(capability: ComputeCapability) -> String {
    format!("{}.{}.0", capability.major, capability.minor)
}

/// A CEL double-quoted string literal of `value`.
pub(crate) fn cel_string(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                // Infallible: writing to a String.
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn string_attribute<'a, D: DeviceFields>(
    device: &'a D,
    driver: &str,
    name: &str,
) -> Option<&'a str> {
    match device_attribute(device, driver, name) {
        Some(DeviceAttribute {
            string: Some(value),
            ..
        }) => Some(value),
        _ => None,
    }
}

/// Compares a published semver (`major.minor.patch[-pre][+build]`) with a release version; a
/// pre-release sorts before its release, as in semver. `None` when it does not parse.
fn compare_semver(version: &str, release: (u64, u64, u64)) -> Option<Ordering> {
    let without_build = version.split_once('+').map_or(version, |(v, _)| v);
    let (core, pre) = match without_build.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (without_build, None),
    };
    let mut parts = core.split('.').map(|part| {
        (!part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
            .then(|| part.parse::<u64>().ok())
            .flatten()
    });
    let parsed = (parts.next()??, parts.next()??, parts.next()??);
    if parts.next().is_some() {
        return None;
    }
    Some(match parsed.cmp(&release) {
        Ordering::Equal if pre.is_some() => Ordering::Less,
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{Device, DeviceCapacity};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use kerf_api::params::GpuSelector;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    const DRIVER: &str = "gpu.kerf.dev";

    fn params(allocator: Allocator, selector: GpuSelector) -> GpuClassParameters {
        GpuClassParameters {
            allocator,
            selector,
            ..GpuClassParameters::default()
        }
    }

    fn string(value: &str) -> DeviceAttribute {
        DeviceAttribute {
            string: Some(value.to_owned()),
            ..DeviceAttribute::default()
        }
    }

    fn device(kind: &str, product: &str, memory: &str, capability: &str) -> Device {
        let mut attributes = BTreeMap::from([
            ("type".to_owned(), string(kind)),
            ("productName".to_owned(), string(product)),
            (
                "cudaComputeCapability".to_owned(),
                DeviceAttribute {
                    version: Some(capability.to_owned()),
                    ..DeviceAttribute::default()
                },
            ),
        ]);
        if kind == "mig" {
            attributes.insert("profile".to_owned(), string("1g.10gb"));
        }
        Device {
            name: "gpu-0".to_owned(),
            attributes: Some(attributes),
            capacity: Some(BTreeMap::from([(
                "memory".to_owned(),
                DeviceCapacity {
                    value: Quantity(memory.to_owned()),
                    request_policy: None,
                },
            )])),
            ..Device::default()
        }
    }

    fn whole_gpu_selector() -> GpuSelector {
        GpuSelector {
            product_names: vec![
                "NVIDIA H100 80GB HBM3".to_owned(),
                "NVIDIA A100-SXM4-40GB".to_owned(),
            ],
            min_memory: Some(Quantity("40Gi".to_owned())),
            min_compute_capability: Some("8.0".to_owned()),
            mig_profile: None,
        }
    }

    #[test]
    fn whole_gpu_cel() {
        let cel = class_cel(
            &params(Allocator::Scheduler, whole_gpu_selector()),
            DRIVER,
            "spec",
            false,
        )
        .unwrap();
        assert_eq!(
            cel,
            r#"device.driver == "gpu.kerf.dev" && device.attributes["gpu.kerf.dev"].type == "gpu" && device.attributes["gpu.kerf.dev"].productName in ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"] && device.capacity["gpu.kerf.dev"].memory.compareTo(quantity("40Gi")) >= 0 && device.attributes["gpu.kerf.dev"].cudaComputeCapability.compareTo(semver("8.0.0")) >= 0 && "allocator" in device.attributes["gpu.kerf.dev"] && device.attributes["gpu.kerf.dev"].allocator == "scheduler""#
        );
    }

    #[test]
    fn consumable_capacity_splits_whole_and_sliced_scheduler_classes() {
        let guard = r#""allocator" in device.attributes["gpu.kerf.dev"] && device.attributes["gpu.kerf.dev"].allocator == "scheduler""#;
        let whole = class_cel(
            &params(Allocator::Scheduler, GpuSelector::default()),
            DRIVER,
            "spec",
            true,
        )
        .unwrap();
        assert_eq!(
            whole,
            format!(
                r#"device.driver == "gpu.kerf.dev" && device.attributes["gpu.kerf.dev"].type == "gpu" && {guard} && !device.allowMultipleAllocations"#
            )
        );
        let sliced_params = GpuClassParameters {
            slicing: Some(kerf_api::params::Slicing::default()),
            ..params(Allocator::Scheduler, GpuSelector::default())
        };
        let sliced = class_cel(&sliced_params, DRIVER, "spec", true).unwrap();
        assert_eq!(
            sliced,
            format!(
                r#"device.driver == "gpu.kerf.dev" && device.attributes["gpu.kerf.dev"].type == "gpu" && {guard} && device.allowMultipleAllocations"#
            )
        );
        // Without the feature the field is not declared: no class may name it, and a sliced
        // class selects nothing rather than whole GPUs.
        let old_whole = class_cel(
            &params(Allocator::Scheduler, GpuSelector::default()),
            DRIVER,
            "spec",
            false,
        )
        .unwrap();
        assert!(
            !old_whole.contains("allowMultipleAllocations"),
            "{old_whole}"
        );
        let old_sliced = class_cel(&sliced_params, DRIVER, "spec", false).unwrap();
        assert_eq!(old_sliced, unavailable_cel(DRIVER));
        assert!(!old_sliced.contains("allowMultipleAllocations"));
        // MIG devices are never shareable: their classes are as before.
        let mig = class_cel(
            &params(
                Allocator::Scheduler,
                GpuSelector {
                    mig_profile: Some("1g.10gb".to_owned()),
                    ..GpuSelector::default()
                },
            ),
            DRIVER,
            "spec",
            true,
        )
        .unwrap();
        assert!(!mig.contains("allowMultipleAllocations"), "{mig}");
        // Controller classes with slicing keep their never-matching selector.
        let controller = GpuClassParameters {
            allocator: Allocator::Controller,
            ..sliced_params
        };
        assert_eq!(
            class_cel(&controller, DRIVER, "spec", true).unwrap(),
            controller_cel(DRIVER)
        );
    }

    #[test]
    fn mig_cel() {
        let selector = GpuSelector {
            mig_profile: Some("1g.10gb".to_owned()),
            ..GpuSelector::default()
        };
        let cel = class_cel(
            &params(Allocator::Scheduler, selector),
            DRIVER,
            "spec",
            false,
        )
        .unwrap();
        assert_eq!(
            cel,
            r#"device.driver == "gpu.kerf.dev" && device.attributes["gpu.kerf.dev"].type == "mig" && device.attributes["gpu.kerf.dev"].profile == "1g.10gb" && "allocator" in device.attributes["gpu.kerf.dev"] && device.attributes["gpu.kerf.dev"].allocator == "scheduler""#
        );
    }

    #[test]
    fn controller_cel_matches_nothing_published() {
        let cel = class_cel(
            &params(Allocator::Controller, whole_gpu_selector()),
            DRIVER,
            "spec",
            false,
        )
        .unwrap();
        assert_eq!(
            cel,
            r#"device.driver == "gpu.kerf.dev" && device.attributes["gpu.kerf.dev"].type == "slice""#
        );
        assert_ne!(TYPE_SLICE, TYPE_GPU);
        assert_ne!(TYPE_SLICE, TYPE_MIG);
    }

    #[test]
    fn empty_selector_is_every_whole_gpu() {
        let cel = class_cel(
            &params(Allocator::Scheduler, GpuSelector::default()),
            "x.example.com",
            "spec",
            false,
        )
        .unwrap();
        assert_eq!(
            cel,
            r#"device.driver == "x.example.com" && device.attributes["x.example.com"].type == "gpu" && "allocator" in device.attributes["x.example.com"] && device.attributes["x.example.com"].allocator == "scheduler""#
        );
    }

    #[test]
    fn quantities_are_written_canonically() {
        let selector = GpuSelector {
            min_memory: Some(Quantity("81559Mi".to_owned())),
            ..GpuSelector::default()
        };
        let cel = DeviceSelector::new(&params(Allocator::Scheduler, selector), "spec")
            .unwrap()
            .cel(DRIVER);
        assert!(
            cel.ends_with(r#".memory.compareTo(quantity("81559Mi")) >= 0"#),
            "{cel}"
        );
        let selector = GpuSelector {
            min_memory: Some(Quantity("1.5Gi".to_owned())),
            ..GpuSelector::default()
        };
        let cel = DeviceSelector::new(&params(Allocator::Scheduler, selector), "spec")
            .unwrap()
            .cel(DRIVER);
        assert!(cel.ends_with(r#"quantity("1536Mi")) >= 0"#), "{cel}");
    }

    #[test]
    fn invalid_selectors_name_the_field() {
        let selector = GpuSelector {
            min_memory: Some(Quantity("0.5".to_owned())),
            ..GpuSelector::default()
        };
        let err = class_cel(
            &params(Allocator::Scheduler, selector),
            DRIVER,
            "spec",
            false,
        )
        .unwrap_err();
        assert!(err.to_string().contains("spec.selector.minMemory"), "{err}");
        let selector = GpuSelector {
            mig_profile: Some("1g.10gb".to_owned()),
            ..GpuSelector::default()
        };
        let err = class_cel(
            &params(Allocator::Controller, selector),
            DRIVER,
            "spec",
            false,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("spec.selector.migProfile"),
            "{err}"
        );
    }

    #[test]
    fn strings_are_escaped() {
        assert_eq!(cel_string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(cel_string("a\nb"), r#""a\u000ab""#);
        assert_eq!(cel_string("ünï"), "\"ünï\"");
    }

    #[test]
    fn rust_matching_follows_each_clause() {
        let selector =
            DeviceSelector::new(&params(Allocator::Scheduler, whole_gpu_selector()), "spec")
                .unwrap();
        let h100 = device("gpu", "NVIDIA H100 80GB HBM3", "81559Mi", "9.0.0");
        assert!(selector.matches(&h100, DRIVER));
        assert!(!selector.matches(
            &device("mig", "NVIDIA H100 80GB HBM3", "81559Mi", "9.0.0"),
            DRIVER
        ));
        assert!(!selector.matches(&device("gpu", "NVIDIA L4", "81559Mi", "9.0.0"), DRIVER));
        assert!(!selector.matches(
            &device("gpu", "NVIDIA H100 80GB HBM3", "40959Mi", "9.0.0"),
            DRIVER
        ));
        assert!(selector.matches(
            &device("gpu", "NVIDIA H100 80GB HBM3", "40Gi", "8.0.0"),
            DRIVER
        ));
        assert!(!selector.matches(
            &device("gpu", "NVIDIA H100 80GB HBM3", "40Gi", "7.5.0"),
            DRIVER
        ));
        assert!(!selector.matches(
            &device("gpu", "NVIDIA H100 80GB HBM3", "40Gi", "8.0.0-rc1"),
            DRIVER
        ));
        assert!(!selector.matches(
            &device("gpu", "NVIDIA H100 80GB HBM3", "40Gi", "garbage"),
            DRIVER
        ));
        assert!(!selector.matches(
            &device("gpu", "NVIDIA H100 80GB HBM3", "garbage", "9.0.0"),
            DRIVER
        ));
    }

    #[test]
    fn mig_matching_needs_the_profile() {
        let selector = DeviceSelector::new(
            &params(
                Allocator::Scheduler,
                GpuSelector {
                    mig_profile: Some("1g.10gb".to_owned()),
                    ..GpuSelector::default()
                },
            ),
            "spec",
        )
        .unwrap();
        assert!(selector.matches(
            &device("mig", "NVIDIA A100-SXM4-40GB", "9856Mi", "8.0.0"),
            DRIVER
        ));
        assert!(!selector.matches(
            &device("gpu", "NVIDIA A100-SXM4-40GB", "40Gi", "8.0.0"),
            DRIVER
        ));
        let mut other = device("mig", "NVIDIA A100-SXM4-40GB", "9856Mi", "8.0.0");
        other
            .attributes
            .as_mut()
            .unwrap()
            .insert("profile".to_owned(), string("2g.20gb"));
        assert!(!selector.matches(&other, DRIVER));
    }

    #[test]
    fn qualified_attribute_names_match_too() {
        let mut d = device("gpu", "NVIDIA L4", "23034Mi", "8.9.0");
        let attributes = d.attributes.take().unwrap();
        d.attributes = Some(
            attributes
                .into_iter()
                .map(|(k, v)| (format!("{DRIVER}/{k}"), v))
                .collect(),
        );
        let selector = DeviceSelector::new(
            &params(
                Allocator::Scheduler,
                GpuSelector {
                    product_names: vec!["NVIDIA L4".to_owned()],
                    ..GpuSelector::default()
                },
            ),
            "spec",
        )
        .unwrap();
        assert!(selector.matches(&d, DRIVER));
    }

    proptest! {
        #[test]
        fn semver_comparison_is_numeric(a in (0u64..200, 0u64..200, 0u64..200), b in (0u64..200, 0u64..200, 0u64..200)) {
            let text = format!("{}.{}.{}", a.0, a.1, a.2);
            prop_assert_eq!(compare_semver(&text, b), Some(a.cmp(&b)));
        }

        #[test]
        fn minimum_memory_is_inclusive(memory in 1u64..(1 << 50), delta in 0u64..(1 << 20)) {
            let selector = DeviceSelector {
                kind: DeviceKind::WholeGpu,
                product_names: Vec::new(),
                min_memory_bytes: Some(memory),
                min_compute_capability: None,
            };
            let at = device("gpu", "p", &memory.to_string(), "9.0.0");
            let above = device("gpu", "p", &(memory + delta).to_string(), "9.0.0");
            prop_assert!(selector.matches(&at, DRIVER));
            prop_assert!(selector.matches(&above, DRIVER));
            if memory > delta && delta > 0 {
                let below = device("gpu", "p", &(memory - delta).to_string(), "9.0.0");
                prop_assert!(!selector.matches(&below, DRIVER));
            }
        }

        #[test]
        fn cel_strings_round_trip_quotes(value in "\\PC{0,40}") {
            let literal = cel_string(&value);
            prop_assert!(literal.starts_with('"') && literal.ends_with('"'));
            // No unescaped quote inside: every quote is preceded by an odd run of backslashes.
            let inner = &literal[1..literal.len() - 1];
            let bytes = inner.as_bytes();
            for (i, b) in bytes.iter().enumerate() {
                if *b == b'"' {
                    let backslashes = bytes[..i].iter().rev().take_while(|c| **c == b'\\').count();
                    prop_assert!(backslashes % 2 == 1, "{literal}");
                }
            }
        }
    }
}
