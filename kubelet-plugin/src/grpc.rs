//! The plugin's gRPC services and the Unix sockets that carry them. The DRA health service,
//! which serves on the DRA socket too, is with the rest of GPU health ([`crate::health::grpc`]).

pub mod dra;
pub mod kubelet_version;
pub mod registration;
pub mod socket;
