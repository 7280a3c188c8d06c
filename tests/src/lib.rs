//! kerf-tests: shared helpers for cross-crate tests: a fake kubelet, an in-memory API server,
//! snapshots of its store for the kube-scheduler stand-in ([`scheduler_snapshots`]), claims
//! as users write them ([`fixtures`]) and a whole-cluster simulation ([`sim`]).

pub mod api_server;
pub mod fake_api;
pub mod fake_kubelet;
pub mod fixtures;
pub mod logs;
pub mod manifests;
pub mod metrics_reference;
pub mod module_graph;
pub mod pod_runner;
pub mod podman;
pub mod scheduler_snapshots;
pub mod sim;
pub mod wait;
