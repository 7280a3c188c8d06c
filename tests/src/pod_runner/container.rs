//! One container as a local process: started, watched, restarted with the kubelet's
//! back-off while the pod lives (`restartPolicy: Always`), and killed as the kubelet kills it.
//!
//! Upstream (kubernetes/kubernetes):
//! - `pkg/kubelet/kuberuntime/kuberuntime_manager.go`, `computePodActions` (an exited
//!   container of an `Always` pod is started again) and `doBackOff`: the back-off runs from
//!   the exited container's `finishedAt`; while it lasts the container waits in
//!   `CrashLoopBackOff` with `back-off <d> restarting failed container=<name> pod=<pod>`;
//! - `staging/src/k8s.io/client-go/util/flowcontrol/backoff.go`, `Backoff.Next` and
//!   `IsInBackOffSince`: the first exit restarts at once and opens a window of the initial
//!   back-off; each later restart doubles it up to the maximum; an entry older than twice the
//!   maximum starts over (`hasExpired`);
//! - `pkg/kubelet/kubelet.go` (`backOffPeriod`, 10 s) and `MaxContainerBackOff` (300 s);
//! - `pkg/kubelet/kuberuntime/kuberuntime_container.go`, `killContainer`: the grace period is
//!   the pod's `deletionGracePeriodSeconds`, else `spec.terminationGracePeriodSeconds`, at
//!   least `minimumGracePeriodInSeconds` (2 s); the runtime's `StopContainer` sends SIGTERM
//!   to the container's first process and SIGKILL when the grace period is over.
//!
//! A container's processes are one process group here (its first process leads it): SIGTERM
//! goes to the first process only, as the runtime sends it to PID 1, and SIGKILL to the whole
//! group, as killing a container's cgroup does. When the first process exits, the rest of the
//! group is killed, as a PID namespace ends with its init. A process that leaves the group
//! (`setsid`) escapes this.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use rustix::process::{Pid, Signal};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::plan::Launch;

/// What a container task tells its pod worker.
#[derive(Debug)]
pub(super) enum ContainerEvent {
    /// A new instance runs.
    Started {
        index: usize,
        pid: u32,
        id: String,
        at: Timestamp,
        log: PathBuf,
    },
    /// The instance ended (or could not start); `backoff` is the `CrashLoopBackOff` wait
    /// before the next one, when there is one.
    Exited {
        index: usize,
        exit: Exit,
        backoff: Option<Duration>,
    },
}

/// How an instance ended, as the runtime reports it.
#[derive(Debug, Clone)]
pub(super) struct Exit {
    pub(super) code: i32,
    pub(super) reason: String,
    pub(super) message: Option<String>,
    pub(super) started_at: Option<Timestamp>,
    pub(super) finished_at: Timestamp,
    pub(super) id: Option<String>,
}

/// `flowcontrol.Backoff` for one container.
#[derive(Debug)]
pub(super) struct Backoff {
    initial: Duration,
    max: Duration,
    entry: Option<(Duration, Instant)>,
}

impl Backoff {
    pub(super) fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            entry: None,
        }
    }

    fn expired(&self, finished: Instant, last_update: Instant) -> bool {
        finished.saturating_duration_since(last_update) > self.max * 2
    }

    /// `IsInBackOffSince(finished)`: how long to wait from now, when in back-off.
    pub(super) fn wait_after(&self, finished: Instant, now: Instant) -> Option<Duration> {
        let (backoff, last_update) = self.entry?;
        if self.expired(finished, last_update) {
            return None;
        }
        let since = now.saturating_duration_since(finished);
        backoff.checked_sub(since).filter(|left| !left.is_zero())
    }

    /// The window being waited (`Backoff.Get`).
    pub(super) fn current(&self) -> Duration {
        self.entry.map_or(Duration::ZERO, |(backoff, _)| backoff)
    }

    /// `Next(finished)`, called when the container is started again.
    pub(super) fn next(&mut self, finished: Instant, now: Instant) {
        let backoff = match self.entry {
            Some((backoff, last_update)) if !self.expired(finished, last_update) => {
                (backoff * 2).min(self.max)
            }
            _ => self.initial.min(self.max),
        };
        self.entry = Some((backoff, now));
    }
}

/// Everything a container task needs.
pub(super) struct ContainerTask {
    pub(super) index: usize,
    pub(super) name: String,
    pub(super) pod_label: String,
    pub(super) pod_uid: String,
    pub(super) launch: Launch,
    pub(super) log_dir: PathBuf,
    pub(super) backoff: Backoff,
    pub(super) events: mpsc::UnboundedSender<ContainerEvent>,
    /// The grace period once the pod is being killed.
    pub(super) kill: watch::Receiver<Option<Duration>>,
}

/// Where a running instance is.
struct Instance {
    child: Child,
    pid: u32,
    id: String,
    started_at: Timestamp,
}

