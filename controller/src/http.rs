//! What the controller's HTTP endpoint (`/healthz`, `/readyz`, `/metrics`, served by
//! [`kerf_ops::http::serve`]) reports on `/readyz`.
//!
//! `/readyz` answers 200 once this replica takes part in the election (or runs without one),
//! as leader or standby: a standby that reported not-ready would block rolling updates of the
//! Deployment without making anything safer. The body says which role the replica has. A
//! replica that runs the admission webhook is ready only while the webhook serves: the
//! webhook Service sends reviews to ready replicas, and kube-apiserver refuses a claim with a
//! kerf config whose review finds no answer (`failurePolicy: Fail`).

use kerf_ops::ready::{ReadyFlag, ReadyFlags};

/// What `/readyz` says while the webhook of a replica that runs one does not serve.
const WEBHOOK_NOT_SERVING: &str = "the admission webhook is not serving";

/// What `/readyz` says until the replica takes part in the election.
const ELECTION_NOT_STARTED: &str = "leader election has not started (is the Lease reachable?)";

/// The flags of a controller replica: the election sets `started` once it takes part (or
/// at once without an election) and `leader` while it leads; `webhook_serving` is the
/// webhook's, when the replica runs it.
#[must_use]
pub fn ready_flags(
    started: &ReadyFlag,
    leader: &ReadyFlag,
    webhook_serving: Option<&ReadyFlag>,
) -> ReadyFlags {
    let flags = match webhook_serving {
        Some(serving) => ReadyFlags::new().require(serving, WEBHOOK_NOT_SERVING),
        None => ReadyFlags::new(),
    };
    flags
        .require(started, ELECTION_NOT_STARTED)
        .with_role(leader, "leader", "standby")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use prometheus_client::registry::Registry;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::metrics::Metrics;

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
    async fn endpoints_report_readiness_role_and_metrics() {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        let (started, leader) = (ReadyFlag::new(), ReadyFlag::new());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(kerf_ops::http::serve(
            listener,
            Arc::new(registry),
            ready_flags(&started, &leader, None),
            shutdown.clone(),
        ));

        assert_eq!(get(addr, "/healthz").await, (200, "ok\n".to_owned()));
        assert_eq!(
            get(addr, "/readyz").await,
            (503, format!("not ready: {ELECTION_NOT_STARTED}\n"))
        );
        started.set(true);
        assert_eq!(
            get(addr, "/readyz").await,
            (200, "ok: standby\n".to_owned())
        );
        leader.set(true);
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
        let (started, leader, serving) = (ReadyFlag::new(), ReadyFlag::new(), ReadyFlag::new());
        let flags = ready_flags(&started, &leader, Some(&serving));
        started.set(true);
        assert_eq!(flags.readiness(), Err(WEBHOOK_NOT_SERVING.to_owned()));
        serving.set(true);
        assert_eq!(flags.readiness(), Ok("ok: standby".to_owned()));
        serving.set(false);
        assert!(!flags.is_ready());
    }

    #[test]
    fn a_replica_without_a_webhook_needs_only_the_election() {
        let (started, leader) = (ReadyFlag::new(), ReadyFlag::new());
        let flags = ready_flags(&started, &leader, None);
        assert!(!flags.is_ready());
        started.set(true);
        assert!(flags.is_ready());
    }
}
