//! Per-instance socket names (the pod UID, see `args.rs`) need a kubelet that keeps several
//! registrations of one driver: 1.33 and later (`pkg/kubelet/cm/dra/plugin`, the plugin store
//! keyed by driver and endpoint). Before 1.33, `RegistrationHandler.DeRegisterPlugin`
//! deleted the driver by name, so the old instance's deregistration at the end of a rolling
//! update would remove the new instance too, and "no instance left" (kubernetes
//! `pkg/kubelet/pluginmanager/pluginwatcher/README.md`, "Deployment").
//!
//! Upstream's helper has no fallback: its `RollingUpdate` option says "Don't use this if it is
//! not certain that the kubelet has that support!". kerf checks its Node's
//! `status.nodeInfo.kubeletVersion` at start-up and, on an older kubelet, uses the fixed names
//! instead: the new instance then replaces the old one's socket files, the kubelet
//! re-registers the driver through them, and the old instance's shutdown leaves them alone
//! (`socket.rs`); a short gap, as without rolling updates, instead of a node without a driver.

use k8s_openapi::api::core::v1::Node;
use kube::Api;

use crate::config::PluginConfig;

/// The first kubelet minor version (of major version 1) that keeps several instances.
const FIRST_MINOR_WITH_INSTANCES: u32 = 33;

/// `config` with the fixed socket names when it has per-instance ones and the kubelet of its
/// node is older than 1.33. A kubelet version that cannot be read keeps the names it has (a
/// warning says so): kerf's supported Kubernetes versions all have the support.
pub async fn sockets_for_kubelet(config: PluginConfig, client: &kube::Client) -> PluginConfig {
    let fixed = fixed_names(&config);
    if fixed
        == (
            config.registration_socket.clone(),
            config.dra_socket.clone(),
        )
    {
        return config;
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let version = match nodes.get(&config.node_name).await {
        Ok(node) => node
            .status
            .and_then(|s| s.node_info)
            .map(|info| info.kubelet_version),
        Err(e) => {
            tracing::warn!(node = %config.node_name, error = %e, "cannot read the kubelet's version; keeping the per-instance socket names (they need kubelet 1.33+)");
            return config;
        }
    };
    match version.as_deref().map(keeps_instances) {
        Some(Some(false)) => {
            tracing::warn!(
                kubelet = version.as_deref().unwrap_or_default(),
                "kubelet older than 1.33 drops a driver when any of its instances deregisters: using the fixed socket names; roll this DaemonSet with maxSurge: 0 on such nodes (docs/operations.md, Upgrading the plugin)"
            );
            let (registration_socket, dra_socket) = fixed;
            PluginConfig {
                registration_socket,
                dra_socket,
                ..config
            }
        }
        Some(Some(true)) => config,
        Some(None) | None => {
            tracing::warn!(
                kubelet = version.as_deref().unwrap_or_default(),
                "unknown kubelet version; keeping the per-instance socket names (they need kubelet 1.33+)"
            );
            config
        }
    }
}

/// The fixed names in the same directories: `<driver>-reg.sock` and `dra.sock`.
fn fixed_names(config: &PluginConfig) -> (std::path::PathBuf, std::path::PathBuf) {
    let beside = |socket: &std::path::Path, name: String| {
        socket
            .parent()
            .map_or_else(|| name.clone().into(), |dir| dir.join(&name))
    };
    (
        beside(
            &config.registration_socket,
            format!("{}-reg.sock", config.driver_name),
        ),
        beside(&config.dra_socket, "dra.sock".to_owned()),
    )
}

/// Whether a kubelet `version` (`v1.33.2`, `v1.32.4-eks-1234`) keeps several instances of a
/// driver; `None` when it does not parse.
fn keeps_instances(version: &str) -> Option<bool> {
    let mut parts = version.strip_prefix('v').unwrap_or(version).split('.');
    let major: u32 = parts.next()?.parse().ok()?;
    let minor: String = parts
        .next()?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let minor: u32 = minor.parse().ok()?;
    Some(major > 1 || (major == 1 && minor >= FIRST_MINOR_WITH_INSTANCES))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubelet_versions() {
        assert_eq!(keeps_instances("v1.33.0"), Some(true));
        assert_eq!(keeps_instances("v1.36.2"), Some(true));
        assert_eq!(keeps_instances("v1.32.4-eks-1234"), Some(false));
        assert_eq!(keeps_instances("v1.31.0"), Some(false));
        assert_eq!(keeps_instances("v1.33+"), Some(true));
        assert_eq!(keeps_instances("v2.0.0"), Some(true));
        assert_eq!(keeps_instances("garbage"), None);
        assert_eq!(keeps_instances(""), None);
    }
}
