//! `DRAPlugin` v1 and v1beta1 on one socket, both answered by the same [`Driver`].

use std::sync::Arc;

use kerf_proto::dra::{v1, v1beta1};
use tonic::{Request, Response, Status};

use crate::driver::{ClaimRef, Driver, PreparedDeviceResult};
use crate::metrics::Metrics;

/// The DRA service; clone it into both API versions' servers.
#[derive(Clone)]
pub struct DraService {
    driver: Arc<Driver>,
    metrics: Metrics,
}

impl DraService {
    /// Serves `driver`.
    pub fn new(driver: Arc<Driver>, metrics: Metrics) -> Self {
        DraService { driver, metrics }
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
    ) -> Vec<(String, Result<Vec<PreparedDeviceResult>, String>)> {
        self.driver.prepare(&claims).await
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> Vec<(String, Result<(), String>)> {
        self.driver.unprepare(&claims).await
    }
}

macro_rules! claim_refs {
    ($claims:expr) => {
        $claims
            .into_iter()
            .map(|c| ClaimRef {
                namespace: c.namespace,
                uid: c.uid,
                name: c.name,
            })
            .collect::<Vec<_>>()
    };
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        self.metrics.record_request("NodePrepareResources", "v1");
        let answers = self.prepare(claim_refs!(request.into_inner().claims)).await;
        let claims = answers
            .into_iter()
            .map(|(uid, result)| {
                let answer = match result {
                    Ok(devices) => v1::NodePrepareResourceResponse {
                        devices: devices.into_iter().map(v1_device).collect(),
                        error: String::new(),
                    },
                    Err(error) => v1::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    },
                };
                (uid, answer)
            })
            .collect();
        Ok(Response::new(v1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        self.metrics.record_request("NodeUnprepareResources", "v1");
        let answers = self
            .unprepare(claim_refs!(request.into_inner().claims))
            .await;
        let claims = answers
            .into_iter()
            .map(|(uid, result)| {
                (
                    uid,
                    v1::NodeUnprepareResourceResponse {
                        error: result.err().unwrap_or_default(),
                    },
                )
            })
            .collect();
        Ok(Response::new(v1::NodeUnprepareResourcesResponse { claims }))
    }
}

/// The v1beta1 face of [`DraService`]: the same messages without `share_id`.
#[derive(Clone)]
pub struct V1beta1(DraService);

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for V1beta1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        self.0
            .metrics
            .record_request("NodePrepareResources", "v1beta1");
        let answers = self
            .0
            .prepare(claim_refs!(request.into_inner().claims))
            .await;
        let claims = answers
            .into_iter()
            .map(|(uid, result)| {
                let answer = match result {
                    Ok(devices) => v1beta1::NodePrepareResourceResponse {
                        devices: devices.into_iter().map(v1beta1_device).collect(),
                        error: String::new(),
                    },
                    Err(error) => v1beta1::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    },
                };
                (uid, answer)
            })
            .collect();
        Ok(Response::new(v1beta1::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        self.0
            .metrics
            .record_request("NodeUnprepareResources", "v1beta1");
        let answers = self
            .0
            .unprepare(claim_refs!(request.into_inner().claims))
            .await;
        let claims = answers
            .into_iter()
            .map(|(uid, result)| {
                (
                    uid,
                    v1beta1::NodeUnprepareResourceResponse {
                        error: result.err().unwrap_or_default(),
                    },
                )
            })
            .collect();
        Ok(Response::new(v1beta1::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

fn v1_device(d: PreparedDeviceResult) -> v1::Device {
    v1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
        share_id: d.share_id,
    }
}

fn v1beta1_device(d: PreparedDeviceResult) -> v1beta1::Device {
    v1beta1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
    }
}
