//! The in-memory-first checkpoint of prepared claims.
//!
//! Every mutation happens on the in-memory [`Checkpoint`] under a short lock and gets a
//! sequence number; [`CheckpointStore::update`] then writes a snapshot itself, unless a write
//! that began after its mutation already covered it. Concurrent prepares therefore share
//! writes instead of each making its own.
//!
//! A write replaces the file atomically and is not fsync'd ([`checkpoint::save`]): it must
//! survive the plugin (a crash, a SIGKILL, a rolling update), which the page cache does, not
//! the node. A power loss or kernel crash boots the node again, and a checkpoint from an older
//! boot holds nothing prepared in this one ([`Checkpoint::forget_older_boot`]), torn or not.
//!
//! The write runs in the caller's task, without a hand-over to another thread: without an
//! fsync it is a few syscalls (a temporary file, a rename; about 0.1 ms), less than waking a
//! writer thread and being woken by it costs on a busy node.
//!
//! # Two instances, one file
//!
//! During a rolling update (pod UID sockets, DaemonSet `maxSurge: 1`) an old and a new plugin
//! instance run side by side on one node and share this file; the kubelet may send a claim's
//! prepare to one and its unprepare to the other (upstream's `RollingUpdate` option in
//! `k8s.io/dynamic-resource-allocation/kubeletplugin/draplugin.go`: "each instance must be
//! entirely stateless across method calls"). Upstream's helper serializes every call of both
//! instances on a `flock`; kerf keeps its concurrent prepares and makes each access safe:
//!
//! - **Writes** hold an exclusive `flock` on `<checkpoint>.lock` from "has the file changed
//!   since this process last saw it?" through the write: if it has, the file is read
//!   and merged in first ([`two_instances::merge`]: per claim, per GPU, what this process did
//!   not change since it last saw the file takes the file's value). Neither instance's write
//!   can therefore drop a claim the other one wrote.
//! - **Reads and in-memory mutations** first compare the file's device and inode with the file
//!   this process last read or wrote (kept open, so the inode number cannot be reused): one
//!   `stat`, no parse. Only a file replaced by the other instance is read and merged. A read
//!   thus sees every change the other instance had written when the read began; what the
//!   other instance holds only in memory (a prepare it started and has not finished) is not
//!   seen, so a device check across instances covers finished prepares only.
//! - While this process's own writer replaces the file under the lock, a changed inode is its
//!   own write and needs no read.
//! - **Start-up against running operations**: an instance's start-up removes what no
//!   checkpoint entry owns (CDI specs, unfinished dynamic-MIG instances, MPS daemons and time
//!   slices no claim needs). The other instance's prepare in flight owns such things before
//!   its entry is written. So every prepare (past its API read, like upstream's helper, which
//!   fetches claims "before serializing") and unprepare holds a shared `flock` on
//!   `<checkpoint>.operations.lock` ([`CheckpointStore::operation`]), and start-up's
//!   clean-up holds it exclusively (`CheckpointStore::start_up_hold`): it waits for the other
//!   instance's operations to end, and the other instance's next ones wait for it. A prepare of
//!   a claim already prepared takes no hold: nothing start-up removes belongs to it.
//!
//! A plugin from before this contract does not take the lock; the rolling update that
//! installs this version overlaps with such an instance, which the kubelet sends no calls once
//! the new one is registered.

use std::fs::File;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kerf_core::checkpoint::{self, Checkpoint, LoadOutcome};

use crate::{Error, Result};

mod two_instances;

use two_instances::{Exclusive, FileId, KnownFile};

/// Why a checkpoint write failed: the disk refused it, or the task writing it panicked. The
/// two get different errors so that metrics do not count a bug as a disk problem.
#[derive(Debug, Clone)]
enum WriteFailure {
    Save(Arc<str>),
    Panicked(Arc<str>),
}

