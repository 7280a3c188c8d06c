//! Mock GPU discovery: a named profile or a YAML inventory file (see [`kerf_core::mock`]).

use std::path::{Path, PathBuf};

use kerf_core::inventory::Inventory;

use super::DeviceDiscovery;
use crate::Result;

/// Discovery that returns a mock inventory.
#[derive(Debug, Clone)]
pub(crate) struct MockDiscovery {
    source: MockSource,
}

#[derive(Debug, Clone)]
enum MockSource {
    /// Built once from `PROFILE[:COUNT]`.
    Profile(Inventory),
    /// Read again at every discovery, so an edited file is picked up on republish.
    File(PathBuf),
}

impl MockDiscovery {
    /// A mock of the profile `PROFILE[:COUNT]`, e.g. `h100-sxm-80gb` or `l4:4`.
    ///
    /// # Errors
    /// [`crate::Error::Core`] with an unknown profile or a bad count.
    pub fn from_spec(spec: &str) -> Result<Self> {
        Ok(MockDiscovery {
            source: MockSource::Profile(kerf_core::mock::from_spec(spec)?),
        })
    }

    /// A mock read from a YAML inventory file. The file is loaded now, so that a broken file
    /// is reported at start-up, and again at every [`DeviceDiscovery::discover`].
    ///
    /// # Errors
    /// [`crate::Error::Core`] when the file cannot be read, decoded or validated.
    pub(crate) fn from_file(path: &Path) -> Result<Self> {
        kerf_core::mock::load_file(path)?;
        Ok(MockDiscovery {
            source: MockSource::File(path.to_path_buf()),
        })
    }
}

impl DeviceDiscovery for MockDiscovery {
    fn discover(&self) -> Result<Inventory> {
        match &self.source {
            MockSource::Profile(inventory) => Ok(inventory.clone()),
            MockSource::File(path) => Ok(kerf_core::mock::load_file(path)?),
        }
    }

    fn source(&self) -> &'static str {
        match self.source {
            MockSource::Profile(_) => "mock-profile",
            MockSource::File(_) => "mock-file",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn profile() {
        let discovery = MockDiscovery::from_spec("l4:3").unwrap();
        assert_eq!(discovery.source(), "mock-profile");
        assert_eq!(discovery.discover().unwrap().gpus.len(), 3);
        assert!(matches!(
            MockDiscovery::from_spec("nope"),
            Err(Error::Core(kerf_core::Error::UnknownMockProfile { .. }))
        ));
    }

    #[test]
    fn file_is_reread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inventory.yaml");
        let write = |spec: &str| {
            let inventory = kerf_core::mock::from_spec(spec).unwrap();
            std::fs::write(&path, serde_json::to_string(&inventory).unwrap()).unwrap();
        };
        write("l4:1");
        let discovery = MockDiscovery::from_file(&path).unwrap();
        assert_eq!(discovery.source(), "mock-file");
        assert_eq!(discovery.discover().unwrap().gpus.len(), 1);
        write("l4:2");
        assert_eq!(discovery.discover().unwrap().gpus.len(), 2);
        std::fs::write(&path, "driverVersion: [").unwrap();
        assert!(matches!(
            discovery.discover(),
            Err(Error::Core(kerf_core::Error::Yaml { .. }))
        ));
        assert!(MockDiscovery::from_file(&path).is_err());
    }
}
