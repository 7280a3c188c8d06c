//! A tiny HTTPS admission webhook for the FakeApi webhook tests: its own CA and a serving
//! certificate for the names it is given, every AdmissionReview it receives recorded, each
//! answered by the test's handler.
#![allow(
    dead_code,
    reason = "each test binary uses a part of the server's helpers"
)]

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use http::{Request, Response};
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::{Value, json};

/// What the webhook answers to a review: the `response` object, the request's `uid` added
/// when it has none.
pub type Handler = Arc<dyn Fn(Value) -> Pin<Box<dyn Future<Output = Value> + Send>> + Send + Sync>;

/// A handler from a plain function of the review.
pub fn handler(answer: impl Fn(&Value) -> Value + Send + Sync + 'static) -> Handler {
    let answer = Arc::new(answer);
    Arc::new(move |review| {
        let answer = Arc::clone(&answer);
        Box::pin(async move { answer(&review) })
    })
}

/// `{"allowed": true}`.
pub fn allowed() -> Value {
    json!({"allowed": true})
}

/// A denial with `result` as its Status.
pub fn denied(result: Value) -> Value {
    let mut response = json!({"allowed": false});
    response["status"] = result;
    response
}

/// A running webhook.
pub struct Webhook {
    pub address: SocketAddr,
    /// Its CA certificate in PEM, for `clientConfig.caBundle`.
    pub ca_pem: String,
    reviews: Arc<Mutex<Vec<Value>>>,
}

impl Webhook {
    /// The AdmissionReviews received so far.
    pub fn reviews(&self) -> Vec<Value> {
        self.reviews.lock().unwrap().clone()
    }

    /// The CA in base64, as `caBundle` carries it.
    pub fn ca_bundle(&self) -> String {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(&self.ca_pem)
    }
}

/// Starts a webhook on a free port of 127.0.0.1 whose certificate is valid for `names`
/// (DNS names or IP addresses).
pub async fn start(names: &[&str], answer: Handler) -> Webhook {
    let (ca_pem, tls) = certificates(names);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let reviews = Arc::new(Mutex::new(Vec::new()));
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let recorded = Arc::clone(&reviews);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            let answer = Arc::clone(&answer);
            let recorded = Arc::clone(&recorded);
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = service_fn(move |request| {
                    serve(request, Arc::clone(&answer), Arc::clone(&recorded))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    Webhook {
        address,
        ca_pem,
        reviews,
    }
}

async fn serve(
    request: Request<Incoming>,
    answer: Handler,
    recorded: Arc<Mutex<Vec<Value>>>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let body = request.into_body().collect().await.unwrap().to_bytes();
    let review: Value = serde_json::from_slice(&body).unwrap();
    recorded.lock().unwrap().push(review.clone());
    let mut response = answer(review.clone()).await;
    // A handler may answer with another uid, to test how a wrong answer is treated.
    if response.get("uid").is_none() {
        response["uid"] = review["request"]["uid"].clone();
    }
    let answer = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response,
    });
    Ok(Response::new(Full::new(Bytes::from(answer.to_string()))))
}

/// A CA and a serving certificate for `names` signed by it: the CA's PEM and the server's TLS.
fn certificates(names: &[&str]) -> (String, Arc<rustls::ServerConfig>) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::default();
    ca.distinguished_name
        .push(DnType::CommonName, "FakeApi test webhook CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut serving =
        CertificateParams::new(names.iter().map(|&n| n.to_owned()).collect::<Vec<_>>()).unwrap();
    serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = serving
        .signed_by(&key, &Issuer::from_params(&ca, &ca_key))
        .unwrap();
    let private = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], private)
        .unwrap();
    (ca_cert.pem(), Arc::new(config))
}
