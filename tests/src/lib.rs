//! kerf-tests: shared helpers for cross-crate tests: a fake kubelet, an in-memory API server,
//! a kube-scheduler stand-in and a whole-cluster simulation ([`sim`]).

pub mod api_server;
pub mod fake_api;
pub mod fake_kubelet;
pub mod kubelet;
pub mod podman;
pub mod scheduler;
pub mod sim;
