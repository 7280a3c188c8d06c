//! The controller's HTTP endpoint (`/healthz`, `/readyz`, `/metrics`, served by
//! [`kerf_ops::http`]).
//!
//! `/readyz` answers 200 once this replica takes part in the election (or runs without one),
//! as leader or standby: a standby that reported not-ready would block rolling updates of the
//! Deployment without making anything safer. The body says which role the replica has. A
//! replica that runs the admission webhook is ready only while the webhook serves: the
//! webhook Service sends reviews to ready replicas, and kube-apiserver refuses a claim with a
//! kerf config whose review finds no answer (`failurePolicy: Fail`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

pub use kerf_ops::http::{OPENMETRICS_CONTENT_TYPE, router};

use crate::error::{Error, Result};

/// Readiness state shared between the election and the HTTP endpoint. Clones share state.
#[derive(Clone, Debug, Default)]
pub struct Health {
    started: Arc<AtomicBool>,
    leader: Arc<AtomicBool>,
    /// Set when this replica runs the webhook: whether it serves now.
    webhook: Option<Arc<AtomicBool>>,
}

impl Health {
    /// Not started, not leader.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that the replica takes part in the election (the Lease was reachable).
    pub fn set_started(&self, started: bool) {
        self.started.store(started, Ordering::Release);
    }

    /// Records whether the replica leads.
    pub fn set_leader(&self, leader: bool) {
        self.leader.store(leader, Ordering::Release);
    }

    /// This replica runs the admission webhook, which sets `serving` while it serves.
    #[must_use]
    pub fn with_webhook(mut self, serving: Arc<AtomicBool>) -> Self {
        self.webhook = Some(serving);
        self
    }

    /// Whether the replica is ready.
    pub fn is_ready(&self) -> bool {
        self.started.load(Ordering::Acquire) && self.webhook_serving()
    }

    /// Whether the webhook serves, or the replica runs none.
    fn webhook_serving(&self) -> bool {
        self.webhook
            .as_ref()
            .is_none_or(|serving| serving.load(Ordering::Acquire))
    }

    /// Whether the replica leads.
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::Acquire)
    }
}

impl kerf_ops::http::Readiness for Health {
    fn readiness(&self) -> Result<String, String> {
        if !self.webhook_serving() {
            return Err("the admission webhook is not serving".to_owned());
        }
        match (self.is_ready(), self.is_leader()) {
            (true, true) => Ok("ok: leader".to_owned()),
            (true, false) => Ok("ok: standby".to_owned()),
            (false, _) => {
                Err("leader election has not started (is the Lease reachable?)".to_owned())
            }
        }
    }
}

/// Serves the routes on `listener` until `shutdown` is cancelled.
///
/// # Errors
///
/// [`Error::Http`] when the server fails to accept connections.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    health: Health,
    shutdown: CancellationToken,
) -> Result<()> {
    kerf_ops::http::serve(listener, registry, health, shutdown)
        .await
        .map_err(Error::Http)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut raw = String::new();
        stream.read_to_string(&mut raw).await.unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        (
            head.split(' ').nth(1).unwrap().parse().unwrap(),
            body.to_owned(),
        )
    }

    #[tokio::test]
    async fn endpoints_report_health_role_and_metrics() {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        let health = Health::new();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(serve(
            listener,
            Arc::new(registry),
            health.clone(),
            shutdown.clone(),
        ));

        assert_eq!(get(addr, "/healthz").await, (200, "ok\n".to_owned()));
        assert_eq!(get(addr, "/readyz").await.0, 503);
        health.set_started(true);
        assert_eq!(
            get(addr, "/readyz").await,
            (200, "ok: standby\n".to_owned())
        );
        health.set_leader(true);
        metrics.set_leader(true);
        assert_eq!(get(addr, "/readyz").await, (200, "ok: leader\n".to_owned()));
        let (status, body) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        assert!(body.contains("kerf_controller_leader 1"), "{body}");
        assert_eq!(get(addr, "/nope").await.0, 404);

        shutdown.cancel();
        task.await.unwrap().unwrap();
    }

    #[test]
    fn a_replica_with_a_webhook_is_ready_only_while_it_serves() {
        use kerf_ops::http::Readiness as _;
        let serving = Arc::new(AtomicBool::new(false));
        let health = Health::new().with_webhook(Arc::clone(&serving));
        health.set_started(true);
        assert_eq!(
            health.readiness(),
            Err("the admission webhook is not serving".to_owned())
        );
        serving.store(true, Ordering::Release);
        assert_eq!(health.readiness(), Ok("ok: standby".to_owned()));
        serving.store(false, Ordering::Release);
        assert!(!health.is_ready());
    }
}
