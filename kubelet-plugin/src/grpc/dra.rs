//! `DRAPlugin` v1 and v1beta1 on one socket, both answered by the same [`Preparer`].
//!
//! Here, and only here, a claim's typed error becomes the message of its per-claim answer:
//! the kubelet reports it on the pod as it is.

use std::sync::Arc;

use kerf_proto::PreparedDevice;
use kerf_proto::dra::{v1, v1beta1};
use tonic::{Request, Response, Status};

use crate::identity::ClaimRef;
use crate::metrics::Metrics;
use crate::preparer::Preparer;

/// The DRA service; clone it into both API versions' servers.
#[derive(Clone)]
pub(crate) struct DraService {
    preparer: Arc<Preparer>,
    metrics: Metrics,
}

impl DraService {
    /// Serves the claims `preparer` prepares.
    pub fn new(preparer: Arc<Preparer>, metrics: Metrics) -> Self {
        DraService { preparer, metrics }
    }

    /// The v1 gRPC server.
    pub fn v1(&self) -> v1::dra_plugin_server::DraPluginServer<Self> {
        v1::dra_plugin_server::DraPluginServer::new(self.clone())
    }

    /// The v1beta1 gRPC server.
    pub fn v1beta1(&self) -> v1beta1::dra_plugin_server::DraPluginServer<V1beta1> {
        v1beta1::dra_plugin_server::DraPluginServer::new(V1beta1(self.clone()))
    }

    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(String, crate::Result<Vec<PreparedDevice>>)> {
        self.preparer.prepare(&claims).await
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> Vec<(String, crate::Result<()>)> {
        self.preparer.unprepare(&claims).await
    }
}

/// Implements one API version's `DRAPlugin` on top of [`DraService`]: the versions differ
/// only in their generated types (a [`PreparedDevice`] converts into either's `Device`).
macro_rules! dra_plugin {
    ($version:ident, $label:literal, $service:ty) => {
        #[tonic::async_trait]
        impl $version::dra_plugin_server::DraPlugin for $service {
            async fn node_prepare_resources(
                &self,
                request: Request<$version::NodePrepareResourcesRequest>,
            ) -> Result<Response<$version::NodePrepareResourcesResponse>, Status> {
                let service: &DraService = self.as_ref();
                service
                    .metrics
                    .record_request("NodePrepareResources", $label);
                let claims = request.into_inner().claims.into_iter();
                let refs = claims.map(|c| ClaimRef {
                    namespace: c.namespace,
                    uid: c.uid,
                    name: c.name,
                });
                let answers = service.prepare(refs.collect()).await;
                let claims = answers
                    .into_iter()
                    .map(|(uid, result)| {
                        let answer = match result {
                            Ok(devices) => $version::NodePrepareResourceResponse {
                                devices: devices.into_iter().map(Into::into).collect(),
                                error: String::new(),
                            },
                            Err(error) => $version::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error: error.to_string(),
                            },
                        };
                        (uid, answer)
                    })
                    .collect();
                Ok(Response::new($version::NodePrepareResourcesResponse {
                    claims,
                }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$version::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$version::NodeUnprepareResourcesResponse>, Status> {
                let service: &DraService = self.as_ref();
                service
                    .metrics
                    .record_request("NodeUnprepareResources", $label);
                let claims = request.into_inner().claims.into_iter();
                let refs = claims.map(|c| ClaimRef {
                    namespace: c.namespace,
                    uid: c.uid,
                    name: c.name,
                });
                let answers = service.unprepare(refs.collect()).await;
                let claims = answers
                    .into_iter()
                    .map(|(uid, result)| {
                        let error = result.err().map(|e| e.to_string()).unwrap_or_default();
                        (uid, $version::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($version::NodeUnprepareResourcesResponse {
                    claims,
                }))
            }
        }
    };
}

impl AsRef<DraService> for DraService {
    fn as_ref(&self) -> &DraService {
        self
    }
}

dra_plugin!(v1, "v1", DraService);

/// The v1beta1 face of `DraService`: the same messages without `share_id`.
#[derive(Clone)]
pub struct V1beta1(DraService);

impl AsRef<DraService> for V1beta1 {
    fn as_ref(&self) -> &DraService {
        &self.0
    }
}

dra_plugin!(v1beta1, "v1beta1", V1beta1);
