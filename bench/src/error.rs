//! The benchmarks' one error type.

use std::path::PathBuf;

/// Why a benchmark could not run. A missed target is not an error: it is reported in the
/// benchmark's output.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The benchmark name is not one of [`crate::NAMES`] or [`crate::EXTRA_NAMES`].
    #[error("unknown benchmark {0:?}; expected one of: {names}, {extra}", names = crate::NAMES.join(", "), extra = crate::EXTRA_NAMES.join(", "))]
    UnknownBenchmark(String),
    /// An option is out of range.
    #[error("invalid option {option}: {reason}")]
    InvalidOption {
        /// The option.
        option: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A file system step failed.
    #[error("{step} {path}: {source}")]
    Io {
        /// What was being done.
        step: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A data file (the openb trace) has a line that cannot be read.
    #[error("{}:{line}: {field}: {reason}", path.display())]
    Data {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// The column (or `header`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The work directory is on a file system where fsync costs nothing.
    #[error(
        "{path} is on a {fs_type} file system, where fsync is free and the prepare figures would mean nothing; choose a directory on a disk"
    )]
    NotOnDisk {
        /// The work directory.
        path: PathBuf,
        /// Its file system type.
        fs_type: String,
    },
    /// The directory meant to stand for a node's `/var/run/cdi` is not on a tmpfs.
    #[error(
        "{path} is on a {fs_type} file system; the node layout keeps CDI specs on a tmpfs, as /var/run/cdi is on a node: choose a tmpfs directory (--node-cdi-dir)"
    )]
    NotOnTmpfs {
        /// The directory.
        path: PathBuf,
        /// Its file system type.
        fs_type: String,
    },
    /// A kube client for the API server could not be built from its kubeconfig.
    #[error("kube client from {}: {message}", path.display())]
    ApiClient {
        /// The kubeconfig.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The plugin failed to start or stop.
    #[error("kubelet plugin: {0}")]
    Plugin(#[from] kerf_kubelet_plugin::Error),
    /// kerf-core refused something the benchmark built.
    #[error("kerf-core: {0}")]
    Core(#[from] kerf_core::Error),
    /// kerf-api refused something the benchmark built.
    #[error("kerf-api: {0}")]
    Api(#[from] kerf_api::Error),
    /// The kubelet-side client failed: a socket, a call, or an answer the kubelet's rules
    /// refuse.
    #[error("kubelet: {0}")]
    Kubelet(#[from] kerf_proto::client::ClientError),
    /// The plugin answered a claim with an error, or prepared it without devices.
    #[error("claim {uid}: {message}")]
    Claim {
        /// The claim's UID.
        uid: String,
        /// The plugin's message.
        message: String,
    },
    /// The fake GPU tools of the MPS cases cannot run: the program behind them does not act
    /// as the tools, or their directories do not suit them.
    #[error("fake GPU tools ({}): {message}", program.display())]
    FakeGpuTools {
        /// The program the tools link to.
        program: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A measurement child process misbehaved.
    #[error("measurement child: {0}")]
    Child(String),
    /// The workload did not allow the measurement (e.g. nothing could be placed).
    #[error("workload: {0}")]
    Workload(String),
    /// The simulated cluster of `scheduling` failed.
    #[error("{0}")]
    Sim(#[from] kerf_tests::sim::SimError),
}

impl Error {
    /// A short stable label of the variant.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::UnknownBenchmark(_) => "unknown_benchmark",
            Error::InvalidOption { .. } => "invalid_option",
            Error::Io { .. } => "io",
            Error::Data { .. } => "data",
            Error::NotOnDisk { .. } => "not_on_disk",
            Error::NotOnTmpfs { .. } => "not_on_tmpfs",
            Error::ApiClient { .. } => "api_client",
            Error::Plugin(e) => e.reason(),
            Error::Core(e) => e.reason(),
            Error::Api(e) => e.reason(),
            Error::Kubelet(e) => e.reason(),
            Error::Claim { .. } => "claim",
            Error::FakeGpuTools { .. } => "fake_gpu_tools",
            Error::Child(_) => "child",
            Error::Workload(_) => "workload",
            Error::Sim(_) => "sim",
        }
    }

    pub(crate) fn io(step: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            step,
            path: path.into(),
            source,
        }
    }
}

/// Result of the benchmarks.
pub type Result<T, E = Error> = std::result::Result<T, E>;
