//! The claim reader: where the plugin reads the ResourceClaims the kubelet names.

use std::collections::BTreeMap;
use std::sync::{PoisonError, RwLock};

use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::core::Status;

/// Reads one ResourceClaim. The kubelet sends only namespace, name and UID; the allocation
/// comes from the API server.
pub trait ClaimReader: Send + Sync + 'static {
    /// GETs the claim `namespace/name`.
    ///
    /// # Errors
    /// The API server's answer; a claim that does not exist must be [`kube::Error::Api`] with
    /// code 404, which the preparer reports as the claim not being found rather than as an
    /// API failure.
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>>;
}

/// Reads claims straight from the API server, one GET per claim and no client-side rate
/// limit, so prepares never queue behind each other.
#[derive(Clone)]
pub struct ApiClaimReader {
    client: kube::Client,
}

impl ApiClaimReader {
    /// Reads through `client`.
    pub fn new(client: kube::Client) -> Self {
        ApiClaimReader { client }
    }
}

impl ClaimReader for ApiClaimReader {
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

/// ResourceClaims held in memory, by `(namespace, name)`, for running the plugin without an
/// API server (the demo, the benchmarks); a missing claim answers 404 as the API server does.
#[derive(Debug, Default)]
pub struct MemoryClaimReader {
    claims: RwLock<BTreeMap<(String, String), ResourceClaim>>,
}

impl MemoryClaimReader {
    /// Stores (or replaces) a claim under its namespace and name.
    pub fn insert(&self, claim: ResourceClaim) {
        let key = (
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default(),
        );
        self.claims
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, claim);
    }

    /// Number of claims held.
    pub fn len(&self) -> usize {
        self.claims
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// True when no claim is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl ClaimReader for MemoryClaimReader {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>> {
        let found = self
            .claims
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned();
        Box::pin(async move {
            found.ok_or_else(|| {
                let message = format!("resourceclaims.resource.k8s.io {name:?} not found");
                kube::Error::Api(Status::failure(&message, "NotFound").with_code(404).boxed())
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    #[tokio::test]
    async fn serves_stored_claims_and_404_otherwise() {
        let store = MemoryClaimReader::default();
        store.insert(ResourceClaim {
            metadata: ObjectMeta {
                namespace: Some("ns".into()),
                name: Some("c".into()),
                ..ObjectMeta::default()
            },
            ..ResourceClaim::default()
        });
        assert_eq!(store.len(), 1);
        assert!(store.get("ns", "c").await.is_ok());
        match store.get("ns", "x").await {
            Err(kube::Error::Api(status)) => assert_eq!(status.code, 404),
            other => panic!("unexpected {other:?}"),
        }
    }
}
