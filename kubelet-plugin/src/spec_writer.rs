//! The CDI spec files: transient, rebuilt from the checkpoint.
//!
//! Every prepare writes its claim's spec and every unprepare removes one. The spec needs no
//! fsync of its own, because nothing is lost with it: the plugin rewrites every completed
//! claim's spec from the checkpoint at start-up, before its sockets serve
//! ([`crate::preparer::Preparer::restore_cdi_specs`]), an idempotent repeat prepare rewrites
//! it, and `/var/run/cdi` is a tmpfs on most nodes, which a reboot empties anyway. So a
//! spec change is
//! [`kerf_core::fsutil::write_replace`]: a temporary file renamed over the target, so that a
//! container runtime reading the directory at any time sees the old spec or the new one,
//! never half of one. containerd and CRI-O read it through the CDI library's cache, which
//! watches the directory with inotify and rescans it on every write to a `.json` or `.yaml`
//! file and on every rename (cncf-tags/container-device-interface, `pkg/cdi/cache.go`,
//! `watch.watch`): a spec written in place would be read half-written; the temporary file's
//! name ends in neither suffix, so only the rename makes it rescan.
//!
//! Each change runs on its own blocking thread (`spawn_blocking`) rather than through one
//! writer task that groups changes: without fsyncs a change is a few syscalls, and the task's
//! extra hop costs more than grouping saves for the lone prepare (the figures are in
//! docs/performance.md).
//!
//! What the writer task gave for free is kept: changes to one file land in the order they
//! were asked for. A change handed to its thread runs to its end even when its caller is
//! cancelled (the kubelet gave up on an unprepare, and the claim's lock is free again), and
//! it may not have started yet; the next change to the same file, e.g. the rewrite of an
//! idempotent repeat prepare, waits for it instead of racing it and losing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use kerf_core::fsutil;
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use crate::{Error, Result};

/// Writes and removes the spec files of one CDI directory. Cheap to clone.
#[derive(Clone)]
pub(crate) struct SpecWriter {
    inner: Arc<Inner>,
}

struct Inner {
    dir: PathBuf,
    /// One lock per file name with a change in flight or waiting, forgotten when none is.
    files: Mutex<HashMap<String, Arc<AsyncMutex<()>>>>,
}

/// A change's claim on its file name: the lock while it is held, and the clean-up of the
/// name's entry when the last change to it ends (or its caller gave up waiting).
struct Turn {
    inner: Arc<Inner>,
    name: String,
    lock: Option<Arc<AsyncMutex<()>>>,
    held: Option<OwnedMutexGuard<()>>,
}

impl SpecWriter {
    /// The writer of `dir`. Nothing is checked or started here: a missing `dir` fails each
    /// change, and changes need a Tokio runtime.
    pub(crate) fn start(dir: PathBuf) -> Self {
        SpecWriter {
            inner: Arc::new(Inner {
                dir,
                files: Mutex::default(),
            }),
        }
    }

    /// Runs `first` on a blocking thread, then replaces (or creates) `dir/name` with
    /// `contents` atomically, without an fsync (see the module docs for why none is needed).
    /// `first` writes the files the spec mounts, which must exist before the spec that refers
    /// to them, and which so change in the spec's turn and cost no thread hop of their own.
    ///
    /// # Errors
    /// `first` failed, or the temporary file could not be created or written, or not renamed
    /// over the target (e.g. the directory is missing); the spec is then as it was before.
    pub(crate) async fn write_after(
        &self,
        name: String,
        contents: Vec<u8>,
        first: impl FnOnce() -> kerf_core::Result<()> + Send + 'static,
    ) -> Result<()> {
        self.change(name, move |dir, name| {
            first()?;
            fsutil::write_replace(dir, name, &contents)
        })
        .await
    }

    /// Removes `dir/name`, without an fsync (`false` when it did not exist), then runs `then`
    /// on the same blocking thread: for the files the spec mounted, which go once no spec
    /// refers to them.
    ///
    /// # Errors
    /// The removal failed for another reason than the file being absent (`then` did not
    /// run), or `then` failed.
    pub(crate) async fn remove_then(
        &self,
        name: String,
        then: impl FnOnce() -> kerf_core::Result<()> + Send + 'static,
    ) -> Result<bool> {
        self.change(name, move |dir, name| {
            let removed = fsutil::remove_if_exists(dir, name)?;
            then()?;
            Ok(removed)
        })
        .await
    }

    /// Runs `op` on a blocking thread once every earlier change to `name` has ended. The
    /// change runs to its end even if this future is dropped.
    async fn change<T: Send + 'static>(
        &self,
        name: String,
        op: impl FnOnce(&Path, &str) -> kerf_core::Result<T> + Send + 'static,
    ) -> Result<T> {
        let mut turn = Turn::queue(&self.inner, name);
        turn.wait().await;
        tokio::task::spawn_blocking(move || {
            let result = op(&turn.inner.dir, &turn.name);
            drop(turn);
            result
        })
        .await
        .map_err(|e| Error::internal("the CDI spec writer", e))?
        .map_err(Error::from)
    }
}

