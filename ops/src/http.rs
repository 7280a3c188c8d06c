//! The HTTP endpoint of kerf's binaries: `/healthz`, `/readyz` and `/metrics`.
//!
//! - `/healthz` answers 200 for as long as the process serves HTTP: liveness only says the
//!   process is not wedged.
//! - `/readyz` answers what the binary's [`ReadyFlags`] say: 200 with a short status, or 503
//!   with what is missing, so `kubectl describe` tells an operator which part is broken.
//! - `/metrics` is the OpenMetrics text of the registry.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::ready::ReadyFlags;

/// Content type of the OpenMetrics text exposition format.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone)]
struct AppState {
    registry: Arc<Registry>,
    ready: ReadyFlags,
}

/// The HTTP routes, without a listener (separate so tests and embedders can mount them).
fn router(registry: Arc<Registry>, ready: ReadyFlags) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(AppState { registry, ready })
}

/// Serves the routes on `listener` until `shutdown` is cancelled, then finishes in-flight
/// requests and returns.
///
/// # Errors
/// The server fails to accept connections.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    ready: ReadyFlags,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving /healthz, /readyz and /metrics");
    }
    axum::serve(listener, router(registry, ready))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<AppState>) -> Response {
    match state.ready.readiness() {
        Ok(status) => (StatusCode::OK, format!("{status}\n")).into_response(),
        Err(missing) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {missing}\n"),
        )
            .into_response(),
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)], body).into_response(),
        Err(err) => {
            tracing::error!(error = %err, "encoding metrics failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "encoding metrics failed\n",
            )
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ready::ReadyFlag;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt as _;
    use prometheus_client::metrics::counter::Counter;
    use tower::ServiceExt as _;

    async fn get(router: Router, path: &str) -> (StatusCode, String, Option<String>) {
        let response = router
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            String::from_utf8(body.to_vec()).unwrap(),
            content_type,
        )
    }

    #[tokio::test]
    async fn readiness_follows_the_binary_and_metrics_are_openmetrics() {
        let mut registry = Registry::default();
        let counter = Counter::<u64>::default();
        registry.register("things", "Things", counter.clone());
        counter.inc();
        let flag = ReadyFlag::new();
        let router = router(
            Arc::new(registry),
            ReadyFlags::new().require(&flag, "flag is down"),
        );
        assert_eq!(get(router.clone(), "/healthz").await.0, StatusCode::OK);
        let (status, body, _) = get(router.clone(), "/readyz").await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, "not ready: flag is down\n")
        );
        flag.set(true);
        assert_eq!(get(router.clone(), "/readyz").await.0, StatusCode::OK);
        let (status, body, content_type) = get(router, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("things_total 1"), "{body}");
        assert_eq!(content_type.as_deref(), Some(OPENMETRICS_CONTENT_TYPE));
    }
}
