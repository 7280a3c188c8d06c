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
use super::outcome::{Answer, ClaimDecision, Outcome, QuotaDecision, Review};
use super::quota::{QUOTA_PATH, QuotaAdmission};
use super::review;
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// Largest request body read; the API server's own request limit is 3 MiB.
const MAX_BODY: usize = 4 << 20;
/// How long a client may take for the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the server answers reviews with.
pub struct Reviewers<L> {
    /// What pod reviews read.
    pub lookup: Arc<L>,
    /// The driver whose claim configs are checked.
    pub driver: Arc<str>,
    /// Reviews sent to [`QUOTA_PATH`].
    pub quota: Arc<QuotaAdmission>,
}

impl<L> Clone for Reviewers<L> {
    fn clone(&self) -> Self {
        Self {
            lookup: self.lookup.clone(),
            driver: self.driver.clone(),
            quota: self.quota.clone(),
        }
    }
}

/// Serves AdmissionReviews on `listener` with `tls` until `shutdown` is cancelled: reviews
/// sent to [`QUOTA_PATH`] are checked against GpuQuotas, the others are routed by resource
/// (pod reviews read `reviewers.lookup`, claim reviews check the configs of
/// `reviewers.driver`); all are counted in `metrics`. Connections in flight are dropped at
/// shutdown.
///
/// # Errors
///
/// [`Error::Webhook`] when accepting connections fails for good.
pub async fn serve<L>(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    reviewers: Reviewers<L>,
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
        let (acceptor, reviewers, metrics) = (acceptor.clone(), reviewers.clone(), metrics.clone());
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
                let (reviewers, metrics) = (reviewers.clone(), metrics.clone());
                async move { Ok::<_, Infallible>(answer(request, &reviewers, &metrics).await) }
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

async fn answer<L: ClaimLookup>(
    request: Request<Incoming>,
    reviewers: &Reviewers<L>,
    metrics: &Metrics,
) -> Response<Full<Bytes>> {
    if request.method() != Method::POST {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "POST an AdmissionReview\n");
    }
    let quota = request.uri().path() == QUOTA_PATH;
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
    let answer = if quota {
        reviewers.quota.handle(&body).await
    } else {
        review::handle(&body, &*reviewers.lookup, &reviewers.driver)
    };
    record(&answer, metrics);
    let mut response = Response::new(Full::new(Bytes::from(answer.body)));
    *response.status_mut() =
        StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

/// The label of a review the webhook did not handle, in every admission metric.
const NOT_HANDLED: &str = "error";

/// Counts and logs how a review ended.
fn record(answer: &Answer, metrics: &Metrics) {
    match &answer.outcome {
        Outcome::Quota(decision) => {
            metrics.record_quota_admission(decision.label());
            if let QuotaDecision::Denied(message) = decision {
                tracing::info!(%message, "webhook: claim refused by quota");
            } else {
                tracing::debug!(?decision, "webhook: claim charged");
            }
        }
        Outcome::Claim(resource, decision) => {
            metrics.record_claim_admission(resource.label(), decision.label());
            // The user reads the denial in the API server's answer; the log says which.
            if let ClaimDecision::Invalid { field, message } = decision {
                tracing::info!(message = %format!("{field}: {message}"), resource = resource.label(), "webhook: denied");
            } else {
                tracing::debug!(?decision, "webhook: reviewed a claim");
            }
        }
        Outcome::Pod(decision) => {
            metrics.record_admission(decision.label());
            tracing::debug!(?decision, "webhook: reviewed a pod");
        }
        Outcome::NotHandled(review, message) => {
            match review {
                Review::Quota => metrics.record_quota_admission(NOT_HANDLED),
                Review::Claim(resource) => {
                    metrics.record_claim_admission(resource.label(), NOT_HANDLED);
                }
                Review::Pod => metrics.record_admission(NOT_HANDLED),
            }
            tracing::warn!(%message, ?review, "webhook: review not handled");
        }
        Outcome::BadRequest(message) => {
            metrics.record_admission(NOT_HANDLED);
            tracing::warn!(%message, "webhook: review not handled");
        }
    }
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