impl Turn {
    fn queue(inner: &Arc<Inner>, name: String) -> Self {
        let lock = {
            let mut files = inner.files.lock().unwrap_or_else(PoisonError::into_inner);
            Arc::clone(files.entry(name.clone()).or_default())
        };
        Turn {
            inner: Arc::clone(inner),
            name,
            lock: Some(lock),
            held: None,
        }
    }

    async fn wait(&mut self) {
        if let Some(lock) = self.lock.clone() {
            self.held = Some(lock.lock_owned().await);
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        drop(self.held.take());
        drop(self.lock.take());
        let mut files = self
            .inner
            .files
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Only the map still refers to the lock: no change holds it or waits for it. A
        // waiter whose future is dropped later finds the count at one and removes it then.
        if files
            .get(&self.name)
            .is_some_and(|lock| Arc::strong_count(lock) == 1)
        {
            files.remove(&self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Test helpers may fail loudly.

    use super::*;

    fn tracked(writer: &SpecWriter) -> usize {
        writer.inner.files.lock().unwrap().len()
    }

    /// A spec write with no files of its own to write first.
    async fn write(writer: &SpecWriter, name: &str, contents: &[u8]) -> Result<()> {
        writer
            .write_after(name.to_owned(), contents.to_vec(), || Ok(()))
            .await
    }

    /// A spec removal with no files of its own to remove after it.
    async fn remove(writer: &SpecWriter, name: &str) -> Result<bool> {
        writer.remove_then(name.to_owned(), || Ok(())).await
    }

    #[tokio::test]
    async fn concurrent_writes_and_removes_all_land() {
        let dir = tempfile::tempdir().unwrap();
        let writer = SpecWriter::start(dir.path().to_owned());
        let writes = (0..40).map(|i| {
            let w = writer.clone();
            async move { write(&w, &format!("s{i}.json"), format!("{i}").as_bytes()).await }
        });
        for r in futures::future::join_all(writes).await {
            r.unwrap();
        }
        for i in 0..40 {
            let got = std::fs::read_to_string(dir.path().join(format!("s{i}.json"))).unwrap();
            assert_eq!(got, i.to_string());
        }
        let removes = (0..40).map(|i| {
            let w = writer.clone();
            async move { remove(&w, &format!("s{i}.json")).await }
        });
        for r in futures::future::join_all(removes).await {
            assert!(r.unwrap());
        }
        assert!(!remove(&writer, "s0.json").await.unwrap());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        assert_eq!(tracked(&writer), 0, "every name is forgotten once done");
    }

    #[tokio::test]
    async fn a_missing_directory_fails_the_change_and_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let writer = SpecWriter::start(dir.path().join("missing"));
        let (a, b) = tokio::join!(
            write(&writer, "a.json", b"a"),
            write(&writer, "b.json", b"b")
        );
        let message = a.unwrap_err().to_string();
        assert!(message.contains("missing"), "{message}");
        assert!(b.is_err());
        assert_eq!(tracked(&writer), 0);
    }

    /// A removal whose caller gave up after it was handed to a thread still happens, and a
    /// write asked for after it lands after it: the file ends up written, not removed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn changes_to_one_file_land_in_order_even_when_a_caller_gives_up() {
        let dir = tempfile::tempdir().unwrap();
        let writer = SpecWriter::start(dir.path().to_owned());
        write(&writer, "a.json", b"old").await.unwrap();
        let (started, running) = tokio::sync::oneshot::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let (finished, removed) = std::sync::mpsc::channel::<()>();
        let removal = {
            let writer = writer.clone();
            tokio::spawn(async move {
                // A removal slowed down on its thread, as a busy disk would slow it.
                let op = move |dir: &Path, name: &str| {
                    let _ = started.send(());
                    let _ = released.recv();
                    let result = fsutil::remove_if_exists(dir, name);
                    let _ = finished.send(());
                    result
                };
                writer.change("a.json".into(), op).await
            })
        };
        running.await.unwrap();
        removal.abort();
        assert!(removal.await.unwrap_err().is_cancelled());
        let rewrite = {
            let writer = writer.clone();
            tokio::spawn(async move { write(&writer, "a.json", b"new").await })
        };
        // Until the rewrite has queued up behind the removal: the map, the removal's turn
        // (its lock and its guard) and the rewrite's turn (its lock and the wait for it) refer
        // to the file's lock. A writer that did not keep the order would finish the rewrite.
        let queued = || {
            writer
                .inner
                .files
                .lock()
                .unwrap()
                .get("a.json")
                .is_some_and(|lock| Arc::strong_count(lock) >= 5)
        };
        while !rewrite.is_finished() && !queued() {
            tokio::task::yield_now().await;
        }
        release.send(()).unwrap();
        rewrite.await.unwrap().unwrap();
        tokio::task::spawn_blocking(move || removed.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(std::fs::read(dir.path().join("a.json")).unwrap(), b"new");
        // The removal's thread signals before its turn is dropped, and the rewrite may have
        // ended while that turn still held the lock: then the removal's drop forgets the name.
        let forgotten = async {
            while tracked(&writer) != 0 {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), forgotten)
            .await
            .expect("the name is forgotten once both changes ended");
    }
}