/// The in-memory checkpoint and its sequence numbers.
struct State {
    checkpoint: Checkpoint,
    /// Number of the latest mutation.
    seq: u64,
    /// Number of the latest mutation the file holds.
    written: u64,
    /// The checkpoint as the file held it when this process last read or wrote it: what the
    /// other instance's changes are told from this process's own.
    base: Checkpoint,
    /// The file that held `base`.
    known: Option<KnownFile>,
    /// This process's writer holds the lock and is replacing the file.
    writing: bool,
    /// How often the file was read again because the other instance had replaced it.
    reloads: u64,
}

impl State {
    fn known_id(&self) -> Option<FileId> {
        self.known.as_ref().map(KnownFile::id)
    }

    /// Takes in `theirs`, read from `known`, unless that file is already the known one.
    fn take_in(&mut self, known: KnownFile, theirs: &Checkpoint) {
        if self.known_id() == Some(known.id()) {
            return;
        }
        two_instances::merge(&self.base, &mut self.checkpoint, theirs);
        self.base = theirs.clone();
        self.known = Some(known);
        self.reloads += 1;
    }
}

struct CheckpointInner {
    path: PathBuf,
    state: Mutex<State>,
    /// `<checkpoint>.lock`, whose `flock` the writes of every instance hold.
    lock_file: File,
    /// Serializes this process's reloads and writes, so that `base` and `known` change
    /// together.
    sync: Mutex<()>,
}

/// A hold on the operations of every instance that shares the checkpoint: shared by prepares
/// and unprepares, exclusive during an instance's start-up clean-up (see the module docs).
/// Released on drop (closing its own descriptor releases its `flock`).
#[derive(Debug)]
pub struct OperationsHold {
    _file: File,
}

/// Handle to the checkpoint. Cheap to clone.
#[derive(Clone)]
pub struct CheckpointStore {
    inner: Arc<CheckpointInner>,
}

/// What [`CheckpointStore::open`] found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened {
    /// No checkpoint existed; starting empty.
    Fresh,
    /// The checkpoint was loaded; it was written in this boot.
    Loaded,
    /// The checkpoint was written in an older boot: its claims were forgotten (see
    /// [`Checkpoint::forget_older_boot`]).
    Rebooted {
        /// How many claims the older boot had prepared.
        forgotten: usize,
    },
    /// The checkpoint was corrupt and was moved aside; starting empty.
    MovedAside {
        /// Where the corrupt file now is.
        moved_to: PathBuf,
        /// Why it could not be used.
        reason: String,
    },
}

impl CheckpointStore {
    /// Loads the checkpoint at `path` (or starts empty).
    ///
    /// Must be called inside a Tokio runtime. The boot ID is recorded in every write.
    ///
    /// # Errors
    /// An I/O error other than "not found" while reading the file, or the first write of a
    /// fresh checkpoint failing (e.g. the directory is not writable).
    pub async fn open(path: &Path, boot_id: &str) -> Result<(Self, Opened)> {
        let lock_path = two_instances::lock_path(path);
        let lock_file =
            two_instances::open_lock(&lock_path).map_err(|e| Error::io("open", &lock_path, e))?;
        let read_path = path.to_owned();
        let (lock_file, outcome, known) = tokio::task::spawn_blocking(move || {
            // Under the lock: another instance's write cannot slip between the load and the
            // identity of the file loaded.
            let locked = Exclusive::take(&lock_file).map_err(|e| Error::io("lock", &lock_path, e));
            let loaded = locked.and_then(|_held| {
                let outcome = checkpoint::load(&read_path)?;
                Ok((outcome, two_instances::open_known(&read_path)))
            });
            loaded.map(|(outcome, known)| (lock_file, outcome, known))
        })
        .await
        .map_err(|e| Error::internal("the checkpoint loader task", e))??;
        let (mut cp, opened) = match outcome {
            LoadOutcome::Missing => (Checkpoint::default(), Opened::Fresh),
            LoadOutcome::Loaded(mut cp) if cp.is_from_older_boot(boot_id) => {
                let forgotten = cp.forget_older_boot();
                (cp, Opened::Rebooted { forgotten })
            }
            LoadOutcome::Loaded(cp) => (cp, Opened::Loaded),
            LoadOutcome::Corrupt { moved_to, reason } => (
                Checkpoint::default(),
                Opened::MovedAside { moved_to, reason },
            ),
        };
        let base = cp.clone();
        boot_id.clone_into(&mut cp.boot_id);
        let inner = Arc::new(CheckpointInner {
            path: path.to_owned(),
            state: Mutex::new(State {
                checkpoint: cp,
                seq: 0,
                written: 0,
                base,
                known,
                writing: false,
                reloads: 0,
            }),
            lock_file,
            sync: Mutex::new(()),
        });
        let store = CheckpointStore { inner };
        // Persist once so that the boot ID and any migration are on disk, and so that an
        // unwritable directory is reported at start-up rather than at the first prepare.
        store.update(|_| ()).await?;
        Ok((store, opened))
    }

