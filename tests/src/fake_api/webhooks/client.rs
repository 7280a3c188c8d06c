//! The HTTPS call to one webhook, as kube-apiserver's webhook client makes it
//! (kubernetes/kubernetes `staging/src/k8s.io/apiserver/pkg/util/webhook/client.go`,
//! `ClientManager.HookClient`): a service reference is dialled as
//! `https://<service>.<namespace>.svc:<port><path>` and its certificate verified for the server
//! name `<service>.<namespace>.svc` against `clientConfig.caBundle`; a `url` is dialled as
//! written. The request is a POST of the AdmissionReview with `?timeout=<n>s`, as the dispatcher's
//! `r.Timeout` adds it (`validating/dispatcher.go`, `callHook`).
//!
//! Where a Service's pods are is known to the fake only through
//! [`FakeApi::serve_webhook_service`](super::super::FakeApi::serve_webhook_service): the
//! Service's `port` is kept in the URL (and the messages) but the connection goes to the address
//! given there.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, header};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::admissionregistration::v1::WebhookClientConfig;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;

/// Where a webhook is served and how to trust it.
#[derive(Debug, Clone)]
pub(super) struct Endpoint {
    /// The URL kube-apiserver would post to, without the timeout parameter.
    url: String,
    /// The name the server's certificate must be valid for.
    server_name: String,
    /// `host:port` to dial, or the Service (`namespace`, `name`) whose address the test gave.
    dial: Dial,
    /// `path[?query]` of the request.
    path: String,
    /// `clientConfig.caBundle`: PEM certificates.
    ca_bundle: Vec<u8>,
}

#[derive(Debug, Clone)]
enum Dial {
    Service(String, String),
    HostPort(String),
}

impl Endpoint {
    /// The endpoint of `config`.
    ///
    /// # Errors
    ///
    /// The configuration names neither a service nor a URL, or its URL is not `https://`.
    pub(super) fn of(config: &WebhookClientConfig) -> Result<Self, String> {
        let ca_bundle = config
            .ca_bundle
            .as_ref()
            .map(|b| b.0.clone())
            .unwrap_or_default();
        if let Some(service) = &config.service {
            let host = format!("{}.{}.svc", service.name, service.namespace);
            let port = service.port.unwrap_or(443);
            let path = service.path.clone().unwrap_or_default();
            return Ok(Self {
                url: format!("https://{host}:{port}{path}"),
                server_name: host,
                dial: Dial::Service(service.namespace.clone(), service.name.clone()),
                path: if path.is_empty() {
                    "/".to_owned()
                } else {
                    path
                },
                ca_bundle,
            });
        }
        let Some(url) = &config.url else {
            return Err("webhook clientConfig has neither service nor url".to_owned());
        };
        let Some(rest) = url.strip_prefix("https://") else {
            return Err(format!("webhook url {url:?} is not https"));
        };
        let (authority, path) = rest
            .find('/')
            .map_or((rest, "/"), |at| (&rest[..at], &rest[at..]));
        let host = authority
            .rsplit_once(':')
            .filter(|(_, port)| port.parse::<u16>().is_ok())
            .map_or(authority, |(host, _)| host);
        let dial = if host.len() == authority.len() {
            format!("{authority}:443")
        } else {
            authority.to_owned()
        };
        Ok(Self {
            url: url.clone(),
            server_name: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
            dial: Dial::HostPort(dial),
            path: path.to_owned(),
            ca_bundle,
        })
    }

    /// POSTs `review` and returns the decoded answer.
    ///
    /// # Errors
    ///
    /// Why the call failed, worded as Go's HTTP client words it where it can
    /// (`Post "<url>": <error>`).
    pub(super) async fn post(
        &self,
        services: &HashMap<(String, String), SocketAddr>,
        review: &Value,
        timeout: Duration,
    ) -> Result<Value, String> {
        let seconds = timeout.as_secs();
        let separator = if self.path.contains('?') { '&' } else { '?' };
        let path = format!("{}{separator}timeout={seconds}s", self.path);
        let url = format!("{}{separator}timeout={seconds}s", self.url);
        let call = self.exchange(services, &path, review);
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(format!("Post {url:?}: {e}")),
            Err(_) => Err(format!("Post {url:?}: context deadline exceeded")),
        }
    }

    async fn exchange(
        &self,
        services: &HashMap<(String, String), SocketAddr>,
        path: &str,
        review: &Value,
    ) -> Result<Value, String> {
        let tcp = match &self.dial {
            Dial::Service(namespace, name) => {
                let address = services
                    .get(&(namespace.clone(), name.clone()))
                    .ok_or_else(|| {
                        format!(
                            "service \"{namespace}/{name}\" has no endpoints known to FakeApi (serve_webhook_service)"
                        )
                    })?;
                tokio::net::TcpStream::connect(address).await
            }
            Dial::HostPort(authority) => tokio::net::TcpStream::connect(authority.as_str()).await,
        }
        .map_err(|e| format!("dial tcp: {e}"))?;
        let tls = tokio_rustls::TlsConnector::from(self.tls_config()?)
            .connect(self.server()?, tcp)
            .await
            .map_err(|e| format!("tls: failed to verify certificate: {e}"))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        let body = serde_json::to_vec(review).map_err(|e| e.to_string())?;
        let request = Request::post(path)
            .header(header::HOST, &self.server_name)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if !status.is_success() {
            // client-go's `transformResponse` words an answer that is not a Status so.
            return Err(format!(
                "an error on the server ({:?}) has prevented the request from succeeding",
                String::from_utf8_lossy(&bytes)
            ));
        }
        serde_json::from_slice(&bytes).map_err(|e| format!("decoding the answer: {e}"))
    }

    fn server(&self) -> Result<ServerName<'static>, String> {
        ServerName::try_from(self.server_name.clone())
            .map_err(|e| format!("invalid server name {:?}: {e}", self.server_name))
    }

    /// TLS that trusts only `caBundle`, as kube-apiserver's webhook client does when one is set.
    fn tls_config(&self) -> Result<Arc<rustls::ClientConfig>, String> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&self.ca_bundle) {
            let cert = cert.map_err(|e| format!("unable to load root certificates: {e}"))?;
            roots
                .add(cert)
                .map_err(|e| format!("unable to load root certificates: {e}"))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Arc::new(config))
    }
}
