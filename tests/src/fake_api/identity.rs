//! Who sends a request to [`FakeApi`]: the user kube-apiserver's authenticators would hand
//! to its authorizers and admission plugins (kubernetes/kubernetes
//! `staging/src/k8s.io/apiserver/pkg/authentication/user/user.go`, `DefaultInfo`).
//!
//! Each kerf component talks to the fake as its own ServiceAccount, as it does on a cluster
//! where its pod's projected token authenticates it ([`Identity::kerf_controller`],
//! [`Identity::kerf_kubelet_plugin`]). Test code that plays the cluster (a user creating
//! claims, kube-scheduler, the kubelet) uses [`Identity::admin`], a member of
//! `system:masters`, whom kube-apiserver's authorizer chain always allows.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};

use super::{FakeApi, FakeBody};

/// The namespace kerf's manifests (`deploy/helm/kerf/templates/namespace.yaml`) install into.
pub const KERF_NAMESPACE: &str = "kerf-system";

/// The user-info extra key that carries the node of the pod a ServiceAccount token is bound
/// to (ServiceAccountTokenPodNodeInfo; kubernetes/kubernetes
/// `pkg/serviceaccount/claims.go`, `NodeNameKey`).
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";

/// The authenticated user of a request: name, groups and extra values.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    /// The user name, e.g. `system:serviceaccount:kerf-system:kerf-controller`.
    pub username: String,
    /// The groups the user belongs to, `system:authenticated` included.
    pub groups: Vec<String>,
    /// Extra values, e.g. the token's node ([`NODE_NAME_EXTRA`]).
    pub extra: BTreeMap<String, Vec<String>>,
}

impl Identity {
    /// The cluster admin (`system:masters`): allowed everything, as kube-apiserver's
    /// `authorizerfactory` privileged-group authorizer allows that group.
    pub fn admin() -> Self {
        Self {
            username: "kubernetes-admin".to_owned(),
            groups: vec![
                "system:masters".to_owned(),
                "system:authenticated".to_owned(),
            ],
            extra: BTreeMap::new(),
        }
    }

    /// A ServiceAccount as its token authenticates it (kubernetes/kubernetes
    /// `pkg/serviceaccount/util.go`, `UserInfo`): user
    /// `system:serviceaccount:<namespace>:<name>`, groups `system:serviceaccounts`,
    /// `system:serviceaccounts:<namespace>` and `system:authenticated`.
    pub fn service_account(namespace: &str, name: &str) -> Self {
        Self {
            username: format!("system:serviceaccount:{namespace}:{name}"),
            groups: vec![
                "system:serviceaccounts".to_owned(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".to_owned(),
            ],
            extra: BTreeMap::new(),
        }
    }

    /// This identity with a token bound to a pod on `node` ([`NODE_NAME_EXTRA`]).
    #[must_use]
    pub fn on_node(mut self, node: &str) -> Self {
        self.extra
            .insert(NODE_NAME_EXTRA.to_owned(), vec![node.to_owned()]);
        self
    }

    /// kerf-controller's ServiceAccount (`deploy/helm/kerf/templates/controller-rbac.yaml`); the webhook runs
    /// in the same process and uses it too.
    pub fn kerf_controller() -> Self {
        Self::service_account(KERF_NAMESPACE, "kerf-controller")
    }

    /// The kubelet plugin's ServiceAccount (`deploy/helm/kerf/templates/kubelet-plugin-rbac.yaml`), its
    /// token bound to a pod on `node`.
    pub fn kerf_kubelet_plugin(node: &str) -> Self {
        Self::service_account(KERF_NAMESPACE, "kerf-kubelet-plugin").on_node(node)
    }

    /// The node a pod-bound token names, if any.
    pub fn node_name(&self) -> Option<&str> {
        self.extra
            .get(NODE_NAME_EXTRA)
            .and_then(|nodes| nodes.first())
            .map(String::as_str)
    }
}

/// [`FakeApi`] answering every request as sent by one [`Identity`]: the identity travels in
/// the request's extensions, where [`FakeApi`]'s handler reads it (requests without one are
/// the admin's).
#[derive(Clone)]
pub(super) struct AsIdentity {
    pub(super) api: FakeApi,
    pub(super) identity: Arc<Identity>,
}

impl tower::Service<Request<kube::client::Body>> for AsIdentity {
    type Response = Response<FakeBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<kube::client::Body>) -> Self::Future {
        request.extensions_mut().insert(Arc::clone(&self.identity));
        let api = self.api.clone();
        Box::pin(async move { Ok(api.handle(request).await) })
    }
}
