//! Discovery of the NVIDIA user-space driver files (libraries and tools) that containers get
//! as read-only bind mounts.
//!
//! The driver root is `/` on hosts with the driver installed, or e.g. `/run/nvidia/driver`
//! when a driver container provides it. Paths inside the root are resolved as if the root
//! were `/`: an absolute symlink such as `lib64 -> /usr/lib64` points into the root, not
//! into the host. Each file is mounted at its path relative to the root; a symlink such as
//! `libcuda.so.1 -> libcuda.so.570.124.06` is mounted as the file it resolves to at the
//! symlink's own path, so the container needs no symlinks of its own (or an ldconfig hook).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use crate::cdi::{Mount, READ_ONLY_BIND};
use crate::error::{Error, Result};

/// Library directories searched, relative to the root, most specific first. A directory that
/// resolves to one already searched (merged-`/usr` aliases like `lib64 -> usr/lib64`) is
/// skipped, so each file is mounted once, at the first path it was found under.
const LIBRARY_DIRS: [&str; 8] = [
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "lib64",
    "usr/lib",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib",
];

/// Library name stems: a file matches a stem when its name is the stem or the stem followed
/// by `.` and a version (`libcuda.so`, `libcuda.so.1`, `libcuda.so.570.124.06`).
pub const LIBRARY_STEMS: [&str; 11] = [
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-gpucomp.so",
    "libnvidia-allocator.so",
    "libnvidia-cfg.so",
    "libnvidia-opencl.so",
    // Only in older drivers; harmless where absent.
    "libnvidia-fatbinaryloader.so",
    "libnvidia-compiler.so",
];

/// Binary directories searched, relative to the root.
const BINARY_DIRS: [&str; 2] = ["usr/bin", "bin"];

/// Binaries mounted when present.
pub const BINARIES: [&str; 5] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];

/// Symlink hops followed before a path is considered a loop (as Linux's `MAXSYMLINKS`).
const MAX_SYMLINK_HOPS: u32 = 40;

/// One file to mount.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DriverFile {
    /// Absolute path in the container: the path relative to the root, under `/`.
    pub container_path: PathBuf,
    /// The regular file on the host that the container path resolves to.
    pub host_path: PathBuf,
}

/// The driver files found under a root.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverFiles {
    /// The driver root searched.
    pub root: PathBuf,
    /// Libraries, sorted by container path.
    pub libraries: Vec<DriverFile>,
    /// Binaries, sorted by container path.
    pub binaries: Vec<DriverFile>,
}

impl DriverFiles {
    /// Read-only bind mounts of every file: libraries first, then binaries, each sorted by
    /// container path. No mount `type`, which keeps specs at the oldest CDI version.
    pub fn mounts(&self) -> Vec<Mount> {
        self.libraries
            .iter()
            .chain(&self.binaries)
            .map(|f| Mount {
                host_path: f.host_path.to_string_lossy().into_owned(),
                container_path: f.container_path.to_string_lossy().into_owned(),
                options: READ_ONLY_BIND.iter().map(|&o| o.to_owned()).collect(),
                fs_type: None,
            })
            .collect()
    }

    /// True when nothing was found.
    pub fn is_empty(&self) -> bool {
        self.libraries.is_empty() && self.binaries.is_empty()
    }
}

/// Finds the driver libraries ([`LIBRARY_STEMS`] in `LIBRARY_DIRS`) and binaries
/// ([`BINARIES`] in `BINARY_DIRS`) under `root`. Missing directories and dangling symlinks
/// are skipped; the result is deterministic.
///
/// # Errors
///
/// [`Error::Io`] when `root` is missing, not a directory, not valid UTF-8 or unreadable, or
/// a search directory exists but cannot be read (silently mounting fewer libraries would
/// break CUDA in ways that are hard to trace back).
pub fn discover(root: &Path) -> Result<DriverFiles> {
    check_root(root)?;
    let library = |name: &str| {
        LIBRARY_STEMS.iter().any(|stem| {
            name.strip_prefix(stem)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
        })
    };
    let binary = |name: &str| BINARIES.contains(&name);
    Ok(DriverFiles {
        root: root.to_owned(),
        libraries: find_files(root, &LIBRARY_DIRS, library)?,
        binaries: find_files(root, &BINARY_DIRS, binary)?,
    })
}

fn check_root(root: &Path) -> Result<()> {
    if root.to_str().is_none() {
        let e = io::Error::new(
            io::ErrorKind::InvalidInput,
            "driver root is not valid UTF-8",
        );
        return Err(Error::io("open driver root", root, e));
    }
    let meta = fs::metadata(root).map_err(|e| Error::io("stat driver root", root, e))?;
    if !meta.is_dir() {
        let e = io::Error::new(
            io::ErrorKind::NotADirectory,
            "driver root is not a directory",
        );
        return Err(Error::io("open driver root", root, e));
    }
    fs::read_dir(root)
        .map(drop)
        .map_err(|e| Error::io("read driver root", root, e))
}

