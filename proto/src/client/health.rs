//! The kubelet's health stream: `v1alpha1.DRAResourceHealth/NodeWatchResources` on the
//! plugin's DRA connection, as upstream kubelet opens it (`pkg/kubelet/cm/dra/plugin/
//! dra_plugin.go`, `NodeWatchResources`, on the connection of the registered plugin; no
//! call limit, the stream lives as long as the plugin) and reads it
//! (`pkg/kubelet/cm/dra/manager.go`, `HandleWatchResourcesStream`: every message is the full
//! list; the end of the stream, EOF or error, ends the watch).

use super::{ClientError, RegisteredPlugin};
use crate::health::v1alpha1::dra_resource_health_client::DraResourceHealthClient;
use crate::health::v1alpha1::{NodeWatchResourcesRequest, NodeWatchResourcesResponse};

const NODE_WATCH_RESOURCES: &str = "NodeWatchResources";

/// An open health stream.
#[derive(Debug)]
pub struct HealthStream {
    inner: tonic::Streaming<NodeWatchResourcesResponse>,
}

impl HealthStream {
    /// The next full list; `None` when the plugin ended the stream.
    ///
    /// # Errors
    /// [`ClientError::Rpc`] when the stream broke (the plugin went away).
    pub async fn next(&mut self) -> Result<Option<NodeWatchResourcesResponse>, ClientError> {
        self.inner
            .message()
            .await
            .map_err(|source| ClientError::Rpc {
                method: NODE_WATCH_RESOURCES,
                source,
            })
    }
}

impl RegisteredPlugin {
    /// Opens the health stream on the plugin's DRA connection.
    ///
    /// # Errors
    /// [`ClientError::Rpc`] when the plugin refuses the call (e.g. `Unimplemented`).
    pub async fn watch_health(&self) -> Result<HealthStream, ClientError> {
        let mut client = DraResourceHealthClient::new(self.channel.clone());
        let answer = client
            .node_watch_resources(tonic::Request::new(NodeWatchResourcesRequest {}))
            .await
            .map_err(|source| ClientError::Rpc {
                method: NODE_WATCH_RESOURCES,
                source,
            })?;
        Ok(HealthStream {
            inner: answer.into_inner(),
        })
    }
}
