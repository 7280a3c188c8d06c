//! The kubelet's side of a DRA plugin's sockets: one client that imitates the kubelet for
//! every caller (the fake kubelet of the tests, the demo, the benchmarks).
//!
//! - Registration, as the kubelet's plugin watcher does it
//!   (`pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go`): `GetInfo`, the
//!   first of the plugin's `supported_versions` this kubelet knows
//!   (`choose_dra_service`), `NotifyRegistrationStatus` with the verdict (a refusal too),
//!   then a connection to the plugin's DRA endpoint. The watcher's `dial` uses grpc-go with
//!   a context dialer and no `WithAuthority`, so registration calls carry `:authority` = the
//!   registration socket's path ([`Authority::SocketPath`]); the DRA client
//!   (`pkg/kubelet/cm/dra/plugin`) dials `unix:<endpoint>` and sends `localhost`
//!   ([`Authority::Localhost`]). [`KubeletClient::registration_authority`] and
//!   [`KubeletClient::dra_authority`] choose other forms.
//! - Batched `NodePrepareResources` / `NodeUnprepareResources` over the chosen API version
//!   ([`RegisteredPlugin`]), with the kubelet's rules: an RPC error voids the whole
//!   response, every requested claim must have an entry and no other claim may, and
//!   per-claim errors come back per claim; each call optionally limited in time (the
//!   kubelet's limit is [`KUBELET_CALL_TIMEOUT`]).

mod error;
mod health;
mod response;

use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::time::Duration;

use tonic::transport::Channel;

pub use self::error::ClientError;
pub use self::health::HealthStream;
pub use self::response::{ClaimResult, PrepareResponse, UnprepareResponse};
pub use crate::device::PreparedDevice;
use crate::dial::{Authority, dial_unix};
use crate::dra::{v1, v1beta1};
use crate::pluginregistration::registration_client::RegistrationClient;
use crate::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus};
use crate::service_names::{DRA_PLUGIN_TYPE, DRA_V1, DRA_V1BETA1};

/// The DRA services a 1.34+ kubelet knows, in its order of preference.
pub const KNOWN_SERVICES: [&str; 2] = [DRA_V1, DRA_V1BETA1];

/// How long the kubelet lets a `NodePrepareResources` / `NodeUnprepareResources` call take.
pub const KUBELET_CALL_TIMEOUT: Duration = Duration::from_secs(45);

const GET_INFO: &str = "GetInfo";
const NOTIFY_REGISTRATION_STATUS: &str = "NotifyRegistrationStatus";
const NODE_PREPARE_RESOURCES: &str = "NodePrepareResources";
const NODE_UNPREPARE_RESOURCES: &str = "NodeUnprepareResources";

/// Judges a DRA plugin's `GetInfo` answer as the kubelet does: the type must be `DRAPlugin`,
/// the endpoint an absolute path, and one of the plugin's `supported_versions` known; the
/// kubelet walks the plugin's list (newest first) and takes the first it knows.
///
/// # Errors
/// The reason the kubelet would refuse the registration, in its words.
fn choose_dra_service<'a, S: AsRef<str>>(
    info: &'a PluginInfo,
    known: &[S],
) -> Result<&'a str, String> {
    if info.r#type != DRA_PLUGIN_TYPE {
        return Err(format!(
            "plugin type {:?} is not {DRA_PLUGIN_TYPE}",
            info.r#type
        ));
    }
    if !info.endpoint.starts_with('/') {
        return Err(format!(
            "endpoint {:?} is not an absolute path",
            info.endpoint
        ));
    }
    info.supported_versions
        .iter()
        .map(String::as_str)
        .find(|v| known.iter().any(|k| k.as_ref() == *v))
        .ok_or_else(|| {
            format!(
                "none of the plugin's versions {:?} is supported",
                info.supported_versions
            )
        })
}

/// The DRA API version a kubelet chose for a plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraVersion {
    /// `v1.DRAPlugin` (kubelet 1.34+).
    V1,
    /// `v1beta1.DRAPlugin` (kubelet 1.32+).
    V1beta1,
}

impl DraVersion {
    /// The gRPC service name the plugin advertises for this version.
    fn service_name(self) -> &'static str {
        match self {
            DraVersion::V1 => DRA_V1,
            DraVersion::V1beta1 => DRA_V1BETA1,
        }
    }

    /// The version a service name stands for, if this client speaks it.
    fn from_service_name(name: &str) -> Option<Self> {
        [DraVersion::V1, DraVersion::V1beta1]
            .into_iter()
            .find(|v| v.service_name() == name)
    }
}

