//! The fake kubelet's device health, as upstream kubelet keeps it:
//!
//! - per registered plugin a loop that opens `NodeWatchResources` and, when the stream ends,
//!   opens it again after 5 s (`pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`, `add`:
//!   `wait.UntilWithContext(..., 5*time.Second)`), ending when the plugin is deregistered;
//! - every message is the driver's full list; each device is stamped with the time it was
//!   received and its `health_check_timeout_seconds` (0 or less: 30 s); when the stream ends
//!   the driver's entries are dropped (`pkg/kubelet/cm/dra/manager.go`,
//!   `HandleWatchResourcesStream`, and `healthinfo.go`, `updateHealthInfo`, `clearDriver`);
//! - a device is read as Unknown with no message when it has no entry or its entry is older
//!   than its timeout (`healthinfo.go`, `getHealthInfo`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kerf_proto::client::RegisteredPlugin;
use kerf_proto::health::v1alpha1::HealthStatus;
use tokio::sync::watch;

use super::lock;

/// The kubelet's wait before opening a health stream again.
pub const STREAM_RETRY: Duration = Duration::from_secs(5);

/// The kubelet's timeout for a device whose plugin sends none (`DefaultHealthTimeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// What the kubelet shows for one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealthView {
    /// Healthy, Unhealthy or Unknown.
    pub health: HealthStatus,
    /// The plugin's message (empty when Unknown by staleness).
    pub message: String,
}

#[derive(Debug, Clone)]
struct Entry {
    health: HealthStatus,
    message: String,
    timeout: Duration,
    received: Instant,
    last_updated_time: i64,
}

#[derive(Debug, Default)]
struct State {
    /// driver -> "pool/device" -> entry.
    devices: HashMap<String, HashMap<String, Entry>>,
    /// Streams opened, by driver.
    streams: HashMap<String, usize>,
    /// Messages received, by driver.
    messages: HashMap<String, usize>,
}

/// The health the kubelet knows. Cloning shares it.
#[derive(Debug, Clone)]
pub struct HealthCache {
    state: Arc<Mutex<State>>,
    changes: watch::Sender<u64>,
}

impl Default for HealthCache {
    fn default() -> Self {
        HealthCache {
            state: Arc::default(),
            changes: watch::channel(0).0,
        }
    }
}

impl HealthCache {
    /// The health of `pool`/`device` of `driver` as the kubelet reads it now.
    pub fn device(&self, driver: &str, pool: &str, device: &str) -> DeviceHealthView {
        let state = lock(&self.state);
        let entry = state
            .devices
            .get(driver)
            .and_then(|d| d.get(&format!("{pool}/{device}")))
            .filter(|e| e.received.elapsed() <= e.timeout);
        entry.map_or(
            DeviceHealthView {
                health: HealthStatus::Unknown,
                message: String::new(),
            },
            |e| DeviceHealthView {
                health: e.health,
                message: e.message.clone(),
            },
        )
    }

    /// The plugin's `last_updated_time` of the device's latest entry, if any.
    pub fn last_updated_time(&self, driver: &str, pool: &str, device: &str) -> Option<i64> {
        lock(&self.state)
            .devices
            .get(driver)
            .and_then(|d| d.get(&format!("{pool}/{device}")))
            .map(|e| e.last_updated_time)
    }

    /// How many devices of `driver` have an entry.
    pub fn device_count(&self, driver: &str) -> usize {
        lock(&self.state)
            .devices
            .get(driver)
            .map_or(0, HashMap::len)
    }

    /// How many health streams were opened to `driver`'s plugins.
    pub fn streams(&self, driver: &str) -> usize {
        lock(&self.state).streams.get(driver).copied().unwrap_or(0)
    }

    /// How many messages `driver`'s plugins sent.
    pub fn messages(&self, driver: &str) -> usize {
        lock(&self.state).messages.get(driver).copied().unwrap_or(0)
    }

    /// Waits until `condition` holds for the cache, checking after every change.
    ///
    /// # Errors
    /// The condition did not hold within `timeout`.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        mut condition: impl FnMut(&HealthCache) -> bool,
    ) -> Result<(), String> {
        let mut changes = self.changes.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if condition(self) {
                return Ok(());
            }
            // Staleness turns entries Unknown without a message, so look at least every 100 ms.
            let tick = tokio::time::sleep(Duration::from_millis(100));
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {
                    return Err(format!("health condition not met within {timeout:?}"));
                }
                _ = changes.changed() => {}
                () = tick => {}
            }
        }
    }

    fn opened(&self, driver: &str) {
        *lock(&self.state)
            .streams
            .entry(driver.to_owned())
            .or_default() += 1;
        self.changes.send_modify(|n| *n += 1);
    }

    fn update(
        &self,
        driver: &str,
        message: &kerf_proto::health::v1alpha1::NodeWatchResourcesResponse,
    ) {
        let now = Instant::now();
        let mut state = lock(&self.state);
        *state.messages.entry(driver.to_owned()).or_default() += 1;
        let devices = state.devices.entry(driver.to_owned()).or_default();
        for device in &message.devices {
            let id = device.device.clone().unwrap_or_default();
            let timeout = u64::try_from(device.health_check_timeout_seconds)
                .ok()
                .filter(|s| *s > 0)
                .map_or(DEFAULT_TIMEOUT, Duration::from_secs);
            devices.insert(
                format!("{}/{}", id.pool_name, id.device_name),
                Entry {
                    health: device.health(),
                    message: device.message.clone(),
                    timeout,
                    received: now,
                    last_updated_time: device.last_updated_time,
                },
            );
        }
        drop(state);
        self.changes.send_modify(|n| *n += 1);
    }

    fn clear(&self, driver: &str) {
        lock(&self.state).devices.remove(driver);
        self.changes.send_modify(|n| *n += 1);
    }
}

/// Watches the health of `plugin` until it is deregistered (the fake kubelet drops it).
pub(super) async fn watch(
    plugin: Arc<RegisteredPlugin>,
    driver: String,
    cache: HealthCache,
    retry: Duration,
) {
    let plugin: Weak<RegisteredPlugin> = Arc::downgrade(&plugin);
    loop {
        let Some(current) = plugin.upgrade() else {
            return;
        };
        if let Ok(mut stream) = current.watch_health().await {
            drop(current);
            cache.opened(&driver);
            while let Ok(Some(message)) = stream.next().await {
                cache.update(&driver, &message);
            }
            cache.clear(&driver);
        } else {
            drop(current);
        }
        tokio::time::sleep(retry).await;
    }
}
