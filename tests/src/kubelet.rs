//! A kubelet stand-in built only from kerf's protos: it registers a DRA plugin the way the
//! kubelet does and calls `NodePrepareResources` / `NodeUnprepareResources` over the
//! plugin's real Unix sockets, applying the kubelet's rules to the answers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kerf_proto::dra::{v1, v1beta1};
use kerf_proto::pluginregistration::registration_client::RegistrationClient;
use kerf_proto::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus};
use tonic::transport::Channel;

/// The DRA services this kubelet knows, as a 1.34+ kubelet does.
pub const KNOWN_SERVICES: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];

/// Errors of the fake kubelet.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    /// Dialling a socket failed.
    #[error("dial {0}: {1}")]
    Dial(PathBuf, #[source] tonic::transport::Error),
    /// A call returned a gRPC error: the kubelet ignores the whole response.
    #[error("RPC failed: {0}")]
    Rpc(#[from] tonic::Status),
    /// The plugin's registration answer is unacceptable.
    #[error("registration refused: {0}")]
    Registration(String),
    /// A claim of the request had no entry in the response.
    #[error("response has no entry for claim {0}")]
    MissingClaim(String),
    /// The response has an entry for a claim that was not in the request.
    #[error("response has an entry for claim {0}, which was not requested")]
    UnknownClaim(String),
    /// The plugin answered a claim with an error (its devices, if any, are ignored).
    #[error("claim {uid}: {error}")]
    ClaimFailed {
        /// UID of the claim.
        uid: String,
        /// The plugin's message.
        error: String,
    },
    /// No plugin of this driver is registered.
    #[error("driver {0} is not registered")]
    NotRegistered(String),
    /// A call did not finish in time (the kubelet's limit is 45 s).
    #[error("call timed out after {0:?}")]
    Timeout(std::time::Duration),
}

/// Connects to a Unix socket as the kubelet does (`unix:<path>`).
///
/// # Errors
/// The socket cannot be dialled.
pub async fn dial(path: &Path) -> Result<Channel, KubeletError> {
    kerf_proto::dial::dial_unix(path, kerf_proto::dial::Authority::Localhost)
        .await
        .map_err(|e| KubeletError::Dial(path.to_owned(), e))
}

/// A claim reference as the kubelet sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// Namespace.
    pub namespace: String,
    /// UID.
    pub uid: String,
    /// Name.
    pub name: String,
}

impl Claim {
    /// Builds a claim reference.
    pub fn new(namespace: &str, name: &str, uid: &str) -> Self {
        Claim {
            namespace: namespace.into(),
            uid: uid.into(),
            name: name.into(),
        }
    }
}

/// One prepared device as the kubelet stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// Requests served.
    pub request_names: Vec<String>,
    /// Pool.
    pub pool_name: String,
    /// Device.
    pub device_name: String,
    /// CDI IDs to pass to the runtime.
    pub cdi_device_ids: Vec<String>,
    /// Share ID (v1 only).
    pub share_id: Option<String>,
}

/// The kubelet's view of one claim's prepare answer.
pub type ClaimResult = Result<Vec<Device>, String>;

/// Which DRA API version the kubelet picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraVersion {
    /// `v1.DRAPlugin`.
    V1,
    /// `v1beta1.DRAPlugin`.
    V1beta1,
}

/// A registered plugin, as the kubelet holds it.
#[derive(Debug, Clone)]
pub struct RegisteredPlugin {
    /// What GetInfo returned.
    pub info: PluginInfo,
    /// The version the kubelet chose.
    pub version: DraVersion,
    channel: Channel,
}

