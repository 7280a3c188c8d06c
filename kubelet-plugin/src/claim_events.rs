//! Warning Events on prepared claims, for what happens to them on the node after prepare
//! (an MPS daemon of their GPU died and was restarted): `kubectl describe resourceclaim`
//! shows them next to the controller's allocation Events.

use std::sync::{Mutex, PoisonError};

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

use crate::preparer::ClaimRef;

/// The reporting component of the plugin's Events and the field manager of its writes.
pub const REPORTING_CONTROLLER: &str = "kerf-kubelet-plugin";

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
/// [`REPORTING_CONTROLLER`] on this node.
pub struct KubeClaimEvents {
    recorder: Recorder,
}

impl KubeClaimEvents {
    /// Events written with `client`, reported by the plugin instance of `node`.
    pub fn new(client: kube::Client, node: &str) -> Self {
        KubeClaimEvents {
            recorder: Recorder::new(
                client,
                Reporter {
                    controller: REPORTING_CONTROLLER.to_owned(),
                    instance: Some(node.to_owned()),
                },
            ),
        }
    }
}

impl ClaimEvents for KubeClaimEvents {
    fn warn(&self, warning: ClaimWarning) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let event = Event {
                type_: EventType::Warning,
                reason: warning.reason.to_owned(),
                note: Some(warning.note),
                action: "Prepare".to_owned(),
                secondary: None,
            };
            let regarding = claim_reference(&warning.claim);
            if let Err(error) = self.recorder.publish(&event, &regarding).await {
                tracing::warn!(claim.uid = %warning.claim.uid, %error, "cannot publish a claim Event");
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
