//! GPU health from NVML, after NVIDIA k8s-dra-driver-gpu
//! `cmd/gpu-kubelet-plugin/device_health.go` (`registerDevicesForEvents`, `run`,
//! `xidsToSkip`):
//!
//! - an event set with XID critical errors and double-bit ECC errors of every GPU, waited on
//!   with a bounded wait (NVIDIA waits 5 s; kerf 1 s so that shutdown is prompt) on a blocking
//!   thread; XIDs of [`XidPolicy`] are skipped, the others are faults of their GPU;
//! - a GPU whose handle, supported events or registration fails is marked
//!   [`Fault::Unmonitored`] (Unknown): NVIDIA marks it unhealthy, but its health is unknown
//!   rather than bad;
//! - every poll interval, each GPU is asked for its handle (failure or `GPU_IS_LOST`:
//!   [`Fault::GpuLost`]), its volatile uncorrected ECC count (growth since the first poll:
//!   [`Fault::EccUncorrected`]) and its throttle reasons (thermal or power: informational).
//!
//! Event faults are sticky until the plugin restarts, as in NVIDIA's drivers: an XID says
//! the GPU needs attention (for the fatal ones a reset), and nothing NVML reports says it got
//! it. Faults are per physical GPU; a fault of a GPU is one of each MIG device on it (NVIDIA
//! maps an event with GPU and compute instance IDs to one MIG device, which nvml-wrapper's
//! `EventData` does not carry).
//!
//! The NVML calls are behind `HealthBackend`, so the loop is tested with a scripted backend.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kerf_core::health::{Fault, XidPolicy};
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use tokio_util::sync::CancellationToken;

use super::{Faults, HealthMonitor, Source};

/// Longest wait for one NVML event before the loop looks at the clock and the shutdown token.
const EVENT_WAIT_MS: u32 = 1000;

/// One NVML event as the loop sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// An XID critical error of a GPU.
    Xid {
        /// The GPU's UUID.
        uuid: String,
        /// The XID, `None` when NVML did not say.
        code: Option<u64>,
    },
    /// A double-bit (uncorrected) ECC error of a GPU.
    DoubleBitEcc {
        /// The GPU's UUID.
        uuid: String,
    },
}

/// What a wait for an event found.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Waited {
    /// An event.
    Event(Event),
    /// None within the wait.
    Timeout,
    /// The wait failed; NVML's words.
    Failed(String),
}

/// What one poll of a GPU found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Polled {
    /// The GPU is lost or has no handle.
    pub lost: bool,
    /// Volatile uncorrected ECC errors, when the GPU counts them.
    pub ecc_uncorrected: Option<u64>,
    /// Clocks held down by temperature.
    pub thermal: bool,
    /// Clocks held down by the power cap or brake.
    pub power: bool,
}

/// The NVML calls the health loop makes.
trait HealthBackend {
    /// Registers the GPU's XID and double-bit ECC events.
    ///
    /// # Errors
    /// Why its events cannot be observed, in NVML's words.
    fn register(&mut self, uuid: &str) -> Result<(), String>;

    /// Waits up to `timeout_ms` for one event.
    fn wait(&mut self, timeout_ms: u32) -> Waited;

    /// Asks the GPU for its state.
    fn poll(&mut self, uuid: &str) -> Polled;
}

