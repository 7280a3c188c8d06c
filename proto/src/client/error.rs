//! Why a call of the kubelet-side client failed.

use std::path::PathBuf;
use std::time::Duration;

/// Why the kubelet-side client failed, in the kubelet's terms: a call it could not make, an
/// answer its rules refuse, or a claim the plugin could not prepare.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Dialling a plugin socket failed.
    #[error("dial {}: {source}", path.display())]
    Dial {
        /// The socket.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: tonic::transport::Error,
    },
    /// A call returned a gRPC error: the kubelet ignores the whole response.
    #[error("{method}: RPC failed: {source}")]
    Rpc {
        /// The gRPC method, e.g. `NodePrepareResources`.
        method: &'static str,
        /// The status the plugin (or the transport) returned.
        #[source]
        source: tonic::Status,
    },
    /// The plugin's registration answer is one the kubelet refuses (it has told the plugin
    /// so through `NotifyRegistrationStatus`).
    #[error("registration refused: {0}")]
    RegistrationRefused(String),
    /// A claim of the request has no entry in the response.
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
    /// A call did not finish in time (the kubelet gives up on DRA calls after 45 s).
    #[error("{method} did not finish within {after:?}")]
    Timeout {
        /// The gRPC method.
        method: &'static str,
        /// The limit.
        after: Duration,
    },
}

impl ClientError {
    /// A short, stable label of the variant (for metrics and reports).
    pub fn reason(&self) -> &'static str {
        match self {
            ClientError::Dial { .. } => "dial",
            ClientError::Rpc { .. } => "rpc",
            ClientError::RegistrationRefused(_) => "registration_refused",
            ClientError::MissingClaim(_) => "missing_claim",
            ClientError::UnknownClaim(_) => "unknown_claim",
            ClientError::ClaimFailed { .. } => "claim_failed",
            ClientError::Timeout { .. } => "timeout",
        }
    }
}
