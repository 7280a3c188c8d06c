//! What the plugin's HTTP endpoint (`/healthz`, `/readyz`, `/metrics`, served by
//! [`kerf_ops::http::serve`]) reports on `/readyz`.
//!
//! `/readyz` answers 200 only when the DRA gRPC server is serving and the kubelet has
//! registered the plugin; otherwise 503 with what is missing, so `kubectl describe` tells an
//! operator which half is broken.

use kerf_ops::ready::{ReadyFlag, ReadyFlags};

/// The flags of the plugin: the DRA gRPC server raises `serving` once it serves, and the
/// registration service sets `registered` from the kubelet's last `NotifyRegistrationStatus`.
#[must_use]
pub(crate) fn ready_flags(serving: &ReadyFlag, registered: &ReadyFlag) -> ReadyFlags {
    ReadyFlags::new()
        .require(serving, "DRA gRPC server is not serving")
        .require(registered, "kubelet has not registered the plugin")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kerf_ops::http::OPENMETRICS_CONTENT_TYPE;
    use prometheus_client::registry::Registry;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::metrics::Metrics;

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

    /// The flags `/readyz` reads: `serving`, then `registered`.
    struct Flags {
        serving: ReadyFlag,
        registered: ReadyFlag,
        all: ReadyFlags,
    }

    async fn start() -> (
        std::net::SocketAddr,
        Flags,
        Metrics,
        CancellationToken,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ) {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        let (serving, registered) = (ReadyFlag::new(), ReadyFlag::new());
        let all = ready_flags(&serving, &registered);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(kerf_ops::http::serve(
            listener,
            Arc::new(registry),
            all.clone(),
            shutdown.clone(),
        ));
        let flags = Flags {
            serving,
            registered,
            all,
        };
        (addr, flags, metrics, shutdown, task)
    }

    #[tokio::test]
    async fn healthz_is_ok_even_when_not_ready() {
        let (addr, _flags, _metrics, shutdown, task) = start().await;
        let reply = get(addr, "/healthz").await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.body, "ok\n");
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn readyz_needs_serving_and_registration() {
        let (addr, flags, _metrics, shutdown, task) = start().await;

        let reply = get(addr, "/readyz").await;
        assert_eq!(reply.status, 503);
        assert!(reply.body.contains("not serving"), "{}", reply.body);
        assert!(reply.body.contains("not registered"), "{}", reply.body);

        flags.serving.set(true);
        let reply = get(addr, "/readyz").await;
        assert_eq!(reply.status, 503);
        assert!(!reply.body.contains("not serving"), "{}", reply.body);
        assert!(reply.body.contains("not registered"), "{}", reply.body);

        flags.registered.set(true);
        let reply = get(addr, "/readyz").await;
        assert_eq!(reply.status, 200);
        assert!(flags.all.is_ready());

        flags.serving.set(false);
        assert_eq!(get(addr, "/readyz").await.status, 503);

        shutdown.cancel();
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn metrics_are_openmetrics_text() {
        let (addr, _flags, metrics, shutdown, task) = start().await;
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
        let (addr, _flags, _metrics, shutdown, task) = start().await;
        assert_eq!(get(addr, "/nope").await.status, 404);
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }
}
