//! The checkpoint file as two plugin instances share it during a rolling update: the lock
//! file beside it, the identity of the file a process last saw, and the three-way merge that
//! takes in what the other instance wrote. See the contract in the parent module's docs.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Read as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use kerf_core::checkpoint::{self, Checkpoint};

/// Device and inode of a checkpoint file. The file is only ever replaced by a rename, never
/// written in place ([`kerf_core::fsutil::write_atomic`]), so a path whose identity is
/// unchanged holds unchanged content, as long as the inode number cannot be reused: see
/// [`KnownFile`].
pub(super) type FileId = (u64, u64);

/// The checkpoint file a process last read or wrote, kept open: while it is open its inode is
/// not freed, so no later file can get the same inode number and look unchanged.
pub(super) struct KnownFile {
    _file: File,
    id: FileId,
}

impl KnownFile {
    /// The identity of the file.
    pub(super) fn id(&self) -> FileId {
        self.id
    }
}

/// The identity of the file at `path` now; `None` when there is none (or it cannot be
/// stat'ed, which the next read or write reports).
pub(super) fn current_id(path: &Path) -> Option<FileId> {
    std::fs::metadata(path)
        .ok()
        .map(|meta| (meta.dev(), meta.ino()))
}

/// Opens the file at `path` as the one now known; `None` when there is none.
pub(super) fn open_known(path: &Path) -> Option<KnownFile> {
    let file = File::open(path).ok()?;
    let meta = file.metadata().ok()?;
    Some(KnownFile {
        id: (meta.dev(), meta.ino()),
        _file: file,
    })
}

/// Reads and decodes the checkpoint at `path` through one open file, so that the content and
/// the identity belong together even if the file is replaced meanwhile. `Ok(None)` when there
/// is no file.
///
/// # Errors
/// The file cannot be read or does not decode; the caller keeps what it has in memory.
pub(super) fn read(path: &Path) -> Result<Option<(KnownFile, Checkpoint)>, String> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("open {}: {e}", path.display())),
    };
    let meta = file
        .metadata()
        .map_err(|e| format!("stat {}: {e}", path.display()))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| format!("read {}: {e}", path.display()))?;
    let checkpoint = checkpoint::decode(&bytes).map_err(|e| e.to_string())?;
    let known = KnownFile {
        id: (meta.dev(), meta.ino()),
        _file: file,
    };
    Ok(Some((known, checkpoint)))
}

/// The lock file of the writes beside the checkpoint: `<checkpoint>.lock`.
pub(super) fn lock_path(checkpoint: &Path) -> PathBuf {
    beside(checkpoint, ".lock")
}

/// The lock file of the operations beside the checkpoint: `<checkpoint>.operations.lock`.
pub(super) fn operations_lock_path(checkpoint: &Path) -> PathBuf {
    beside(checkpoint, ".operations.lock")
}

fn beside(checkpoint: &Path, suffix: &str) -> PathBuf {
    let mut name = checkpoint
        .file_name()
        .map(std::ffi::OsStr::to_os_string)
        .unwrap_or_default();
    name.push(suffix);
    checkpoint.with_file_name(name)
}

/// Opens (creating) the lock file. It is never written: only its `flock` matters.
///
/// # Errors
/// The file cannot be created or opened.
pub(super) fn open_lock(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
}

/// An exclusive `flock` on the lock file, released on drop. `flock` locks belong to an open
/// file description, so two stores of one process exclude each other as two processes do.
pub(super) struct Exclusive<'a>(&'a File);

impl<'a> Exclusive<'a> {
    /// Waits for the lock.
    ///
    /// # Errors
    /// `flock` failed.
    pub(super) fn take(file: &'a File) -> std::io::Result<Self> {
        file.lock()?;
        Ok(Exclusive(file))
    }
}

impl Drop for Exclusive<'_> {
    fn drop(&mut self) {
        // Closing the descriptor would release it too; the descriptor lives on, so unlock.
        if let Err(e) = self.0.unlock() {
            tracing::warn!(error = %e, "could not release the checkpoint lock");
        }
    }
}

/// Takes into `ours` what another instance changed between `base` (the file as this process
/// last saw it) and `theirs` (the file now): for every key of the claims, the undecodable
/// claims and the GPU sharing entries, a value this process did not change since `base` is
/// replaced by theirs (or removed, when theirs lacks it); a value this process changed stays.
/// Both instances changing one key at once (one claim prepared by both) keeps the last
/// writer's value, as with a single instance the last call's effect stays.
pub(super) fn merge(base: &Checkpoint, ours: &mut Checkpoint, theirs: &Checkpoint) {
    merge_map(&base.claims, &mut ours.claims, &theirs.claims);
    merge_map(
        &base.undecodable,
        &mut ours.undecodable,
        &theirs.undecodable,
    );
    merge_map(
        &base.gpu_sharing,
        &mut ours.gpu_sharing,
        &theirs.gpu_sharing,
    );
}

fn merge_map<V: Clone + PartialEq>(
    base: &BTreeMap<String, V>,
    ours: &mut BTreeMap<String, V>,
    theirs: &BTreeMap<String, V>,
) {
    // A key only in ours was added by this process: it stays.
    let keys: BTreeSet<&String> = base.keys().chain(theirs.keys()).collect();
    for key in keys {
        if ours.get(key) != base.get(key) {
            continue;
        }
        match theirs.get(key) {
            Some(value) => {
                ours.insert(key.clone(), value.clone());
            }
            None => {
                ours.remove(key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kerf_core::checkpoint::{ClaimEntry, ClaimState};

    use super::*;

    fn with(claims: &[(&str, ClaimState)]) -> Checkpoint {
        let mut cp = Checkpoint::default();
        for (uid, state) in claims {
            cp.claims.insert(
                (*uid).to_owned(),
                ClaimEntry {
                    state: *state,
                    ..ClaimEntry::default()
                },
            );
        }
        cp
    }

    #[test]
    fn keeps_our_changes_and_takes_theirs() {
        use ClaimState::{PrepareCompleted as Done, PrepareStarted as Started};
        let base = with(&[
            ("kept", Done),
            ("ours-removed", Done),
            ("theirs-removed", Done),
        ]);
        // We removed one claim and added one; they removed another and added another.
        let mut ours = with(&[
            ("kept", Done),
            ("theirs-removed", Done),
            ("ours-new", Started),
        ]);
        let theirs = with(&[("kept", Done), ("ours-removed", Done), ("theirs-new", Done)]);
        merge(&base, &mut ours, &theirs);
        let uids: Vec<&str> = ours.claims.keys().map(String::as_str).collect();
        assert_eq!(uids, ["kept", "ours-new", "theirs-new"]);
    }

    #[test]
    fn a_value_changed_by_them_replaces_an_unchanged_one() {
        use ClaimState::{PrepareCompleted as Done, PrepareStarted as Started};
        let base = with(&[("c", Started)]);
        let mut ours = base.clone();
        let theirs = with(&[("c", Done)]);
        merge(&base, &mut ours, &theirs);
        assert_eq!(ours.claims["c"].state, Done);
    }

    #[test]
    fn the_lock_file_sits_beside_the_checkpoint() {
        assert_eq!(
            lock_path(Path::new("/var/lib/kubelet/plugins/d/checkpoint.json")),
            PathBuf::from("/var/lib/kubelet/plugins/d/checkpoint.json.lock")
        );
    }
}