/// Watches `gpus` through `backend` until `shutdown`, setting faults in `monitor`.
fn run_health_loop<B: HealthBackend>(
    backend: &mut B,
    gpus: &[String],
    policy: &XidPolicy,
    monitor: &HealthMonitor,
    poll_interval: Duration,
    shutdown: &CancellationToken,
) {
    for uuid in gpus {
        if let Err(reason) = backend.register(uuid) {
            tracing::warn!(gpu = %uuid, %reason, "cannot watch GPU health events; its devices are Unknown");
            monitor.add_fault(Source::NvmlEvents, uuid, Fault::Unmonitored { reason });
        }
    }
    let mut ecc_baseline: BTreeMap<String, u64> = BTreeMap::new();
    let mut next_poll = Instant::now();
    while !shutdown.is_cancelled() {
        if Instant::now() >= next_poll {
            poll_all(backend, gpus, monitor, &mut ecc_baseline);
            next_poll = Instant::now() + poll_interval;
        }
        match backend.wait(EVENT_WAIT_MS) {
            Waited::Timeout => {}
            Waited::Failed(error) => {
                // NVIDIA marks every device unhealthy here; the wait failing says nothing
                // about the GPUs, only that events are not observed until the next wait.
                tracing::warn!(%error, "waiting for NVML events failed");
                std::thread::sleep(Duration::from_millis(u64::from(EVENT_WAIT_MS)));
            }
            Waited::Event(Event::Xid { uuid, code }) => {
                let Some(code) = code else {
                    tracing::warn!(gpu = %uuid, "XID event without an XID number; ignored");
                    continue;
                };
                if let Some(fault) = policy.fault(code) {
                    tracing::error!(gpu = %uuid, xid = code, "XID error: GPU unhealthy");
                    monitor.add_fault(Source::NvmlEvents, &uuid, fault);
                } else {
                    tracing::info!(gpu = %uuid, xid = code, "application XID; ignored");
                }
            }
            Waited::Event(Event::DoubleBitEcc { uuid }) => {
                tracing::error!(gpu = %uuid, "double-bit ECC error: GPU unhealthy");
                monitor.add_fault(Source::NvmlEvents, &uuid, Fault::EccUncorrected);
            }
        }
    }
}

fn poll_all<B: HealthBackend>(
    backend: &mut B,
    gpus: &[String],
    monitor: &HealthMonitor,
    ecc_baseline: &mut BTreeMap<String, u64>,
) {
    let mut faults = Faults::new();
    for uuid in gpus {
        let polled = backend.poll(uuid);
        let mut found = Vec::new();
        if polled.lost {
            found.push(Fault::GpuLost);
        }
        if let Some(count) = polled.ecc_uncorrected {
            let baseline = *ecc_baseline.entry(uuid.clone()).or_insert(count);
            if count > baseline {
                // Sticky as an ECC event: the errors happened, whatever the counter does.
                monitor.add_fault(Source::NvmlEvents, uuid, Fault::EccUncorrected);
            }
        }
        if polled.thermal {
            found.push(Fault::ThermalThrottle);
        }
        if polled.power {
            found.push(Fault::PowerThrottle);
        }
        if !found.is_empty() {
            faults.insert(uuid.clone(), found);
        }
    }
    monitor.set_source(Source::NvmlPoll, faults);
}

/// The NVML backend: one `Nvml` and its event set, both living on the health thread.
struct NvmlBackend<'nvml> {
    nvml: &'nvml Nvml,
    events: Option<EventSet<'nvml>>,
}

impl HealthBackend for NvmlBackend<'_> {
    fn register(&mut self, uuid: &str) -> Result<(), String> {
        let device = self.nvml.device_by_uuid(uuid).map_err(|e| e.to_string())?;
        let supported = device.supported_event_types().map_err(|e| e.to_string())?;
        let wanted =
            (EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR) & supported;
        let set = match self.events.take() {
            Some(set) => set,
            None => self.nvml.create_event_set().map_err(|e| e.to_string())?,
        };
        // A failed registration frees the set (nvml-wrapper's `register_events`); the next
        // GPU starts a new one, and GPUs registered before are then no longer watched.
        match device.register_events(wanted, set) {
            Ok(set) => {
                self.events = Some(set);
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        }
    }

    fn wait(&mut self, timeout_ms: u32) -> Waited {
        let Some(set) = &self.events else {
            std::thread::sleep(Duration::from_millis(u64::from(timeout_ms)));
            return Waited::Timeout;
        };
        match set.wait(timeout_ms) {
            Ok(event) => {
                let uuid = match event.device.uuid() {
                    Ok(uuid) => uuid,
                    Err(e) => return Waited::Failed(format!("UUID of the event's GPU: {e}")),
                };
                if event.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                    let code = match event.event_data {
                        Some(XidError::Value(code)) => Some(code),
                        Some(XidError::Unknown) | None => None,
                    };
                    Waited::Event(Event::Xid { uuid, code })
                } else if event.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                    Waited::Event(Event::DoubleBitEcc { uuid })
                } else {
                    Waited::Timeout
                }
            }
            Err(NvmlError::Timeout) => Waited::Timeout,
            Err(e) => Waited::Failed(e.to_string()),
        }
    }

    fn poll(&mut self, uuid: &str) -> Polled {
        let Ok(device) = self.nvml.device_by_uuid(uuid) else {
            return Polled {
                lost: true,
                ..Polled::default()
            };
        };
        let ecc = device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile);
        let lost = matches!(ecc, Err(NvmlError::GpuLost));
        let reasons = device
            .current_throttle_reasons()
            .unwrap_or(ThrottleReasons::empty());
        Polled {
            lost,
            ecc_uncorrected: ecc.ok(),
            thermal: reasons.intersects(
                ThrottleReasons::SW_THERMAL_SLOWDOWN | ThrottleReasons::HW_THERMAL_SLOWDOWN,
            ),
            power: reasons.intersects(
                ThrottleReasons::SW_POWER_CAP | ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN,
            ),
        }
    }
}

