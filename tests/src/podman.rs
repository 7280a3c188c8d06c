//! A real CDI consumer: podman, run with the settings that work on these machines
//! (reference/cdi.md): runc instead of crun, no network, explicit ulimits, and a root file
//! system that is a folder holding a static busybox.
//!
//! podman 4.3.1 (Debian bookworm) reads CDI specs only from the fixed directories `/etc/cdi`
//! and `/var/run/cdi`: it has neither `--cdi-spec-dir` nor containers.conf `cdi_spec_dirs`.
//! So each run happens in a private mount namespace (`unshare --mount`) in which the test's
//! own CDI directory is bind-mounted over `/var/run/cdi`. Nothing outside that namespace
//! sees the specs, and runs of parallel tests do not see each other's.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Where the dynamic CDI directory is; `/var/run` is a symlink to `/run` on Debian.
pub const DYNAMIC_CDI_DIR: &str = "/run/cdi";

/// Errors of a container run.
#[derive(Debug, thiserror::Error)]
pub enum PodmanError {
    /// A file or process could not be set up.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The run did not finish in time and was killed.
    #[error("container run timed out after {timeout:?}; stderr: {stderr}")]
    Timeout {
        /// The limit.
        timeout: Duration,
        /// What podman printed on stderr.
        stderr: String,
    },
    /// podman or the container failed.
    #[error("container run failed ({status}); stdout: {stdout}; stderr: {stderr}")]
    Failed {
        /// Exit status.
        status: ExitStatus,
        /// What the container printed.
        stdout: String,
        /// What podman and the container printed on stderr.
        stderr: String,
    },
}

/// A podman that was checked to work with CDI here.
#[derive(Debug, Clone)]
pub struct Podman {
    busybox: PathBuf,
}

/// One container run.
#[derive(Debug, Clone)]
pub struct ContainerRun<'a> {
    /// CDI spec directory the run sees as `/var/run/cdi`.
    pub cdi_dir: &'a Path,
    /// Fully qualified CDI device names to inject (`vendor/class=name`).
    pub devices: &'a [String],
    /// Root file system prepared with [`Podman::make_rootfs`].
    pub rootfs: &'a Path,
    /// Shell script run by busybox `sh` in the container.
    pub script: &'a str,
    /// Limit of the whole run.
    pub timeout: Duration,
}

/// Where Debian's busybox-static and other distributions put a static busybox.
pub const BUSYBOX_CANDIDATES: [&str; 2] = ["/bin/busybox", "/usr/bin/busybox"];

impl Podman {
    /// podman for the test named `test`, or `None` after printing why it is skipped. Under
    /// `ci` (the caller passes whether `CI=true`) a runtime that cannot run is a failure: CI
    /// must run these tests, not skip them.
    ///
    /// # Panics
    /// Under `ci` when no container can be run here, with the reason.
    #[allow(
        clippy::panic,
        reason = "test support: under CI a missing runtime must fail the calling test"
    )]
    pub fn for_test(test: &str, ci: bool) -> Option<Podman> {
        let busybox = BUSYBOX_CANDIDATES
            .iter()
            .map(Path::new)
            .find(|p| p.exists())
            .unwrap_or(Path::new(BUSYBOX_CANDIDATES[0]));
        match Podman::detect(busybox) {
            Ok(podman) => Some(podman),
            Err(reason) if ci => {
                panic!("{test}: CI=true but no CDI runtime can run here: {reason}")
            }
            Err(reason) => {
                eprintln!("SKIPPED {test}: {reason} (under CI=true this fails)");
                None
            }
        }
    }

    /// Checks that podman, runc, `unshare`, mount namespaces and a static busybox are
    /// usable; `busybox` is the busybox binary to copy into root file systems (Debian's
    /// busybox-static installs `/bin/busybox`).
    ///
    /// # Errors
    /// Why a container cannot be run here, in words.
    pub fn detect(busybox: &Path) -> Result<Podman, String> {
        check_runs("podman", &["--version"])?;
        check_runs("runc", &["--version"])?;
        check_static_elf(busybox)?;
        check_runs("unshare", &["--mount", "true"])
            .map_err(|e| format!("no private mount namespace for the CDI directory: {e}"))?;
        Ok(Podman {
            busybox: busybox.to_owned(),
        })
    }

    /// Makes `dir` a root file system: `bin/busybox` and the mount points podman expects.
    ///
    /// # Errors
    /// The directory or the copy cannot be made.
    pub fn make_rootfs(&self, dir: &Path) -> Result<(), PodmanError> {
        let io = |what: &str| {
            let what = format!("{what} in {}", dir.display());
            move |source| PodmanError::Io { what, source }
        };
        for sub in ["bin", "dev", "proc", "sys", "tmp", "etc"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(io("create directory"))?;
        }
        std::fs::copy(&self.busybox, dir.join("bin/busybox")).map_err(io("copy busybox"))?;
        Ok(())
    }

    /// Runs `/bin/busybox sh -c SCRIPT` in a container with the given CDI devices and
    /// returns its standard output.
    ///
    /// # Errors
    /// podman cannot be started, fails (e.g. an unresolvable CDI device), the script exits
    /// non-zero, or the run takes longer than its timeout.
    pub fn run(&self, run: &ContainerRun<'_>) -> Result<String, PodmanError> {
        let mut command = Command::new("unshare");
        // The shell binds the CDI directory in the new namespace, then becomes podman.
        command.args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            "mkdir -p \"$2\" && mount --bind \"$1\" \"$2\" && shift 2 && exec podman \"$@\"",
            "sh",
        ]);
        command.arg(run.cdi_dir).arg(DYNAMIC_CDI_DIR);
        command.args([
            "--runtime",
            "runc",
            "run",
            "--rm",
            "--network=none",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
        ]);
        for device in run.devices {
            command.arg("--device").arg(device);
        }
        command
            .arg("--rootfs")
            .arg(run.rootfs)
            .args(["/bin/busybox", "sh", "-c", run.script]);
        run_with_timeout(command, run.timeout)
    }
}

