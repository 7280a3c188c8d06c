//! The kubelet's side of the plugin sockets, as little of it as the demo needs: register
//! through the registration socket (`GetInfo`, pick `v1.DRAPlugin`,
//! `NotifyRegistrationStatus`), then batched `NodePrepareResources` /
//! `NodeUnprepareResources` calls over the DRA socket the plugin named.

use std::collections::HashMap;
use std::path::Path;

use kerf_proto::dra::v1;
use kerf_proto::pluginregistration::registration_client::RegistrationClient;
use kerf_proto::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus};
use kerf_proto::service_names::DRA_V1;

use tonic::transport::Channel;

use crate::error::{Error, Result};

/// A claim as the kubelet names it in its calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
}

/// One prepared device as the kubelet records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    /// Requests the device serves.
    pub request_names: Vec<String>,
    /// Pool (node) name.
    pub pool_name: String,
    /// Device name.
    pub device_name: String,
    /// CDI device IDs the runtime injects.
    pub cdi_device_ids: Vec<String>,
}

/// A plugin the kubelet stand-in registered.
#[derive(Debug, Clone)]
pub struct Registered {
    /// What the plugin's `GetInfo` returned.
    pub info: PluginInfo,
    channel: Channel,
}

/// Dials a Unix socket (`unix:<path>` in the kubelet).
///
/// # Errors
/// The socket does not accept the connection.
pub async fn dial(path: &Path) -> Result<Channel> {
    kerf_proto::dial::dial_unix(path, kerf_proto::dial::Authority::Localhost)
        .await
        .map_err(|e| Error::Kubelet(format!("dial {}: {e}", path.display())))
}

/// Registers the plugin behind `registration_socket` as the kubelet does and connects to its
/// DRA socket. The kubelet's rules: the type must be `DRAPlugin`, the endpoint absolute, and
/// `v1.DRAPlugin` among the supported versions (this stand-in speaks only v1); the outcome
/// is reported back with `NotifyRegistrationStatus` either way.
///
/// # Errors
/// A dial or RPC failure, or a registration the kubelet would refuse.
pub async fn register(registration_socket: &Path) -> Result<Registered> {
    let mut client = RegistrationClient::new(dial(registration_socket).await?);
    let info = client
        .get_info(InfoRequest {})
        .await
        .map_err(|s| rpc_error("GetInfo", &s))?
        .into_inner();
    let verdict = check_info(&info);
    let status = RegistrationStatus {
        plugin_registered: verdict.is_ok(),
        error: verdict.clone().err().unwrap_or_default(),
    };
    client
        .notify_registration_status(status)
        .await
        .map_err(|s| rpc_error("NotifyRegistrationStatus", &s))?;
    verdict.map_err(|e| Error::Kubelet(format!("registration refused: {e}")))?;
    let channel = dial(Path::new(&info.endpoint)).await?;
    Ok(Registered { info, channel })
}

/// This stand-in speaks only v1.
fn check_info(info: &PluginInfo) -> Result<(), String> {
    kerf_proto::client::choose_dra_service(info, &[DRA_V1]).map(|_| ())
}

fn rpc_error(method: &str, status: &tonic::Status) -> Error {
    Error::Kubelet(format!("{method}: {}", status.message()))
}

fn v1_claims(claims: &[ClaimRef]) -> Vec<v1::Claim> {
    claims
        .iter()
        .map(|c| v1::Claim {
            namespace: c.namespace.clone(),
            uid: c.uid.clone(),
            name: c.name.clone(),
        })
        .collect()
}

/// The kubelet's rule: every claim of the request must have an answer.
fn require_every_claim<T>(claims: &[ClaimRef], answers: &HashMap<String, T>) -> Result<()> {
    match claims.iter().find(|c| !answers.contains_key(&c.uid)) {
        Some(missing) => Err(Error::Kubelet(format!(
            "the plugin's answer has no entry for claim {}/{} (uid {})",
            missing.namespace, missing.name, missing.uid
        ))),
        None => Ok(()),
    }
}

impl Registered {
    /// One batched `NodePrepareResources` call: per claim UID, its devices or its error.
    ///
    /// # Errors
    /// The call failed (the kubelet ignores the whole answer then) or a claim has no entry.
    pub async fn prepare(
        &self,
        claims: &[ClaimRef],
    ) -> Result<HashMap<String, Result<Vec<PreparedDevice>, String>>> {
        let mut client = v1::dra_plugin_client::DraPluginClient::new(self.channel.clone());
        let request = v1::NodePrepareResourcesRequest {
            claims: v1_claims(claims),
        };
        let response = client
            .node_prepare_resources(request)
            .await
            .map_err(|s| rpc_error("NodePrepareResources", &s))?
            .into_inner();
        let answers: HashMap<String, Result<Vec<PreparedDevice>, String>> = response
            .claims
            .into_iter()
            .map(|(uid, answer)| {
                let result = if answer.error.is_empty() {
                    Ok(answer
                        .devices
                        .into_iter()
                        .map(|d| PreparedDevice {
                            request_names: d.request_names,
                            pool_name: d.pool_name,
                            device_name: d.device_name,
                            cdi_device_ids: d.cdi_device_ids,
                        })
                        .collect())
                } else {
                    Err(answer.error)
                };
                (uid, result)
            })
            .collect();
        require_every_claim(claims, &answers)?;
        Ok(answers)
    }

    /// One batched `NodeUnprepareResources` call: per claim UID, `Ok` or its error.
    ///
    /// # Errors
    /// The call failed or a claim has no entry.
    pub async fn unprepare(
        &self,
        claims: &[ClaimRef],
    ) -> Result<HashMap<String, Result<(), String>>> {
        let mut client = v1::dra_plugin_client::DraPluginClient::new(self.channel.clone());
        let request = v1::NodeUnprepareResourcesRequest {
            claims: v1_claims(claims),
        };
        let response = client
            .node_unprepare_resources(request)
            .await
            .map_err(|s| rpc_error("NodeUnprepareResources", &s))?
            .into_inner();
        let answers: HashMap<String, Result<(), String>> = response
            .claims
            .into_iter()
            .map(|(uid, answer)| {
                let result = if answer.error.is_empty() {
                    Ok(())
                } else {
                    Err(answer.error)
                };
                (uid, result)
            })
            .collect();
        require_every_claim(claims, &answers)?;
        Ok(answers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(kind: &str, endpoint: &str, versions: &[&str]) -> PluginInfo {
        PluginInfo {
            r#type: kind.to_owned(),
            name: "gpu.kerf.dev".to_owned(),
            endpoint: endpoint.to_owned(),
            supported_versions: versions.iter().map(|v| (*v).to_owned()).collect(),
        }
    }

    #[test]
    fn registration_rules() {
        assert!(check_info(&info("DRAPlugin", "/x/dra.sock", &["v1.DRAPlugin"])).is_ok());
        assert!(check_info(&info("CSIPlugin", "/x/dra.sock", &["v1.DRAPlugin"])).is_err());
        assert!(check_info(&info("DRAPlugin", "x/dra.sock", &["v1.DRAPlugin"])).is_err());
        assert!(check_info(&info("DRAPlugin", "/x/dra.sock", &["v1beta1.DRAPlugin"])).is_err());
    }

    #[test]
    fn every_claim_needs_an_answer() {
        let claims = [ClaimRef {
            namespace: "ns".into(),
            name: "c".into(),
            uid: "u1".into(),
        }];
        let answers: HashMap<String, Result<(), String>> = HashMap::new();
        assert!(require_every_claim(&claims, &answers).is_err());
    }
}
