//! A prepare's read of its claim: from the cache when it can stand in for a GET
//! ([`Cached::usable`]), and otherwise from the API server raced against the watch.
//!
//! On a miss, two things start at once and the first to answer wins:
//! - the cache waits for its watch to deliver a copy that is usable for the claim (the node
//!   label kerf-controller writes after kube-scheduler's allocation, or the allocation itself,
//!   is often on its way when the kubelet calls);
//! - the API read: first a GET with `resourceVersion=0` when the reader allows it
//!   ([`ClaimReader::may_read_any`]), which kube-apiserver serves from its watch cache without
//!   a round to etcd (kubernetes/kubernetes `staging/src/k8s.io/apiserver/pkg/storage/cacher/
//!   delegator.go`, `CacheDelegator.Get`: an empty resourceVersion is read "from underlying
//!   storage", any other from the cache, "at least that fresh as the given resourceVersion",
//!   which for `0` is no bound at all). Its answer is taken only when it passes the same test
//!   as a cached copy ([`Cached::usable`]: the kubelet's UID, not being deleted, allocated on
//!   this node); any other answer (stale without the allocation, an older claim of the same
//!   name, a 404 the watch cache has not caught up with, an error) sends the read on to a
//!   quorum GET, whose answer is the API server's word.
//!
//! The API read runs as a task of its own, so that a watch that wins does not cancel it: kube's
//! client speaks HTTP/1.1, where a request dropped half-way closes its connection, and the next
//! read would pay for a new one (TCP and TLS).

use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;

use super::{Cached, ClaimReader, Fallback};

/// The claim a prepare reads: as the kubelet names it, and what makes a copy of it usable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    /// Namespace of the ResourceClaim.
    pub namespace: String,
    /// Name of the ResourceClaim.
    pub name: String,
    /// The UID the kubelet sent.
    pub uid: String,
    /// The DRA driver name whose results the allocation must hold.
    pub driver: String,
    /// This node: the pool of those results.
    pub node: String,
}

impl Wanted {
    /// `claim` as a usable copy, or why it is not one (see [`Cached::usable`]).
    ///
    /// # Errors
    /// The [`Fallback`] that says why `claim` cannot stand in for a quorum GET.
    pub fn usable(&self, claim: Cached) -> Result<Arc<ResourceClaim>, Fallback> {
        claim.usable(&self.uid, &self.driver, &self.node)
    }
}

/// Where a prepare's claim came from; [`Lookup::source`] and [`Lookup::reason`] are the labels
/// of `kerf_plugin_claim_lookups_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// The cache held a usable copy when the prepare asked.
    Cache,
    /// The cache had none, and its watch delivered one before the API read answered.
    Watch(Fallback),
    /// A GET with `resourceVersion=0` (kube-apiserver's watch cache) answered with a usable
    /// copy.
    ApiAny(Fallback),
    /// A quorum GET answered.
    Api(Fallback),
}

impl Lookup {
    /// The metric's `source` label: `cache`, `watch`, `api_any` or `api`.
    pub fn source(self) -> &'static str {
        match self {
            Lookup::Cache => "cache",
            Lookup::Watch(_) => "watch",
            Lookup::ApiAny(_) => "api_any",
            Lookup::Api(_) => "api",
        }
    }

    /// The metric's `reason` label: why the cache could not answer at once (empty for
    /// [`Lookup::Cache`]).
    pub fn reason(self) -> &'static str {
        match self {
            Lookup::Cache => "",
            Lookup::Watch(fallback) | Lookup::ApiAny(fallback) | Lookup::Api(fallback) => {
                fallback.reason()
            }
        }
    }
}

/// Why a read found no claim to prepare.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The quorum GET failed; a claim that does not exist is [`kube::Error::Api`] with code
    /// 404.
    #[error("{error}")]
    Api {
        /// The client's error.
        #[source]
        error: kube::Error,
        /// Why the cache could not answer.
        fallback: Fallback,
    },
    /// The task of the API read ended without an answer (it panicked, or the runtime is
    /// shutting down).
    #[error("the claim read task ended without an answer: {error}")]
    Task {
        /// How the task ended.
        #[source]
        error: tokio::task::JoinError,
        /// Why the cache could not answer.
        fallback: Fallback,
    },
}

impl ReadError {
    /// The read that failed, for the lookup metric: always the API server's.
    pub fn lookup(&self) -> Lookup {
        match self {
            ReadError::Api { fallback, .. } | ReadError::Task { fallback, .. } => {
                Lookup::Api(*fallback)
            }
        }
    }
}

/// Reads the claim `wanted` names through `reader` (see the module docs): the cached copy when
/// it is usable, else whichever answers first of the cache's watch and the API read.
///
/// The claim returned from the cache, the watch or a `resourceVersion=0` GET has the kubelet's
/// UID and is allocated on this node; one from the quorum GET is the API server's answer,
/// which the caller checks.
///
/// # Errors
/// The quorum GET failed, or its task ended without an answer.
pub async fn read(
    reader: &Arc<dyn ClaimReader>,
    wanted: &Wanted,
) -> Result<(Arc<ResourceClaim>, Lookup), ReadError> {
    let fallback = match wanted.usable(reader.cached(&wanted.namespace, &wanted.name)) {
        Ok(claim) => return Ok((claim, Lookup::Cache)),
        Err(fallback) => fallback,
    };
    let api = tokio::spawn(read_api(Arc::clone(reader), wanted.clone(), fallback));
    tokio::select! {
        biased;
        claim = reader.until_cached(wanted) => Ok((claim, Lookup::Watch(fallback))),
        joined = api => joined
            .map_err(|error| ReadError::Task { error, fallback })?
            .map_err(|error| ReadError::Api { error, fallback }),
    }
}

/// The API read: a `resourceVersion=0` GET whose answer is usable, else a quorum GET.
async fn read_api(
    reader: Arc<dyn ClaimReader>,
    wanted: Wanted,
    fallback: Fallback,
) -> Result<(Arc<ResourceClaim>, Lookup), kube::Error> {
    if reader.may_read_any(&wanted.uid) {
        match reader.get_any(&wanted.namespace, &wanted.name).await {
            Ok(claim) => match wanted.usable(Cached::Found(Arc::new(claim))) {
                Ok(claim) => return Ok((claim, Lookup::ApiAny(fallback))),
                Err(stale) => {
                    tracing::debug!(claim.uid = %wanted.uid, reason = stale.reason(), "the resourceVersion=0 read cannot stand in for a quorum GET");
                }
            },
            Err(error) => {
                tracing::debug!(claim.uid = %wanted.uid, %error, "the resourceVersion=0 read failed; reading with a quorum GET");
            }
        }
    }
    let claim = reader.get(&wanted.namespace, &wanted.name).await?;
    Ok((Arc::new(claim), Lookup::Api(fallback)))
}

#[cfg(test)]
#[path = "miss/tests.rs"]
mod tests;