/// [`choose_dra_service`], then the version this client speaks for it.
///
/// # Errors
/// The reason the kubelet would refuse the registration.
fn choose_dra_version<S: AsRef<str>>(info: &PluginInfo, known: &[S]) -> Result<DraVersion, String> {
    let service = choose_dra_service(info, known)?;
    DraVersion::from_service_name(service)
        .ok_or_else(|| format!("this kubelet does not speak {service}"))
}

/// A claim as the kubelet names it in its DRA calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// Namespace of the ResourceClaim.
    pub namespace: String,
    /// UID of the ResourceClaim: the key of every answer.
    pub uid: String,
    /// Name of the ResourceClaim.
    pub name: String,
}

impl Claim {
    /// A claim reference.
    pub fn new(namespace: &str, name: &str, uid: &str) -> Self {
        Claim {
            namespace: namespace.to_owned(),
            uid: uid.to_owned(),
            name: name.to_owned(),
        }
    }
}

impl From<&Claim> for v1::Claim {
    fn from(c: &Claim) -> Self {
        v1::Claim {
            namespace: c.namespace.clone(),
            uid: c.uid.clone(),
            name: c.name.clone(),
        }
    }
}

impl From<&Claim> for v1beta1::Claim {
    fn from(c: &Claim) -> Self {
        v1beta1::Claim {
            namespace: c.namespace.clone(),
            uid: c.uid.clone(),
            name: c.name.clone(),
        }
    }
}

/// A kubelet's side of the plugin sockets: what it knows and how it dials. The default is
/// a 1.34+ kubelet: both DRA versions, the `:authority` forms the kubelet sends, and its
/// 45 s limit on DRA calls.
#[derive(Debug, Clone)]
pub struct KubeletClient {
    known_services: Vec<String>,
    registration_authority: Authority,
    dra_authority: Authority,
    call_timeout: Option<Duration>,
}

impl Default for KubeletClient {
    fn default() -> Self {
        KubeletClient {
            known_services: KNOWN_SERVICES.iter().map(|s| (*s).to_owned()).collect(),
            registration_authority: Authority::SocketPath,
            dra_authority: Authority::Localhost,
            call_timeout: Some(KUBELET_CALL_TIMEOUT),
        }
    }
}

impl KubeletClient {
    /// A 1.34+ kubelet, as [`KubeletClient::default`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The same kubelet knowing only `services`, e.g. `["v1beta1.DRAPlugin"]`.
    #[must_use]
    pub fn knowing<S: AsRef<str>>(mut self, services: &[S]) -> Self {
        self.known_services = services.iter().map(|s| s.as_ref().to_owned()).collect();
        self
    }

    /// The `:authority` sent on the registration socket ([`Authority::SocketPath`], the
    /// kubelet's, by default).
    #[must_use]
    pub fn registration_authority(mut self, authority: Authority) -> Self {
        self.registration_authority = authority;
        self
    }

    /// The `:authority` sent on the DRA socket ([`Authority::Localhost`], the kubelet's, by
    /// default).
    #[must_use]
    pub fn dra_authority(mut self, authority: Authority) -> Self {
        self.dra_authority = authority;
        self
    }

    /// The limit of every call, sent to the plugin as `grpc-timeout` as grpc-go sends a
    /// context deadline; `None` for no limit (the default is [`KUBELET_CALL_TIMEOUT`]).
    #[must_use]
    pub fn call_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// The DRA services this kubelet knows.
    pub fn known_services(&self) -> &[String] {
        &self.known_services
    }

    /// Registers the plugin behind `registration_socket` as the kubelet's plugin watcher
    /// does: `GetInfo`, the first of the plugin's `supported_versions` this kubelet knows,
    /// `NotifyRegistrationStatus` with the verdict, then a connection to the plugin's DRA
    /// endpoint.
    ///
    /// # Errors
    /// [`ClientError::Dial`], [`ClientError::Rpc`] or [`ClientError::Timeout`] when a socket
    /// or a call fails; [`ClientError::RegistrationRefused`] when the kubelet would refuse
    /// the plugin (after telling the plugin so, as the kubelet does).
    pub async fn register(
        &self,
        registration_socket: &Path,
    ) -> Result<RegisteredPlugin, ClientError> {
        let channel = dial(registration_socket, &self.registration_authority).await?;
        let mut registration = RegistrationClient::new(channel);
        let request = self.request(InfoRequest {});
        let info = self.call(GET_INFO, registration.get_info(request)).await?;
        let verdict = choose_dra_version(&info, &self.known_services);
        let status = RegistrationStatus {
            plugin_registered: verdict.is_ok(),
            error: verdict.as_ref().err().cloned().unwrap_or_default(),
        };
        let request = self.request(status);
        self.call(
            NOTIFY_REGISTRATION_STATUS,
            registration.notify_registration_status(request),
        )
        .await?;
        let version = verdict.map_err(ClientError::RegistrationRefused)?;
        let channel = dial(Path::new(&info.endpoint), &self.dra_authority).await?;
        Ok(RegisteredPlugin {
            info,
            version,
            channel,
            client: self.clone(),
        })
    }

