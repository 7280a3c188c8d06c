//! `v1alpha1.DRAResourceHealth/NodeWatchResources`: the health of every published device,
//! streamed to the kubelet.
//!
//! The kubelet (upstream `pkg/kubelet/cm/dra/manager.go`, `HandleWatchResourcesStream`)
//! opens the stream when the plugin registers and opens it again 5 s after it ends
//! (`pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`, `add`); it stamps each device it
//! receives with its own receipt time and shows a device Unknown once that is older than the
//! device's `health_check_timeout_seconds` (default 30 s, `pkg/kubelet/cm/dra/healthinfo.go`,
//! `DefaultHealthTimeout`, `getHealthInfo`). So each response is the complete list, sent at
//! stream start, on every change, and again every resend interval (a third of the timeout)
//! even when nothing changed.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use kerf_core::health::{DeviceHealth, HealthStatus, NodeHealth};
use kerf_core::inventory::Inventory;
use kerf_proto::health::v1alpha1 as pb;
use kerf_proto::health::v1alpha1::dra_resource_health_server::{
    DraResourceHealth, DraResourceHealthServer,
};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// Longest `message` the kubelet accepts (`DeviceHealth.message`, 1.36).
const MAX_MESSAGE_CHARS: usize = 1024;

/// Serves the health stream of one node's published devices.
#[derive(Debug, Clone)]
pub(crate) struct HealthService {
    health: watch::Receiver<NodeHealth>,
    inventory: Arc<Inventory>,
    pool: String,
    check_timeout: Duration,
    resend_interval: Duration,
    shutdown: CancellationToken,
}

impl HealthService {
    /// Streams `health` of `inventory`'s devices in pool `pool` (the node name); streams end
    /// at `shutdown` so the server can stop and the kubelet reconnects to the next plugin.
    pub fn new(
        health: watch::Receiver<NodeHealth>,
        inventory: Arc<Inventory>,
        pool: String,
        check_timeout: Duration,
        resend_interval: Duration,
        shutdown: CancellationToken,
    ) -> Self {
        HealthService {
            health,
            inventory,
            pool,
            check_timeout,
            resend_interval,
            shutdown,
        }
    }

    /// The service for a tonic server.
    pub fn server(self) -> DraResourceHealthServer<Self> {
        DraResourceHealthServer::new(self)
    }

    fn response_now(&self, health: &NodeHealth) -> pb::NodeWatchResourcesResponse {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        let timeout = i64::try_from(self.check_timeout.as_secs()).unwrap_or(i64::MAX);
        response(&self.pool, &health.devices(&self.inventory), now, timeout)
    }
}

/// One complete response: every device of `devices` in pool `pool`, stamped `now` (Unix
/// seconds) with `timeout_seconds`.
pub fn response(
    pool: &str,
    devices: &[DeviceHealth],
    now: i64,
    timeout_seconds: i64,
) -> pb::NodeWatchResourcesResponse {
    pb::NodeWatchResourcesResponse {
        devices: devices
            .iter()
            .map(|device| pb::DeviceHealth {
                device: Some(pb::DeviceIdentifier {
                    pool_name: pool.to_owned(),
                    device_name: device.device.clone(),
                }),
                health: match device.status {
                    HealthStatus::Healthy => pb::HealthStatus::Healthy,
                    HealthStatus::Unhealthy => pb::HealthStatus::Unhealthy,
                    HealthStatus::Unknown => pb::HealthStatus::Unknown,
                }
                .into(),
                last_updated_time: now,
                health_check_timeout_seconds: timeout_seconds,
                message: truncate_message(&device.message()),
            })
            .collect(),
    }
}

/// `message` cut to [`MAX_MESSAGE_CHARS`] characters: longer ones keep their first 1021
/// characters and end in `...`.
fn truncate_message(message: &str) -> String {
    if message.chars().count() <= MAX_MESSAGE_CHARS {
        return message.to_owned();
    }
    let mut cut: String = message.chars().take(MAX_MESSAGE_CHARS - 3).collect();
    cut.push_str("...");
    cut
}

type HealthStream =
    Pin<Box<dyn Stream<Item = Result<pb::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _request: Request<pb::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        tracing::debug!("kubelet opened the health stream");
        let (sender, receiver) = mpsc::channel(4);
        let service = self.clone();
        tokio::spawn(async move { service.stream_to(sender).await });
        let stream = tokio_stream::wrappers::ReceiverStream::new(receiver);
        Ok(Response::new(Box::pin(stream)))
    }
}

impl HealthService {
    /// Sends the full list now, on every change and every resend interval, until the
    /// kubelet goes away or the plugin stops.
    async fn stream_to(
        mut self,
        sender: mpsc::Sender<Result<pb::NodeWatchResourcesResponse, Status>>,
    ) {
        let mut ticks = tokio::time::interval(self.resend_interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut health_open = true;
        loop {
            let current = self.health.borrow_and_update().clone();
            if sender.send(Ok(self.response_now(&current))).await.is_err() {
                tracing::debug!("kubelet closed the health stream");
                return;
            }
            ticks.reset();
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                () = sender.closed() => return,
                _ = ticks.tick() => {}
                changed = self.health.changed(), if health_open => {
                    // Without a monitor the list only repeats, so the stream stays useful.
                    health_open = changed.is_ok();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kerf_core::health::Fault;

    use super::*;

    #[test]
    fn messages_are_cut_to_the_kubelets_limit() {
        assert_eq!(truncate_message("XID 79"), "XID 79");
        let exact = "x".repeat(MAX_MESSAGE_CHARS);
        assert_eq!(truncate_message(&exact), exact);
        let long = "é".repeat(MAX_MESSAGE_CHARS + 1);
        let cut = truncate_message(&long);
        assert_eq!(cut.chars().count(), MAX_MESSAGE_CHARS);
        assert!(cut.ends_with("..."));
        assert_eq!(cut.chars().filter(|c| *c == 'é').count(), 1021);
    }

    #[test]
    fn a_response_lists_every_device_with_its_health() {
        let devices = [
            DeviceHealth::of("gpu-0".into(), "GPU-0".into(), vec![]),
            DeviceHealth::of("gpu-1".into(), "GPU-1".into(), vec![Fault::GpuLost]),
            DeviceHealth::of(
                "gpu-2".into(),
                "GPU-2".into(),
                vec![Fault::Unmonitored {
                    reason: "no events".into(),
                }],
            ),
        ];
        let answer = response("node-a", &devices, 1_700_000_000, 30);
        let seen: Vec<_> = answer
            .devices
            .iter()
            .map(|d| {
                let id = d.device.clone().unwrap_or_default();
                (
                    id.pool_name,
                    id.device_name,
                    d.health(),
                    d.last_updated_time,
                    d.health_check_timeout_seconds,
                    d.message.clone(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                (
                    "node-a".to_owned(),
                    "gpu-0".to_owned(),
                    pb::HealthStatus::Healthy,
                    1_700_000_000,
                    30,
                    String::new()
                ),
                (
                    "node-a".to_owned(),
                    "gpu-1".to_owned(),
                    pb::HealthStatus::Unhealthy,
                    1_700_000_000,
                    30,
                    "GPU lost (fallen off the bus or not answering)".to_owned()
                ),
                (
                    "node-a".to_owned(),
                    "gpu-2".to_owned(),
                    pb::HealthStatus::Unknown,
                    1_700_000_000,
                    30,
                    "health not observable: no events".to_owned()
                ),
            ]
        );
    }
}
