//! Group commit of CDI spec files.
//!
//! Every prepare writes its claim's spec and every unprepare removes one. Done one by one,
//! each costs two fsyncs (the file, then the directory), and disks serialise fsyncs: 64
//! concurrent prepares would queue behind 128 of them. Instead, callers hand their change
//! to one writer task, which takes whatever has queued up while the previous group was on
//! its way to disk and commits it with [`kerf_core::fsutil::commit`]: one flush of the data
//! of all the group's files and one directory fsync. A caller returns when its own change
//! is durable, exactly as with a lone atomic write; a caller with nobody to share with pays
//! what a lone write pays.

use std::path::{Path, PathBuf};

use kerf_core::fsutil::{self, FileChange};
use tokio::sync::{mpsc, oneshot};

use crate::{Error, Result};

/// Most changes committed together; a bound keeps one group's latency bounded when a
/// flood of calls arrives.
const MAX_GROUP: usize = 256;

/// Handle to the writer task of one CDI directory. Cheap to clone; the task ends when the
/// last handle is dropped.
#[derive(Clone)]
pub struct SpecWriter {
    dir: PathBuf,
    jobs: mpsc::UnboundedSender<Job>,
}

struct Job {
    change: Change,
    done: oneshot::Sender<kerf_core::Result<bool>>,
}

enum Change {
    Write { name: String, contents: Vec<u8> },
    Remove { name: String },
}

impl Change {
    fn as_file_change(&self) -> FileChange<'_> {
        match self {
            Change::Write { name, contents } => FileChange::Write { name, contents },
            Change::Remove { name } => FileChange::Remove { name },
        }
    }
}

impl SpecWriter {
    /// Starts the writer task for `dir`. Must be called inside a Tokio runtime.
    pub fn start(dir: PathBuf) -> Self {
        let (jobs, queue) = mpsc::unbounded_channel();
        tokio::spawn(run(dir.clone(), queue));
        SpecWriter { dir, jobs }
    }

    /// The directory this writer commits to.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Replaces (or creates) `dir/name` with `contents`, atomically, and waits until it is
    /// durable.
    ///
    /// # Errors
    /// The write, the flush of its group or the directory fsync failed; the file is then as
    /// it was before.
    pub async fn write(&self, name: String, contents: Vec<u8>) -> Result<()> {
        self.submit(Change::Write { name, contents })
            .await
            .map(|_| ())
    }

    /// Removes `dir/name` durably; `false` when it did not exist.
    ///
    /// # Errors
    /// The removal or the directory fsync failed.
    pub async fn remove(&self, name: String) -> Result<bool> {
        self.submit(Change::Remove { name }).await
    }

    async fn submit(&self, change: Change) -> Result<bool> {
        let (done, outcome) = oneshot::channel();
        self.jobs
            .send(Job { change, done })
            .map_err(|_| stopped(&self.dir))?;
        outcome
            .await
            .map_err(|_| stopped(&self.dir))?
            .map_err(Error::from)
    }
}

/// Commits groups of queued changes until every handle is gone.
async fn run(dir: PathBuf, mut queue: mpsc::UnboundedReceiver<Job>) {
    let mut group = Vec::new();
    while queue.recv_many(&mut group, MAX_GROUP).await > 0 {
        let jobs = std::mem::take(&mut group);
        let dir = dir.clone();
        // A panic in the blocking task drops the jobs, and with them their senders: the
        // callers see the writer as stopped rather than waiting forever.
        let _ = tokio::task::spawn_blocking(move || commit_group(&dir, jobs)).await;
    }
}

fn commit_group(dir: &Path, jobs: Vec<Job>) {
    let changes: Vec<FileChange<'_>> = jobs.iter().map(|j| j.change.as_file_change()).collect();
    let results = fsutil::commit(dir, &changes);
    for (job, result) in jobs.into_iter().zip(results) {
        // The caller may have gone away (its call was cancelled); the change stands.
        let _ = job.done.send(result);
    }
}

fn stopped(dir: &Path) -> Error {
    Error::internal(
        "the CDI spec writer",
        format_args!("it has stopped (directory {})", dir.display()),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Test helpers may fail loudly.

    use super::*;

    #[tokio::test]
    async fn concurrent_writes_and_removes_all_land() {
        let dir = tempfile::tempdir().unwrap();
        let writer = SpecWriter::start(dir.path().to_owned());
        let writes = (0..40).map(|i| {
            let w = writer.clone();
            async move {
                w.write(format!("s{i}.json"), format!("{i}").into_bytes())
                    .await
            }
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
            async move { w.remove(format!("s{i}.json")).await }
        });
        for r in futures::future::join_all(removes).await {
            assert!(r.unwrap());
        }
        assert!(!writer.remove("s0.json".into()).await.unwrap());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn a_missing_directory_fails_every_change_of_the_group() {
        let dir = tempfile::tempdir().unwrap();
        let writer = SpecWriter::start(dir.path().join("missing"));
        let (a, b) = tokio::join!(
            writer.write("a.json".into(), b"a".to_vec()),
            writer.write("b.json".into(), b"b".to_vec())
        );
        let message = a.unwrap_err().to_string();
        assert!(message.contains("missing"), "{message}");
        assert!(b.is_err());
    }
}
