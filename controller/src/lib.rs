//! kerf-controller: kerf's control-plane controller.
//!
//! - [`gpuclass`]: reconciles each GpuClass into an owned DeviceClass ([`deviceclass`], with
//!   the CEL of [`selector`] and the extended resource name of [`extended_resource`]) and
//!   reports what it matches ([`capacity`]); [`features`]: what the API server serves of the
//!   optional fields, probed once per leadership term.
//! - [`run()`]: the program of the binary (`entry.rs`), from its flags ([`args`]) to a
//!   [`Process`]; [`Process::run`]: the process — metrics and readiness HTTP (`http.rs`),
//!   leader election (`leader.rs`), the webhook, and the controllers that run while this
//!   replica leads ([`controllers`]).
//! - `scheduler_slices.rs`: which GPUs are published as shareable for sliced Scheduler classes
//!   (scheduler slices), written by the ownership tick of [`claims`] and reported by [`gpuclass`].
//! - [`default_classes`]: the default GpuClasses the leader creates (create only).
//! - [`claims`]: KEP-3063 allocation of GPU slices for ResourceClaims of controller classes.
//! - [`webhook`]: the mutating admission webhook that gates pods with controller claims.
//! - [`quota`]: GPU quota per namespace (GpuQuota): the recount of `status.used` from the
//!   claims ([`quota::recount`]) and the size of each class's largest device.
//! - `context.rs`: the shared core of every controller's context ([`Context`]; the claim
//!   controller's [`claims::ClaimsContext`] and the GpuClass controller's
//!   [`gpuclass::ClassContext`] wrap it); [`config`]: the configuration values; [`backoff`] and
//!   [`retry`]: per-object back-off and the one wrapper around every reconcile; [`cache`]: the
//!   watch-fed caches; `metrics.rs`: Prometheus metrics ([`Metrics`]); [`args`]: the
//!   command-line flags.

pub mod args;
pub mod backoff;
pub mod cache;
pub mod capacity;
pub mod claims;
mod condition;
pub mod config;
mod context;
pub mod default_classes;
pub mod deviceclass;
mod entry;
mod error;
pub mod extended_resource;
pub mod features;
pub mod gpuclass;
mod http;
mod leader;
mod metrics;
pub mod quota;
pub mod retry;
mod run;
mod scheduler_slices;
pub mod selector;
pub mod webhook;

pub use backoff::BackoffConfig;
pub use config::{ControllerConfig, FIELD_MANAGER};
pub use context::Context;
pub use entry::run;
pub use error::{Error, Result};
pub use leader::{LeaderElector, LeaseConfig};
pub use metrics::{Metrics, reference_registry as metrics_reference_registry};
pub use run::{Config, ControllerTask, Process, controllers};
pub use scheduler_slices::node_shares;
