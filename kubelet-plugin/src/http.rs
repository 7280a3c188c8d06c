//! The plugin's HTTP endpoint (`/healthz`, `/readyz`, `/metrics`, served by [`kerf_ops::http`]).
//!
//! `/readyz` answers 200 only when the DRA gRPC server is serving and the kubelet has
//! registered the plugin; otherwise 503 with what is missing, so `kubectl describe` tells an
//! operator which half is broken.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

pub use kerf_ops::http::OPENMETRICS_CONTENT_TYPE;

use crate::{Error, Result};

/// Readiness state shared between the gRPC servers and the HTTP endpoint.
///
/// Clones share the same flags.
#[derive(Clone, Debug, Default)]
pub struct Health {
    registered: Arc<AtomicBool>,
    serving: Arc<AtomicBool>,
}

impl Health {
    /// A state that is not ready: not registered and not serving.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records whether the kubelet has registered the plugin (its last `NotifyRegistrationStatus`).
    pub fn set_registered(&self, registered: bool) {
        self.registered.store(registered, Ordering::Release);
    }

    /// Records whether the DRA gRPC server is serving.
    pub fn set_serving(&self, serving: bool) {
        self.serving.store(serving, Ordering::Release);
    }

    /// Whether the kubelet has registered the plugin.
    pub fn is_registered(&self) -> bool {
        self.registered.load(Ordering::Acquire)
    }

    /// Whether the DRA gRPC server is serving.
    pub fn is_serving(&self) -> bool {
        self.serving.load(Ordering::Acquire)
    }

    /// Ready means the kubelet can call the plugin: serving and registered.
    pub fn is_ready(&self) -> bool {
        self.is_serving() && self.is_registered()
    }
}

impl kerf_ops::http::Readiness for Health {
    fn readiness(&self) -> Result<String, String> {
        let mut missing = Vec::new();
        if !self.is_serving() {
            missing.push("DRA gRPC server is not serving");
        }
        if !self.is_registered() {
            missing.push("kubelet has not registered the plugin");
        }
        if missing.is_empty() {
            Ok("ok".to_owned())
        } else {
            Err(missing.join("; "))
        }
    }
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `listener` until `shutdown` is cancelled, then
/// finishes in-flight requests and returns.
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

    struct Reply {
        status: u16,
        headers: String,
        body: String,
    }

    /// A minimal HTTP/1.1 client: the server is local, so one request per connection is enough.
    async fn get(addr: std::net::SocketAddr, path: &str) -> Reply {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut raw = String::new();
        stream.read_to_string(&mut raw).await.unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        Reply {
            status,
            headers: head.to_ascii_lowercase(),
            body: body.to_owned(),
        }
    }

    async fn start() -> (
        std::net::SocketAddr,
        Health,
        Metrics,
        CancellationToken,
        tokio::task::JoinHandle<Result<()>>,
    ) {
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
        (addr, health, metrics, shutdown, task)
    }

    #[tokio::test]
    async fn healthz_is_ok_even_when_not_ready() {
        let (addr, _health, _metrics, shutdown, task) = start().await;
        let reply = get(addr, "/healthz").await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.body, "ok\n");
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn readyz_needs_serving_and_registration() {
        let (addr, health, _metrics, shutdown, task) = start().await;

        let reply = get(addr, "/readyz").await;
        assert_eq!(reply.status, 503);
        assert!(reply.body.contains("not serving"), "{}", reply.body);
        assert!(reply.body.contains("not registered"), "{}", reply.body);

        health.set_serving(true);
        let reply = get(addr, "/readyz").await;
        assert_eq!(reply.status, 503);
        assert!(!reply.body.contains("not serving"), "{}", reply.body);
        assert!(reply.body.contains("not registered"), "{}", reply.body);

        health.set_registered(true);
        let reply = get(addr, "/readyz").await;
        assert_eq!(reply.status, 200);
        assert!(health.is_ready());

        health.set_serving(false);
        assert_eq!(get(addr, "/readyz").await.status, 503);

        shutdown.cancel();
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn metrics_are_openmetrics_text() {
        let (addr, _health, metrics, shutdown, task) = start().await;
        metrics.set_prepared_claims(2);
        let reply = get(addr, "/metrics").await;
        assert_eq!(reply.status, 200);
        assert!(
            reply
                .headers
                .contains(&format!("content-type: {OPENMETRICS_CONTENT_TYPE}")),
            "{}",
            reply.headers
        );
        assert!(
            reply.body.contains("kerf_plugin_prepared_claims 2"),
            "{}",
            reply.body
        );
        assert!(reply.body.trim_end().ends_with("# EOF"), "{}", reply.body);
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn unknown_paths_are_404() {
        let (addr, _health, _metrics, shutdown, task) = start().await;
        assert_eq!(get(addr, "/nope").await.status, 404);
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }
}
