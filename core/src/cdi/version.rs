//! CDI spec versions and the lowest version a spec's fields allow.
//!
//! Runtimes refuse a spec whose `cdiVersion` is lower than its fields need, and also
//! versions they do not know (podman 4.3 stops at 0.5.0, containerd 1.7 at 0.8.0). So kerf
//! writes the lowest version that fits, never a fixed newer one.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::spec::{ContainerEdits, Spec};
use crate::error::Error;

/// A CDI specification version kerf can write or read.
///
/// Ordered: a later variant is a newer version. 0.3.0 is the earliest version the reference
/// implementation accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CdiVersion {
    /// 0.3.0: the baseline.
    V0_3_0,
    /// 0.4.0: `mounts[].type`.
    V0_4_0,
    /// 0.5.0: `deviceNodes[].hostPath`; device names starting with a digit.
    V0_5_0,
    /// 0.6.0: annotations; dots in the class part of `kind`.
    V0_6_0,
    /// 0.7.0: `intelRdt`, `additionalGids`.
    V0_7_0,
    /// 0.8.0: no new fields.
    V0_8_0,
    /// 1.0.0: no new fields.
    V1_0_0,
    /// 1.1.0: `netDevices`; `intelRdt.schemata`, `intelRdt.enableMonitoring`.
    V1_1_0,
}

impl CdiVersion {
    /// Every version, oldest first.
    pub const ALL: [CdiVersion; 8] = [
        CdiVersion::V0_3_0,
        CdiVersion::V0_4_0,
        CdiVersion::V0_5_0,
        CdiVersion::V0_6_0,
        CdiVersion::V0_7_0,
        CdiVersion::V0_8_0,
        CdiVersion::V1_0_0,
        CdiVersion::V1_1_0,
    ];

    /// The version as written in `cdiVersion`, e.g. `0.5.0`.
    pub fn as_str(self) -> &'static str {
        match self {
            CdiVersion::V0_3_0 => "0.3.0",
            CdiVersion::V0_4_0 => "0.4.0",
            CdiVersion::V0_5_0 => "0.5.0",
            CdiVersion::V0_6_0 => "0.6.0",
            CdiVersion::V0_7_0 => "0.7.0",
            CdiVersion::V0_8_0 => "0.8.0",
            CdiVersion::V1_0_0 => "1.0.0",
            CdiVersion::V1_1_0 => "1.1.0",
        }
    }
}

impl fmt::Display for CdiVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CdiVersion {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CdiVersion::ALL
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| {
                Error::InvalidCdiSpec(format!(
                    "unsupported cdiVersion {s:?} (kerf knows 0.3.0 to 1.1.0)"
                ))
            })
    }
}

impl Serialize for CdiVersion {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for CdiVersion {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Spec {
    /// The lowest CDI version whose fields cover everything this spec uses, following the
    /// reference implementation's rules (empty strings count as absent, as in Go).
    pub fn minimum_version(&self) -> CdiVersion {
        let all_edits = || {
            std::iter::once(&self.container_edits)
                .chain(self.devices.iter().map(|d| &d.container_edits))
        };
        let edits_need = all_edits()
            .map(edits_minimum_version)
            .max()
            .unwrap_or(CdiVersion::V0_3_0);
        edits_need.max(self.naming_minimum_version())
    }

    /// What the kind, device names and annotations need.
    fn naming_minimum_version(&self) -> CdiVersion {
        let annotated =
            !self.annotations.is_empty() || self.devices.iter().any(|d| !d.annotations.is_empty());
        let dotted_class = self
            .kind
            .split_once('/')
            .is_some_and(|(vendor, class)| !vendor.is_empty() && class.contains('.'));
        if annotated || dotted_class {
            return CdiVersion::V0_6_0;
        }
        let digit_name = self.devices.iter().any(|d| {
            d.name
                .bytes()
                .next()
                .is_some_and(|b| !b.is_ascii_alphabetic())
        });
        if digit_name {
            CdiVersion::V0_5_0
        } else {
            CdiVersion::V0_3_0
        }
    }
}

fn edits_minimum_version(edits: &ContainerEdits) -> CdiVersion {
    let rdt_v110 = edits
        .intel_rdt
        .as_ref()
        .is_some_and(|r| !r.schemata.is_empty() || r.enable_monitoring);
    if !edits.net_devices.is_empty() || rdt_v110 {
        CdiVersion::V1_1_0
    } else if edits.intel_rdt.is_some() || !edits.additional_gids.is_empty() {
        CdiVersion::V0_7_0
    } else if edits
        .device_nodes
        .iter()
        .any(|n| n.host_path.as_deref().is_some_and(|p| !p.is_empty()))
    {
        CdiVersion::V0_5_0
    } else if edits
        .mounts
        .iter()
        .any(|m| m.fs_type.as_deref().is_some_and(|t| !t.is_empty()))
    {
        CdiVersion::V0_4_0
    } else {
        CdiVersion::V0_3_0
    }
}
