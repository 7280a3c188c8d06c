//! kerf's cross-crate tests without a cluster, in one binary (one link instead of sixty): the
//! controllers against the in-memory API server (`kerf_tests::FakeApi`), the kubelet plugin
//! against the fake kubelet, the CDI specs run by podman and runc, the Python grpcio client,
//! the webhooks as kube-apiserver calls them, and the simulations. One module per area; run
//! one with a filter, e.g. `cargo test -p kerf-tests --test integration stress:: -- --nocapture`.
//! Tests that need a tool (podman, runc, grpcio) fail under `CI=true` when it is missing.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a failed unwrap is a failed test"
)]

mod common;
mod plugin_node;

mod cache_object_sizes;
mod cdi_runtime;
mod cdi_runtime_mps;
mod claim_cache;
mod claim_cache_miss;
mod claim_env;
mod claim_node_labels;
mod claim_webhook_match;
mod claims;
mod claims_logs;
mod controller_scheduler_slices;
mod controller_write_failures;
mod crash_restore;
mod default_classes;
mod device_status;
mod docs;
mod dynamic_mig_crash;
mod dynamic_mig_ownership;
mod extended_demand;
mod fake_api_gpuquota;
mod fake_api_webhooks;
mod fake_api_webhooks_failures;
mod features;
mod field_managers;
mod gpu_mps_enforcement;
mod gpu_mps_pods;
mod gpu_sharing;
mod gpuclass;
mod grpcio_client;
mod health;
mod helm_values_doc;
mod idle_gpus_taint;
mod kubelet_contract;
mod leader;
mod metrics_reference;
mod module_circles;
mod mps_control_daemon;
mod mps_daemon_pod_policy;
mod mps_daemon_pods;
mod mps_daemons;
mod mps_reaping;
mod mps_server_limits;
mod node_filters;
mod one_watch_per_kind;
mod outage;
mod outage_burst;
mod ownership_passes;
mod permissions;
mod permissions_doc;
mod plugin;
mod pod_runner;
mod prometheus_scrape;
mod publish;
mod quota_admission;
mod quota_recount;
mod rolling_update;
mod scheduler_slices;
mod scheduler_standin;
mod scheduler_standin_filter;
mod sim_requests;
mod spaced_parameters;
mod stress;
mod usage_metrics;
mod webhook;
mod webhook_claims;
mod write_failures;
