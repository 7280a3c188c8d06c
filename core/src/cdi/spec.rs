//! The CDI spec document, field for field as the upstream schema (spec version 1.1.0) names
//! them.
//!
//! Encoding leaves out empty and absent fields, so that a spec only carries, and its
//! [`Spec::minimum_version`] only reflects, what it uses. Decoding rejects unknown fields as
//! CDI loaders do.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::version::CdiVersion;

/// One CDI spec file: a kind and the devices of that kind it defines.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    /// The version of the CDI specification the document complies with.
    pub cdi_version: CdiVersion,
    /// `vendor/class`, e.g. `k8s.gpu.kerf.dev/gpu`.
    pub kind: String,
    /// Spec annotations (need 0.6.0).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// The devices this spec defines.
    pub devices: Vec<Device>,
    /// Edits applied whenever any device of this spec is injected.
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

/// One device of a spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Device {
    /// Device name, unique within the spec; qualified as `vendor/class=name`.
    pub name: String,
    /// Device annotations (need 0.6.0).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Edits applied when this device is injected. The schema requires the field, so it is
    /// always written, if need be as `{}`.
    pub container_edits: ContainerEdits,
}

/// Changes a runtime makes to a container's OCI spec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    /// `NAME=value` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes to create in the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    /// Mounts to add.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    /// OCI hooks to add.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
    /// Supplementary group ids for the container's process (need 0.7.0).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub additional_gids: Vec<u32>,
    /// Intel RDT settings (need 0.7.0; some fields 1.1.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intel_rdt: Option<IntelRdt>,
    /// Network devices to move into the container (need 1.1.0).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub net_devices: Vec<NetDevice>,
}

impl ContainerEdits {
    /// True when the edits change nothing.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty()
            && self.device_nodes.is_empty()
            && self.mounts.is_empty()
            && self.hooks.is_empty()
            && self.additional_gids.is_empty()
            && self.intel_rdt.is_none()
            && self.net_devices.is_empty()
    }
}

/// A device node to create in the container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    /// Path in the container.
    pub path: String,
    /// Host node to take type and numbers from, when not `path` itself (needs 0.5.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// `c`, `b`, `u` or `p`; taken from the host node when absent.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub node_type: Option<String>,
    /// Major number; taken from the host node when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    /// Minor number; taken from the host node when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    /// File mode bits of the node (Go `os.FileMode`; missing from the upstream schema).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_mode: Option<u32>,
    /// Cgroup device permissions, a combination of `r`, `w` and `m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
    /// Owner uid of the node in the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Owner gid of the node in the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

impl DeviceNode {
    /// A node at `path` whose type and numbers the runtime takes from the same host path.
    pub fn at(path: impl Into<String>) -> Self {
        DeviceNode {
            path: path.into(),
            ..DeviceNode::default()
        }
    }
}

/// A mount to add to the container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    /// Source on the host.
    pub host_path: String,
    /// Destination in the container.
    pub container_path: String,
    /// Mount options, e.g. `ro`, `bind`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
    /// File system type (needs 0.4.0). Bind mounts work without it.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub fs_type: Option<String>,
}

/// An OCI hook to add to the container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Hook {
    /// OCI hook point, e.g. `createContainer`.
    pub hook_name: String,
    /// Executable on the host.
    pub path: String,
    /// Arguments, including `argv[0]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// `NAME=value` environment of the hook.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Timeout in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u32>,
}

/// Intel RDT (resctrl) settings of the container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IntelRdt {
    /// resctrl class of service.
    #[serde(default, rename = "closID", skip_serializing_if = "Option::is_none")]
    pub clos_id: Option<String>,
    /// L3 cache allocation schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub l3_cache_schema: Option<String>,
    /// Memory bandwidth schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_bw_schema: Option<String>,
    /// Raw schemata lines (need 1.1.0).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub schemata: Vec<String>,
    /// Whether to create a monitoring group (needs 1.1.0 when true).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub enable_monitoring: bool,
}

/// A host network interface to move into the container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetDevice {
    /// Interface name on the host.
    pub host_interface_name: String,
    /// Interface name in the container.
    pub name: String,
}
