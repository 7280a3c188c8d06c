//! The plugin's gRPC services and the Unix sockets that carry them.

pub mod dra;
pub mod health;
pub mod instances;
pub mod kubelet_version;
pub mod registration;
pub mod socket;
