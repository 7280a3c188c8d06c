//! The in-memory API server ([`FakeApi`]) over real HTTP, for code that runs in another
//! process (e.g. the kubelet plugin started as its own binary, so that a test can SIGKILL
//! it) or that should pay what a real client pays (a hyper connection, JSON both ways, a
//! round-trip latency: [`ApiServer::set_latency`]), together with a kubeconfig that points
//! at it.
//!
//! Requests authenticate as kube-apiserver's bearer-token authenticator sees them
//! (kubernetes/kubernetes `staging/src/k8s.io/apiserver/pkg/authentication/request/bearertoken/
//! bearertoken.go`, `Authenticator.AuthenticateRequest`): a kubeconfig from
//! [`ApiServer::write_kubeconfig_for`] carries an opaque token this server maps to its
//! [`Identity`], so that a component in another process talks with its own rights; an unknown
//! token is `401 Unauthorized`. A request without a token is the cluster admin's (what the
//! test itself plays), where a real server would make it `system:anonymous`.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::{Request, Response};
use http_body_util::BodyExt as _;
use serde_json::json;
use tokio::task::JoinHandle;
use tower::ServiceExt as _;

use crate::fake_api::{FakeApi, Identity};

/// The identities of the tokens an [`ApiServer`] handed out.
type Tokens = Arc<Mutex<HashMap<String, Arc<Identity>>>>;

/// A [`FakeApi`] served over plain HTTP on a loopback port. The server stops when this value
/// is dropped.
#[derive(Debug)]
pub struct ApiServer {
    address: SocketAddr,
    task: JoinHandle<()>,
    /// Nanoseconds every answer waits; see [`ApiServer::set_latency`].
    latency: Arc<AtomicU64>,
    /// Bearer tokens and whom they authenticate ([`ApiServer::write_kubeconfig_for`]).
    tokens: Tokens,
}

impl ApiServer {
    /// Serves `api` on `127.0.0.1` at a free port. Must be called inside a Tokio runtime.
    ///
    /// # Errors
    /// No loopback port can be bound.
    pub async fn start(api: FakeApi) -> io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let address = listener.local_addr()?;
        let latency = Arc::new(AtomicU64::new(0));
        let wait = Arc::clone(&latency);
        let tokens = Tokens::default();
        let known = Arc::clone(&tokens);
        let app = axum::Router::new().fallback(move |request: axum::extract::Request| {
            let api = api.clone();
            let wait = Duration::from_nanos(wait.load(Ordering::Relaxed));
            let known = Arc::clone(&known);
            async move { forward(api, request, wait, &known).await }
        });
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("fake API server on {address} stopped: {e}");
            }
        });
        Ok(ApiServer {
            address,
            task,
            latency,
            tokens,
        })
    }

    /// Answers every request that arrives from now on `latency` late (zero: at once), watches
    /// before their first byte, on top of any delay scripted in the [`FakeApi`].
    ///
    /// Imitates the round trip to a real API server. A GET without `resourceVersion` (what
    /// kube's `Api::get` sends) is not served from kube-apiserver's watch cache but read from
    /// etcd (kubernetes/kubernetes `staging/src/k8s.io/apiserver/pkg/storage/cacher/
    /// delegator.go`, `CacheDelegator.Get`: "If resourceVersion is not specified, serve it
    /// from underlying storage"), a linearizable read that costs etcd a round of its own, on
    /// top of the client's network hop, authentication and encoding: about a millisecond in
    /// a healthy cluster is an assumption, not a measurement.
    ///
    /// The wait is a thread's sleep, not Tokio's timer: Tokio rounds a sleep up to its
    /// millisecond ticks and its driver's wake-up again, which turned a 1 ms latency into
    /// about 2.4 ms on the benchmark machine.
    pub fn set_latency(&self, latency: Duration) {
        let nanos = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.latency.store(nanos, Ordering::Relaxed);
    }

    /// The server's URL, e.g. `http://127.0.0.1:34567`.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Writes a kubeconfig whose current context talks to this server without credentials,
    /// with `default` as the namespace. (JSON is valid YAML, so no YAML writer is needed.)
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn write_kubeconfig(&self, path: &Path) -> io::Result<()> {
        self.write_kubeconfig_with(path, &json!({}))
    }

    /// Writes a kubeconfig like [`ApiServer::write_kubeconfig`] whose requests this server
    /// authenticates as `identity` (e.g. [`Identity::kerf_kubelet_plugin`] for a plugin
    /// process): it carries a new bearer token that maps to `identity`.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn write_kubeconfig_for(&self, path: &Path, identity: Identity) -> io::Result<()> {
        let token = {
            let mut tokens = self.tokens.lock().unwrap_or_else(PoisonError::into_inner);
            let token = format!("fake-token-{}-{}", self.address.port(), tokens.len() + 1);
            tokens.insert(token.clone(), Arc::new(identity));
            token
        };
        self.write_kubeconfig_with(path, &json!({"token": token}))
    }

    fn write_kubeconfig_with(&self, path: &Path, user: &serde_json::Value) -> io::Result<()> {
        let config = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url()}}],
            "users": [{"name": "fake", "user": user}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
            "current-context": "fake",
        });
        std::fs::write(path, config.to_string())
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Hands one HTTP request to the fake, whose service speaks kube's body type, `latency` late,
/// as the user its bearer token names (`tokens`); no token: the admin.
async fn forward(
    api: FakeApi,
    request: axum::extract::Request,
    latency: Duration,
    tokens: &Mutex<HashMap<String, Arc<Identity>>>,
) -> Response<axum::body::Body> {
    if !latency.is_zero() {
        // A sleeping thread of the blocking pool, for its precision; a join error means the
        // runtime is shutting down, when nobody waits for the answer any more.
        let _ = tokio::task::spawn_blocking(move || std::thread::sleep(latency)).await;
    }
    let (mut parts, body) = request.into_parts();
    if let Some(header) = parts.headers.get(http::header::AUTHORIZATION) {
        let token = header
            .to_str()
            .ok()
            .and_then(|value| value.strip_prefix("Bearer "))
            .map(str::trim);
        let identity = token.and_then(|token| {
            tokens
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(token)
                .cloned()
        });
        let Some(identity) = identity else {
            return unauthorized();
        };
        parts.extensions.insert(identity);
    }
    let bytes = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            let mut response = Response::new(axum::body::Body::from(format!("reading body: {e}")));
            *response.status_mut() = http::StatusCode::BAD_REQUEST;
            return response;
        }
    };
    let request = Request::from_parts(parts, kube::client::Body::from(bytes));
    match api.oneshot(request).await {
        Ok(response) => response.map(axum::body::Body::new),
        Err(never) => match never {},
    }
}