impl ContainerTask {
    /// Runs instances until the pod is killed.
    pub(super) async fn run(mut self) {
        let mut starts = 0u32;
        loop {
            if self.kill.borrow().is_some() {
                return;
            }
            let (exit, killed) = match self.start(starts) {
                Ok(instance) => self.watch(instance).await,
                Err(exit) => (exit, false),
            };
            starts += 1;
            let finished = Instant::now();
            let backoff = self.backoff.wait_after(finished, finished);
            let shown = backoff.map(|_| self.backoff.current());
            let _ = self.events.send(ContainerEvent::Exited {
                index: self.index,
                exit,
                backoff: if killed { None } else { shown },
            });
            if killed {
                return;
            }
            if let Some(wait) = backoff {
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    _ = self.kill.wait_for(Option::is_some) => return,
                }
            }
            self.backoff.next(finished, Instant::now());
        }
    }

    /// Starts instance number `restart` (its log is `<restart>.log`, as the kubelet names it).
    fn start(&self, restart: u32) -> Result<Instance, Exit> {
        let id = format!("fake://{}/{}/{restart}", self.pod_uid, self.name);
        let log = self.log_dir.join(format!("{restart}.log"));
        let started_at = Timestamp::now();
        let failed = |message: String| Exit {
            code: 128,
            reason: "StartError".to_owned(),
            message: Some(message),
            started_at: None,
            finished_at: Timestamp::now(),
            id: Some(id.clone()),
        };
        let file = std::fs::create_dir_all(&self.log_dir)
            .and_then(|()| std::fs::File::create(&log))
            .map_err(|e| failed(format!("pod runner: log file {}: {e}", log.display())))?;
        let stderr = file
            .try_clone()
            .map_err(|e| failed(format!("pod runner: log file {}: {e}", log.display())))?;
        let child = Command::new(&self.launch.program)
            .args(&self.launch.args)
            .env_clear()
            .envs(self.launch.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&self.launch.working_dir)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                failed(format!(
                    "pod runner: starting {}: {e}",
                    self.launch.program.display()
                ))
            })?;
        let Some(pid) = child.id() else {
            return Err(failed("pod runner: the process ended at once".to_owned()));
        };
        let _ = self.events.send(ContainerEvent::Started {
            index: self.index,
            pid,
            id: id.clone(),
            at: started_at,
            log,
        });
        tracing::debug!(pod = %self.pod_label, container = %self.name, pid, "pod runner: started");
        Ok(Instance {
            child,
            pid,
            id,
            started_at,
        })
    }

    /// Waits for the instance to end, or kills it when the pod is killed; whether it was.
    async fn watch(&mut self, mut instance: Instance) -> (Exit, bool) {
        let grace = tokio::select! {
            status = instance.child.wait() => {
                kill_group(instance.pid);
                return (exit_of(&instance, status), false);
            }
            grace = self.kill.wait_for(Option::is_some) => grace.ok().and_then(|g| *g),
        };
        signal(instance.pid, Signal::TERM, false);
        let waited = tokio::time::timeout(grace.unwrap_or_default(), instance.child.wait()).await;
        let status = if let Ok(status) = waited {
            status
        } else {
            kill_group(instance.pid);
            instance.child.wait().await
        };
        kill_group(instance.pid);
        (exit_of(&instance, status), true)
    }
}

fn exit_of(instance: &Instance, status: std::io::Result<std::process::ExitStatus>) -> Exit {
    use std::os::unix::process::ExitStatusExt as _;
    let (code, message) = match status {
        Ok(status) => (
            status
                .code()
                .or_else(|| status.signal().map(|signal| 128 + signal))
                .unwrap_or(-1),
            None,
        ),
        Err(e) => (
            -1,
            Some(format!("pod runner: waiting for the process: {e}")),
        ),
    };
    Exit {
        code,
        reason: if code == 0 { "Completed" } else { "Error" }.to_owned(),
        message,
        started_at: Some(instance.started_at),
        finished_at: Timestamp::now(),
        id: Some(instance.id.clone()),
    }
}

/// SIGKILL to the container's process group (what is left of it).
pub(super) fn kill_group(pid: u32) {
    signal(pid, Signal::KILL, true);
}

fn signal(pid: u32, signal: Signal, group: bool) {
    let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) else {
        return;
    };
    let sent = if group {
        rustix::process::kill_process_group(pid, signal)
    } else {
        rustix::process::kill_process(pid, signal)
    };
    match sent {
        // Already gone: nothing left to stop.
        Ok(()) | Err(rustix::io::Errno::SRCH) => {}
        Err(error) => tracing::warn!(pid = pid.as_raw_pid(), %error, "pod runner: cannot signal"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_restarts_at_once_then_doubles_up_to_the_maximum() {
        let start = Instant::now();
        let second = Duration::from_secs(1);
        let mut backoff = Backoff::new(10 * second, 40 * second);
        assert_eq!(backoff.wait_after(start, start), None);
        backoff.next(start, start);
        let mut now = start;
        for expected in [10, 20, 40, 40] {
            now += second;
            assert_eq!(backoff.wait_after(now, now), Some(expected * second));
            assert_eq!(backoff.current(), expected * second);
            now += expected * second;
            assert_eq!(backoff.wait_after(now - expected * second, now), None);
            backoff.next(now - expected * second, now);
        }
        // Ran longer than twice the maximum: starts over.
        let later = now + 81 * second;
        assert_eq!(backoff.wait_after(later, later), None);
        backoff.next(later, later);
        assert_eq!(backoff.current(), 10 * second);
    }
}
