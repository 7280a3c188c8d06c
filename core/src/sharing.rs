//! What a prepared device gives a container: the whole device or a slice of it, and how the
//! device is shared.

use serde::{Deserialize, Serialize};

/// How a device is shared between the claims (and containers) that use it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Sharing {
    /// One claim holds the device alone.
    #[default]
    Exclusive,
    /// CUDA MPS: several claims run concurrently with per-client limits.
    #[serde(rename = "MPS")]
    Mps,
    /// Time slicing: several claims take turns on the device.
    TimeSlicing,
}

impl Sharing {
    /// The name used in the API and in container environments.
    pub fn as_str(self) -> &'static str {
        match self {
            Sharing::Exclusive => "Exclusive",
            Sharing::Mps => "MPS",
            Sharing::TimeSlicing => "TimeSlicing",
        }
    }
}

impl std::fmt::Display for Sharing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The share of one GPU that a claim's device was given. `None` fields mean "all of it".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceLimits {
    /// Device memory the slice may pin, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Percent (1–100) of the GPU's multiprocessors the slice may use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_percent: Option<u8>,
}

impl SliceLimits {
    /// True when the limits select the whole device.
    pub fn is_whole(&self) -> bool {
        self.memory_bytes.is_none() && self.compute_percent.is_none()
    }
}
