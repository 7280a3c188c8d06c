//! The durable, in-memory-first checkpoint of prepared claims, with group commit.
//!
//! Every mutation happens on the in-memory [`Checkpoint`] under a short lock and gets a
//! sequence number; one writer thread persists snapshots. Concurrent prepares therefore share
//! one fsync'd write instead of queueing behind each other's: a caller waits only until a
//! snapshot that includes its own mutation is durable.
//!
//! The writer is a thread of its own, not a task that hands each write to the blocking pool:
//! a lone prepare then waits for one wake-up of the writer and one of itself, not for four
//! hand-overs between the runtime's threads, and the write is most of what it waits for.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kerf_core::checkpoint::{self, Checkpoint, LoadOutcome};
use tokio::sync::watch;

use crate::{Error, Result};

/// Progress of the writer: everything up to `durable` is on disk; a write covering up to
/// `failed` failed with `error` (and nothing later has succeeded since).
#[derive(Debug, Clone, Default)]
struct Progress {
    durable: u64,
    failed: u64,
    error: Option<WriteFailure>,
}

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
    /// Latest mutation somebody waits to see on disk; lazy mutations do not raise it.
    wanted: u64,
}

struct Shared {
    path: PathBuf,
    state: Mutex<State>,
    /// Signalled (with `state`) when a mutation somebody waits for is pending.
    wake: Condvar,
    progress: watch::Sender<Progress>,
}

/// Handle to the checkpoint. Cheap to clone.
#[derive(Clone)]
pub struct CheckpointStore {
    shared: Arc<Shared>,
}

/// What [`CheckpointStore::open`] found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened {
    /// No checkpoint existed; starting empty.
    Fresh,
    /// The checkpoint was loaded.
    Loaded {
        /// Whether the node rebooted since it was written (boot IDs differ).
        rebooted: bool,
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
    /// Loads the checkpoint at `path` (or starts empty) and starts the writer thread.
    ///
    /// Must be called inside a Tokio runtime. The boot ID is recorded in every write.
    ///
    /// # Errors
    /// An I/O error other than "not found" while reading the file, the writer thread could
    /// not be started, or the first write of a fresh checkpoint failing (e.g. the directory
    /// is not writable).
    pub async fn open(path: &Path, boot_id: &str) -> Result<(Self, Opened)> {
        let read_path = path.to_owned();
        let outcome = tokio::task::spawn_blocking(move || checkpoint::load(&read_path))
            .await
            .map_err(|e| Error::internal("the checkpoint loader task", e))??;
        let (mut cp, opened) = match outcome {
            LoadOutcome::Missing => (Checkpoint::default(), Opened::Fresh),
            LoadOutcome::Loaded(cp) => {
                let rebooted = cp.boot_id != boot_id;
                (cp, Opened::Loaded { rebooted })
            }
            LoadOutcome::Corrupt { moved_to, reason } => (
                Checkpoint::default(),
                Opened::MovedAside { moved_to, reason },
            ),
        };
        boot_id.clone_into(&mut cp.boot_id);
        let (progress, _) = watch::channel(Progress::default());
        let shared = Arc::new(Shared {
            path: path.to_owned(),
            state: Mutex::new(State {
                checkpoint: cp,
                seq: 0,
                wanted: 0,
            }),
            wake: Condvar::new(),
            progress,
        });
        let writer_shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("kerf-checkpoint".into())
            .spawn(move || writer(&writer_shared))
            .map_err(|e| Error::internal("the checkpoint writer thread", e))?;
        let store = CheckpointStore { shared };
        // Persist once so that the boot ID and any migration are on disk, and so that an
        // unwritable directory is reported at start-up rather than at the first prepare.
        store.update(|_| ()).await?;
        Ok((store, opened))
    }

    /// Reads the in-memory checkpoint.
    pub fn read<T>(&self, f: impl FnOnce(&Checkpoint) -> T) -> T {
        f(&self.lock().checkpoint)
    }

    /// Mutates the checkpoint in memory only: the change reaches the disk with the next write
    /// that someone waits for (or never, if the process stops first). For state whose loss
    /// in a crash is harmless, such as a prepare that has started; waking the writer for it
    /// would put a disk write nobody waits for in front of the ones callers do wait for.
    pub fn mutate_lazily<T>(&self, f: impl FnOnce(&mut Checkpoint) -> T) -> T {
        let mut guard = self.lock();
        let out = f(&mut guard.checkpoint);
        guard.seq += 1;
        out
    }

    /// Mutates the checkpoint in memory, wakes the writer, and returns the sequence number
    /// to pass to [`CheckpointStore::persisted`].
    fn mutate<T>(&self, f: impl FnOnce(&mut Checkpoint) -> T) -> (T, u64) {
        let mut guard = self.lock();
        let out = f(&mut guard.checkpoint);
        guard.seq += 1;
        let seq = guard.seq;
        guard.wanted = seq;
        drop(guard);
        self.shared.wake.notify_one();
        (out, seq)
    }

    /// Mutates the checkpoint and waits until the mutation is durable.
    ///
    /// # Errors
    /// The write that covered this mutation failed.
    pub async fn update<T>(&self, f: impl FnOnce(&mut Checkpoint) -> T) -> Result<T> {
        let (out, seq) = self.mutate(f);
        self.persisted(seq).await?;
        Ok(out)
    }

    /// Waits until every mutation up to `seq` is durable.
    ///
    /// # Errors
    /// The write that covered `seq` failed and no later write has succeeded.
    pub async fn persisted(&self, seq: u64) -> Result<()> {
        let mut rx = self.shared.progress.subscribe();
        let progress = rx
            .wait_for(|p| p.durable >= seq || p.failed >= seq)
            .await
            .map_err(|_| Error::internal("the checkpoint writer", "it has stopped"))?
            .clone();
        if progress.durable >= seq {
            return Ok(());
        }
        let reason = match progress.error {
            Some(WriteFailure::Panicked(detail)) => {
                return Err(Error::internal("the checkpoint write task", detail));
            }
            Some(WriteFailure::Save(reason)) => reason.to_string(),
            None => "unknown error".to_owned(),
        };
        Err(kerf_core::Error::Checkpoint {
            path: self.shared.path.clone(),
            reason,
        }
        .into())
    }

    /// The checkpoint file.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the checkpoint half-mutated in a way
        // that matters more than stopping would: keep serving.
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Persists snapshots whenever mutations are pending; exits when every handle is gone.
fn writer(shared: &Arc<Shared>) {
    let mut written = 0;
    loop {
        let Some((snapshot, seq)) = next_snapshot(shared, written) else {
            return;
        };
        let outcome = match catch_unwind(AssertUnwindSafe(|| {
            checkpoint::save(&shared.path, &snapshot)
        })) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(WriteFailure::Save(e.to_string().into())),
            Err(panic) => Err(WriteFailure::Panicked(panic_message(panic.as_ref()).into())),
        };
        written = seq;
        shared.progress.send_modify(|p| match outcome {
            Ok(()) => {
                p.durable = seq;
                p.error = None;
            }
            Err(failure) => {
                let (WriteFailure::Save(message) | WriteFailure::Panicked(message)) = &failure;
                tracing::error!(path = %shared.path.display(), error = %message, "checkpoint write failed");
                p.failed = seq;
                p.error = Some(failure);
            }
        });
    }
}

