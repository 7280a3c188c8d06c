//! The shared core of every controller's context ([`Context`]): the client, configuration
//! values, metrics, the event recorder, the caches, diagnostics and the per-object back-off
//! ([`crate::backoff`]). A controller with state of its own wraps it (the claim controller's
//! `crate::claims::ClaimsContext`, the GpuClass controller's `crate::gpuclass::ClassContext`);
//! the quota recount has none and uses it as it is.

mod events;
mod write_failures;

use std::sync::Arc;
use std::time::SystemTime;

use kube::Client;
use kube::runtime::events::Reporter;
use tokio::sync::RwLock;

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kerf_api::GpuClassParameters;
use kerf_api::controller_claims::class_parameters;
use kube::runtime::reflector::ObjectRef;

use crate::backoff::ObjectBackoff;
use crate::cache::Caches;
use crate::config::ControllerConfig;
use crate::features::ApiSupport;
use crate::metrics::Metrics;

pub(crate) use crate::error::Write;
pub(crate) use events::EventRecorder;

/// What the controller last did, for logs and debugging.
#[derive(Debug, Clone, Default)]
pub struct Diagnostics {
    /// When the last reconcile finished.
    pub last_reconcile: Option<SystemTime>,
    /// The object it reconciled (`controller/namespace/name`).
    pub last_object: Option<String>,
}

/// What every reconciler needs. One per leadership term, shared by all controllers: the
/// GpuClass reconciler, the quota recount, the claim reconciler and its ownership pass, and the
/// claims' node label reconciler.
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
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("config", &self.config)
            .field("caches", &self.caches)
            .field("api_support", &self.api_support)
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

    /// The driver name.
    pub fn driver(&self) -> &str {
        &self.config.driver_name
    }

    /// The kerf class parameters of DeviceClass `name`, when it carries them.
    pub fn class_params(&self, name: &str) -> Option<GpuClassParameters> {
        let class = self
            .caches
            .device_classes
            .get(&ObjectRef::<DeviceClass>::new(name))?;
        class_parameters(&class, self.driver())
    }

    /// True when a request of the claim uses a controller class of this driver.
    pub fn is_controller_claim(&self, claim: &ResourceClaim) -> bool {
        kerf_api::controller_claims::is_controller_claim(claim, |class| self.class_params(class))
    }

    /// The cached claim `name` in `namespace`.
    pub fn claim(&self, namespace: &str, name: &str) -> Option<Arc<ResourceClaim>> {
        self.caches
            .claims
            .get(&ObjectRef::<ResourceClaim>::new(name).within(namespace))
    }
}

impl AsRef<Context> for Context {
    fn as_ref(&self) -> &Context {
        self
    }
}
