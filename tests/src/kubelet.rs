//! The kubelet-side wire client, which lives in kerf-proto ([`kerf_proto::client`]); this
//! module only re-exports it under its old path.

pub use kerf_proto::client::*;