/// Waits until a mutation after `written` is wanted on disk and returns a snapshot that
/// includes it; `None` once the writer holds the last reference to the store.
fn next_snapshot(shared: &Arc<Shared>, written: u64) -> Option<(Checkpoint, u64)> {
    let mut guard = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
    while guard.wanted <= written {
        if Arc::strong_count(shared) == 1 {
            return None;
        }
        // Wake up now and then to notice that the store was dropped.
        guard = shared
            .wake
            .wait_timeout(guard, Duration::from_secs(1))
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
    Some((guard.checkpoint.clone(), guard.seq))
}

/// The message of a panic's payload, as the standard library prints it.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "the checkpoint writer panicked".to_owned())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)] // Test helpers may fail loudly.

    use kerf_core::checkpoint::ClaimEntry;

    use super::*;

    fn on_disk(path: &Path) -> Checkpoint {
        match checkpoint::load(path).unwrap() {
            LoadOutcome::Loaded(cp) => cp,
            other => panic!("expected a checkpoint, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_lazy_mutation_reaches_the_disk_with_the_next_awaited_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let (store, opened) = CheckpointStore::open(&path, "boot-1").await.unwrap();
        assert_eq!(opened, Opened::Fresh);
        store.mutate_lazily(|cp| {
            cp.claims.insert("lazy".into(), ClaimEntry::default());
        });
        assert!(store.read(|cp| cp.claims.contains_key("lazy")));
        store
            .update(|cp| {
                cp.claims.insert("awaited".into(), ClaimEntry::default());
            })
            .await
            .unwrap();
        let cp = on_disk(&path);
        assert!(cp.claims.contains_key("lazy") && cp.claims.contains_key("awaited"));
        assert_eq!(cp.boot_id, "boot-1");
    }

    #[tokio::test]
    async fn concurrent_updates_are_all_durable_when_they_return() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let (store, _) = CheckpointStore::open(&path, "boot-1").await.unwrap();
        let updates = (0..32).map(|i| {
            let store = store.clone();
            async move {
                store
                    .update(|cp| {
                        cp.claims
                            .insert(format!("claim-{i}"), ClaimEntry::default());
                    })
                    .await
            }
        });
        for result in futures::future::join_all(updates).await {
            result.unwrap();
        }
        assert_eq!(on_disk(&path).claims.len(), 32);
    }
}
