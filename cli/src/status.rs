//! `kerf status`: every kerf GPU of the cluster, per node, from kerf's ResourceSlices and the
//! ResourceClaims allocated on them, the GpuQuotas of every namespace with what their
//! claims hold ([`quotas`]), and the GPU fragmentation of each node pool ([`pools`]) — what an
//! admin would otherwise script with kubectl and jq.
//!
//! [`fetch`] lists these kinds and the Nodes (metadata only: their pool label) once;
//! [`files::read`] reads them from saved YAML instead; [`watch`] keeps them with watches and
//! hands each changed [`Status`] to a callback. Neither needs a kubeconfig: they take a
//! `kube::Client`, which the tests get from the fake API server. Where Nodes may not be listed,
//! everything but the pools is shown, and `poolsProblem` says why.
//!
//! The pools' fragmentation is the GPU part of kerf's LeastFragmentation measure (FGD's): the
//! free GPU capacity the pods like the allocated claims could not use. `kerf status` knows no
//! pod's CPU and memory, so GPUs stranded by them are left to kerf-controller's metrics.
//! Without any allocated claim there is no workload to measure against: `fragmentedGpus` and
//! `ratio` are null (`-` in the table), not 0.
//!
//! # The JSON document (`kerf status -o json`)
//!
//! Stable for scripts: [`model::JSON_VERSION`] is raised when a field changes meaning or goes away;
//! new fields may appear. Quantities are plain numbers (bytes, percent).
//!
//! ```text
//! {
//!   "version": 1,
//!   "driver": "gpu.kerf.dev",
//!   "nodes": [{
//!     "node": "node-1",
//!     "pool": {"name": "node-1", "generation": 3, "slices": 1, "expectedSlices": 1},
//!     "gpus": [{
//!       "device": "gpu-0", "uuid": "GPU-…", "product": "NVIDIA H100 80GB HBM3",
//!       "owner": "controller",                      // or "scheduler", or null
//!       "memory": {"totalBytes": …, "usedBytes": …, "freeBytes": …},
//!       "compute": {"usedPercent": 50, "freePercent": 50},
//!       "health": {"healthy": false,
//!                  "taints": [{"key": "gpu.kerf.dev/unhealthy", "value": "xid-79",
//!                              "effect": "NoExecute"}]},
//!       "claims": [{
//!         "namespace": "default", "name": "train-0", "pods": ["train-0"],
//!         "size": {"kind": "slice", "memoryBytes": 21474836480, "computePercent": 25,
//!                  "sharing": "MPS"},             // or {"kind": "whole"}
//!         "allocator": "kerf-controller"           // or "kube-scheduler"
//!       }]
//!     }],
//!     "migDevices": [{
//!       "device": "gpu-0-mig-1g-5gb-6", "uuid": "MIG-…", "profile": "1g.5gb",
//!       "parentUuid": "GPU-…", "product": "NVIDIA A100-SXM4-40GB", "owner": "scheduler",
//!       "memory": {…}, "health": {…}, "claims": [{…}]
//!     }],
//!     "unreadable": [{"device": "gpu-7", "reason": "attributes[\"uuid\"]: missing"}]
//!   }],
//!   "unmatchedClaims": [{"node": "node-9", "device": "gpu-0", "claim": {…}}],
//!   "quotas": [{
//!     "namespace": "team-a", "name": "team-a",
//!     "ready": true,                               // false: not enforced; null: not counted yet
//!     "problem": null,                             // why not, when ready is false
//!     "total": {"used": {"memoryBytes": 21474836480, "compute": 50, "gpus": 0},
//!               "hard": {"memoryBytes": 42949672960, "compute": 100, "gpus": 2}},
//!     "classes": [{"class": "h100-slice", "used": {…}, "hard": {"memoryBytes": …,
//!                  "compute": null, "gpus": null}}],   // null: not capped
//!     "pendingAdmissions": 0
//!   }],
//!   "poolLabel": "node.kubernetes.io/instance-type",  // --node-pool-label
//!   "pools": [{
//!     "pool": "p4d.24xlarge",                      // "unlabeled": nodes without the label
//!     "nodes": 2,                                  // nodes with kerf GPUs
//!     "freeGpus": 9.5,                             // free shares of GPUs, summed
//!     "fragmentedGpus": 1.5,                       // null: no allocated claim to learn from
//!     "ratio": 0.158                               // fragmentedGpus / freeGpus; null as above
//!   }],                                            // null when Nodes cannot be listed
//!   "poolsProblem": null                           // why pools is null
//! }
//! ```

pub mod files;
pub mod model;
pub mod pools;
pub mod quotas;
mod render;

