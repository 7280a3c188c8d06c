//! The one error type of kerf-controller.

/// Everything that can go wrong in the controller.
///
/// Each variant has a stable [`Error::reason`] used as a metric label. The enum is
/// non-exhaustive: the claim allocation reconciler adds its own variants.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// An error decoding or building kerf's Kubernetes objects (opaque parameters, quantities).
    #[error(transparent)]
    Api(#[from] kerf_api::Error),
    /// A domain error from kerf-core.
    #[error(transparent)]
    Core(#[from] kerf_core::Error),
    /// A watch stream failed for good.
    #[error("watch: {0}")]
    Watch(#[from] kube::runtime::watcher::Error),
    /// A write to the API server failed; names the write, so that its failure can be told on
    /// the objects it concerns ([`crate::context::Context::report_write_failure`]).
    #[error("{write}: Kubernetes API: {source}")]
    Write {
        /// The write.
        write: Box<Write>,
        /// The API's answer.
        #[source]
        source: kube::Error,
    },
    /// Serialising an object to send to the API server failed.
    #[error("serialising {what}: {source}")]
    Serialize {
        /// What was being serialised.
        what: &'static str,
        /// The serialiser's error.
        #[source]
        source: serde_json::Error,
    },
    /// An object from the API server lacks a field every stored object has.
    #[error("{kind} object without metadata.{field}")]
    MissingField {
        /// The kind of the object.
        kind: &'static str,
        /// The missing metadata field, e.g. `name` or `uid`.
        field: &'static str,
    },
    /// The configuration is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The Lease-based leader election failed to start or run.
    #[error("leader election: {0}")]
    LeaderElection(#[from] kube_lease_manager::LeaseManagerError),
    /// This replica was the leader and no longer is; it must stop writing and exit.
    #[error("leadership lost: {0}")]
    LeadershipLost(String),
    /// A controller stopped although nobody asked it to.
    #[error("controller {name} stopped unexpectedly: {message}")]
    ControllerStopped {
        /// The controller's name, e.g. `gpuclass`.
        name: &'static str,
        /// What it reported.
        message: String,
    },
    /// Logging could not be set up, e.g. a `--log-filter` that does not parse.
    #[error(transparent)]
    Logging(#[from] kerf_ops::logging::LoggingError),
    /// No client for the API server of the environment's kubeconfig (in a pod, its
    /// ServiceAccount).
    #[error("connecting to the Kubernetes API: {0}")]
    Connect(#[source] kube::Error),
    /// The HTTP server of `/metrics`, `/healthz` and `/readyz` failed.
    #[error("HTTP server: {0}")]
    Http(#[source] std::io::Error),
    /// The admission webhook's listener could not be bound or failed.
    #[error("admission webhook server: {0}")]
    Webhook(#[source] std::io::Error),
    /// A TLS key or certificate of the admission webhook could not be made or loaded.
    #[error("webhook TLS: {0}")]
    Tls(String),
    /// A certificate or key file of the admission webhook (cert-manager mode) is unusable.
    #[error("webhook certificate file {}: {message}", path.display())]
    CertFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        message: String,
    },
}

impl Error {
    /// A short, stable, low-cardinality label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Kube(e) | Error::Write { source: e, .. } => kube_reason(e),
            Error::Api(e) => e.reason(),
            Error::Core(e) => e.reason(),
            Error::Watch(_) => "watch",
            Error::Serialize { .. } => "serialize",
            Error::MissingField { .. } => "missing_field",
            Error::Config(_) => "config",
            Error::LeaderElection(_) => "leader_election",
            Error::LeadershipLost(_) => "leadership_lost",
            Error::ControllerStopped { .. } => "controller_stopped",
            Error::Logging(_) => "logging",
            Error::Connect(_) => "connect",
            Error::Http(_) => "http",
            Error::Webhook(_) => "webhook",
            Error::Tls(_) => "tls",
            Error::CertFile { .. } => "cert_file",
        }
    }

    /// Whether the error is a normal part of optimistic concurrency rather than a fault: a
    /// conflict (the object changed since it was read) or a NotFound (it was deleted under the
    /// reconcile). The retry that follows sees the new state; such errors are logged at debug
    /// and only [`Error::reason`] counts them, unless the same object keeps failing.
    pub fn is_routine(&self) -> bool {
        matches!(self.reason(), "kube_conflict" | "kube_not_found")
    }

    /// Builds an [`Error::Write`]: `write` failed with `source`.
    pub fn write(write: Write, source: kube::Error) -> Self {
        Error::Write {
            write: Box::new(write),
            source,
        }
    }

    /// Builds an [`Error::Serialize`] for `what`.
    pub fn serialize(what: &'static str, source: serde_json::Error) -> Self {
        Error::Serialize { what, source }
    }
}

/// Splits API errors into the few classes an operator acts on differently.
fn kube_reason(error: &kube::Error) -> &'static str {
    match error {
        kube::Error::Api(status) if status.is_conflict() => "kube_conflict",
        kube::Error::Api(status) if status.is_not_found() => "kube_not_found",
        kube::Error::Api(status) if status.is_forbidden() => "kube_forbidden",
        kube::Error::Api(_) => "kube_api",
        _ => "kube_transport",
    }
}

/// Result alias for kerf-controller.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One write of the controller, named for its failure report: `verb` on `resource` (plural,
/// with the subresource, as RBAC names it) of object `name` in `namespace`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// RBAC verb: `patch`, `create`, `update`.
    pub verb: &'static str,
    /// Plural resource and subresource, e.g. `resourceclaims/status`.
    pub resource: &'static str,
    /// Namespace of the object; `None` for cluster-scoped ones.
    pub namespace: Option<String>,
    /// Name of the object.
    pub name: String,
}

impl Write {
    /// A `patch` of `resource` on the object `name` in `namespace`.
    pub fn patch(resource: &'static str, namespace: Option<&str>, name: &str) -> Self {
        Self {
            verb: "patch",
            resource,
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
        }
    }

    /// An `update` (a replace, `PUT`) of `resource` on the object `name` in `namespace`.
    pub fn update(resource: &'static str, namespace: Option<&str>, name: &str) -> Self {
        Self {
            verb: "update",
            ..Self::patch(resource, namespace, name)
        }
    }
}

impl std::fmt::Display for Write {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.namespace {
            Some(namespace) => write!(
                f,
                "{} {} {namespace}/{}",
                self.verb, self.resource, self.name
            ),
            None => write!(f, "{} {} {}", self.verb, self.resource, self.name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, reason: &str) -> Error {
        Error::Kube(kube::Error::Api(Box::new(
            kube::core::Status::failure("x", reason).with_code(code),
        )))
    }

    #[test]
    fn api_errors_are_classified_by_code() {
        assert_eq!(api_error(409, "Conflict").reason(), "kube_conflict");
        assert_eq!(api_error(404, "NotFound").reason(), "kube_not_found");
        assert_eq!(api_error(403, "Forbidden").reason(), "kube_forbidden");
        assert_eq!(api_error(500, "InternalError").reason(), "kube_api");
    }

    #[test]
    fn only_conflicts_and_not_found_are_routine() {
        assert!(api_error(409, "Conflict").is_routine());
        assert!(api_error(404, "NotFound").is_routine());
        assert!(!api_error(403, "Forbidden").is_routine());
        assert!(!api_error(500, "InternalError").is_routine());
        assert!(!Error::Config("x".to_owned()).is_routine());
    }

    #[test]
    fn a_failed_write_is_classified_by_its_answer() {
        let Error::Kube(conflict) = api_error(409, "Conflict") else {
            unreachable!()
        };
        let write = Write::patch("pods", Some("ns"), "p");
        let error = Error::write(write, conflict);
        assert_eq!(error.reason(), "kube_conflict");
        assert!(error.is_routine());
        assert!(
            error.to_string().starts_with("patch pods ns/p: "),
            "{error}"
        );
    }

    #[test]
    fn nested_errors_keep_their_own_reason() {
        let err = Error::from(kerf_api::Error::config("spec.selector.minMemory", "bad"));
        assert_eq!(err.reason(), "invalid_config");
        assert!(err.to_string().contains("spec.selector.minMemory"), "{err}");
    }
}
