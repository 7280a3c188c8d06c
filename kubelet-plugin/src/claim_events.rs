//! Warning Events on prepared claims, for what happens to them on the node after prepare
//! (an MPS daemon of their GPU died and was restarted): `kubectl describe resourceclaim`
//! shows them next to the controller's allocation Events.

use std::sync::{Mutex, PoisonError};

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};

use crate::preparer::ClaimRef;

/// The reporting component of the plugin's Events and the field manager of its writes: the
/// plugin's one field manager, [`crate::publish::FIELD_MANAGER`].
pub const REPORTING_CONTROLLER: &str = crate::publish::FIELD_MANAGER;

/// A Warning Event about a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimWarning {
    /// The claim.
    pub claim: ClaimRef,
    /// CamelCase reason, e.g. `MpsDaemonRestarted`.
    pub reason: &'static str,
    /// What happened, for people.
    pub note: String,
}

/// Where the plugin's Warning Events about claims go.
pub trait ClaimEvents: Send + Sync + 'static {
    /// Publishes `warning`. Failing to publish is logged, never fatal: an Event is a report,
    /// and what it reports has been logged and counted already.
    fn warn(&self, warning: ClaimWarning) -> BoxFuture<'_, ()>;
}

/// Events through the API server (`events.k8s.io/v1`), reported as
/// [`REPORTING_CONTROLLER`] on this node and created under that field manager.
///
/// Each warning is a new Event named as client-go's `tools/events` names them
/// (`<object>.<nanoseconds in hex>`), without kube-runtime's `Recorder`, which creates Events
/// with no field manager (`Recorder::publish` in kube-rs/kube `kube-runtime/src/events.rs`):
/// they would show up as manager `unknown`. Repeats are not folded into a series; the
/// warnings are rare (a daemon restart) and each one is news.
pub struct KubeClaimEvents {
    client: kube::Client,
    node: String,
}

impl KubeClaimEvents {
    /// Events written with `client`, reported by the plugin instance of `node`.
    pub fn new(client: kube::Client, node: &str) -> Self {
        KubeClaimEvents {
            client,
            node: node.to_owned(),
        }
    }

    fn event(&self, warning: ClaimWarning, now: Timestamp) -> Event {
        Event {
            metadata: ObjectMeta {
                name: Some(format!("{}.{:x}", warning.claim.name, now.as_nanosecond())),
                namespace: Some(warning.claim.namespace.clone()),
                ..ObjectMeta::default()
            },
            type_: Some("Warning".to_owned()),
            reason: Some(warning.reason.to_owned()),
            note: Some(warning.note),
            action: Some("Prepare".to_owned()),
            event_time: Some(MicroTime(now)),
            regarding: Some(claim_reference(&warning.claim)),
            reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
            reporting_instance: Some(self.node.clone()),
            ..Event::default()
        }
    }
}

impl ClaimEvents for KubeClaimEvents {
    fn warn(&self, warning: ClaimWarning) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let uid = warning.claim.uid.clone();
            let api: Api<Event> = Api::namespaced(self.client.clone(), &warning.claim.namespace);
            let event = self.event(warning, Timestamp::now());
            let params = PostParams {
                field_manager: Some(REPORTING_CONTROLLER.to_owned()),
                ..PostParams::default()
            };
            if let Err(error) = api.create(&params, &event).await {
                tracing::warn!(claim.uid = %uid, %error, "cannot publish a claim Event");
            }
        })
    }
}

fn claim_reference(claim: &ClaimRef) -> ObjectReference {
    ObjectReference {
        api_version: Some("resource.k8s.io/v1".to_owned()),
        kind: Some("ResourceClaim".to_owned()),
        namespace: Some(claim.namespace.clone()),
        name: Some(claim.name.clone()),
        uid: Some(claim.uid.clone()),
        ..ObjectReference::default()
    }
}

/// Events kept in memory: for running without an API server (the demo) and for tests.
#[derive(Debug, Default)]
pub struct MemoryClaimEvents {
    warnings: Mutex<Vec<ClaimWarning>>,
}

impl MemoryClaimEvents {
    /// The warnings published so far, oldest first.
    pub fn warnings(&self) -> Vec<ClaimWarning> {
        self.warnings
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl ClaimEvents for MemoryClaimEvents {
    fn warn(&self, warning: ClaimWarning) -> BoxFuture<'_, ()> {
        self.warnings
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(warning);
        Box::pin(async {})
    }
}