    /// Reads the in-memory checkpoint, after taking in what another instance wrote to the
    /// file since this process last saw it (see the module docs).
    pub fn read<T>(&self, f: impl FnOnce(&Checkpoint) -> T) -> T {
        f(&self.fresh().checkpoint)
    }

    /// Mutates the checkpoint in memory only: the change reaches the disk with the next write
    /// that someone waits for (or never, if the process stops first). For state whose loss
    /// in a crash is harmless, such as a prepare that has started, which would otherwise cost
    /// a write of its own.
    pub(crate) fn mutate_lazily<T>(&self, f: impl FnOnce(&mut Checkpoint) -> T) -> T {
        let mut guard = self.fresh();
        let out = f(&mut guard.checkpoint);
        guard.seq += 1;
        out
    }

    /// Mutates the checkpoint and returns once the file holds the mutation: written here,
    /// or by a write that began after it. Blocks the calling thread for the write (a few
    /// syscalls, and the other instance's write if it holds the lock at that moment).
    ///
    /// # Errors
    /// The write that was to hold this mutation failed.
    #[allow(
        clippy::unused_async,
        reason = "an operation of the prepare's sequence; async so that it may hand the write off again without touching its callers"
    )]
    pub async fn update<T>(&self, f: impl FnOnce(&mut Checkpoint) -> T) -> Result<T> {
        let (out, seq) = {
            let mut guard = self.fresh();
            let out = f(&mut guard.checkpoint);
            guard.seq += 1;
            (out, guard.seq)
        };
        match write_covering(&self.inner, seq) {
            Ok(()) => Ok(out),
            Err(WriteFailure::Panicked(detail)) => {
                Err(Error::internal("the checkpoint write", detail))
            }
            Err(WriteFailure::Save(reason)) => Err(kerf_core::Error::Checkpoint {
                path: self.inner.path.clone(),
                reason: reason.to_string(),
            }
            .into()),
        }
    }

    /// The checkpoint file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Holds the operations lock shared, for one prepare or unprepare.
    ///
    /// # Errors
    /// The lock file cannot be opened or locked.
    pub async fn operation(&self) -> Result<OperationsHold> {
        self.hold(false).await
    }

    /// Holds the operations lock exclusively, for start-up's clean-up: waits until the other
    /// instance's operations have ended.
    ///
    /// # Errors
    /// The lock file cannot be opened or locked.
    pub(crate) async fn start_up_hold(&self) -> Result<OperationsHold> {
        self.hold(true).await
    }

    async fn hold(&self, exclusive: bool) -> Result<OperationsHold> {
        let path = two_instances::operations_lock_path(&self.inner.path);
        // A descriptor of its own: `flock` locks belong to the open file description, so
        // holds sharing one would release each other's.
        let file = two_instances::open_lock(&path).map_err(|e| Error::io("open", &path, e))?;
        let quick = if exclusive {
            file.try_lock()
        } else {
            file.try_lock_shared()
        };
        match quick {
            Ok(()) => return Ok(OperationsHold { _file: file }),
            Err(std::fs::TryLockError::WouldBlock) => {}
            Err(std::fs::TryLockError::Error(e)) => return Err(Error::io("lock", &path, e)),
        }
        tracing::info!(path = %path.display(), exclusive, "waiting for another plugin instance (start-up clean-up or operations in flight)");
        let lock_path = path.clone();
        let file = tokio::task::spawn_blocking(move || {
            let locked = if exclusive {
                file.lock()
            } else {
                file.lock_shared()
            };
            locked.map(|()| file)
        })
        .await
        .map_err(|e| Error::internal("the operations lock task", e))?
        .map_err(|e| Error::io("lock", &lock_path, e))?;
        Ok(OperationsHold { _file: file })
    }

    /// How often the file was read again because another instance had replaced it.
    pub fn reloads(&self) -> u64 {
        self.lock().reloads
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock_state(&self.inner)
    }

    /// The state, with what another instance wrote taken in. The fast path, an
    /// unchanged file, costs one `stat`.
    fn fresh(&self) -> MutexGuard<'_, State> {
        let on_disk = two_instances::current_id(&self.inner.path);
        let guard = self.lock();
        if guard.writing || on_disk == guard.known_id() || on_disk.is_none() {
            return guard;
        }
        drop(guard);
        let _sync = self
            .inner
            .sync
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if two_instances::current_id(&self.inner.path) != self.lock().known_id() {
            match two_instances::read(&self.inner.path) {
                Ok(Some((known, theirs))) => self.lock().take_in(known, &theirs),
                Ok(None) => {}
                Err(reason) => {
                    tracing::error!(path = %self.inner.path.display(), %reason, "cannot read the checkpoint another plugin instance wrote; going on with this instance's");
                }
            }
        }
        self.lock()
    }
}

