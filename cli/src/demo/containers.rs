//! Running one busybox container per prepared claim with podman, injecting the claim's CDI
//! devices, to show what a workload sees.
//!
//! podman reads CDI specs from `/etc/cdi` and `/var/run/cdi` only; podman 4.3 (Debian 12)
//! has no `--cdi-spec-dir` flag and no `cdi_spec_dirs` setting. Where the flag is missing,
//! podman runs in a private mount namespace (`unshare --mount`) in which the demo's CDI
//! directory is bind-mounted over `/var/run/cdi` (and an empty one over `/etc/cdi`, so that
//! only the demo's specs are seen): nothing outside the namespace changes. That needs root,
//! as rootful podman does anyway.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// What each container prints: kerf's, CUDA's and NVIDIA's environment, the GPU device
/// nodes, and for an MPS slice what is in its MPS pipe directory (the daemon's `control`
/// socket and PID file, the proof that the container reaches the GPU's daemon).
pub const PROBE_SCRIPT: &str = "env | grep -E '^(KERF|CUDA|NVIDIA)_' | sort; \
     ls -l /dev/nvidia* 2>&1 | sed 's/  */ /g'; \
     if [ -n \"$CUDA_MPS_PIPE_DIRECTORY\" ]; then \
     echo \"ls -l $CUDA_MPS_PIPE_DIRECTORY:\"; \
     ls -l \"$CUDA_MPS_PIPE_DIRECTORY\" 2>&1 | sed '/^total /d; s/  */ /g'; fi";

/// Where podman runs, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runtime {
    /// The podman binary.
    pub podman: PathBuf,
    /// The podman version line.
    pub version: String,
    /// The static busybox copied into the root filesystem.
    pub busybox: PathBuf,
    /// How podman finds the demo's CDI specs.
    pub spec_dirs: SpecDirs,
}

/// How podman is pointed at the demo's CDI directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecDirs {
    /// `podman --cdi-spec-dir DIR` (podman 4.7 and later).
    Flag,
    /// A private mount namespace with the directory bind-mounted over the default ones.
    MountNamespace,
}

/// One container's run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerRun {
    /// The podman command line (as run inside the namespace, when one is used).
    pub command: String,
    /// Exit status; `None` when killed by a signal.
    pub exit_code: Option<i32>,
    /// What the container printed (stdout, then stderr).
    pub output: String,
}

/// Finds podman, a static busybox and a way to hand podman the spec directory.
///
/// # Errors
/// [`Error::Containers`] saying what is missing and how to install it.
pub fn find_runtime(busybox: Option<&Path>) -> Result<Runtime> {
    let podman = find_in_path("podman").ok_or_else(|| {
        Error::Containers(
            "podman is not installed; on Debian/Ubuntu: apt-get install -y --no-install-recommends podman runc busybox-static".to_owned(),
        )
    })?;
    let version = run_text(&podman, &["--version"])?;
    let busybox = match busybox {
        Some(path) => path.to_owned(),
        None => ["/bin/busybox", "/usr/bin/busybox"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .ok_or_else(|| {
                Error::Containers(
                    "busybox is not installed; on Debian/Ubuntu: apt-get install -y busybox-static"
                        .to_owned(),
                )
            })?,
    };
    let bytes = std::fs::read(&busybox).map_err(|e| Error::io("read", &busybox, e))?;
    if !is_static_elf(&bytes) {
        return Err(Error::Containers(format!(
            "{} is not a statically linked ELF executable; install busybox-static",
            busybox.display()
        )));
    }
    let help = run_text(&podman, &["--help"])?;
    let spec_dirs = if help.contains("--cdi-spec-dir") {
        SpecDirs::Flag
    } else {
        if find_in_path("unshare").is_none() {
            return Err(Error::Containers(
                "this podman has no --cdi-spec-dir and unshare(1) is missing (util-linux)"
                    .to_owned(),
            ));
        }
        SpecDirs::MountNamespace
    };
    Ok(Runtime {
        podman,
        version,
        busybox,
        spec_dirs,
    })
}

/// Builds `<output>/rootfs` holding only `bin/busybox`.
///
/// # Errors
/// The copy fails.
pub fn make_rootfs(runtime: &Runtime, output_dir: &Path) -> Result<PathBuf> {
    let rootfs = output_dir.join("rootfs");
    let bin = rootfs.join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| Error::io("create directory", &bin, e))?;
    let target = bin.join("busybox");
    std::fs::copy(&runtime.busybox, &target)
        .map_err(|e| Error::io("copy busybox to", &target, e))?;
    Ok(rootfs)
}