    /// `message` as a request carrying the call limit.
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(timeout) = self.call_timeout {
            request.set_timeout(timeout);
        }
        request
    }

    /// Awaits one call within the call limit.
    async fn call<T>(
        &self,
        method: &'static str,
        call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, ClientError> {
        let answer = match self.call_timeout {
            None => call.await,
            Some(after) => tokio::time::timeout(after, call)
                .await
                .map_err(|_| ClientError::Timeout { method, after })?,
        };
        answer
            .map(tonic::Response::into_inner)
            .map_err(|source| ClientError::Rpc { method, source })
    }
}

async fn dial(path: &Path, authority: &Authority) -> Result<Channel, ClientError> {
    dial_unix(path, authority.clone())
        .await
        .map_err(|source| ClientError::Dial {
            path: path.to_owned(),
            source,
        })
}

/// One DRA call of a [`RegisteredPlugin`] over the API version it chose: the versions
/// differ only in their generated types, and the answer's type checks either's.
macro_rules! dra_call {
    ($plugin:expr, $claims:expr, $method:expr, $rpc:ident($request:ident), $answer:ident) => {
        match $plugin.version {
            DraVersion::V1 => {
                let answer = dra_call!(@call v1, $plugin, $claims, $method, $rpc($request));
                $answer::checked_v1($claims, answer)
            }
            DraVersion::V1beta1 => {
                let answer = dra_call!(@call v1beta1, $plugin, $claims, $method, $rpc($request));
                $answer::checked_v1beta1($claims, answer)
            }
        }
    };
    (@call $version:ident, $plugin:expr, $claims:expr, $method:expr, $rpc:ident($request:ident)) => {{
        let kubelet = &$plugin.client;
        let request = kubelet.request($version::$request {
            claims: $claims.iter().map($version::Claim::from).collect(),
        });
        let channel = $plugin.channel.clone();
        let mut dra = $version::dra_plugin_client::DraPluginClient::new(channel);
        kubelet.call($method, dra.$rpc(request)).await?
    }};
}

/// A plugin the kubelet registered: its `GetInfo` answer, the chosen version, and a
/// connection to its DRA socket. Cloning it shares the connection.
#[derive(Debug, Clone)]
pub struct RegisteredPlugin {
    /// What `GetInfo` returned.
    pub info: PluginInfo,
    /// The version the kubelet chose.
    pub version: DraVersion,
    channel: Channel,
    client: KubeletClient,
}

impl RegisteredPlugin {
    /// One batched `NodePrepareResources` call: per claim UID, its devices or its error.
    ///
    /// # Errors
    /// As [`RegisteredPlugin::prepare_response`].
    pub async fn prepare(
        &self,
        claims: &[Claim],
    ) -> Result<HashMap<String, ClaimResult>, ClientError> {
        Ok(self.prepare_response(claims).await?.into_results())
    }

    /// One batched `NodePrepareResources` call, its answer checked by the kubelet's rules
    /// and kept as it came (for callers that only look at it).
    ///
    /// # Errors
    /// [`ClientError::Rpc`] or [`ClientError::Timeout`] when the call fails (the kubelet
    /// ignores the whole answer then); [`ClientError::MissingClaim`] or
    /// [`ClientError::UnknownClaim`] when the answer's claims are not the request's.
    pub async fn prepare_response(&self, claims: &[Claim]) -> Result<PrepareResponse, ClientError> {
        dra_call!(
            self,
            claims,
            NODE_PREPARE_RESOURCES,
            node_prepare_resources(NodePrepareResourcesRequest),
            PrepareResponse
        )
    }

    /// One batched `NodeUnprepareResources` call: per claim UID, `Ok` or its error.
    ///
    /// # Errors
    /// As [`RegisteredPlugin::unprepare_response`].
    pub async fn unprepare(
        &self,
        claims: &[Claim],
    ) -> Result<HashMap<String, Result<(), String>>, ClientError> {
        Ok(self.unprepare_response(claims).await?.into_results())
    }

