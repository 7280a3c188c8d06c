//! Atomic file writes: durable ones for the checkpoint, and ones without any flush for files
//! that are rebuilt after a crash (the CDI specs).
//!
//! A reader (a container runtime scanning `/var/run/cdi`, or the plugin itself after a crash)
//! must only ever see the old or the new content of a file, never a torn one. That takes a
//! temporary file in the same directory renamed over the target; [`write_replace`] and
//! [`remove_if_exists`] do no more than that. A change that was reported done must also
//! survive a power cut when nothing else can rebuild it: [`write_atomic`] and
//! [`remove_durable`] add an fsync of the file before the rename and of the directory after
//! it, and [`commit`] does that for many files at once with one flush of their data and one
//! directory fsync.
//!
//! Without the flushes a power cut may leave a replaced file at its old content, empty or
//! partly written, and a removed file back (a process crash alone leaves none of these: the
//! kernel's page cache survives it). Callers of the cheap pair must rebuild such files from a
//! durable record at start-up.

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

/// One change to a file of a directory, made durably by [`commit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileChange<'a> {
    /// Replace (or create) `name` with `contents`, atomically.
    Write {
        /// File name within the directory.
        name: &'a str,
        /// The new content.
        contents: &'a [u8],
    },
    /// Remove `name` if it exists.
    Remove {
        /// File name within the directory.
        name: &'a str,
    },
}

impl FileChange<'_> {
    fn name(&self) -> &str {
        match self {
            FileChange::Write { name, .. } | FileChange::Remove { name } => name,
        }
    }
}

/// Makes several changes to files of `dir` atomically (each file shows its old or its new
/// content, never a torn one) and durably, sharing the expensive steps among them: one
/// durability barrier for the data of every written file, then the renames and removals in
/// order, then one fsync of the directory.
///
/// The barrier is an fdatasync when one file was written and one `syncfs` of the
/// directory's filesystem when several were: disks (virtual ones especially) serialise
/// fsyncs, so N files cost N flushes one way and one flush the other. `syncfs` also flushes
/// other dirty data on that filesystem, which is why it only replaces two or more fsyncs; on
/// a tmpfs it costs nothing.
///
/// Returns one result per change, in order: for a write `Ok(true)`; for a removal whether
/// the file existed. A failure of a shared step fails every change that depended on it; a
/// failed write leaves its target as it was and no temporary file behind.
pub fn commit(dir: &Path, changes: &[FileChange<'_>]) -> Vec<Result<bool>> {
    let mut results: Vec<Result<bool>> = Vec::with_capacity(changes.len());
    let mut staged: Vec<Option<Staged>> = Vec::with_capacity(changes.len());
    for change in changes {
        match *change {
            FileChange::Write { name, contents } => match stage(dir, name, contents) {
                Ok(s) => {
                    staged.push(Some(s));
                    results.push(Ok(true));
                }
                Err(e) => {
                    staged.push(None);
                    results.push(Err(e));
                }
            },
            FileChange::Remove { .. } => {
                staged.push(None);
                results.push(Ok(false));
            }
        }
    }
    if let Err(e) = barrier(dir, &staged) {
        for (result, s) in results.iter_mut().zip(&mut staged) {
            if let Some(s) = s.take() {
                remove_quietly(&s.temp);
                *result = Err(copy_error(&e));
            }
        }
    }
    let mut touched = Vec::new();
    for (i, change) in changes.iter().enumerate() {
        let outcome = match (change, staged[i].take()) {
            (FileChange::Write { .. }, Some(s)) => publish(dir, change.name(), s).map(|()| true),
            (FileChange::Write { .. }, None) => continue,
            (FileChange::Remove { name }, _) => remove(dir, name),
        };
        match outcome {
            Ok(changed) => {
                results[i] = Ok(changed);
                if changed {
                    touched.push(i);
                }
            }
            Err(e) => results[i] = Err(e),
        }
    }
    if !touched.is_empty()
        && let Err(e) = fsync_dir(dir)
    {
        for i in touched {
            results[i] = Err(copy_error(&e));
        }
    }
    results
}

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
    let change = FileChange::Write {
        name: file_name,
        contents,
    };
    single(commit(dir, &[change])).map(|_| ())
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
    single(commit(dir, &[FileChange::Remove { name: file_name }]))
}

