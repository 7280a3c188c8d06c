//! The watch caches the webhook reads. They serve on every replica, leader or not (the Service
//! sends admission requests to any of them): the claims and DeviceClasses are the process's
//! ([`ProcessCaches`], which a leadership term's [`crate::cache::Caches`] borrows), the
//! ResourceClaimTemplates, which only the webhook reads, are its own.

use std::future::Future;

use futures::StreamExt as _;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceClaimTemplate};
use kerf_api::controller_claims::class_parameters;
use kerf_api::params::GpuClassParameters;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Client};

use super::decide::ClaimLookup;
use crate::cache::{ProcessCaches, cache, strip};
use crate::error::{Error, Result};

/// Read handles of the webhook's caches: every ResourceClaim, ResourceClaimTemplate and
/// DeviceClass. Clones share the stores.
#[derive(Clone)]
pub struct WebhookCaches {
    process: ProcessCaches,
    claims: Store<ResourceClaim>,
    templates: Store<ResourceClaimTemplate>,
    classes: Store<DeviceClass>,
    driver: String,
}

impl std::fmt::Debug for WebhookCaches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookCaches")
            .field("claims", &self.claims.len())
            .field("templates", &self.templates.len())
            .field("classes", &self.classes.len())
            .finish_non_exhaustive()
    }
}

impl WebhookCaches {
    /// Creates the caches for `driver` on the claims and DeviceClasses of `process` (filled by
    /// its own future), and the future that fills the templates' cache (it runs until
    /// dropped; watch errors are retried with back-off).
    pub fn start(
        process: &ProcessCaches,
        client: &Client,
        driver: &str,
    ) -> (Self, impl Future<Output = ()> + Send + use<>) {
        let (templates, changes) = cache(
            Api::all(client.clone()),
            watcher::Config::default(),
            "ResourceClaimTemplate",
            strip::managed_fields,
        );
        let fill = changes.for_each(|_| std::future::ready(()));
        let caches = Self {
            process: process.clone(),
            claims: process.claims.clone(),
            templates,
            classes: process.device_classes.clone(),
            driver: driver.to_owned(),
        };
        (caches, fill)
    }

    /// Waits until every cache holds its first complete list.
    ///
    /// # Errors
    ///
    /// [`Error::ControllerStopped`] when a future filling the caches was dropped first.
    pub async fn wait_ready(&self) -> Result<()> {
        let stopped = |_| Error::ControllerStopped {
            name: "webhook caches",
            message: "the caches stopped before their first list completed".to_owned(),
        };
        // The templates' store has no other waiter; the process's stores queue their waiters.
        self.templates.wait_until_ready().await.map_err(stopped)?;
        self.process.wait_ready().await
    }
}

impl ClaimLookup for WebhookCaches {
    fn claim(&self, namespace: &str, name: &str) -> Option<ResourceClaim> {
        self.claims
            .get(&ObjectRef::new(name).within(namespace))
            .map(|c| (*c).clone())
    }

    fn template(&self, namespace: &str, name: &str) -> Option<ResourceClaimTemplate> {
        self.templates
            .get(&ObjectRef::new(name).within(namespace))
            .map(|t| (*t).clone())
    }

    fn class_parameters(&self, name: &str) -> Option<GpuClassParameters> {
        let class = self.classes.get(&ObjectRef::new(name))?;
        class_parameters(&class, &self.driver)
    }
}