/// Runs one container with `cdi_ids` injected and returns what it printed.
///
/// # Errors
/// podman (or unshare) cannot be started. A container that fails is not an error: its exit
/// code and output are in the result.
pub fn run(
    runtime: &Runtime,
    cdi_dir: &Path,
    empty_dir: &Path,
    rootfs: &Path,
    cdi_ids: &[String],
) -> Result<ContainerRun> {
    let mut podman_args: Vec<String> = Vec::new();
    if runtime.spec_dirs == SpecDirs::Flag {
        podman_args.extend(["--cdi-spec-dir".to_owned(), cdi_dir.display().to_string()]);
    }
    podman_args.extend(
        [
            "--runtime",
            "runc",
            "run",
            "--rm",
            "--network=none",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
        ]
        .map(str::to_owned),
    );
    for id in cdi_ids {
        podman_args.extend(["--device".to_owned(), id.clone()]);
    }
    podman_args.extend([
        "--rootfs".to_owned(),
        rootfs.display().to_string(),
        "/bin/busybox".to_owned(),
        "sh".to_owned(),
        "-c".to_owned(),
        PROBE_SCRIPT.to_owned(),
    ]);
    let shown = format!("podman {}", shell_words(&podman_args));
    let output = match runtime.spec_dirs {
        SpecDirs::Flag => Command::new(&runtime.podman).args(&podman_args).output(),
        SpecDirs::MountNamespace => {
            let script = namespace_script(cdi_dir, empty_dir);
            Command::new("unshare")
                .args([
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    &script,
                    "kerf-demo",
                ])
                .arg(&runtime.podman)
                .args(&podman_args)
                .output()
        }
    }
    .map_err(|e| Error::Containers(format!("cannot start podman: {e}")))?;
    Ok(ContainerRun {
        command: shown,
        exit_code: output.status.code(),
        output: combined(&output),
    })
}

/// The shell run inside the private mount namespace: the demo's CDI directory over
/// `/var/run/cdi`, an empty one over `/etc/cdi` when that exists, then podman (`"$@"`).
fn namespace_script(cdi_dir: &Path, empty_dir: &Path) -> String {
    format!(
        "set -e; mkdir -p /var/run/cdi; mount --bind {} /var/run/cdi; \
         if [ -d /etc/cdi ]; then mount --bind {} /etc/cdi; fi; exec \"$@\"",
        shell_quote(&cdi_dir.display().to_string()),
        shell_quote(&empty_dir.display().to_string()),
    )
}

fn combined(output: &Output) -> String {
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !stderr.trim().is_empty() {
        text.push_str(&stderr);
    }
    text
}

fn run_text(program: &Path, args: &[&str]) -> Result<String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| Error::Containers(format!("cannot run {}: {e}", program.display())))?;
    if !output.status.success() {
        return Err(Error::Containers(format!(
            "{} {} failed: {}",
            program.display(),
            args.join(" "),
            combined(&output).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// The first `name` in `$PATH` that is a file.
fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// True for an ELF executable without a program interpreter (`PT_INTERP`), i.e. one that
/// runs in a root filesystem without a dynamic loader. 64-bit little-endian only, which is
/// what Debian's busybox-static is on the architectures kerf supports.
pub fn is_static_elf(bytes: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    let read = |at: usize, len: usize| bytes.get(at..at + len);
    let u16_at = |at| read(at, 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |at| read(at, 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let u64_at = |at| {
        read(at, 8).map(|b| {
            let mut word = [0u8; 8];
            word.copy_from_slice(b);
            u64::from_le_bytes(word)
        })
    };
    // Magic, ELFCLASS64, little-endian.
    if read(0, 6) != Some(&[0x7f, b'E', b'L', b'F', 2, 1]) {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return false;
    };
    let Ok(phoff) = usize::try_from(phoff) else {
        return false;
    };
    (0..usize::from(phnum))
        .all(|i| u32_at(phoff + i * usize::from(phentsize)).is_some_and(|kind| kind != PT_INTERP))
}

fn shell_quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-=:,".contains(&b))
    {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

fn shell_words(words: &[String]) -> String {
    words
        .iter()
        .map(|w| shell_quote(w))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_keeps_simple_words_and_quotes_the_rest() {
        assert_eq!(
            shell_quote("k8s.gpu.kerf.dev/gpu=abc-gpu-0"),
            "k8s.gpu.kerf.dev/gpu=abc-gpu-0"
        );
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn static_elf_detection() {
        assert!(!is_static_elf(b"#!/bin/sh\n"));
        // This test binary is dynamically linked on glibc targets.
        if let Ok(me) = std::env::current_exe().and_then(std::fs::read)
            && cfg!(all(
                target_env = "gnu",
                target_pointer_width = "64",
                target_endian = "little"
            ))
        {
            assert!(!is_static_elf(&me));
        }
        if let Ok(busybox) = std::fs::read("/bin/busybox") {
            // Debian's busybox-static; the dynamic busybox package would make this false.
            println!("/bin/busybox static: {}", is_static_elf(&busybox));
        }
    }
}