fn find_files(
    root: &Path,
    dirs: &[&str],
    wanted: impl Fn(&str) -> bool,
) -> Result<Vec<DriverFile>> {
    let mut searched = BTreeSet::new();
    let mut found = Vec::new();
    for dir in dirs {
        let resolved = resolve_in_root(root, Path::new(dir))
            .map_err(|e| Error::io("resolve", root.join(dir), e))?;
        let Some(resolved) = resolved else { continue };
        if !searched.insert(resolved.clone()) {
            continue;
        }
        let listing = root.join(&resolved);
        let names = match list_names(&listing) {
            Ok(names) => names,
            Err(e) if is_missing(&e) => continue,
            Err(e) => return Err(Error::io("read dir", listing, e)),
        };
        for name in names.iter().filter(|n| wanted(n)) {
            let link_path = resolved.join(name);
            let target = resolve_in_root(root, &link_path)
                .map_err(|e| Error::io("resolve", root.join(&link_path), e))?;
            let Some(target) = target else { continue };
            let host_path = root.join(target);
            if fs::metadata(&host_path).is_ok_and(|m| m.is_file()) {
                found.push(DriverFile {
                    container_path: Path::new("/").join(dir).join(name),
                    host_path,
                });
            }
        }
    }
    found.sort();
    Ok(found)
}

/// The UTF-8 names in a directory (driver file names are ASCII), sorted.
fn list_names(dir: &Path) -> io::Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir)? {
        if let Ok(name) = entry?.file_name().into_string() {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

fn is_missing(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
    )
}

/// One step of a path being resolved.
enum Step {
    Root,
    Parent,
    Name(OsString),
}

fn steps(path: &Path) -> impl Iterator<Item = Step> + '_ {
    path.components().filter_map(|c| match c {
        Component::RootDir | Component::Prefix(_) => Some(Step::Root),
        Component::ParentDir => Some(Step::Parent),
        Component::Normal(name) => Some(Step::Name(name.to_owned())),
        Component::CurDir => None,
    })
}

/// Resolves `path` inside `root` as if `root` were `/`: symlinks (relative or absolute) are
/// followed, and `..` never climbs above the root. Returns the resolved path relative to the
/// root, or `None` when it does not exist (or a symlink loop makes it unreachable).
fn resolve_in_root(root: &Path, path: &Path) -> io::Result<Option<PathBuf>> {
    let mut resolved = PathBuf::new();
    let mut pending: std::collections::VecDeque<Step> = steps(path).collect();
    let mut hops = 0;
    while let Some(step) = pending.pop_front() {
        let name = match step {
            Step::Root => {
                resolved.clear();
                continue;
            }
            Step::Parent => {
                resolved.pop();
                continue;
            }
            Step::Name(name) => name,
        };
        let candidate = resolved.join(&name);
        let host = root.join(&candidate);
        let meta = match fs::symlink_metadata(&host) {
            Ok(meta) => meta,
            Err(e) if is_missing(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
        if !meta.file_type().is_symlink() {
            resolved = candidate;
            continue;
        }
        hops += 1;
        if hops > MAX_SYMLINK_HOPS {
            return Ok(None);
        }
        let target = fs::read_link(&host)?;
        let mut expanded: std::collections::VecDeque<Step> = steps(&target).collect();
        expanded.extend(pending);
        pending = expanded;
    }
    Ok(Some(resolved))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn resolution_stays_inside_the_root() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::create_dir_all(root.join("usr/lib64")).unwrap();
        fs::write(root.join("usr/lib64/libx.so.1"), b"x").unwrap();
        symlink("/usr/lib64", root.join("lib64")).unwrap();
        symlink("../../../../usr/lib64/libx.so.1", root.join("usr/lib64/up")).unwrap();
        symlink("loop", root.join("loop")).unwrap();
        let r = |p: &str| resolve_in_root(root, Path::new(p)).unwrap();
        assert_eq!(
            r("lib64/libx.so.1"),
            Some(PathBuf::from("usr/lib64/libx.so.1"))
        );
        assert_eq!(
            r("usr/lib64/up"),
            Some(PathBuf::from("usr/lib64/libx.so.1"))
        );
        assert_eq!(r("loop"), None);
        assert_eq!(r("missing/x"), None);
        assert_eq!(r("usr/lib64/libx.so.1/child"), None);
    }
}
