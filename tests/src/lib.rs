//! kerf-tests: shared helpers for cross-crate tests (a fake kubelet).

pub mod fake_api;
pub mod kubelet;
