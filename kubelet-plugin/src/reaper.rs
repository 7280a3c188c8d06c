//! A minimal init in front of the plugin, so that the orphans of the tools it starts are
//! reaped.
//!
//! `nvidia-cuda-mps-control -d` daemonizes with a double fork: its daemon is re-parented to
//! the nearest child subreaper or to PID 1 of its PID namespace, and when the daemon quits
//! that process must reap it. In a container the plugin is PID 1, and tokio reaps only the
//! children it spawned itself (by their PIDs), so every stopped daemon stayed a zombie
//! (`[nvidia-cuda-mps] <defunct>`, seen on an H100 with a plugin that did not reap).
//!
//! Why an init and not the plugin reaping orphans itself: the plugin's own children are
//! waited for by tokio's `Command`; a second reaper in the same process would race it. A
//! `waitid(P_ALL, WNOWAIT)` peek returns one waitable child at a time, so a finished tool
//! that tokio has not yet collected hides every orphan behind it, and telling an orphan from
//! one of tokio's children needs a registry of PIDs that tokio does not expose. A separate
//! init process has no children but the plugin, so it can reap *everything* with a plain
//! `waitpid(-1)`; it is what `tini` does (krallin/tini, `src/tini.c`: `spawn` runs the
//! command as its only child, `wait_and_forward_signal` forwards every signal but `SIGCHLD`,
//! `reap_zombies` collects any child and exits with the command's status, 128 + signal for
//! one killed by a signal; `-s`/`register_subreaper` for when it is not PID 1).
//!
//! [`enter`] decides from [`InitMode`] (`--init`, `KERF_INIT`): `auto` (the default) runs the
//! init only when the process is PID 1, `always` also elsewhere (it then makes itself a child
//! subreaper, `PR_SET_CHILD_SUBREAPER`, so that orphans come to it rather than to the host's
//! PID 1), `never` not at all. The init re-executes its own program with the same arguments
//! plus `--init=child`; the child asks for `SIGKILL` when its parent dies, so a plugin never
//! runs on without its reaper.

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

use rustix::process::{Pid, Signal, WaitOptions, WaitStatus};
use tokio::signal::unix::{SignalKind, signal};

use crate::error::{Error, Result};

/// Whether the plugin runs behind its own minimal init (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum InitMode {
    /// Behind the init when the process is PID 1 (in a container), directly otherwise.
    Auto,
    /// Always behind the init, which is a child subreaper when it is not PID 1.
    Always,
    /// Never: the process is the plugin, and its orphans are whoever adopts them's business.
    Never,
    /// The plugin under an init: set by the init for its child, not meant for users.
    #[value(hide = true)]
    Child,
}

impl InitMode {
    /// Whether a process with PID `pid` becomes the init.
    #[must_use]
    fn runs_init(self, pid: u32) -> bool {
        match self {
            Self::Auto => pid == 1,
            Self::Always => true,
            Self::Never | Self::Child => false,
        }
    }
}

/// The argument the init appends for its child (the last `--init` wins).
pub(crate) const CHILD_ARG: &str = "--init=child";

/// The signals the init passes on to the plugin: what the kubelet, a container runtime or an
/// admin sends to PID 1 to stop it or to ask for something.
const FORWARDED: [SignalKind; 6] = [
    SignalKind::terminate(),
    SignalKind::interrupt(),
    SignalKind::hangup(),
    SignalKind::quit(),
    SignalKind::user_defined1(),
    SignalKind::user_defined2(),
];

/// Runs the init when `mode` says so for this process: it returns the exit code the process
/// must exit with once the plugin has ended. `None` means this process is the plugin; under
/// an init ([`InitMode::Child`]) it then dies with its init.
///
/// `args` are the process's arguments, the program first.
///
/// # Errors
/// [`Error::Io`] when the init cannot make itself a subreaper, set up its signal handlers or
/// start the plugin, or the plugin cannot ask for a signal on its parent's death.
pub fn enter(mode: InitMode, args: Vec<OsString>) -> Result<Option<i32>> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::io("find the plugin's program", Path::new("/proc/self/exe"), e))?;
    if mode == InitMode::Child {
        // Without its init nothing reaps the daemons' zombies; end with it.
        rustix::process::set_parent_process_death_signal(Some(Signal::KILL))
            .map_err(|e| Error::io("ask for SIGKILL on the init's death", &exe, e.into()))?;
        return Ok(None);
    }
    if !mode.runs_init(std::process::id()) {
        return Ok(None);
    }
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
        .map_err(|e| Error::io("become a child subreaper", &exe, e.into()))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("start the init's runtime", &exe, e))?;
    let rest = args.into_iter().skip(1);
    runtime.block_on(supervise(&exe, rest)).map(Some)
}

