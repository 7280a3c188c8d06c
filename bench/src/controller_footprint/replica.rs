//! kerf-controller replicas as processes: started from the real binary with a kubeconfig for
//! kerf-controller's ServiceAccount, measured through `/proc/<pid>`, optionally recorded by
//! `perf`, stopped with SIGTERM.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use kerf_tests::api_server::ApiServer;
use kerf_tests::fake_api::Identity;
use tokio::process::{Child, Command};

use crate::sys::{parse_cpu_time, parse_vm_rss};
use crate::{Error, Result};

/// The `name=value` environment the shipped Deployment (the chart's default install) gives the
/// controller container, leaving out what comes from the pod (`valueFrom`), which the benchmark
/// sets by flags instead: the replicas run with the allocator's settings, as on a cluster.
///
/// # Errors
///
/// [`Error::Workload`] when the manifest does not parse as a Deployment with a container
/// named `controller`.
pub(super) fn deployment_env() -> Result<Vec<(String, String)>> {
    let origin = kerf_tests::manifests::INSTALL_PATH;
    let deployment = kerf_tests::manifests::installed("Deployment", "kerf-controller")
        .map_err(|e| Error::Workload(e.to_string()))?;
    let deployment: k8s_openapi::api::apps::v1::Deployment = serde_json::from_value(deployment)
        .map_err(|e| Error::Workload(format!("{origin}: Deployment kerf-controller: {e}")))?;
    let container = deployment
        .spec
        .and_then(|spec| spec.template.spec)
        .and_then(|pod| pod.containers.into_iter().find(|c| c.name == "controller"))
        .ok_or_else(|| {
            Error::Workload(format!(
                "{origin}: Deployment kerf-controller has no container \"controller\""
            ))
        })?;
    Ok(container
        .env
        .unwrap_or_default()
        .into_iter()
        .filter_map(|var| Some((var.name, var.value?)))
        .collect())
}

/// How long a replica may take to exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// One running kerf-controller process.
#[derive(Debug)]
pub(super) struct Replica {
    /// Holder identity in the Lease (`--identity`).
    pub identity: String,
    /// Port of its admission webhook on 127.0.0.1.
    pub webhook_port: u16,
    /// Its log (stdout and stderr).
    pub log: PathBuf,
    child: Child,
    pid: u32,
}

/// What `/proc/<pid>` says about a process at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Sample {
    /// CPU time used so far (user + system, every thread).
    pub cpu: Duration,
    /// Resident set size, bytes (`VmRSS`).
    pub rss: u64,
    /// Peak resident set size, bytes (`VmHWM`).
    pub peak_rss: u64,
}

/// The kerf-controller next to the running executable (`target/<profile>/kerf-controller`
/// for `kerf` or `kerf-bench`; one directory up for a test executable in `deps/`).
pub fn default_binary() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let beside = dir.join("kerf-controller");
    if beside.is_file() || dir.file_name().is_none_or(|n| n != "deps") {
        return Some(beside);
    }
    Some(dir.parent()?.join("kerf-controller"))
}

/// A free TCP port on 127.0.0.1 (the listener is closed again; nothing else on this machine
/// is expected to take it in the moment before the replica binds it).
fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
        .map_err(|e| Error::io("bind", "127.0.0.1:0", e))?;
    let port = listener
        .local_addr()
        .map_err(|e| Error::io("read address of", "127.0.0.1:0", e))?
        .port();
    Ok(port)
}

