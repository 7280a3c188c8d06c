//! Atomic, durable file writes for CDI specs and the checkpoint.
//!
//! A reader (a container runtime scanning `/var/run/cdi`, or the plugin itself after a crash)
//! must only ever see the old or the new content of a file, never a torn one, and a change
//! that was reported done must survive a power cut. That takes, and these functions do no
//! more than: write a temporary file in the same directory, fsync it, rename it over the
//! target and fsync the directory.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// Marker between the target name and the unique suffix of a temporary file.
const TEMP_MARKER: &str = ".tmp-";

/// Makes temporary names unique among the threads of this process; the process id in the
/// name separates processes. A process-wide counter is the one piece of shared state here,
/// kept because concurrent writers of the same target (two prepares of one claim) must not
/// share a temporary file.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes `contents` to `dir/file_name` atomically and durably.
///
/// The data goes to `.<file_name>.tmp-<pid>-<n>` in the same directory first, is fsynced,
/// renamed over the target and the directory is fsynced. On failure the temporary file is
/// removed and the target is left as it was.
///
/// # Errors
///
/// [`Error::Io`] naming the step (`create`, `write`, `fsync`, `rename`, `open dir`,
/// `fsync dir`) and path that failed, e.g. when `dir` is missing or not writable.
pub fn write_atomic(dir: &Path, file_name: &str, contents: &[u8]) -> Result<()> {
    let temp = dir.join(temp_file_name(file_name));
    if let Err(e) = write_synced(&temp, contents) {
        remove_quietly(&temp);
        return Err(e);
    }
    let target = dir.join(file_name);
    if let Err(e) = fs::rename(&temp, &target) {
        remove_quietly(&temp);
        return Err(Error::io("rename", target, e));
    }
    fsync_dir(dir)
}

/// Removes `dir/file_name` durably.
///
/// Returns `true` when the file existed and was removed, `false` when it was already absent
/// (nothing to make durable then, so the directory is not fsynced).
///
/// # Errors
///
/// [`Error::Io`] when the removal or the directory fsync fails for another reason than the
/// file being absent.
pub fn remove_durable(dir: &Path, file_name: &str) -> Result<bool> {
    let target = dir.join(file_name);
    match fs::remove_file(&target) {
        Ok(()) => {
            fsync_dir(dir)?;
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io("remove", target, e)),
    }
}

/// Fsyncs a directory so that entries created, renamed or removed in it are durable.
///
/// # Errors
///
/// [`Error::Io`] when the directory cannot be opened or fsynced.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    let handle = File::open(dir).map_err(|e| Error::io("open dir", dir, e))?;
    handle
        .sync_all()
        .map_err(|e| Error::io("fsync dir", dir, e))
}

/// Removes temporary files that [`write_atomic`] left in `dir` when its process died between
/// creating and renaming them, for targets whose name starts with `target_prefix` (so that
/// another writer's files in a shared directory such as `/var/run/cdi` are left alone).
/// Call it at start-up, before any writer of those targets runs.
///
/// Returns the paths removed, sorted.
///
/// # Errors
///
/// [`Error::Io`] when `dir` cannot be listed or a leftover cannot be removed. A missing
/// `dir` is not an error.
pub fn remove_stale_temp_files(dir: &Path, target_prefix: &str) -> Result<Vec<PathBuf>> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("read dir", dir, e)),
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("read dir", dir, e))?;
        let name = entry.file_name();
        if name
            .to_str()
            .is_some_and(|n| is_temp_file_for(n, target_prefix))
        {
            let path = entry.path();
            fs::remove_file(&path).map_err(|e| Error::io("remove", &path, e))?;
            removed.push(path);
        }
    }
    if !removed.is_empty() {
        fsync_dir(dir)?;
    }
    removed.sort();
    Ok(removed)
}

/// True for names [`write_atomic`] gives temporary files of targets starting with
/// `target_prefix`. The suffix also keeps CDI loaders away from them: they only read names
/// ending in `.json` or `.yaml`.
fn is_temp_file_for(name: &str, target_prefix: &str) -> bool {
    name.strip_prefix('.')
        .is_some_and(|rest| rest.starts_with(target_prefix) && rest.contains(TEMP_MARKER))
}

fn temp_file_name(file_name: &str) -> String {
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(".{file_name}{TEMP_MARKER}{}-{n}", std::process::id())
}

/// Creates (or truncates a leftover of) `path`, writes `contents` and fsyncs the data.
///
/// `sync_data` suffices: the file is new, and fdatasync also flushes the size change that
/// reading the data back needs; the name becomes durable with the directory fsync.
fn write_synced(path: &Path, contents: &[u8]) -> Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| Error::io("create", path, e))?;
    file.write_all(contents)
        .map_err(|e| Error::io("write", path, e))?;
    file.sync_data().map_err(|e| Error::io("fsync", path, e))
}

/// Best-effort cleanup on an error path: the original error is the one worth reporting.
fn remove_quietly(path: &Path) {
    let _ = fs::remove_file(path);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_names_are_hidden_unique_and_recognised() {
        let a = temp_file_name("x.json");
        let b = temp_file_name("x.json");
        assert_ne!(a, b);
        assert!(a.starts_with(".x.json.tmp-"));
        assert!(is_temp_file_for(&a, ""));
        assert!(is_temp_file_for(&a, "x."));
        assert!(!is_temp_file_for(&a, "y"));
        assert!(!is_temp_file_for("x.json", ""));
        assert!(!is_temp_file_for(".hidden", ""));
    }
}
