//! The in-memory API server ([`FakeApi`]) over real HTTP, for code that runs in another
//! process (e.g. the kubelet plugin started as its own binary, so that a test can SIGKILL
//! it), together with a kubeconfig that points at it.

use std::io;
use std::net::SocketAddr;
use std::path::Path;

use http::{Request, Response};
use http_body_util::BodyExt as _;
use serde_json::json;
use tokio::task::JoinHandle;
use tower::ServiceExt as _;

use crate::fake_api::FakeApi;

/// A [`FakeApi`] served over plain HTTP on a loopback port. The server stops when this value
/// is dropped.
#[derive(Debug)]
pub struct ApiServer {
    address: SocketAddr,
    task: JoinHandle<()>,
}

impl ApiServer {
    /// Serves `api` on `127.0.0.1` at a free port. Must be called inside a Tokio runtime.
    ///
    /// # Errors
    /// No loopback port can be bound.
    pub async fn start(api: FakeApi) -> io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let address = listener.local_addr()?;
        let app = axum::Router::new().fallback(move |request: axum::extract::Request| {
            let api = api.clone();
            async move { forward(api, request).await }
        });
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("fake API server on {address} stopped: {e}");
            }
        });
        Ok(ApiServer { address, task })
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
        let config = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url()}}],
            "users": [{"name": "fake", "user": {}}],
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

/// Hands one HTTP request to the fake, whose service speaks kube's body type.
async fn forward(api: FakeApi, request: axum::extract::Request) -> Response<axum::body::Body> {
    let (parts, body) = request.into_parts();
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
