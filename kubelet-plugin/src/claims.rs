//! Where the plugin reads ResourceClaims from.

use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;

/// Reads one ResourceClaim. The kubelet sends only namespace, name and UID; the allocation
/// comes from the API server.
pub trait ClaimSource: Send + Sync + 'static {
    /// GETs the claim `namespace/name`.
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>>;
}

/// Reads claims straight from the API server, one GET per claim and no client-side rate
/// limit, so prepares never queue behind each other.
#[derive(Clone)]
pub struct KubeClaims {
    client: kube::Client,
}

impl KubeClaims {
    /// Reads through `client`.
    pub fn new(client: kube::Client) -> Self {
        KubeClaims { client }
    }
}

impl ClaimSource for KubeClaims {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>> {
        Box::pin(async move {
            Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
                .get(name)
                .await
        })
    }
}