    /// One batched `NodeUnprepareResources` call, its answer checked by the kubelet's rules.
    ///
    /// # Errors
    /// As [`RegisteredPlugin::prepare_response`].
    pub async fn unprepare_response(
        &self,
        claims: &[Claim],
    ) -> Result<UnprepareResponse, ClientError> {
        dra_call!(
            self,
            claims,
            NODE_UNPREPARE_RESOURCES,
            node_unprepare_resources(NodeUnprepareResourcesRequest),
            UnprepareResponse
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(kind: &str, endpoint: &str, versions: &[&str]) -> PluginInfo {
        PluginInfo {
            r#type: kind.into(),
            name: "gpu.kerf.dev".into(),
            endpoint: endpoint.into(),
            supported_versions: versions.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn picks_the_plugins_first_known_service() {
        let both = info("DRAPlugin", "/x/dra.sock", &[DRA_V1, DRA_V1BETA1]);
        assert_eq!(
            choose_dra_service(&both, &[DRA_V1BETA1, DRA_V1]),
            Ok(DRA_V1)
        );
        assert_eq!(choose_dra_service(&both, &[DRA_V1BETA1]), Ok(DRA_V1BETA1));
        let future = info("DRAPlugin", "/x/dra.sock", &["v9.DRAPlugin", DRA_V1BETA1]);
        assert_eq!(
            choose_dra_service(&future, &[DRA_V1, DRA_V1BETA1]),
            Ok(DRA_V1BETA1)
        );
    }

    #[test]
    fn refuses_what_the_kubelet_refuses() {
        assert!(
            choose_dra_service(&info("CSIPlugin", "/x", &[DRA_V1]), &[DRA_V1])
                .unwrap_err()
                .contains("CSIPlugin")
        );
        assert!(
            choose_dra_service(&info("DRAPlugin", "x.sock", &[DRA_V1]), &[DRA_V1])
                .unwrap_err()
                .contains("absolute")
        );
        assert!(
            choose_dra_service(&info("DRAPlugin", "/x", &[]), &[DRA_V1])
                .unwrap_err()
                .contains("supported")
        );
    }

    #[test]
    fn picks_the_plugins_first_known_version() {
        let both = info("DRAPlugin", "/x/dra.sock", &[DRA_V1, DRA_V1BETA1]);
        assert_eq!(
            choose_dra_version(&both, &KNOWN_SERVICES),
            Ok(DraVersion::V1)
        );
        assert_eq!(
            choose_dra_version(&both, &[DRA_V1BETA1]),
            Ok(DraVersion::V1beta1)
        );
        let future = info("DRAPlugin", "/x/dra.sock", &["v9.DRAPlugin", DRA_V1BETA1]);
        assert_eq!(
            choose_dra_version(&future, &KNOWN_SERVICES),
            Ok(DraVersion::V1beta1)
        );
        let none = info("DRAPlugin", "/x/dra.sock", &[]);
        assert!(choose_dra_version(&none, &KNOWN_SERVICES).is_err());
    }

    /// The demo's kubelet, which knew only v1.
    #[test]
    fn a_v1_only_kubelet_refuses_a_v1beta1_only_plugin() {
        let v1_only = [DRA_V1];
        let ok = info("DRAPlugin", "/x/dra.sock", &[DRA_V1]);
        assert_eq!(choose_dra_version(&ok, &v1_only), Ok(DraVersion::V1));
        for refused in [
            info("CSIPlugin", "/x/dra.sock", &[DRA_V1]),
            info("DRAPlugin", "x/dra.sock", &[DRA_V1]),
            info("DRAPlugin", "/x/dra.sock", &[DRA_V1BETA1]),
        ] {
            assert!(
                choose_dra_version(&refused, &v1_only).is_err(),
                "{refused:?}"
            );
        }
    }

    #[test]
    fn a_known_service_this_client_does_not_speak_is_refused() {
        let future = info("DRAPlugin", "/x/dra.sock", &["v9.DRAPlugin"]);
        let reason = choose_dra_version(&future, &["v9.DRAPlugin"]).unwrap_err();
        assert!(reason.contains("v9.DRAPlugin"), "{reason}");
    }

    #[test]
    fn versions_and_service_names_match() {
        for version in [DraVersion::V1, DraVersion::V1beta1] {
            assert_eq!(
                DraVersion::from_service_name(version.service_name()),
                Some(version)
            );
        }
        assert_eq!(DraVersion::from_service_name("v1.CSIPlugin"), None);
    }

    #[test]
    fn the_default_client_is_the_kubelets() {
        let client = KubeletClient::new();
        assert_eq!(client.known_services(), KNOWN_SERVICES);
        assert_eq!(client.registration_authority, Authority::SocketPath);
        assert_eq!(client.dra_authority, Authority::Localhost);
        assert_eq!(client.call_timeout, Some(KUBELET_CALL_TIMEOUT));
        let client = client
            .knowing(&[DRA_V1BETA1])
            .registration_authority(Authority::Empty)
            .dra_authority(Authority::Absent)
            .call_timeout(None);
        assert_eq!(client.known_services(), [DRA_V1BETA1]);
        assert_eq!(client.registration_authority, Authority::Empty);
        assert_eq!(client.dra_authority, Authority::Absent);
        assert_eq!(client.call_timeout, None);
    }
}
