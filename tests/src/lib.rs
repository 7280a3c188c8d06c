//! kerf-tests: shared helpers for cross-crate tests (a fake kubelet).

pub mod kubelet;
