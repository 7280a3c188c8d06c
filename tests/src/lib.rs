//! kerf-tests: shared helpers for cross-crate tests: a fake kubelet, an in-memory API server,
//! a kube-scheduler stand-in, a whole-cluster simulation ([`sim`]) and fake GPU tools
//! ([`fake_gpu_tools`]).

pub mod api_server;
pub mod fake_api;
pub mod fake_kubelet;
pub mod kubelet;
pub mod logs;
pub mod manifests;
pub mod metrics_reference;
pub mod module_graph;
pub mod pod_runner;
pub mod podman;
pub mod scheduler;
pub mod sim;
pub mod wait;

/// The fake GPU tools, which live in their own crate (kerf-fake-gpu-tools) so that the image
/// and the CLI can ship them; re-exported under their old path for the tests.
pub use kerf_fake_gpu_tools as fake_gpu_tools;
