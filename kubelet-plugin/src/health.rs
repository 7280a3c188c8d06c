//! GPU health: the sources that observe GPU faults, the monitor that unites them, and the
//! stream that reports them to the kubelet. (Whether the plugin process itself is ready is
//! another word: its ready flags, [`crate::http`].)
//!
//! Each source ([`nvml`]: NVML events and the NVML poll; in mock mode [`mock`]: the fault file
//! and the Node annotation) owns its own part of the faults; the [`HealthMonitor`] unites the
//! parts into one [`NodeHealth`] and publishes it on a `tokio::sync::watch` channel. The DRA
//! health service ([`grpc`]) streams it to the kubelet and the publisher turns it into device
//! taints.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kerf_core::health::{FATAL_XIDS, Fault, HealthStatus, NodeHealth, TaintPolicy};
use kerf_core::inventory::Inventory;
use tokio::sync::watch;

use crate::metrics::Metrics;

pub mod grpc;
pub mod mock;
pub mod nvml;

/// The kubelet's default health check timeout when a plugin sends none (upstream kubelet
/// `pkg/kubelet/cm/dra/healthinfo.go`, `DefaultHealthTimeout`).
const DEFAULT_HEALTH_CHECK_TIMEOUT: Duration = Duration::from_secs(30);

/// How the plugin observes and reports device health.
#[derive(Debug, Clone)]
pub struct HealthConfig {
    /// Sent to the kubelet as `health_check_timeout_seconds`: after this long without an
    /// update the kubelet shows the device as Unknown.
    pub check_timeout: Duration,
    /// How often the full list is sent again without a change; well within `check_timeout`.
    pub resend_interval: Duration,
    /// How often NVML is polled for lost GPUs, ECC counts and throttling.
    pub nvml_poll_interval: Duration,
    /// XIDs ignored besides NVIDIA's application XIDs.
    pub extra_ignored_xids: Vec<u64>,
    /// Mock mode: the fault file, re-read when it changes.
    pub mock_fault_file: Option<PathBuf>,
    /// How often the mock fault file is checked for changes.
    pub mock_fault_file_poll: Duration,
    /// Mock mode: whether the Node annotation [`mock::MOCK_FAULTS_ANNOTATION`] declares faults.
    pub mock_annotation: bool,
    /// The taint an unhealthy device gets.
    pub taint_policy: TaintPolicy,
}

impl HealthConfig {
    /// The defaults: the kubelet's 30 s timeout, a resend every 10 s, NVML polled every 10 s,
    /// and in mock mode (`mock`) faults from the Node annotation.
    pub fn defaults(mock: bool) -> Self {
        HealthConfig {
            check_timeout: DEFAULT_HEALTH_CHECK_TIMEOUT,
            resend_interval: resend_interval_for(DEFAULT_HEALTH_CHECK_TIMEOUT),
            nvml_poll_interval: Duration::from_secs(10),
            extra_ignored_xids: Vec::new(),
            mock_fault_file: None,
            mock_fault_file_poll: Duration::from_secs(1),
            mock_annotation: mock,
            taint_policy: TaintPolicy::default(),
        }
    }
}

/// A third of the timeout (at least one second): two resends may be lost before the kubelet
/// calls the device Unknown.
pub(crate) fn resend_interval_for(timeout: Duration) -> Duration {
    (timeout / 3).max(Duration::from_secs(1))
}

/// Who reported a part of the faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Source {
    /// NVML events (XID, double-bit ECC) and event registration failures; sticky.
    NvmlEvents,
    /// The periodic NVML poll (lost GPU, throttling); replaced on every poll.
    NvmlPoll,
    /// The mock fault file.
    FaultFile,
    /// The mock fault annotation of the Node.
    NodeAnnotation,
}

/// The faults of one source, by GPU UUID.
pub type Faults = BTreeMap<String, Vec<Fault>>;

/// The united faults of every source, published on a watch channel.
#[derive(Debug, Clone)]
pub struct HealthMonitor {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    parts: Mutex<BTreeMap<Source, Faults>>,
    sender: watch::Sender<NodeHealth>,
    inventory: Arc<Inventory>,
    metrics: Metrics,
}

impl HealthMonitor {
    /// A monitor of `inventory`'s GPUs, all healthy until a source says otherwise.
    pub fn new(inventory: Arc<Inventory>, metrics: Metrics) -> Self {
        let (sender, _) = watch::channel(NodeHealth::default());
        let monitor = HealthMonitor {
            inner: Arc::new(Inner {
                parts: Mutex::new(BTreeMap::new()),
                sender,
                inventory,
                metrics,
            }),
        };
        monitor.record_gauge(&NodeHealth::default());
        monitor
    }

    /// The inventory whose health is monitored.
    pub fn inventory(&self) -> &Arc<Inventory> {
        &self.inner.inventory
    }

    /// A receiver of the united health; it sees every change.
    pub fn subscribe(&self) -> watch::Receiver<NodeHealth> {
        self.inner.sender.subscribe()
    }

    /// The united health now.
    pub fn current(&self) -> NodeHealth {
        self.inner.sender.borrow().clone()
    }

    /// Replaces every fault `source` reported with `faults`.
    fn set_source(&self, source: Source, faults: Faults) {
        self.update(|parts| {
            parts.insert(source, faults);
        });
    }

