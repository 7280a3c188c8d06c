//! Where the node's GPU inventory comes from: NVML on a real node, or a mock inventory (a named
//! profile or a YAML file) for demos, CI and clusters without GPUs.
//!
//! [`select`] picks the source from the command-line choices.

use std::path::Path;
use std::sync::Arc;

use kerf_core::inventory::Inventory;

use crate::{Error, Result};

pub mod facts;
pub mod mock;
pub mod nvml;
// The one module of kerf that may use `unsafe`: raw NVML calls nvml-wrapper has no safe API
// for. Its module docs explain why each unsafe block is sound.
#[allow(unsafe_code)]
pub(crate) mod nvml_raw;

pub(crate) use facts::{DynamicMigPolicy, KerfInstances};
pub(crate) use mock::MockDiscovery;
pub(crate) use nvml::NvmlDiscovery;

/// Where NVML discovery gets its [`DynamicMigPolicy`] each time it runs: the flags, and the
/// MIG instances the checkpoint records now.
pub(crate) type DynamicMigSource = Arc<dyn Fn() -> DynamicMigPolicy + Send + Sync>;

/// A source of the node's GPU inventory.
pub trait DeviceDiscovery: Send + Sync {
    /// Discovers the GPUs now. Called at start-up and again whenever the plugin republishes.
    ///
    /// # Errors
    /// The source cannot be read, or what it reports is not a valid inventory.
    fn discover(&self) -> Result<Inventory, Error>;

    /// A short name of the source for logs and metrics: `nvml`, `mock-profile`, `mock-file`.
    fn source(&self) -> &'static str;
}

/// Picks the discovery source: the mock profile `mock_gpus` (`PROFILE[:COUNT]`), the mock
/// inventory file `mock_inventory`, or, when neither is given, NVML.
///
/// # Errors
/// - [`Error::Config`] when both mock options are given;
/// - [`Error::Core`] when the mock profile or file is unusable;
/// - [`Error::NoDiscovery`] when neither is given and NVML cannot be loaded; its message
///   carries NVML's error and the hint to use `--mock-gpus`.
pub fn select(
    mock_gpus: Option<&str>,
    mock_inventory: Option<&Path>,
) -> Result<Box<dyn DeviceDiscovery>> {
    select_with_dynamic_mig(mock_gpus, mock_inventory, None)
}

/// [`select`], with NVML discovery marking dynamic-MIG GPUs as `dynamic_mig` decides
/// ([`NvmlDiscovery::with_dynamic_mig`]). Mock inventories carry their own
/// [`kerf_core::inventory::Gpu::dynamic_mig`] and ignore it.
///
/// # Errors
/// As [`select`].
pub(crate) fn select_with_dynamic_mig(
    mock_gpus: Option<&str>,
    mock_inventory: Option<&Path>,
    dynamic_mig: Option<DynamicMigSource>,
) -> Result<Box<dyn DeviceDiscovery>> {
    match (mock_gpus, mock_inventory) {
        (Some(spec), Some(path)) => Err(Error::Config(format!(
            "--mock-gpus ({spec}) and --mock-inventory ({}) are mutually exclusive; pass one",
            path.display()
        ))),
        (Some(spec), None) => Ok(Box::new(MockDiscovery::from_spec(spec)?)),
        (None, Some(path)) => Ok(Box::new(MockDiscovery::from_file(path)?)),
        (None, None) => match NvmlDiscovery::init() {
            Ok(nvml) => Ok(Box::new(match dynamic_mig {
                Some(source) => nvml.with_dynamic_mig(source),
                None => nvml,
            })),
            Err(Error::Nvml(message)) => Err(Error::NoDiscovery(message)),
            Err(other) => Err(Error::NoDiscovery(other.to_string())),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_mocks_is_a_config_error() {
        let err = select(Some("l4"), Some(Path::new("x.yaml"))).err();
        assert!(
            matches!(&err, Some(Error::Config(m)) if m.contains("mutually exclusive")),
            "{err:?}"
        );
    }

    #[test]
    fn mock_profile_and_file() {
        let discovery = select(Some("h100-sxm-80gb:2"), None).unwrap();
        assert_eq!(discovery.source(), "mock-profile");
        assert_eq!(discovery.discover().unwrap().gpus.len(), 2);
        let example =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/inventory/custom.yaml");
        let discovery = select(None, Some(&example)).unwrap();
        assert_eq!(discovery.source(), "mock-file");
        assert!(discovery.discover().is_ok());
        assert!(matches!(select(Some("l4:0"), None), Err(Error::Core(_))));
        assert!(matches!(
            select(None, Some(Path::new("/nonexistent/inv.yaml"))),
            Err(Error::Core(_))
        ));
    }

    /// No NVIDIA driver on this machine: falling back to NVML fails with the hint to use a mock.
    #[test]
    fn no_gpu_and_no_mock_explains_what_to_do() {
        match select(None, None) {
            Ok(discovery) => assert_eq!(discovery.source(), "nvml"),
            Err(err @ Error::NoDiscovery(_)) => {
                let text = err.to_string();
                assert!(text.contains("libnvidia-ml"), "{text}");
                assert!(text.contains("--mock-gpus"), "{text}");
            }
            Err(other) => panic!("expected NoDiscovery, got {other:?}"),
        }
    }
}
