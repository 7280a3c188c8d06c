//! kube-apiserver's side of kerf's mutating webhooks: every claim and pod the benchmark creates
//! is first sent as an `admission.k8s.io/v1` AdmissionReview to a kerf-controller replica over
//! HTTPS, and the JSONPatch of the answer is applied to the object before it is stored.
//!
//! Upstream (kubernetes/kubernetes): `staging/src/k8s.io/apiserver/pkg/admission/plugin/
//! webhook/mutating/dispatcher.go`, `callAttrMutatingHook`, builds the review with
//! `request.CreateAdmissionObjects` → `CreateV1AdmissionReview` (`.../webhook/request/
//! admissionreview.go`: a fresh `uid`, `kind`, `resource`, `requestKind`, `requestResource`,
//! `namespace`, `operation`, `userInfo`, `object`, `dryRun`, `options`), POSTs it to the
//! Service's path with `?timeout=<timeoutSeconds>s`, checks the answer
//! (`VerifyAdmissionResponse`: the same `uid`) and applies `jsonpatch.DecodePatch(patch)` to the
//! object. The server's certificate must chain to the configuration's `caBundle` and name
//! `<service>.<namespace>.svc`. A Service spreads requests over its endpoints; here they go to
//! the replicas in turn.
//!
//! Differences: the configuration's `matchConditions` are not evaluated (every claim the
//! benchmark creates carries a `gpu.kerf.dev` config, so every claim matches them), and a
//! failed call fails the benchmark instead of following `failurePolicy`, because an
//! unadmitted object would measure something else.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use http::{Request, header};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};

use crate::{Error, Result};

/// The MutatingWebhookConfiguration of the pod webhook (`deploy/helm/kerf/templates/webhook.yaml`).
pub(super) const POD_CONFIGURATION: &str = "kerf-scheduling-gate";
/// The MutatingWebhookConfiguration of the claim webhooks (`deploy/helm/kerf/templates/webhook.yaml`).
pub(super) const CLAIM_CONFIGURATION: &str = "kerf-claim-parameters";
/// The host name the self-made certificate is for (`--webhook-service`.`--webhook-namespace`.svc).
const HOST: &str = "kerf-webhook.kerf-system.svc";
/// The path and timeout of every webhook in `deploy/helm/kerf/templates/webhook.yaml`.
const PATH: &str = "/mutate?timeout=5s";

/// What is admitted: the resource as the review names it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Resource {
    /// `resource.k8s.io/v1` `resourceclaims`.
    Claim,
    /// `v1` `pods`.
    Pod,
}

impl Resource {
    fn kind(self) -> Value {
        match self {
            Resource::Claim => {
                json!({"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"})
            }
            Resource::Pod => json!({"group": "", "version": "v1", "kind": "Pod"}),
        }
    }

    fn resource(self) -> Value {
        match self {
            Resource::Claim => {
                json!({"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"})
            }
            Resource::Pod => json!({"group": "", "version": "v1", "resource": "pods"}),
        }
    }
}

/// An HTTPS client of the replicas' webhooks, trusting only the CAs of their
/// MutatingWebhookConfigurations.
#[derive(Clone)]
pub(super) struct Admitter {
    tls: tokio_rustls::TlsConnector,
    ports: Arc<Vec<u16>>,
    next: Arc<AtomicUsize>,
    /// Reviews sent, for the review `uid`s.
    sent: Arc<AtomicUsize>,
    /// Idle kept-alive connections, by replica port.
    idle: Arc<Mutex<HashMap<u16, Vec<Sender>>>>,
}

/// One HTTP/1.1 connection to a webhook.
type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

impl std::fmt::Debug for Admitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admitter")
            .field("ports", &self.ports)
            .finish_non_exhaustive()
    }
}

/// How many certificates a PEM bundle holds.
pub(super) fn certificates(pem: &str) -> usize {
    pem.matches("-----BEGIN CERTIFICATE-----").count()
}

