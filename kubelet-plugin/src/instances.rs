//! Other instances of this driver on this node: during a rolling update with per-instance
//! socket names (the pod UID, see `args.rs`), the old and the new plugin each have their own
//! registration socket in the kubelet's registry directory.
//!
//! The old instance's clean shutdown must not delete the node's ResourceSlices while the new
//! one serves: the new instance's publisher would put them back only after its watch saw the
//! deletion, and in between the scheduler sees no devices on the node. Upstream's helper does
//! not delete slices when it stops (`k8s.io/dynamic-resource-allocation/kubeletplugin`,
//! `draplugin.go`, `Helper.PublishResources`: "don't delete ResourceSlices, not even on a
//! clean shutdown. We either support rolling updates and want to hand over seamlessly [...]")
//! and leaves a gone driver's slices to the kubelet, which wipes them 30 s after its last
//! instance is gone (`pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`,
//! `DRAPluginManager.sync`). kerf keeps deleting them on an uninstall, when no other
//! instance answers, and leaves them to the instance that does.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long a registration socket may take to accept a connection to count as served.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Finds the other instances of one driver by their registration sockets.
#[derive(Debug, Clone)]
pub(crate) struct OtherInstances {
    registry_dir: PathBuf,
    driver: String,
    own_socket: PathBuf,
}

impl OtherInstances {
    /// The instances of `driver` in `registry_dir` other than the one registered through
    /// `own_socket`.
    pub fn new(registry_dir: &Path, driver: &str, own_socket: &Path) -> Self {
        OtherInstances {
            registry_dir: registry_dir.to_owned(),
            driver: driver.to_owned(),
            own_socket: own_socket.to_owned(),
        }
    }

    /// For the instance whose registration socket is `own_socket`: its directory is the
    /// registry. `None` for a socket path without a directory.
    pub(crate) fn of_socket(driver: &str, own_socket: &Path) -> Option<Self> {
        let dir = own_socket.parent()?;
        Some(Self::new(dir, driver, own_socket))
    }

    /// The registration sockets of this driver's other instances that accept a connection
    /// now. A socket file left by a killed instance refuses connections and does not count.
    pub async fn serving(&self) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(&self.registry_dir) else {
            return Vec::new();
        };
        let candidates: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .filter(|e| self.is_instance_socket(&e.file_name().to_string_lossy()))
            .map(|e| e.path())
            .filter(|path| *path != self.own_socket)
            .collect();
        let mut serving = Vec::new();
        for path in candidates {
            let connect = tokio::net::UnixStream::connect(&path);
            if let Ok(Ok(_)) = tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
                serving.push(path);
            }
        }
        serving
    }

    /// `<driver>-reg.sock` or `<driver>-<pod uid>-reg.sock`.
    fn is_instance_socket(&self, name: &str) -> bool {
        let Some(rest) = name.strip_prefix(self.driver.as_str()) else {
            return false;
        };
        match rest.strip_suffix("-reg.sock") {
            Some("") => true,
            Some(uid) => uid.strip_prefix('-').is_some_and(is_pod_uid),
            None => false,
        }
    }
}

/// A pod UID as the API server assigns it: an RFC 4122 UUID in its 36-character form.
fn is_pod_uid(value: &str) -> bool {
    value.len() == 36 && value.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f3c2a9e-6a52-4c1e-9b3d-2f1e8c7d6b5a";

    #[test]
    fn names_of_this_drivers_instances() {
        let others = OtherInstances::new(Path::new("/r"), "gpu.kerf.dev", Path::new("/r/x"));
        assert!(others.is_instance_socket("gpu.kerf.dev-reg.sock"));
        assert!(others.is_instance_socket(&format!("gpu.kerf.dev-{UID}-reg.sock")));
        assert!(!others.is_instance_socket("gpu.kerf.dev-other-reg.sock"));
        assert!(!others.is_instance_socket("gpu.example.com-reg.sock"));
        assert!(!others.is_instance_socket(&format!("gpu.kerf.dev-{UID}.sock")));
    }

    #[tokio::test]
    async fn only_serving_sockets_of_others_count() {
        let dir = tempfile::tempdir().unwrap();
        let own = dir.path().join("gpu.kerf.dev-reg.sock");
        let _own = std::os::unix::net::UnixListener::bind(&own).unwrap();
        let others = OtherInstances::new(dir.path(), "gpu.kerf.dev", &own);
        assert!(
            others.serving().await.is_empty(),
            "its own socket does not count"
        );
        let stale = dir.path().join(format!("gpu.kerf.dev-{UID}-reg.sock"));
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        assert!(
            others.serving().await.is_empty(),
            "a stale socket does not count"
        );
        std::fs::remove_file(&stale).unwrap();
        let _newer = std::os::unix::net::UnixListener::bind(&stale).unwrap();
        assert_eq!(others.serving().await, [stale]);
    }
}