fn run_with_timeout(mut command: Command, timeout: Duration) -> Result<String, PodmanError> {
    let io = |what: &'static str| {
        move |source| PodmanError::Io {
            what: what.to_owned(),
            source,
        }
    };
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io("start podman"))?;
    // Readers on their own threads, so a chatty container cannot block on a full pipe.
    let stdout = child.stdout.take().map(read_in_background);
    let stderr = child.stderr.take().map(read_in_background);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(io("wait for podman"))? {
            break Some(status);
        }
        if started.elapsed() > timeout {
            // Already exited or not: either way it is gone after this.
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let collect = |reader: Option<std::thread::JoinHandle<String>>| {
        reader.and_then(|r| r.join().ok()).unwrap_or_default()
    };
    let (stdout, stderr) = (collect(stdout), collect(stderr));
    match status {
        None => Err(PodmanError::Timeout { timeout, stderr }),
        Some(status) if status.success() => Ok(stdout),
        Some(status) => Err(PodmanError::Failed {
            status,
            stdout,
            stderr,
        }),
    }
}

/// Reads a child's pipe to its end on a thread of its own, so that a child filling one pipe
/// never blocks on it while the caller waits on the other.
pub fn read_in_background(
    mut pipe: impl std::io::Read + Send + 'static,
) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        // A read error leaves what was read so far, which is what a report needs.
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

fn check_runs(program: &str, args: &[&str]) -> Result<(), String> {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{program} cannot be started: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// A dynamically linked busybox would need the host's libraries inside the container.
fn check_static_elf(path: &Path) -> Result<(), String> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| {
            format!(
                "{} cannot be read (install busybox-static): {e}",
                path.display()
            )
        })?;
    match elf_has_interpreter(&bytes) {
        Some(false) => Ok(()),
        Some(true) => Err(format!(
            "{} is dynamically linked; install busybox-static",
            path.display()
        )),
        None => Err(format!(
            "{} is not a 64-bit little-endian ELF file",
            path.display()
        )),
    }
}

/// Whether a 64-bit little-endian ELF file has a `PT_INTERP` program header (a dynamic
/// loader); `None` when `bytes` is not such a file.
fn elf_has_interpreter(bytes: &[u8]) -> Option<bool> {
    const PT_INTERP: u32 = 3;
    if bytes.get(..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let u16_at = |at: usize| Some(u16::from_le_bytes(bytes.get(at..at + 2)?.try_into().ok()?));
    let u32_at = |at: usize| Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?));
    let u64_at = |at: usize| Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    let mut found = false;
    for index in 0..phnum {
        found |= u32_at(phoff.checked_add(index.checked_mul(phentsize)?)?)? == PT_INTERP;
    }
    Some(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elf_interpreter_detection() {
        assert_eq!(elf_has_interpreter(b"#!/bin/sh\n"), None);
        assert_eq!(elf_has_interpreter(b""), None);
        // This test binary itself is a dynamically linked 64-bit ELF on x86_64 and aarch64.
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        if cfg!(target_pointer_width = "64") && cfg!(target_endian = "little") {
            assert_eq!(elf_has_interpreter(&me), Some(true));
        }
        let mut header = me[..64].to_vec();
        header[0x38] = 0;
        header[0x39] = 0;
        assert_eq!(
            elf_has_interpreter(&header),
            Some(false),
            "no program headers"
        );
    }
}