impl Admitter {
    /// A client of the webhooks on `ports` (127.0.0.1) trusting the CAs in `bundle` (PEM).
    ///
    /// # Errors
    /// [`Error::Child`] when the bundle holds no usable certificate.
    pub(super) fn new(bundle: &str, ports: Vec<u16>) -> Result<Self> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
            let cert = cert.map_err(|e| Error::Child(format!("webhook caBundle: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| Error::Child(format!("webhook caBundle: {e}")))?;
        }
        if roots.is_empty() {
            return Err(Error::Child("webhook caBundle holds no certificate".into()));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Child(format!("TLS client: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Admitter {
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
            ports: Arc::new(ports),
            next: Arc::new(AtomicUsize::new(0)),
            sent: Arc::new(AtomicUsize::new(0)),
            idle: Arc::default(),
        })
    }

    /// Sends `object` (about to be created in `namespace`) to the next replica's webhook and
    /// applies the answer's patch to it. Returns whether there was a patch.
    ///
    /// # Errors
    /// [`Error::Child`] when the call fails, the answer is not a review of this request, the
    /// object is denied, or the patch does not apply.
    pub(super) async fn admit(
        &self,
        resource: Resource,
        namespace: &str,
        object: &mut Value,
    ) -> Result<bool> {
        let n = self.sent.fetch_add(1, Ordering::Relaxed);
        let uid = format!("00000000-0000-4000-8000-{n:012}");
        let review = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": resource.kind(),
                "resource": resource.resource(),
                "requestKind": resource.kind(),
                "requestResource": resource.resource(),
                "name": object.pointer("/metadata/name").cloned().unwrap_or(Value::Null),
                "namespace": namespace,
                "operation": "CREATE",
                "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]},
                "object": object.clone(),
                "oldObject": null,
                "dryRun": false,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
            },
        });
        let port = self.ports[self.next.fetch_add(1, Ordering::Relaxed) % self.ports.len()];
        let answer = self.post(port, review.to_string()).await?;
        let response = &answer["response"];
        if response["uid"].as_str() != Some(uid.as_str()) {
            return Err(Error::Child(format!(
                "webhook on port {port} answered another review: {answer}"
            )));
        }
        if response["allowed"].as_bool() != Some(true) {
            return Err(Error::Child(format!(
                "webhook on port {port} denied {}: {}",
                review["request"]["name"], response["status"]
            )));
        }
        let Some(encoded) = response["patch"].as_str() else {
            return Ok(false);
        };
        let bytes = STANDARD
            .decode(encoded)
            .map_err(|e| Error::Child(format!("webhook patch is not base64: {e}")))?;
        let patch: json_patch::Patch = serde_json::from_slice(&bytes)
            .map_err(|e| Error::Child(format!("webhook patch is not a JSONPatch: {e}")))?;
        json_patch::patch(object, &patch)
            .map_err(|e| Error::Child(format!("webhook patch does not apply: {e}")))?;
        Ok(true)
    }

    /// One POST over an idle kept-alive connection to the replica on `port`, or a new one.
    ///
    /// kube-apiserver keeps its connections to a webhook open (its webhook client is cached
    /// per webhook with a keep-alive transport: `staging/src/k8s.io/apiserver/pkg/util/webhook/
    /// client.go`, `ClientManager.HookClient`), so a TLS handshake is not paid per review.
    async fn post(&self, port: u16, body: String) -> Result<Value> {
        let body = Bytes::from(body);
        if let Some(mut sender) = self.take_idle(port)
            && let Ok(response) = send(&mut sender, request(body.clone())?).await
        {
            return self.finish(port, sender, response).await;
        }
        // No idle connection, or the replica closed it as the review went out on it. Go's
        // transport then sends the request again on a new connection (`net/http/transport.go`,
        // `persistConn.shouldRetryRequest`); a review has no side effects, so that is safe.
        let mut sender = self.connect(port).await?;
        let response = send(&mut sender, request(body)?)
            .await
            .map_err(|e| Error::Child(format!("webhook on 127.0.0.1:{port}: POST: {e}")))?;
        self.finish(port, sender, response).await
    }

    /// Reads the answer and keeps the connection for the next review.
    async fn finish(
        &self,
        port: u16,
        mut sender: Sender,
        response: http::Response<hyper::body::Incoming>,
    ) -> Result<Value> {
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            Error::Child(format!("webhook on 127.0.0.1:{port}: {what}: {e}"))
        };
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| fail("body", &e))?
            .to_bytes();
        if sender.ready().await.is_ok() {
            self.put_idle(port, sender);
        }
        if !status.is_success() {
            return Err(fail(
                "status",
                &format!("{status}: {}", String::from_utf8_lossy(&bytes)),
            ));
        }
        serde_json::from_slice(&bytes).map_err(|e| fail("answer is not JSON", &e))
    }

    fn take_idle(&self, port: u16) -> Option<Sender> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let pool = idle.entry(port).or_default();
        while let Some(sender) = pool.pop() {
            if !sender.is_closed() {
                return Some(sender);
            }
        }
        None
    }

    fn put_idle(&self, port: u16, sender: Sender) {
        if !sender.is_closed() {
            self.idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(port)
                .or_default()
                .push(sender);
        }
    }

    async fn connect(&self, port: u16) -> Result<Sender> {
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            Error::Child(format!("webhook on 127.0.0.1:{port}: {what}: {e}"))
        };
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| fail("connect", &e))?;
        let name = ServerName::try_from(HOST).map_err(|e| fail("server name", &e))?;
        let tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|e| fail("TLS handshake", &e))?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| fail("HTTP handshake", &e))?;
        tokio::spawn(connection);
        Ok(sender)
    }
}

/// The POST of one review.
fn request(body: Bytes) -> Result<Request<Full<Bytes>>> {
    Request::post(PATH)
        .header(header::HOST, HOST)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| Error::Child(format!("webhook request: {e}")))
}

/// Sends `request` on `sender` once the connection is ready for one.
async fn send(
    sender: &mut Sender,
    request: Request<Full<Bytes>>,
) -> std::result::Result<http::Response<hyper::body::Incoming>, hyper::Error> {
    sender.ready().await?;
    sender.send_request(request).await
}