impl Replica {
    /// Starts `binary` as replica `index` against `server`, with its log and kubeconfig in
    /// `dir`: leader election on, the webhook and metrics on free loopback ports, `extra`
    /// flags last (they override).
    ///
    /// # Errors
    /// [`Error::InvalidOption`] naming the path when `binary` is not a file; [`Error::Io`] when
    /// the kubeconfig or log cannot be written or the process does not start.
    pub(super) fn start(
        binary: &Path,
        server: &ApiServer,
        dir: &Path,
        index: usize,
        extra: &[OsString],
    ) -> Result<Replica> {
        if !binary.is_file() {
            return Err(Error::InvalidOption {
                option: "controller_binary",
                reason: format!(
                    "no kerf-controller at {}: build it (cargo build --release -p kerf-controller) or name it with --controller-binary / KERF_CONTROLLER_BINARY",
                    binary.display()
                ),
            });
        }
        let identity = format!("kerf-controller-{index}");
        let kubeconfig = dir.join(format!("{identity}.kubeconfig"));
        server
            .write_kubeconfig_for(&kubeconfig, Identity::kerf_controller())
            .map_err(|e| Error::io("write", &kubeconfig, e))?;
        let log = dir.join(format!("{identity}.log"));
        let out = std::fs::File::create(&log).map_err(|e| Error::io("create", &log, e))?;
        let err = out.try_clone().map_err(|e| Error::io("open", &log, e))?;
        let webhook_port = free_port()?;
        let metrics_port = free_port()?;
        let child = Command::new(binary)
            .arg(format!("--identity={identity}"))
            .arg("--leader-elect=true")
            .arg(format!("--webhook-address=127.0.0.1:{webhook_port}"))
            .arg(format!("--metrics-address=127.0.0.1:{metrics_port}"))
            .args(extra)
            .envs(deployment_env()?)
            .env("KUBECONFIG", &kubeconfig)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Error::io("start", binary, e))?;
        let pid = child.id().ok_or_else(|| {
            Error::Child(format!("{identity} exited at once; see {}", log.display()))
        })?;
        Ok(Replica {
            identity,
            webhook_port,
            log,
            child,
            pid,
        })
    }

    /// The process id.
    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// CPU time and memory now.
    ///
    /// # Errors
    /// [`Error::Child`] when the process has exited; [`Error::Io`] when `/proc` cannot be read.
    pub(super) fn sample(&mut self) -> Result<Sample> {
        self.check_running()?;
        let stat_path = PathBuf::from(format!("/proc/{}/stat", self.pid));
        let stat =
            std::fs::read_to_string(&stat_path).map_err(|e| Error::io("read", &stat_path, e))?;
        let status_path = PathBuf::from(format!("/proc/{}/status", self.pid));
        let status = std::fs::read_to_string(&status_path)
            .map_err(|e| Error::io("read", &status_path, e))?;
        let malformed = |what: &str| {
            Error::Child(format!(
                "{}: no {what} in /proc/{}",
                self.identity, self.pid
            ))
        };
        Ok(Sample {
            cpu: parse_cpu_time(&stat).ok_or_else(|| malformed("utime/stime"))?,
            rss: parse_vm_rss(&status).ok_or_else(|| malformed("VmRSS"))?,
            peak_rss: parse_vm_hwm(&status).ok_or_else(|| malformed("VmHWM"))?,
        })
    }

    /// Fails when the process has exited, naming its log.
    ///
    /// # Errors
    /// [`Error::Child`] when it exited.
    pub(super) fn check_running(&mut self) -> Result<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(Error::Child(format!(
                "{} exited ({status}); see {}",
                self.identity,
                self.log.display()
            ))),
            Err(e) => Err(Error::io("wait for", &self.log, e)),
        }
    }

    /// Sends SIGTERM and waits for the exit (kills it after [`STOP_TIMEOUT`]).
    pub(super) async fn stop(mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.pid.cast_signed()) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        if tokio::time::timeout(STOP_TIMEOUT, self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// The `VmHWM:   1234 kB` line (peak resident set size) of a status file, in bytes.
pub(super) fn parse_vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    parse_vm_rss(&line.replacen("VmHWM:", "VmRSS:", 1))
}

/// `perf record` attached to one process, writing call graphs to a file until stopped.
#[derive(Debug)]
pub(super) struct PerfRecord {
    child: Child,
    output: PathBuf,
}

impl PerfRecord {
    /// Starts `perf record -F 499 -g --call-graph dwarf -p <pid> -o <output>`.
    ///
    /// # Errors
    /// [`Error::Io`] when `perf` cannot be started.
    pub(super) fn start(pid: u32, output: &Path) -> Result<PerfRecord> {
        let child = Command::new("perf")
            .args(["record", "-F", "499", "-g", "--call-graph", "dwarf", "-p"])
            .arg(pid.to_string())
            .arg("-o")
            .arg(output)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Error::io("start perf record for", output, e))?;
        Ok(PerfRecord {
            child,
            output: output.to_owned(),
        })
    }

    /// Stops the recording with SIGINT (perf then writes its file) and waits for it; returns
    /// the file.
    pub(super) async fn stop(mut self) -> PathBuf {
        if let Some(pid) = self
            .child
            .id()
            .and_then(|id| rustix::process::Pid::from_raw(id.cast_signed()))
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        }
        if tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
        self.output
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_rss_comes_from_vm_hwm() {
        let status = "VmPeak:\t  9000 kB\nVmHWM:\t    6144 kB\nVmRSS:\t    5120 kB\n";
        assert_eq!(parse_vm_hwm(status), Some(6 << 20));
        assert_eq!(parse_vm_hwm("VmRSS:\t 1 kB\n"), None);
    }

    /// The replicas run with the allocator settings the Deployment ships (the footprint's
    /// memory figures depend on them), and nothing the pod supplies.
    #[test]
    fn replicas_get_the_deployments_literal_environment() {
        let env = deployment_env().unwrap();
        for (name, value) in [
            ("MIMALLOC_ARENA_EAGER_COMMIT", "0"),
            ("MIMALLOC_PAGE_COMMIT_ON_DEMAND", "1"),
            ("MIMALLOC_PAGE_FULL_RETAIN", "0"),
            ("MIMALLOC_PURGE_DELAY", "0"),
        ] {
            assert!(
                env.contains(&(name.to_owned(), value.to_owned())),
                "{name}={value} in {env:?}"
            );
        }
        assert!(env.iter().all(|(name, _)| name != "POD_NAME"), "{env:?}");
    }
}
