//! What every reconciler gets ([`Context`]): the client, configuration values, metrics, the
//! event recorder, the caches, diagnostics, the per-object back-off ([`crate::retry`]) and the
//! claim controller's part ([`ClaimsPart`]).

mod events;
mod write_failures;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kube::Client;
use kube::runtime::events::Reporter;
use tokio::sync::RwLock;

use crate::cache::Caches;
use crate::claims::ClaimsPart;
use crate::features::ApiSupport;
use crate::metrics::Metrics;
use crate::retry::{BackoffConfig, ObjectBackoff};

pub(crate) use crate::error::Write;
pub(crate) use events::EventRecorder;

/// Field manager of every write of the controller: server-side apply, merge patches, creates
/// and Events. The default of [`ControllerConfig::field_manager`], through which it is passed.
pub const FIELD_MANAGER: &str = "kerf-controller";

/// Configuration the reconcilers read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerConfig {
    /// DRA driver name, e.g. `gpu.kerf.dev`.
    pub driver_name: String,
    /// Field manager of every write (see [`FIELD_MANAGER`]), reporting controller of Events,
    /// and `app.kubernetes.io/managed-by` of DeviceClasses.
    pub field_manager: String,
    /// How often every object is reconciled even without a change.
    pub resync_period: Duration,
    /// Shortest time between two refreshes of every GpuClass status after cache changes: the
    /// free capacity a status shows may lag this much behind the claims.
    pub class_status_interval: Duration,
    /// Retry delays after a failed reconcile.
    pub backoff: BackoffConfig,
    /// Identity of this replica in Events (`reportingInstance`), usually the pod name.
    pub instance: Option<String>,
    /// Timing of the ResourceClaim allocation controller.
    pub claims: crate::claims::ClaimSettings,
    /// Timing of the GpuQuota recount.
    pub quota: crate::quota::QuotaSettings,
    /// The node label whose value names a node's pool in the fragmentation metrics
    /// (`kerf_api::node_pool`).
    pub node_pool_label: String,
}

impl ControllerConfig {
    /// The defaults of the command-line flags for `driver_name`.
    pub fn new(driver_name: impl Into<String>) -> Self {
        Self {
            driver_name: driver_name.into(),
            field_manager: FIELD_MANAGER.to_owned(),
            resync_period: Duration::from_secs(600),
            class_status_interval: Duration::from_secs(1),
            backoff: BackoffConfig::default(),
            instance: None,
            claims: crate::claims::ClaimSettings::default(),
            quota: crate::quota::QuotaSettings::default(),
            node_pool_label: kerf_api::node_pool::DEFAULT_NODE_POOL_LABEL.to_owned(),
        }
    }
}

/// What the controller last did, for logs and debugging.
#[derive(Debug, Clone, Default)]
pub struct Diagnostics {
    /// When the last reconcile finished.
    pub last_reconcile: Option<SystemTime>,
    /// The object it reconciled (`controller/namespace/name`).
    pub last_object: Option<String>,
}

/// Everything a reconciler needs. One per leadership term, shared by all controllers: the
/// GpuClass reconciler, the claim reconciler and its ownership pass, and the claims' node
/// label reconciler.
pub struct Context {
    /// Kubernetes client.
    pub client: Client,
    /// Configuration values.
    pub config: ControllerConfig,
    /// Metric handles.
    pub metrics: Metrics,
    /// Publishes Events about the objects the controllers reconcile.
    pub recorder: EventRecorder,
    /// Watch-fed caches of slices, claims and DeviceClasses.
    pub caches: Caches,
    /// What happened last.
    pub diagnostics: Arc<RwLock<Diagnostics>>,
    /// Per-object failure counts.
    pub backoff: ObjectBackoff,
    /// What the API server serves of the optional fields the controller writes, as probed
    /// when the term started.
    pub api_support: ApiSupport,
    /// What only the claim controller reads: the pod and node stores, its bookkeeping, its
    /// queue of claims to reconcile again.
    pub claims: ClaimsPart,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("config", &self.config)
            .field("caches", &self.caches)
            .field("api_support", &self.api_support)
            .field("claims", &self.claims)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// A context whose Events are reported as `config.field_manager` / `config.instance`, and
    /// which assumes every optional API field is served ([`ApiSupport::all_served`]) until
    /// [`Context::with_api_support`] says otherwise.
    pub fn new(client: Client, config: ControllerConfig, metrics: Metrics, caches: Caches) -> Self {
        let recorder = EventRecorder::new(
            client.clone(),
            Reporter {
                controller: config.field_manager.clone(),
                instance: config.instance.clone(),
            },
            config.field_manager.clone(),
        );
        Self {
            client,
            config,
            metrics,
            recorder,
            caches,
            diagnostics: Arc::default(),
            backoff: ObjectBackoff::default(),
            api_support: ApiSupport::all_served(),
            claims: ClaimsPart::new(),
        }
    }

    /// The context with what the API server was found to serve ([`crate::features::probe`]).
    #[must_use]
    pub fn with_api_support(mut self, api_support: ApiSupport) -> Self {
        self.api_support = api_support;
        self
    }

    /// Records that `object` was just reconciled.
    pub async fn note_reconcile(&self, object: String) {
        let mut diagnostics = self.diagnostics.write().await;
        diagnostics.last_reconcile = Some(SystemTime::now());
        diagnostics.last_object = Some(object);
    }
}
