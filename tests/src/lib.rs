//! kerf-tests: shared helpers for cross-crate tests (a fake kubelet).

pub mod api_server;
pub mod fake_api;
pub mod fake_kubelet;
pub mod kubelet;
pub mod podman;
pub mod scheduler;
