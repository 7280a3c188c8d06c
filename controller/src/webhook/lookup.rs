//! The webhook's own watch caches. They run on every replica, leader or not (the Service sends
//! admission requests to any of them), unlike [`crate::cache::Caches`], which lives only for a
//! leadership term.

use std::future::Future;

use futures::{StreamExt as _, stream};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceClaimTemplate};
use kerf_api::controller_claims::class_parameters;
use kerf_api::params::GpuClassParameters;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Client};

use super::decide::ClaimLookup;
use crate::cache::cache;
use crate::error::{Error, Result};

/// Read handles of the webhook's caches: every ResourceClaim, ResourceClaimTemplate and
/// DeviceClass. Clones share the stores.
#[derive(Clone)]
pub struct WebhookCaches {
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
    /// Creates the caches for `driver` and the future that fills them (it runs until dropped;
    /// watch errors are retried with back-off).
    pub fn start(
        client: &Client,
        driver: &str,
    ) -> (Self, impl Future<Output = ()> + Send + 'static) {
        let all = watcher::Config::default;
        let (claims, a) = cache(Api::all(client.clone()), all(), "ResourceClaim");
        let (templates, b) = cache(Api::all(client.clone()), all(), "ResourceClaimTemplate");
        let (classes, c) = cache(Api::all(client.clone()), all(), "DeviceClass");
        let fill = stream::select(stream::select(a, b), c).for_each(|()| std::future::ready(()));
        (
            Self {
                claims,
                templates,
                classes,
                driver: driver.to_owned(),
            },
            fill,
        )
    }

    /// Waits until every cache holds its first complete list.
    ///
    /// # Errors
    ///
    /// [`Error::ControllerStopped`] when the future filling the caches was dropped first.
    pub async fn wait_ready(&self) -> Result<()> {
        let stopped = |_| Error::ControllerStopped {
            name: "webhook caches",
            message: "the caches stopped before their first list completed".to_owned(),
        };
        self.claims.wait_until_ready().await.map_err(stopped)?;
        self.templates.wait_until_ready().await.map_err(stopped)?;
        self.classes.wait_until_ready().await.map_err(stopped)
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
