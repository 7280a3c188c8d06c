//! The HTTPS server: TLS through rustls with a swappable certificate, HTTP/1.1 through hyper,
//! one AdmissionReview per POST.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use super::decide::ClaimLookup;
use super::review::{self, ClaimOutcome, Outcome};
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// Largest request body read; the API server's own request limit is 3 MiB.
const MAX_BODY: usize = 4 << 20;
/// How long a client may take for the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves AdmissionReviews on `listener` with `tls` until `shutdown` is cancelled; pod reviews
/// read `lookup`, claim reviews check the configs of `driver`, and all are counted in
/// `metrics`. Connections in flight are dropped at shutdown.
///
/// # Errors
///
/// [`Error::Webhook`] when accepting connections fails for good.
pub async fn serve<L>(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    lookup: Arc<L>,
    driver: Arc<str>,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Result<()>
where
    L: ClaimLookup + Send + Sync + 'static,
{
    let acceptor = TlsAcceptor::from(tls);
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        while connections.try_join_next().is_some() {}
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) if is_transient(&error) => {
                tracing::warn!(%error, "webhook: accept failed; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            Err(error) => return Err(Error::Webhook(error)),
        };
        let (acceptor, lookup, metrics) = (acceptor.clone(), lookup.clone(), metrics.clone());
        let driver = driver.clone();
        connections.spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(error)) => {
                    tracing::debug!(%peer, %error, "webhook: TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "webhook: TLS handshake timed out");
                    return;
                }
            };
            let service = service_fn(move |request| {
                let (lookup, driver, metrics) = (lookup.clone(), driver.clone(), metrics.clone());
                async move {
                    Ok::<_, Infallible>(answer(request, (&*lookup, &driver), &metrics).await)
                }
            });
            if let Err(error) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tls), service)
                .await
            {
                tracing::debug!(%peer, %error, "webhook: connection ended with an error");
            }
        });
    }
    connections.shutdown().await;
    Ok(())
}

fn is_transient(error: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionReset, Interrupted, WouldBlock};
    matches!(
        error.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock
    ) || error
        .raw_os_error()
        .is_some_and(|code| code == 24 || code == 23) // EMFILE, ENFILE
}

async fn answer(
    request: Request<Incoming>,
    (lookup, driver): (&impl ClaimLookup, &str),
    metrics: &Metrics,
) -> Response<Full<Bytes>> {
    if request.method() != Method::POST {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "POST an AdmissionReview\n");
    }
    let body = match Limited::new(request.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(error) => {
            metrics.record_admission("error");
            return plain(
                StatusCode::BAD_REQUEST,
                &format!("cannot read the request body: {error}\n"),
            );
        }
    };
    let answer = review::handle(&body, lookup, driver);
    match &answer.outcome {
        Outcome::Claim(resource, outcome) => {
            metrics.record_claim_admission(resource.label(), outcome.label());
            match outcome {
                ClaimOutcome::Error(message) => {
                    tracing::warn!(%message, "webhook: claim review not handled");
                }
                // The user reads the denial in the API server's answer; the log says which.
                ClaimOutcome::Denied(message) => {
                    tracing::info!(%message, resource = resource.label(), "webhook: denied");
                }
                outcome => tracing::debug!(?outcome, "webhook: reviewed a claim"),
            }
        }
        Outcome::Error(message) => {
            metrics.record_admission(answer.outcome.label());
            tracing::warn!(%message, "webhook: review not handled");
        }
        outcome => {
            metrics.record_admission(outcome.label());
            tracing::debug!(?outcome, "webhook: reviewed a pod");
        }
    }
    let mut response = Response::new(Full::new(Bytes::from(answer.body)));
    *response.status_mut() =
        StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

fn plain(status: StatusCode, text: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(text.to_owned())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
