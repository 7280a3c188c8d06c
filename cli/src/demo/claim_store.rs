//! The claims the kubelet plugin reads, served from memory instead of an API server.

pub use kerf_kubelet_plugin::claim_reader::MemoryClaimReader;
