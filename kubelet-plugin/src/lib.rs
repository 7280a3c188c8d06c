//! kerf-kubelet-plugin: the node side of kerf.
//!
//! It registers with the kubelet, publishes the node's GPUs as ResourceSlices, and implements
//! the kubelet's `NodePrepareResources` / `NodeUnprepareResources` calls by writing one CDI spec
//! per claim and recording it in a checkpoint that outlives the plugin.
//!
//! [`preparer::Preparer`] answers those calls, reading each claim through a
//! [`claim_reader::ClaimReader`]. The binary's `main` calls [`launch`] (the MPS daemon
//! subcommand, flags, logging, the init) and then [`run`], which builds the
//! [`config::PluginConfig`] and the [`plugin::Connections`] from [`args::Args`] and starts the
//! plugin with [`plugin::start`]; tests' `kerf-test-plugin` is the same two calls.

pub mod args;
pub mod checkpoint_store;
pub mod claim_events;
mod claim_locks;
pub mod claim_reader;
pub mod config;
pub mod crash;
pub mod discovery;
mod dynamic_mig;
mod entry;
mod error;
pub mod gpu_sharing;
pub mod grpc;
pub mod health;
mod http;
pub mod identity;
pub mod instances;
pub mod metrics;
pub mod metrics_reference;
mod mps_checks;
mod mps_control_daemon;
pub mod mps_daemons;
pub mod plugin;
mod prepare_error;
pub mod preparer;
pub mod publish;
pub mod reaper;
mod spec_writer;
pub mod write_failures;

pub use entry::{LaunchError, Launched, launch, run};
pub use error::{Error, Result};
pub use prepare_error::PrepareError;
