//! The driver's tools as both daemon runners call them: `nvidia-smi` for compute modes and
//! time slices, `nvidia-cuda-mps-control` as the control client.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use kerf_core::mps::{
    CONTROL_PROGRAM, ComputeMode, MpsDirectories, QUIT_COMMAND, compute_mode_args,
};
use tokio::io::AsyncWriteExt as _;
use tokio::process::Command;

use crate::error::{Error, Result};

/// `nvidia-smi`, looked up next to the control program.
const SMI_PROGRAM: &str = "nvidia-smi";

/// Where a driver root keeps the driver's libraries (Debian-style multiarch and RPM-style
/// layouts), relative to the root.
const DRIVER_LIBRARY_DIRS: [&str; 3] = [
    "usr/lib/x86_64-linux-gnu",
    "usr/lib64",
    "usr/lib/aarch64-linux-gnu",
];

/// A driver tool of `tools_root` with a clean environment except the driver root's library
/// directories: the tools (and the MPS server the daemon spawns) load the driver's libraries,
/// which are not on the plugin image's search path when the driver lives in a driver root
/// such as `/run/nvidia/driver`.
pub(crate) fn tool(tools_root: &Path, name: &str) -> Command {
    let mut command = Command::new(tools_root.join("usr/bin").join(name));
    command
        .env_clear()
        .env("LD_LIBRARY_PATH", library_path(tools_root));
    command
}

/// The control program of `tools_root` with only this GPU, this pipe and this log directory.
pub(crate) fn control(tools_root: &Path, dirs: &MpsDirectories) -> Command {
    let mut command = tool(tools_root, CONTROL_PROGRAM);
    command.envs(dirs.control_env()).kill_on_drop(false);
    command
}

pub(crate) fn library_path(tools_root: &Path) -> std::ffi::OsString {
    let dirs: Vec<PathBuf> = DRIVER_LIBRARY_DIRS
        .iter()
        .map(|dir| tools_root.join(dir))
        .collect();
    std::env::join_paths(dirs).unwrap_or_default()
}

/// Writes `quit` to the control client of `dirs` and waits for it until `deadline`.
///
/// # Errors
/// The client's failure, as a message: it cannot run, it fails (no daemon listens) or it does
/// not finish in time (it is then killed).
pub(crate) async fn send_quit(
    tools_root: &Path,
    dirs: &MpsDirectories,
    deadline: tokio::time::Instant,
) -> std::result::Result<(), String> {
    run_control_client(tools_root, dirs, QUIT_COMMAND, deadline)
        .await
        .map(drop)
}

/// Sends `commands` (one a line) to the control daemon of `dirs` through one run of the
/// control client, which must finish within `timeout`; returns what it printed.
///
/// # Errors
/// [`Error::Mps`] naming the GPU and the commands when the client cannot run, fails (no
/// daemon listens) or does not finish in time (it is then killed).
pub(crate) async fn send_commands(
    tools_root: &Path,
    dirs: &MpsDirectories,
    commands: &[String],
    timeout: std::time::Duration,
) -> Result<String> {
    let mut input = commands.join("\n");
    input.push('\n');
    let deadline = tokio::time::Instant::now() + timeout;
    run_control_client(tools_root, dirs, &input, deadline)
        .await
        .map_err(|message| mps_error(dirs.gpu_uuid(), format!("{message} (sent {commands:?})")))
}

/// One run of the control client of `dirs` with `input` on its stdin, until `deadline`;
/// what it printed.
async fn run_control_client(
    tools_root: &Path,
    dirs: &MpsDirectories,
    input: &str,
    deadline: tokio::time::Instant,
) -> std::result::Result<String, String> {
    let mut client = control(tools_root, dirs)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run {CONTROL_PROGRAM}: {e}"))?;
    if let Some(mut stdin) = client.stdin.take() {
        // A daemon already gone makes the client fail; its status says so below.
        let _ = stdin.write_all(input.as_bytes()).await;
    }
    match tokio::time::timeout_at(deadline, client.wait_with_output()).await {
        Ok(Ok(output)) if output.status.success() => {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        }
        Ok(Ok(output)) => Err(format!(
            "{CONTROL_PROGRAM} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )),
        Ok(Err(error)) => Err(format!("cannot wait for {CONTROL_PROGRAM}: {error}")),
        Err(_) => Err(format!("{CONTROL_PROGRAM} did not finish in time")),
    }
}

/// Puts `gpu` in compute mode `mode`.
///
/// # Errors
/// [`Error::Mps`] naming the GPU and `nvidia-smi`'s own message.
pub(crate) async fn set_compute_mode(
    tools_root: &Path,
    gpu: &str,
    mode: ComputeMode,
) -> Result<()> {
    smi(tools_root, gpu, &compute_mode_args(gpu, mode)).await
}

/// Runs `nvidia-smi args` for `gpu`.
///
/// # Errors
/// [`Error::Mps`] naming the GPU and the tool's own message.
pub(crate) async fn smi(tools_root: &Path, gpu: &str, args: &[String]) -> Result<()> {
    let output = tool(tools_root, SMI_PROGRAM)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| mps_error(gpu, format!("cannot run {SMI_PROGRAM}: {e}")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(mps_error(
            gpu,
            format!(
                "{SMI_PROGRAM} {} failed ({}): {}",
                args.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        ))
    }
}

pub(crate) fn mps_error(gpu: &str, message: String) -> Error {
    Error::Mps {
        gpu: gpu.to_owned(),
        message,
    }
}

/// Removes the daemon's files and puts its GPU back in compute mode `DEFAULT`, once no
/// daemon runs for it. Failures are logged: the next start or start-up tries again.
pub(crate) async fn clean_up(tools_root: &Path, dirs: &MpsDirectories) {
    if let Err(error) = tokio::fs::remove_dir_all(dirs.base()).await
        && error.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(gpu = dirs.gpu_uuid(), %error, "cannot remove MPS directories");
    }
    let gpu = dirs.gpu_uuid();
    if let Err(error) = set_compute_mode(tools_root, gpu, ComputeMode::Default).await {
        tracing::warn!(gpu, %error, "cannot restore compute mode DEFAULT");
    }
}

/// Empties `dir` but keeps the directory itself: running client containers have it
/// bind-mounted, and a directory replaced by a new one would leave them looking at the old
/// one, where a restarted daemon's sockets never appear. A missing directory is fine.
///
/// # Errors
/// The I/O error of reading the directory or removing an entry.
pub(crate) async fn clear_directory(dir: &Path) -> std::io::Result<()> {
    let mut entries = match tokio::fs::read_dir(dir).await {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(error),
    };
    while let Some(entry) = entries.next_entry().await? {
        let path = entry.path();
        let removed = if entry.file_type().await?.is_dir() {
            tokio::fs::remove_dir_all(&path).await
        } else {
            tokio::fs::remove_file(&path).await
        };
        match removed {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => return Err(error),
            _ => {}
        }
    }
    Ok(())
}

/// A shared-memory directory with `/dev/shm`'s mode (world-writable, sticky): MPS clients of
/// any user create their segments there, and none may remove another's. A kubelet-created
/// hostPath directory is 0755 root, which would lock out every client not running as root.
///
/// # Errors
/// [`Error::Io`] when it cannot be created or its mode set.
pub(crate) fn create_shm_directory(dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io("create MPS shared-memory directory", dir, e))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777))
        .map_err(|e| Error::io("set the mode of the MPS shared-memory directory", dir, e))
}

