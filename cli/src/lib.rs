//! kerf-cli: the commands behind the `kerf` binary.
//!
//! - [`inventory`]: the ResourceSlices the kubelet plugin would publish for this node.
//! - [`demo`]: kerf's main job on one mock node — the real kubelet plugin, the real
//!   controller allocator, a kubelet stand-in and optionally podman — with no cluster.
//! - [`status`]: every kerf GPU of the cluster per node, from kerf's ResourceSlices and the
//!   claims allocated on them (or from saved YAML).
//! - [`args`]: the command line of `kerf`; [`reference`]: every kerf binary's flags as the
//!   Markdown of docs/configuration.md.

pub mod args;
pub mod demo;
mod error;
pub mod inventory;
pub mod reference;
pub mod status;

pub use error::{Error, Result};