/// Registers the plugin behind `registration_socket`: `GetInfo`, pick the first of the
/// plugin's `supported_versions` that `known` contains, `NotifyRegistrationStatus`.
///
/// # Errors
/// Dial or RPC failure, wrong plugin type, or no common version (the kubelet then reports
/// the failure to the plugin before returning the error, as the real one does).
pub async fn register(
    registration_socket: &Path,
    known: &[&str],
) -> Result<RegisteredPlugin, KubeletError> {
    let mut client = RegistrationClient::new(dial(registration_socket).await?);
    let info = client.get_info(InfoRequest {}).await?.into_inner();
    let chosen = check_info(&info, known);
    let status = match &chosen {
        Ok(_) => RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        },
        Err(e) => RegistrationStatus {
            plugin_registered: false,
            error: e.clone(),
        },
    };
    client.notify_registration_status(status).await?;
    let version = chosen.map_err(KubeletError::Registration)?;
    let channel = dial(Path::new(&info.endpoint)).await?;
    Ok(RegisteredPlugin {
        info,
        version,
        channel,
    })
}

fn check_info(info: &PluginInfo, known: &[&str]) -> Result<DraVersion, String> {
    match kerf_proto::client::choose_dra_service(info, known)? {
        "v1.DRAPlugin" => Ok(DraVersion::V1),
        "v1beta1.DRAPlugin" => Ok(DraVersion::V1beta1),
        other => Err(format!("this kubelet does not speak {other}")),
    }
}

impl RegisteredPlugin {
    /// One batched `NodePrepareResources` call. Applies the kubelet's rules: an RPC error
    /// voids the whole response, and every claim must have an entry.
    ///
    /// # Errors
    /// RPC failure or a claim without an entry.
    pub async fn prepare(
        &self,
        claims: &[Claim],
    ) -> Result<HashMap<String, ClaimResult>, KubeletError> {
        let answers: HashMap<String, ClaimResult> = match self.version {
            DraVersion::V1 => {
                let mut client = v1::dra_plugin_client::DraPluginClient::new(self.channel.clone());
                let request = v1::NodePrepareResourcesRequest {
                    claims: claims.iter().map(v1_claim).collect(),
                };
                let response = client.node_prepare_resources(request).await?.into_inner();
                response
                    .claims
                    .into_iter()
                    .map(|(uid, r)| (uid, v1_result(r)))
                    .collect()
            }
            DraVersion::V1beta1 => {
                let mut client =
                    v1beta1::dra_plugin_client::DraPluginClient::new(self.channel.clone());
                let request = v1beta1::NodePrepareResourcesRequest {
                    claims: claims.iter().map(v1beta1_claim).collect(),
                };
                let response = client.node_prepare_resources(request).await?.into_inner();
                response
                    .claims
                    .into_iter()
                    .map(|(uid, r)| (uid, v1beta1_result(r)))
                    .collect()
            }
        };
        require_every_claim(claims, answers)
    }

    /// One batched `NodeUnprepareResources` call, with the same rules.
    ///
    /// # Errors
    /// RPC failure or a claim without an entry.
    pub async fn unprepare(
        &self,
        claims: &[Claim],
    ) -> Result<HashMap<String, Result<(), String>>, KubeletError> {
        let answers: HashMap<String, Result<(), String>> = match self.version {
            DraVersion::V1 => {
                let mut client = v1::dra_plugin_client::DraPluginClient::new(self.channel.clone());
                let request = v1::NodeUnprepareResourcesRequest {
                    claims: claims.iter().map(v1_claim).collect(),
                };
                let response = client.node_unprepare_resources(request).await?.into_inner();
                response
                    .claims
                    .into_iter()
                    .map(|(uid, r)| (uid, error_result(r.error)))
                    .collect()
            }
            DraVersion::V1beta1 => {
                let mut client =
                    v1beta1::dra_plugin_client::DraPluginClient::new(self.channel.clone());
                let request = v1beta1::NodeUnprepareResourcesRequest {
                    claims: claims.iter().map(v1beta1_claim).collect(),
                };
                let response = client.node_unprepare_resources(request).await?.into_inner();
                response
                    .claims
                    .into_iter()
                    .map(|(uid, r)| (uid, error_result(r.error)))
                    .collect()
            }
        };
        require_every_claim(claims, answers)
    }
}

