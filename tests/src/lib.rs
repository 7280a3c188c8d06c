//! kerf-tests: shared helpers for cross-crate tests: a fake kubelet, an in-memory API server,
//! a kube-scheduler stand-in, a whole-cluster simulation ([`sim`]) and fake GPU tools
//! ([`fake_gpu_tools`]).

pub mod api_server;
pub mod fake_api;
pub mod fake_gpu_tools;
pub mod fake_kubelet;
pub mod kubelet;
pub mod podman;
pub mod scheduler;
pub mod sim;