/// Whether the daemon of `dirs` accepts connections on its control socket: what every MPS
/// client (and the control client) needs, and readable across PID namespaces, unlike the PID
/// file. A stale socket file (its daemon gone) refuses.
pub(crate) async fn accepts_connections(dirs: &MpsDirectories) -> bool {
    let path = dirs.pipe().join("control");
    tokio::task::spawn_blocking(move || control_socket_answers(&path))
        .await
        .unwrap_or(false)
}

/// Connects with the control socket's own type, trying stream, seqpacket and datagram in
/// turn: a connect of the wrong type fails with `EPROTOTYPE`, one to a stale socket file (its
/// daemon gone) with `ECONNREFUSED` (Linux `net/unix/af_unix.c`, `unix_find_bsd`). On an H200
/// (driver 580.159.04) a stream connect never reached NVIDIA's daemon — its log showed no
/// connection in 30 s while its own control client got through — so the type is not assumed,
/// and any other refusal of a bound socket counts as a daemon.
fn control_socket_answers(path: &Path) -> bool {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketType};
    let Ok(address) = SocketAddrUnix::new(path) else {
        return false;
    };
    for kind in [SocketType::STREAM, SocketType::SEQPACKET, SocketType::DGRAM] {
        let Ok(socket) = rustix::net::socket(AddressFamily::UNIX, kind, None) else {
            continue;
        };
        match rustix::net::connect(&socket, &address) {
            Err(rustix::io::Errno::PROTOTYPE) => {}
            // No file, or a file nobody is bound to: no daemon.
            Err(rustix::io::Errno::NOENT | rustix::io::Errno::CONNREFUSED) => return false,
            // Connected, or refused otherwise (a full backlog, a permission): a socket is bound
            // there, so a daemon runs.
            Ok(()) | Err(_) => return true,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketType};

    fn bound(path: &Path, kind: SocketType, listening: bool) -> rustix::fd::OwnedFd {
        let socket = rustix::net::socket(AddressFamily::UNIX, kind, None).unwrap();
        rustix::net::bind(&socket, &SocketAddrUnix::new(path).unwrap()).unwrap();
        if listening {
            rustix::net::listen(&socket, 4).unwrap();
        }
        socket
    }

    #[test]
    fn a_control_socket_of_any_type_answers_and_a_stale_one_does_not() {
        let dir = tempfile::tempdir().unwrap();
        for (name, kind, listening) in [
            ("stream", SocketType::STREAM, true),
            ("seqpacket", SocketType::SEQPACKET, true),
            ("datagram", SocketType::DGRAM, false),
        ] {
            let path = dir.path().join(name);
            let socket = bound(&path, kind, listening);
            assert!(control_socket_answers(&path), "{name}");
            drop(socket);
            assert!(
                !control_socket_answers(&path),
                "{name}: stale after its daemon is gone"
            );
        }
        assert!(!control_socket_answers(&dir.path().join("missing")));
    }

    #[test]
    fn tools_find_the_driver_roots_libraries() {
        let root = Path::new("/run/nvidia/driver");
        assert_eq!(
            library_path(root),
            "/run/nvidia/driver/usr/lib/x86_64-linux-gnu:/run/nvidia/driver/usr/lib64:/run/nvidia/driver/usr/lib/aarch64-linux-gnu"
        );
        let command = tool(root, SMI_PROGRAM);
        let std = command.as_std();
        assert_eq!(std.get_program(), "/run/nvidia/driver/usr/bin/nvidia-smi");
        let env: Vec<_> = std.get_envs().collect();
        assert_eq!(env.len(), 1, "nothing of the plugin's environment: {env:?}");
    }
}
