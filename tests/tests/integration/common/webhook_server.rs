//! The webhook as the controller runs it, for the webhook tests: started on a free port in
//! self-signed mode as kerf-controller's ServiceAccount, reached over real HTTPS trusting only
//! the CA it put in its MutatingWebhookConfigurations, as kube-apiserver does.
#![allow(dead_code, reason = "each test binary uses a part of the fixture")]

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use http::{Request, header};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use kerf_controller::Metrics;
use kerf_controller::webhook::{self, Certificates, SelfSigned, WebhookConfig};
use kerf_tests::fake_api::{FakeApi, Identity};
use prometheus_client::registry::Registry;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

pub use kerf_tests::fixtures::DRIVER;
/// The name the webhook's certificate is made for (`<service>.<namespace>.svc`).
pub const HOST: &str = "kerf-webhook.kerf-system.svc";

/// A MutatingWebhookConfiguration `name` with `webhooks` pointing at kerf's Service.
pub fn configuration(name: &str, webhooks: &[&str], failure_policy: &str) -> Value {
    let webhooks: Vec<Value> = webhooks
        .iter()
        .map(|webhook| {
            json!({
                "name": webhook,
                "clientConfig": {"service": {"name": "kerf-webhook", "namespace": "kerf-system", "path": "/mutate"}},
                "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": failure_policy,
            })
        })
        .collect();
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name}, "webhooks": webhooks,
    })
}

/// A started webhook: its port, its metrics and the flag it sets while serving.
pub struct Started {
    pub port: u16,
    pub registry: Registry,
    pub serving: Arc<AtomicBool>,
}

/// Starts the webhook as kerf-controller (self-signed mode, its CA kept in `configurations`)
/// on a free port.
pub fn start(
    fake: &FakeApi,
    configurations: &[&str],
    validity: Duration,
    renew_before: Duration,
    stop: &CancellationToken,
) -> Started {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let config = WebhookConfig {
        address: ([127, 0, 0, 1], port).into(),
        driver_name: DRIVER.to_owned(),
        field_manager: "kerf-controller".to_owned(),
        certificates: Certificates::SelfSigned(SelfSigned {
            service: "kerf-webhook".to_owned(),
            namespace: "kerf-system".to_owned(),
            webhook_configurations: configurations.iter().map(|&c| c.to_owned()).collect(),
            validating_configurations: Vec::new(),
            validity,
            renew_before,
        }),
    };
    let serving = Arc::new(AtomicBool::new(false));
    tokio::spawn(webhook::run(webhook::Webhook {
        config,
        client: fake.client_as(Identity::kerf_controller()),
        caches: None,
        metrics,
        serving: Arc::clone(&serving),
        shutdown: stop.clone(),
    }));
    Started {
        port,
        registry,
        serving,
    }
}

/// The decoded caBundle of every webhook of configuration `name`, when all are set.
pub fn bundles(fake: &FakeApi, name: &str) -> Option<Vec<String>> {
    fake.mutating_webhook_ca_bundles(name)
}

/// What the webhook answered to one POST.
pub struct Answer {
    pub status: u16,
    pub body: Value,
    /// The certificate the server presented.
    pub certificate: CertificateDer<'static>,
}

/// POSTs `body` (sent as it is) to `/mutate` over HTTPS, trusting only the CAs in `bundle`.
///
/// # Errors
/// The connection, the TLS handshake or the request failed (as text).
pub async fn post(port: u16, bundle: &str, body: impl Into<Bytes>) -> Result<Answer, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from(HOST).unwrap().to_owned(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let certificate = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    let request = Request::post("/mutate?timeout=5s")
        .header(header::HOST, HOST)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body.into()))
        .unwrap();
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    Ok(Answer {
        status,
        body: serde_json::from_slice(&bytes).unwrap(),
        certificate,
    })
}
