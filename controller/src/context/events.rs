//! Events (`events.k8s.io/v1`) written under the controller's field manager.
//!
//! kube-runtime's `Recorder::publish` (kube-rs/kube, `kube-runtime/src/events.rs`) creates and
//! patches Events with default parameters, so they show up as manager `unknown` in
//! `managedFields`, and it offers no way to name one. This recorder keeps its behaviour — an
//! Event repeated within six minutes (its `CACHE_TTL`, the series window of client-go's
//! `tools/events` broadcaster) becomes a `series` patch of the first one instead of a new
//! object — and names the field manager on every write.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::{Client, ResourceExt as _};
use tokio::sync::Mutex;

/// How long a published Event is remembered for aggregating repeats into its series.
const SERIES_WINDOW: SignedDuration = SignedDuration::from_mins(6);

/// What makes two Events the same occurrence, repeated (kube-runtime's `EventKey`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct EventKey {
    type_: &'static str,
    action: String,
    reason: String,
    note: Option<String>,
    regarding: String,
    related: Option<String>,
}

/// Publishes Events about objects as `reporter`, writing them as `field_manager`.
pub struct EventRecorder {
    client: Client,
    reporter: Reporter,
    field_manager: String,
    /// Events published within [`SERIES_WINDOW`], pruned on every publish.
    recent: Mutex<HashMap<EventKey, K8sEvent>>,
}

impl std::fmt::Debug for EventRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventRecorder")
            .field("reporter", &self.reporter)
            .field("field_manager", &self.field_manager)
            .finish_non_exhaustive()
    }
}

fn type_name(type_: EventType) -> &'static str {
    match type_ {
        EventType::Normal => "Normal",
        EventType::Warning => "Warning",
    }
}

/// A reference as one comparable string; the fields that identify the object.
fn reference_key(reference: &ObjectReference) -> String {
    format!(
        "{}/{}/{}/{}/{}",
        reference.api_version.as_deref().unwrap_or_default(),
        reference.kind.as_deref().unwrap_or_default(),
        reference.namespace.as_deref().unwrap_or_default(),
        reference.name.as_deref().unwrap_or_default(),
        reference.uid.as_deref().unwrap_or_default(),
    )
}

fn last_seen(event: &K8sEvent) -> Option<Timestamp> {
    event
        .series
        .as_ref()
        .map(|s| s.last_observed_time.0)
        .or_else(|| event.event_time.as_ref().map(|t| t.0))
}

impl EventRecorder {
    /// A recorder whose Events name `reporter` and whose writes name `field_manager`.
    pub fn new(client: Client, reporter: Reporter, field_manager: impl Into<String>) -> Self {
        Self {
            client,
            reporter,
            field_manager: field_manager.into(),
            recent: Mutex::default(),
        }
    }

    /// Publishes `event` about `regarding`: a new Event, or a bump of the series of the same
    /// Event published within the last six minutes. Cluster-scoped objects get their Events
    /// in `default`.
    ///
    /// # Errors
    /// The API server refused the Event.
    pub async fn publish(
        &self,
        event: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let key = EventKey {
            type_: type_name(event.type_),
            action: event.action.clone(),
            reason: event.reason.clone(),
            note: event.note.clone(),
            regarding: reference_key(regarding),
            related: event.secondary.as_ref().map(reference_key),
        };
        let previous = {
            let mut recent = self.recent.lock().await;
            recent.retain(|_, e| last_seen(e).is_some_and(|t| t + SERIES_WINDOW > now));
            recent.get(&key).cloned()
        };
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), namespace);
        let written = if let Some(mut repeated) = previous {
            let count = repeated.series.as_ref().map_or(2, |s| s.count + 1);
            repeated.series = Some(EventSeries {
                count,
                last_observed_time: MicroTime(now),
            });
            let params = PatchParams {
                field_manager: Some(self.field_manager.clone()),
                ..PatchParams::default()
            };
            let patch = serde_json::json!({"series": repeated.series});
            api.patch(&repeated.name_any(), &params, &Patch::Merge(&patch))
                .await?;
            repeated
        } else {
            let created = self.new_event(event, regarding, now);
            let params = PostParams {
                field_manager: Some(self.field_manager.clone()),
                ..PostParams::default()
            };
            api.create(&params, &created).await?;
            created
        };
        self.recent.lock().await.insert(key, written);
        Ok(())
    }

    fn new_event(&self, event: &Event, regarding: &ObjectReference, now: Timestamp) -> K8sEvent {
        let base = regarding
            .name
            .as_deref()
            .unwrap_or(&self.reporter.controller);
        K8sEvent {
            action: Some(event.action.clone()),
            reason: Some(event.reason.clone()),
            note: event.note.clone(),
            type_: Some(type_name(event.type_).to_owned()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            related: event.secondary.clone(),
            metadata: ObjectMeta {
                namespace: regarding.namespace.clone(),
                // client-go names Events `<object>.<nanoseconds in hex>`.
                name: Some(format!("{base}.{:x}", now.as_nanosecond())),
                ..ObjectMeta::default()
            },
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: Some(
                self.reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| self.reporter.controller.clone()),
            ),
            ..K8sEvent::default()
        }
    }
}