/// The kubelet refuses a response with an entry for a claim it did not ask about, or without
/// an entry for one it did.
fn require_every_claim<T>(
    claims: &[Claim],
    answers: HashMap<String, T>,
) -> Result<HashMap<String, T>, KubeletError> {
    if let Some(unknown) = answers
        .keys()
        .find(|uid| !claims.iter().any(|c| &c.uid == *uid))
    {
        return Err(KubeletError::UnknownClaim(unknown.clone()));
    }
    match claims.iter().find(|c| !answers.contains_key(&c.uid)) {
        Some(missing) => Err(KubeletError::MissingClaim(missing.uid.clone())),
        None => Ok(answers),
    }
}

fn error_result(error: String) -> Result<(), String> {
    if error.is_empty() { Ok(()) } else { Err(error) }
}

fn v1_claim(c: &Claim) -> v1::Claim {
    v1::Claim {
        namespace: c.namespace.clone(),
        uid: c.uid.clone(),
        name: c.name.clone(),
    }
}

fn v1beta1_claim(c: &Claim) -> v1beta1::Claim {
    v1beta1::Claim {
        namespace: c.namespace.clone(),
        uid: c.uid.clone(),
        name: c.name.clone(),
    }
}

/// A per-claim error makes the kubelet ignore the devices.
fn v1_result(r: v1::NodePrepareResourceResponse) -> ClaimResult {
    if !r.error.is_empty() {
        return Err(r.error);
    }
    Ok(r.devices
        .into_iter()
        .map(|d| Device {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: d.share_id,
        })
        .collect())
}

fn v1beta1_result(r: v1beta1::NodePrepareResourceResponse) -> ClaimResult {
    if !r.error.is_empty() {
        return Err(r.error);
    }
    Ok(r.devices
        .into_iter()
        .map(|d| Device {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(versions: &[&str]) -> PluginInfo {
        PluginInfo {
            r#type: "DRAPlugin".into(),
            name: "gpu.kerf.dev".into(),
            endpoint: "/x/dra.sock".into(),
            supported_versions: versions.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn picks_the_plugins_first_known_version() {
        assert_eq!(
            check_info(
                &info(&["v1.DRAPlugin", "v1beta1.DRAPlugin"]),
                &KNOWN_SERVICES
            ),
            Ok(DraVersion::V1)
        );
        assert_eq!(
            check_info(
                &info(&["v9.DRAPlugin", "v1beta1.DRAPlugin"]),
                &KNOWN_SERVICES
            ),
            Ok(DraVersion::V1beta1)
        );
        assert_eq!(
            check_info(
                &info(&["v1.DRAPlugin", "v1beta1.DRAPlugin"]),
                &["v1beta1.DRAPlugin"]
            ),
            Ok(DraVersion::V1beta1)
        );
        assert!(check_info(&info(&[]), &KNOWN_SERVICES).is_err());
    }

    #[test]
    fn a_missing_claim_is_an_error() {
        let claims = [Claim::new("ns", "a", "1"), Claim::new("ns", "b", "2")];
        let answers = HashMap::from([("1".to_owned(), Ok::<(), String>(()))]);
        assert!(
            matches!(require_every_claim(&claims, answers), Err(KubeletError::MissingClaim(uid)) if uid == "2")
        );
    }

    #[test]
    fn an_unrequested_claim_is_an_error() {
        let claims = [Claim::new("ns", "a", "1")];
        let answers = HashMap::from([
            ("1".to_owned(), Ok::<(), String>(())),
            ("3".to_owned(), Ok(())),
        ]);
        assert!(
            matches!(require_every_claim(&claims, answers), Err(KubeletError::UnknownClaim(uid)) if uid == "3")
        );
    }
}
