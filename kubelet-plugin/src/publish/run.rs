//! Keeping the slices published: [`Publisher::run`], its watches of this node's slices and of
//! its Node object, and the clean-up at shutdown.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kerf_api::ownership::{OwnershipRecord, RECORD_ANNOTATION};
use kerf_api::watch_backoff::WatchBackoff;
use kerf_core::health::NodeHealth;
use kerf_core::inventory::Inventory;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Publisher, SHUTDOWN_DELETE_ATTEMPTS, WatchItem, WatchStream};
use crate::Result;

impl Publisher {
    /// Publishes `inventory` and keeps it published until `shutdown`: republishes after a
    /// short debounce when a slice disappears or is changed by someone else, or when the
    /// Node's ownership record changes; checks again every `resync`, and retries failures
    /// with exponential backoff. At shutdown it deletes this node's slices of this driver
    /// (unless another instance of the driver serves the node, `Publisher::with_other_instances`)
    /// and returns.
    ///
    /// # Errors
    ///
    /// Only the final clean-up: [`Error::Kube`] when the slices cannot be deleted at shutdown
    /// after a few attempts. API errors while running are logged and retried.
    pub async fn run(
        self,
        inventory: Arc<Inventory>,
        resync: Duration,
        shutdown: CancellationToken,
    ) -> Result<()> {
        let mut slice_watch = self.slice_watch();
        let mut node_watch = self.node_watch();
        let mut backoff = Backoff::new(self.retry_backoff);
        let mut next_publish = Some(Instant::now());
        let mut next_resync = Instant::now() + resync;
        let mut init_seen = HashSet::new();
        let mut health = self.taints.as_ref().map(|t| t.health.clone());
        loop {
            let publish_at = next_publish.unwrap_or(next_resync);
            let republish = tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep_until(publish_at) => {
                    let result = tokio::select! {
                        biased;
                        () = shutdown.cancelled() => break,
                        result = self.publish(&inventory) => result,
                    };
                    next_publish = Self::after_publish(result, &mut backoff);
                    if next_publish.is_none() {
                        next_resync = Instant::now() + resync;
                    }
                    false
                }
                event = slice_watch.next() => {
                    self.on_slice_event(event, &mut init_seen, &mut slice_watch)
                }
                event = node_watch.next() => self.on_node_event(event, &mut node_watch),
                changed = health_changed(health.as_mut()) => {
                    if !changed {
                        // The monitor is gone; the taints stay as they are.
                        health = None;
                    }
                    changed
                }
            };
            if republish {
                next_publish.get_or_insert_with(|| Instant::now() + self.debounce);
            }
        }
        self.delete_at_shutdown().await
    }

    /// When to publish next after a publish with `result`: not before the resync after a
    /// success, after the next backoff delay after a failure.
    fn after_publish(result: Result<()>, backoff: &mut Backoff) -> Option<Instant> {
        match result {
            Ok(()) => {
                backoff.reset();
                None
            }
            Err(err) => {
                let delay = backoff.next_delay();
                tracing::warn!(error = %err, retry_in = ?delay, "publishing ResourceSlices failed");
                Some(Instant::now() + delay)
            }
        }
    }

    /// This node's slices of this driver, watched; the watch retries errors with [`WatchBackoff`].
    fn slice_watch(&self) -> WatchStream<ResourceSlice> {
        let config = watcher::Config::default().fields(&self.field_selector());
        watcher::watcher(self.slices.clone(), config)
            .backoff(WatchBackoff::default())
            .boxed()
    }

    /// This node's Node object only (`metadata.name=<node>`), watched for its ownership
    /// record; the watch retries errors with [`WatchBackoff`].
    fn node_watch(&self) -> WatchStream<Node> {
        let config =
            watcher::Config::default().fields(&format!("metadata.name={}", self.node_name));
        watcher::watcher(self.nodes.clone(), config)
            .backoff(WatchBackoff::default())
            .boxed()
    }

    /// Handles one item of the slice watch (starting it again when it ended); `true` when the
    /// slices must be published again.
    fn on_slice_event(
        &self,
        event: Option<WatchItem<ResourceSlice>>,
        init_seen: &mut HashSet<String>,
        watch: &mut WatchStream<ResourceSlice>,
    ) -> bool {
        match event {
            Some(Ok(event)) => {
                let why = self.republish_reason(&event, init_seen);
                if let Some(why) = why {
                    tracing::info!(
                        reason = why,
                        "ResourceSlices changed behind the plugin's back; publishing again"
                    );
                }
                why.is_some()
            }
            Some(Err(err)) => {
                tracing::warn!(error = %err, "watching ResourceSlices failed; retrying");
                false
            }
            None => {
                tracing::warn!("ResourceSlice watch ended; starting it again");
                *watch = self.slice_watch();
                false
            }
        }
    }

    /// Handles one item of the Node watch (starting it again when it ended); `true` when the
    /// ownership record changed and the slices must be published again.
    fn on_node_event(&self, event: Option<WatchItem<Node>>, watch: &mut WatchStream<Node>) -> bool {
        match event {
            Some(Ok(Event::Apply(node) | Event::InitApply(node))) => {
                if let Some(source) = &self.fault_annotation {
                    source.observe(&node);
                }
                let record = self.observe_record(&node);
                let publication = self.observe_publication(&node);
                if record || publication {
                    tracing::info!(
                        node = %self.node_name,
                        record,
                        publication,
                        "the Node's ownership record or shared publication changed; publishing again"
                    );
                }
                record || publication
            }
            Some(Ok(Event::Init | Event::InitDone | Event::Delete(_))) => false,
            Some(Err(err)) => {
                tracing::warn!(error = %err, "watching the Node failed; retrying");
                false
            }
            None => {
                tracing::warn!("Node watch ended; starting it again");
                *watch = self.node_watch();
                false
            }
        }
    }

    /// Takes the ownership record of `node`; `true` when it differs from the record held.
    /// A malformed record is warned about (once per distinct bad value in a row) and the last
    /// good record is kept.
    pub(super) fn observe_record(&self, node: &Node) -> bool {
        let annotations = node.metadata.annotations.as_ref();
        let parsed = OwnershipRecord::from_annotations(annotations);
        let mut state = self.state();
        match parsed {
            Ok(record) => {
                state.bad_record = None;
                let changed = state.record != record;
                state.record = record;
                changed
            }
            Err(err) => {
                let value = annotations
                    .and_then(|a| a.get(RECORD_ANNOTATION))
                    .cloned()
                    .unwrap_or_default();
                if state.bad_record.as_ref() != Some(&value) {
                    tracing::warn!(
                        node = %self.node_name,
                        annotation = RECORD_ANNOTATION,
                        error = %err,
                        "malformed ownership record on the Node; keeping the last good record"
                    );
                    state.bad_record = Some(value);
                }
                false
            }
        }
    }

    /// Why a watch event calls for publishing again, if it does.
    fn republish_reason(
        &self,
        event: &Event<ResourceSlice>,
        init_seen: &mut HashSet<String>,
    ) -> Option<&'static str> {
        let state = self.state();
        let changed_by_others = |slice: &ResourceSlice| {
            let name = slice.metadata.name.as_deref().unwrap_or_default();
            state.written.get(name) != slice.metadata.resource_version.as_ref()
        };
        match event {
            Event::Init => {
                init_seen.clear();
                None
            }
            Event::InitApply(slice) => {
                init_seen.insert(slice.metadata.name.clone().unwrap_or_default());
                changed_by_others(slice).then_some("slice changed")
            }
            Event::InitDone => state
                .written
                .keys()
                .any(|name| !init_seen.contains(name))
                .then_some("slice deleted"),
            Event::Apply(slice) => changed_by_others(slice).then_some("slice changed"),
            Event::Delete(slice) => {
                let name = slice.metadata.name.as_deref().unwrap_or_default();
                state.written.contains_key(name).then_some("slice deleted")
            }
        }
    }

    async fn delete_at_shutdown(&self) -> Result<()> {
        if let Some(others) = &self.others {
            let serving = others.serving().await;
            if !serving.is_empty() {
                tracing::info!(instances = ?serving, "another instance of the driver serves this node; leaving the ResourceSlices to it");
                return Ok(());
            }
        }
        let mut backoff = Backoff::new(self.retry_backoff);
        let mut attempt = 1;
        loop {
            match self.delete_all().await {
                Ok(_) => return Ok(()),
                Err(err) if attempt < SHUTDOWN_DELETE_ATTEMPTS => {
                    let delay = backoff.next_delay();
                    tracing::warn!(error = %err, attempt, retry_in = ?delay, "deleting ResourceSlices at shutdown failed");
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
                Err(err) => {
                    tracing::error!(error = %err, "could not delete ResourceSlices at shutdown; the kubelet removes them 30 s after the plugin is gone");
                    return Err(err);
                }
            }
        }
    }
}

/// Waits for a change of the health; `false` when its sender is gone. Without a receiver it
/// never completes.
async fn health_changed(health: Option<&mut watch::Receiver<NodeHealth>>) -> bool {
    match health {
        Some(receiver) => receiver.changed().await.is_ok(),
        None => std::future::pending().await,
    }
}

/// Exponential backoff between a first and a longest delay.
#[derive(Debug)]
pub(super) struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub(super) fn new((first, max): (Duration, Duration)) -> Self {
        Self {
            first,
            max,
            next: first,
        }
    }

    pub(super) fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    pub(super) fn reset(&mut self) {
        self.next = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_limit_and_resets() {
        let mut backoff = Backoff::new((Duration::from_millis(100), Duration::from_millis(350)));
        let delays: Vec<_> = (0..4).map(|_| backoff.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 350, 350]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_millis(100));
    }
}
