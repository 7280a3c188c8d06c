//! kerf-cli: the commands behind the `kerf` binary.
//!
//! - [`inventory`]: the ResourceSlices the kubelet plugin would publish for this node.
//! - [`demo`]: kerf's main job on one mock node — the real kubelet plugin, the real
//!   controller allocator, a kubelet stand-in and optionally podman — with no cluster.

pub mod demo;
pub mod error;
pub mod inventory;

pub use error::{Error, Result};