/// Runs the NVML health loop on a blocking thread until `shutdown`. When NVML cannot be
/// loaded every GPU is marked [`Fault::Unmonitored`] and the task waits for `shutdown` all
/// the same: the plugin stops when any of its tasks ends.
///
/// # Errors
///
/// [`crate::Error::Internal`] when the blocking thread panicked.
pub(crate) async fn watch_nvml(
    monitor: HealthMonitor,
    policy: XidPolicy,
    poll_interval: Duration,
    shutdown: CancellationToken,
) -> crate::Result<()> {
    let gpus: Vec<String> = monitor
        .inventory()
        .gpus
        .iter()
        .map(|g| g.uuid.clone())
        .collect();
    let stopped = shutdown.clone();
    tokio::task::spawn_blocking(move || match Nvml::init() {
        Ok(nvml) => {
            let mut backend = NvmlBackend {
                nvml: &nvml,
                events: None,
            };
            run_health_loop(
                &mut backend,
                &gpus,
                &policy,
                &monitor,
                poll_interval,
                &shutdown,
            );
        }
        Err(e) => {
            tracing::error!(error = %e, "NVML cannot be loaded for health checks; GPU health is Unknown");
            for uuid in &gpus {
                monitor.add_fault(
                    Source::NvmlEvents,
                    uuid,
                    Fault::Unmonitored {
                        reason: format!("NVML: {e}"),
                    },
                );
            }
        }
    })
    .await
    .map_err(|e| crate::Error::internal("the NVML health thread", e))?;
    stopped.cancelled().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Arc;

    use kerf_core::health::HealthStatus;
    use prometheus_client::registry::Registry;

    use super::*;
    use crate::metrics::Metrics;

    /// Plays a script of events, then cancels the loop. Each loop round polls every GPU, then
    /// waits; the poll answers come from the first round of `polls`, and each wait moves on
    /// to the next round (the last one repeats).
    struct Scripted {
        refuse: Vec<String>,
        events: VecDeque<Waited>,
        polls: VecDeque<BTreeMap<String, Polled>>,
        shutdown: CancellationToken,
    }

    impl HealthBackend for Scripted {
        fn register(&mut self, uuid: &str) -> Result<(), String> {
            if self.refuse.iter().any(|u| u == uuid) {
                Err("Not Supported".into())
            } else {
                Ok(())
            }
        }

        fn wait(&mut self, _timeout_ms: u32) -> Waited {
            if self.polls.len() > 1 {
                self.polls.pop_front();
            }
            self.events.pop_front().unwrap_or_else(|| {
                self.shutdown.cancel();
                Waited::Timeout
            })
        }

        fn poll(&mut self, uuid: &str) -> Polled {
            self.polls
                .front()
                .and_then(|r| r.get(uuid).cloned())
                .unwrap_or_default()
        }
    }

    fn monitor() -> (HealthMonitor, Vec<String>) {
        let metrics = Metrics::new(&mut Registry::default());
        let inventory = kerf_core::mock::from_spec("h100-sxm-80gb:4").expect("profile");
        let monitor = HealthMonitor::new(Arc::new(inventory), metrics);
        let gpus: Vec<String> = monitor
            .inventory()
            .gpus
            .iter()
            .map(|g| g.uuid.clone())
            .collect();
        (monitor, gpus)
    }

    #[test]
    fn ignored_xids_registration_failures_and_throttling() {
        let (monitor, gpus) = monitor();
        let shutdown = CancellationToken::new();
        let ecc = |n| Polled {
            ecc_uncorrected: Some(n),
            ..Polled::default()
        };
        let mut backend = Scripted {
            refuse: vec![gpus[3].clone()],
            events: VecDeque::from([
                Waited::Event(Event::Xid {
                    uuid: gpus[0].clone(),
                    code: Some(13),
                }),
                Waited::Event(Event::Xid {
                    uuid: gpus[0].clone(),
                    code: Some(94),
                }),
                Waited::Failed("Unknown Error".into()),
            ]),
            polls: VecDeque::from([BTreeMap::from([
                (gpus[1].clone(), ecc(2)),
                (
                    gpus[2].clone(),
                    Polled {
                        thermal: true,
                        ..Polled::default()
                    },
                ),
            ])]),
            shutdown: shutdown.clone(),
        };
        let policy = XidPolicy::ignoring([94]);
        run_health_loop(
            &mut backend,
            &gpus,
            &policy,
            &monitor,
            Duration::ZERO,
            &shutdown,
        );
        let statuses: Vec<HealthStatus> = monitor
            .current()
            .devices(monitor.inventory())
            .into_iter()
            .map(|d| d.status)
            .collect();
        // Ignored XIDs leave GPU 0 healthy; a steady ECC count and throttling are no faults.
        assert_eq!(
            statuses,
            [
                HealthStatus::Healthy,
                HealthStatus::Healthy,
                HealthStatus::Healthy,
                HealthStatus::Unknown
            ]
        );
        let thermal: Vec<Fault> = monitor.current().faults(&gpus[2]).cloned().collect();
        assert_eq!(thermal, [Fault::ThermalThrottle]);
    }

    #[test]
    fn counted_xids_ecc_growth_and_lost_gpus_are_faults() {
        let (monitor, gpus) = monitor();
        let ecc = |n| Polled {
            ecc_uncorrected: Some(n),
            ..Polled::default()
        };
        let policy = XidPolicy::default();
        let shutdown = CancellationToken::new();
        let mut backend = Scripted {
            refuse: Vec::new(),
            events: VecDeque::from([Waited::Event(Event::Xid {
                uuid: gpus[0].clone(),
                code: Some(79),
            })]),
            polls: VecDeque::from([
                BTreeMap::from([(gpus[1].clone(), ecc(2))]),
                BTreeMap::from([
                    (gpus[1].clone(), ecc(3)),
                    (
                        gpus[2].clone(),
                        Polled {
                            lost: true,
                            ..Polled::default()
                        },
                    ),
                ]),
            ]),
            shutdown: shutdown.clone(),
        };
        run_health_loop(
            &mut backend,
            &gpus,
            &policy,
            &monitor,
            Duration::ZERO,
            &shutdown,
        );
        let health = monitor.current();
        assert_eq!(
            health.faults(&gpus[0]).cloned().collect::<Vec<_>>(),
            [Fault::Xid { code: 79 }]
        );
        assert_eq!(
            health.faults(&gpus[1]).cloned().collect::<Vec<_>>(),
            [Fault::EccUncorrected]
        );
        assert_eq!(
            health.faults(&gpus[2]).cloned().collect::<Vec<_>>(),
            [Fault::GpuLost]
        );
    }

    /// Without a driver (here) NVML does not load; with one, the mock GPUs are not its GPUs.
    /// Either way every GPU is Unknown, and the task lasts until shutdown.
    #[tokio::test]
    async fn gpus_nvml_cannot_watch_are_unknown_and_the_task_waits_for_shutdown() {
        let (monitor, _) = monitor();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(watch_nvml(
            monitor.clone(),
            XidPolicy::default(),
            Duration::from_secs(60),
            shutdown.clone(),
        ));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !monitor
            .current()
            .devices(monitor.inventory())
            .iter()
            .all(|d| d.status == HealthStatus::Unknown)
        {
            assert!(Instant::now() < deadline, "GPUs did not become Unknown");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!task.is_finished());
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}
