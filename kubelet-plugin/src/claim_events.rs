//! Warning Events on prepared claims, for what happens to them on the node after prepare
//! (an MPS daemon of their GPU died and was restarted, the API server refused their status):
//! `kubectl describe resourceclaim` shows them next to the controller's allocation Events.
//! What concerns the node as a whole (its ResourceSlices cannot be published) goes on the
//! Node, as the kubelet reports node matters.

use std::sync::{Mutex, PoisonError};

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};

use crate::identity::ClaimRef;

/// The reporting component of the plugin's Events and the field manager of its writes: the
/// plugin's one field manager, [`crate::identity::FIELD_MANAGER`].
pub(crate) const REPORTING_CONTROLLER: &str = crate::identity::FIELD_MANAGER;

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

/// A Warning Event about this plugin's Node: what concerns the node as a whole, such as its
/// ResourceSlices, which the kubelet-side component reports on the Node as the kubelet does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeWarning {
    /// CamelCase reason, e.g. `WriteRefused`.
    pub reason: &'static str,
    /// What happened, for people.
    pub note: String,
}

/// Where the plugin's Warning Events about claims (and about its Node) go.
pub trait ClaimEvents: Send + Sync + 'static {
    /// Publishes `warning`. Failing to publish is logged, never fatal: an Event is a report,
    /// and what it reports has been logged and counted already.
    fn warn(&self, warning: ClaimWarning) -> BoxFuture<'_, ()>;

    /// Publishes `warning` about this plugin's Node, on the same terms as [`ClaimEvents::warn`].
    fn warn_node(&self, warning: NodeWarning) -> BoxFuture<'_, ()>;
}

/// Events through the API server (`events.k8s.io/v1`), reported as
/// `REPORTING_CONTROLLER` on this node and created under that field manager.
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
            let event = self.event(warning, Timestamp::now());
            if let Err(error) = self.create(event).await {
                tracing::warn!(claim.uid = %uid, %error, "cannot publish a claim Event");
            }
        })
    }

    fn warn_node(&self, warning: NodeWarning) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let event = self.node_event(warning, Timestamp::now());
            if let Err(error) = self.create(event).await {
                tracing::warn!(node = %self.node, %error, "cannot publish a Node Event");
            }
        })
    }
}

impl KubeClaimEvents {
    /// Creates `event` in its namespace under the plugin's field manager.
    async fn create(&self, event: Event) -> Result<Event, kube::Error> {
        let namespace = event.metadata.namespace.clone().unwrap_or_default();
        let api: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        let params = PostParams {
            field_manager: Some(REPORTING_CONTROLLER.to_owned()),
            ..PostParams::default()
        };
        api.create(&params, &event).await
    }

    /// A Warning about the Node as the kubelet reports on its Node: regarding the reference
    /// `NewMainKubelet` builds for Events (kubernetes/kubernetes `pkg/kubelet/kubelet.go`:
    /// kind `Node`, the node's name as name and as UID, no namespace), in namespace `default`,
    /// where client-go's recorder puts Events of a reference without one (`makeEvent` in
    /// `staging/src/k8s.io/client-go/tools/record/event.go`).
    fn node_event(&self, warning: NodeWarning, now: Timestamp) -> Event {
        Event {
            metadata: ObjectMeta {
                name: Some(format!("{}.{:x}", self.node, now.as_nanosecond())),
                namespace: Some("default".to_owned()),
                ..ObjectMeta::default()
            },
            type_: Some("Warning".to_owned()),
            reason: Some(warning.reason.to_owned()),
            note: Some(warning.note),
            action: Some("Publish".to_owned()),
            event_time: Some(MicroTime(now)),
            regarding: Some(ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Node".to_owned()),
                name: Some(self.node.clone()),
                uid: Some(self.node.clone()),
                ..ObjectReference::default()
            }),
            reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
            reporting_instance: Some(self.node.clone()),
            ..Event::default()
        }
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
    node_warnings: Mutex<Vec<NodeWarning>>,
}

impl MemoryClaimEvents {
    /// The warnings published so far, oldest first.
    pub fn warnings(&self) -> Vec<ClaimWarning> {
        self.warnings
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The warnings about the Node published so far, oldest first.
    #[cfg(test)]
    pub(crate) fn node_warnings(&self) -> Vec<NodeWarning> {
        self.node_warnings
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

    fn warn_node(&self, warning: NodeWarning) -> BoxFuture<'_, ()> {
        self.node_warnings
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(warning);
        Box::pin(async {})
    }
}