/// Starts the plugin as the only child, forwards signals to it and reaps every child until
/// the plugin ends; returns its exit code. Runs on the thread that spawns the plugin for its
/// whole life: the plugin's parent-death signal fires when that *thread* ends.
async fn supervise(exe: &Path, args: impl Iterator<Item = OsString>) -> Result<i32> {
    // Handlers first: a signal that arrived between the spawn and their registration would
    // end the init (not PID 1) without reaching the plugin.
    let mut streams = Vec::with_capacity(FORWARDED.len());
    for kind in FORWARDED {
        let stream = signal(kind).map_err(|e| Error::io("watch signals", exe, e))?;
        streams.push((kind, stream));
    }
    let child = Command::new(exe)
        .args(args)
        .arg(CHILD_ARG)
        .spawn()
        .map_err(|e| Error::io("start the plugin under its init", exe, e))?;
    let plugin = i32::try_from(child.id())
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| Error::io("start the plugin under its init", exe, invalid_pid()))?;
    let (done, mut ended) = tokio::sync::oneshot::channel();
    // A blocking waitpid(-1) on its own thread: it reaps every zombie as it appears, the
    // plugin's status included, with no SIGCHLD handling to get wrong.
    std::thread::spawn(move || {
        let _ = done.send(reap_until(plugin));
    });
    loop {
        let signalled = next_signal(&mut streams);
        tokio::select! {
            status = &mut ended => {
                let status = status.map_err(|_| Error::io("reap", exe, lost_child()))?;
                return status.map(exit_code).map_err(|e| Error::io("reap", exe, e.into()));
            }
            kind = signalled => forward(plugin, kind),
        }
    }
}

/// The first of `streams` to deliver a signal.
async fn next_signal(streams: &mut [(SignalKind, tokio::signal::unix::Signal)]) -> SignalKind {
    let waits = streams.iter_mut().map(|(kind, stream)| {
        let kind = *kind;
        Box::pin(async move {
            stream.recv().await;
            kind
        })
    });
    futures::future::select_all(waits).await.0
}

fn forward(plugin: Pid, kind: SignalKind) {
    let Some(signal) = Signal::from_named_raw(kind.as_raw_value()) else {
        return;
    };
    match rustix::process::kill_process(plugin, signal) {
        // The plugin has just ended; its status is on its way.
        Ok(()) | Err(rustix::io::Errno::SRCH) => {}
        Err(error) => {
            tracing::warn!(%error, signal = kind.as_raw_value(), "cannot forward a signal to the plugin");
        }
    }
}

/// Reaps every child (orphans adopted as PID 1 or subreaper) until `plugin` ends.
fn reap_until(plugin: Pid) -> rustix::io::Result<WaitStatus> {
    loop {
        match rustix::process::wait(WaitOptions::empty()) {
            Ok(Some((pid, status))) if pid == plugin => return Ok(status),
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(error) => return Err(error),
        }
    }
}

/// The init's exit code for the plugin's status: its own code, or 128 + the signal that
/// killed it (as a shell and `tini` report it).
fn exit_code(status: WaitStatus) -> i32 {
    status
        .exit_status()
        .or_else(|| status.terminating_signal().map(|signal| 128 + signal))
        .unwrap_or(1)
}

fn invalid_pid() -> std::io::Error {
    std::io::Error::other("the plugin's process has no valid PID")
}

fn lost_child() -> std::io::Error {
    std::io::Error::other("the reaper thread ended without the plugin's status")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_init_runs_as_pid_1_or_when_asked() {
        assert!(InitMode::Auto.runs_init(1));
        assert!(!InitMode::Auto.runs_init(42));
        assert!(InitMode::Always.runs_init(42));
        assert!(!InitMode::Never.runs_init(1));
        assert!(
            !InitMode::Child.runs_init(1),
            "the child never nests an init"
        );
    }
}