/// Replaces (or creates) `dir/file_name` with `contents` atomically, without making the
/// change durable: a reader sees the old or the new content, never a torn one, but after a
/// power cut the file may be old, absent, empty or partly written. For files rebuilt from a durable record
/// at start-up, which then cost a few syscalls instead of two flushes.
///
/// The data goes to the same temporary name as with [`write_atomic`] (so that
/// [`remove_stale_temp_files`] finds it after a crash) and is renamed over the target. On
/// failure the temporary file is removed and the target is left as it was.
///
/// # Errors
///
/// [`Error::Io`] naming the step (`create`, `write`, `rename`) and the path that failed, e.g.
/// when `dir` is missing or not writable, or the target is a non-empty directory.
pub fn write_replace(dir: &Path, file_name: &str, contents: &[u8]) -> Result<()> {
    let staged = stage(dir, file_name, contents)?;
    publish(dir, file_name, staged)
}

/// Removes `dir/file_name` without making the removal durable (after a power cut the file
/// may be back); the counterpart of [`write_replace`].
///
/// Returns `true` when the file existed and was removed, `false` when it was already absent.
///
/// # Errors
///
/// [`Error::Io`] (`remove`) when the removal fails for another reason than the file being
/// absent, e.g. when the name is a directory.
pub fn remove_if_exists(dir: &Path, file_name: &str) -> Result<bool> {
    remove(dir, file_name)
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

/// Removes temporary files that [`write_atomic`] or [`write_replace`] left in `dir` when its process died between
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

/// True for names [`write_atomic`] and [`write_replace`] give temporary files of targets starting with
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

/// A written, not yet durable temporary file waiting to be renamed over its target.
struct Staged {
    temp: PathBuf,
    file: File,
}

/// Creates (or truncates a leftover of) the temporary file of `name` and writes `contents`.
fn stage(dir: &Path, name: &str, contents: &[u8]) -> Result<Staged> {
    let temp = dir.join(temp_file_name(name));
    let written = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&temp)
        .map_err(|e| Error::io("create", &temp, e))
        .and_then(|mut file| {
            file.write_all(contents)
                .map_err(|e| Error::io("write", &temp, e))
                .map(|()| file)
        });
    match written {
        Ok(file) => Ok(Staged { temp, file }),
        Err(e) => {
            remove_quietly(&temp);
            Err(e)
        }
    }
}

/// Makes the data of every staged file durable (see [`commit`] for the choice of call).
///
/// `sync_data` suffices for one file: it is new, and fdatasync also flushes the size change
/// that reading the data back needs; names become durable with the directory fsync.
fn barrier(dir: &Path, staged: &[Option<Staged>]) -> Result<()> {
    let mut files = staged.iter().flatten();
    match (files.next(), files.next()) {
        (None, _) => Ok(()),
        (Some(only), None) => only
            .file
            .sync_data()
            .map_err(|e| Error::io("fsync", &only.temp, e)),
        (Some(first), Some(_)) => rustix::fs::syncfs(&first.file)
            .map_err(|e| Error::io("syncfs", dir, io::Error::from(e))),
    }
}

/// Renames a temporary file (made durable first by [`commit`], not by [`write_replace`]) over
/// its target.
fn publish(dir: &Path, name: &str, staged: Staged) -> Result<()> {
    drop(staged.file);
    let target = dir.join(name);
    fs::rename(&staged.temp, &target).map_err(|e| {
        remove_quietly(&staged.temp);
        Error::io("rename", target, e)
    })
}

/// Removes `dir/name`; `false` when it was not there.
fn remove(dir: &Path, name: &str) -> Result<bool> {
    let target = dir.join(name);
    match fs::remove_file(&target) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io("remove", target, e)),
    }
}

/// The result of a one-change [`commit`].
fn single(mut results: Vec<Result<bool>>) -> Result<bool> {
    results.pop().unwrap_or(Ok(false))
}

/// A shared step's error, once per change it failed (I/O errors do not clone).
fn copy_error(e: &Error) -> Error {
    match e {
        Error::Io { op, path, source } => Error::io(
            op,
            path.clone(),
            io::Error::new(source.kind(), source.to_string()),
        ),
        other => Error::io(
            "commit",
            PathBuf::new(),
            io::Error::other(other.to_string()),
        ),
    }
}

/// Best-effort cleanup on an error path: the original error is the one worth reporting.
fn remove_quietly(path: &Path) {
    let _ = fs::remove_file(path);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)] // Test helpers may fail loudly.

    use super::*;

    #[test]
    fn write_replace_leaves_temporary_files_that_start_up_clean_up_recognises() {
        // What a crash between create and rename would leave: the temporary name itself.
        let dir = tempfile::tempdir().unwrap();
        let staged = stage(dir.path(), "k8s.gpu.kerf.dev-gpu_u1.json", b"x").unwrap();
        drop(staged.file);
        let removed = remove_stale_temp_files(dir.path(), "k8s.gpu.kerf.dev-gpu_").unwrap();
        assert_eq!(removed, [staged.temp]);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

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
