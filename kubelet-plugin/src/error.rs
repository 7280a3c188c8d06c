//! The one error type of the kubelet plugin.

use std::path::PathBuf;

use crate::prepare_error::PrepareError;

/// Everything that can go wrong in the kubelet plugin.
///
/// Each variant has a stable [`Error::reason`] used as a metric label.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A domain error from kerf-core (inventory, CDI, checkpoint, names).
    #[error(transparent)]
    Core(#[from] kerf_core::Error),
    /// An error decoding or building Kubernetes objects.
    #[error(transparent)]
    Api(#[from] kerf_api::Error),
    /// A Kubernetes API call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A write to the API server failed; names it, so that its failure can be told on the
    /// object it concerns ([`crate::write_failures`]).
    #[error("{verb} {resource} {name}: Kubernetes API: {source}")]
    Write {
        /// RBAC verb: `patch`, `create`, `delete`.
        verb: &'static str,
        /// Plural resource with subresource, e.g. `resourceslices`.
        resource: &'static str,
        /// The object's name.
        name: String,
        /// The API's answer, boxed so that this variant keeps the error no larger than
        /// [`Error::Kube`] (errors travel by value through every `Result`).
        #[source]
        source: Box<kube::Error>,
    },
    /// NVML could not be loaded or queried.
    #[error("NVML: {0}")]
    Nvml(String),
    /// Neither NVML nor a mock inventory is available.
    #[error(
        "no GPU discovery available: NVML could not be loaded ({0}); pass --mock-gpus PROFILE or --mock-inventory FILE to run with mock GPUs"
    )]
    NoDiscovery(String),
    /// A gRPC server failed.
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// A socket or directory could not be set up.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The configuration is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A claim cannot be prepared as the kubelet asked; the message names the field and value
    /// at fault and reaches the user as the claim's error.
    #[error(transparent)]
    Prepare(#[from] PrepareError),
    /// A failure inside the plugin rather than in its input or surroundings: a task panicked
    /// or a writer task is gone. Counted apart so that it is not mistaken for a bad setting.
    #[error("internal failure in {what}: {detail}")]
    Internal {
        /// The part of the plugin that failed, e.g. `the checkpoint writer`.
        what: &'static str,
        /// What happened to it, e.g. the panic message of its task.
        detail: String,
    },
    /// A GPU's CUDA MPS control daemon could not be started or stopped, or its compute mode
    /// not set; `message` carries the tool's own words.
    #[error("MPS control daemon for GPU {gpu}: {message}")]
    Mps {
        /// The GPU's UUID.
        gpu: String,
        /// What failed, with the tool's stderr.
        message: String,
    },
    /// A GPU's time slice could not be set; `message` carries `nvidia-smi`'s own words.
    #[error("time slice of GPU {gpu}: {message}")]
    TimeSlice {
        /// The GPU's UUID.
        gpu: String,
        /// What failed, with the tool's stderr.
        message: String,
    },
    /// The HTTP server of `/metrics`, `/healthz` and `/readyz` failed.
    #[error("HTTP server: {0}")]
    Http(#[source] std::io::Error),
    /// A MIG instance of a dynamic-MIG GPU could not be created, destroyed or listed;
    /// `message` carries the driver's own words.
    #[error("MIG {call} on GPU {gpu}: {message}")]
    Mig {
        /// The driver call, e.g. `create GPU instance`.
        call: &'static str,
        /// The GPU's UUID.
        gpu: String,
        /// How it failed, as far as kerf acts on it.
        kind: MigFailureKind,
        /// The driver's words.
        message: String,
    },
}

impl Error {
    /// A short, stable, low-cardinality label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Core(e) => e.reason(),
            Error::Api(e) => e.reason(),
            Error::Kube(_) | Error::Write { .. } => "kube_api",
            Error::Nvml(_) => "nvml",
            Error::NoDiscovery(_) => "no_discovery",
            Error::Transport(_) => "transport",
            Error::Io { .. } => "io",
            Error::Config(_) => "config",
            Error::Prepare(e) => e.reason(),
            Error::Internal { .. } => "internal",
            Error::Mps { .. } => "mps",
            Error::TimeSlice { .. } => "time_slice",
            Error::Http(_) => "http",
            Error::Mig { .. } => "mig",
        }
    }

    /// Builds an [`Error::Internal`] for `what`, e.g. from the [`tokio::task::JoinError`] of
    /// its task.
    pub fn internal(what: &'static str, detail: impl std::fmt::Display) -> Self {
        Error::Internal {
            what,
            detail: detail.to_string(),
        }
    }

    /// Builds an [`Error::Write`]: `verb` of `resource` object `name` failed with `source`.
    pub fn write(
        verb: &'static str,
        resource: &'static str,
        name: &str,
        source: kube::Error,
    ) -> Self {
        Error::Write {
            verb,
            resource,
            name: name.to_owned(),
            source: Box::new(source),
        }
    }

    /// Builds an [`Error::Io`] for `op` on `path`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// Result alias for the kubelet plugin.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How a MIG call failed, as far as kerf acts on it; the driver's words are kept in
/// [`crate::Error::Mig`]'s message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigFailureKind {
    /// The instance does not exist (`NVML_ERROR_NOT_FOUND`): a destroy has nothing to do.
    NotFound,
    /// The placement is taken or the GPU has no room (`NVML_ERROR_INSUFFICIENT_RESOURCES`).
    InsufficientResources,
    /// The driver refused the arguments (`NVML_ERROR_INVALID_ARGUMENT`, a profile the GPU
    /// lacks, a placement outside it).
    InvalidArgument,
    /// The instance is in use (`NVML_ERROR_IN_USE`): a process still runs on it.
    InUse,
    /// Anything else (driver not loaded, MIG mode off, an injected mock failure, I/O).
    Other,
}

impl MigFailureKind {
    /// A short, stable label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            MigFailureKind::NotFound => "not_found",
            MigFailureKind::InsufficientResources => "insufficient_resources",
            MigFailureKind::InvalidArgument => "invalid_argument",
            MigFailureKind::InUse => "in_use",
            MigFailureKind::Other => "other",
        }
    }
}
