//! The error type of kerf-cli's library.

use std::path::{Path, PathBuf};

/// What can go wrong in a `kerf` command.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or directory operation failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The command's settings are unusable.
    #[error("{0}")]
    Config(String),
    /// The kubelet plugin failed to start, serve or stop.
    #[error("kubelet plugin: {0}")]
    Plugin(#[from] kerf_kubelet_plugin::Error),
    /// An inventory or CDI operation of kerf-core failed.
    #[error(transparent)]
    Core(#[from] kerf_core::Error),
    /// Building Kubernetes objects failed.
    #[error(transparent)]
    Api(#[from] kerf_api::Error),
    /// The kubelet stand-in could not talk to the plugin, or the plugin's answer breaks the
    /// kubelet's rules.
    #[error("kubelet: {0}")]
    Kubelet(#[from] kerf_proto::client::ClientError),
    /// The plugin could not unprepare some claims (every failure, in order).
    #[error("NodeUnprepareResources failed: {0}")]
    Unprepare(String),
    /// A container runtime step failed.
    #[error("containers: {0}")]
    Containers(String),
    /// JSON encoding failed.
    #[error("{what}: {source}")]
    Json {
        /// What was being encoded.
        what: &'static str,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// A Kubernetes API request failed.
    #[error("{action}: {source}")]
    Kube {
        /// What was being done, e.g. `listing ResourceSlices`.
        action: &'static str,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// A YAML file, or an object in it, is unusable (the message names the file and object).
    #[error("{0}")]
    Yaml(String),
}

impl Error {
    /// A short, stable label of the error kind.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::Config(_) => "config",
            Error::Plugin(_) => "plugin",
            Error::Core(_) => "core",
            Error::Api(_) => "api",
            Error::Kubelet(_) | Error::Unprepare(_) => "kubelet",
            Error::Containers(_) => "containers",
            Error::Json { .. } => "json",
            Error::Kube { .. } => "kube",
            Error::Yaml(_) => "yaml",
        }
    }

    /// An [`Error::Io`] for `action` on `path`.
    pub fn io(action: &'static str, path: impl AsRef<Path>, source: std::io::Error) -> Self {
        Error::Io {
            action,
            path: path.as_ref().to_owned(),
            source,
        }
    }
}

/// The result type of kerf-cli's library.
pub type Result<T, E = Error> = std::result::Result<T, E>;