fn lock_state(inner: &CheckpointInner) -> MutexGuard<'_, State> {
    // A panic while holding the lock cannot leave the checkpoint half-mutated in a way
    // that matters more than stopping would: keep serving.
    inner.state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Makes the file hold mutation `seq`: nothing when a write since has, else one write under
/// the lock, which takes in the other instance's changes and writes a snapshot.
fn write_covering(inner: &CheckpointInner, seq: u64) -> std::result::Result<(), WriteFailure> {
    let _sync = inner.sync.lock().unwrap_or_else(PoisonError::into_inner);
    if lock_state(inner).written >= seq {
        return Ok(());
    }
    let locked = Exclusive::take(&inner.lock_file);
    let mut state = lock_state(inner);
    let held = match locked {
        Ok(held) => held,
        Err(e) => {
            let reason = format!(
                "lock {}: {e}",
                two_instances::lock_path(&inner.path).display()
            );
            return Err(WriteFailure::Save(reason.into()));
        }
    };
    if two_instances::current_id(&inner.path) != state.known_id() {
        drop(state);
        let read = two_instances::read(&inner.path);
        state = lock_state(inner);
        match read {
            Ok(Some((known, theirs))) => state.take_in(known, &theirs),
            Ok(None) => {}
            Err(reason) => {
                // Writing over a file that does not decode would lose the other instance's
                // claims for good; fail the write instead, and say why.
                return Err(WriteFailure::Save(reason.into()));
            }
        }
    }
    let (snapshot, snapshot_seq) = (state.checkpoint.clone(), state.seq);
    state.writing = true;
    drop(state);
    let outcome = match catch_unwind(AssertUnwindSafe(|| {
        checkpoint::save(&inner.path, &snapshot)
    })) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(WriteFailure::Save(e.to_string().into())),
        Err(panic) => Err(WriteFailure::Panicked(panic_message(panic.as_ref()).into())),
    };
    let known = outcome
        .is_ok()
        .then(|| two_instances::open_known(&inner.path))
        .flatten();
    let mut state = lock_state(inner);
    state.writing = false;
    if outcome.is_ok() {
        state.base = snapshot;
        state.known = known;
        state.written = snapshot_seq;
    }
    // Only now may the other instance write: until `known` names this write, a replaced
    // file here would be taken for this process's own.
    drop(state);
    drop(held);
    if let Err(WriteFailure::Save(message) | WriteFailure::Panicked(message)) = &outcome {
        tracing::error!(path = %inner.path.display(), error = %message, "checkpoint write failed");
    }
    outcome
}

/// The message of a panic's payload, as the standard library prints it.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "the checkpoint write panicked".to_owned())
}

#[cfg(test)]
mod tests;
