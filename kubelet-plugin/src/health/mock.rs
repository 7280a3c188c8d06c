//! Mock health sources: a fault file (`--mock-fault-file`) and the annotation
//! [`MOCK_FAULTS_ANNOTATION`] of the plugin's own Node, both in the format of
//! [`kerf_core::health::parse_fault_file`] (YAML, so JSON too). Their faults are united with
//! each other by the [`HealthMonitor`].
//!
//! A missing file or annotation means healthy; a bad one is logged once per distinct content
//! and the last good state is kept, so a half-written edit never flips devices back to healthy.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kerf_core::health::parse_fault_file;
use tokio_util::sync::CancellationToken;

use super::{HealthMonitor, Source};

/// The Node annotation that declares mock faults, e.g.
/// `kubectl annotate node n1 gpu.kerf.dev/mock-faults='{"gpu-0": [{"kind": "xid", "code": 79}]}'`.
pub const MOCK_FAULTS_ANNOTATION: &str = "gpu.kerf.dev/mock-faults";

/// What one read of a mock source found.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Read {
    /// No file or no annotation: healthy.
    Absent,
    /// The text as read.
    Text(String),
    /// The file could not be read; the OS error in words.
    Failed(String),
}

/// Applies one read of a mock source to the monitor when it differs from the last one.
#[derive(Debug)]
struct MockSource {
    source: Source,
    what: String,
    monitor: HealthMonitor,
    last: Option<Read>,
}

impl MockSource {
    fn observe(&mut self, read: Read) {
        if self.last.as_ref() == Some(&read) {
            return;
        }
        match &read {
            Read::Absent => {
                tracing::info!(source = %self.what, "no mock faults declared; GPUs healthy");
                self.monitor.set_source(self.source, super::Faults::new());
            }
            Read::Text(text) => match parse_fault_file(text, self.monitor.inventory()) {
                Ok(faults) => {
                    tracing::info!(source = %self.what, gpus = faults.len(), "mock faults read");
                    self.monitor.set_source(self.source, faults);
                }
                Err(error) => tracing::error!(
                    source = %self.what,
                    %error,
                    "mock faults cannot be read; keeping the last good state"
                ),
            },
            Read::Failed(error) => tracing::error!(
                source = %self.what,
                %error,
                "mock fault file cannot be read; keeping the last good state"
            ),
        }
        self.last = Some(read);
    }
}

fn read_file(path: &Path) -> Read {
    match std::fs::read_to_string(path) {
        Ok(text) => Read::Text(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Read::Absent,
        Err(e) => Read::Failed(e.to_string()),
    }
}

/// Reads the fault file at `path` now and then every `interval` until `shutdown`, and sets
/// its faults in `monitor` whenever its content changed. The content is compared rather than
/// the modification time, which a quick rewrite within one tick may leave unchanged.
///
/// # Errors
///
/// None: problems with the file are logged. The `Result` fits the plugin's task list.
pub(crate) async fn watch_fault_file(
    path: PathBuf,
    monitor: HealthMonitor,
    interval: Duration,
    shutdown: CancellationToken,
) -> crate::Result<()> {
    let mut source = MockSource {
        source: Source::FaultFile,
        what: path.display().to_string(),
        monitor,
        last: None,
    };
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            _ = ticks.tick() => {}
        }
        let file = path.clone();
        let read = tokio::task::spawn_blocking(move || read_file(&file))
            .await
            .unwrap_or_else(|e| Read::Failed(e.to_string()));
        source.observe(read);
    }
}

/// The mock faults of the Node's annotation, applied to the monitor as the Node changes.
/// Cloning shares the last state.
#[derive(Debug, Clone)]
pub(crate) struct NodeAnnotationSource {
    inner: Arc<Mutex<MockSource>>,
}

impl NodeAnnotationSource {
    /// A source that sets the annotation's faults in `monitor`.
    pub fn new(monitor: HealthMonitor) -> Self {
        NodeAnnotationSource {
            inner: Arc::new(Mutex::new(MockSource {
                source: Source::NodeAnnotation,
                what: format!("Node annotation {MOCK_FAULTS_ANNOTATION}"),
                monitor,
                last: None,
            })),
        }
    }

    /// Takes the annotation of `node` (its absence means healthy).
    pub fn observe(&self, node: &Node) {
        let read = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(MOCK_FAULTS_ANNOTATION))
            .map_or(Read::Absent, |text| Read::Text(text.clone()));
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .observe(read);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use kerf_core::health::{Fault, HealthStatus};
    use prometheus_client::registry::Registry;

    use super::*;
    use crate::metrics::Metrics;

    fn monitor() -> HealthMonitor {
        let metrics = Metrics::new(&mut Registry::default());
        let inventory = kerf_core::mock::from_spec("h100-sxm-80gb:2").expect("profile");
        HealthMonitor::new(Arc::new(inventory), metrics)
    }

    fn statuses(monitor: &HealthMonitor) -> Vec<HealthStatus> {
        monitor
            .current()
            .devices(monitor.inventory())
            .into_iter()
            .map(|d| d.status)
            .collect()
    }

    #[test]
    fn a_bad_file_keeps_the_last_good_state_and_a_missing_one_is_healthy() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("faults.yaml");
        let monitor = monitor();
        let mut source = MockSource {
            source: Source::FaultFile,
            what: "test".into(),
            monitor: monitor.clone(),
            last: None,
        };
        source.observe(read_file(&path));
        assert_eq!(statuses(&monitor), [HealthStatus::Healthy; 2]);
        std::fs::write(&path, "gpu-1:\n  - kind: xid\n    code: 79\n").unwrap();
        source.observe(read_file(&path));
        assert_eq!(
            statuses(&monitor),
            [HealthStatus::Healthy, HealthStatus::Unhealthy]
        );
        std::fs::write(&path, "gpu-1:\n  - kind: meltdown\n").unwrap();
        source.observe(read_file(&path));
        assert_eq!(
            statuses(&monitor),
            [HealthStatus::Healthy, HealthStatus::Unhealthy]
        );
        std::fs::remove_file(&path).unwrap();
        source.observe(read_file(&path));
        assert_eq!(statuses(&monitor), [HealthStatus::Healthy; 2]);
    }

    #[test]
    fn the_annotation_takes_json_and_its_removal_heals() {
        let monitor = monitor();
        let source = NodeAnnotationSource::new(monitor.clone());
        let gpu0 = monitor.inventory().gpus[0].uuid.clone();
        let mut node = Node::default();
        node.metadata.annotations = Some(BTreeMap::from([(
            MOCK_FAULTS_ANNOTATION.to_owned(),
            format!(r#"{{"{gpu0}": [{{"kind": "eccUncorrected"}}]}}"#),
        )]));
        source.observe(&node);
        let faults: Vec<Fault> = monitor.current().faults(&gpu0).cloned().collect();
        assert_eq!(faults, [Fault::EccUncorrected]);
        node.metadata.annotations = None;
        source.observe(&node);
        assert_eq!(statuses(&monitor), [HealthStatus::Healthy; 2]);
    }
}