use std::future::Future;
use std::pin::pin;

use futures::{Stream, StreamExt as _, stream};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kerf_api::gpuquota::GpuQuota;
use kerf_api::watch_backoff::WatchBackoff;
use kube::api::{Api, ListParams, PartialObjectMeta};
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt as _, watcher};

use crate::error::{Error, Result};
pub use model::{Snapshot, Status};
pub use render::table;

/// The ResourceSlice field selector for `driver`'s slices.
fn driver_selector(driver: &str) -> String {
    format!("spec.driver={driver}")
}

/// Lists `driver`'s ResourceSlices, every ResourceClaim, every GpuQuota (none where the
/// GpuQuota CRD is not installed) and the Nodes' metadata once (where Nodes may not be listed,
/// none and [`Snapshot::nodes_problem`] says why).
///
/// # Errors
/// [`Error::Kube`] when a list fails (unreachable server, missing RBAC for listing
/// ResourceSlices, or ResourceClaims or GpuQuotas in all namespaces).
pub async fn fetch(client: &kube::Client, driver: &str) -> Result<Snapshot> {
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default().fields(&driver_selector(driver)))
        .await
        .map_err(|source| Error::Kube {
            action: "listing ResourceSlices",
            source,
        })?;
    let claims = Api::<ResourceClaim>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|source| Error::Kube {
            action: "listing ResourceClaims in all namespaces",
            source,
        })?;
    let quotas = match Api::<GpuQuota>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(list) => list.items,
        // A cluster whose kerf predates GpuQuota has no quotas to show.
        Err(error) if is_not_found(&error) => Vec::new(),
        Err(source) => {
            return Err(Error::Kube {
                action: "listing GpuQuotas in all namespaces",
                source,
            });
        }
    };
    let (nodes, nodes_problem) = match Api::<Node>::all(client.clone())
        .list_metadata(&ListParams::default())
        .await
    {
        Ok(list) => (list.items.into_iter().map(node_of).collect(), None),
        Err(error) => (Vec::new(), Some(nodes_problem(&error))),
    };
    Ok(Snapshot {
        slices: slices.items,
        claims: claims.items,
        quotas,
        nodes,
        nodes_problem,
    })
}

/// A Node of which only the metadata is known.
fn node_of(meta: PartialObjectMeta<Node>) -> Node {
    Node {
        metadata: meta.metadata,
        ..Node::default()
    }
}

/// Why the pools are not shown, in one line: the pools are a part of the status that a user
/// without access to Nodes goes without.
fn nodes_problem(error: &kube::Error) -> String {
    if matches!(error, kube::Error::Api(status) if status.is_forbidden()) {
        "not allowed to list Nodes (node pools need list and watch on nodes)".to_owned()
    } else {
        format!("listing Nodes failed: {error}")
    }
}

fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.is_not_found())
}

/// Whether the API server serves GpuQuotas (the CRD is installed): probed once, so that a watch
/// of a kind the server lacks does not hold back the status for ever.
async fn serves_quotas(client: &kube::Client) -> bool {
    let probe = Api::<GpuQuota>::all(client.clone())
        .list(&ListParams::default().limit(1))
        .await;
    !matches!(&probe, Err(error) if is_not_found(error))
}

/// The JSON document (see the module docs), pretty-printed.
///
/// # Errors
/// [`Error::Json`], never in practice: every field serializes.
pub fn json(status: &Status) -> Result<String> {
    serde_json::to_string_pretty(status).map_err(|source| Error::Json {
        what: "encoding the status as JSON",
        source,
    })
}

/// Watches `driver`'s ResourceSlices, all ResourceClaims, (where served) all GpuQuotas and
/// (where allowed) the Nodes' metadata, and calls `on_change` with the status, node pools named
/// by the node label `pool_label`, once all are listed and then after every change that
/// alters it, until `shutdown` completes (`Ok`). Watch failures are retried with kube's default
/// back-off; each is passed to `on_error`.
///
/// # Errors
/// Never yet: the watches retry for ever. Kept fallible for a future limit on retries.
pub async fn watch(
    client: kube::Client,
    driver: &str,
    pool_label: &str,
    shutdown: impl Future<Output = ()>,
    mut on_change: impl FnMut(&Status),
    mut on_error: impl FnMut(&str),
) -> Result<()> {
    let (caches, mut events) = Caches::start(client, driver).await;
    let mut shutdown = pin!(shutdown);
    let mut last: Option<Status> = None;
    loop {
        let event = tokio::select! {
            () = &mut shutdown => return Ok(()),
            event = events.next() => event,
        };
        match event {
            // The watch streams retry for ever; an end means the runtime is going away.
            None => return Ok(()),
            Some(Tick::Failed(message)) => on_error(&message),
            Some(Tick::Changed) => {
                let Some(snapshot) = caches.snapshot() else {
                    continue;
                };
                let status = Status::with_pool_label(&snapshot, driver, pool_label);
                if last.as_ref() != Some(&status) {
                    on_change(&status);
                    last = Some(status);
                }
            }
        }
    }
}