    /// Adds one fault of GPU `uuid` to what `source` reported (sticky: nothing removes it
    /// but `HealthMonitor::set_source`).
    pub fn add_fault(&self, source: Source, uuid: &str, fault: Fault) {
        self.update(|parts| {
            let faults = parts
                .entry(source)
                .or_default()
                .entry(uuid.to_owned())
                .or_default();
            if !faults.contains(&fault) {
                faults.push(fault);
            }
        });
    }

    fn update(&self, change: impl FnOnce(&mut BTreeMap<Source, Faults>)) {
        // The parts are plain data that stay valid even if a holder panicked.
        let mut parts = self
            .inner
            .parts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        change(&mut parts);
        let united = unite(&parts);
        drop(parts);
        let mut appeared = Vec::new();
        let changed = self.inner.sender.send_if_modified(|health| {
            if *health == united {
                return false;
            }
            for gpu in &self.inner.inventory.gpus {
                let before: Vec<&Fault> = health.faults(&gpu.uuid).collect();
                appeared.extend(
                    united
                        .faults(&gpu.uuid)
                        .filter(|f| !before.contains(f))
                        .map(fault_class),
                );
            }
            *health = united.clone();
            true
        });
        if changed {
            for class in appeared {
                self.inner.metrics.record_fault(class);
            }
            self.record_gauge(&united);
        }
    }

    fn record_gauge(&self, health: &NodeHealth) {
        let (mut healthy, mut unhealthy, mut unknown) = (0, 0, 0);
        for device in health.devices(&self.inner.inventory) {
            match device.status {
                HealthStatus::Healthy => healthy += 1,
                HealthStatus::Unhealthy => unhealthy += 1,
                HealthStatus::Unknown => unknown += 1,
            }
        }
        self.inner
            .metrics
            .set_device_health(healthy, unhealthy, unknown);
    }
}

/// Every source's faults of each GPU together (a fault reported twice counts once).
fn unite(parts: &BTreeMap<Source, Faults>) -> NodeHealth {
    let mut by_gpu: BTreeMap<&str, Vec<Fault>> = BTreeMap::new();
    for faults in parts.values() {
        for (uuid, list) in faults {
            by_gpu
                .entry(uuid.as_str())
                .or_default()
                .extend(list.iter().cloned());
        }
    }
    let mut health = NodeHealth::default();
    for (uuid, faults) in by_gpu {
        health.set_faults(uuid, faults);
    }
    health
}

/// The low-cardinality class of a fault for the fault counter.
fn fault_class(fault: &Fault) -> &'static str {
    match fault {
        Fault::Xid { code } if FATAL_XIDS.contains(code) => "fatal_xid",
        Fault::Xid { .. } => "xid",
        Fault::EccUncorrected => "ecc_uncorrected",
        Fault::GpuLost => "gpu_lost",
        Fault::ThermalThrottle => "thermal_throttle",
        Fault::PowerThrottle => "power_throttle",
        Fault::Unmonitored { .. } => "unmonitored",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    fn monitor() -> (HealthMonitor, Registry) {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        let inventory = kerf_core::mock::from_spec("h100-sxm-80gb:2").expect("profile");
        (HealthMonitor::new(Arc::new(inventory), metrics), registry)
    }

    fn metrics_text(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text
    }

    #[test]
    fn sources_are_united_and_each_replaces_only_its_own_part() {
        let (monitor, registry) = monitor();
        let gpu = monitor.inventory().gpus[0].uuid.clone();
        let mut rx = monitor.subscribe();
        monitor.set_source(
            Source::FaultFile,
            Faults::from([(gpu.clone(), vec![Fault::Xid { code: 48 }])]),
        );
        monitor.set_source(
            Source::NodeAnnotation,
            Faults::from([(gpu.clone(), vec![Fault::ThermalThrottle])]),
        );
        assert!(rx.has_changed().unwrap());
        let faults: Vec<Fault> = rx.borrow_and_update().faults(&gpu).cloned().collect();
        assert_eq!(faults, [Fault::Xid { code: 48 }, Fault::ThermalThrottle]);
        monitor.set_source(Source::FaultFile, Faults::new());
        let faults: Vec<Fault> = monitor.current().faults(&gpu).cloned().collect();
        assert_eq!(faults, [Fault::ThermalThrottle]);
        // The same state again is no change.
        rx.borrow_and_update();
        monitor.set_source(
            Source::NodeAnnotation,
            Faults::from([(gpu.clone(), vec![Fault::ThermalThrottle])]),
        );
        assert!(!rx.has_changed().unwrap());
        let text = metrics_text(&registry);
        assert!(
            text.contains("kerf_plugin_device_faults_total{reason=\"fatal_xid\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kerf_plugin_devices_by_health{status=\"healthy\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn sticky_faults_stay_and_count_once() {
        let (monitor, registry) = monitor();
        let gpu = monitor.inventory().gpus[1].uuid.clone();
        monitor.add_fault(Source::NvmlEvents, &gpu, Fault::Xid { code: 61 });
        monitor.add_fault(Source::NvmlEvents, &gpu, Fault::Xid { code: 61 });
        monitor.set_source(Source::NvmlPoll, Faults::new());
        let devices = monitor.current().devices(monitor.inventory());
        assert_eq!(devices[1].status, HealthStatus::Unhealthy);
        assert_eq!(devices[0].status, HealthStatus::Healthy);
        let text = metrics_text(&registry);
        assert!(
            text.contains("kerf_plugin_device_faults_total{reason=\"xid\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kerf_plugin_devices_by_health{status=\"unhealthy\"} 1"),
            "{text}"
        );
    }
}
