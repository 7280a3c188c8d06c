//! `kerf status`: every kerf GPU of the cluster, per node, from kerf's ResourceSlices and the
//! ResourceClaims allocated on them — what an admin would otherwise script with kubectl and
//! jq.
//!
//! [`fetch`] lists both kinds once; [`files::read`] reads them from saved YAML instead; [`watch`] keeps them with watches and hands each changed
//! [`Status`] to a callback. Neither needs a kubeconfig: they take a `kube::Client`, which the
//! tests get from the fake API server.
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
//!   "unmatchedClaims": [{"node": "node-9", "device": "gpu-0", "claim": {…}}]
//! }
//! ```

pub mod files;
pub mod model;
mod render;

use std::future::Future;
use std::pin::pin;

use futures::{Stream, StreamExt as _, stream};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kerf_api::watch_backoff::WatchBackoff;
use kube::api::{Api, ListParams};
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt as _, watcher};

use crate::error::{Error, Result};
pub use model::{Snapshot, Status};
pub use render::table;

/// The ResourceSlice field selector for `driver`'s slices.
fn driver_selector(driver: &str) -> String {
    format!("spec.driver={driver}")
}

/// Lists `driver`'s ResourceSlices and every ResourceClaim once.
///
/// # Errors
/// [`Error::Kube`] when either list fails (unreachable server, missing RBAC for listing ResourceSlices or
/// ResourceClaims in all namespaces).
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
    Ok(Snapshot {
        slices: slices.items,
        claims: claims.items,
    })
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

/// Watches `driver`'s ResourceSlices and all ResourceClaims, and calls `on_change` with the
/// status once both are listed and then after every change that alters it, until `shutdown`
/// completes (`Ok`). Watch failures are retried with kube's default back-off; each is passed
/// to `on_error`.
///
/// # Errors
/// Never yet: the watches retry for ever. Kept fallible for a future limit on retries.
pub async fn watch(
    client: kube::Client,
    driver: &str,
    shutdown: impl Future<Output = ()>,
    mut on_change: impl FnMut(&Status),
    mut on_error: impl FnMut(&str),
) -> Result<()> {
    let (slices, slice_events) = cache(
        Api::<ResourceSlice>::all(client.clone()),
        watcher::Config::default().fields(&driver_selector(driver)),
        "ResourceSlices",
    );
    let (claims, claim_events) = cache(
        Api::<ResourceClaim>::all(client),
        watcher::Config::default(),
        "ResourceClaims",
    );
    let mut events = stream::select(slice_events, claim_events);
    let mut shutdown = pin!(shutdown);
    let mut last: Option<Status> = None;
    loop {
        let event = tokio::select! {
            () = &mut shutdown => return Ok(()),
            event = events.next() => event,
        };
        match event {
            // Both watch streams retry for ever; an end means the runtime is going away.
            None => return Ok(()),
            Some(Tick::Failed(message)) => on_error(&message),
            Some(Tick::Changed) => {
                // Before both initial lists are in, a status would show claims without their
                // devices or devices without their claims.
                if !(is_ready(&slices) && is_ready(&claims)) {
                    continue;
                }
                let snapshot = Snapshot {
                    slices: slices.state().iter().map(|s| (**s).clone()).collect(),
                    claims: claims.state().iter().map(|c| (**c).clone()).collect(),
                };
                let status = Status::new(&snapshot, driver);
                if last.as_ref() != Some(&status) {
                    on_change(&status);
                    last = Some(status);
                }
            }
        }
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