/// The stores [`watch`] keeps.
struct Caches {
    slices: Store<ResourceSlice>,
    claims: Store<ResourceClaim>,
    /// `None` where the GpuQuota CRD is not installed.
    quotas: Option<Store<GpuQuota>>,
    /// The Nodes' metadata, or why Nodes may not be listed.
    nodes: std::result::Result<Store<PartialObjectMeta<Node>>, String>,
}

type Ticks = std::pin::Pin<Box<dyn Stream<Item = Tick> + Send>>;

impl Caches {
    /// Starts the watches: slices and claims always; GpuQuotas and Nodes only where a probe
    /// lists them, so that a watch of a kind the server lacks or forbids does not hold back the
    /// status for ever.
    async fn start(client: kube::Client, driver: &str) -> (Caches, Ticks) {
        let (slices, slice_events) = cache(
            Api::<ResourceSlice>::all(client.clone()),
            watcher::Config::default().fields(&driver_selector(driver)),
            "ResourceSlices",
        );
        let (claims, claim_events) = cache(
            Api::<ResourceClaim>::all(client.clone()),
            watcher::Config::default(),
            "ResourceClaims",
        );
        let mut events: Ticks = Box::pin(stream::select(slice_events, claim_events));
        let quotas = if serves_quotas(&client).await {
            let (store, quota_events) = cache(
                Api::<GpuQuota>::all(client.clone()),
                watcher::Config::default(),
                "GpuQuotas",
            );
            events = Box::pin(stream::select(events, quota_events));
            Some(store)
        } else {
            None
        };
        let nodes_api = Api::<PartialObjectMeta<Node>>::all(client);
        let nodes = match nodes_api.list(&ListParams::default().limit(1)).await {
            Ok(_) => {
                let (store, node_events) = cache(nodes_api, watcher::Config::default(), "Nodes");
                events = Box::pin(stream::select(events, node_events));
                Ok(store)
            }
            Err(error) => Err(nodes_problem(&error)),
        };
        let caches = Caches {
            slices,
            claims,
            quotas,
            nodes,
        };
        (caches, events)
    }

    /// The stores' contents; `None` until every store has its initial list, which would show
    /// claims without their devices or devices without their claims.
    fn snapshot(&self) -> Option<Snapshot> {
        let quotas_ready = self.quotas.as_ref().is_none_or(is_ready);
        let nodes_ready = self.nodes.as_ref().map_or(true, is_ready);
        if !(is_ready(&self.slices) && is_ready(&self.claims) && quotas_ready && nodes_ready) {
            return None;
        }
        let (nodes, nodes_problem) = match &self.nodes {
            Ok(store) => (
                store
                    .state()
                    .iter()
                    .map(|n| node_of((**n).clone()))
                    .collect(),
                None,
            ),
            Err(problem) => (Vec::new(), Some(problem.clone())),
        };
        Some(Snapshot {
            slices: self.slices.state().iter().map(|s| (**s).clone()).collect(),
            claims: self.claims.state().iter().map(|c| (**c).clone()).collect(),
            quotas: self
                .quotas
                .iter()
                .flat_map(Store::state)
                .map(|q| (*q).clone())
                .collect(),
            nodes,
            nodes_problem,
        })
    }
}

/// What a watch stream reports.
enum Tick {
    /// The store changed, or finished its initial list.
    Changed,
    /// The watch failed; it is retried.
    Failed(String),
}

/// Whether the store's initial list is complete.
fn is_ready<K>(store: &Store<K>) -> bool
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    use futures::FutureExt as _;
    store.wait_until_ready().now_or_never().is_some()
}

/// A reflector over `api` and its stream of ticks.
fn cache<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: &'static str,
) -> (Store<K>, impl Stream<Item = Tick> + Send + Unpin + 'static)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let ticks = reflector(
        writer,
        watcher(api, config).backoff(WatchBackoff::default()),
    )
    .filter_map(move |event| {
        std::future::ready(match event {
            Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone) => {
                Some(Tick::Changed)
            }
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => None,
            Err(error) => Some(Tick::Failed(format!(
                "watching {kind} failed: {error}; retrying"
            ))),
        })
    });
    (store, Box::pin(ticks))
}
