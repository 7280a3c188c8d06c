//! `pluginregistration.Registration`: how the kubelet discovers the plugin.

use std::path::PathBuf;

use kerf_ops::ready::ReadyFlag;
use kerf_proto::pluginregistration::registration_server::Registration;
use kerf_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use kerf_proto::service_names;
use tonic::{Request, Response, Status};

use crate::metrics::Metrics;

/// Answers the kubelet's registration calls.
#[derive(Clone)]
pub(crate) struct RegistrationService {
    driver_name: String,
    dra_endpoint: PathBuf,
    /// Raised while the kubelet's last `NotifyRegistrationStatus` said registered.
    registered: ReadyFlag,
    metrics: Metrics,
}

impl RegistrationService {
    /// Registers `driver_name` with its DRA socket at `dra_endpoint` (absolute host path),
    /// setting `registered` from the kubelet's answer.
    pub fn new(
        driver_name: String,
        dra_endpoint: PathBuf,
        registered: ReadyFlag,
        metrics: Metrics,
    ) -> Self {
        RegistrationService {
            driver_name,
            dra_endpoint,
            registered,
            metrics,
        }
    }

    /// The services the plugin offers, DRA versions newest first, then the health service.
    ///
    /// The kubelet takes the first entry it knows as the DRA service and skips the others
    /// (upstream `pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`,
    /// `validateSupportedServices`, 1.34 to 1.36), so the health service at the end can never
    /// be chosen nor make a kubelet that does not know it refuse the plugin. The kubelet
    /// opens the health stream whenever its `ResourceHealthStatus` gate is on, listed or not
    /// (same file, `add`); the entry tells other readers what the socket serves.
    pub fn supported_versions() -> Vec<String> {
        vec![
            service_names::DRA_V1.to_owned(),
            service_names::DRA_V1BETA1.to_owned(),
            service_names::HEALTH_V1ALPHA1.to_owned(),
        ]
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(
        &self,
        _request: Request<InfoRequest>,
    ) -> Result<Response<PluginInfo>, Status> {
        tracing::debug!("kubelet asked for plugin info");
        Ok(Response::new(PluginInfo {
            r#type: service_names::DRA_PLUGIN_TYPE.to_owned(),
            name: self.driver_name.clone(),
            endpoint: self.dra_endpoint.to_string_lossy().into_owned(),
            supported_versions: Self::supported_versions(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = %self.driver_name, "kubelet registered the plugin");
        } else {
            tracing::error!(driver = %self.driver_name, error = %status.error, "kubelet failed to register the plugin");
        }
        self.registered.set(status.plugin_registered);
        self.metrics.set_registered(status.plugin_registered);
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