/// The answer to a request whose credentials authenticate nobody, as kube-apiserver's
/// authentication filter writes it (`staging/src/k8s.io/apiserver/pkg/endpoints/filters/
/// authentication.go`, `Unauthorized`: `apierrors.NewUnauthorized("Unauthorized")`).
fn unauthorized() -> Response<axum::body::Body> {
    let status = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Unauthorized",
        "reason": "Unauthorized",
        "code": 401,
    });
    let mut response = Response::new(axum::body::Body::from(status.to_string()));
    *response.status_mut() = http::StatusCode::UNAUTHORIZED;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::Api;

    use super::*;

    async fn client(server: &ApiServer) -> kube::Client {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        server.write_kubeconfig(&path).unwrap();
        client_of(&path).await
    }

    async fn client_of(path: &Path) -> kube::Client {
        let kubeconfig = kube::config::Kubeconfig::read_from(path).unwrap();
        let config = kube::Config::from_custom_kubeconfig(
            kubeconfig,
            &kube::config::KubeConfigOptions::default(),
        )
        .await
        .unwrap();
        kube::Client::try_from(config).unwrap()
    }

    /// A sleep never ends early, so no answer can come before the latency has passed: a
    /// lower bound only, whatever the machine's speed.
    #[tokio::test]
    async fn every_answer_waits_at_least_the_latency_errors_too() {
        let fake = FakeApi::new();
        fake.insert(json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": "ns"},
        }));
        let server = ApiServer::start(fake.clone()).await.unwrap();
        let api: Api<ConfigMap> = Api::namespaced(client(&server).await, "ns");
        let latency = Duration::from_millis(30);
        server.set_latency(latency);
        let started = std::time::Instant::now();
        api.get("c").await.unwrap();
        assert!(started.elapsed() >= latency);
        let started = std::time::Instant::now();
        assert!(api.get("missing").await.is_err());
        assert!(started.elapsed() >= latency);
        server.set_latency(Duration::ZERO);
        assert_eq!(server.latency.load(Ordering::Relaxed), 0);
        api.get("c").await.unwrap();
        assert_eq!(fake.count("GET", "/api/v1/namespaces/ns/configmaps"), 3);
    }

    /// A kubeconfig for an identity authenticates as that identity, which RBAC then limits;
    /// a token the server never handed out authenticates nobody.
    #[tokio::test]
    async fn a_kubeconfig_for_an_identity_talks_as_that_identity() {
        let fake = FakeApi::new();
        fake.insert(json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": "ns"},
        }));
        let server = ApiServer::start(fake.clone()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        server
            .write_kubeconfig_for(&path, Identity::kerf_kubelet_plugin("node-a"))
            .unwrap();
        let plugin = client_of(&path).await;
        let err = Api::<ConfigMap>::namespaced(plugin, "ns")
            .get("c")
            .await
            .unwrap_err();
        assert!(
            matches!(&err, kube::Error::Api(s) if s.code == 403
                && s.message.contains("User \"system:serviceaccount:kerf-system:kerf-kubelet-plugin\" cannot get resource \"configmaps\"")),
            "{err}"
        );
        let last = fake.requests().pop().unwrap();
        assert_eq!(
            last.user,
            "system:serviceaccount:kerf-system:kerf-kubelet-plugin"
        );

        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replace("fake-token-", "forged-token-")).unwrap();
        let forged = client_of(&path).await;
        let err = Api::<ConfigMap>::namespaced(forged, "ns")
            .get("c")
            .await
            .unwrap_err();
        assert!(
            matches!(&err, kube::Error::Api(s) if s.code == 401),
            "{err}"
        );
    }
}
